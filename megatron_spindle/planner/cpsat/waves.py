"""Small rules on lists of waves that the search and the models share."""

from __future__ import annotations

from dataclasses import replace

from megatron_spindle.graph.opgraph import MetaGraph
from megatron_spindle.planner.schedule import ScheduledWave, back_to_back

REL_EPS = 1e-9  # makespans closer than this (relative) are equal


def makespan(waves: list[ScheduledWave]) -> float:
    return max((w.end for w in waves), default=0.0)


def better(waves: list[ScheduledWave] | None, than: list[ScheduledWave]) -> bool:
    return waves is not None and makespan(waves) < makespan(than)


def concatenate(parts: list[list[ScheduledWave]]) -> list[ScheduledWave]:
    """Waves of consecutive levels, re-timed back to back (each part may start at any time)."""
    return back_to_back([w for waves in parts for w in sorted(waves, key=lambda w: w.start)])


def renumber(waves: list[ScheduledWave]) -> list[ScheduledWave]:
    """The waves longest first, re-timed from 0, each MetaOp's layer ranges consecutive in that order
    (within one level the waves are interchangeable)."""
    done: dict[str, int] = {}
    out, t = [], 0.0
    for w in sorted(waves, key=lambda w: -w.duration):
        slices = []
        for s in w.slices:
            a = done.get(s.metaop, 0)
            b = a + s.layer_end - s.layer_start
            slices.append(replace(s, layer_start=a, layer_end=b))
            done[s.metaop] = b
        out.append(ScheduledWave(w.level, t, w.duration, slices))
        t += w.duration
    return out


def levels_mixed(metagraph: MetaGraph, waves: list[ScheduledWave]) -> bool:
    """True when some wave holds MetaOps of several levels (a cross-level plan)."""
    return any(len({metagraph.metaops[s.metaop].level for s in w.slices}) > 1 for w in waves)
