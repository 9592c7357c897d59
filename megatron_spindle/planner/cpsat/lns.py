"""Wave-window search: large-neighbourhood search over one level's waves.

A window of a few waves is re-solved exactly by the slot model, with each MetaOp's layer total inside the
window fixed, and spliced back if it is shorter. Waves of one level are interchangeable (a MetaOp's layer
ranges follow the wave order, re-numbered after every splice), so a window is any set of waves: the one that
wastes the most device time and up to ``WINDOW_WAVES - 1`` others that share the most MetaOps with it (ties
broken at random). Its model has a handful of MetaOps and slots and usually solves to optimality in
milliseconds, which the full level model, with its hundreds of variables, rarely does within the limit. A
window that cannot improve is not tried again until the plan changes.
"""

from __future__ import annotations

import random
from dataclasses import replace

from megatron_spindle.graph.opgraph import MetaGraph
from megatron_spindle.planner.cpsat.budget import TimeBudget
from megatron_spindle.planner.cpsat.model import SEED, SlotModel
from megatron_spindle.planner.cpsat.problem import Problem
from megatron_spindle.planner.cpsat.waves import makespan, renumber
from megatron_spindle.planner.schedule import ScheduledWave

WINDOW_WAVES = 2  # waves re-solved together: larger windows solve too slowly to try many
STEP_SECONDS = 0.25  # limit of one window model (most finish in milliseconds)
MAX_FAILURES = 60  # windows in a row without improvement before the search stops


def window_search(problem: Problem, sub: MetaGraph, waves: list[ScheduledWave],
                  budget: TimeBudget) -> list[ScheduledWave]:
    """The level's waves after window re-solves until the budget ends, no window is left, or
    ``MAX_FAILURES`` windows in a row did not improve."""
    rng = random.Random(SEED)
    area = {m: min(o.n * o.seconds for o in problem.slice_options[m]) for m in sub.metaops}
    best = renumber(waves)
    tried: set[frozenset[int]] = set()
    failures = 0
    while budget.left() > STEP_SECONDS / 4 and failures <= MAX_FAILURES:
        window = _pick_window(best, problem.cluster.num_devices, rng, tried, area)
        if window is None:
            break
        tried.add(frozenset(window))
        old = [best[i] for i in window]
        new = _solve_window(problem, sub, old, budget.part(STEP_SECONDS))
        if new is not None and makespan(new) < sum(w.duration for w in old) * (1 - 1e-6):
            best = renumber([w for i, w in enumerate(best) if i not in window] + new)
            tried.clear()
            failures = 0
        else:
            failures += 1
    return best


def _waste(w: ScheduledWave, N: int, area: dict[str, float]) -> float:
    """Device-seconds of the wave beyond the least its layers need (``area``: a MetaOp's least device-seconds
    per layer): idle devices and configurations that scale worse both count."""
    return N * w.duration - sum(area[s.metaop] * (s.layer_end - s.layer_start) for s in w.slices)


def _pick_window(waves: list[ScheduledWave], N: int, rng: random.Random, tried: set[frozenset[int]],
                 area: dict[str, float]) -> list[int] | None:
    """Indices of a window not tried yet: an anchor by waste (the worst untried first) plus the waves
    sharing the most MetaOps with it."""
    order = sorted(range(len(waves)), key=lambda i: -_waste(waves[i], N, area))
    ops = [{s.metaop for s in w.slices} for w in waves]
    for anchor in order:
        others = sorted((i for i in range(len(waves)) if i != anchor),
                        key=lambda i: (-len(ops[i] & ops[anchor]), rng.random()))
        for k in range(min(WINDOW_WAVES, len(waves)), 1, -1):
            window = [anchor] + others[:k - 1]
            if frozenset(window) not in tried:
                return window
        for i in others:  # pairs with every other wave
            if frozenset((anchor, i)) not in tried:
                return [anchor, i]
    return None


def _solve_window(problem: Problem, sub: MetaGraph, old: list[ScheduledWave],
                  budget: TimeBudget) -> list[ScheduledWave] | None:
    """The window's waves re-planned by the slot model over its MetaOps, each with its layer total there."""
    totals: dict[str, int] = {}
    for w in old:
        for s in w.slices:
            totals[s.metaop] = totals.get(s.metaop, 0) + s.layer_end - s.layer_start
    ops = {m: replace(sub.metaops[m], ops=sub.metaops[m].ops[:n], params=sub.metaops[m].params[:n])
           for m, n in totals.items()}
    window_graph = MetaGraph(ops, [], [list(ops)])
    hint = renumber([ScheduledWave(w.level, 0.0, w.duration, [replace(s) for s in w.slices]) for w in old])
    return SlotModel(problem, hint, metagraph=window_graph, block_size=len(old)).solve(budget).waves
