"""Tasks partitioned over groups of whole nodes (planner/node_groups.py): every partition covers each task once
and every node once; the merged plan is a valid plan of the whole workload whose slices stay on their group's
nodes, so no activation crosses a node (fewer inter-node transfer bytes than the plain wavefront plan's);
autoplan proposes it on several nodes and still never returns a plan slower than the task-sequential one."""

from __future__ import annotations

from functools import lru_cache

import pytest

from megatron_spindle.autoplan import autoplan
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.plan.validate import validate_plan
from megatron_spindle.planner.node_groups import node_group_partitions, plan_node_groups
from megatron_spindle.planner.pipeline import PlannerConfig, plan_workload

CELLS = [("tiny-clip", 4, 2), ("clip-4", 16, 8)]  # (workload, GPUs, GPUs per node): 2 nodes each


@lru_cache(maxsize=None)
def _cell(name: str, gpus: int, per_node: int):
    return load_workload(name), make_cluster(gpus, gpus_per_node=per_node)


@pytest.mark.parametrize("name,gpus,per_node", CELLS + [("clip-10", 32, 8)])
def test_partitions_cover_every_task_and_node_once(name, gpus, per_node):
    w, c = _cell(name, gpus, per_node)
    partitions = node_group_partitions(w, c)
    assert partitions, "several nodes and tasks: at least one partition"
    for partition in partitions:
        assert len(partition) >= 2
        tasks = [t for g in partition for t in g.tasks]
        assert sorted(tasks) == sorted(t.name for t in w.tasks)
        nodes = [g.first_node + i for g in partition for i in range(g.num_nodes)]
        assert nodes == list(range(c.num_nodes))
    assert len({tuple(p) for p in partitions}) == len(partitions)  # each proposed once


def test_sharing_aware_partitions_sync_fewer_shared_parameters():
    """CLIP-10's towers are shared by several tasks: beside the balanced partition, one that syncs fewer of
    their parameters across groups, within the balance tolerance."""
    from megatron_spindle.estimator import AnalyticCostModel
    from megatron_spindle.graph.opgraph import build_metagraph
    from megatron_spindle.planner.node_groups import SHARING_TOLERANCES, shared_cut, task_params, task_work

    w, c = _cell("clip-10", 32, 8)
    mg = build_metagraph(w)
    cost = AnalyticCostModel(w, c)
    params, work = task_params(mg, cost), task_work(mg, cost)
    by_k: dict[int, list] = {}
    for p in node_group_partitions(w, c, mg):
        by_k.setdefault(len(p), []).append(p)
    assert any(len(ps) > 1 for ps in by_k.values())
    for ps in by_k.values():
        balanced, *others = ps
        cuts = [shared_cut([list(g.tasks) for g in p], params) for p in ps]
        worst = [max(sum(work[t] for t in g.tasks) / g.num_nodes for g in p) for p in ps]
        for cut, load in zip(cuts[1:], worst[1:]):
            assert cut < cuts[0]
            assert load <= max(SHARING_TOLERANCES) * worst[0] * (1 + 1e-9)


@pytest.mark.parametrize("name,gpus,per_node", CELLS)
def test_node_group_plan_is_valid_and_keeps_activations_on_its_nodes(name, gpus, per_node):
    w, c = _cell(name, gpus, per_node)
    plain = plan_workload(w, c, PlannerConfig(planner="wavefront", select="none")).plan
    for partition in node_group_partitions(w, c):
        result = plan_node_groups(w, c, partition)
        plan = result.plan
        validate_plan(plan, w, c, result.metagraph)
        for g in partition:
            mine = range(g.first_node * c.gpus_per_node, (g.first_node + g.num_nodes) * c.gpus_per_node)
            for s in plan.slices():
                if s.task in g.tasks:
                    assert set(s.devices) <= set(mine), f"slice {s.id} of {s.task} leaves its nodes"
        # a task's transfers stay inside its group; one node per group: on NVLink only
        if all(g.num_nodes == 1 for g in partition):
            assert plan.predicted["inter_island_bytes"] == 0.0
        assert plan.predicted["inter_island_bytes"] < plain.predicted["inter_island_bytes"]
        assert {s.task for s in plan.slices()} == {t.name for t in w.tasks}


@pytest.mark.parametrize("name,gpus,per_node", CELLS)
def test_autoplan_times_the_node_groups_and_is_not_slower_than_task_sequential(name, gpus, per_node):
    w, c = _cell(name, gpus, per_node)
    chosen = autoplan(w, c, PlannerConfig(planner="wavefront"))
    by_name = {cand.name: cand for cand in chosen.candidates}
    assert any(n.startswith("node-groups-") for n in by_name)
    fitting = [cand for cand in chosen.candidates if cand.fits]
    assert chosen.sim.iteration_time == pytest.approx(min(x.sim.iteration_time for x in fitting), rel=1e-9)
    sequential = [x.sim.iteration_time for x in fitting if x.name.startswith("task-sequential")]
    assert sequential and chosen.sim.iteration_time <= min(sequential) * (1 + 1e-9)
    validate_plan(chosen.plan, w, c, chosen.result.metagraph)


def test_autoplan_with_cpsat_refines_the_fastest_partition_per_group():
    w, c = _cell("tiny-clip", 4, 2)
    chosen = autoplan(w, c, PlannerConfig(planner="cpsat", solver_time_limit=1.0, solver_workers=1))
    names = [cand.name for cand in chosen.candidates]
    assert len(names) == len(set(names))
    refined = [cand for cand in chosen.candidates if cand.name.startswith("node-groups-") and "+cpsat" in cand.name]
    assert refined
    for cand in refined:
        validate_plan(cand.plan, w, c, cand.result.metagraph)
        assert cand.plan.planner["planner"] == "cpsat-node-groups"
    assert chosen.sim.iteration_time <= min(x.sim.iteration_time for x in chosen.candidates
                                            if x.name.startswith("task-sequential")) * (1 + 1e-9)


def test_estimate_runs_each_group_on_its_own_devices():
    """The merged plan's waves join the groups level by level, but no device or hand-off joins them: the
    planner's estimate runs the steps as dataflow, each phase starting when its own devices are free, so its
    compute span is the longest group's own, below the sum of the merged steps' maxima (barriers)."""
    from megatron_spindle.plan.order import BWD, slice_order
    from megatron_spindle.plan.timeline import device_components
    from megatron_spindle.planner.objective import estimate_iteration, slice_phases

    w, c = _cell("clip-4", 16, 8)
    partition = node_group_partitions(w, c)[0]
    result = plan_node_groups(w, c, partition)
    plan, mg = result.plan, result.metagraph
    component = device_components(plan)
    groups = {}
    for g in partition:
        groups.update({t: g.first_node for t in g.tasks})
    # one component per group: slices of two groups never share one
    by_group = {}
    for s in plan.slices():
        by_group.setdefault(groups[s.task], set()).add(component[s.id])
    assert all(len(v) == 1 for v in by_group.values()) and len(set().union(*by_group.values())) == len(partition)
    # the span by hand: each phase starts when its devices are free; per group, its devices' last end
    phases = slice_phases(plan, mg.metaops, result.cost_model)
    waves = plan.waves
    clock: dict[int, float] = {}
    spans: dict[int, float] = {}
    tasks = [[s.task for s in wv.slices] for wv in waves]
    steps: dict[tuple[int, str], float] = {}
    for wi, si, phase in slice_order(tasks, plan.settings):
        s = waves[wi].slices[si]
        own = phases[s.id][1 if phase == BWD else 0]
        end = max(clock.get(d, 0.0) for d in s.devices) + own
        clock.update({d: end for d in s.devices})
        spans[groups[s.task]] = max(spans.get(groups[s.task], 0.0), end)
        steps[(wi, phase)] = max(steps.get((wi, phase), 0.0), own)
    merged = sum(steps.values())
    estimate = estimate_iteration(plan, mg, c, result.cost_model)
    assert estimate.waves == pytest.approx(max(spans.values()) * plan.settings.micro_batches)
    assert estimate.waves < merged * plan.settings.micro_batches


def test_node_groups_plan_on_a_whole_profile_with_its_cost_model():
    """Given a profile's measurements, the merged plan is estimated (and selected) on the profiled model, as the
    other candidates are: a measured tower that is 10x the analytic time shows in the plan's estimate."""
    from megatron_spindle.estimator import AnalyticCostModel, Measurement, ProfiledCostModel
    from megatron_spindle.estimator.profile import Profile
    from megatron_spindle.graph.opgraph import build_metagraph

    w, c = _cell("tiny-clip", 4, 2)
    graph, analytic = build_metagraph(w), AnalyticCostModel(w, c)
    tower = graph.metaops["vision_depth/vision"]
    members = [m for m in graph.metaops if m.endswith("/vision")]
    slow = 10 * analytic.layer_cost(tower, 1, 1).step
    profile = Profile({}, [Measurement(tower.id, members, 1, 1, 1, slow, 0.0, "none", 0.0)])
    partition = node_group_partitions(w, c)[0]
    measured = plan_node_groups(w, c, partition, profile=profile)
    assert isinstance(measured.cost_model, ProfiledCostModel)
    plain = plan_node_groups(w, c, partition)
    assert type(plain.cost_model) is AnalyticCostModel
    assert measured.plan.predicted["planner_estimate"] > plain.plan.predicted["planner_estimate"]


def test_node_groups_plan_with_a_profile_of_the_whole_cluster():
    """A profile of every MetaOp on the whole cluster (points up to all its devices) plans each group on its
    share: the group's own MetaOps, the points that fit its nodes (it was refused for naming the other groups'
    MetaOps before)."""
    from megatron_spindle.estimator import AnalyticCostModel, valid_configs
    from megatron_spindle.estimator.curve import CurvePoint
    from megatron_spindle.graph.opgraph import build_metagraph

    w = load_workload("tiny-clip")
    c = make_cluster(4, 2, "CPU")  # 2 nodes of 2
    graph, model = build_metagraph(w), AnalyticCostModel(w, c)
    points = {mid: [CurvePoint(tp * dp, tp, dp, 2 * model.layer_cost(m, tp, dp).step, "profiled")
                    for tp, dp in valid_configs(m, w, c)] for mid, m in graph.metaops.items()}
    assert any(p.n == 4 for pts in points.values() for p in pts)
    partition = next(p for p in node_group_partitions(w, c) if all(g.num_nodes == 1 for g in p))
    result = plan_node_groups(w, c, partition, profile=points)
    validate_plan(result.plan, w, c, result.metagraph)
    assert {m.curve_source for m in result.plan.metaops} == {"profiled"}


def test_group_sizes_are_every_non_increasing_composition_and_coarsen_on_many_nodes():
    """Up to MAX_SIZE_STEPS nodes every non-increasing set of group sizes is tried, in the order the old
    enumeration of every cut gave (ties keep their winner); beyond, sizes move in steps, so that 1024 GPUs (128
    nodes, whose cuts into 8 groups number 1e11: planning never finished) partition in about a second."""
    import itertools

    from megatron_spindle.planner.node_groups import MAX_SIZE_STEPS, group_sizes

    def every_cut(total, parts):
        for cut in itertools.combinations(range(1, total), parts - 1):
            sizes = [b - a for a, b in zip((0,) + cut, cut + (total,))]
            if sizes == sorted(sizes, reverse=True):
                yield sizes

    for nodes in range(2, 19):
        for k in range(2, 9):
            assert list(group_sizes(nodes, k)) == list(every_cut(nodes, k)), (nodes, k)
    assert MAX_SIZE_STEPS >= 32  # QWen-VAL's 256 GPUs (32 nodes) keep every size
    for nodes in (128, 1000):
        step = -(-nodes // MAX_SIZE_STEPS)
        tried = [list(group_sizes(nodes, k)) for k in range(2, 9)]
        # at most as many as for MAX_SIZE_STEPS nodes (3318 sets of sizes into 2-8 groups at 32)
        assert sum(map(len, tried)) <= sum(len(list(group_sizes(MAX_SIZE_STEPS, k))) for k in range(2, 9))
        for found in tried:
            assert found
            for sizes in found:
                assert sum(sizes) == nodes and sizes == sorted(sizes, reverse=True)
                assert all(s % step == 0 for s in sizes[1:])
    partitions = node_group_partitions(load_workload("clip-20"), make_cluster(1024))
    assert partitions and all(sum(g.num_nodes for g in p) == 128 for p in partitions)


@pytest.mark.parametrize("name,given", [("tiny-clip", "1"), ("tiny-vlm", "auto")])
def test_groups_keep_one_micro_batch_where_the_workload_has_a_contrastive_loss(name, given, monkeypatch):
    """The plan has one micro-batch count, and auto never splits a contrastive batch (plan/layout.py
    micro_batch_choices): a group of LM tasks alone must not choose several for the whole plan."""
    import megatron_spindle.planner.node_groups as node_groups

    w, c = load_workload(name), make_cluster(4, gpus_per_node=2)
    seen = []
    planned = node_groups._plan_group

    def spy(workload, cluster, group, config, *rest):
        seen.append(config.micro_batches)
        return planned(workload, cluster, group, config, *rest)

    monkeypatch.setattr(node_groups, "_plan_group", spy)
    partition = node_group_partitions(w, c)[0]
    plan = plan_node_groups(w, c, partition, PlannerConfig(planner="wavefront")).plan
    assert seen and set(seen) == {given}
    assert plan.settings.micro_batches == 1
