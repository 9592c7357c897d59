"""Issue 14's memory options on a baseline's plan: micro-batches and the cheapest recomputation per slice.

A baseline planner (systems.py) tunes the ZeRO stage and all-or-nothing recomputation. ``with_memory_options``
gives it the options Spindle's planner has: for each micro-batch count m it plans the workload at the
micro-batch's batch (every task's batch / m), takes that plan back to the workload with m micro-batches
(``retarget``: the same waves, the workload's MetaOp records and whole-batch transfers), then gives every layer
slice the cheapest recomputation whose memory fits, in the plan's own order (planner/memory_options.py), and
keeps the fastest plan the simulator times that fits. The counts follow Spindle's rule
(plan/layout.py micro_batch_choices): 1, 2 and 4 under auto, 1 alone where a task has a contrastive loss (whose
negatives micro-batches would shrink), N as given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from megatron_spindle.estimator import AnalyticCostModel, MemoryModel
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaGraph, build_metagraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan.buckets import wave_rounds
from megatron_spindle.plan.derive import derive_transfers, metaop_infos
from megatron_spindle.plan.layout import micro_batch_choices, micro_batch_metaop
from megatron_spindle.plan.memory import ZeroSharded, plan_memory
from megatron_spindle.plan.order import slice_order
from megatron_spindle.plan.schema import Plan, PlanError, Recompute
from megatron_spindle.plan.validate import validate_plan
from megatron_spindle.planner.memory_options import RecomputeError, RecomputePolicy, choose_recompute
from megatron_spindle.planner.schedule import scheduled_slice
from megatron_spindle.simulator import SimResult, simulate

MICRO_BATCHES = (1, 2, 4)


def micro_workload(workload: Workload, m: int) -> Workload:
    """The workload with every task's batch divided by ``m``."""
    return Workload(workload.name, workload.modules,
                    [dataclasses.replace(t, batch_size=t.batch_size // m) for t in workload.tasks])


def retarget(plan: Plan, workload: Workload, metagraph: MetaGraph, cost_model, m: int) -> Plan:
    """A plan made for ``micro_workload(workload, m)`` as a plan of ``workload`` with m micro-batches: the same
    waves (their times for m micro-batches), the workload's MetaOp records, transfers of its whole batches."""
    waves = [dataclasses.replace(w, start=m * w.start, duration=m * w.duration,
                                 slices=[dataclasses.replace(s, predicted_time=m * s.predicted_time)
                                         for s in w.slices]) for w in plan.waves]
    out = dataclasses.replace(plan, workload_digest=workload.digest(), metaops=metaop_infos(metagraph), waves=waves,
                              planner=dict(plan.planner), predicted=dict(plan.predicted),
                              settings=dataclasses.replace(plan.settings, micro_batches=m))
    out.transfers = derive_transfers(out, lambda mid: cost_model.activation_bytes(metagraph.metaops[mid]))
    return out


def with_cheapest_recompute(plan: Plan, metagraph: MetaGraph, cost_model, memory_model,
                            cluster: ClusterSpec) -> Plan | None:
    """The plan with every layer slice at the cheapest recomputation that fits, in the plan's own order (None
    when nothing fits). Cheapest as the planner's memory search counts it (planner/memory_options.py): a second
    of recomputation costs what it lengthens its wave, by the plan's predicted times of one micro-batch."""
    base = dataclasses.replace(plan.settings, recompute=Recompute(), slice_recompute={})
    order = slice_order([[s.task for s in w.slices] for w in plan.waves], base)
    m = base.micro_batches
    micro = {mid: micro_batch_metaop(op, m) for mid, op in metagraph.metaops.items()}
    waves = [[dataclasses.replace(scheduled_slice(s), time=s.predicted_time / m) for s in w.slices]
             for w in plan.waves]
    try:
        numbers = ZeroSharded.of(memory_model, base, plan.gpus_per_node)
        choices = choose_recompute(waves, micro, numbers, cost_model, cluster.gpu.memory_bytes, order,
                                   RecomputePolicy(), cluster.num_devices, cluster.gpu.name,
                                   [w.duration / m for w in plan.waves],
                                   rounds=wave_rounds(len(plan.waves), base))
    except RecomputeError:
        return None
    per_slice = {plan.waves[wi].slices[si].id: rc for (wi, si), rc in choices.items() if rc.mode != "none"}
    return dataclasses.replace(plan, settings=dataclasses.replace(base, slice_recompute=per_slice))


def with_memory_options(build: Callable, workload: Workload, cluster: ClusterSpec,
                        micro_batches: str = "auto", metagraph: MetaGraph | None = None,
                        ) -> tuple[Plan, SimResult, AnalyticCostModel, MemoryModel]:
    """The fastest simulated plan of ``build(workload, cluster, ctx)`` (a baseline planner) over the micro-batch
    counts of ``--spindle-micro-batches micro_batches`` that divide every batch, each with the cheapest
    recomputation per slice that fits (module docstring); with the models it was timed with. Raises PlanError
    when none fits."""
    from megatron_spindle.baselines.systems import BaselineContext

    g = metagraph or build_metagraph(workload)
    cost = AnalyticCostModel(workload, cluster)
    memory = MemoryModel(workload, cluster, cost)
    best = None
    counts = micro_batch_choices(micro_batches, g.metaops.values(), MICRO_BATCHES)
    for m in counts:
        if any(t.batch_size % m for t in workload.tasks):
            continue
        small = micro_workload(workload, m)
        planned = build(small, cluster, BaselineContext.build(small, cluster))
        plan = with_cheapest_recompute(retarget(planned, workload, g, cost, m), g, cost, memory, cluster)
        if plan is None:
            continue
        plan.memory_per_device = plan_memory(plan, g.metaops, memory)
        validate_plan(plan, workload, cluster, g)
        sim = simulate(plan, workload, cluster, cost, memory, metagraph=g)
        if best is None or sim.iteration_time < best[1].iteration_time:
            best = (plan, sim)
    if best is None:
        raise PlanError(f"no micro-batch count of {counts} and no recomputation fits device memory")
    return best[0], best[1], cost, memory
