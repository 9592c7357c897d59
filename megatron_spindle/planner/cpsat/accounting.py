"""Every byte the CP-SAT planner counts: per-device memory and inter-island bytes of placed waves, and the
per-layer and per-MetaOp coefficients its models use. The only module of the planner that reads the cost
model and the memory model. The rules themselves are plan/'s (memory accounting, routing), so the search,
the models, the assembled plan and the simulator count the same bytes.
"""

from __future__ import annotations

from typing import Protocol

from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaGraph, MetaOp
from megatron_spindle.plan.layout import graph_transfer_pairs
from megatron_spindle.plan.routing import ROUTE_INTER, bytes_by_route, forward_messages
from megatron_spindle.planner.placement import FlowCostModel, predicted_memory
from megatron_spindle.planner.schedule import ScheduledWave


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
    """Activation bytes crossing islands, forward: plan/routing.py's routes of the transfers plan/layout.py
    derives (slices without devices yet move nothing)."""
    if cluster.num_nodes <= 1:
        return 0.0
    slices = [w.slices for w in waves]
    total = 0.0
    for (pw, ps), (cw, cs) in graph_transfer_pairs(slices, metagraph):
        src, dst = slices[pw][ps], slices[cw][cs]
        if src.devices is None or dst.devices is None:
            continue
        m = metagraph.metaops[src.metaop]
        messages = forward_messages(src, dst, m.batch, cluster.gpus_per_node)
        total += bytes_by_route(messages, handoff_bytes(m, cost_model) / m.batch)[ROUTE_INTER]
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


def shared_weight_bytes(a: MetaOp, b: MetaOp, cost_model: FlowCostModel, grad_bytes: int) -> float:
    """Gradient bytes of the weights two MetaOps share (``grad_bytes`` per parameter, the plan's reduce
    dtype): what their parameter group's all-reduce moves when they run in different islands (0 when they share
    none)."""
    shared = a.trained_param_names() & b.trained_param_names()
    return float(grad_bytes * sum(cost_model.param_count(p) for p in shared))

