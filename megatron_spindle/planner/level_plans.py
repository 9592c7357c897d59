"""Constructive plans of one MetaLevel for the CP-SAT planner (planner/cpsat/levels.py): starting points
and hints.

The slot model (planner/cpsat/model.py) proves bounds well but, within seconds, finds good plans for large
levels (20 encoders on 8 devices) poorly: its first solutions come from the hint, and the greedy wavefront
plan has many short waves whose idle devices add up. Two fast constructions give it better starts:

- ``efficient_waves``: wave by wave, the wave that does the most useful work per device-second (a
  multiple-choice knapsack over devices for each candidate wave length). Levels of near-linearly scaling
  encoders come out within a few percent of C*.
- ``few_wave_plans``: plans of exactly K waves (uniform wave length, bisected), the hints of the K-slot
  models of slot deepening.

Options are anything with ``n``, ``tp``, ``dp`` and ``seconds`` (per layer), as planner.cpsat.SliceOption.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

from megatron_spindle.planner.schedule import ScheduledSlice, ScheduledWave


class SliceOption(Protocol):
    n: int
    tp: int
    dp: int
    seconds: float  # per layer


def few_wave_plans(metaops: dict[str, Any], options: dict[str, list[SliceOption]], num_devices: int,
                   max_waves: int, layer_cap: dict[tuple[str, int], int] | None = None,
                   level: int = 0, expired: Callable[[], bool] = lambda: False) -> dict[int, list[ScheduledWave]]:
    """Plans of one MetaLevel with at most K waves, for K = 1 .. max_waves (those that exist): hints for the
    K-slot models, which otherwise start from nothing when the best plan has more waves than K.

    For a wave length D, a MetaOp with option c runs at most ``cap = min(D / seconds per layer, memory
    cap)`` layers per wave, so it needs ``k = ceil(L / cap)`` waves of ``n`` devices; each MetaOp takes the
    option with the fewest device-waves ``n * k`` (then the shortest time). The MetaOps' k occurrences are
    packed into K waves of N devices (at most one per wave and MetaOp; widest first, each into the k waves
    with the most free devices) and the layers spread evenly over a MetaOp's occurrences. Bisection finds the smallest D that packs; the wave durations are then the longest slices.
    ``layer_cap[(metaop, option index)]`` is the memory bound on layers per slice (none if absent). Stops
    when ``expired()`` (the caller's budget) with the plans found so far."""
    plans = {}
    for K in range(1, max_waves + 1):
        if expired():
            break
        lo = max(min(o.seconds for o in opts) * metaops[m].num_layers / K for m, opts in options.items())
        hi = sum(max(o.seconds for o in opts) * metaops[m].num_layers for m, opts in options.items())
        if _pack_waves(metaops, options, num_devices, K, hi, layer_cap) is None:
            continue
        for _ in range(40):
            if hi - lo <= 1e-4 * hi:
                break
            mid = (lo + hi) / 2
            if _pack_waves(metaops, options, num_devices, K, mid, layer_cap) is None:
                lo = mid
            else:
                hi = mid
        plans[K] = _waves_from_packing(_pack_waves(metaops, options, num_devices, K, hi, layer_cap), level)
    return plans


def efficient_waves(metaops: dict[str, Any], options: dict[str, list[SliceOption]], num_devices: int,
                    layer_cap: dict[tuple[str, int], int] | None = None, level: int = 0,
                    urgency: float = 0.0, grid: int = 24) -> list[ScheduledWave] | None:
    """A level plan built wave by wave, each wave the most *efficient* one: for candidate durations D, a
    multiple-choice knapsack over devices (DP, one slice per MetaOp: option c and the most layers that
    fit D and its memory cap) maximises the useful work ``sum layers * a_m`` (a_m: the MetaOp's least device-
    seconds per layer), and the wave with the highest ``work / (N * its longest slice)`` is kept. With
    ``urgency`` > 0 the work of a MetaOp is weighted up by how much its remaining chain, at its fastest,
    exceeds the remaining average, so long chains are not left for last. None if the level's devices are
    too many for the DP to be cheap."""
    N = num_devices
    if N > 128 or not options:
        return None
    caps = layer_cap or {}
    area = {m: min(o.n * o.seconds for o in opts) for m, opts in options.items()}
    fastest = {m: min((o.seconds for o in opts if o.n <= N), default=math.inf) for m, opts in options.items()}
    if math.inf in fastest.values():  # a MetaOp with no configuration that fits the level's devices
        return None
    left = {m: metaops[m].num_layers for m in options}
    waves, t, done = [], 0.0, {m: 0 for m in options}
    while any(left.values()):
        active = [m for m in left if left[m]]
        avg = sum(left[m] * area[m] for m in active) / N
        weight = {m: 1.0 + urgency * max(0.0, left[m] * fastest[m] / max(avg, 1e-30) - 0.5) for m in active}
        lo = min(min(o.seconds for o in options[m]) for m in active)
        hi = max(max(avg, left[m] * fastest[m]) for m in active)
        best = None
        for i in range(grid):
            D = lo * (hi / lo) ** (i / max(grid - 1, 1)) * (1 + 1e-9)
            choice = _knapsack_wave(active, options, left, caps, D, N, area, weight)
            if not choice:
                continue
            longest = max(o.seconds * nl for _, o, nl in choice)
            score = sum(nl * area[m] for m, _, nl in choice) / (N * longest)
            if best is None or score >= best[0] * (1 - 1e-12):  # ties: the longer wave (fewer waves)
                best = (score, choice, longest)
        if best is None:
            return None
        slices = []
        for m, o, nl in best[1]:
            slices.append(ScheduledSlice(m, o.n, o.tp, o.dp, done[m], done[m] + nl, o.seconds * nl))
            done[m] += nl
            left[m] -= nl
        waves.append(ScheduledWave(level, t, best[2], slices))
        t += best[2]
    return waves


def _knapsack_wave(active, options, left, caps, D: float, N: int, area, weight):
    """[(metaop, option, layers)] maximising the weighted work of one wave of length <= D on N devices."""
    NEG = -1.0
    value = [0.0] + [NEG] * N  # value[d]: best weighted work using exactly d devices
    picks: list[list] = [[] for _ in range(N + 1)]
    for m in active:
        items = []
        for c, o in enumerate(options[m]):
            if o.n > N:
                continue
            nl = min(left[m], caps.get((m, c), left[m]), int(D / o.seconds))
            if nl >= 1:
                items.append((o.n, nl * area[m] * weight[m], o, nl))
        if not items:
            continue
        new_value, new_picks = value[:], picks[:]
        for d in range(N + 1):
            if value[d] < 0:
                continue
            for n, v, o, nl in items:
                e = d + n
                if e <= N and value[d] + v > new_value[e]:
                    new_value[e] = value[d] + v
                    new_picks[e] = picks[d] + [(m, o, nl)]
        value, picks = new_value, new_picks
    d = max(range(N + 1), key=lambda k: value[k])
    return picks[d]


def _pack_waves(metaops, options, N: int, K: int, D: float, layer_cap):
    """{wave: [(metaop, SliceOption, layers)]} packing every MetaOp's layers into K waves of length D, or None."""
    choice = {}
    for m, opts in options.items():
        L, best = metaops[m].num_layers, None
        for c, o in enumerate(opts):
            cap = min(int(D / o.seconds * (1 + 1e-9)), (layer_cap or {}).get((m, c), L), L)
            if cap < 1 or o.n > N:
                continue
            k = math.ceil(L / cap)
            if k > K:
                continue
            key = (o.n * k, o.seconds * L, c)
            if best is None or key < best[0]:
                best = (key, c, k, cap)
        if best is None:
            return None
        choice[m] = best[1:]
    free = [N] * K
    placed: dict[int, list[tuple[str, int, int]]] = {w: [] for w in range(K)}
    for m in sorted(choice, key=lambda m: (-options[m][choice[m][0]].n, -choice[m][1], m)):
        c, k, cap = choice[m]
        n = options[m][c].n
        waves = sorted((w for w in range(K) if free[w] >= n), key=lambda w: (-free[w], w))[:k]
        if len(waves) < k:
            return None
        layers = _spread(metaops[m].num_layers, k)
        for w, nl in zip(sorted(waves), layers):
            free[w] -= n
            placed[w].append((m, options[m][c], nl))
    return placed


def _spread(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _waves_from_packing(placed, level: int) -> list[ScheduledWave]:
    waves, t, done = [], 0.0, {}
    for w in sorted(placed):
        slices = []
        for m, o, nl in placed[w]:
            a = done.get(m, 0)
            slices.append(ScheduledSlice(m, o.n, o.tp, o.dp, a, a + nl, o.seconds * nl))
            done[m] = a + nl
        if slices:
            d = max(s.time for s in slices)
            waves.append(ScheduledWave(level, t, d, slices))
            t += d
    return waves
