"""A plan from explicit waves of slices, each given its devices and TP: for runtime tests and benchmarks that need
a layout no planner would choose (e.g. every tower at TP 2 on its own device set). The derived fields (MetaOp
records, routed transfers, parameter device groups) come from plan/derive.py, as for planned plans."""

from __future__ import annotations

from megatron_spindle.estimator import AnalyticCostModel
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan.derive import derive_param_groups, derive_transfers, metaop_infos
from megatron_spindle.plan.schema import LevelInfo, Plan, Slice, Wave
from megatron_spindle.plan.validate import validate_plan, validate_slices

# one slice: (metaop id, layer_start, layer_end, devices, tp)
SliceSpec = tuple[str, int, int, list[int], int]


def plan_from_slices(workload: Workload, cluster: ClusterSpec, waves: list[list[SliceSpec]],
                     validate: bool = True) -> Plan:
    """The plan running ``waves`` in order (wave i's slices at once), every slice's DP = devices / TP; its
    predicted times are placeholders (1 s per wave): time it with the simulator."""
    g = build_metagraph(workload)
    plan_waves = []
    for wi, specs in enumerate(waves):
        slices = [Slice(id=f"w{wi}:{mid}@{ls}", metaop=mid, module=g.metaops[mid].module, task=g.metaops[mid].task,
                        kind=g.metaops[mid].kind, layer_start=ls, layer_end=le, devices=list(devs), tp=tp,
                        dp=len(devs) // tp, predicted_time=1.0)
                  for mid, ls, le, devs, tp in specs]
        plan_waves.append(Wave(index=wi, level=0, start=float(wi), duration=1.0, slices=slices))
    plan = Plan(workload_name=workload.name, workload_digest=workload.digest(), cluster=cluster.to_dict(),
                cluster_digest=cluster.digest(), planner={"planner": "explicit"}, metaops=metaop_infos(g),
                levels=[LevelInfo(i, lv, 0.0, 0.0, 0.0) for i, lv in enumerate(g.levels)], waves=plan_waves,
                transfers=[], param_groups=[], memory_per_device=[], predicted={})
    if validate:  # deriving routes rows by equal DP shares: a slice the rules refuse is named, not routed
        validate_slices(plan, g.metaops)
    cost = AnalyticCostModel(workload, cluster)
    plan.transfers = derive_transfers(plan, lambda mid: cost.activation_bytes(g.metaops[mid]))
    plan.param_groups = derive_param_groups(plan, g.metaops, cost.param_count)
    if validate:
        validate_plan(plan, workload, cluster, g)
    return plan
