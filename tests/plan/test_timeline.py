"""Device components keep their own wave clocks (plan/timeline.py): a plan of one component keeps its waves'
starts to the bit; a node-group plan's groups run side by side, each on its own clock, and its predicted
makespan and utilisation are the longest group's, not the merged waves'."""

from __future__ import annotations

from functools import lru_cache

import pytest

from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.plan.timeline import device_components, makespan, slice_starts
from megatron_spindle.planner.node_groups import node_group_partitions, plan_node_groups
from megatron_spindle.planner.pipeline import PlannerConfig, make_plan


@lru_cache(maxsize=None)
def _node_group_plan():
    w, c = load_workload("clip-4"), make_cluster(16, gpus_per_node=8)
    partition = node_group_partitions(w, c)[0]
    return plan_node_groups(w, c, partition).plan, partition


def test_one_component_keeps_the_waves_clock():
    plan = make_plan(load_workload("tiny-clip"), make_cluster(4), PlannerConfig(planner="wavefront"))
    assert len(set(device_components(plan).values())) == 1
    assert slice_starts(plan) == {s.id: w.start for w in plan.waves for s in w.slices}
    assert makespan(plan) == plan.waves[-1].end == plan.predicted["iteration_time"]


def test_node_groups_run_on_their_own_clocks():
    plan, partition = _node_group_plan()
    group_of = {t: gi for gi, g in enumerate(partition) for t in g.tasks}
    # by hand: per group, its slices back to back wave after wave, each wave as long as the group's longest
    clock = [0.0] * len(partition)
    expected = {}
    for w in plan.waves:
        longest = {}
        for s in w.slices:
            expected[s.id] = clock[group_of[s.task]]
            longest[group_of[s.task]] = max(longest.get(group_of[s.task], 0.0), s.predicted_time)
        for g, t in longest.items():
            clock[g] += t
    starts = slice_starts(plan)
    assert starts == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert any(starts[s.id] < w.start for w in plan.waves for s in w.slices)  # not the merged waves' starts
    assert makespan(plan) == pytest.approx(max(clock)) == plan.iteration_time  # the Plan's own span too
    assert makespan(plan) < plan.waves[-1].end
    predicted = plan.predicted
    assert predicted["iteration_time"] == pytest.approx(max(clock))
    busy = sum(s.predicted_time * len(s.devices) for s in plan.slices())
    assert predicted["utilisation"] == pytest.approx(busy / (plan.num_devices * max(clock)))


def test_node_group_plan_keeps_each_groups_allocation():
    """The summary's n* and allocation columns: the merged plan has no allocator, its MetaOps keep their group's."""
    plan, _ = _node_group_plan()
    for m in plan.metaops:
        assert m.n_star > 0, m.id
        assert sum(layers for _, layers in m.allocation) == m.num_layers, m.id
