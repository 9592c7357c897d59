"""Per-level search: under the level barrier the makespan is the sum of independent per-level makespans, so
(when per-device memory is not modelled) each MetaLevel is its own problem.

The slot model proves bounds well but finds good plans for large levels slowly, so each level
(``_solve_level``) goes through:

1. *constructive plans* (planner/level_plans.py): ``few_wave_plans``, plans of at most K waves that hint the
   K-slot models, and ``efficient_waves`` (wave by wave the most useful work per device-second) over a small
   portfolio of its knobs; the level starts from the best of them and its greedy waves;
2. *slot deepening*: models of 1, 2, ... slots, from 2 on with the options bracketed around each MetaOp's
   continuous optimum n* (Problem.bracketed), while they are proven (too few slots is a quick infeasibility
   proof) and half the level's time is left;
3. *growth*: full-option models of the best plan's waves + ``FINAL_EXTRA_SLOTS`` slots, each hinted by the
   previous answer, while they improve (the last one gives the level's bound);
4. the *wave-window search* (lns.py) for the rest of the level's time.

Levels share the time by what the greedy plan leaves above their C~* (``_level_weight``); a level that ends
early passes its time on, and time left at the end goes to rounds of growth models on the levels not proven
optimal (``LevelSearch.improve``). Within a level the waves are interchangeable, so they are ordered longest
first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_spindle.graph.opgraph import MetaGraph
from megatron_spindle.planner.cpsat.budget import TimeBudget
from megatron_spindle.planner.cpsat.lns import window_search
from megatron_spindle.planner.cpsat.model import SlotModel
from megatron_spindle.planner.cpsat.problem import Problem
from megatron_spindle.planner.cpsat.ranges import with_ranges
from megatron_spindle.planner.cpsat.waves import REL_EPS, concatenate, makespan
from megatron_spindle.planner.level_plans import efficient_waves, few_wave_plans
from megatron_spindle.planner.schedule import ScheduledWave

MIN_LEVEL_SECONDS = 0.2  # floor of a level's share: enough to build its model and load the hint
FINAL_EXTRA_SLOTS = 2  # a growth model: the best plan's waves plus this many slots
CONSTRUCTIVE_SHARE = 0.3  # of a level's time, at most, for the constructive plans
DEEPENING_STEP_SHARE = 0.5  # a deepening model: this share of the level's time left
BRACKET_SHARE = 0.35  # of a level's time, for the first unproven bracketed model (proofs are quick)
WINDOW_SEARCH_SHARE = 0.5  # of the level's time left after deepening, for the wave-window search
# efficient_waves knobs: which urgency and duration grid is best varies from level to level
PORTFOLIO = [(u, g) for u in (0.0, 2.0, 4.0, 8.0, 16.0) for g in (16, 24, 40)]


@dataclass
class LevelResult:
    """A level's best waves and what the solver said about them (bound in model time units)."""

    waves: list[ScheduledWave]
    status: str
    bound_units: float | None


@dataclass
class LevelSearch:
    """Per-MetaLevel sub-problems of the level-barrier objective and the best result of each so far."""

    problem: Problem
    subs: list[MetaGraph]  # one per non-empty level
    hints: list[list[ScheduledWave]]  # the greedy waves of each level, re-timed from 0
    weights: list[float]  # time shares (_level_weight)
    results: list[LevelResult] = field(default_factory=list)

    @classmethod
    def of(cls, problem: Problem, greedy: list[ScheduledWave]) -> LevelSearch:
        g = problem.metagraph
        indices = [k for k, lv in enumerate(g.levels) if lv]
        level_of = {m: i for i, k in enumerate(indices) for m in g.levels[k]}
        # each level's greedy waves re-timed from 0, so that makespans compare within the level
        hints = [concatenate([[w for w in greedy if w.slices and level_of[w.slices[0].metaop] == i]])
                 for i in range(len(indices))]
        weights = [_level_weight(hint, problem.level_c_stars.get(k)) for k, hint in zip(indices, hints)]
        subs = [MetaGraph({m: g.metaops[m] for m in g.levels[k]}, [], [list(g.levels[k])]) for k in indices]
        return cls(problem, subs, hints, weights)

    def solve(self, budget: TimeBudget) -> None:
        """Every level in turn with its share of the budget, then rounds of improvement with the rest."""
        for k, hint in enumerate(self.hints):
            share = budget.share(self.weights[k] / sum(self.weights[k:]), MIN_LEVEL_SECONDS)
            self.results.append(_solve_level(self.problem, self.subs[k], hint, share))
        self.improve(budget)

    def improve(self, budget: TimeBudget) -> None:
        """Rounds of growth models over the levels not proven optimal, each hinted by and sized from its best
        plan (a plan that improved with fewer waves gets a smaller, faster model next round), sharing the
        budget by weight, until the time is spent or a round improves no level."""
        while True:
            pending = [k for k, r in enumerate(self.results) if r.status != "OPTIMAL"]
            improved = False
            for i, k in enumerate(pending):
                if budget.left() < MIN_LEVEL_SECONDS:
                    break
                share = budget.share(self.weights[k] / sum(self.weights[j] for j in pending[i:]), MIN_LEVEL_SECONDS)
                old = self.results[k]
                again = _growth_model(self.problem, self.subs[k], old.waves, share)
                if again.bound_units is not None:
                    improved |= makespan(again.waves) < makespan(old.waves) * (1 - REL_EPS)
                    self.results[k] = again
            if not improved or not pending or budget.left() < MIN_LEVEL_SECONDS:
                return

    def waves(self) -> list[ScheduledWave]:
        return concatenate([r.waves for r in self.results])

    def status(self) -> str:
        """OPTIMAL only if every level was proven optimal; every level has a plan (at worst its greedy waves)."""
        return "OPTIMAL" if all(r.status == "OPTIMAL" for r in self.results) else "FEASIBLE"

    def bound_units(self) -> float | None:
        bounds = [r.bound_units for r in self.results]
        return None if any(b is None for b in bounds) else sum(bounds)

    def note(self) -> str:
        return f"per-level solves: {sum(r.status == 'OPTIMAL' for r in self.results)}/{len(self.results)} optimal"

    def gains(self) -> list[float]:
        """Per level: how much shorter its solver plan is than its greedy waves."""
        return [makespan(h) - makespan(r.waves) for h, r in zip(self.hints, self.results)]


def _level_weight(hint: list[ScheduledWave], c_star: float | None) -> float:
    """Time share of a level: what the greedy plan leaves above the level's relaxed optimum (at least 2% of
    its duration, so every level gets some time), or its duration when C~* is unknown."""
    duration = sum(w.duration for w in hint)
    if c_star is None:
        return max(duration, 1e-12)
    return max(duration - c_star, 0.02 * duration, 1e-12)


def _solve_level(problem: Problem, sub: MetaGraph, greedy: list[ScheduledWave], budget: TimeBudget) -> LevelResult:
    """Constructive plans, slot deepening, growth, then the window search (module docstring). Small models
    search far better than one large model in the same time (good plans need few waves: a level of 20
    encoders on 8 devices needs about 6, the greedy plan has 15), so growth starts from the deepening's plan
    even when it is still worse than the greedy one."""
    full = len(greedy) + problem.settings.extra_waves
    few = constructive_plans(problem, sub, full, budget.share(CONSTRUCTIVE_SHARE))
    best = min([greedy, *few.values()], key=makespan)
    best, _ = _deepen(problem, sub, best, range(1, 2), budget, few)
    small = None
    bracketed = problem.bracketed(list(sub.metaops), best)
    if bracketed is not None:
        best, small = _deepen(bracketed, sub, best, range(2, full), budget, few,
                              last_seconds=budget.seconds * BRACKET_SHARE)
    grown = _grow(problem, sub, best, small, budget.share(1 - WINDOW_SEARCH_SHARE))
    searched = window_search(problem, sub, grown.waves, budget)
    if makespan(searched) < makespan(grown.waves):
        grown.waves = searched
    return grown


def constructive_plans(problem: Problem, sub: MetaGraph, max_waves: int,
                       budget: TimeBudget) -> dict[int, list[ScheduledWave]]:
    """few_wave_plans() and efficient_waves() for one level, with the per-slice memory cap of the models:
    the best plan found for each wave count, with packed device ranges."""
    options = {m: problem.slice_options[m] for m in sub.metaops}
    caps = {(m, c): problem.layer_cap(mo, o) for m, mo in sub.metaops.items() for c, o in enumerate(options[m])}
    level = min((mo.level for mo in sub.metaops.values()), default=0)
    N = problem.cluster.num_devices
    plans = few_wave_plans(sub.metaops, options, N, max_waves, caps, level, budget.expired)
    for urgency, grid in PORTFOLIO:
        if budget.left() <= 0:
            break
        waves = efficient_waves(sub.metaops, options, N, caps, level, urgency, grid)
        if waves and (len(waves) not in plans or makespan(waves) < makespan(plans[len(waves)])):
            plans[len(waves)] = waves
    return {k: waves for k, waves in plans.items() if with_ranges(waves, problem.cluster)}


def _deepen(problem: Problem, sub: MetaGraph, best: list[ScheduledWave], slot_counts: range, budget: TimeBudget,
            few: dict[int, list[ScheduledWave]], last_seconds: float | None = None,
            ) -> tuple[list[ScheduledWave], list[ScheduledWave] | None]:
    """Models of each slot count in turn, hinted by the best plan so far (or, if it has more waves than the
    model has slots, by the best few-wave plan that fits), while they are proven (optimal or infeasible) and
    half of the level's budget remains; each gets ``DEEPENING_STEP_SHARE`` of the time left, or
    ``last_seconds`` if given. Returns the best plan and the answer of the last model (None if it found
    nothing)."""
    last = None
    for slots in slot_counts:
        if budget.spent_fraction() > 0.5:
            break
        fitting = [w for w in (best, *few.values()) if len(w) <= slots]
        hint = min(fitting, key=makespan) if fitting else []
        step = budget.share(DEEPENING_STEP_SHARE) if last_seconds is None else budget.part(last_seconds)
        answer = SlotModel(problem, hint, metagraph=sub, block_size=slots).solve(step)
        last = answer.waves
        if last is not None and makespan(last) < makespan(best):
            best = last
        if answer.status not in ("OPTIMAL", "INFEASIBLE"):  # too few slots is a quick proof: go on
            break
    return best, last


def _grow(problem: Problem, sub: MetaGraph, best: list[ScheduledWave], small: list[ScheduledWave] | None,
          budget: TimeBudget) -> LevelResult:
    """Growth models, each hinted by the previous answer and given half the time left (the last one all of
    it), from ``small`` if it has fewer waves than ``best``, while they improve. The last model's bound is
    the level's bound (for plans of that many waves)."""
    current = small if small is not None and len(small) < len(best) else best
    result = LevelResult(best, "UNKNOWN", None)
    while True:
        last = budget.left() < 2 * MIN_LEVEL_SECONDS
        step = _growth_model(problem, sub, current, budget if last else budget.share(0.5))
        improved = makespan(step.waves) < makespan(current) * (1 - REL_EPS)
        if makespan(step.waves) < makespan(best):
            best = step.waves
        if step.bound_units is not None:
            result = LevelResult(best, step.status, step.bound_units)
        current = step.waves
        if last or not improved or step.status == "OPTIMAL":
            result.waves = best
            return result


def _growth_model(problem: Problem, sub: MetaGraph, best: list[ScheduledWave], budget: TimeBudget) -> LevelResult:
    """The model of best's waves + FINAL_EXTRA_SLOTS slots hinted by best; its bound is the level's bound
    (for plans of that many waves)."""
    answer = SlotModel(problem, best, metagraph=sub, block_size=len(best) + FINAL_EXTRA_SLOTS).solve(budget)
    if answer.waves is None:
        return LevelResult(best, answer.status, None)
    waves = answer.waves if makespan(answer.waves) < makespan(best) else best
    return LevelResult(waves, answer.status, answer.bound_units)
