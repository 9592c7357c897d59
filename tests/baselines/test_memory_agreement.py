"""The memory a plan predicts per device is the simulator's peak memory per device, exactly, for Spindle's plan
and every baseline on every cell of benchmarks/paper_eval.py (the greedy wavefront planner, as its default
Spindle column; cells that do not fit 80 GiB are planned on the memory-relaxed cluster, as paper_eval does).
On the same plans every device holds one TP shard of each unit it holds, so the runtime's rings are the
group size / t the simulator and the memory model count (plan/tp_shards.py ``ring_surplus``). The 1024-GPU scale row is covered by its whole-cluster baselines (Spindle's own 1024-GPU plan takes tens of
seconds to make)."""

from __future__ import annotations

import pytest
from script_loader import load_script

from megatron_spindle.baselines import BASELINES, BaselineContext
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.plan.schema import PlanError
from megatron_spindle.plan.tp_shards import ring_surplus
from megatron_spindle.planner.pipeline import PlannerConfig, plan_workload
from megatron_spindle.simulator import simulate

PAPER_EVAL = load_script("benchmarks/paper_eval.py")
CELLS = [(w, n) for w, ns in PAPER_EVAL.PAPER_FIG8.items() for n in ns] + [(w, 256) for w in PAPER_EVAL.PAPER_TABLE2]


@pytest.mark.parametrize("name,gpus", CELLS, ids=[f"{w}-{n}" for w, n in CELLS])
def test_predicted_memory_is_the_simulated_peak_on_every_cell(name, gpus, wavefront_plan):
    try:
        workload, cluster, result = wavefront_plan(name, gpus)
    except PlanError:
        workload, cluster = load_workload(name), PAPER_EVAL.relaxed(make_cluster(gpus))
        result = plan_workload(workload, cluster, PlannerConfig(planner="wavefront"))
    plans = {"spindle": result.plan}
    ctx = BaselineContext(workload, cluster, result.metagraph, result.cost_model, result.memory_model)
    plans.update({b: make(workload, cluster, ctx) for b, make in BASELINES.items()})
    for system, plan in plans.items():
        sim = simulate(plan, workload, cluster, result.cost_model, result.memory_model, metagraph=result.metagraph)
        assert sim.peak_memory == plan.memory_per_device, f"{name} {gpus} {system}"
        assert max(plan.memory_per_device) > 0
        assert ring_surplus([w.slices for w in plan.waves], result.metagraph.metaops,
                            [g.params for g in plan.param_groups], plan.settings) == 0, f"{name} {gpus} {system}"


@pytest.mark.parametrize("system", ["spindle-seq", "deepspeed"])
def test_whole_cluster_baselines_at_1024_gpus(system):
    """The scale row's cluster: whole-cluster plans (every MetaOp on all 1024 devices) assemble and simulate
    in seconds, with the same memory on both sides."""
    workload, cluster = load_workload("clip-20"), make_cluster(1024)
    ctx = BaselineContext.build(workload, cluster)
    plan = BASELINES[system](workload, cluster, ctx)
    assert {len(s.devices) for s in plan.slices()} & {1024}
    sim = simulate(plan, workload, cluster, ctx.cost_model, ctx.memory_model, metagraph=ctx.metagraph)
    assert sim.peak_memory == plan.memory_per_device
    assert sim.transfer_bytes_by_kind == pytest.approx(
        {k: sum(t.bytes_by_kind[k] for t in plan.transfers) for k in sim.transfer_bytes_by_kind})
