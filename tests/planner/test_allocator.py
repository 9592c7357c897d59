"""Resource allocator: T^-1, Alg. 2 bisection, bi-point discretisation (paper 3.3 / App. B, summary 2.3)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_spindle.estimator.curve import ScalingCurve
from megatron_spindle.graph.opgraph import MetaOp
from megatron_spindle.planner.allocator import (
    AllocationError,
    allocate_level,
    bipoint_split,
    bisect_level,
    discretise,
    inverse_time,
)


@dataclass
class RawCurve:
    """A bare duck-typed curve that skips ScalingCurve's own checks: for malformed-curve tests only."""

    metaop: str
    table: dict[int, float]

    @property
    def valid_ns(self) -> list[int]:
        return sorted(self.table)

    def time(self, n: int) -> float:
        return self.table[n]

    def config(self, n: int) -> tuple[int, int]:
        return 1, n


def make_metaop(metaop_id: str, num_layers: int, level: int = 0) -> MetaOp:
    ops = [f"{metaop_id}.layer{i}" for i in range(num_layers)]
    return MetaOp(id=metaop_id, type="layer", input_shape=(8, 16, 32), ops=ops,
                  params=[(f"{metaop_id}.layers.{i}",) for i in range(num_layers)], task="t", module="m",
                  kind="layer", layer_offset=0, level=level)


@st.composite
def concave_curves(draw, metaop_id: str = "m", max_n: int = 16) -> ScalingCurve:
    """Strictly decreasing T whose rate 1/T is concave in n (diminishing returns), valid n including 1."""
    extra = draw(st.lists(st.integers(2, max_n), max_size=5, unique=True))
    ns = sorted({1, *extra})
    t1 = draw(st.floats(0.05, 10.0))
    slope = 1.0 / t1  # rate gained per device from 0 to 1 device
    rate, table, prev_n = 1.0 / t1, {1: t1}, 1
    for n in ns[1:]:
        slope *= draw(st.floats(0.05, 1.0))
        rate += (n - prev_n) * slope
        table[n], prev_n = 1.0 / rate, n
    return ScalingCurve.from_table(metaop_id, table)


# ------------------------------------------------------------------------------------ paper Fig. 5a

# Fig. 5a (N = 4, time unit C~* = 1): bi-point tuples and the rounded tuples' times give per-layer times.
#   MetaOp 1 (L=8):  C~* = 7.6 T(2) + 0.4 T(1);  rounded (8 x 2 devices) takes 0.96 C~*  =>  8 T(2) = 0.96
#                    => T(2) = 0.12, T(1) = (1 - 7.6 * 0.12) / 0.4 = 0.22
#   MetaOp 2 (L=12): 8.4 T(2) + 3.6 T(1) = 1;  rounded 8 T(2) + 4 T(1) = 1.02
#                    => T(2) = 0.082 / 1.2 = 0.41/6 (0.0683), T(1) = (1.02 - 8 T(2)) / 4 = 0.71/6 (0.1183)
#   MetaOp 3 (L=6):  (6 x 1 device) takes 0.6 C~*  =>  T(1) = 0.1; T(2) is not in the figure (n* < 1):
#                    0.06 stands for a light op that scales poorly.
FIG5A_N = 4
FIG5A_LAYERS = {"m1": 8, "m2": 12, "m3": 6}
FIG5A_TIMES = {"m1": {1: 0.22, 2: 0.12}, "m2": {1: 0.71 / 6, 2: 0.41 / 6}, "m3": {1: 0.1, 2: 0.06}}


def fig5a_curves() -> dict[str, ScalingCurve]:
    return {m: ScalingCurve.from_table(m, t) for m, t in FIG5A_TIMES.items()}


def test_fig5a_rate_mode_matches_the_figure():
    curves = fig5a_curves()
    c_star, n_star = bisect_level(list(curves), FIG5A_LAYERS, curves, FIG5A_N)
    assert sum(n_star.values()) == pytest.approx(FIG5A_N, rel=1e-9)
    for m, expected in {"m1": 1.9, "m2": 1.5, "m3": 0.6}.items():
        assert n_star[m] == pytest.approx(expected, abs=0.1)
    splits = {m: bipoint_split(m, FIG5A_LAYERS[m], n_star[m], c_star, curves[m]) for m in curves}
    figure = {"m1": [(2, 7.6), (1, 0.4)], "m2": [(2, 8.4), (1, 3.6)], "m3": [(1, 6.0), (0, 0.0)]}
    for m, tuples in figure.items():
        assert [n for n, _ in splits[m]] == [n for n, _ in tuples]
        for (_, got), (_, want) in zip(splits[m], tuples):
            assert got == pytest.approx(want, abs=0.5)
    # The real bi-point plans of MetaOps 1 and 2 end exactly at C~* (eq. 10b); MetaOp 3's dummy ends early.
    spans = {m: sum(curves[m].time(n) * count for n, count in split if n > 0) for m, split in splits.items()}
    assert spans["m1"] == pytest.approx(c_star, rel=1e-9)
    assert spans["m2"] == pytest.approx(c_star, rel=1e-9)
    assert spans["m3"] == pytest.approx(6 * 0.1) and spans["m3"] < c_star


def test_fig5a_time_mode_is_eq11_and_differs():
    curves = fig5a_curves()
    # At the figure's C~* = 1: eq. 11 (linear in T) gives 1.95 and 1.70, i.e. 4.25 "devices" on 4;
    # rate-linear gives 1/(1/8) between rates 1/0.22 and 1/0.12, and likewise for MetaOp 2.
    per_layer = {m: 1.0 / FIG5A_LAYERS[m] for m in curves}
    time_n = {m: inverse_time(curves[m], per_layer[m], mode="time") for m in curves}
    assert time_n["m1"] == pytest.approx(1.95)
    assert time_n["m2"] == pytest.approx(1.70)
    assert time_n["m3"] == pytest.approx(0.6)
    assert sum(time_n.values()) == pytest.approx(4.25)
    rate_m1 = 1 + (8 - 1 / 0.22) / (1 / 0.12 - 1 / 0.22)
    assert inverse_time(curves["m1"], per_layer["m1"], mode="rate") == pytest.approx(rate_m1)

    c_rate, _ = bisect_level(list(curves), FIG5A_LAYERS, curves, FIG5A_N, mode="rate")
    c_time, n_time = bisect_level(list(curves), FIG5A_LAYERS, curves, FIG5A_N, mode="time")
    assert sum(n_time.values()) == pytest.approx(FIG5A_N, rel=1e-9)
    assert c_time > c_rate * 1.01  # eq. 11 over-counts devices, so it settles on a later C~*


@pytest.mark.parametrize("mode", ["rate", "time"])
def test_bipoint_plan_uses_n_devices_on_average_only_in_rate_mode(mode):
    curves = fig5a_curves()
    c_star, n_star = bisect_level(list(curves), FIG5A_LAYERS, curves, FIG5A_N, mode=mode)
    device_seconds = 0.0
    for m, curve in curves.items():
        for n, layers in bipoint_split(m, FIG5A_LAYERS[m], n_star[m], c_star, curve):
            if n > 0:
                device_seconds += n * curve.time(n) * layers
    average_devices = device_seconds / c_star
    if mode == "rate":
        assert average_devices == pytest.approx(FIG5A_N, rel=1e-9)
    else:
        assert average_devices < FIG5A_N - 0.05


def test_fig5a_allocate_level_rounds_and_keeps_layers():
    curves = fig5a_curves()
    metaops = [make_metaop(m, L) for m, L in FIG5A_LAYERS.items()]
    alloc = allocate_level(0, metaops, curves, FIG5A_N)
    assert alloc.level == 0
    assert set(alloc.tuples) == set(FIG5A_LAYERS)
    for m, tuples in alloc.tuples.items():
        assert sum(layers for _, layers in tuples) == FIG5A_LAYERS[m]
        assert all(layers >= 1 and 1 <= n <= FIG5A_N for n, layers in tuples)
        assert [n for n, _ in tuples] == sorted((n for n, _ in tuples), reverse=True)
    assert alloc.tuples["m2"] == [(2, 8), (1, 4)]
    assert alloc.tuples["m3"] == [(1, 6)]


# ------------------------------------------------------------------------------------ inverse_time


@pytest.mark.parametrize("mode", ["rate", "time"])
@settings(deadline=None)  # curve fitting time varies with the machine
@given(curve=concave_curves())
def test_inverse_is_exact_at_valid_points(mode, curve):
    for n in curve.valid_ns:
        assert inverse_time(curve, curve.time(n), mode=mode) == pytest.approx(n, rel=1e-9)


@pytest.mark.parametrize("mode", ["rate", "time"])
@settings(deadline=None)  # curve fitting time varies with the machine
@given(curve=concave_curves(), fractions=st.lists(st.floats(0.01, 3.0), min_size=2, max_size=20))
def test_inverse_is_monotone_non_increasing(mode, curve, fractions):
    targets = sorted(f * curve.time(1) for f in fractions)
    ns = [inverse_time(curve, t, mode=mode) for t in targets]
    assert all(a >= b - 1e-12 for a, b in zip(ns, ns[1:]))
    assert all(0 < n <= curve.valid_ns[-1] for n in ns)


@settings(deadline=None)  # curve fitting time varies with the machine
@given(curve=concave_curves(), frac=st.floats(0.01, 0.99))
def test_time_mode_lies_above_rate_mode_between_points(curve, frac):
    # n(c) is linear in c for "time" and convex in c for "rate" (linear in 1/c): the chord lies above.
    assume(len(curve.valid_ns) >= 2)
    t_lo, t_hi = curve.time(curve.valid_ns[0]), curve.time(curve.valid_ns[1])
    target = t_hi + frac * (t_lo - t_hi)
    assert inverse_time(curve, target, "time") >= inverse_time(curve, target, "rate") - 1e-12


def test_inverse_share_and_saturation():
    curve = ScalingCurve.from_table("m", {1: 4.0, 2: 2.5, 4: 1.5})
    assert inverse_time(curve, 8.0) == pytest.approx(0.5)  # T(1)/target: half a device
    assert inverse_time(curve, 8.0, mode="time") == pytest.approx(0.5)
    assert inverse_time(curve, 1.0) == 4  # faster than T(4) is impossible: the largest valid n
    assert inverse_time(curve, 1.0, max_n=2) == 2
    # rate-linear between n=2 (rate 0.4) and n=4 (rate 2/3): target 2.0 is rate 0.5
    assert inverse_time(curve, 2.0) == pytest.approx(2 + (0.5 - 0.4) / (2 / 3 - 0.4) * 2)
    # eq. 11 between the same points: ((2 - 2.5) * 4 + (1.5 - 2) * 2) / (1.5 - 2.5)
    assert inverse_time(curve, 2.0, mode="time") == pytest.approx(3.0)


def test_inverse_ignores_valid_points_that_are_not_faster():
    # n=3 is slower than n=2 (a bad config): nobody should pay 3 devices for it.
    curve = ScalingCurve.from_table("m", {1: 4.0, 2: 2.0, 3: 2.5, 4: 1.0})
    assert inverse_time(curve, 1.5) == pytest.approx(2 + (1 / 1.5 - 0.5) / (1.0 - 0.5) * 2)


def test_inverse_without_single_device_config_shares_smallest_allocation():
    curve = ScalingCurve.from_table("m", {2: 3.0, 4: 2.0})  # e.g. no single device fits the weights
    assert inverse_time(curve, 6.0) == pytest.approx(1.0)  # 2 devices busy half the time


@pytest.mark.parametrize("table, target, mode, message", [
    ({1: 1.0}, 1.0, "linear", "unknown inverse mode"),
    ({1: 1.0}, 0.0, "rate", "target time"),
    ({1: 1.0}, float("nan"), "rate", "target time"),
    ({}, 1.0, "rate", "no valid device counts"),
    ({1: 1.0, 2: -1.0}, 1.0, "rate", r"time\(2\)"),
    ({0: 1.0, 2: 0.5}, 1.0, "rate", "positive integers"),
])
def test_inverse_rejects_bad_input(table, target, mode, message):
    with pytest.raises(AllocationError, match=message):
        inverse_time(RawCurve("m", table), target, mode=mode)


# ------------------------------------------------------------------------------------ bisection


@st.composite
def levels(draw, max_metaops: int = 5):
    num_devices = draw(st.integers(1, 16))
    count = draw(st.integers(1, max_metaops))
    ids = [f"t{i}/mod" for i in range(count)]
    curves = {m: draw(concave_curves(m)) for m in ids}
    layers = {m: draw(st.integers(1, 24)) for m in ids}
    return ids, layers, curves, num_devices


@pytest.mark.parametrize("mode", ["rate", "time"])
@given(level=levels())
@settings(max_examples=150, deadline=None)
def test_bisection_within_bounds_and_uses_n_devices(mode, level):
    ids, layers, curves, num_devices = level
    c_star, n_star = bisect_level(ids, layers, curves, num_devices, mode=mode)
    fastest = {m: max(n for n in curves[m].valid_ns if n <= num_devices) for m in ids}
    c_low = max(curves[m].time(fastest[m]) * layers[m] for m in ids)
    c_high = sum(curves[m].time(1) * layers[m] for m in ids)
    assert c_low * (1 - 1e-12) <= c_star <= c_high * (1 + 1e-12)
    assert all(0 < n_star[m] <= fastest[m] + 1e-9 for m in ids)
    total = sum(n_star.values())
    if c_star == pytest.approx(c_low, rel=1e-12):
        # the slowest MetaOp at its fastest bounds the level; the others may leave devices over
        assert total <= num_devices * (1 + 1e-9)
        assert any(n_star[m] >= fastest[m] - 1e-9 for m in ids)
    else:
        assert total == pytest.approx(num_devices, rel=1e-9)
    # Theorem 1: every MetaOp's bi-point plan ends at the same C~*.
    for m in ids:
        split = bipoint_split(m, layers[m], n_star[m], c_star, curves[m], max_n=num_devices)
        span = sum(curves[m].time(n) * layers for n, layers in split if n > 0)
        if n_star[m] < fastest[m] - 1e-9 and n_star[m] >= 1:
            assert span == pytest.approx(c_star, rel=1e-9)
        else:
            assert span <= c_star * (1 + 1e-9)


def test_bisection_single_device_runs_everything_in_sequence():
    curves = {"a": ScalingCurve.from_table("a", {1: 2.0, 2: 1.2}),
              "b": ScalingCurve.from_table("b", {1: 0.5})}
    c_star, n_star = bisect_level(["a", "b"], {"a": 3, "b": 4}, curves, 1)
    assert c_star == pytest.approx(3 * 2.0 + 4 * 0.5)
    assert n_star == pytest.approx({"a": 0.75, "b": 0.25})


def test_bisection_saturated_level_stops_at_lower_bound():
    # One MetaOp that cannot use more than 4 of 8 devices: C~* is its time on 4.
    curves = {"a": ScalingCurve.from_table("a", {1: 4.0, 2: 2.2, 4: 1.3})}
    c_star, n_star = bisect_level(["a"], {"a": 10}, curves, 8)
    assert c_star == pytest.approx(13.0)
    assert n_star == {"a": 4.0}


def test_bisection_hits_exact_optimum_on_valid_points():
    # Two identical MetaOps on 2 devices: the optimum is exactly one device each, C~* = T(1) L.
    curves = {m: ScalingCurve.from_table(m, {1: 1.0, 2: 0.6}) for m in "ab"}
    c_star, n_star = bisect_level(["a", "b"], {"a": 5, "b": 5}, curves, 2)
    assert c_star == pytest.approx(5.0, rel=1e-12)
    assert n_star == pytest.approx({"a": 1.0, "b": 1.0}, rel=1e-9)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_devices=0), "num_devices"),
    (dict(layers={"a": 0}), "layer count"),
    (dict(layers={}), "no layer count"),
    (dict(ids=[]), "at least one MetaOp"),
    (dict(ids=["a", "a"]), "repeat"),
    (dict(ids=["a", "x"]), "'x' has no scaling curve"),
    (dict(mode="exact"), "unknown inverse mode"),
    (dict(rel_eps=0.0), "rel_eps"),
    (dict(curves={"a": ScalingCurve.from_table("a", {8: 1.0})}), "smallest valid device count 8"),
])
def test_bisection_rejects_bad_input(kwargs, message):
    args = dict(ids=["a"], layers={"a": 2}, curves={"a": ScalingCurve.from_table("a", {1: 1.0, 2: 0.6})},
                num_devices=4, mode="rate", rel_eps=1e-6)
    args.update(kwargs)
    with pytest.raises(AllocationError, match=message):
        bisect_level(args["ids"], args["layers"], args["curves"], args["num_devices"], mode=args["mode"],
                     rel_eps=args["rel_eps"])


# ------------------------------------------------------------------------------------ discretisation


def test_discretise_solves_10a_10b_and_rounds_to_nearest():
    curve = ScalingCurve.from_table("m", {1: 2.0, 2: 1.0, 4: 0.6})
    # l_hi = (T(1) L - C) / (T(1) - T(2)) = (20 - C) / 1
    assert bipoint_split("m", 10, 1.5, 14.6, curve) == [(2, pytest.approx(5.4)), (1, pytest.approx(4.6))]
    assert discretise("m", 10, 1.5, 14.6, curve) == [(2, 5), (1, 5)]
    assert discretise("m", 10, 1.5, 14.4, curve) == [(2, 6), (1, 4)]
    assert discretise("m", 10, 1.5, 10.2, curve) == [(2, 10)]  # l_lo = 0.2 rounds away: dropped
    assert discretise("m", 10, 2.0, 10.0, curve) == [(2, 10)]  # on a valid point
    assert discretise("m", 10, 0.4, 50.0, curve) == [(1, 10)]  # dummy n_lo = 0
    assert discretise("m", 10, 4.0, 6.0, curve) == [(4, 10)]


@settings(deadline=None)
@given(curve=concave_curves(), L=st.integers(1, 64), target_frac=st.floats(0.3, 3.0),
       c_scale=st.floats(0.01, 10.0), consistent=st.booleans())
def test_discretise_keeps_layers_exact_and_non_negative(curve, L, target_frac, c_scale, consistent):
    target = target_frac ** 3 * curve.time(1)  # reaches below T(n_max) too
    n_star = inverse_time(curve, target)
    # consistent: the C~* that goes with n*; otherwise one deliberately off the bracket
    c_star = target * L if consistent else c_scale * curve.time(1) * L
    tuples = discretise("m", L, n_star, c_star, curve)
    assert sum(layers for _, layers in tuples) == L
    assert all(layers >= 1 for _, layers in tuples)
    assert all(n in curve.valid_ns for n, _ in tuples)
    assert 1 <= len(tuples) <= 2
    assert [n for n, _ in tuples] == sorted({n for n, _ in tuples}, reverse=True)
    if len(tuples) == 2:
        n_hi, n_lo = tuples[0][0], tuples[1][0]
        assert n_lo < n_star < n_hi
        assert not any(n_lo < n < n_hi for n in curve.valid_ns)


@pytest.mark.parametrize("L, n_star, c_star, message", [
    (0, 1.0, 1.0, "layer count"),
    (3, 0.0, 1.0, "n\\*"),
    (3, 1.0, math.inf, "C~\\*"),
])
def test_discretise_rejects_bad_input(L, n_star, c_star, message):
    with pytest.raises(AllocationError, match=message):
        discretise("m", L, n_star, c_star, ScalingCurve.from_table("m", {1: 1.0}))


@given(level=levels())
@settings(max_examples=100, deadline=None)
def test_allocate_level_tuples_cover_every_layer(level):
    ids, layers, curves, num_devices = level
    metaops = [make_metaop(m, layers[m]) for m in ids]
    alloc = allocate_level(3, metaops, curves, num_devices)
    assert alloc.level == 3
    assert set(alloc.tuples) == set(ids) == set(alloc.n_star)
    for m in ids:
        assert sum(count for _, count in alloc.tuples[m]) == layers[m]
        for n, count in alloc.tuples[m]:
            assert count >= 1 and 1 <= n <= num_devices and n in curves[m].valid_ns
