"""The seconds of one slice's forward and backward in one micro-batch: the one rule the simulator and the planner's
estimate (planner/objective.py) both charge.

Per layer, the cost model's ``step_phases``, plus the sharded runtime's host copies at ZeRO 1 and 2
(``sharded_phases``); the backward adds the slice's recomputation (``recompute_seconds``).

At ZeRO stage 3 a layer's weights live sharded over the slice's data-parallel ranks (with node-local weight shards,
those on its node) and are all-gathered before the layer's forward and again before its backward, as DeepSpeed
ZeRO-3 and FSDP do. Both prefetch: the next layer's gather is issued when a layer's compute starts, so only the
first layer's gather of a phase waits alone, and every later one runs beside the previous layer's compute. While
they overlap, the collective model's rule applies (estimator/comm_model.py, ``overlapped_backward_seconds``): the
compute runs ``slowdown`` times slower (C10, or the profile's measured factor) and the gather takes ``slowdown``
times its time alone plus ``latency`` (0 on GPUs). ``prefetched_phase_seconds`` is that timeline, layer by layer.
"""

from __future__ import annotations

from megatron_spindle.estimator.comm_model import CommModel, GroupPlacement
from megatron_spindle.estimator.cost_model import sharded_phases, step_phases
from megatron_spindle.graph.opgraph import MetaOp
from megatron_spindle.plan.layout import micro_batch_metaop
from megatron_spindle.plan.memory import WEIGHT_BYTES_PER_PARAM
from megatron_spindle.plan.schema import ExecutionSettings, Slice


def layer_gather_seconds(cost_model, comm: CommModel, metaop: MetaOp, s: Slice, node_local: bool = False) -> float:
    """Seconds, alone, of the all-gather of one layer's bf16 weights (its TP shard) over the slice's
    data-parallel ring at ZeRO-3 (``node_local``: the ring of its members on one node, the widest such:
    plan/layout.py ``weight_shard_group``); 0 without weights or data parallelism."""
    if s.dp == 1 or not metaop.params:
        return 0.0
    layer_params = sum(cost_model.param_count(p) for p in metaop.params[0])
    ring = GroupPlacement.dp_ring(s.devices, s.tp, comm.cluster)
    if node_local:
        ring = GroupPlacement((max(ring.ranks_per_node),))
    if ring.size <= 1:
        return 0.0
    return comm.all_gather(layer_params * WEIGHT_BYTES_PER_PARAM / s.tp, ring, s.tp if ring.crosses_nodes else 1)


def prefetched_phase_seconds(compute: float, gather: float, layers: int, slowdown: float,
                             latency: float = 0.0) -> float:
    """One phase of ``layers`` layers of ``compute`` seconds each whose weights are gathered (``gather`` seconds
    alone) one layer ahead: the first gather alone, then each layer's compute beside the next layer's gather,
    then the last layer's compute alone. A layer with a gather beside it takes ``compute + (slowdown - 1) *
    gather + latency * (1 - 1 / slowdown)`` while the gather ends first, and the gather's ``slowdown * gather +
    latency`` once it outlasts the slowed compute."""
    if layers <= 0:
        return 0.0
    if gather <= 0.0:
        return layers * compute
    beside = slowdown * gather + latency  # the gather, slowed, next to compute
    if beside <= slowdown * compute:  # the gather ends first; the rest of the compute runs at full speed
        overlapped = beside + compute - beside / slowdown
    else:  # the compute ends first (slowed throughout); the next layer waits for its weights
        overlapped = beside
    return gather + (layers - 1) * overlapped + compute


def recomputation_seconds(cost_model, run: MetaOp, s: Slice, settings: ExecutionSettings,
                          forward_per_layer: float) -> float:
    """Backward seconds a slice spends recomputing: the cost model's ``recompute_seconds``; a cost model without
    one (stand-ins) reruns the forward of each fully recomputed layer."""
    recompute = settings.recompute_of(s.id)
    seconds = getattr(cost_model, "recompute_seconds", None)
    if seconds is not None:
        return seconds(run, s.tp, s.dp, recompute, s.num_layers)
    return recompute.recomputed_layers(s.num_layers) * forward_per_layer


def slice_phase_seconds(cost_model, comm: CommModel, metaop: MetaOp, s: Slice, settings: ExecutionSettings,
                        forward_fraction: float | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of slice ``s`` of ``metaop`` in one micro-batch of a plan with ``settings``
    (module docstring; ``forward_fraction``: ``step_phases``'s split, the simulator's setting)."""
    micro = settings.micro_batches
    run = micro_batch_metaop(metaop, micro)  # what one micro-batch runs
    fwd, bwd = step_phases(cost_model, run, s.tp, s.dp, forward_fraction)
    load, stage = sharded_phases(cost_model, metaop, s.tp, s.dp, settings.zero_stage, micro)
    fwd, bwd = fwd + load, bwd + stage
    recompute = recomputation_seconds(cost_model, run, s, settings, fwd)
    gather = layer_gather_seconds(cost_model, comm, metaop, s, settings.node_local_weights) \
        if settings.zero_stage == 3 else 0.0
    if gather <= 0.0:
        return fwd * s.num_layers, bwd * s.num_layers + recompute
    slowdown, latency = comm.overlap_slowdown, comm.overlap_latency
    backward_per_layer = bwd + recompute / s.num_layers  # a recomputed layer's forward reruns on its gathered weights
    return (prefetched_phase_seconds(fwd, gather, s.num_layers, slowdown, latency),
            prefetched_phase_seconds(backward_per_layer, gather, s.num_layers, slowdown, latency))
