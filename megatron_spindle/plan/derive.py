"""The fields of a plan that follow from the workload's graph and the waves: the MetaOp records, the routed
transfers and the parameter device groups with their gradient all-reduce bytes. Every plan builder (the
assembler, hand-built test plans) and the operator factory's MetaOp records call these."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from megatron_spindle.graph.opgraph import MetaGraph, MetaOp
from megatron_spindle.plan.layout import param_device_groups, transfer_pairs
from megatron_spindle.plan.memory import grad_reduce_bytes
from megatron_spindle.plan.routing import Router, gradient_returns
from megatron_spindle.plan.schema import MetaOpInfo, ParamGroup, Plan, Transfer


def metaop_infos(metagraph: MetaGraph) -> list[MetaOpInfo]:
    """The plan's record of every MetaOp of the graph (without planner diagnostics), in graph order."""
    return [MetaOpInfo(id=mid, task=m.task, module=m.module, kind=m.kind, num_layers=m.num_layers,
                       layer_offset=m.layer_offset, input_shape=list(m.input_shape), level=m.level,
                       preds=metagraph.predecessors(mid), params=[p for names in m.params for p in names],
                       backward=m.backward)
            for mid, m in metagraph.metaops.items()]


def plan_slice_pairs(plan: Plan) -> list[tuple[str, str]]:
    """(producer slice id, consumer slice id) of every transfer the plan needs, in consumer order."""
    waves = [w.slices for w in plan.waves]
    pairs = transfer_pairs(waves, {m.id: m.preds for m in plan.metaops}, {m.id: m.num_layers for m in plan.metaops})
    return [(waves[pw][ps].id, waves[cw][cs].id) for (pw, ps), (cw, cs) in pairs]


def derive_transfers(plan: Plan, activation_bytes: Callable[[str], float]) -> list[Transfer]:
    """Every transfer of the plan, routed; ``activation_bytes(metaop id)`` is a MetaOp's output for its batch."""
    slices = {s.id: s for s in plan.slices()}
    batch = {m.id: int(m.input_shape[0]) for m in plan.metaops}
    grad = {m.id: gradient_returns(m.backward) for m in plan.metaops}
    router = Router(plan.gpus_per_node)
    out = []
    for p, c in plan_slice_pairs(plan):
        src, dst = slices[p], slices[c]
        out.append(router.transfer(p, c, src, dst, batch[src.metaop], float(activation_bytes(src.metaop)),
                                   grad[src.metaop]))
    return out


def derive_param_groups(plan: Plan, metaops: Mapping[str, MetaOp], param_count: Callable[[str], int]) -> list[ParamGroup]:
    """The parameter device group pool, each group's ``bytes`` its gradient all-reduce volume."""
    return [ParamGroup(devices=devices, params=units,
                       bytes=float(grad_reduce_bytes(sum(param_count(u) for u in units), plan.settings)))
            for devices, units in param_device_groups([w.slices for w in plan.waves], metaops)]
