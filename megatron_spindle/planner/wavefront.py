"""Wavefront scheduler (paper section 3.4, Alg. 1; summary 2.4).

Turns each MetaLevel's bi-point tuples into waves. Per wave:

1. propose: an exact subset-sum over the head tuple of every unfinished MetaOp (one tuple per MetaOp at a
   time: the operators of a MetaOp form a chain, eq. 6) maximising the devices used <= N; ties go to the
   set with the larger total remaining time of its MetaOps (critical work first);
2. extend: while devices are free, the chosen MetaOp with the largest remaining time moves to its next
   valid (faster) allocation for this wave;
3. align: the shortest chosen tuple sets T_wave; every other one runs floor(T_wave / T(n)) layers, at least
   one; the wave lasts as long as its longest slice, and where one layer made it longer than T_wave every tuple
   runs as many layers as fit the longer wave (our addition: the paper's alignment idles the other devices then,
   which on many devices, with flat host-bound curves, left clip-20 on 1024 GPUs at 2.4x C*; now 1.5x);
4. commit: the layers run are consumed; an exhausted tuple drops and the MetaOp's next tuple becomes its head.

Each wave exhausts at least its shortest tuple, so a level takes at most as many waves as it has tuples
(<= 2 per MetaOp). Levels run one after another, each starting when the previous one ends.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_spindle.planner.allocator import AllocationError, Curve, efficient_points
from megatron_spindle.planner.schedule import LevelAllocation, ScheduledSlice, ScheduledWave

if TYPE_CHECKING:
    from megatron_spindle.graph.opgraph import MetaGraph, MetaOp

# Relative slack when comparing times, so floor(T_wave / T(n)) is not cut short by rounding.
_TIME_RTOL = 1e-12


class ScheduleError(ValueError):
    """An allocation the wavefront scheduler cannot schedule (inconsistent with the level or the devices)."""


@dataclass
class _PendingTuple:
    n: int
    layers: int  # layers of this tuple not yet scheduled


@dataclass
class _MetaOpState:
    """What is left of one MetaOp: its pending tuples (head first) and the next layer to schedule."""

    id: str
    curve: Curve
    tuples: list[_PendingTuple]
    next_layer: int
    faster_ns: list[int]  # valid n <= N, each strictly faster than all smaller ones

    @property
    def head(self) -> _PendingTuple:
        return self.tuples[0]

    def remaining_time(self, head_n: int | None = None) -> float:
        """Seconds of work left, with the head tuple on ``head_n`` devices (default: its planned n)."""
        head = self.head
        n = head.n if head_n is None else head_n
        rest = sum(self.curve.time(t.n) * t.layers for t in self.tuples[1:])
        return self.curve.time(n) * head.layers + rest

    def next_faster_n(self, n: int) -> int | None:
        return next((m for m in self.faster_ns if m > n), None)


# ------------------------------------------------------------------------------------ inputs


def _as_metaop_list(metaops: Sequence[MetaOp] | Mapping[str, MetaOp]) -> list[MetaOp]:
    return list(metaops.values()) if isinstance(metaops, Mapping) else list(metaops)


def _initial_states(alloc: LevelAllocation, metaops: list[MetaOp], curves: Mapping[str, Curve],
                    num_devices: int) -> list[_MetaOpState]:
    ids = [m.id for m in metaops]
    missing, extra = set(ids) - set(alloc.tuples), set(alloc.tuples) - set(ids)
    if missing or extra:
        raise ScheduleError(f"level {alloc.level}: allocation does not match the level's MetaOps "
                            f"(missing {sorted(missing)}, unknown {sorted(extra)})")
    states = []
    for mo in metaops:
        if mo.id not in curves:
            raise ScheduleError(f"MetaOp '{mo.id}' has no scaling curve")
        curve = curves[mo.id]
        tuples = alloc.tuples[mo.id]
        if not tuples:
            raise ScheduleError(f"MetaOp '{mo.id}': allocation has no tuples")
        valid = set(curve.valid_ns)
        for n, layers in tuples:
            where = f"MetaOp '{mo.id}': tuple (n={n}, l={layers})"
            if n > num_devices:
                raise ScheduleError(f"{where} needs more devices than the {num_devices} available")
            if n not in valid:
                raise ScheduleError(f"{where}: {n} is not a valid device count for its curve {sorted(valid)}")
            if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
                raise ScheduleError(f"{where} must have a positive integer layer count")
        total = sum(layers for _, layers in tuples)
        if total != mo.num_layers:
            raise ScheduleError(f"MetaOp '{mo.id}': tuples cover {total} layers, the MetaOp has "
                                f"{mo.num_layers}")
        try:
            faster = [n for n, _ in efficient_points(curve, num_devices, name=f"MetaOp '{mo.id}'")]
        except AllocationError as err:
            raise ScheduleError(str(err)) from err
        pending = [_PendingTuple(n, layers) for n, layers in tuples]
        states.append(_MetaOpState(mo.id, curve, pending, next_layer=0, faster_ns=faster))
    return states


# ------------------------------------------------------------------------------------ the four steps


def _propose(heads: list[_MetaOpState], num_devices: int) -> list[int]:
    """Indices into ``heads`` of the subset whose head tuples use the most devices <= N.

    Exact 0/1 subset-sum DP over device counts; per count it keeps the subset with the largest total
    remaining time. Ties on both stay with the subset found first (level order), so the result is stable.
    """
    best: list[tuple[float, tuple[int, ...]] | None] = [None] * (num_devices + 1)
    best[0] = (0.0, ())
    for i, state in enumerate(heads):
        weight, value = state.head.n, state.remaining_time()
        for used in range(num_devices, weight - 1, -1):
            prev = best[used - weight]
            if prev is None:
                continue
            cand = (prev[0] + value, prev[1] + (i,))
            if best[used] is None or cand[0] > best[used][0]:
                best[used] = cand
    used = max(c for c in range(1, num_devices + 1) if best[c] is not None)
    return list(best[used][1])


def _extend(chosen: list[_MetaOpState], num_devices: int) -> list[int]:
    """Device counts for this wave: planned n, raised step by step while devices are free."""
    ns = [s.head.n for s in chosen]
    free = num_devices - sum(ns)
    while free > 0:
        by_remaining = sorted(range(len(chosen)), key=lambda k: -chosen[k].remaining_time(ns[k]))
        for k in by_remaining:
            nxt = chosen[k].next_faster_n(ns[k])
            if nxt is not None and nxt - ns[k] <= free:
                free -= nxt - ns[k]
                ns[k] = nxt
                break
        else:
            break  # no chosen MetaOp can use the free devices
    return ns


def _align(chosen: list[_MetaOpState], ns: list[int]) -> list[int]:
    """Layers each chosen tuple runs in this wave: the shortest tuple runs out, the others fit T_wave. A tuple
    whose one layer is longer than T_wave still runs one (progress), which makes the wave longer: then every
    tuple runs as many layers as fit that longer wave, instead of idling its devices for the rest of it."""
    spans = [s.curve.time(n) * s.head.layers for s, n in zip(chosen, ns)]
    t_wave = min(spans)
    layers = []
    for s, n, span in zip(chosen, ns, spans):
        if span <= t_wave * (1.0 + _TIME_RTOL):
            layers.append(s.head.layers)
        else:
            fit = math.floor(t_wave / s.curve.time(n) * (1.0 + _TIME_RTOL))
            layers.append(min(s.head.layers, max(1, fit)))
    wave = max(s.curve.time(n) * k for s, n, k in zip(chosen, ns, layers))
    return [min(s.head.layers, max(k, math.floor(wave / s.curve.time(n) * (1.0 + _TIME_RTOL))))
            for s, n, k in zip(chosen, ns, layers)]


def _make_slice(state: _MetaOpState, n: int, layers: int) -> ScheduledSlice:
    tp, dp = state.curve.config(n)
    if tp * dp != n:
        raise ScheduleError(f"MetaOp '{state.id}': curve config({n}) = (tp={tp}, dp={dp}) does not use {n} "
                            f"devices")
    start = state.next_layer
    return ScheduledSlice(metaop=state.id, n=n, tp=tp, dp=dp, layer_start=start, layer_end=start + layers,
                          time=state.curve.time(n) * layers)


def _commit(state: _MetaOpState, layers: int) -> None:
    state.head.layers -= layers
    state.next_layer += layers
    if state.head.layers == 0:
        state.tuples.pop(0)


# ------------------------------------------------------------------------------------ public API


def schedule_level(alloc: LevelAllocation, metaops: Sequence[MetaOp] | Mapping[str, MetaOp],
                   curves: Mapping[str, Curve], num_devices: int, t_start: float) -> list[ScheduledWave]:
    """Alg. 1 for one MetaLevel: waves from ``t_start`` until every tuple of ``alloc`` is scheduled.

    Slices have ``devices=None`` (placement fills them); layer ranges are relative to the MetaOp and each
    slice of a MetaOp continues where its previous one stopped.
    """
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ScheduleError(f"num_devices must be a positive integer, got {num_devices!r}")
    if not math.isfinite(t_start) or t_start < 0.0:
        raise ScheduleError(f"t_start must be a non-negative finite time, got {t_start!r}")
    states = _initial_states(alloc, _as_metaop_list(metaops), curves, num_devices)
    waves: list[ScheduledWave] = []
    t_cur = float(t_start)
    while True:
        heads = [s for s in states if s.tuples]
        if not heads:
            return waves
        chosen = [heads[i] for i in _propose(heads, num_devices)]
        ns = _extend(chosen, num_devices)
        layers = _align(chosen, ns)
        slices = [_make_slice(s, n, k) for s, n, k in zip(chosen, ns, layers)]
        wave = ScheduledWave(level=alloc.level, start=t_cur, duration=max(sl.time for sl in slices),
                             slices=slices)
        for s, k in zip(chosen, layers):
            _commit(s, k)
        waves.append(wave)
        t_cur = wave.end


def schedule_levels(allocs: Iterable[LevelAllocation], metagraph: MetaGraph, curves: Mapping[str, Curve],
                    num_devices: int) -> list[ScheduledWave]:
    """Every MetaLevel in dependency order, each starting at the end of the previous one (from t = 0)."""
    allocs = list(allocs)
    got = [a.level for a in allocs]
    if got != list(range(len(metagraph.levels))):
        raise ScheduleError(f"need one allocation per MetaLevel in order 0..{len(metagraph.levels) - 1}, "
                            f"got levels {got}")
    waves: list[ScheduledWave] = []
    t_cur = 0.0
    for alloc in allocs:
        level_ops = [metagraph.metaops[m] for m in metagraph.levels[alloc.level]]
        level_waves = schedule_level(alloc, level_ops, curves, num_devices, t_cur)
        waves += level_waves
        if level_waves:
            t_cur = level_waves[-1].end
    return waves
