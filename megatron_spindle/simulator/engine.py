"""Discrete-event simulation of one training iteration of any ``Plan`` (Spindle's, a baseline's, hand-made).

Execution model (the same for every plan, so that plans from different planners compare fairly; the event
engine is timeline.py):

- **Order.** plan/order.py's execution order of the plan's ``settings``: ``segments`` (optional) group wave
  indices into segments that run forward then backward one after another (temporal decoupling: each task is
  a segment); without them the whole plan is one segment: forward wave by wave, then backward in reverse wave
  order (or ``backward_order``); or an explicit ``order`` of (wave, phase, task) steps (early backward).
  Every device executes its own slices in that global order. With ``micro_batches`` m the order runs m times
  one after another, each slice on B/m samples (its costs and transfers at that batch), and the gradient
  synchronisation (overlapped with the last micro-batch's backward; with every micro-batch's, and every
  segment's, under ZeRO 2 and 3: plan/buckets.py ``sync_rounds``) and the optimizer step follow.
- **Dataflow, no global barrier.** A slice starts when all its devices are free and its inputs have arrived:
  a wave boundary is a point-to-point dependency, not a cluster-wide barrier (a device only waits for the
  devices it receives from). On wave-aligned Spindle plans this changes little; it lets the baselines whose
  tasks run side by side on disjoint devices (Spindle-Optimus) proceed independently.
- **Compute.** A slice's forward and backward take ``layers x`` the cost model's ``phase_seconds(metaop, tp,
  dp)`` (the per-kernel model's forward and backward, TP all-reduces and launch floor), plus a contrastive
  loss's all-gather of the embeddings forward and its reduce-scatter backward (``step_phases``). Cost models
  without ``phase_seconds`` (stand-ins) split ``layer_cost`` one third forward, two thirds backward. A
  slice's activation recomputation (``settings.recompute_of``) adds the cost model's ``recompute_seconds``
  to its backward: the attention cores (selective) or the whole forward of each recomputed layer (full).
  With ZeRO stage 3 (``settings.zero_stage``) every layer also all-gathers its weights forward and again
  backward, each gather prefetched beside the previous layer's compute as DeepSpeed and FSDP do. These rules
  are estimator/slice_time.py's, which the planner's estimate charges too.
- **Transfers** (activations forward, their gradients backward) happen between a producer slice and a
  consumer slice, routed by plan/routing.py as the runtime sends them (the backward reaches every producer
  device, so its bytes differ from the forward's when the TP degrees differ): each direction starts when its
  sender finishes and the links of every device involved are free (first come, first served), and takes the
  time of its busiest device at the comm model's point-to-point bandwidths (estimator/transfer.py). They sit on the
  critical path of the consumer (forward) or producer (backward) and may overlap compute of unrelated slices.
  Where a device loses compute time per message (``ClusterSpec.message_host_seconds``, a profiled CPU device),
  the sending and the receiving slice's phase each take that much longer per message of their busiest device.
- **Gradient synchronisation** (grad_sync.py): the runtime's buckets of each parameter device group, issued in
  the plan-wide launch order as soon as their last gradient is accumulated on a member, reduced by the comm
  model's collectives during the rest of the backward, with cross-node collectives sharing the node's network
  and compute and communication slowed by C10's factor while they overlap (a collective beside compute also
  takes the measured ``overlap_latency`` more: 0 on GPUs, milliseconds on a profiled CPU device, whose gloo
  thread waits for the scheduler). The buckets are cut at the plan's ``ddp_bucket_size``; with the plan's
  ``overlap_grad_reduce`` off every bucket is issued after the device's backward, as the runtime then does.
  ZeRO stage 0 all-reduces, stages 1-3 reduce-scatter; stages 1 and 2 all-gather the updated weights after the
  optimizer step (``param_gather`` in the breakdown), and stage 3 redistributes them (an all-to-all of what each
  member keeps) for the groups whose weight shards are not their master shards (plan/buckets.py
  ``regathered_groups``: a TP shard, or a unit on several device sets). With ``settings.overlap_param_gather``
  (Megatron's ``--overlap-param-gather``, stages 1 to 3) those gathers belong to the next iteration: in the
  steady state each group's gather is issued at the iteration's start, on its members' channels ahead of the
  buckets, and overlaps the forward (slowed by C10's factor like the buckets); a slice's first forward waits
  for the gathers of the groups holding its units (at ZeRO 1 and 2 each layer for its own bucket, at ZeRO-3
  the slice for all of its buckets before it starts: plan/buckets.py ``weights_wanted_at``), and
  ``param_gather`` is what those waits add.
- **Optimizer step.** After a device's last backward and the gradient synchronisation of every bucket it is
  in, it runs AdamW over the fp32 master elements it holds: per unit, the unit's TP shard (the smallest TP
  degree of its slices on the device, as the memory model counts it), divided over the slice's DP ranks
  with ZeRO stage >= 1. It takes the cost model's ``optimizer_seconds(elements, tensors)`` (one tensor per
  unit): analytic from the device memory bandwidth of the cluster spec, or measured by the profiler
  (``ProfiledCostModel``). Devices step independently; the iteration ends with the last one.
- **Memory.** plan/memory.py's accounting, the planner's own: per device the parameter state of every unit
  it runs, once (weights + fp32 grads + Adam, sharded by TP and by ZeRO stage over the slice's DP ranks),
  plus activations held from a slice's forward to its backward (the memory model's, per the slice's
  recomputation, of one micro-batch), at the peak of the device's order.
- **Models.** Recomputation is charged per slice, so a cost model that adds it to every layer
  (``config.recompute``) is replaced by a copy without it (``matching_models``).

The planner's own estimate (``plan.predicted["planner_estimate"]``) sums its waves of T(n) and adds its
estimate of the exposed gradient synchronisation and the transfers; plan selection (megatron_spindle/autoplan.py)
then writes this simulator's time into ``plan.predicted["iteration_time"]``.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field

from megatron_spindle.estimator.comm_model import CommModel
from megatron_spindle.estimator.slice_time import slice_phase_seconds
from megatron_spindle.estimator.transfer import (
    TransferLoad,
    link_devices,
    route_bandwidths,
    transfer_host_seconds,
    transfer_load,
    transfer_seconds,
)
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaGraph, MetaOp, build_metagraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan.buckets import (
    gather_order,
    overlaps_param_gather,
    synced_micro_batches,
    unit_first_use,
    wave_rounds,
    weights_wanted_at,
)
from megatron_spindle.plan.derive import plan_slice_pairs
from megatron_spindle.plan.layout import first_operators, slice_units, stepped_elements
from megatron_spindle.plan.memory import plan_memory
from megatron_spindle.plan.order import FWD, slice_order
from megatron_spindle.plan.routing import Router, gradient_returns
from megatron_spindle.plan.schema import TRANSFER_KINDS, Plan, Slice
from megatron_spindle.simulator.grad_sync import (
    BucketSync,
    CollectiveTimer,
    GroupInfo,
    group_infos,
    nodes_of,
    param_gathers,
    plan_buckets,
    synced_buckets,
)
from megatron_spindle.simulator.result import GroupSync, Interval, SimResult
from megatron_spindle.simulator.timeline import Collective, Flow, Task, TimelineResult, run_timeline


@dataclass
class SimSettings:
    """Knobs of the execution model (defaults: see the module docstring)."""

    forward_fraction: float | None = None  # share of fwd+bwd compute in the forward; None: the cost model's split
    transfers: bool = True  # False: transfers are free (used for the breakdown)
    grad_sync: bool = True  # False: no gradient synchronisation
    optimizer: bool = True  # False: no optimizer step
    overlap_slowdown: float | None = None  # None: the cluster's (CommModel.overlap_slowdown; C10 unless measured)


@dataclass
class _Flow:
    """One direction of a transfer: the devices whose links it occupies (none for local copies only) and the
    compute time its busiest device loses to its messages (``host``, charged to the sender and receiver)."""

    devices: tuple[int, ...]
    seconds: float
    bytes_by_route: dict[str, float]
    seconds_by_route: dict[str, float]
    host: float = 0.0


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
    comm: CommModel | None = None
    groups: list[GroupInfo] = field(default_factory=list)
    buckets: list[BucketSync] = field(default_factory=list)
    settings: SimSettings = field(default_factory=SimSettings)
    synced: list[BucketSync] = field(default_factory=list)  # a synced micro-batch's collectives (synced_buckets)
    rounds: list[int] = field(default_factory=list)  # the gradient round of each wave (plan/buckets.py)


def simulate(plan: Plan, workload: Workload, cluster: ClusterSpec, cost_model=None, memory_model=None,
             settings: SimSettings | None = None, metagraph: MetaGraph | None = None) -> SimResult:
    """Simulate one iteration of ``plan``; see the module docstring for the execution model."""
    settings = settings or SimSettings()
    cost_model, memory_model = matching_models(plan, workload, cluster, cost_model, memory_model)
    metagraph = metagraph or build_metagraph(workload)
    ctx = _build_context(plan, cluster, metagraph, cost_model, settings)
    timer = CollectiveTimer(ctx.comm)
    bare, _ = _timeline(ctx, timer, transfers=False, sync=False)
    moved, _ = _timeline(ctx, timer, transfers=settings.transfers, sync=False)
    full = _timeline(ctx, timer, transfers=settings.transfers, sync=True)[0] if settings.grad_sync and ctx.buckets \
        else moved
    buckets = ctx.synced if full is not moved else []
    # Megatron's --overlap-param-gather: the weights' all-gather of the last step runs during this forward
    overlapped = settings.grad_sync and overlaps_param_gather(plan.settings) and bool(
        param_gathers(plan, ctx.groups, ctx.metaops))
    run, gathered = _timeline(ctx, timer, transfers=settings.transfers, sync=bool(buckets), gathers=True) \
        if overlapped else (full, [])
    synced_free = max(_device_done(full, buckets), default=0.0)  # without waiting for any gather
    device_done = _device_done(run, buckets)
    synced = max(device_done, default=0.0)
    optimizer = _optimizer_steps(ctx, device_done, cost_model) if settings.optimizer else \
        [(t, t) for t in device_done]
    gathers = gathered or (_param_gathers(ctx, timer, optimizer) if settings.grad_sync else [])
    stepped = max([end for _, end in optimizer] + [synced])
    iteration = max([stepped] + [end for _, _, end in gathers])
    compute = min(bare.makespan, synced_free)
    transfer = max(0.0, min(moved.makespan, synced_free) - compute)
    waited = max(0.0, synced - synced_free)  # what the forward's waits for overlapped gathers cost
    syncs = _group_syncs(ctx, buckets, run)
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
    busy, fwd_end = _busy(ctx, run)
    return SimResult(
        iteration_time=iteration,
        compute_time=compute,
        transfer_time=transfer,
        grad_sync_time=synced - waited - compute - transfer,
        optimizer_time=stepped - synced,
        param_gather_time=waited + iteration - stepped,
        optimizer_steps=optimizer,
        transfer_by_kind=transfer_by_kind,
        transfer_bytes_by_kind=bytes_by_kind,
        transfer_backward_bytes_by_kind=backward_bytes_by_kind,
        transfer_seconds_by_kind=seconds_by_kind,
        grad_sync=syncs,
        busy=busy,
        peak_memory=plan_memory(plan, metagraph.metaops, memory_model),
        forward_end=fwd_end,
        num_devices=plan.num_devices,
        extras={"planner_predicted": float(plan.predicted.get("iteration_time", 0.0)),
                "zero_stage": ctx.zero_stage, "buckets": len(buckets),
                "sync_seconds": max(_per_device_comm(ctx, buckets, run), default=0.0),
                "backward_end": max(run.device_end, default=0.0),
                "param_gathers": [(gi, start, end) for gi, start, end in gathers],
                "overlap_param_gather": overlapped},
    )


# ------------------------------------------------------------------------------------------ context


def matching_models(plan: Plan, workload: Workload, cluster: ClusterSpec, cost_model=None, memory_model=None):
    """Cost and memory models for timing the plan: recomputation is charged per slice from the plan's
    settings (``recompute_seconds``, plan/memory.py), so the cost model must not add it to every layer
    itself (``config.recompute``): the given ones when they do not (or cannot tell: stand-ins without
    ``config.recompute``), else a copy without it."""
    from megatron_spindle.estimator import AnalyticCostModel, MemoryModel, execution_cost_config

    if cost_model is None:
        cost_model = AnalyticCostModel(workload, cluster, config=execution_cost_config(plan.settings))
        memory_model = None
    elif getattr(getattr(cost_model, "config", None), "recompute", False):
        cost_model = cost_model.without_recompute()
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
    comm = CommModel(cluster)
    fwd_time, bwd_time, units = {}, {}, {}
    for sid, s in slices.items():
        m = metaops[s.metaop]
        fwd_time[sid], bwd_time[sid] = slice_phase_seconds(cost_model, comm, m, s, plan.settings,
                                                           settings.forward_fraction)
        units[sid] = slice_units(m, s.layer_start, s.layer_end)
    in_edges, out_edges = _edges(plan, slices, metaops, cost_model, comm)
    groups = group_infos(plan, metagraph.metaops, cost_model.param_count, cluster)
    buckets = plan_buckets(plan, metagraph.metaops, cost_model.param_count, groups)
    return _Context(plan, cluster, slices, metaops, _order(plan), fwd_time, bwd_time, in_edges, out_edges, zero,
                    units, comm, groups, buckets, settings, synced_buckets(plan, metagraph.metaops, buckets),
                    wave_rounds(len(plan.waves), plan.settings))


def _order(plan: Plan) -> list[tuple[str, str]]:
    """(slice id, phase) of one micro-batch in execution order (plan/order.py)."""
    waves = plan.waves
    return [(waves[wi].slices[si].id, phase)
            for wi, si, phase in slice_order([[s.task for s in w.slices] for w in waves], plan.settings)]


def _edges(plan: Plan, slices: dict[str, Slice], metaops: dict[str, MetaOp], cost_model,
           comm: CommModel) -> tuple[dict[str, list[_Edge]], dict[str, list[_Edge]]]:
    """Producer -> consumer slice pairs (derived from the plan's layout by plan/layout.py, not trusted from its
    transfer list), each direction routed by plan/routing.py."""
    in_edges: dict[str, list[_Edge]] = {sid: [] for sid in slices}
    out_edges: dict[str, list[_Edge]] = {sid: [] for sid in slices}
    router = Router(plan.gpus_per_node)
    flows: dict[tuple, _Flow] = {}  # plans repeat layouts: each (layout, bytes per row) timed once

    def flow(holders: Slice, needers: Slice, batch: int, per_row: float) -> _Flow:
        key = (router.key(holders, needers, batch), per_row)
        if key not in flows:
            flows[key] = _flow(transfer_load(router.route(holders, needers, batch), per_row), comm)
        return flows[key]

    micro = plan.settings.micro_batches
    for p, c in plan_slice_pairs(plan):
        src, dst = slices[p], slices[c]
        m = metaops[src.metaop]
        per_row = float(cost_model.activation_bytes(m)) / m.batch
        rows = m.batch // micro  # each micro-batch moves its own rows
        back = flow(dst, src, rows, per_row) if gradient_returns(m.backward) else _NO_FLOW
        edge = _Edge(p, c, flow(src, dst, rows, per_row), back)
        in_edges[c].append(edge)
        out_edges[p].append(edge)
    return in_edges, out_edges


_NO_FLOW = _Flow((), 0.0, dict.fromkeys(TRANSFER_KINDS, 0.0), dict.fromkeys(TRANSFER_KINDS, 0.0), 0.0)


def _flow(load: TransferLoad, comm: CommModel) -> _Flow:
    seconds = transfer_seconds(load, comm)
    by_route = load.total_by_route()
    bw = route_bandwidths(comm)
    raw = {k: by_route[k] / bw[k] for k in TRANSFER_KINDS}
    total_raw = sum(raw.values())
    by_seconds = {k: (seconds * raw[k] / total_raw if total_raw > 0 else 0.0) for k in TRANSFER_KINDS}
    return _Flow(link_devices(load), seconds, by_route, by_seconds, transfer_host_seconds(load, comm))


# ------------------------------------------------------------------------------------------ timeline


def _timeline(ctx: _Context, timer: CollectiveTimer, transfers: bool, sync: bool,
              gathers: bool = False) -> tuple[TimelineResult, list[tuple[int, float, float]]]:
    """One run of the event engine over the plan's tasks (the order once per micro-batch), with or without
    transfers and gradient buckets; the buckets follow the last micro-batch's accumulations (every
    micro-batch's under ZeRO-2 and 3: plan/buckets.py ``synced_micro_batches``). ``gathers``: the weights'
    all-gathers of the last step run from time 0, ahead of the buckets on every member's channel, and a slice's
    first forward waits for those of the groups holding its units. Returns the run (its collectives: the
    buckets) and each gather's (group, start, end)."""
    micro = ctx.plan.settings.micro_batches
    index = {(key, mb): k for k, (key, mb) in enumerate(_task_keys(ctx))}
    tasks = []
    for (sid, phase), _ in _task_keys(ctx):
        s = ctx.slices[sid]
        tasks.append(Task(tuple(s.devices), ctx.fwd_time[sid] if phase == FWD else ctx.bwd_time[sid]))
    flows: list[Flow] = []

    def connect(src: tuple[str, str], dst: tuple[str, str], flow: _Flow, mb: int) -> None:
        a, b = index.get((src, mb)), index.get((dst, mb))
        if a is None or b is None or a >= b:
            return  # a producer that runs later: the plan is invalid, validate_plan says why
        tasks[b].inputs.append(len(flows))
        flows.append(Flow(a, b, flow.devices if transfers else (), flow.seconds if transfers else 0.0))
        if transfers and flow.host > 0:  # posting and receiving take the devices' own compute time
            tasks[a].work += flow.host
            tasks[b].work += flow.host

    for mb in range(micro):
        for sid in ctx.slices:
            for e in ctx.in_edges[sid]:
                connect((e.producer, FWD), (sid, FWD), e.fwd, mb)
                connect((sid, "bwd"), (e.producer, "bwd"), e.bwd, mb)
    collectives, gathered = _gather_collectives(ctx, timer, tasks, index) if gathers else ([], [])
    if sync and ctx.buckets:
        gpn = ctx.cluster.gpus_per_node
        # A micro-batch's tasks are the first one's shifted by whole runs of the order (_task_keys): the
        # milestones are found once and shifted (without overlap every bucket waits for the devices' last tasks).
        at = {key: k for (key, batch), k in index.items() if batch == 0}
        milestones = list(_milestones(ctx, at, tasks))
        for mb in synced_micro_batches(ctx.zero_stage, micro):
            first = len(collectives)
            # without overlap the milestones are the devices' last tasks: those of the last micro-batch
            shift = (mb if ctx.plan.settings.overlap_grad_reduce else micro - 1) * len(ctx.order)
            collectives += [Collective(b.devices, _collective_seconds(timer, b.op, b.nbytes, b.ring),
                                      nodes_of(b.devices, gpn), b.rings)
                            for b in ctx.synced]
            for c, (k, fraction, d) in milestones:
                tasks[k + shift].milestones.append((fraction, first + c, d))
    slowdown = (ctx.settings.overlap_slowdown or ctx.comm.overlap_slowdown) if collectives else 1.0
    run = run_timeline(ctx.plan.num_devices, tasks, flows, collectives, slowdown, ctx.comm.overlap_latency)
    n = len(gathered)  # the gathers come first
    spans = [(gi, run.coll_start[c], run.coll_end[c]) for c, gi in enumerate(gathered)]
    return dataclasses.replace(run, coll_start=run.coll_start[n:], coll_end=run.coll_end[n:],
                               coll_issued=run.coll_issued[n:]), spans


def _gather_collectives(ctx: _Context, timer: CollectiveTimer, tasks: list[Task],
                        index) -> tuple[list[Collective], list[int]]:
    """The weights' all-gather (ZeRO-3: redistribution) of every bucket of the gathering groups (plan/buckets.py:
    the gradient buckets, in ``gather_order``), issued at time 0; in the first micro-batch's forward of a slice
    each layer waits for the buckets of its units (the slice's first layer before the slice starts, the others
    at the fraction of its work where they begin; at ZeRO-3 all before the slice starts: ``weights_wanted_at``).
    Returns the collectives and each one's group."""
    gpn = ctx.cluster.gpus_per_node
    gathering = set(param_gathers(ctx.plan, ctx.groups, ctx.metaops))
    waves = [w.slices for w in ctx.plan.waves]
    first_use = unit_first_use(waves, ctx.metaops, ctx.plan.settings)
    buckets = gather_order((b for b in ctx.buckets if b.group in gathering), first_use)
    out, bucket_of_unit = [], {}
    for b in buckets:
        out.append(Collective(b.devices, _collective_seconds(timer, b.weight_op, b.weight_bytes, b.ring),
                              nodes_of(b.devices, gpn), b.rings, at_start=True))
        for u in b.units:
            bucket_of_unit[u] = len(out) - 1
    for sid, s in ctx.slices.items():
        k = index[((sid, FWD), 0)]
        ops = s.num_layers
        for u, first in first_operators(ctx.metaops[s.metaop], s).items():
            if u in bucket_of_unit:
                i = weights_wanted_at(ctx.plan.settings.zero_stage, first)
                if i == 0:
                    tasks[k].after.append(bucket_of_unit[u])
                else:
                    tasks[k].gates.append((i / ops, bucket_of_unit[u]))
        tasks[k].after = sorted(set(tasks[k].after))
    return out, [b.group for b in buckets]


def _device_done(run: TimelineResult, buckets: list[BucketSync]) -> list[float]:
    """Per device: the end of its last task or of its last bucket's collective."""
    done = list(run.device_end)
    for b, _, c_end in _bucket_runs(buckets, run):
        for d in b.devices:
            done[d] = max(done[d], c_end)
    return done


def _task_keys(ctx: _Context) -> list[tuple[tuple[str, str], int]]:
    """((slice id, phase), micro-batch) of every task, in execution order: micro-batch after micro-batch."""
    return [(key, mb) for mb in range(ctx.plan.settings.micro_batches) for key in ctx.order]


def _collective_seconds(timer: CollectiveTimer, op: str, nbytes: float, ring):
    """A Collective's ``seconds(sharing)``: the ring's ``op`` of ``nbytes`` while it shares its nodes."""
    return lambda sharing: timer.seconds(op, nbytes, ring, sharing)


def _milestones(ctx: _Context, index: dict[tuple[str, str], int], tasks: list[Task]):
    """(collective, (task, fraction of its work, device)) of one micro-batch's tasks: where each member's last
    accumulation of each synced bucket happens in the bucket's round (grad_sync.py); a member accumulating none
    there, where it reaches the round (the end of its last task before the round's first, else the start of its
    first); without overlap, the end of the device's last task before the next round."""
    wave_of = {s.id: wi for wi, w in enumerate(ctx.plan.waves) for s in w.slices}
    round_of = [ctx.rounds[wave_of[sid]] if ctx.rounds else 0 for sid, _ in ctx.order]  # per task of micro 0
    starts = [round_of.index(r) for r in range(max(round_of, default=0) + 1)] + [len(round_of)]
    device_tasks: dict[int, list[int]] = {}
    for k in range(len(ctx.order)):
        for d in tasks[k].devices:
            device_tasks.setdefault(d, []).append(k)

    def reached(d: int, before: int) -> tuple[int, float]:
        """Device d's last task before task index ``before`` ends, else its first task starts."""
        mine = device_tasks[d]
        i = bisect.bisect_left(mine, before)
        return (mine[i - 1], 1.0) if i > 0 else (mine[0], 0.0)

    if not ctx.plan.settings.overlap_grad_reduce:
        for c, b in enumerate(ctx.synced):
            for d in b.devices:
                yield c, reached(d, starts[b.round + 1]) + (d,)
        return
    # unit -> [(task, fraction, round)] over the backward tasks holding it, in execution order
    holding: dict[str, list[tuple[int, float, int]]] = {}
    for sid, phase in ctx.order:
        if phase == FWD:
            continue
        units = ctx.units[sid]
        k = index[(sid, phase)]
        first = first_operators(ctx.metaops[ctx.slices[sid].metaop], ctx.slices[sid])
        ops = ctx.slices[sid].num_layers
        for u in units:
            holding.setdefault(u, []).append((k, (ops - first[u]) / ops, round_of[k]))
    for c, b in enumerate(ctx.synced):
        best: dict[int, tuple[int, float]] = {}
        members = set(b.devices)
        for u in b.units:
            for k, fraction, r in holding.get(u, ()):
                if r != b.round:
                    continue
                for d in tasks[k].devices:
                    if d in members and (k, fraction) > best.get(d, (-1, 0.0)):
                        best[d] = (k, fraction)
        for d in b.devices:
            k, fraction = best[d] if d in best else reached(d, starts[b.round])
            yield c, (k, fraction, d)


def _busy(ctx: _Context, run: TimelineResult) -> tuple[list[list[Interval]], float]:
    busy: list[list[Interval]] = [[] for _ in range(ctx.plan.num_devices)]
    forward_end = 0.0
    for k, ((sid, phase), _) in enumerate(_task_keys(ctx)):
        start, end = run.task_start[k], run.task_end[k]
        if phase == FWD:
            forward_end = max(forward_end, end)
        if end > start:
            interval = Interval(start, end, sid, phase)
            for d in ctx.slices[sid].devices:
                busy[d].append(interval)
    for ivs in busy:
        ivs.sort()
    return busy, forward_end


def _bucket_runs(buckets: list[BucketSync], run: TimelineResult):
    """(bucket, start, end) of every gradient collective of the run: the buckets once, or once per synced
    micro-batch (``_timeline`` issues them micro-batch after micro-batch)."""
    for c, (start, end) in enumerate(zip(run.coll_start, run.coll_end)):
        if buckets:
            yield buckets[c % len(buckets)], start, end


def _group_syncs(ctx: _Context, buckets: list[BucketSync], run: TimelineResult) -> list[GroupSync]:
    by_group: dict[int, list[tuple[BucketSync, float, float]]] = {}
    for b, start, end in _bucket_runs(buckets, run):
        by_group.setdefault(b.group, []).append((b, start, end))
    out = []
    for gi, runs in sorted(by_group.items()):
        g = ctx.groups[gi]
        out.append(GroupSync(list(g.devices), len(g.units), sum(b.nbytes for b, _, _ in runs), g.ranks,
                             g.ring.crosses_nodes, min(start for _, start, _ in runs),
                             max(end for _, _, end in runs), buckets=len(runs),
                             comm_seconds=sum(end - start for _, start, end in runs)))
    return out


def _per_device_comm(ctx: _Context, buckets: list[BucketSync], run: TimelineResult) -> list[float]:
    """Seconds each device spends in gradient collectives."""
    out = [0.0] * ctx.plan.num_devices
    for b, start, end in _bucket_runs(buckets, run):
        for d in b.devices:
            out[d] += end - start
    return out


def _optimizer_steps(ctx: _Context, ready: list[float], cost_model) -> list[tuple[float, float]]:
    """(start, end) of each device's AdamW step: after its last backward and its buckets' syncs."""
    seconds = getattr(cost_model, "optimizer_seconds", None)
    if seconds is None:  # a cost model without one (stand-ins): no optimizer term
        return [(t, t) for t in ready]
    steps = []
    waves = [w.slices for w in ctx.plan.waves]
    held = stepped_elements(waves, ctx.metaops, cost_model.param_count, ctx.zero_stage, ctx.plan.num_devices)
    for d, units in enumerate(held):
        duration = seconds(sum(units.values()), len(units)) if units else 0.0
        steps.append((ready[d], ready[d] + duration))
    return steps


def _param_gathers(ctx: _Context, timer: CollectiveTimer, steps: list[tuple[float, float]]):
    """Each group plan/buckets.py ``regathered_groups`` gathers its updated weights once its members have
    stepped, bucket by bucket (its gradient buckets, one after another, as the runtime streams them; all-gathers,
    or at ZeRO-3 all-to-alls: ``BucketSync.weight_op``);
    gathers sharing a device run one after another, and a cross-node gather shares its nodes' network with the
    cross-node gathers already running there when it starts. (group, start, end) each."""
    gathers = param_gathers(ctx.plan, ctx.groups, ctx.metaops)
    if not gathers:
        return []
    bucket_parts: dict[int, list[tuple[str, float]]] = {}  # group -> its buckets' (collective, bf16 bytes)
    for b in ctx.buckets:
        bucket_parts.setdefault(b.group, []).append((b.weight_op, b.weight_bytes))
    gpn = ctx.cluster.gpus_per_node
    free = [end for _, end in steps]
    out: list[tuple[int, float, float]] = []
    running: list[tuple[float, float, tuple[int, ...], int]] = []  # (start, end, nodes, rings) of cross-node ones
    for gi in sorted(gathers, key=lambda x: max(steps[d][1] for d in ctx.groups[x].devices)):
        g = ctx.groups[gi]
        start = max(free[d] for d in g.devices)
        nodes = nodes_of(g.devices, gpn)
        sharing = g.tp
        if nodes:
            for node in nodes:
                sharing = max(sharing, g.tp + sum(r for a, b, ns, r in running if a <= start < b and node in ns))
        end = start + sum(timer.seconds(op, part, g.ring, sharing) for op, part in bucket_parts[gi])
        for d in g.devices:
            free[d] = end
        if nodes:
            running.append((start, end, nodes, g.tp))
        out.append((gi, start, end))
    return out
