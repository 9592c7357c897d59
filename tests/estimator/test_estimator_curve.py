import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_spindle.estimator import CurvePoint, EstimatorError, ScalingCurve, choose_breakpoints


def alpha_beta(n: float, alpha: float, beta: float, beta_prime: float, c: float, w: float) -> float:
    comm = c * 2 * (n - 1) / n if n > 1 else 0.0
    return alpha + beta * comm + beta_prime * w / n


def test_from_table_round_trip():
    table = {1: 8.0, 2: 4.5, 4: 2.6, 8: 1.9}
    curve = ScalingCurve.from_table("t/vision", table)
    assert curve.metaop == "t/vision"
    assert curve.valid_ns == [1, 2, 4, 8]
    assert {n: curve.time(n) for n in curve.valid_ns} == table
    assert all(curve.config(n) == (1, n) for n in table)
    assert curve.source == "analytic"
    assert curve.speedup(8) == pytest.approx(8.0 / 1.9)


def test_from_points_keeps_the_fastest_config_per_n():
    points = [
        CurvePoint(1, 1, 1, 10.0),
        CurvePoint(4, 1, 4, 3.0),
        CurvePoint(4, 2, 2, 2.5),
        CurvePoint(4, 4, 1, 2.8),
        CurvePoint(8, 2, 4, 1.5),
    ]
    curve = ScalingCurve.from_points("m", points)
    assert curve.config(4) == (2, 2) and curve.time(4) == 2.5
    assert curve.valid_ns == [1, 4, 8]


def test_fit_recovers_an_exact_alpha_beta_model():
    c, w = 4e8, 2e12
    coefs = (3e-4, 2e-12, 5e-15)
    table = {n: alpha_beta(n, *coefs, c, w) for n in (1, 2, 4, 8, 16, 32)}
    curve = ScalingCurve.from_table("m", table, c=c, w=w)
    assert curve.fit_error < 1e-9
    for n in (3, 6, 12, 24):  # between the points the fit is the model
        assert curve.time(n) == pytest.approx(alpha_beta(n, *coefs, c, w), rel=1e-6)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.05, 20.0), min_size=1, max_size=7))
def test_fit_reproduces_its_points_within_fit_error(times):
    ns = [2**k for k in range(len(times))]
    curve = ScalingCurve.from_table("m", dict(zip(ns, times)), c=1e8, w=1e12, node_size=8)
    for n in ns:
        assert curve.time(n) == dict(zip(ns, times))[n]  # exact at the points
        assert abs(curve.fitted(n) - curve.time(n)) / curve.time(n) <= curve.fit_error + 1e-9
    for piece in curve.pieces:  # non-negative coefficients: never a negative time
        assert min(piece.alpha, piece.beta, piece.beta_prime) >= 0
    assert all(curve.fitted(n) >= 0 for n in (1.5, 3, 5, 7))


def test_pieces_split_at_the_node_boundary():
    # Within a node the time halves per doubling; across nodes a slow all-reduce adds a big constant.
    table = {1: 16.0, 2: 8.0, 4: 4.0, 8: 2.0, 16: 6.0, 32: 5.0, 64: 4.5}
    curve = ScalingCurve.from_table("m", table, w=1.0, node_size=8)
    assert [(p.lo, p.hi) for p in curve.pieces] == [(1, 8), (16, 64)]
    single = ScalingCurve.from_table("m", table, w=1.0, node_size=None, min_points_per_piece=7)
    assert len(single.pieces) == 1
    assert curve.fit_error < single.fit_error
    assert curve.time(3) == pytest.approx(16.0 / 3)  # intra-node piece: exactly 16/n


def test_choose_breakpoints_keeps_enough_points_per_piece():
    ns = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    breaks = choose_breakpoints(ns, node_size=8, min_points_per_piece=3)
    assert breaks == [8]
    assert choose_breakpoints(ns, node_size=None, min_points_per_piece=3) != []
    for b in choose_breakpoints(ns, node_size=None, min_points_per_piece=3):
        assert b & (b - 1) == 0  # powers of two only
    bounds = [0] + choose_breakpoints(ns, node_size=None, min_points_per_piece=3) + [ns[-1]]
    assert all(sum(1 for n in ns if lo < n <= hi) >= 3 for lo, hi in zip(bounds, bounds[1:]))
    assert choose_breakpoints([1, 2], node_size=None) == []


def test_time_outside_the_points():
    curve = ScalingCurve.from_table("m", {2: 5.0, 4: 3.0, 8: 2.0}, w=1.0)
    assert curve.time(16) == 2.0  # more devices than useful: they idle
    assert curve.time(1) >= 5.0  # fewer devices than the first point: never faster
    with pytest.raises(EstimatorError, match="n must be positive"):
        curve.time(0)


def test_monotone_drops_n_that_do_not_help():
    curve = ScalingCurve.from_table("m", {1: 10.0, 2: 6.0, 4: 7.0, 8: 5.0, 16: 5.0})
    assert not curve.is_monotone
    mono = curve.monotone()
    assert mono.valid_ns == [1, 2, 8]
    assert mono.is_monotone
    assert [mono.time(n) for n in mono.valid_ns] == [10.0, 6.0, 5.0]
    assert mono.config(8) == (1, 8)


def test_config_of_an_invalid_n_is_a_clear_error():
    curve = ScalingCurve.from_table("t/text", {1: 2.0, 2: 1.5})
    with pytest.raises(EstimatorError, match=r"n=4 is not a valid device count \(valid: \[1, 2\]\)"):
        curve.config(4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=4, tp=2, dp=1, seconds=1.0), "tp 2 x dp 1 != n 4"),
        (dict(n=1, tp=1, dp=1, seconds=0.0), "positive finite"),
        (dict(n=1, tp=1, dp=1, seconds=math.nan), "positive finite"),
        (dict(n=0, tp=1, dp=0, seconds=1.0), "n must be a positive integer"),
        (dict(n=1, tp=1, dp=1, seconds=1.0, source="guess"), "source"),
    ],
)
def test_bad_points_are_rejected(kwargs, message):
    with pytest.raises(EstimatorError, match=message):
        CurvePoint(**kwargs)


def test_empty_curve_is_rejected():
    with pytest.raises(EstimatorError, match="no points"):
        ScalingCurve.from_table("m", {})
