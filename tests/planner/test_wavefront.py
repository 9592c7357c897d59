"""Wavefront scheduler: Alg. 1 propose / extend / align / commit (paper 3.4, summary 2.4)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_spindle.estimator.curve import CurvePoint, ScalingCurve
from megatron_spindle.graph.opgraph import MetaGraph, MetaOp
from megatron_spindle.planner.allocator import allocate_level
from megatron_spindle.planner.schedule import LevelAllocation, ScheduledWave
from megatron_spindle.planner.wavefront import ScheduleError, schedule_level, schedule_levels


def make_metaop(metaop_id: str, num_layers: int, level: int = 0) -> MetaOp:
    ops = [f"{metaop_id}.layer{i}" for i in range(num_layers)]
    return MetaOp(id=metaop_id, type="layer", input_shape=(8, 16, 32), ops=ops,
                  params=[(f"{metaop_id}.layers.{i}",) for i in range(num_layers)], task="t", module="m",
                  kind="layer", layer_offset=0, level=level)


def summary(waves: list[ScheduledWave]) -> list[list[tuple[str, int, int, int]]]:
    return [[(s.metaop, s.n, s.layer_start, s.layer_end) for s in w.slices] for w in waves]


# ------------------------------------------------------------------------------------ hand-built levels


def test_wave_that_does_not_fill_the_cluster_is_extended():
    # N=4. Wave 1: a(2) + b(2) fill the devices; a's 2 layers (2 s) are shortest, b runs 2 of its 6.
    # Wave 2: only b is left, planned on 2 devices: extension moves it to 4 (0.6 s per layer).
    curves = {"a": ScalingCurve.from_table("a", {1: 2.0, 2: 1.0}),
              "b": ScalingCurve.from_table("b", {1: 2.0, 2: 1.0, 4: 0.6})}
    alloc = LevelAllocation(level=0, c_star=0.0, n_star={}, tuples={"a": [(2, 2)], "b": [(2, 6)]})
    waves = schedule_level(alloc, [make_metaop("a", 2), make_metaop("b", 6)], curves, 4, t_start=1.5)
    assert summary(waves) == [[("a", 2, 0, 2), ("b", 2, 0, 2)], [("b", 4, 2, 6)]]
    assert waves[0].start == 1.5 and waves[0].duration == pytest.approx(2.0)
    assert waves[1].start == pytest.approx(3.5) and waves[1].duration == pytest.approx(2.4)
    assert waves[1].slices[0].time == pytest.approx(2.4)
    assert (waves[1].slices[0].tp, waves[1].slices[0].dp) == (1, 4)
    assert all(s.devices is None for w in waves for s in w.slices)


def test_fig5b_first_level_waves_one_and_two():
    # Fig. 5b, MetaLevel 1 on 8 devices, with the figure's tuples (larger n first). Per-layer times are
    # ours, chosen so that, as in the figure, MetaOp 4 (3 layers on 2 devices, 3 s) is the shortest of
    # wave 2: T1(4) = 2 s fits 1 layer, T2(2) = 1.2 s fits 2 layers (2.4 s) into 3 s.
    curves = {
        "1": ScalingCurve.from_table("1", {1: 7.0, 2: 3.8, 4: 2.0, 8: 1.1}),
        "2": ScalingCurve.from_table("2", {1: 2.0, 2: 1.2, 4: 0.8}),
        "4": ScalingCurve.from_table("4", {1: 1.8, 2: 1.0, 4: 0.7}),
        "5": ScalingCurve.from_table("5", {1: 1.0, 2: 0.6}),
        "6": ScalingCurve.from_table("6", {1: 1.0, 2: 0.6}),
    }
    tuples = {"1": [(8, 2), (4, 9)], "2": [(2, 14), (1, 2)], "4": [(2, 3), (1, 13)], "5": [(1, 6)],
              "6": [(1, 6)]}
    metaops = [make_metaop(m, sum(layers for _, layers in t)) for m, t in tuples.items()]
    waves = schedule_level(LevelAllocation(0, 0.0, {}, tuples), metaops, curves, 8, t_start=0.0)
    # Wave 1: MetaOp 1's 8-device tuple fills the cluster alone.
    assert summary(waves)[0] == [("1", 8, 0, 2)]
    # Wave 2: {1, 2, 4} (4+2+2) ties {1, 2, 5, 6} and {1, 4, 5, 6} on 8 devices; 2 and 4 have more work
    # left than 5 and 6 together. MetaOp 4 sets T_wave = 3 s; 1 runs 1 op, 2 runs 2 ops.
    assert summary(waves)[1] == [("1", 4, 2, 3), ("2", 2, 0, 2), ("4", 2, 0, 3)]
    assert waves[1].duration == pytest.approx(3.0)
    # Later, MetaOp 4's 1-device tuple is raised to 2 devices in some wave (Fig. 5b's wave 4).
    assert any(s.metaop == "4" and s.layer_start >= 3 and s.n == 2 for w in waves for s in w.slices)
    assert len(waves) <= sum(len(t) for t in tuples.values())


def test_propose_breaks_device_ties_towards_more_remaining_work():
    curves = {m: ScalingCurve.from_table(m, {1: 1.0, 2: 0.5}) for m in ("light", "heavy")}
    tuples = {"light": [(2, 1)], "heavy": [(2, 8)]}
    metaops = [make_metaop("light", 1), make_metaop("heavy", 8)]
    waves = schedule_level(LevelAllocation(0, 0.0, {}, tuples), metaops, curves, 2, t_start=0.0)
    assert summary(waves) == [[("heavy", 2, 0, 8)], [("light", 2, 0, 1)]]


def test_extend_raises_the_metaop_with_most_remaining_work_first():
    # N=3: a(1) + b(1) leave one device; a has 4 s of work left, b 2 s, so a moves to 2 devices.
    # T_wave = b's 2 s; a fits floor(2 / 0.6) = 3 layers. Wave 2: a's last layer, extended again.
    curves = {m: ScalingCurve.from_table(m, {1: 1.0, 2: 0.6}) for m in ("a", "b")}
    tuples = {"a": [(1, 4)], "b": [(1, 2)]}
    waves = schedule_level(LevelAllocation(0, 0.0, {}, tuples), [make_metaop("a", 4), make_metaop("b", 2)],
                           curves, 3, t_start=0.0)
    assert summary(waves) == [[("a", 2, 0, 3), ("b", 1, 0, 2)], [("a", 2, 3, 4)]]
    assert [w.duration for w in waves] == pytest.approx([2.0, 0.6])


def test_align_runs_at_least_one_layer():
    # b's single layer (1 s) is shorter than one layer of a (3 s): a still runs one layer.
    curves = {"a": ScalingCurve.from_table("a", {1: 3.0}), "b": ScalingCurve.from_table("b", {1: 1.0})}
    tuples = {"a": [(1, 2)], "b": [(1, 1)]}
    waves = schedule_level(LevelAllocation(0, 0.0, {}, tuples), [make_metaop("a", 2), make_metaop("b", 1)],
                           curves, 2, t_start=0.0)
    assert summary(waves) == [[("a", 1, 0, 1), ("b", 1, 0, 1)], [("a", 1, 1, 2)]]
    assert waves[0].duration == pytest.approx(3.0)


def test_a_wave_lengthened_by_one_long_layer_is_filled_by_the_others():
    # c's shortest span (1 s) sets T_wave, a's single layer (3 s) lengthens the wave to 3 s: b (1 s per layer)
    # runs 3 of its layers in it instead of 1 and idling 2 s; c has only its one layer.
    curves = {"a": ScalingCurve.from_table("a", {1: 3.0}), "b": ScalingCurve.from_table("b", {1: 1.0}),
              "c": ScalingCurve.from_table("c", {1: 1.0})}
    tuples = {"a": [(1, 2)], "b": [(1, 4)], "c": [(1, 1)]}
    metaops = [make_metaop("a", 2), make_metaop("b", 4), make_metaop("c", 1)]
    waves = schedule_level(LevelAllocation(0, 0.0, {}, tuples), metaops, curves, 3, t_start=0.0)
    assert summary(waves)[0] == [("a", 1, 0, 1), ("b", 1, 0, 3), ("c", 1, 0, 1)]
    assert waves[0].duration == pytest.approx(3.0)


def test_slices_take_tp_and_dp_from_the_curve():
    points = [CurvePoint(1, 1, 1, 2.0), CurvePoint(2, 1, 2, 1.1), CurvePoint(4, 2, 2, 0.6),
              CurvePoint(4, 1, 4, 0.7)]
    curves = {"a": ScalingCurve.from_points("a", points)}  # the fastest config at n=4 is tp=2 x dp=2
    alloc = LevelAllocation(0, 0.0, {}, {"a": [(4, 3)]})
    waves = schedule_level(alloc, [make_metaop("a", 3)], curves, 4, 0.0)
    assert [(s.n, s.tp, s.dp) for s in waves[0].slices] == [(4, 2, 2)]


# ------------------------------------------------------------------------------------ bad input


def _one_op(tuples, table=None, layers=3, num_devices=4, metaop_ids=("a",)):
    curves = {"a": ScalingCurve.from_table("a", table or {1: 2.0, 2: 1.0, 4: 0.6})}
    metaops = [make_metaop(m, layers) for m in metaop_ids]
    return schedule_level(LevelAllocation(0, 0.0, {}, tuples), metaops, curves, num_devices, 0.0)


@pytest.mark.parametrize("call, message", [
    (lambda: _one_op({"a": [(8, 3)]}, table={1: 2.0, 8: 0.3}), "more devices than the 4 available"),
    (lambda: _one_op({"a": [(2, 2)]}), "cover 2 layers, the MetaOp has 3"),
    (lambda: _one_op({"a": [(3, 3)]}), "3 is not a valid device count"),
    (lambda: _one_op({"a": [(2, 0), (1, 3)]}), "positive integer layer count"),
    (lambda: _one_op({"a": []}), "no tuples"),
    (lambda: _one_op({"a": [(2, 3)], "z": [(1, 1)]}), r"unknown \['z'\]"),
    (lambda: _one_op({"a": [(2, 3)]}, metaop_ids=("a", "q")), r"missing \['q'\]"),
    (lambda: _one_op({"a": [(2, 3)]}, num_devices=0), "num_devices"),
])
def test_schedule_level_rejects_bad_allocations(call, message):
    with pytest.raises(ScheduleError, match=message):
        call()


def test_config_that_does_not_match_n_is_an_error():
    @dataclass
    class BadConfigCurve:  # duck-typed: ScalingCurve itself refuses tp * dp != n
        valid_ns = [1, 2]

        def time(self, n: int) -> float:
            return {1: 1.0, 2: 0.6}[n]

        def config(self, n: int) -> tuple[int, int]:
            return 1, 1

    curves = {"a": BadConfigCurve()}
    with pytest.raises(ScheduleError, match=r"config\(2\)"):
        schedule_level(LevelAllocation(0, 0.0, {}, {"a": [(2, 1)]}), [make_metaop("a", 1)], curves, 2, 0.0)


# ------------------------------------------------------------------------------------ properties


@st.composite
def concave_curves(draw, metaop_id: str, max_n: int = 16) -> ScalingCurve:
    """Strictly decreasing T whose rate 1/T is concave in n (diminishing returns), valid n including 1."""
    extra = draw(st.lists(st.integers(2, max_n), max_size=5, unique=True))
    ns = sorted({1, *extra})
    t1 = draw(st.floats(0.05, 10.0))
    slope = 1.0 / t1
    rate, table, prev_n = 1.0 / t1, {1: t1}, 1
    for n in ns[1:]:
        slope *= draw(st.floats(0.05, 1.0))
        rate += (n - prev_n) * slope
        table[n], prev_n = 1.0 / rate, n
    return ScalingCurve.from_table(metaop_id, table)


@st.composite
def random_levels(draw, max_metaops: int = 6):
    num_devices = draw(st.integers(1, 16))
    ids = [f"t{i}/mod" for i in range(draw(st.integers(1, max_metaops)))]
    curves = {m: draw(concave_curves(m)) for m in ids}
    metaops = [make_metaop(m, draw(st.integers(1, 24))) for m in ids]
    return metaops, curves, num_devices


def check_waves(waves: list[ScheduledWave], metaops: list[MetaOp], curves, num_devices: int, t_start: float):
    """Invariants every level schedule must satisfy."""
    assert waves[0].start == t_start
    for a, b in zip(waves, waves[1:]):
        assert b.start == pytest.approx(a.end, rel=1e-12)  # contiguous, never overlapping
    covered = {m.id: [] for m in metaops}
    for w in waves:
        assert 1 <= w.devices_used <= num_devices
        assert len({s.metaop for s in w.slices}) == len(w.slices)  # one slice per MetaOp per wave
        assert w.duration == pytest.approx(max(s.time for s in w.slices))
        free = num_devices - w.devices_used
        for s in w.slices:
            curve = curves[s.metaop]
            assert s.n in curve.valid_ns and s.tp * s.dp == s.n
            assert s.layer_end > s.layer_start
            assert s.time == pytest.approx(curve.time(s.n) * (s.layer_end - s.layer_start))
            assert s.time <= w.duration * (1 + 1e-12)  # the slice fits in its wave: no overlap in time
            covered[s.metaop].append((s.layer_start, s.layer_end))
            # extension left no devices that this slice could have used for its next valid n
            bigger = [n for n in curve.valid_ns if n > s.n]
            assert not bigger or bigger[0] - s.n > free
    for m in metaops:
        ranges = covered[m.id]  # waves are in time order, so this is the MetaOp's execution order
        assert ranges[0][0] == 0 and ranges[-1][1] == m.num_layers
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # every layer once, in order


@given(level=random_levels(), t_start=st.sampled_from([0.0, 2.5]))
@settings(max_examples=200, deadline=None)
def test_random_levels_schedule_every_layer_within_capacity(level, t_start):
    metaops, curves, num_devices = level
    alloc = allocate_level(0, metaops, curves, num_devices)
    waves = schedule_level(alloc, metaops, curves, num_devices, t_start)
    check_waves(waves, metaops, curves, num_devices, t_start)
    # Each wave exhausts its shortest tuple (align), and bi-point gives <= 2 tuples per MetaOp.
    num_tuples = sum(len(t) for t in alloc.tuples.values())
    assert len(waves) <= num_tuples <= 2 * len(metaops)
    # With concave rates, C~* bounds every schedule of the level from below (Theorem 1 + Jensen).
    makespan = waves[-1].end - t_start
    assert makespan >= alloc.c_star * (1 - 1e-9)


@given(level=random_levels(max_metaops=4), mode=st.sampled_from(["rate", "time"]))
@settings(max_examples=50, deadline=None)
def test_time_mode_allocations_schedule_too(level, mode):
    metaops, curves, num_devices = level
    alloc = allocate_level(0, metaops, curves, num_devices, mode=mode)
    check_waves(schedule_level(alloc, metaops, curves, num_devices, 0.0), metaops, curves, num_devices, 0.0)


# ------------------------------------------------------------------------------------ several levels


def two_level_graph() -> tuple[MetaGraph, dict[str, ScalingCurve]]:
    metaops = {
        "t1/audio": make_metaop("t1/audio", 6, level=0),
        "t2/vision": make_metaop("t2/vision", 4, level=0),
        "t1/lm": make_metaop("t1/lm", 5, level=1),
    }
    edges = [("t1/audio", "t1/lm"), ("t2/vision", "t1/lm")]
    graph = MetaGraph(metaops=metaops, edges=edges, levels=[["t1/audio", "t2/vision"], ["t1/lm"]])
    curves = {
        "t1/audio": ScalingCurve.from_table("t1/audio", {1: 1.0, 2: 0.6, 4: 0.45}),
        "t2/vision": ScalingCurve.from_table("t2/vision", {1: 2.0, 2: 1.05, 4: 0.6}),
        "t1/lm": ScalingCurve.from_table("t1/lm", {1: 4.0, 2: 2.1, 4: 1.2}),
    }
    return graph, curves


def test_schedule_levels_concatenates_levels_in_order():
    graph, curves = two_level_graph()
    allocs = [allocate_level(k, [graph.metaops[m] for m in ids], curves, 4)
              for k, ids in enumerate(graph.levels)]
    waves = schedule_levels(allocs, graph, curves, 4)
    levels = [w.level for w in waves]
    assert levels == sorted(levels) and set(levels) == {0, 1}
    first_level_end = max(w.end for w in waves if w.level == 0)
    assert min(w.start for w in waves if w.level == 1) == pytest.approx(first_level_end)
    check_waves(waves, list(graph.metaops.values()), curves, 4, 0.0)
    # the LM alone on 4 devices: its level lasts 5 * T(4)
    assert sum(w.duration for w in waves if w.level == 1) == pytest.approx(5 * 1.2)


def test_schedule_levels_needs_one_allocation_per_level_in_order():
    graph, curves = two_level_graph()
    allocs = [allocate_level(k, [graph.metaops[m] for m in ids], curves, 4)
              for k, ids in enumerate(graph.levels)]
    with pytest.raises(ScheduleError, match=r"got levels \[1, 0\]"):
        schedule_levels(list(reversed(allocs)), graph, curves, 4)
    with pytest.raises(ScheduleError, match=r"got levels \[0\]"):
        schedule_levels(allocs[:1], graph, curves, 4)
