"""Device ranges for the slices of a wave: contiguous, tp-aligned, inside islands when possible.

A slice gets a contiguous device range ``[o, o + n)`` with ``o`` a multiple of tp, so with tp dividing the
node size every TP group stays inside a node and gets the rank layout of plan/schema.py. Models whose
objective and constraints do not depend on *which* devices keep only a device count per wave, and the
ranges are packed afterwards here (which always fits when the tp degrees divide one another).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.planner.cpsat.problem import SliceOption
from megatron_spindle.planner.schedule import ScheduledSlice, ScheduledWave


def pack_ranges(sizes: list[tuple[int, int]], cluster: ClusterSpec) -> list[int] | None:
    """Contiguous, tp-aligned start offsets for slices of (n, tp) that fit side by side, or None.

    First island-friendly (largest first: a slice that fits a node goes into one island, a larger one starts
    at an island boundary), else plain left-to-right by decreasing tp, which always succeeds when the total
    fits and the tp degrees divide one another (each start is then a multiple of the next tp).
    """
    return _pack_islands(sizes, cluster) or _pack_line(sizes, cluster.num_devices)


def pack_slices(slices: Sequence[ScheduledSlice], cluster: ClusterSpec) -> bool:
    """Give the slices of one wave packed device ranges (pack_ranges); False, devices untouched, if they
    do not pack."""
    starts = pack_ranges([(s.n, s.tp) for s in slices], cluster)
    if starts is None:
        return False
    for s, st in zip(slices, starts):
        s.devices = list(range(st, st + s.n))
    return True


def with_ranges(waves: list[ScheduledWave], cluster: ClusterSpec) -> bool:
    """Give every slice a packed device range; False if some wave does not pack."""
    return all(pack_slices(w.slices, cluster) for w in waves)


def tp_degrees_nest(slice_options: Mapping[str, Sequence[SliceOption]]) -> bool:
    """True when every pair of tp degrees in use divides one another (then any wave packs into ranges)."""
    tps = sorted({o.tp for opts in slice_options.values() for o in opts})
    return all(b % a == 0 for a, b in zip(tps, tps[1:]))


def range_start(devices: list[int] | None, n: int) -> int | None:
    """The first device if ``devices`` is the range [first, first + n), else None."""
    if not devices or len(devices) != n:
        return None
    lo = min(devices)
    return lo if list(devices) == list(range(lo, lo + n)) else None


def _pack_islands(sizes: list[tuple[int, int]], cluster: ClusterSpec) -> list[int] | None:
    G, islands = cluster.gpus_per_node, cluster.num_nodes
    free = [[True] * G for _ in range(islands)]
    starts: list[int | None] = [None] * len(sizes)
    for idx in sorted(range(len(sizes)), key=lambda i: (-sizes[i][0], -sizes[i][1])):
        n, tp = sizes[idx]
        starts[idx] = _first_fit(free, n, tp, G, islands)
        if starts[idx] is None:
            return None
    return starts  # type: ignore[return-value]


def _pack_line(sizes: list[tuple[int, int]], num_devices: int) -> list[int] | None:
    starts: list[int] = [0] * len(sizes)
    cursor = 0
    for idx in sorted(range(len(sizes)), key=lambda i: (-sizes[i][1], -sizes[i][0])):
        n, tp = sizes[idx]
        cursor = -(-cursor // tp) * tp
        starts[idx] = cursor
        cursor += n
    return starts if cursor <= num_devices else None


def _first_fit(free: list[list[bool]], n: int, tp: int, G: int, islands: int) -> int | None:
    if n <= G:
        for isl in range(islands):
            for off in range(0, G - n + 1, tp):
                if all(free[isl][off:off + n]):
                    for k in range(off, off + n):
                        free[isl][k] = False
                    return isl * G + off
        return None
    span = math.ceil(n / G)
    for isl in range(islands - span + 1):
        devs = [(isl + k // G, k % G) for k in range(n)]
        if all(free[a][b] for a, b in devs):
            for a, b in devs:
                free[a][b] = False
            return isl * G
    return None
