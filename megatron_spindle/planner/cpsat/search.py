"""The search: an explicit list of stages run in order on one time budget, each improving the best placed plan.

1. ``barrier``: the level-barrier plan, one problem per MetaLevel (levels.py), or one whole-graph model when
   the greedy hint mixes levels in a wave. Levels are solved without the other levels' per-device memory
   (activations are held for the whole iteration), so if their union does not place, levels go back to
   their greedy waves, least gain first, until it does.
2. ``memory`` (only where per-device memory can bind on a small cluster, Problem.exact_memory_possible): if
   the barrier plan did not place, the whole-graph model with per-device memory, hinted by the greedy plan;
   otherwise the time held back for it goes to more rounds on the levels.
3. ``overlap`` (with cross-level overlap): the whole-graph model without the barrier, hinted by the best
   barrier plan.
4. ``comm`` (several islands, few devices: Problem.has_comm): the communication objective with the makespan
   capped at the best plan's.

A stage gets the time left times its weight over the weights of the stages still to run (the communication
phase's weight is set to give it a quarter of the budget), so time a stage does not use passes to the later
ones. Every plan a stage finds is placed (``_place``): devices from
placement.place() (islands, big flows first, weight co-location, memory with backtracking) unless it fails
or moves more bytes across islands than the solver's own ranges, and it is kept only if it fits every
device's memory (accounting.fits_memory) and beats the best so far.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from megatron_spindle.planner.cpsat.accounting import fits_memory, inter_island_bytes
from megatron_spindle.planner.cpsat.budget import TimeBudget
from megatron_spindle.planner.cpsat.levels import LevelSearch
from megatron_spindle.planner.cpsat.model import SlotModel
from megatron_spindle.planner.cpsat.problem import Problem
from megatron_spindle.planner.cpsat.waves import better, concatenate, levels_mixed, makespan
from megatron_spindle.planner.schedule import ScheduledWave

# stage weights of the makespan stages: cross-level overlap 0.3 of the barrier + overlap time, since it
# starts from the barrier plan; the memory stage as much as the barrier stage it backs up
BARRIER_WEIGHT = 7.0
MEMORY_WEIGHT = 7.0
OVERLAP_WEIGHT = 3.0
# the communication phase (a second objective: one whole-graph solve from a good hint) gets this share of
# the budget, the makespan stages the rest
COMM_SHARE = 0.25


class Placer(Protocol):
    """Devices for a schedule (placement heuristics), or None if it cannot be placed."""

    def __call__(self, waves: list[ScheduledWave]) -> list[ScheduledWave] | None: ...


@dataclass(frozen=True)
class Stage:
    name: str
    weight: float
    run: Callable[[TimeBudget], None]


@dataclass
class SearchState:
    """The best placed plan so far and what the solver said about it."""

    best: list[ScheduledWave]  # placed and within memory: the greedy waves until a solver plan beats them
    status: str = "UNKNOWN"
    bound_units: float | None = None  # the solver's bound for the stage whose plans ``best`` competes with
    levels: LevelSearch | None = None
    level_note: str | None = None
    notes: list[str] = field(default_factory=list)
    unplaced: bool = False  # the barrier plan beat greedy but no placement of it (or its reverts) fits memory
    exact_memory: bool = False  # the models from the memory stage on carry per-device memory
    barrier_makespan: float | None = None
    seconds: float = 0.0
    work: float | None = None  # the solver's deterministic time, on the work clock (budget.py)


class Search:
    """The stages of one planning call over a Problem, from the greedy (placed) waves."""

    def __init__(self, problem: Problem, greedy: list[ScheduledWave], placer: Placer, overlap: bool):
        self.problem = problem
        self.greedy = greedy
        self.placer = placer
        self.overlap = overlap
        self.state = SearchState(greedy)

    def stages(self) -> list[Stage]:
        stages = [Stage("barrier", BARRIER_WEIGHT, self._barrier)]
        if self.problem.exact_memory_possible:
            stages.append(Stage("memory", MEMORY_WEIGHT, self._memory))
        if self.overlap:
            stages.append(Stage("overlap", OVERLAP_WEIGHT, self._overlap))
        if self.problem.has_comm:
            weight = COMM_SHARE / (1 - COMM_SHARE) * sum(s.weight for s in stages)
            stages.append(Stage("comm", weight, self._comm))
        return stages

    def run(self, budget: TimeBudget) -> SearchState:
        start, work = time.perf_counter(), budget.clock.now()
        stages = self.stages()
        for i, stage in enumerate(stages):
            stage.run(budget.share(stage.weight / sum(s.weight for s in stages[i:])))
        self.state.seconds = time.perf_counter() - start
        if budget.clock.deterministic:
            self.state.work = budget.clock.now() - work
        return self.state

    # ---------------------------------------------------------------- stages
    def _barrier(self, budget: TimeBudget) -> None:
        st = self.state
        if levels_mixed(self.problem.metagraph, self.greedy):  # a hint across levels has no per-level split
            answer = SlotModel(self.problem, self.greedy).solve(budget)
            waves, st.status, st.bound_units = answer.waves, answer.status, answer.bound_units
        else:
            st.levels = LevelSearch.of(self.problem, self.greedy)
            st.levels.solve(budget)
            waves, st.status, st.bound_units = st.levels.waves(), st.levels.status(), st.levels.bound_units()
            st.level_note = st.levels.note()
        if not better(waves, self.greedy):
            return
        placed = self._place(waves)
        if placed is None and st.levels is not None:
            placed = self._revert_until_placed(st.levels)
        if placed is None:
            st.unplaced = True
        else:
            st.best = placed

    def _memory(self, budget: TimeBudget) -> None:
        """The time held back for per-device memory: the whole model with it if the barrier plan did not
        place, else more rounds on the levels."""
        if self.state.unplaced:
            self._exact_memory_model(budget)
        elif self.state.levels is not None:
            self._more_level_rounds(self.state.levels, budget)

    def _exact_memory_model(self, budget: TimeBudget) -> None:
        st = self.state
        st.exact_memory = True
        answer = SlotModel(self.problem, self.greedy, exact_memory=True).solve(budget)
        st.notes.append(f"whole model with per-device memory {answer.status}")
        st.status, st.bound_units = answer.status, answer.bound_units
        if better(answer.waves, self.greedy):
            st.best = self._place(answer.waves) or st.best

    def _more_level_rounds(self, levels: LevelSearch, budget: TimeBudget) -> None:
        st = self.state
        levels.improve(budget)
        waves = levels.waves()
        placed = self._place(waves) if better(waves, st.best) else None
        if placed is not None:
            st.best, st.status, st.bound_units = placed, levels.status(), levels.bound_units()
            st.level_note = levels.note()

    def _overlap(self, budget: TimeBudget) -> None:
        st = self.state
        st.barrier_makespan = makespan(st.best)
        answer = SlotModel(self.problem, st.best, overlap=True, exact_memory=st.exact_memory).solve(budget)
        st.notes.append(f"overlap model {answer.status}")
        st.bound_units = answer.bound_units  # only the overlap model bounds overlap plans
        if answer.waves is not None:
            st.status = answer.status
        if better(answer.waves, st.best):
            st.best = self._place(answer.waves) or st.best

    def _comm(self, budget: TimeBudget) -> None:
        st = self.state
        if budget.left() <= 0:
            return
        model = SlotModel(self.problem, st.best, overlap=self.overlap, exact_memory=st.exact_memory, with_comm=True)
        answer = model.solve_comm(budget)
        if answer.waves is None:
            st.notes.append(f"communication phase {answer.status}: makespan-phase plan kept")
            return
        st.notes.append(f"communication phase {answer.status}")
        if makespan(answer.waves) <= makespan(st.best):
            st.best = self._place(answer.waves) or st.best

    # ---------------------------------------------------------------- placement
    def _place(self, waves: list[ScheduledWave], notes: list[str] | None = None) -> list[ScheduledWave] | None:
        """Devices for the solver's schedule: the placement heuristics' or the solver's own ranges, whichever
        fits memory and moves fewer bytes across islands; None if neither fits. Says which in ``notes``
        (the search's notes by default)."""
        p = self.problem
        notes = self.state.notes if notes is None else notes
        candidates = []
        placed = self.placer(waves)
        if placed is not None and fits_memory(placed, p.metagraph, p.memory_model, p.cluster):
            candidates.append(("placement heuristics", placed))
        if fits_memory(waves, p.metagraph, p.memory_model, p.cluster):
            candidates.append(("solver ranges", waves))
        if not candidates:
            notes.append("no placement of the solver schedule fits memory")
            return None
        name, best = min(candidates, key=lambda c: inter_island_bytes(c[1], p.metagraph, p.cluster, p.cost_model))
        notes.append(f"devices from {name}")
        return best

    def _revert_until_placed(self, levels: LevelSearch) -> list[ScheduledWave] | None:
        """Put levels back to their greedy waves, the least gain first, until a placement fits; None if only
        the greedy plan does."""
        results = [r.waves for r in levels.results]
        gains = levels.gains()
        for k in sorted((k for k in range(len(results)) if gains[k] > 0), key=lambda k: gains[k]):
            results[k] = levels.hints[k]
            if all(r is h for r, h in zip(results, levels.hints)):
                return None
            attempt: list[str] = []
            placed = self._place(concatenate(results), attempt)
            if placed is not None:
                kept = sum(r is not h for r, h in zip(results, levels.hints))
                self.state.notes.extend(attempt + [f"kept the solver plans of {kept}/{len(results)} levels (memory)"])
                return placed
        return None
