"""Scaling curves T_m(n): per-operator seconds of a MetaOp on n devices (paper section 3.2 and Appendix A).

A curve holds the fastest known (tp, dp) and its time at each valid n (profiled or analytic points) and a
piecewise alpha-beta fit of the paper

    T(n) = a_i + b_i * c(n) + b'_i * w / n        for n in piece i,

where w is the work split over the devices (FLOPs of one operator) and c(n) the per-device cost of the ring
all-reduce of the operator's gradients (c: gradient bytes) in bytes: c * 2(n-1)/n sent, plus 2(n-1) hops of
latency counted as the bytes a link carries meanwhile (``hop_bytes`` = latency x bandwidth). c(n) depends on
n, which keeps b_i apart from the constant a_i, and its hop term lets small ops get slower with more ranks, as
latency-bound collectives do. Each piece is a least-squares fit of relative residuals (times span orders
of magnitude, and fit_error is relative too) with non-negative coefficients, so the fit never predicts negative
or shrinking-overhead times.

Breakpoints: the kernels a MetaOp runs and the links its collectives use change with n, so the coefficients
differ by piece. We always split at the node size (collectives leave NVLink for the network there), then at
powers of two nearest the middle of a piece while both sides keep at least ``min_points_per_piece`` points
(3 = the number of coefficients). A piece with fewer points fits only as many coefficients as it has points.

``time(n)`` is exact at the points and the fit elsewhere. It is NOT forced to be non-increasing: at a valid n
the time must match ``config(n)``, whose tp * dp is n (the plan validator checks that), and data can make a
larger n slower (e.g. the first inter-node all-reduce). ``monotone()`` returns the curve restricted to the n
that beat every smaller n: the allocator uses it when it needs a non-increasing T (Theorem 1), and a MetaOp
offered more devices simply takes the largest useful n below.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from megatron_spindle.estimator.errors import EstimatorError

CURVE_SOURCES = ("analytic", "profiled")


@dataclass(frozen=True)
class CurvePoint:
    """Time of one operator of a MetaOp on n = tp * dp devices, forward + backward."""

    n: int
    tp: int
    dp: int
    seconds: float
    source: str = "analytic"

    def __post_init__(self):
        for what in ("n", "tp", "dp"):
            value = getattr(self, what)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise EstimatorError(f"curve point: {what} must be a positive integer, got {value!r}")
        if self.tp * self.dp != self.n:
            raise EstimatorError(f"curve point: tp {self.tp} x dp {self.dp} != n {self.n}")
        if not isinstance(self.seconds, (int, float)) or not math.isfinite(self.seconds) or self.seconds <= 0:
            raise EstimatorError(
                f"curve point at n={self.n}: seconds must be a positive finite number, got {self.seconds!r}"
            )
        if self.source not in CURVE_SOURCES:
            raise EstimatorError(
                f"curve point at n={self.n}: source must be one of {CURVE_SOURCES}, got {self.source!r}"
            )


@dataclass(frozen=True)
class CurvePiece:
    """T(n) = alpha + beta * c(n) + beta_prime * w / n for lo <= n <= hi (lo, hi: its first and last points)."""

    lo: int
    hi: int
    alpha: float
    beta: float
    beta_prime: float

    def predict(self, n: float, c: float, w: float, hop_bytes: float = 0.0) -> float:
        return self.alpha + self.beta * _allreduce_volume(c, n, hop_bytes) + self.beta_prime * w / n


def _allreduce_volume(c: float, n: float, hop_bytes: float) -> float:
    """Byte-equivalent cost of an all-reduce of c bytes over n ranks: 2(n-1)/n * c sent per device plus one
    collective's latency, hop_bytes (0 on one device): the cost model charges a latency per collective."""
    return (c * 2 * (n - 1) / n + hop_bytes) if n > 1 else 0.0


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def choose_breakpoints(ns: list[int], node_size: int | None, min_points_per_piece: int = 3) -> list[int]:
    """Last n of every piece but the final one. ``ns`` sorted ascending; pieces are (previous break, break]."""

    def split(segment: list[int], at_node: bool) -> list[int]:
        def fits(b: int) -> bool:
            left = sum(1 for n in segment if n <= b)
            return left >= min_points_per_piece and len(segment) - left >= min_points_per_piece

        def recurse(b: int) -> list[int]:
            left = [n for n in segment if n <= b]
            right = [n for n in segment if n > b]
            return split(left, False) + [b] + split(right, False)

        if at_node and node_size is not None:
            # The regime change at the node boundary is physical (NVLink -> network), so split there even when
            # a side has few points; such a piece just fits fewer coefficients.
            inside = [n for n in segment if n <= node_size]
            if 0 < len(inside) < len(segment):
                return recurse(inside[-1])
        candidates = [n for n in segment[:-1] if _is_power_of_two(n) and fits(n)]
        if not candidates:
            return []
        middle = (len(segment) - 1) / 2
        return recurse(min(candidates, key=lambda b: (abs(segment.index(b) - middle), b)))

    return split(sorted(ns), True)


def _fit_piece(
    ns: list[int], seconds: list[float], c: float, w: float, hop_bytes: float
) -> tuple[float, float, float]:
    """Non-negative least squares of relative residuals for (alpha, beta, beta_prime).

    With at most three coefficients we solve the unconstrained problem on every subset of columns and keep the
    best non-negative solution (the exact NNLS optimum lies on one of them).
    """
    columns = [np.ones(len(ns))]
    names = ["alpha"]
    if c > 0 or hop_bytes > 0:
        columns.append(np.array([_allreduce_volume(c, n, hop_bytes) for n in ns]))
        names.append("beta")
    if w > 0:
        columns.append(np.array([w / n for n in ns]))
        names.append("beta_prime")
    target = np.array(seconds, dtype=float)
    weights = 1.0 / target  # relative residuals
    best: tuple[float, dict[str, float]] | None = None
    for size in range(1, min(len(columns), len(ns)) + 1):
        for subset in itertools.combinations(range(len(columns)), size):
            matrix = np.stack([columns[j] for j in subset], axis=1)
            scale = np.abs(matrix).max(axis=0)
            scale[scale == 0] = 1.0
            solution, *_ = np.linalg.lstsq((matrix / scale) * weights[:, None], target * weights, rcond=None)
            coefs = solution / scale
            if np.any(coefs < 0):
                continue
            residual = float(np.sum(((matrix @ coefs - target) * weights) ** 2))
            if best is None or residual < best[0] * (1 - 1e-12):
                best = (residual, {names[j]: float(coefs[k]) for k, j in enumerate(subset)})
    assert best is not None  # a single positive constant is always a non-negative solution
    coefs = best[1]
    return coefs.get("alpha", 0.0), coefs.get("beta", 0.0), coefs.get("beta_prime", 0.0)


@dataclass
class ScalingCurve:
    """T_m(n) of one MetaOp. Build with ``from_points`` or ``from_table``; ``points`` are keyed by n."""

    metaop: str
    points: dict[int, CurvePoint]
    source: str = "analytic"
    c: float = 0.0  # bytes one operator exchanges across DP ranks: its gradients (the paper's c_m)
    w: float = 1.0  # FLOPs of one operator (the paper's w_m)
    hop_bytes: float = 0.0  # latency x bandwidth of one collective hop, in bytes (see the module docstring)
    node_size: int | None = None
    min_points_per_piece: int = 3
    pieces: list[CurvePiece] = field(init=False)
    fit_error: float = field(init=False)

    def __post_init__(self):
        if not self.points:
            raise EstimatorError(f"scaling curve of '{self.metaop}': no points")
        if self.source not in CURVE_SOURCES:
            raise EstimatorError(f"scaling curve of '{self.metaop}': source must be one of {CURVE_SOURCES}")
        if self.c < 0 or self.w < 0 or self.hop_bytes < 0:
            raise EstimatorError(f"scaling curve of '{self.metaop}': c, w and hop_bytes must be >= 0")
        if self.min_points_per_piece < 1:
            raise EstimatorError(f"scaling curve of '{self.metaop}': min_points_per_piece must be >= 1")
        for n, point in self.points.items():
            if point.n != n:
                raise EstimatorError(
                    f"scaling curve of '{self.metaop}': point for n={point.n} stored under n={n}"
                )
        self.points = dict(sorted(self.points.items()))
        self.pieces = self._fit()
        self.fit_error = max(abs(self.fitted(n) - p.seconds) / p.seconds for n, p in self.points.items())

    # ---------------------------------------------------------------------------------------- building

    @classmethod
    def from_points(
        cls,
        metaop_id: str,
        points: list[CurvePoint],
        c: float = 0.0,
        w: float = 1.0,
        hop_bytes: float = 0.0,
        source: str = "analytic",
        node_size: int | None = None,
        min_points_per_piece: int = 3,
    ) -> ScalingCurve:
        """Keep the fastest config per n (ties: smaller tp, fewer all-reduces) and fit."""
        fastest: dict[int, CurvePoint] = {}
        for p in points:
            if not isinstance(p, CurvePoint):
                raise EstimatorError(
                    f"scaling curve of '{metaop_id}': expected CurvePoint, got {type(p).__name__}"
                )
            best = fastest.get(p.n)
            if best is None or (p.seconds, p.tp) < (best.seconds, best.tp):
                fastest[p.n] = p
        return cls(metaop_id, fastest, source, c, w, hop_bytes, node_size, min_points_per_piece)

    @classmethod
    def from_table(cls, metaop_id: str, table: dict[int, float], **kwargs) -> ScalingCurve:
        """A curve from {n: seconds} with pure data parallelism (tp = 1, dp = n): tests, hand-made examples."""
        return cls.from_points(metaop_id, [CurvePoint(n, 1, n, s) for n, s in table.items()], **kwargs)

    def _fit(self) -> list[CurvePiece]:
        ns = list(self.points)
        breaks = choose_breakpoints(ns, self.node_size, self.min_points_per_piece) + [ns[-1]]
        pieces, lo_bound = [], 0
        for hi in breaks:
            piece_ns = [n for n in ns if lo_bound < n <= hi]
            seconds = [self.points[n].seconds for n in piece_ns]
            alpha, beta, beta_prime = _fit_piece(piece_ns, seconds, self.c, self.w, self.hop_bytes)
            pieces.append(CurvePiece(piece_ns[0], hi, alpha, beta, beta_prime))
            lo_bound = hi
        return pieces

    # --------------------------------------------------------------------------------------- evaluation

    @property
    def valid_ns(self) -> list[int]:
        return list(self.points)

    def _piece_for(self, n: float) -> CurvePiece:
        for piece in self.pieces:
            if n <= piece.hi:
                return piece
        return self.pieces[-1]

    def fitted(self, n: float) -> float:
        """The piecewise alpha-beta model at n (also at the points, where ``time`` is exact instead)."""
        if n <= 0:
            raise EstimatorError(f"scaling curve of '{self.metaop}': n must be positive, got {n}")
        return self._piece_for(n).predict(n, self.c, self.w, self.hop_bytes)

    def time(self, n: float) -> float:
        """Per-operator seconds on n devices: the point at a valid n, the fit between points. Below the first
        point the first piece is extrapolated (never faster than the first point); above the last point the
        last point's time (extra devices would idle)."""
        if n <= 0:
            raise EstimatorError(f"scaling curve of '{self.metaop}': n must be positive, got {n}")
        if n in self.points:
            return self.points[n].seconds
        first, last = self.valid_ns[0], self.valid_ns[-1]
        if n > last:
            return self.points[last].seconds
        if n < first:
            return max(self.fitted(n), self.points[first].seconds)
        return self.fitted(n)

    def config(self, n: int) -> tuple[int, int]:
        """(tp, dp) of the fastest known config at a valid n."""
        point = self.points.get(n)
        if point is None:
            raise EstimatorError(
                f"MetaOp '{self.metaop}': n={n} is not a valid device count (valid: {self.valid_ns})"
            )
        return point.tp, point.dp

    def speedup(self, n: float) -> float:
        """The paper's scalability T(n0) / T(n), n0 the smallest valid n (usually 1)."""
        return self.points[self.valid_ns[0]].seconds / self.time(n)

    @property
    def is_monotone(self) -> bool:
        times = [p.seconds for p in self.points.values()]
        return all(b <= a for a, b in zip(times, times[1:]))

    def monotone(self) -> ScalingCurve:
        """The curve on the n that are strictly faster than every smaller n (non-increasing time)."""
        kept, best = {}, math.inf
        for n, point in self.points.items():
            if point.seconds < best:
                kept[n], best = point, point.seconds
        return self._with_points(kept)

    def _with_points(self, points: dict[int, CurvePoint]) -> ScalingCurve:
        return ScalingCurve(self.metaop, points, self.source, self.c, self.w, self.hop_bytes, self.node_size,
                            self.min_points_per_piece)
