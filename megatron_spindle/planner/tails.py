"""A MetaLevel's tail settled into one wave, so that its MetaOps stop moving between device sets.

The wavefront scheduler (and CP-SAT after it) ends a heavy MetaLevel with short waves, each choosing every
remaining MetaOp's device count again (bi-point tuples, extension onto free devices). A MetaOp's last layers
then hop from one device set to another every few milliseconds, and each hop moves its activations (and their
gradients back): across nodes such a hop takes as long as the wave. On clip-10 / 32 GPUs the tail of the
encoder level is 35 ms of waves that its transfers lengthen by 47 ms.

``settle_tail`` replaces the waves of one level from its k-th on by one wave in which every MetaOp left runs all
its remaining layers on one device count: the counts whose longest span is the shortest, and the fewest devices
for it (``min_max_counts``). Placement then keeps most of them on their previous devices, so the tail moves
each MetaOp's activations once. What that costs in balance against what it saves in transfers only an
estimate of the placed plan can tell: the pipeline (planner/pipeline.py) keeps, level by level, the tail whose
plan its own estimate (planner/objective.py) times fastest, or the level as it was.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace

from megatron_spindle.graph.opgraph import MetaGraph
from megatron_spindle.planner.allocator import Curve, efficient_points
from megatron_spindle.planner.light_levels import light_levels
from megatron_spindle.planner.schedule import ScheduledSlice, ScheduledWave, back_to_back

# Tail starts tried per level: its last waves' (the tails of one to this many waves beyond the last one); each
# costs a placement and an estimate.
MAX_TAIL_STARTS = 6
_TIME_RTOL = 1e-12
_OVERLAP_TOL = 1e-9  # waves overlapping by more than this (relative to a wave) come from a cross-level plan


def settled_levels(waves: Sequence[ScheduledWave], metagraph: MetaGraph) -> list[int]:
    """The levels whose tail may be settled: heavy ones (light levels follow their neighbours instead,
    planner/light_levels.py) of two waves or more, in a plan whose waves each hold one level, back to back."""
    ordered = sorted(waves, key=lambda w: w.start)
    if any(len({metagraph.metaops[s.metaop].level for s in w.slices}) > 1 for w in waves) or \
            any(b.start < a.end - _OVERLAP_TOL * max(a.duration, 1e-12) for a, b in zip(ordered, ordered[1:])):
        return []  # a cross-level plan (--spindle-cross-level-overlap): its waves are not a level's one by one
    light = light_levels(metagraph)
    counts = Counter(w.level for w in waves)
    return sorted(level for level, count in counts.items() if count >= 2 and level not in light)


def tail_starts(waves: Sequence[ScheduledWave], level: int) -> list[int]:
    """Indices k into the level's waves (in time order) where a settled tail may start: the last
    ``MAX_TAIL_STARTS`` of them that leave at least two waves in the tail."""
    count = sum(w.level == level for w in waves)
    return list(range(max(0, count - 1 - MAX_TAIL_STARTS), count - 1))


def min_max_counts(layers: Mapping[str, int], curves: Mapping[str, Curve], num_devices: int) -> dict[str, int] | None:
    """Per MetaOp, a device count among its curve's (each faster than every smaller one) such that the longest
    ``T(n) x layers`` is the shortest possible on ``num_devices`` devices, each MetaOp on the fewest devices that
    keep within it; None when the smallest counts alone need more devices."""
    points = {m: efficient_points(curves[m], num_devices, name=f"MetaOp '{m}'") for m in layers}
    if sum(p[0][0] for p in points.values()) > num_devices:
        return None
    for span in sorted({t * layers[m] for m, p in points.items() for _, t in p}):
        counts = {}
        for m, p in points.items():
            fits = [n for n, t in p if t * layers[m] <= span * (1.0 + _TIME_RTOL)]
            if not fits:
                break
            counts[m] = fits[0]
        else:
            if sum(counts.values()) <= num_devices:
                return counts
    return None  # unreachable: the largest span lets every MetaOp take its smallest count


def settle_tail(waves: Sequence[ScheduledWave], level: int, k: int, curves: Mapping[str, Curve],
                num_devices: int) -> list[ScheduledWave] | None:
    """``waves`` with the level's waves from its k-th (in time order) on replaced by one wave (module
    docstring), every wave re-timed back to back and every device cleared (placement runs after); None when the
    remaining MetaOps cannot run side by side on ``num_devices`` devices."""
    ordered = sorted(waves, key=lambda w: w.start)
    own = [i for i, w in enumerate(ordered) if w.level == level]
    tail = own[k:]
    if len(tail) < 2:
        return None
    first_layer: dict[str, int] = {}
    last_layer: dict[str, int] = {}
    for i in tail:
        for s in ordered[i].slices:
            first_layer[s.metaop] = min(first_layer.get(s.metaop, s.layer_start), s.layer_start)
            last_layer[s.metaop] = max(last_layer.get(s.metaop, s.layer_end), s.layer_end)
    layers = {m: last_layer[m] - a for m, a in first_layer.items()}
    counts = min_max_counts(layers, curves, num_devices)
    if counts is None:
        return None
    slices = []
    for m, n in counts.items():
        tp, dp = curves[m].config(n)
        slices.append(ScheduledSlice(m, n, tp, dp, first_layer[m], last_layer[m], curves[m].time(n) * layers[m]))
    settled = ScheduledWave(level, 0.0, max(s.time for s in slices), slices)
    dropped = set(tail)
    kept = [w for i, w in enumerate(ordered) if i not in dropped]
    kept.insert(tail[0], settled)
    return back_to_back([replace(w, slices=[replace(s, devices=None) for s in w.slices]) for w in kept])
