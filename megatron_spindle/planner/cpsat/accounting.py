"""Every byte the CP-SAT planner counts: per-device memory and inter-island bytes of placed waves, and the
per-layer and per-MetaOp coefficients its models use. The only module of the planner that reads the cost
model and the memory model, so one set of rules (placement's today) serves the search and the models.
"""

from __future__ import annotations

from typing import Protocol

from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaGraph, MetaOp
from megatron_spindle.planner.placement import GRAD_BYTES_PER_PARAM, FlowCostModel, predicted_memory
from megatron_spindle.planner.schedule import ScheduledSlice, ScheduledWave


class MemoryModel(Protocol):
    """What the CP-SAT planner reads of the estimator's ``MemoryModel`` (placement's DeviceMemoryModel and
    the ``dp`` the distributed optimizer shards by). Of the cost model it reads placement's FlowCostModel."""

    def param_state_bytes(self, param_name: str, tp: int, dp: int = 1) -> float: ...

    def activation_bytes(self, metaop: MetaOp, tp: int, dp: int, num_layers: int) -> float: ...


# ------------------------------------------------------------------------------------------ placed waves


def device_memory(waves: list[ScheduledWave], metagraph: MetaGraph, memory_model: MemoryModel,
                  cluster: ClusterSpec) -> list[float]:
    """Per-device bytes of placed waves: each parameter unit's state once per device (at the largest shard
    held), plus every slice's activations; the assembler's accounting (placement.predicted_memory)."""
    return list(predicted_memory(waves, metagraph, memory_model, cluster))


def fits_memory(waves: list[ScheduledWave], metagraph: MetaGraph, memory_model: MemoryModel,
                cluster: ClusterSpec) -> bool:
    cap = cluster.gpu.memory_bytes
    return all(b <= cap for b in device_memory(waves, metagraph, memory_model, cluster))


def inter_island_bytes(waves: list[ScheduledWave], metagraph: MetaGraph, cluster: ClusterSpec,
                       cost_model: FlowCostModel) -> float:
    """Activation bytes crossing islands, following plan.py's transfer rules (forward direction)."""
    if cluster.num_nodes <= 1:
        return 0.0
    order = sorted(((w.start, i, s) for i, w in enumerate(waves) for s in w.slices), key=lambda x: (x[0], x[1]))
    by_op: dict[str, list[ScheduledSlice]] = {}
    for _, _, s in order:
        by_op.setdefault(s.metaop, []).append(s)
    for slices in by_op.values():
        slices.sort(key=lambda s: s.layer_start)

    def islands(s: ScheduledSlice) -> set[int]:
        return {cluster.island(d) for d in (s.devices or [])}

    def crosses(a: ScheduledSlice, b: ScheduledSlice) -> bool:
        return bool(islands(b) - islands(a)) or bool(islands(a) - islands(b))

    total = 0.0
    for mid, slices in by_op.items():
        nbytes = handoff_bytes(metagraph.metaops[mid], cost_model)
        total += sum(nbytes for a, b in zip(slices, slices[1:]) if crosses(a, b))
    for src, dst in metagraph.edges:
        if src in by_op and dst in by_op and crosses(by_op[src][-1], by_op[dst][0]):
            total += handoff_bytes(metagraph.metaops[src], cost_model)
    return total


# ------------------------------------------------------------------------------------------ model coefficients


def layer_bytes(metaop: MetaOp, tp: int, dp: int, memory_model: MemoryModel) -> float:
    """Per-device bytes one layer of the MetaOp holds for the iteration with (tp, dp): its parameter state
    (layers of a MetaOp are identical; dp matters with the distributed optimizer) and its activations."""
    params = sum(memory_model.param_state_bytes(p, tp, dp) for p in metaop.params[0]) if metaop.params else 0.0
    return float(params) + float(memory_model.activation_bytes(metaop, tp, dp, 1))


def handoff_bytes(metaop: MetaOp, cost_model: FlowCostModel) -> float:
    """Bytes a slice of the MetaOp hands to the next slice or consumer (one operator's output)."""
    return float(cost_model.activation_bytes(metaop))


def shared_weight_bytes(a: MetaOp, b: MetaOp, cost_model: FlowCostModel) -> float:
    """Gradient bytes of the weights two MetaOps share: what their parameter group's all-reduce moves when
    they run in different islands (0 when they share none)."""
    shared = a.param_names() & b.param_names()
    return float(GRAD_BYTES_PER_PARAM * sum(cost_model.param_count(p) for p in shared))

