"""Turn placed waves into a ``Plan``: slices, inter-wave transfers, parameter device groups, memory, predictions.

Every planner (Spindle, the baselines, CP-SAT) ends here, so the plan's derived fields are computed one way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaGraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan.derive import derive_param_groups, derive_transfers, metaop_infos
from megatron_spindle.plan.memory import MemoryNumbers, plan_memory
from megatron_spindle.plan.schema import (
    TRANSFER_KINDS,
    ExecutionSettings,
    LevelInfo,
    MetaOpInfo,
    Plan,
    PlanError,
    Slice,
    Wave,
)
from megatron_spindle.plan.tp_shards import aligned_device_orders
from megatron_spindle.plan.validate import validate_plan
from megatron_spindle.planner.placement import FlowCostModel
from megatron_spindle.planner.schedule import LevelAllocation, ScheduledWave

DEFAULT_SETTINGS = ExecutionSettings()  # frozen: one shared default is safe


def slice_id(wave_index: int, metaop: str) -> str:
    return f"w{wave_index}:{metaop}"


def assemble_plan(workload: Workload, cluster: ClusterSpec, metagraph: MetaGraph, waves: Sequence[ScheduledWave],
                  cost_model: FlowCostModel, memory_model: MemoryNumbers, planner_info: dict[str, Any],
                  level_allocs: list[LevelAllocation] | None = None, curves: dict[str, Any] | None = None,
                  validate: bool = True, settings: ExecutionSettings = DEFAULT_SETTINGS) -> Plan:
    """Build the plan of placed ``waves`` (every slice has ``devices``) run under ``settings`` and, unless
    ``validate`` is False, check it with ``validate_plan`` (raises ``PlanError``). ``planner_info`` becomes the
    plan's diagnostics (``Plan.planner``).

    Transfers are routed and the memory per device is accounted by plan/ (routing.py, memory.py), the same
    rules the simulator and the runtime apply. ``curves`` maps MetaOp id -> ScalingCurve (only ``source`` and
    ``fit_error`` are read). Without ``level_allocs`` the relaxed optimum is unknown: levels get ``c_star = 0``
    and ``predicted`` has no ``c_star`` / ``gap``.
    """
    _check_placed(waves, metagraph)
    allocs = {a.level: a for a in level_allocs or []}
    plan = Plan(
        workload_name=workload.name,
        workload_digest=workload.digest(),
        cluster=cluster.to_dict(),
        cluster_digest=cluster.digest(),
        planner=dict(planner_info),
        metaops=_metaop_records(metagraph, allocs, curves or {}),
        levels=_level_infos(metagraph, waves, allocs, settings.micro_batches),
        waves=_plan_waves(waves, metagraph),
        transfers=[],
        param_groups=[],
        memory_per_device=[],
        predicted={},
        settings=settings,
    )
    plan.param_groups = derive_param_groups(plan, metagraph.metaops, cost_model.param_count)
    _align_tp_shards(plan, metagraph)
    plan.transfers = derive_transfers(plan, lambda mid: cost_model.activation_bytes(metagraph.metaops[mid]))
    plan.memory_per_device = plan_memory(plan, metagraph.metaops, memory_model)
    plan.predicted = _predictions(plan, cluster, allocs if level_allocs is not None else None)
    if validate:
        validate_plan(plan, workload, cluster, metagraph)
    return plan


def _check_placed(waves: Sequence[ScheduledWave], metagraph: MetaGraph) -> None:
    for wi, w in enumerate(waves):
        seen = set()
        for s in w.slices:
            if s.metaop not in metagraph.metaops:
                raise PlanError(f"wave {wi}: slice of unknown MetaOp '{s.metaop}'")
            if s.devices is None:
                raise PlanError(f"wave {wi}: slice of MetaOp '{s.metaop}' has no devices (run placement first)")
            if s.metaop in seen:
                raise PlanError(f"wave {wi}: MetaOp '{s.metaop}' has two slices in one wave")
            seen.add(s.metaop)


def _align_tp_shards(plan: Plan, metagraph: MetaGraph) -> None:
    """Order each slice's TP groups so a device holds one TP shard of each unit (plan/tp_shards.py): the
    placement chose which devices form a TP group, not which of them takes which TP rank."""
    orders = aligned_device_orders([w.slices for w in plan.waves], metagraph.metaops,
                                   [g.params for g in plan.param_groups], plan.settings)
    for w, wave_orders in zip(plan.waves, orders):
        for s, devices in zip(w.slices, wave_orders):
            s.devices = list(devices)


def _plan_waves(waves: Sequence[ScheduledWave], metagraph: MetaGraph) -> list[Wave]:
    out = []
    for wi, w in enumerate(waves):
        slices = []
        for s in w.slices:
            m = metagraph.metaops[s.metaop]
            slices.append(Slice(id=slice_id(wi, s.metaop), metaop=s.metaop, module=m.module, task=m.task,
                                kind=m.kind, layer_start=s.layer_start, layer_end=s.layer_end,
                                devices=list(s.devices), tp=s.tp, dp=s.dp, predicted_time=float(s.time)))
        out.append(Wave(index=wi, level=w.level, start=float(w.start), duration=float(w.duration), slices=slices))
    return out


def _metaop_records(metagraph: MetaGraph, allocs: dict[int, LevelAllocation],
                    curves: dict[str, Any]) -> list[MetaOpInfo]:
    """The MetaOp records with the planner's diagnostics: allocation tuples, n*, the curve's source and fit."""
    out = metaop_infos(metagraph)
    for info in out:
        alloc, curve = allocs.get(info.level), curves.get(info.id)
        if curve is not None:
            info.curve_source, info.curve_fit_error = curve.source, float(curve.fit_error)
        if alloc:
            info.allocation = [[int(n), int(layers)] for n, layers in alloc.tuples.get(info.id, [])]
            info.n_star = float(alloc.n_star.get(info.id, 0.0))
    return out


def _level_infos(metagraph: MetaGraph, waves: Sequence[ScheduledWave],
                 allocs: dict[int, LevelAllocation], micro_batches: int) -> list[LevelInfo]:
    """Per MetaLevel its span in the waves and C~* scaled to the iteration as the waves are (the allocator
    allocates one micro-batch; the waves run ``micro_batches``)."""
    out = []
    previous_end = 0.0
    for index, metaops in enumerate(metagraph.levels):
        mine = [w for w in waves if w.level == index]
        start = min((w.start for w in mine), default=previous_end)
        end = max((w.end for w in mine), default=start)
        alloc = allocs.get(index)
        out.append(LevelInfo(index=index, metaops=list(metaops),
                             c_star=float(alloc.c_star) * micro_batches if alloc else 0.0,
                             start=float(start), end=float(end)))
        previous_end = end
    return out


def _predictions(plan: Plan, cluster: ClusterSpec, allocs: dict[int, LevelAllocation] | None) -> dict[str, float]:
    """The waves' makespan (an iteration's: the longest device component's, plan/timeline.py), one
    micro-batch's share of it, utilisation, bytes per route kind and, with the allocations, C~* of the
    iteration and the gap to it."""
    micro_batches = plan.settings.micro_batches
    span = plan.iteration_time
    busy = sum(s.predicted_time * len(s.devices) for s in plan.slices())
    predicted = {
        "iteration_time": float(span),
        "micro_batch_time": float(span) / micro_batches,
        "utilisation": float(busy / (cluster.num_devices * span)) if span > 0 else 0.0,
    }
    for kind in TRANSFER_KINDS:
        predicted[f"{kind}_bytes"] = float(sum(t.bytes_by_kind.get(kind, 0.0) for t in plan.transfers))
    if allocs is not None:
        c_star = float(sum(a.c_star for a in allocs.values())) * micro_batches
        predicted["c_star"] = c_star
        predicted["gap"] = span / c_star - 1.0 if c_star > 0 else 0.0
    return predicted
