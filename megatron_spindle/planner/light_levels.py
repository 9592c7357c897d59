"""Light MetaLevels follow their neighbours' layout, so that their hand-offs stay on the same devices.

A MetaLevel of light MetaOps only (front ends, projectors, heads, LM heads, losses: ``LIGHT_KINDS``) takes a
few milliseconds however it is allocated, so the allocator's and the solver's choice of its device counts is
arbitrary for the makespan, but not for the transfers: a front end spread data-parallel over 32 devices hands
each 2-device encoder slice rows from every node, over the network. Here every MetaOp of such a level runs on
the data-parallel degree of the slice it exchanges activations with (a front end: its consumer's first slice;
a head or a loss: its producer's last slice), TP 1 (light operators do not split), and the level's slices are
packed first-fit into waves of at most N devices. Placement then puts each one where its rows are (local
copies). A MetaOp whose neighbour's degree is not one of its valid device counts keeps its slice.

Placement still moves some of them elsewhere (a wave's packing, memory), so after placement ``pin_to_partners``
puts every light slice on exactly its partner's data-parallel devices and packs the light levels again into
waves of disjoint devices; ``pinned_plan`` does it to a finished plan, which plan selection
(megatron_spindle/autoplan.py) times beside the unpinned one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from megatron_spindle.estimator.configs import LIGHT_KINDS
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaGraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan.schema import Plan
from megatron_spindle.planner.assemble import assemble_plan, slice_id
from megatron_spindle.planner.objective import estimate_iteration
from megatron_spindle.planner.schedule import ScheduledSlice, ScheduledWave, back_to_back, scheduled_slice


def light_levels(metagraph: MetaGraph) -> set[int]:
    """The MetaLevels whose MetaOps are all light."""
    return {k for k, level in enumerate(metagraph.levels)
            if level and all(metagraph.metaops[m].kind in LIGHT_KINDS for m in level)}


def follow_neighbours(waves: Sequence[ScheduledWave], metagraph: MetaGraph, curves: Mapping,
                      num_devices: int) -> list[ScheduledWave]:
    """The waves with every light level re-laid-out (module docstring) and all waves re-timed back to back;
    the waves unchanged when the graph has no light level. Devices are cleared (placement runs after)."""
    if not light_levels(metagraph):
        return list(waves)
    out, _ = _relay_light_levels(waves, metagraph, lambda s, partner: _followed(s, curves, partner),
                                 lambda level, slices: _pack(level, slices, num_devices))
    return back_to_back(out)


def _followed(s: ScheduledSlice, curves: Mapping, partner: ScheduledSlice | None) -> ScheduledSlice:
    """``s`` on its partner's data-parallel degree without devices, or ``s`` without devices when it cannot be."""
    curve = curves.get(s.metaop)
    dp = partner.dp if partner is not None else None
    if dp is None or curve is None or dp not in curve.valid_ns or curve.config(dp) != (1, dp):
        return replace(s, devices=None)
    layers = s.layer_end - s.layer_start
    return ScheduledSlice(s.metaop, dp, 1, dp, s.layer_start, s.layer_end, curve.time(dp) * layers)


def _relay_light_levels(waves: Sequence[ScheduledWave], metagraph: MetaGraph,
                        relay: Callable[[ScheduledSlice, ScheduledSlice | None], ScheduledSlice],
                        pack: Callable[[int, list[ScheduledSlice]], list[ScheduledWave]],
                        ) -> tuple[list[ScheduledWave], bool]:
    """The waves level by level, every light level's slices replaced by ``relay(slice, partner)`` and packed
    into waves again by ``pack``; and whether any slice changed. Levels go in order and a relaid slice becomes
    its MetaOp's first / last, so a loss follows its head as relaid."""
    light = light_levels(metagraph)
    first, last, consumers = _chain_ends(waves, metagraph)
    out: list[ScheduledWave] = []
    moved = False
    for level in sorted({w.level for w in waves}):
        mine = [w for w in waves if w.level == level]
        if level not in light:
            out += mine
            continue
        relaid = []
        for w in mine:
            for s in w.slices:
                new = relay(s, _partner(s.metaop, metagraph, first, last, consumers))
                moved |= new is not s
                relaid.append(new)
                if s.layer_start == 0:
                    first[s.metaop] = new
                if s.layer_end == metagraph.metaops[s.metaop].num_layers:
                    last[s.metaop] = new
        out += pack(level, relaid)
    return out, moved


def _chain_ends(waves: Sequence[ScheduledWave], metagraph: MetaGraph):
    """Each MetaOp's first and last slice, and each MetaOp's consumers."""
    slices = [s for w in waves for s in w.slices]
    first = {s.metaop: s for s in slices if s.layer_start == 0}
    last = {s.metaop: s for s in slices if s.layer_end == metagraph.metaops[s.metaop].num_layers}
    consumers: dict[str, list[str]] = {}
    for src, dst in metagraph.edges:
        consumers.setdefault(src, []).append(dst)
    return first, last, consumers


def _partner(mid: str, metagraph: MetaGraph, first, last, consumers) -> ScheduledSlice | None:
    """The slice a light MetaOp exchanges activations with: its first producer's last slice, else (a front
    end) its first consumer's first slice."""
    preds = metagraph.predecessors(mid)
    if preds:
        return last.get(preds[0])
    for c in consumers.get(mid, []):
        if c in first:
            return first[c]
    return None


def _pack(level: int, slices: list[ScheduledSlice], num_devices: int) -> list[ScheduledWave]:
    """First-fit decreasing by device count; a MetaOp's slices (one each here) never share a wave."""
    bins: list[list[ScheduledSlice]] = []
    for s in sorted(slices, key=lambda s: (-s.n, s.metaop)):
        for b in bins:
            if sum(x.n for x in b) + s.n <= num_devices and all(x.metaop != s.metaop for x in b):
                b.append(s)
                break
        else:
            bins.append([s])
    return [ScheduledWave(level, 0.0, max(s.time for s in b), b) for b in bins]


def pin_to_partners(waves: Sequence[ScheduledWave], metagraph: MetaGraph, curves: Mapping,
                    time_scale: float = 1.0) -> list[ScheduledWave]:
    """Placed waves with every light level's slices on the devices of the slice they exchange activations with.

    After placement a light MetaOp may still sit on other devices than its partner (``_partner``), so its
    hand-off crosses devices, often nodes. Here it runs data-parallel on its partner's data-parallel degree,
    data-parallel rank k on the device of the partner's rank k (its first TP rank), so the hand-off is a local
    copy (and an NVLink copy to the other TP ranks). Slices whose partner's degree is not a valid count of their
    own keep their devices. Two slices on common devices cannot share a wave any more, so each light level is
    packed again (longest first into the first wave whose devices are disjoint from it) and every wave re-timed
    back to back. Levels are pinned in order, so a loss follows its head where it was pinned. ``time_scale``:
    the waves' time per curve time (the micro-batches of an iteration). Returns ``waves`` itself when nothing
    moves."""
    if not light_levels(metagraph):
        return waves
    out, moved = _relay_light_levels(
        waves, metagraph, lambda s, partner: _pinned(s, metagraph, curves, partner, time_scale), _pack_disjoint)
    return back_to_back(out) if moved else waves


def _pinned(s: ScheduledSlice, metagraph: MetaGraph, curves: Mapping, partner: ScheduledSlice | None,
            time_scale: float) -> ScheduledSlice:
    """``s`` on its partner's data-parallel devices, or ``s`` itself when it already is or cannot be."""
    curve = curves.get(s.metaop)
    if partner is None or partner.devices is None or curve is None:
        return s
    dp = partner.dp
    devices = [partner.devices[k * partner.tp] for k in range(dp)]
    if (s.tp, s.dp, s.devices) == (1, dp, devices):
        return s
    if dp not in curve.valid_ns or curve.config(dp) != (1, dp) or metagraph.metaops[s.metaop].batch % dp:
        return s
    layers = s.layer_end - s.layer_start
    return ScheduledSlice(s.metaop, dp, 1, dp, s.layer_start, s.layer_end, curve.time(dp) * layers * time_scale,
                          devices)


def _pack_disjoint(level: int, slices: list[ScheduledSlice]) -> list[ScheduledWave]:
    """Longest slice first into the first wave whose devices it does not touch (and whose MetaOps it is not)."""
    bins: list[tuple[set[int], list[ScheduledSlice]]] = []
    for s in sorted(slices, key=lambda s: (-s.time, s.metaop)):
        for used, members in bins:
            if used.isdisjoint(s.devices) and all(x.metaop != s.metaop for x in members):
                used.update(s.devices)
                members.append(s)
                break
        else:
            bins.append((set(s.devices), [s]))
    return [ScheduledWave(level, 0.0, max(s.time for s in members), members) for _, members in bins]


def pinned_plan(plan: Plan, metagraph: MetaGraph, curves: Mapping, workload: Workload, cluster: ClusterSpec,
                cost_model, memory_model, level_allocs=None) -> Plan | None:
    """``plan`` with its light levels pinned to their partners (``pin_to_partners``) and everything derived
    again (transfers, parameter device groups, memory, the planner's estimate); None when nothing moves or
    the plan has an explicit execution order (its steps name waves by index). Per-slice recomputation keeps
    its slices under their new wave indices."""
    settings = plan.settings
    if settings.order is not None or settings.segments is not None or settings.backward_order is not None:
        return None
    waves = [ScheduledWave(w.level, w.start, w.duration, [scheduled_slice(s) for s in w.slices]) for w in plan.waves]
    pinned = pin_to_partners(waves, metagraph, curves, settings.micro_batches)
    if pinned is waves:
        return None
    index = {(s.metaop, s.layer_start): wi for wi, w in enumerate(pinned) for s in w.slices}
    recompute = {slice_id(index[(s.metaop, s.layer_start)], s.metaop): settings.slice_recompute[s.id]
                 for w in plan.waves for s in w.slices if s.id in settings.slice_recompute}
    out = assemble_plan(workload, cluster, metagraph, pinned, cost_model, memory_model, dict(plan.planner),
                        level_allocs=level_allocs, curves=curves,
                        settings=dataclasses.replace(settings, slice_recompute=recompute))
    out.planner["light_levels"] = "pinned to their partners' devices"
    out.predicted.update(estimate_iteration(out, metagraph, cluster, cost_model).as_predicted())
    return out
