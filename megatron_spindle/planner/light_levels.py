"""Light MetaLevels follow their neighbours' layout, so that their hand-offs stay on the same devices.

A MetaLevel of light MetaOps only (front ends, projectors, heads, LM heads, losses: ``LIGHT_KINDS``) takes a
few milliseconds however it is allocated, so the allocator's and the solver's choice of its device counts is
arbitrary for the makespan, but not for the transfers: a front end spread data-parallel over 32 devices hands
each 2-device encoder slice rows from every node, over the network. Here every MetaOp of such a level runs on
the data-parallel degree of the slice it exchanges activations with (a front end: its consumer's first slice;
a head or a loss: its producer's last slice), TP 1 (light operators do not split), and the level's slices are
packed first-fit into waves of at most N devices. Placement then puts each one where its rows are (local
copies). A MetaOp whose neighbour's degree is not one of its valid device counts keeps its slice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from megatron_spindle.estimator.configs import LIGHT_KINDS
from megatron_spindle.graph.opgraph import MetaGraph
from megatron_spindle.planner.schedule import ScheduledSlice, ScheduledWave


def light_levels(metagraph: MetaGraph) -> set[int]:
    """The MetaLevels whose MetaOps are all light."""
    return {k for k, level in enumerate(metagraph.levels)
            if level and all(metagraph.metaops[m].kind in LIGHT_KINDS for m in level)}


def follow_neighbours(waves: Sequence[ScheduledWave], metagraph: MetaGraph, curves: Mapping,
                      num_devices: int) -> list[ScheduledWave]:
    """The waves with every light level re-laid-out (module docstring) and all waves re-timed back to back;
    the waves unchanged when the graph has no light level. Devices are cleared (placement runs after)."""
    light = light_levels(metagraph)
    if not light:
        return list(waves)
    slices = [s for w in waves for s in w.slices]
    first = {s.metaop: s for s in slices if s.layer_start == 0}
    last = {s.metaop: s for s in slices if s.layer_end == metagraph.metaops[s.metaop].num_layers}
    consumers: dict[str, list[str]] = {}
    for src, dst in metagraph.edges:
        consumers.setdefault(src, []).append(dst)
    out: list[ScheduledWave] = []
    for level in sorted({w.level for w in waves}):
        mine = [w for w in waves if w.level == level]
        if level not in light:
            out += mine
            continue
        relaid = []
        for w in mine:
            for s in w.slices:
                m = metagraph.metaops[s.metaop]
                partner = _partner(m.id, metagraph, first, last, consumers)
                curve = curves.get(m.id)
                dp = partner.dp if partner is not None else None
                if dp is None or curve is None or dp not in curve.valid_ns or curve.config(dp) != (1, dp):
                    relaid.append(replace(s, devices=None))
                    continue
                layers = s.layer_end - s.layer_start
                new = ScheduledSlice(m.id, dp, 1, dp, s.layer_start, s.layer_end, curve.time(dp) * layers)
                relaid.append(new)
                if s.layer_end == m.num_layers:
                    last[m.id] = new
                if s.layer_start == 0:
                    first[m.id] = new
        out += _pack(level, relaid, num_devices)
    return _retime(out)


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


def _retime(waves: list[ScheduledWave]) -> list[ScheduledWave]:
    out, t = [], 0.0
    for w in waves:
        out.append(ScheduledWave(w.level, t, w.duration, list(w.slices)))
        t += w.duration
    return out
