"""Resource allocator for one MetaLevel (paper section 3.3, Appendix B; summary 2.3).

Continuous optimum (Theorem 1): every MetaOp m of the level runs on n_m* devices from 0 to the common end
C~*, with T_m(n_m*) * L_m = C~* and sum_m n_m* = N. ``bisect_level`` finds C~* by bisection (Alg. 2) and
``inverse_time`` is the T^-1 it evaluates. ``discretise`` replaces each real n_m* by two valid allocations
(the bi-point plan, eqs. 10a/10b) with integer layer counts; ``allocate_level`` chains the two.

Curves are duck-typed (the estimator's ``ScalingCurve`` is one): ``valid_ns`` (sorted device counts),
``time(n)`` (seconds per operator at a valid n) and ``config(n) -> (tp, dp)``. This module reads only
``valid_ns`` and ``time``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from megatron_spindle.planner.schedule import LevelAllocation

if TYPE_CHECKING:
    from megatron_spindle.graph.opgraph import MetaOp

INVERSE_MODES = ("rate", "time")


class AllocationError(ValueError):
    """Input the allocator cannot work with: a malformed curve, a bad layer count, an unknown mode."""


class Curve(Protocol):
    """What the allocator and the wavefront scheduler need from a scaling curve."""

    valid_ns: list[int]

    def time(self, n: int) -> float: ...

    def config(self, n: int) -> tuple[int, int]: ...


# ------------------------------------------------------------------------------------ curve helpers


def efficient_points(curve: Curve, max_n: int | None = None, name: str = "curve") -> list[tuple[int, float]]:
    """(n, T(n)) for the valid n (<= max_n) that are strictly faster than every smaller valid n.

    A valid n that is not faster than a smaller one is never worth its extra devices; dropping it makes
    T strictly decreasing on what is left, so T^-1 is well defined and monotone.
    """
    ns = list(curve.valid_ns)
    if not ns:
        raise AllocationError(f"{name}: no valid device counts")
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in ns):
        raise AllocationError(f"{name}: valid device counts must be positive integers, got {ns}")
    if any(a >= b for a, b in zip(ns, ns[1:])):
        raise AllocationError(f"{name}: valid device counts must be strictly increasing, got {ns}")
    if max_n is not None:
        if ns[0] > max_n:
            raise AllocationError(f"{name}: smallest valid device count {ns[0]} exceeds the {max_n} devices")
        ns = [n for n in ns if n <= max_n]
    points: list[tuple[int, float]] = []
    for n in ns:
        t = float(curve.time(n))
        if not math.isfinite(t) or t <= 0.0:
            raise AllocationError(f"{name}: time({n}) = {t!r} is not a positive finite number of seconds")
        if not points or t < points[-1][1]:
            points.append((n, t))
    return points


def _check_mode(mode: str) -> None:
    if mode not in INVERSE_MODES:
        raise AllocationError(f"unknown inverse mode '{mode}'; expected one of {INVERSE_MODES}")


def _bracket(points: list[tuple[int, float]], target: float) -> int:
    """Index i with T(n_i) > target >= T(n_{i+1}); caller guarantees T(n_0) > target >= T(n_last)."""
    lo, hi = 0, len(points) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if points[mid][1] > target:
            lo = mid
        else:
            hi = mid
    return lo


def _inverse_on_points(points: list[tuple[int, float]], target: float, mode: str) -> float:
    n_min, t_min_n = points[0]
    if target >= t_min_n:
        # Sub-allocation share: n_min devices busy a fraction T(n_min)/target of the time (T(1)/target
        # when 1 is valid). It is the rate-linear segment from the dummy allocation (0 devices, rate 0).
        return n_min * t_min_n / target
    n_max, t_max_n = points[-1]
    if target <= t_max_n:
        return float(n_max)  # cannot go faster than the largest valid allocation
    i = _bracket(points, target)
    (n_lo, t_lo), (n_hi, t_hi) = points[i], points[i + 1]
    if t_lo - t_hi <= 1e-9 * t_lo:  # a flat stretch (equal up to rounding, e.g. at the launch floor): fewer devices
        return float(n_lo)
    if mode == "rate":
        weight = (1.0 / target - 1.0 / t_lo) / (1.0 / t_hi - 1.0 / t_lo)
        return n_lo + weight * (n_hi - n_lo)
    # Paper eq. 11: linear in T between the two valid allocations.
    return ((target - t_lo) * n_hi + (t_hi - target) * n_lo) / (t_hi - t_lo)


def inverse_time(curve: Curve, target: float, mode: str = "rate", max_n: int | None = None) -> float:
    """T^-1(target): the (real) number of devices at which one operator takes ``target`` seconds.

    Between the nearest valid n_lo < n < n_hi with T(n_lo) > target >= T(n_hi) the curve is interpolated:

    - ``"rate"`` (default): linear in the rate 1/T. This is the consistent form: running l_hi layers on
      n_hi and l_lo on n_lo (eqs. 10a/10b) uses on average exactly (n_hi t_hi + n_lo t_lo) / C~ devices,
      and that time-weighted average is the rate-linear n. So sum_m n_m* = N (what the bisection
      enforces) means the bi-point plan keeps exactly N devices busy on average.
    - ``"time"``: linear in T (the paper's eq. 11). The same bi-point plan then uses fewer devices than
      sum n* claims (in Fig. 5a, 4.25 "devices" for a 4-device plan), so the level ends later than C~*.

    ``target >= T(n_min)`` (n_min the smallest valid n, usually 1) returns n_min T(n_min) / target, i.e.
    T(1)/target: a share of a device (the dummy allocation). ``target <= T(n_max)`` returns n_max: more
    devices cannot make it faster. ``max_n`` caps the valid counts (the level's N). Valid n that are not
    faster than a smaller valid n are ignored (see ``efficient_points``).
    """
    _check_mode(mode)
    if not math.isfinite(target) or target <= 0.0:
        raise AllocationError(f"inverse_time: target time {target!r} is not a positive finite number")
    return _inverse_on_points(efficient_points(curve, max_n), target, mode)


# ------------------------------------------------------------------------------------ bisection (Alg. 2)


def _check_level_inputs(metaop_ids: Sequence[str], num_layers: Mapping[str, int], curves: Mapping[str, Curve],
                        num_devices: int) -> None:
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise AllocationError(f"num_devices must be a positive integer, got {num_devices!r}")
    if not metaop_ids:
        raise AllocationError("a MetaLevel needs at least one MetaOp")
    if len(set(metaop_ids)) != len(metaop_ids):
        raise AllocationError(f"MetaOp ids repeat in the level: {list(metaop_ids)}")
    for m in metaop_ids:
        if m not in curves:
            raise AllocationError(f"MetaOp '{m}' has no scaling curve")
        if m not in num_layers:
            raise AllocationError(f"MetaOp '{m}' has no layer count")
        L = num_layers[m]
        if isinstance(L, bool) or not isinstance(L, int) or L < 1:
            raise AllocationError(f"MetaOp '{m}': layer count must be a positive integer, got {L!r}")


def _total_devices(points: Mapping[str, list[tuple[int, float]]], num_layers: Mapping[str, int], c: float,
                   mode: str) -> float:
    return sum(_inverse_on_points(p, c / num_layers[m], mode) for m, p in points.items())


def _piece_coefficients(points: list[tuple[int, float]], L: int, c: float,
                        mode: str) -> tuple[float, float, float]:
    """(a, b, d) with T^-1(C/L) = a + b/C + d*C for C near ``c`` (inside one piece of the curve)."""
    target = c / L
    n_min, t_n_min = points[0]
    if target >= t_n_min:
        return 0.0, n_min * t_n_min * L, 0.0
    if target <= points[-1][1]:
        return float(points[-1][0]), 0.0, 0.0
    i = _bracket(points, target)
    (n_lo, t_lo), (n_hi, t_hi) = points[i], points[i + 1]
    if t_lo - t_hi <= 1e-9 * t_lo:  # a flat stretch (see _inverse_on_points): a constant piece
        return float(n_lo), 0.0, 0.0
    if mode == "rate":
        k = (n_hi - n_lo) / (1.0 / t_hi - 1.0 / t_lo)
        return n_lo - k / t_lo, k * L, 0.0
    return (t_hi * n_lo - t_lo * n_hi) / (t_hi - t_lo), 0.0, (n_hi - n_lo) / (L * (t_hi - t_lo))


def _solve_on_piece(points: Mapping[str, list[tuple[int, float]]], num_layers: Mapping[str, int],
                    c_left: float, c_right: float, num_devices: int, mode: str) -> float | None:
    """The C in [c_left, c_right] with sum n(C) = N, given that no curve changes piece strictly inside.

    Inside one piece each n_m(C) is a + b/C + d*C (rate mode: d = 0), so the equation is at most quadratic.
    """
    mid = 0.5 * (c_left + c_right)
    a = b = d = 0.0
    for m, p in points.items():
        pa, pb, pd = _piece_coefficients(p, num_layers[m], mid, mode)
        a, b, d = a + pa, b + pb, d + pd
    # d*C^2 + (a - N)*C + b = 0
    if d == 0.0:
        roots = [b / (num_devices - a)] if a < num_devices else []
    else:
        disc = (a - num_devices) ** 2 - 4.0 * d * b
        sqrt_disc = math.sqrt(max(disc, 0.0))
        roots = [] if disc < 0.0 else [(num_devices - a + s * sqrt_disc) / (2.0 * d) for s in (1.0, -1.0)]
    slack = 1e-9 * (c_right - c_left)
    inside = [min(max(r, c_left), c_right) for r in roots if c_left - slack <= r <= c_right + slack]
    return inside[0] if inside else None


def _solve_exact(points: Mapping[str, list[tuple[int, float]]], num_layers: Mapping[str, int], c_low: float,
                 c_high: float, num_devices: int, mode: str) -> float:
    """Refine the bisection bracket to the exact C~*: sum n(C~*) = N up to rounding.

    The breakpoints C = T_m(n) L_m inside the bracket cut it into pieces where every n_m(C) is smooth;
    the sum (non-increasing in C) crosses N in one of them, and there it is solved in closed form.
    Bisection alone leaves C~* up to rel_eps too high, which would report a schedule that meets C~*
    exactly as beating it.
    """
    breakpoints = {t * num_layers[m] for m, p in points.items() for _, t in p}
    cuts = sorted(c for c in breakpoints if c_low < c < c_high)
    edges = [c_low, *cuts, c_high]
    for left, right in zip(edges, edges[1:]):
        if _total_devices(points, num_layers, right, mode) <= num_devices:
            root = _solve_on_piece(points, num_layers, left, right, num_devices, mode)
            return right if root is None else root
    return c_high


def bisect_level(metaop_ids: Sequence[str], num_layers: Mapping[str, int], curves: Mapping[str, Curve],
                 num_devices: int, mode: str = "rate",
                 rel_eps: float = 1e-6) -> tuple[float, dict[str, float]]:
    """Alg. 2: bisection on C~ until sum_m T_m^-1(C~ / L_m) = N. Returns (C~*, {m: n_m*}).

    Bounds: C_low = max_m T_m(N) L_m (T_m at its largest valid n <= N: no MetaOp can finish sooner) and
    C_high = sum_m T_m(1) L_m (everything in sequence on one device). The bracket is halved until its
    width is at most ``rel_eps`` * C_high, then solved exactly inside it (``_solve_exact``).

    sum n* = N up to rounding, except when C~* = C_low: the slowest MetaOp at its largest valid
    allocation bounds the level and the others leave devices over (sum n* < N). With concave rate curves
    (diminishing returns), C~* is a lower bound on the makespan of any schedule of the level.
    """
    _check_mode(mode)
    if not (math.isfinite(rel_eps) and 0.0 < rel_eps < 1.0):
        raise AllocationError(f"rel_eps must be in (0, 1), got {rel_eps!r}")
    _check_level_inputs(metaop_ids, num_layers, curves, num_devices)
    points = {m: efficient_points(curves[m], num_devices, name=f"MetaOp '{m}'") for m in metaop_ids}
    c_low = max(p[-1][1] * num_layers[m] for m, p in points.items())
    c_high = sum(p[0][0] * p[0][1] * num_layers[m] for m, p in points.items())
    c_high = max(c_high, c_low)
    if _total_devices(points, num_layers, c_low, mode) <= num_devices:
        c_star = c_low  # even the fastest finish of the slowest MetaOp leaves devices over
    else:
        while c_high - c_low > rel_eps * c_high:
            c_mid = 0.5 * (c_low + c_high)
            if c_mid <= c_low or c_mid >= c_high:
                break  # floating-point resolution reached
            if _total_devices(points, num_layers, c_mid, mode) < num_devices:
                c_high = c_mid  # devices left over: the level can finish sooner
            else:
                c_low = c_mid
        c_star = _solve_exact(points, num_layers, c_low, c_high, num_devices, mode)
    n_star = {m: _inverse_on_points(p, c_star / num_layers[m], mode) for m, p in points.items()}
    return c_star, n_star


# ------------------------------------------------------------------------------------ bi-point discretisation


def _check_split_inputs(metaop_id: str, L: int, n_star: float, c_star: float) -> None:
    if isinstance(L, bool) or not isinstance(L, int) or L < 1:
        raise AllocationError(f"MetaOp '{metaop_id}': layer count must be a positive integer, got {L!r}")
    if not math.isfinite(n_star) or n_star <= 0.0:
        raise AllocationError(f"MetaOp '{metaop_id}': n* = {n_star!r} is not a positive finite device count")
    if not math.isfinite(c_star) or c_star <= 0.0:
        raise AllocationError(f"MetaOp '{metaop_id}': C~* = {c_star!r} is not a positive finite time")


def bipoint_split(metaop_id: str, L: int, n_star: float, c_star: float, curve: Curve,
                  max_n: int | None = None) -> list[tuple[int, float]]:
    """The real-valued bi-point plan [(n_hi, l_hi), (n_lo, l_lo)] of eqs. 10a/10b, before rounding.

    n_lo <= n* <= n_hi are the nearest valid allocations; n_lo = 0 is the dummy allocation (n* below the
    smallest valid n), which keeps all L layers on n_hi. n* on a valid point gives [(n*, L)]. The real
    l_hi is clipped to [0, L] so a C~* slightly off the bracket (rounding) never yields negative layers.
    """
    _check_split_inputs(metaop_id, L, n_star, c_star)
    points = efficient_points(curve, max_n, name=f"MetaOp '{metaop_id}'")
    snap = 1e-9 * max(1.0, n_star)
    for n, _ in points:
        if abs(n - n_star) <= snap:
            return [(n, float(L))]
    if n_star < points[0][0]:
        return [(points[0][0], float(L)), (0, 0.0)]
    if n_star > points[-1][0]:
        return [(points[-1][0], float(L))]
    i = max(k for k, (n, _) in enumerate(points) if n < n_star)
    (n_lo, t_lo), (n_hi, t_hi) = points[i], points[i + 1]
    # 10a: L = l_hi + l_lo;  10b: C~* = t_hi l_hi + t_lo l_lo  =>  l_hi = (t_lo L - C~*) / (t_lo - t_hi)
    l_hi = min(float(L), max(0.0, (t_lo * L - c_star) / (t_lo - t_hi)))
    return [(n_hi, l_hi), (n_lo, L - l_hi)]


def discretise(metaop_id: str, L: int, n_star: float, c_star: float, curve: Curve,
               max_n: int | None = None) -> list[tuple[int, int]]:
    """The rounded bi-point tuples [(n, l), ...], larger n first, every l >= 1, sum l == L exactly.

    l_hi is rounded to the nearest integer (halves up, towards the faster tuple) and l_lo = L - l_hi, so
    (10a) stays exact; (10b) is biased a little. Tuples with l = 0 and the dummy (n = 0) are dropped.
    """
    split = bipoint_split(metaop_id, L, n_star, c_star, curve, max_n)
    (n_hi, l_hi_real), rest = split[0], split[1:]
    l_hi = min(L, max(0, math.floor(l_hi_real + 0.5)))
    tuples = [(n_hi, l_hi)]
    if rest:
        n_lo = rest[0][0]
        tuples.append((n_lo, L - l_hi))
    return [(n, layers) for n, layers in tuples if n > 0 and layers > 0]


# ------------------------------------------------------------------------------------ one MetaLevel


def allocate_level(level_index: int, metaops: Sequence[MetaOp], curves: Mapping[str, Curve], num_devices: int,
                   mode: str = "rate", rel_eps: float = 1e-6) -> LevelAllocation:
    """Bisection then bi-point discretisation for the MetaOps of one MetaLevel."""
    ids = [m.id for m in metaops]
    layers = {m.id: m.num_layers for m in metaops}
    c_star, n_star = bisect_level(ids, layers, curves, num_devices, mode=mode, rel_eps=rel_eps)
    tuples = {m: discretise(m, layers[m], n_star[m], c_star, curves[m], max_n=num_devices) for m in ids}
    return LevelAllocation(level=level_index, c_star=c_star, n_star=n_star, tuples=tuples)
