"""A slice's phase seconds (estimator/slice_time.py): ZeRO-3's gathers prefetched one layer ahead, the one rule
the simulator and the planner's estimate both charge."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_spindle.baselines import BASELINES, BaselineContext
from megatron_spindle.estimator.comm_model import CommModel, GroupPlacement
from megatron_spindle.estimator.slice_time import layer_gather_seconds, prefetched_phase_seconds
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.planner.objective import estimate_iteration, slice_phases
from megatron_spindle.simulator import SimSettings, simulate
from megatron_spindle.simulator.engine import _build_context


def test_prefetched_phase_hides_all_gathers_but_the_first():
    assert prefetched_phase_seconds(2.0, 0.0, 5, 1.2) == pytest.approx(10.0)
    assert prefetched_phase_seconds(2.0, 0.5, 1, 1.2) == pytest.approx(2.5)  # one layer: its gather alone
    # the gather (1.2 x 0.5 s beside compute) ends first: each later layer takes 0.2 x 0.5 s more
    assert prefetched_phase_seconds(2.0, 0.5, 4, 1.2) == pytest.approx(0.5 + 3 * (2.0 + 0.1) + 2.0)
    # a gather longer than the slowed compute: each later layer waits for it (1.2 x 3 s)
    assert prefetched_phase_seconds(2.0, 3.0, 4, 1.2) == pytest.approx(3.0 + 3 * 3.6 + 2.0)
    # a latency beside compute: 0.1 s more on the gather, 0.1 / 1.2 of it caught up by the compute
    assert prefetched_phase_seconds(2.0, 0.5, 2, 1.2, 0.1) == pytest.approx(0.5 + 2.0 + 0.1 + 0.1 * (1 - 1 / 1.2) + 2.0)
    # the two regimes meet where the slowed gather equals the slowed compute
    edge = 2.0 - 0.1 / 1.2
    assert prefetched_phase_seconds(2.0, edge, 2, 1.2, 0.1) == pytest.approx(
        prefetched_phase_seconds(2.0, edge + 1e-9, 2, 1.2, 0.1))


@pytest.fixture(scope="module")
def zero3_plan():
    w, c = load_workload("clip-4"), make_cluster(8)
    ctx = BaselineContext.build(w, c)
    plan = BASELINES["deepspeed"](w, c, ctx)
    return w, c, ctx, {z: dataclasses.replace(plan, settings=dataclasses.replace(plan.settings, zero_stage=z))
                       for z in (2, 3)}


def test_zero3_gathers_are_charged_alike_by_simulator_and_planner(zero3_plan):
    w, c, ctx, plans = zero3_plan
    comm = CommModel(c)
    metaops = ctx.metagraph.metaops
    sim = _build_context(plans[3], c, ctx.metagraph, ctx.cost_model, SimSettings())
    planner = slice_phases(plans[3], metaops, ctx.cost_model, comm)
    at_stage_2 = slice_phases(plans[2], metaops, ctx.cost_model, comm)
    layered = 0
    for s in plans[3].slices():
        assert planner[s.id] == pytest.approx((sim.fwd_time[s.id], sim.bwd_time[s.id]), rel=1e-12)
        gather = layer_gather_seconds(ctx.cost_model, comm, metaops[s.metaop], s)
        if gather > 0 and s.num_layers > 1:
            layered += 1
            fwd2, bwd2 = at_stage_2[s.id]
            fwd3, bwd3 = planner[s.id]
            # at least the first gather, at most every gather alone
            assert fwd2 + gather <= fwd3 <= fwd2 + s.num_layers * gather * comm.overlap_slowdown
            assert bwd2 + gather <= bwd3
    assert layered, "the plan has data-parallel towers of several layers"
    # the estimate sees the gathers: it stays near the simulated iteration at stage 3
    est = estimate_iteration(plans[3], ctx.metagraph, c, ctx.cost_model)
    simulated = simulate(plans[3], w, c, ctx.cost_model, ctx.memory_model, metagraph=ctx.metagraph).iteration_time
    assert est.total == pytest.approx(simulated, rel=0.05)


def test_node_local_weight_shards_gather_a_layer_inside_the_node():
    """A TP-2 slice on two 8-GPU nodes: its layer gathers cross the nodes (each TP rank's 8 DP ranks, 4 per node,
    two rings sharing the network); with node-local weight shards they run over the 4 ranks on one node."""
    w, c = load_workload("clip-4"), make_cluster(16)
    ctx = BaselineContext.build(w, c)
    comm = CommModel(c)
    metaop = next(m for m in ctx.metagraph.metaops.values() if m.kind == "layer" and m.params)
    s = dataclasses.replace(next(iter(BASELINES["deepspeed"](w, c, ctx).slices())), devices=list(range(16)), tp=2,
                            dp=8)
    layer = sum(ctx.cost_model.param_count(p) for p in metaop.params[0]) * 2 / 2  # bf16, a TP shard
    across = layer_gather_seconds(ctx.cost_model, comm, metaop, s)
    inside = layer_gather_seconds(ctx.cost_model, comm, metaop, s, node_local=True)
    assert across == pytest.approx(comm.all_gather(layer, GroupPlacement((4, 4)), 2))
    assert inside == pytest.approx(comm.all_gather(layer, GroupPlacement((4,))))
    assert 0 < inside < across
