"""Discrete-event simulation of one training iteration of any ``Plan`` (Spindle's, a baseline's, hand-made).

Execution model (the same for every plan, so that plans from different planners compare fairly):

- **Order.** plan/order.py's execution order of the plan's ``settings``: ``segments`` (optional) group wave
  indices into segments that run forward then backward one after another (temporal decoupling: each task is
  a segment); without them the whole plan is one segment: forward wave by wave, then backward in reverse wave
  order (or ``backward_order``). Every device executes its own slices in that global order.
- **Dataflow, no global barrier.** A slice starts when all its devices are free and its inputs have arrived:
  a wave boundary is a point-to-point dependency, not a cluster-wide barrier (a device only waits for the
  devices it receives from). On wave-aligned Spindle plans this changes little; it lets the baselines whose
  tasks run side by side on disjoint devices (Spindle-Optimus) proceed independently.
- **Compute.** A slice takes ``layers x (compute + tp_comm + launch + data_comm)`` of the cost model's
  ``layer_cost(metaop, tp, dp)``: one third forward, two thirds backward (``FWD_BWD_FACTOR``; with
  activation recomputation, ``settings.recompute``, a layer's backward also reruns its forward: 1/4, 3/4).
  The per-layer ``dp_sync`` is *not* charged here: gradients are synchronised per parameter device group after the
  backward (below). With ZeRO stage 3 (``settings.zero_stage``) every layer also all-gathers its weights
  forward and again backward, on the critical path like the gradient synchronisation (no overlap is
  modelled for either), so stage 3 moves 1.5x the data of stages 0-2 and costs accordingly.
- **Transfers** (activations forward, their gradients backward) happen between a producer slice and a
  consumer slice, routed by plan/routing.py as the runtime sends them (the backward reaches every producer
  device, so its bytes differ from the forward's when the TP degrees differ): each direction starts when its
  sender finishes and the links of every device involved are free (one transfer at a time per device), and
  takes the time of its busiest device (``comm.py``). They
  sit on the critical path of the consumer (forward) or producer (backward) and may overlap compute of
  unrelated slices.
- **Gradient synchronisation.** After a device's last backward, each parameter device group (the plan's
  ``param_groups``) all-reduces its gradients (in ``settings.grad_reduce_dtype``) inside its device set,
  as a ring over the data-parallel replicas of each TP shard. Groups sharing a device run one after
  another, device-disjoint groups overlap; groups go in order of readiness, larger first. ZeRO stages 1 and
  2 move the same volume (reduce-scatter + all-gather), stage 3 only the reduce-scatter (half) since its
  gathers happen in the forward and backward.
- **Optimizer step.** After a device's last backward and the gradient synchronisation of every group it is
  in, it runs AdamW over the fp32 master elements it holds: per unit, the unit's TP shard (the smallest TP
  degree of its slices on the device, as the memory model counts it), divided over the slice's DP ranks
  with ZeRO stage >= 1. It takes the cost model's ``optimizer_seconds(elements, tensors)`` (one tensor per
  unit): analytic from the device memory bandwidth of the cluster spec, or measured by the profiler
  (``ProfiledCostModel``). Devices step independently; the iteration ends with the last one.
- **Memory.** plan/memory.py's accounting, the planner's own: per device the parameter state of every unit
  it runs, once (weights + fp32 grads + Adam, sharded by TP and by ZeRO stage over the slice's DP ranks),
  plus activations held from a slice's forward to its backward (the memory model's; only layer inputs under
  recomputation), at the peak of the device's order.
- **Models.** The cost and memory models must match the plan's ``settings.recompute``; ``simulate``
  rebuilds them when they do not (``matching_models``).

The planner's predicted time (``plan.predicted["iteration_time"]``) sums wave durations of T(n), which
amortises the DP all-reduce of every layer into T(n) and ignores transfers. The simulator instead times the
grouped all-reduces after the backward and the transfers, and lets device-disjoint slices run ahead. On
Spindle plans of the calibrated paper workloads the ratio simulated / predicted is 0.92-1.31 (CLIP, OFASys)
and 1.4-1.5 on QWen-VAL, whose shared LLM's all-reduce spans every device that holds it (the per-MetaOp
amortised sync of T(n) sees only each MetaOp's own DP group); tests/simulator check 25 % on CLIP and
tiny-clip, benchmarks/paper_eval.py prints the ratio for every configuration (``sim/pred``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaGraph, MetaOp, build_metagraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan.derive import plan_slice_pairs
from megatron_spindle.plan.layout import device_programs, slice_units
from megatron_spindle.plan.memory import WEIGHT_BYTES_PER_PARAM, grad_reduce_bytes, plan_memory
from megatron_spindle.plan.order import FWD, execution_order
from megatron_spindle.plan.routing import ROUTE_INTER, ROUTE_INTRA, Router
from megatron_spindle.plan.schema import TRANSFER_KINDS, Plan, PlanError, Slice
from megatron_spindle.simulator.comm import (
    TransferLoad,
    ring_allgather_seconds,
    ring_allreduce_seconds,
    route_bandwidths,
    transfer_load,
    transfer_seconds,
)
from megatron_spindle.simulator.result import GroupSync, Interval, SimResult


@dataclass
class SimSettings:
    """Knobs of the execution model (defaults: see the module docstring)."""

    forward_fraction: float | None = None  # share of fwd+bwd compute in the forward; None: 1 / FWD_BWD_FACTOR
    transfers: bool = True  # False: transfers are free (used for the breakdown)
    grad_sync: bool = True  # False: no gradient synchronisation
    optimizer: bool = True  # False: no optimizer step


@dataclass
class _Flow:
    """One direction of a transfer: the devices whose links it occupies (none for local copies only)."""

    devices: tuple[int, ...]
    seconds: float
    bytes_by_route: dict[str, float]
    seconds_by_route: dict[str, float]


@dataclass
class _Edge:
    producer: str
    consumer: str
    fwd: _Flow  # activations to the consumer
    bwd: _Flow  # their gradients back to the producer


@dataclass
class _Context:
    plan: Plan
    cluster: ClusterSpec
    slices: dict[str, Slice]
    metaops: dict[str, MetaOp]
    order: list[tuple[str, str]]  # (slice id, phase) in global execution order
    fwd_time: dict[str, float]
    bwd_time: dict[str, float]
    in_edges: dict[str, list[_Edge]]
    out_edges: dict[str, list[_Edge]]
    zero_stage: int
    units: dict[str, list[str]] = field(default_factory=dict)  # slice id -> parameter units


def simulate(plan: Plan, workload: Workload, cluster: ClusterSpec, cost_model=None, memory_model=None,
             settings: SimSettings | None = None, metagraph: MetaGraph | None = None) -> SimResult:
    """Simulate one iteration of ``plan``; see the module docstring for the execution model."""
    settings = settings or SimSettings()
    cost_model, memory_model = matching_models(plan, workload, cluster, cost_model, memory_model)
    metagraph = metagraph or build_metagraph(workload)
    ctx = _build_context(plan, cluster, metagraph, cost_model, settings)
    run = _run(ctx, with_transfers=settings.transfers)
    bare = _run(ctx, with_transfers=False)
    compute_end = max(run.dev_free, default=0.0)
    syncs = _grad_sync(ctx, run, cost_model) if settings.grad_sync else []
    synced = max([compute_end] + [g.end for g in syncs])
    optimizer = _optimizer_steps(ctx, run, syncs, cost_model) if settings.optimizer else []
    iteration = max([synced] + [end for _, end in optimizer])
    compute = max(bare.dev_free, default=0.0)
    transfer = max(0.0, compute_end - compute)
    compute = min(compute, compute_end)
    seconds_by_kind = {k: 0.0 for k in TRANSFER_KINDS}
    bytes_by_kind = {k: 0.0 for k in TRANSFER_KINDS}
    backward_bytes_by_kind = {k: 0.0 for k in TRANSFER_KINDS}
    for edges in ctx.in_edges.values():
        for e in edges:
            for k in TRANSFER_KINDS:
                seconds_by_kind[k] += e.fwd.seconds_by_route[k] + e.bwd.seconds_by_route[k]
                bytes_by_kind[k] += e.fwd.bytes_by_route[k]
                backward_bytes_by_kind[k] += e.bwd.bytes_by_route[k]
    total_route_seconds = sum(seconds_by_kind.values())
    transfer_by_kind = {k: (transfer * v / total_route_seconds if total_route_seconds > 0 else 0.0)
                        for k, v in seconds_by_kind.items()}
    return SimResult(
        iteration_time=iteration,
        compute_time=compute,
        transfer_time=transfer,
        grad_sync_time=synced - compute_end,
        optimizer_time=iteration - synced,
        optimizer_steps=optimizer,
        transfer_by_kind=transfer_by_kind,
        transfer_bytes_by_kind=bytes_by_kind,
        transfer_backward_bytes_by_kind=backward_bytes_by_kind,
        transfer_seconds_by_kind=seconds_by_kind,
        grad_sync=syncs,
        busy=run.busy,
        peak_memory=plan_memory(plan, metagraph.metaops, memory_model),
        forward_end=run.forward_end,
        num_devices=plan.num_devices,
        extras={"planner_predicted": float(plan.predicted.get("iteration_time", 0.0)),
                "zero_stage": ctx.zero_stage},
    )


# ------------------------------------------------------------------------------------------ context


def matching_models(plan: Plan, workload: Workload, cluster: ClusterSpec, cost_model=None, memory_model=None):
    """Cost and memory models that match the plan's activation recomputation (``settings.recompute``):
    the given ones when they do (or cannot tell: stand-ins without ``config.recompute``), else rebuilt."""
    from megatron_spindle.estimator import AnalyticCostModel, MemoryModel
    from megatron_spindle.estimator.cost_model import CostModelConfig

    recompute = plan.settings.recompute_every_layer()
    if cost_model is None:
        cost_model = AnalyticCostModel(workload, cluster, config=CostModelConfig(recompute=recompute))
        memory_model = None
    else:
        config = getattr(cost_model, "config", None)
        if isinstance(config, CostModelConfig) and config.recompute != recompute:
            cost_model = AnalyticCostModel(workload, cluster, dtype_bytes=cost_model.dtype_bytes,
                                           config=dataclasses.replace(config, recompute=recompute))
            memory_model = None
    if memory_model is None:
        memory_model = MemoryModel(workload, cluster, cost_model)
    return cost_model, memory_model


def _build_context(plan: Plan, cluster: ClusterSpec, metagraph: MetaGraph, cost_model, settings: SimSettings) -> _Context:
    slices = {s.id: s for s in plan.slices()}
    metaops = {}
    for s in slices.values():
        if s.metaop not in metagraph.metaops:
            raise ValueError(f"slice '{s.id}': MetaOp '{s.metaop}' is not in the workload's MetaGraph")
        metaops[s.metaop] = metagraph.metaops[s.metaop]
    zero = plan.settings.zero_stage
    if plan.settings.micro_batches != 1:
        raise PlanError(f"plan: {plan.settings.micro_batches} micro-batches; the simulator models one")
    from megatron_spindle.estimator.cost_model import FWD_BWD_FACTOR

    recompute = bool(getattr(getattr(cost_model, "config", None), "recompute", False))
    fwd_time, bwd_time, units = {}, {}, {}
    for sid, s in slices.items():
        m = metaops[s.metaop]
        fraction = settings.forward_fraction
        if fraction is None:  # recomputation reruns a layer's forward inside its backward
            fraction = 1.0 / (FWD_BWD_FACTOR + (1 if recompute and m.kind == "layer" else 0))
        lc = cost_model.layer_cost(m, s.tp, s.dp)
        per_layer = lc.compute + lc.tp_comm + lc.launch + getattr(lc, "data_comm", 0.0)
        fwd, bwd = fraction * per_layer, (1.0 - fraction) * per_layer
        if zero == 3 and s.dp > 1:
            layer_params = sum(cost_model.param_count(p) for p in m.params[0]) if m.params else 0
            gather = ring_allgather_seconds(layer_params * WEIGHT_BYTES_PER_PARAM / s.tp, s.dp,
                                            not cluster.same_island(s.devices), cluster)
            fwd, bwd = fwd + gather, bwd + gather
        fwd_time[sid] = fwd * s.num_layers
        bwd_time[sid] = bwd * s.num_layers
        units[sid] = slice_units(m, s.layer_start, s.layer_end)
    in_edges, out_edges = _edges(plan, slices, metaops, cluster, cost_model)
    return _Context(plan, cluster, slices, metaops, _order(plan), fwd_time, bwd_time, in_edges, out_edges, zero,
                    units)


def _order(plan: Plan) -> list[tuple[str, str]]:
    """(slice id, phase) in execution order (plan/order.py); a backward wave runs its slices in reverse."""
    order = []
    for wi, phase in execution_order(len(plan.waves), plan.settings):
        slices = plan.waves[wi].slices
        order += [(s.id, phase) for s in (slices if phase == FWD else reversed(slices))]
    return order


def _edges(plan: Plan, slices: dict[str, Slice], metaops: dict[str, MetaOp], cluster: ClusterSpec,
           cost_model) -> tuple[dict[str, list[_Edge]], dict[str, list[_Edge]]]:
    """Producer -> consumer slice pairs (derived from the plan's layout by plan/layout.py, not trusted from its
    transfer list), each direction routed by plan/routing.py."""
    in_edges: dict[str, list[_Edge]] = {sid: [] for sid in slices}
    out_edges: dict[str, list[_Edge]] = {sid: [] for sid in slices}
    router = Router(cluster.gpus_per_node)
    flows: dict[tuple, _Flow] = {}  # plans repeat layouts: each (layout, bytes per row) timed once

    def flow(holders: Slice, needers: Slice, batch: int, per_row: float) -> _Flow:
        key = (router.key(holders, needers, batch), per_row)
        if key not in flows:
            flows[key] = _flow(transfer_load(router.route(holders, needers, batch), per_row), cluster)
        return flows[key]

    for p, c in plan_slice_pairs(plan):
        src, dst = slices[p], slices[c]
        m = metaops[src.metaop]
        per_row = float(cost_model.activation_bytes(m)) / m.batch
        edge = _Edge(p, c, flow(src, dst, m.batch, per_row), flow(dst, src, m.batch, per_row))
        in_edges[c].append(edge)
        out_edges[p].append(edge)
    return in_edges, out_edges


def _flow(load: TransferLoad, cluster: ClusterSpec) -> _Flow:
    seconds = transfer_seconds(load, cluster)
    by_route = load.total_by_route()
    bw = route_bandwidths(cluster)
    raw = {k: by_route[k] / bw[k] for k in TRANSFER_KINDS}
    total_raw = sum(raw.values())
    by_seconds = {k: (seconds * raw[k] / total_raw if total_raw > 0 else 0.0) for k in TRANSFER_KINDS}
    moving = tuple(sorted(load.devices)) if any(by_route[k] > 0 for k in (ROUTE_INTRA, ROUTE_INTER)) else ()
    return _Flow(moving, seconds, by_route, by_seconds)


# ------------------------------------------------------------------------------------------ timeline


@dataclass
class _Run:
    dev_free: list[float]
    busy: list[list[Interval]]
    fwd_end: dict[str, float]
    bwd_end: dict[str, float]
    last_bwd: list[float]
    forward_end: float


def _run(ctx: _Context, with_transfers: bool) -> _Run:
    n = ctx.plan.num_devices
    dev_free = [0.0] * n
    link_free = [0.0] * n
    busy: list[list[Interval]] = [[] for _ in range(n)]
    fwd_end: dict[str, float] = {}
    bwd_end: dict[str, float] = {}

    def arrive(flow: _Flow, sent_at: float) -> float:
        if not with_transfers or not flow.devices:
            return sent_at + (flow.seconds if with_transfers else 0.0)
        start = max([sent_at] + [link_free[d] for d in flow.devices])
        end = start + flow.seconds
        for d in flow.devices:
            link_free[d] = end
        return end

    forward_end = 0.0
    for sid, phase in ctx.order:
        s = ctx.slices[sid]
        if phase == FWD:
            ready = max([arrive(e.fwd, fwd_end[e.producer]) for e in ctx.in_edges[sid] if e.producer in fwd_end],
                        default=0.0)
            duration = ctx.fwd_time[sid]
        else:
            ready = max([arrive(e.bwd, bwd_end[e.consumer]) for e in ctx.out_edges[sid] if e.consumer in bwd_end],
                        default=0.0)
            duration = ctx.bwd_time[sid]
        start = max(ready, max(map(dev_free.__getitem__, s.devices)))
        end = start + duration
        interval = Interval(start, end, sid, phase)
        for d in s.devices:
            dev_free[d] = end
            if duration > 0:
                busy[d].append(interval)
        if phase == FWD:
            fwd_end[sid] = end
            forward_end = max(forward_end, end)
        else:
            bwd_end[sid] = end
    return _Run(dev_free, busy, fwd_end, bwd_end, list(dev_free), forward_end)


def _grad_sync(ctx: _Context, run: _Run, cost_model) -> list[GroupSync]:
    """List-schedule the parameter device groups' all-reduces after each device's backward."""
    unit_tp: dict[str, int] = {}
    for sid, units in ctx.units.items():
        tp = ctx.slices[sid].tp
        for u in units:
            unit_tp[u] = min(unit_tp.get(u, tp), tp)
    jobs = []
    for g in ctx.plan.param_groups:
        if len(g.devices) <= 1 or not g.params:
            continue
        tp = min((unit_tp.get(u, 1) for u in g.params), default=1)
        ranks = len(g.devices) // tp
        volume = grad_reduce_bytes(sum(cost_model.param_count(u) for u in g.params), ctx.plan.settings) / tp
        cross = not ctx.cluster.same_island(g.devices)
        seconds = ring_allreduce_seconds(volume, ranks, cross, ctx.cluster)
        if ctx.zero_stage == 3:
            seconds /= 2  # reduce-scatter only: the weights are gathered in the forward and backward
        ready = max(run.last_bwd[d] for d in g.devices)
        jobs.append((ready, -volume, g, tp, ranks, volume, cross, seconds))
    jobs.sort(key=lambda j: (j[0], j[1], j[2].devices))
    sync_free = list(run.last_bwd)
    out = []
    for ready, _, g, _tp, ranks, volume, cross, seconds in jobs:
        start = max([ready] + [sync_free[d] for d in g.devices])
        end = start + seconds
        for d in g.devices:
            sync_free[d] = end
        out.append(GroupSync(list(g.devices), len(g.params), volume, ranks, cross, start, end))
    return out


def optimizer_elements(ctx: _Context, cost_model) -> list[dict[str, float]]:
    """Per device: unit -> fp32 master elements the device steps (its TP shard; over DP with ZeRO >= 1), the
    largest over its slices holding the unit; devices running the same slices share one dict."""
    waves = [w.slices for w in ctx.plan.waves]
    held: list[dict[str, float]] = [{} for _ in range(ctx.plan.num_devices)]
    for program, devices in device_programs(waves, ctx.plan.num_devices).items():
        mine: dict[str, float] = {}
        for wi, si in program:
            s = waves[wi][si]
            for u in ctx.units[s.id]:
                elements = cost_model.param_count(u) / s.tp / (s.dp if ctx.zero_stage >= 1 else 1)
                mine[u] = max(mine.get(u, 0.0), elements)
        for d in devices:
            held[d] = mine
    return held


def _optimizer_steps(ctx: _Context, run: _Run, syncs: list[GroupSync], cost_model) -> list[tuple[float, float]]:
    """(start, end) of each device's AdamW step: after its last backward and its groups' gradient syncs."""
    seconds = getattr(cost_model, "optimizer_seconds", None)
    if seconds is None:  # a cost model without one (stand-ins): no optimizer term
        return [(t, t) for t in run.last_bwd]
    ready = list(run.last_bwd)
    for g in syncs:
        for d in g.devices:
            ready[d] = max(ready[d], g.end)
    steps = []
    for d, units in enumerate(optimizer_elements(ctx, cost_model)):
        duration = seconds(sum(units.values()), len(units)) if units else 0.0
        steps.append((ready[d], ready[d] + duration))
    return steps
