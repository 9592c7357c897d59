"""The planner's own estimate of a plan's iteration time: what its waves of T(n) leave out.

T(n) is forward + backward compute without gradient sync (``LayerCost.step``). The estimate runs the plan's
steps (plan/order.py) as dataflow, a slice's phase starting when its devices are done with their previous ones
and its inputs have arrived, every slice's phase timed like the simulator times it
(estimator/slice_time.py: ``step_phases``, ``recompute_seconds``, the ZeRO copies and ZeRO-3's prefetched
weight gathers), and adds, from the estimator's models and plan/'s rules:

- **transfers**: what they add to the span: a slice's forward waits for its activations, a backward for their
  gradients, each transfer timed by estimator/transfer.py on plan/routing.py's messages, leaving when its
  sender's phase ends and its devices' links are free (as the simulator times it), so only the transfers on the
  span's path cost; where a device loses compute time per message (``ClusterSpec.message_host_seconds``, a
  profiled CPU device), the sending and the receiving phase take that much longer;
- **gradient sync**: the buckets of every parameter device group (plan/buckets.py), each ready when its last
  unit's accumulation is done in the backward (waves run backward in reverse, a slice's layers from last to
  first), cut at the plan's bucket size, reduced by the comm model on its group's ring; per device, its buckets
  overlap the rest of the backward (follow it, without ``overlap_grad_reduce``) at the cluster's overlap
  slowdown (C10 unless measured; ``overlapped_backward_seconds``), and what they add beyond the backward counts;
- **optimizer**: the slowest device's AdamW step (plan/layout.py ``stepped_elements``), and with ZeRO 1 or 2
  the all-gather of the updated weights (ZeRO-3's regathered groups: their redistribution; with
  ``settings.overlap_param_gather`` what it adds to the forward beside which it runs: bucket by bucket in the
  order they are needed, a layer waiting for its own bucket, the compute beside a gather slowed as the backward
  beside a bucket's reduction is).

It is an estimate: transfers leave in the order of the steps, links are taken first come, first served, a node's
network is not shared, and a device's gathers do not wait for the other devices of their group; the simulator
(megatron_spindle/simulator) times the same plan with contention and fluid network sharing, and plan selection
(megatron_spindle/autoplan.py) keeps the plan it times fastest.
``plan.predicted["planner_estimate"]`` records this estimate.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import NamedTuple

from megatron_spindle.estimator.comm_model import CommModel, GroupPlacement, overlapped_backward_seconds
from megatron_spindle.estimator.estimate import exposed_sync_seconds, weight_sharers
from megatron_spindle.estimator.slice_time import slice_phase_seconds
from megatron_spindle.estimator.transfer import (
    link_devices,
    transfer_host_seconds,
    transfer_load,
    transfer_seconds,
)
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaGraph
from megatron_spindle.plan.buckets import (
    bucket_limit,
    completion_sorted,
    overlaps_param_gather,
    regather_collective,
    regathered_groups,
    split_buckets,
    sync_rounds,
    synced_micro_batches,
    unit_completion,
    unit_holders,
    wave_rounds,
    weights_wanted_at,
)
from megatron_spindle.plan.derive import plan_slice_pairs
from megatron_spindle.plan.layout import device_programs, first_operators, stepped_elements
from megatron_spindle.plan.memory import WEIGHT_BYTES_PER_PARAM, grad_reduce_bytes
from megatron_spindle.plan.order import BWD, FWD, slice_order
from megatron_spindle.plan.routing import Router
from megatron_spindle.plan.schema import Plan
from megatron_spindle.plan.timeline import device_components
from megatron_spindle.plan.tp_shards import group_rings


@dataclass(frozen=True)
class PlanEstimate:
    """Seconds of one iteration as the planner estimates it; ``total`` is their sum."""

    waves: float  # the plan's steps as dataflow, as if every transfer were free
    transfers: float
    grad_sync: float  # beyond the backward: exposed buckets and the overlap slowdown
    optimizer: float
    param_gather: float

    @property
    def total(self) -> float:
        return self.waves + self.transfers + self.grad_sync + self.optimizer + self.param_gather

    def as_predicted(self) -> dict[str, float]:
        out = {f"planner_estimate_{k}": v for k, v in asdict(self).items()}
        out["planner_estimate"] = self.total
        return out


def backward_share(cost_model, metaop, tp: int, dp: int) -> float:
    """The backward's share of one operator's forward + backward (2/3 for cost models without phases)."""
    phases = getattr(cost_model, "phase_seconds", None)
    if phases is None:
        return 2.0 / 3.0
    fwd, bwd = phases(metaop, tp, dp)
    return bwd / (fwd + bwd) if fwd + bwd > 0 else 2.0 / 3.0


def exposed_sync_share(plan: Plan, metagraph: MetaGraph, cost_model) -> float:
    """The device time the plan's slices would add, relative to their own, if each carried the gradient sync its
    configuration cannot hide behind its backward (what sync-aware curves charge, estimator/estimate.py)."""
    sharers = weight_sharers(metagraph)
    own = added = 0.0
    for s in plan.slices():
        devices = len(s.devices)
        own += s.predicted_time * devices
        added += devices * s.num_layers * exposed_sync_seconds(cost_model, metagraph.metaops[s.metaop], s.tp, s.dp,
                                                              sharers[s.metaop])
    return added / own if own > 0 else 0.0


def estimate_iteration(plan: Plan, metagraph: MetaGraph, cluster: ClusterSpec, cost_model) -> PlanEstimate:
    """The planner's estimate of ``plan``'s iteration time (module docstring)."""
    comm = CommModel(cluster)
    metaops = metagraph.metaops
    waves = [w.slices for w in plan.waves]
    times = _unit_ready(plan, metaops, cost_model, _hand_offs(plan, metaops, cost_model, comm), comm)
    sync, gather = _sync_seconds(plan, metaops, cluster, cost_model, comm, times)
    held = stepped_elements(waves, metaops, cost_model.param_count, plan.settings.zero_stage, plan.num_devices)
    step = getattr(cost_model, "optimizer_seconds", None)
    optimizer = max((step(sum(u.values()), len(u)) for u in held if u), default=0.0) if step else 0.0
    return PlanEstimate(times.compute, times.span - times.compute, sync, optimizer, gather)


class UnitTimes(NamedTuple):
    """What ``_unit_ready`` times: the compute span without transfers, the span with them, per (gradient round,
    unit) the time of its last accumulation in that round (plan/buckets.py ``sync_rounds``: one round but
    under ZeRO 2 and 3 with segments) of the last micro-batch's backward, and per unit the time the first
    micro-batch's forward first uses it (the operator of its first use starting at its share of the slice's
    phase, as the simulator gates a slice's layers on their weight gathers)."""

    compute: float
    span: float
    ready: dict[tuple[int, str], float]
    first_use: dict[str, float]


class Flow(NamedTuple):
    """One direction of a transfer: its seconds, the devices whose links it occupies, and the compute time its
    busiest device loses to its messages (charged to the sending and the receiving phase)."""

    seconds: float
    links: tuple[int, ...]
    host: float = 0.0


def _hand_offs(plan: Plan, metaops, cost_model, comm: CommModel) -> dict[tuple[str, str], tuple[Flow, Flow]]:
    """(producer, consumer) slice ids -> the forward transfer and its gradients backward, one micro-batch's rows
    (estimator/transfer.py on plan/routing.py's messages)."""
    slices = {s.id: s for s in plan.slices()}
    router = Router(plan.gpus_per_node)
    cache: dict[tuple, Flow] = {}
    out = {}
    for p, c in plan_slice_pairs(plan):
        src, dst = slices[p], slices[c]
        m = metaops[src.metaop]
        rows = m.batch // plan.settings.micro_batches
        per_row = float(cost_model.activation_bytes(m)) / m.batch
        flows = []
        for holders, needers in ((src, dst), (dst, src)):  # activations forward, their gradients backward
            key = (router.key(holders, needers, rows), per_row)
            if key not in cache:
                load = transfer_load(router.route(holders, needers, rows), per_row)
                cache[key] = Flow(transfer_seconds(load, comm), link_devices(load), transfer_host_seconds(load, comm))
            flows.append(cache[key])
        out[(p, c)] = (flows[0], flows[1])
    return out


def slice_phases(plan: Plan, metaops, cost_model, comm: CommModel | None = None) -> dict[str, tuple[float, float]]:
    """slice id -> (forward, backward) seconds of one micro-batch, as the simulator charges them
    (estimator/slice_time.py: the cost model's phases, recomputation, ZeRO copies and ZeRO-3's prefetched
    gathers). ``comm``: the links the plan is estimated on (default: the plan's own cluster)."""
    comm = comm or CommModel(ClusterSpec.from_dict(plan.cluster))
    return {s.id: slice_phase_seconds(cost_model, comm, metaops[s.metaop], s, plan.settings) for s in plan.slices()}


def _unit_ready(plan: Plan, metaops, cost_model,
                hand_offs: dict[tuple[str, str], tuple[Flow, Flow]] | None = None, comm: CommModel | None = None,
                ) -> UnitTimes:
    """``UnitTimes`` of the plan's steps as dataflow: in the plan's order, a slice's phase starts when each of
    its devices has ended its previous phase (the transfer-free span the same without waiting for inputs); a
    later micro-batch starts where its component (``device_components``: slices joined by a device or a
    hand-off, one per node group of a node-group plan) ended the previous one. With ``hand_offs``
    (``_hand_offs``) a slice's phase also waits for its inputs, as the simulator times transfers: a forward for
    its activations, a backward for their gradients, each transfer leaving when its sender's phase ends and its
    devices' links are free (first come, first served); a transfer only costs where it is on that path. A flow's
    ``host`` seconds lengthen its sender's and its receiver's phase (not the transfer-free span)."""
    waves = plan.waves
    tasks = [[s.task for s in w.slices] for w in waves]
    micro = plan.settings.micro_batches
    phases = slice_phases(plan, metaops, cost_model, comm)
    component = device_components(plan)
    sends: dict[tuple[str, str], list[tuple[tuple[str, str], Flow]]] = {}  # (slice, phase) -> (receiver, flow)
    host: dict[tuple[str, str], float] = {}  # (slice, phase) -> compute time lost to its messages
    for (p, c), (forward, backward) in (hand_offs or {}).items():
        for sender, receiver, flow in (((p, FWD), (c, FWD), forward), ((c, BWD), (p, BWD), backward)):
            sends.setdefault(sender, []).append((receiver, flow))
            for key in (sender, receiver):
                host[key] = host.get(key, 0.0) + flow.host
    steps: list[list[tuple[int, int, str]]] = []
    for wi, si, phase in slice_order(tasks, plan.settings):  # consecutive entries of a wave and phase: a step
        if steps and steps[-1][0][0] == wi and steps[-1][0][2] == phase:
            steps[-1].append((wi, si, phase))
        else:
            steps.append([(wi, si, phase)])
    clock: dict[int, float] = {}  # device -> when its last phase ends
    alone: dict[int, float] = {}  # the devices' clocks as if every transfer were free
    arrival: dict[tuple[str, str], float] = {}  # (slice, phase) -> when its last input has arrived
    link_free: dict[int, float] = {}
    ready: dict[tuple[int, str], tuple[float, int]] = {}  # (round, unit) -> (time in its component, component)
    rounds = wave_rounds(len(waves), plan.settings)
    first_use: dict[str, float] = {}  # unit -> its first forward use (the first micro-batch's)
    ends: dict[int, float] = {}  # component -> when its last phase ends
    for step in steps:
        done: list[tuple[tuple[str, str], float]] = []
        for wi, si, phase in step:
            s = waves[wi].slices[si]
            c, own = component[s.id], phases[s.id][1 if phase == BWD else 0]
            key = (s.id, phase)
            t = max([arrival.get(key, 0.0)] + [clock.get(d, 0.0) for d in s.devices])
            done.append((key, t + own + host.get(key, 0.0)))
            ends[c] = max(ends.get(c, 0.0), done[-1][1])
            free = max(alone.get(d, 0.0) for d in s.devices) + own
            for d in s.devices:
                clock[d], alone[d] = done[-1][1], free
            ops = s.layer_end - s.layer_start
            for u, i in first_operators(metaops[s.metaop], s).items():
                if phase != BWD:
                    wanted = weights_wanted_at(plan.settings.zero_stage, i)
                    first_use[u] = min(first_use.get(u, math.inf), t + own * wanted / ops)
                    continue
                at = t + own * (ops - i) / ops
                if (rounds[wi], u) not in ready or at > ready[rounds[wi], u][0]:
                    ready[rounds[wi], u] = (at, c)
        for key, end in sorted(done, key=lambda kv: kv[1]):  # the step's transfers leave as their senders end
            for receiver, (seconds, links, _) in sends.get(key, []):
                start = max([end] + [link_free.get(d, 0.0) for d in links])
                for d in links:
                    link_free[d] = start + seconds
                arrival[receiver] = max(arrival.get(receiver, 0.0), start + seconds)
    span = max(clock.values(), default=0.0)
    return UnitTimes(max(alone.values(), default=0.0) * micro, span * micro,
                     {key: r + ends[c] * (micro - 1) for key, (r, c) in ready.items()}, first_use)


def _gathers_added(gathers: list[tuple[float, float]], span: float, slowdown: float, latency: float) -> float:
    """What one device's weight all-gathers add to its ``span`` (its timeline as if every device were busy from
    0): ``gathers`` holds (needed by, seconds) per bucket in issue order, all issued at 0 and run one after
    another. While a gather runs beside compute both progress ``slowdown`` times slower and the gather takes
    ``latency`` more (as ``overlapped_backward_seconds``, the simulator's timeline); where the compute reaches a
    bucket's need before it is gathered, it waits (and the gather runs alone)."""
    t, pos = 0.0, 0.0  # wall time, position on the span
    for needed, seconds in gathers:
        left, rate = seconds, 1.0 / (slowdown + (latency / seconds if seconds > 0 else 0.0))
        while left > 1e-18:
            limit = min(needed, span)
            if pos >= limit:  # the compute waits for it, or has none left
                t, left = t + left, 0.0
                break
            dt = min((limit - pos) * slowdown, left / rate)
            t, pos, left = t + dt, pos + dt / slowdown, left - dt * rate
    return max(0.0, t + (span - pos) - span)


def _sync_seconds(plan: Plan, metaops, cluster: ClusterSpec, cost_model, comm: CommModel,
                  unit_times: UnitTimes) -> tuple[float, float]:
    """(what the gradient buckets add beyond the compute on the worst device, the weight gather after the step
    of the groups plan/buckets.py ``regathered_groups`` names), given ``_unit_ready``'s times: the span
    (transfers included), unit accumulations and first uses. Each bucket can overlap any compute after its last
    unit's accumulation (a later segment's forward too)."""
    settings = plan.settings
    waves = [w.slices for w in plan.waves]
    bwd_span, ready = unit_times.span, unit_times.ready
    if bwd_span <= 0:
        return 0.0, 0.0
    completion = unit_completion(waves, metaops, settings)
    micro = settings.micro_batches
    synced, per_micro_batch = synced_micro_batches(settings.zero_stage, micro), bwd_span / micro
    rounds = len(sync_rounds(len(waves), settings))
    # without --overlap-grad-reduce a round's buckets wait for its last accumulation (the last round's, the span)
    round_end = [max((t for (q, _), t in ready.items() if q == r), default=bwd_span) for r in range(rounds - 1)]
    round_end.append(bwd_span)
    op = "all_reduce" if settings.zero_stage == 0 else "reduce_scatter"
    regathered = regathered_groups(waves, metaops, [(g.devices, g.params) for g in plan.param_groups],
                                   settings.zero_stage, plan.weight_scope)
    shards = group_rings(waves, metaops, [(g.devices, g.params) for g in plan.param_groups], settings)
    rings = [(g, r.degree, r.share, GroupPlacement.of_devices(r.devices, cluster), again)
             for g, r, again in zip(plan.param_groups, shards, regathered)]
    per_device: dict[int, list[tuple[float, float]]] = {}
    gathers: dict[int, list[tuple[float, float]]] = {}  # device -> (needed by, seconds) of its buckets
    overlapped = overlaps_param_gather(settings)
    holders = unit_holders(waves, metaops)
    for g, tp, share, ring, again in rings:
        if ring.size <= 1 or not g.params:
            continue
        sharing = tp if ring.crosses_nodes else 1  # its own TP rings; other groups' overlap is not estimated
        limit = bucket_limit(settings.ddp_bucket_size, len(g.devices))
        buckets = split_buckets(completion_sorted(g.params, completion), cost_model.param_count, limit)
        for units in buckets:
            params = sum(cost_model.param_count(u) for u in units)
            seconds = comm.collective_seconds(op, grad_reduce_bytes(params, settings) * share, ring, sharing)
            for r in range(rounds):  # one, or (ZeRO 2 and 3) each segment's: the buckets it accumulates
                at = max((ready[r, u] for u in units if (r, u) in ready), default=None)
                if at is None:
                    continue
                if not settings.overlap_grad_reduce:  # issued once the backward reaches the next round
                    at = round_end[r]
                for mb in synced:  # the last micro-batch's accumulations, or (ZeRO 2 and 3) every micro-batch's
                    shift = per_micro_batch * (micro - 1 - mb) if settings.overlap_grad_reduce else 0.0
                    for d in g.devices:
                        per_device.setdefault(d, []).append((at - shift, seconds))
            if again:  # its updated weights gathered after the step
                needed = min(unit_times.first_use.get(u, 0.0) for u in units) if overlapped else 0.0
                weight_op, moved = regather_collective(settings.zero_stage, holders, units, tp, share,
                                                       cost_model.param_count, plan.weight_scope)
                gathered = comm.collective_seconds(weight_op, moved * WEIGHT_BYTES_PER_PARAM, ring, sharing)
                for d in g.devices:
                    gathers.setdefault(d, []).append((needed, gathered))
    extra = 0.0
    done: dict[tuple, float] = {}
    for devices in device_programs(waves, plan.num_devices).values():
        buckets = tuple(sorted(per_device.get(devices[0], [])))
        if not buckets:
            continue
        if buckets not in done:
            fractions, running = [], 0.0
            for at, _ in buckets:  # without --overlap-grad-reduce at its round's end (one round: the backward's)
                running = max(running, min(1.0, at / bwd_span))
                fractions.append(running)
            times = overlapped_backward_seconds(bwd_span, [s for _, s in buckets], fractions,
                                                comm.overlap_slowdown, comm.overlap_latency)
            done[buckets] = max(0.0, times.end - bwd_span)
        extra = max(extra, done[buckets])
    # with --overlap-param-gather the gathers run beside the forward, in the order they are needed (plan/buckets.py
    # ``gather_order``); else after the step, on their own
    added: dict[tuple, float] = {}
    for mine in gathers.values():
        key = tuple(sorted(mine))
        if key not in added:
            added[key] = _gathers_added(list(key), bwd_span, comm.overlap_slowdown, comm.overlap_latency) \
                if overlapped else sum(s for _, s in key)
    return extra, max(added.values(), default=0.0)
