"""A MetaLevel's tail settled into one wave (planner/tails.py): the min-max device counts, the settled waves, the
pipeline's settled plan (only where its own estimate of the placed plan is faster), and plan selection timing it
beside the plan as it was."""

from __future__ import annotations

import pytest

from megatron_spindle.autoplan import autoplan
from megatron_spindle.estimator.curve import ScalingCurve
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.opgraph import MetaGraph, MetaOp
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.plan.validate import validate_plan
from megatron_spindle.planner.pipeline import PlannerConfig, plan_workload
from megatron_spindle.planner.schedule import ScheduledSlice, ScheduledWave
from megatron_spindle.planner.tails import min_max_counts, settle_tail, settled_levels, tail_starts

CURVES = {"a": ScalingCurve.from_table("a", {1: 4.0, 2: 2.0, 4: 1.2}),
          "b": ScalingCurve.from_table("b", {1: 3.0, 2: 1.6, 4: 1.0}),
          "f": ScalingCurve.from_table("f", {1: 0.1, 2: 0.06})}


def test_min_max_counts_take_the_shortest_longest_span_on_the_fewest_devices():
    # spans (T(n) x layers) a: 8 / 4 / 2.4 on 1 / 2 / 4 devices, b: 3 / 1.6 / 1.0. On 6 devices the longest span
    # can be 2.4 (a on 4); b then needs only 2 devices for it, not 4
    assert min_max_counts({"a": 2, "b": 1}, CURVES, 6) == {"a": 4, "b": 2}
    # on 5 devices a on 4 leaves b one device: 3.0 is the best longest span
    assert min_max_counts({"a": 2, "b": 1}, CURVES, 5) == {"a": 4, "b": 1}
    assert min_max_counts({"a": 2, "b": 1}, CURVES, 3) == {"a": 2, "b": 1}


def test_min_max_counts_none_when_the_smallest_counts_do_not_fit():
    curves = {m: ScalingCurve.from_table(m, {2: 1.0, 4: 0.6}) for m in "xyz"}
    assert min_max_counts({"x": 1, "y": 1, "z": 1}, curves, 5) is None
    assert min_max_counts({"x": 1, "y": 1}, curves, 5) == {"x": 2, "y": 2}


def _slice(m: str, n: int, start: int, end: int) -> ScheduledSlice:
    tp, dp = CURVES[m].config(n)
    return ScheduledSlice(m, n, tp, dp, start, end, CURVES[m].time(n) * (end - start), devices=list(range(n)))


def _waves() -> list[ScheduledWave]:
    # level 0: a front end; level 1: a and b hop between device counts over three waves
    spec = [(0, [_slice("f", 2, 0, 1)]),
            (1, [_slice("a", 4, 0, 2), _slice("b", 2, 0, 1)]),
            (1, [_slice("a", 2, 2, 3), _slice("b", 4, 1, 2)]),
            (1, [_slice("a", 4, 3, 4), _slice("b", 1, 2, 3)])]
    out, t = [], 0.0
    for level, slices in spec:
        duration = max(s.time for s in slices)
        out.append(ScheduledWave(level, t, duration, slices))
        t += duration
    return out


def test_settle_tail_runs_each_metaop_s_remaining_layers_on_one_count():
    waves = _waves()
    settled = settle_tail(waves, level=1, k=1, curves=CURVES, num_devices=6)
    assert [w.level for w in settled] == [0, 1, 1]
    assert [(s.metaop, s.n, s.layer_start, s.layer_end) for s in settled[1].slices] == \
        [("a", 4, 0, 2), ("b", 2, 0, 1)]  # the waves before the tail unchanged
    # a has layers 2-3 left (spans 8 / 4 / 2.4), b layers 1-2 (6 / 3.2 / 2.0): a on 4, b on 2 within 3.2
    tail = settled[2]
    assert [(s.metaop, s.n, s.layer_start, s.layer_end) for s in tail.slices] == [("a", 4, 2, 4), ("b", 2, 1, 3)]
    assert [(s.tp, s.dp) for s in tail.slices] == [CURVES["a"].config(4), CURVES["b"].config(2)]
    assert tail.duration == pytest.approx(3.2)
    assert [w.start for w in settled] == pytest.approx([0.0, 0.06, 0.06 + 2.4])  # back to back
    assert all(s.devices is None for w in settled for s in w.slices)  # placement runs after


def test_a_tail_of_one_wave_or_that_does_not_fit_is_not_settled():
    waves = _waves()
    assert settle_tail(waves, level=1, k=2, curves=CURVES, num_devices=6) is None
    assert settle_tail(waves, level=0, k=0, curves=CURVES, num_devices=6) is None
    assert settle_tail(waves, level=1, k=0, curves=CURVES, num_devices=1) is None  # a and b need 2 devices


def test_settled_levels_are_heavy_levels_of_two_waves_or_more():
    def op(m: str, level: int, kind: str) -> MetaOp:
        return MetaOp(id=m, type=kind, input_shape=(8, 16, 32), ops=[m], params=[], task="t", module="m",
                      kind=kind, layer_offset=0, level=level)

    graph = MetaGraph(metaops={"f": op("f", 0, "frontend"), "a": op("a", 1, "layer"), "b": op("b", 1, "layer")},
                      edges=[("f", "a"), ("f", "b")], levels=[["f"], ["a", "b"]])
    waves = _waves()
    assert settled_levels(waves, graph) == [1]
    assert tail_starts(waves, 1) == [0, 1]
    mixed = waves[:3] + [ScheduledWave(1, 5.0, 1.0, waves[3].slices + waves[0].slices)]
    assert settled_levels(mixed, graph) == []  # a wave holding two levels: not a level-by-level plan
    overlapping = waves[:3] + [ScheduledWave(1, waves[2].start, waves[3].duration, waves[3].slices)]
    assert settled_levels(overlapping, graph) == []  # waves side by side in time: a cross-level plan


@pytest.mark.parametrize("workload, gpus, gpus_per_node, gpu", [("tiny-clip", 8, 4, "CPU"), ("clip-4", 16, 8, None)])
def test_pipeline_settles_a_tail_only_where_its_estimate_is_faster(workload, gpus, gpus_per_node, gpu):
    w = load_workload(workload)
    c = make_cluster(gpus, gpus_per_node, gpu) if gpu else make_cluster(gpus, gpus_per_node)
    # islands as the greedy placement chose them: on tiny-clip the whole-schedule islands (planner/islands.py)
    # leave its tail nothing to gain
    plans = {settle: plan_workload(w, c, PlannerConfig(planner="wavefront", select="none", light_follow=True,
                                                       settle_tails=settle, whole_schedule_islands=False))
             for settle in (False, True)}
    assert plans[False].settled is None
    before, after = plans[True].plan, plans[True].settled.plan
    assert before.to_dict()["waves"] == plans[False].plan.to_dict()["waves"]  # the plan as it was, and beside it
    # on both, a settled tail of the encoder level is what the estimate prefers: fewer waves, a faster estimate
    assert len(after.waves) < len(before.waves)
    assert after.predicted["planner_estimate"] < before.predicted["planner_estimate"]
    assert after.planner["settled_tails"] and "settled_tails" not in before.planner
    validate_plan(after, w, c, plans[True].metagraph)
    for m in plans[True].metagraph.metaops.values():  # every layer once, in order
        ranges = sorted((s.layer_start, s.layer_end) for s in after.slices() if s.metaop == m.id)
        assert ranges[0][0] == 0 and ranges[-1][1] == m.num_layers
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_plan_selection_times_the_settled_plan_beside_the_plan_as_it_was():
    w, c = load_workload("tiny-clip"), make_cluster(8, 4, "CPU")
    chosen = autoplan(w, c, PlannerConfig(planner="wavefront", whole_schedule_islands=False))  # as above
    times = {cand.name: cand.sim.iteration_time for cand in chosen.candidates}
    assert "wavefront+tails" in times and "wavefront+tails+pinned" in times
    assert all(name.replace("+tails", "") in times for name in times)
    assert chosen.sim.iteration_time == min(t for name, t in times.items())


def test_node_groups_take_a_group_s_settled_plan_where_its_estimate_prefers_it():
    from megatron_spindle.planner.node_groups import node_group_partitions, plan_node_groups

    w, c = load_workload("ofasys-4"), make_cluster(16)
    partition = node_group_partitions(w, c)[0]
    plans = {settle: plan_node_groups(w, c, partition, PlannerConfig(planner="wavefront", light_follow=True,
                                                                     settle_tails=settle)).plan
             for settle in (False, True)}
    assert len(plans[True].waves) < len(plans[False].waves)
    assert plans[True].predicted["planner_estimate"] < plans[False].predicted["planner_estimate"]
