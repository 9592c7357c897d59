"""Turn placed waves into a ``Plan``: slices, inter-wave transfers, parameter device groups, memory, predictions.

Every planner (Spindle, the baselines, CP-SAT) ends here, so the plan's derived fields are computed one way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaGraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.planner.placement import (
    DeviceMemoryModel,
    FlowCostModel,
    PlacedRows,
    flow_bytes_by_kind,
    predicted_memory,
    producer_slices,
    slice_units,
    transfer_kind,
)
from megatron_spindle.planner.plan import (
    TRANSFER_KINDS,
    LevelInfo,
    MetaOpInfo,
    ParamGroup,
    Plan,
    PlanError,
    Slice,
    Transfer,
    Wave,
)
from megatron_spindle.planner.schedule import LevelAllocation, ScheduledWave
from megatron_spindle.planner.validate import validate_plan

WEIGHT_BYTES_PER_PARAM = 2  # bf16 weights: the volume a parameter group's gradient all-reduce moves


def slice_id(wave_index: int, metaop: str) -> str:
    return f"w{wave_index}:{metaop}"


def assemble_plan(workload: Workload, cluster: ClusterSpec, metagraph: MetaGraph, waves: Sequence[ScheduledWave],
                  cost_model: FlowCostModel, memory_model: DeviceMemoryModel, settings: dict[str, Any],
                  level_allocs: list[LevelAllocation] | None = None, curves: dict[str, Any] | None = None,
                  validate: bool = True) -> Plan:
    """Build the plan of placed ``waves`` (every slice has ``devices``) and, unless ``validate`` is False,
    check it with ``validate_plan`` (raises ``PlanError``).

    ``curves`` maps MetaOp id -> ScalingCurve (only ``source`` and ``fit_error`` are read). Without
    ``level_allocs`` the relaxed optimum is unknown: levels get ``c_star = 0`` and ``predicted`` has no
    ``c_star`` / ``gap``.
    """
    _check_placed(waves, metagraph)
    plan_waves = _plan_waves(waves, metagraph)
    transfers = _transfers(waves, metagraph, cluster, cost_model)
    memory = predicted_memory(waves, metagraph, memory_model, cluster)
    allocs = {a.level: a for a in level_allocs or []}
    plan = Plan(
        workload_name=workload.name,
        workload_digest=workload.digest(),
        cluster=cluster.to_dict(),
        cluster_digest=cluster.digest(),
        planner=dict(settings),
        metaops=_metaop_infos(metagraph, allocs, curves or {}),
        levels=_level_infos(metagraph, waves, allocs),
        waves=plan_waves,
        transfers=transfers,
        param_groups=param_groups(waves, metagraph, cost_model),
        memory_per_device=memory,
        predicted=_predictions(waves, cluster, transfers, allocs if level_allocs is not None else None),
    )
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


def _transfers(waves: Sequence[ScheduledWave], metagraph: MetaGraph, cluster: ClusterSpec,
               cost_model: FlowCostModel) -> list[Transfer]:
    out = []
    for (wi, si), producers in producer_slices(waves, metagraph).items():
        dst = waves[wi].slices[si]
        for pw, ps in producers:
            src = waves[pw].slices[ps]
            src_metaop = metagraph.metaops[src.metaop]
            total = float(cost_model.activation_bytes(src_metaop))
            rows = PlacedRows.of(src.devices, src.tp, src.dp, src_metaop.batch, total)
            by_kind = flow_bytes_by_kind(rows, dst.devices, dst.tp, dst.dp, cluster)
            out.append(Transfer(producer=slice_id(pw, src.metaop), consumer=slice_id(wi, dst.metaop), bytes=total,
                                kind=transfer_kind(by_kind), src_devices=list(src.devices),
                                dst_devices=list(dst.devices), bytes_by_kind=by_kind))
    return out


def param_groups(waves: Sequence[ScheduledWave], metagraph: MetaGraph, cost_model: FlowCostModel) -> list[ParamGroup]:
    """The parameter device group pool: units held by exactly the same devices form one group.

    Units are listed in order of first use; groups are sorted by their device lists.
    """
    holders: dict[str, set[int]] = {}
    for w in waves:
        for s in w.slices:
            for u in slice_units(metagraph.metaops[s.metaop], s.layer_start, s.layer_end):
                holders.setdefault(u, set()).update(s.devices)
    pool: dict[tuple[int, ...], list[str]] = {}
    for unit, devices in holders.items():
        pool.setdefault(tuple(sorted(devices)), []).append(unit)
    return [
        ParamGroup(devices=list(devs), params=units,
                   bytes=float(sum(WEIGHT_BYTES_PER_PARAM * cost_model.param_count(u) for u in units)))
        for devs, units in sorted(pool.items())
    ]


def _metaop_infos(metagraph: MetaGraph, allocs: dict[int, LevelAllocation], curves: dict[str, Any]) -> list[MetaOpInfo]:
    out = []
    for mid, m in metagraph.metaops.items():
        alloc = allocs.get(m.level)
        curve = curves.get(mid)
        out.append(MetaOpInfo(
            id=mid, task=m.task, module=m.module, kind=m.kind, num_layers=m.num_layers,
            layer_offset=m.layer_offset, input_shape=list(m.input_shape), level=m.level,
            preds=metagraph.predecessors(mid), params=[p for names in m.params for p in names],
            curve_source=curve.source if curve is not None else "analytic",
            curve_fit_error=float(curve.fit_error) if curve is not None else 0.0,
            allocation=[[int(n), int(layers)] for n, layers in alloc.tuples.get(mid, [])] if alloc else [],
            n_star=float(alloc.n_star.get(mid, 0.0)) if alloc else 0.0,
        ))
    return out


def _level_infos(metagraph: MetaGraph, waves: Sequence[ScheduledWave],
                 allocs: dict[int, LevelAllocation]) -> list[LevelInfo]:
    out = []
    previous_end = 0.0
    for index, metaops in enumerate(metagraph.levels):
        mine = [w for w in waves if w.level == index]
        start = min((w.start for w in mine), default=previous_end)
        end = max((w.end for w in mine), default=start)
        alloc = allocs.get(index)
        out.append(LevelInfo(index=index, metaops=list(metaops), c_star=float(alloc.c_star) if alloc else 0.0,
                             start=float(start), end=float(end)))
        previous_end = end
    return out


def _predictions(waves: Sequence[ScheduledWave], cluster: ClusterSpec, transfers: list[Transfer],
                 allocs: dict[int, LevelAllocation] | None) -> dict[str, float]:
    makespan = max((w.end for w in waves), default=0.0)
    busy = sum(s.time * s.n for w in waves for s in w.slices)
    predicted = {
        "iteration_time": float(makespan),
        "utilisation": float(busy / (cluster.num_devices * makespan)) if makespan > 0 else 0.0,
    }
    for kind in TRANSFER_KINDS:
        predicted[f"{kind}_bytes"] = float(sum(t.bytes_by_kind.get(kind, 0.0) for t in transfers))
    if allocs is not None:
        c_star = float(sum(a.c_star for a in allocs.values()))
        predicted["c_star"] = c_star
        predicted["gap"] = makespan / c_star - 1.0 if c_star > 0 else 0.0
    return predicted
