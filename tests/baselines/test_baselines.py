"""Every baseline planner emits a valid plan; the structure each one promises holds; the simulator times them."""

from __future__ import annotations

import pytest

from megatron_spindle.baselines import BASELINES, BaselineContext, optimus_allocation, task_metaops
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.plan.validate import validate_plan
from megatron_spindle.simulator import simulate

CASES = [("tiny-clip", 8), ("tiny-vlm", 4), ("clip-4", 8), ("ofasys-4", 8)]


@pytest.fixture(scope="module")
def contexts():
    out = {}
    for name, n in CASES:
        w, c = load_workload(name), make_cluster(n)
        out[(name, n)] = BaselineContext.build(w, c)
    return out


@pytest.mark.parametrize("system", sorted(BASELINES))
@pytest.mark.parametrize("case", CASES, ids=[f"{w}-{n}" for w, n in CASES])
def test_baseline_plan_is_valid_and_simulates(contexts, system, case):
    ctx = contexts[case]
    plan = BASELINES[system](ctx.workload, ctx.cluster, ctx)
    validate_plan(plan, ctx.workload, ctx.cluster, ctx.metagraph, check_memory=plan.planner["memory_ok"])
    assert plan.planner["planner"] == system
    r = simulate(plan, ctx.workload, ctx.cluster, ctx.cost_model, ctx.memory_model, metagraph=ctx.metagraph)
    assert r.iteration_time > 0
    assert r.iteration_time == pytest.approx(plan.planner["simulated_iteration_time"])
    assert (r.compute_time + r.transfer_time + r.grad_sync_time + r.optimizer_time + r.param_gather_time
            == pytest.approx(r.iteration_time))
    assert r.optimizer_time > 0  # the analytic AdamW step of the devices that finish last
    # DeepSpeed's ZeRO-1/2 gathers the weights in its step; the systems built on Megatron-LM overlap the gather
    assert plan.settings.overlap_param_gather is (system != "deepspeed")
    # every wave index is in exactly one segment, and each segment holds one task (or Optimus' task groups)
    segments = plan.settings.segments
    assert sorted(i for seg in segments for i in seg) == [w.index for w in plan.waves]
    for seg in segments:
        tasks = {s.task for i in seg for s in plan.waves[i].slices}
        assert len(tasks) == 1


@pytest.mark.parametrize("case", CASES, ids=[f"{w}-{n}" for w, n in CASES])
def test_temporal_baselines_give_each_task_the_cluster_in_turn(contexts, case):
    ctx = contexts[case]
    n = ctx.cluster.num_devices
    ds = BASELINES["deepspeed"](ctx.workload, ctx.cluster, ctx)
    for w in ds.waves:
        assert len(w.slices) == 1
        s = w.slices[0]
        assert s.tp == 1 and s.dp == len(s.devices)
        batch = ctx.metagraph.metaops[s.metaop].batch
        assert s.dp == max(d for d in range(1, min(batch, n) + 1) if batch % d == 0)
    assert ds.settings.zero_stage in (0, 1, 2, 3)
    seq = BASELINES["spindle-seq"](ctx.workload, ctx.cluster, ctx)
    assert all(len(w.slices) == 1 for w in seq.waves)
    # tasks run in declaration order, one segment each
    order = [seq.waves[seg[0]].slices[0].task for seg in seq.settings.segments]
    assert order == [t.name for t in ctx.workload.tasks]


def test_deepspeed_picks_the_fastest_zero_stage_that_fits(contexts):
    ctx = contexts[("clip-4", 8)]
    plan = BASELINES["deepspeed"](ctx.workload, ctx.cluster, ctx)
    search = plan.planner["search"]
    fitting = {k: v["time"] for k, v in search.items() if v["memory_ok"]}
    assert fitting, "some ZeRO stage fits a 1.2B model on 8 x 80 GiB"
    assert plan.planner["simulated_iteration_time"] <= min(fitting.values()) * (1 + 1e-3)
    assert set(search) == {"zero0", "zero1", "zero2", "zero3"}  # every stage tried (their costs: test_simulator)


def test_distmm_splits_towers_side_by_side_when_it_pays(contexts):
    ctx = contexts[("clip-4", 8)]
    plan = BASELINES["distmm"](ctx.workload, ctx.cluster, ctx)
    multi = [w for w in plan.waves if len(w.slices) > 1]
    assert multi, "contrastive towers of one task run concurrently on split devices"
    for w in multi:
        assert len({s.task for s in w.slices}) == 1
        assert sum(len(s.devices) for s in w.slices) <= ctx.cluster.num_devices


def test_optimus_runs_tasks_on_disjoint_device_groups(contexts):
    ctx = contexts[("ofasys-4", 8)]
    groups = optimus_allocation(ctx)
    assert sum(size for _, size in groups) <= ctx.cluster.num_devices
    assert sorted(t for names, _ in groups for t in names) == sorted(t.name for t in ctx.workload.tasks)
    plan = BASELINES["optimus"](ctx.workload, ctx.cluster, ctx)
    devices_of = {}
    for s in plan.slices():
        devices_of.setdefault(s.task, set()).update(s.devices)
    tasks = list(devices_of)
    for i, a in enumerate(tasks):
        for b in tasks[i + 1:]:
            assert not devices_of[a] & devices_of[b], f"tasks {a} and {b} share devices"
    # concurrent tasks: the simulated time is below the sum of the tasks' own times
    r = simulate(plan, ctx.workload, ctx.cluster, ctx.cost_model, ctx.memory_model, metagraph=ctx.metagraph)
    assert r.iteration_time < sum(s.predicted_time for s in plan.slices())


def test_optimus_packs_more_tasks_than_devices_onto_single_devices():
    w, c = load_workload("clip-10"), make_cluster(8)
    ctx = BaselineContext.build(w, c)
    groups = optimus_allocation(ctx)
    assert len(groups) == 8 and all(size == 1 for _, size in groups)
    assert sorted(t for names, _ in groups for t in names) == sorted(t.name for t in w.tasks)


def test_task_metaops_cover_every_metaop_once(contexts):
    ctx = contexts[("ofasys-4", 8)]
    seen = [m.id for t in ctx.workload.tasks for level in task_metaops(ctx.metagraph, t.name) for m in level]
    assert sorted(seen) == sorted(ctx.metagraph.metaops)
