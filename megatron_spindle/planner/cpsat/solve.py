"""``solve_cpsat``: refine the greedy (placed) waves with CP-SAT (the package docstring says how)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaGraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.planner.allocator import AllocationError, Curve, allocate_level
from megatron_spindle.planner.cpsat.accounting import MemoryModel, inter_island_bytes
from megatron_spindle.planner.cpsat.budget import TimeBudget
from megatron_spindle.planner.cpsat.problem import (
    CpSatOptions,
    Problem,
    check_memory_fits,
    curve_options,
    rounding_bound,
    time_unit,
    with_units,
)
from megatron_spindle.planner.cpsat.result import CpSatResult, strictly_better
from megatron_spindle.planner.cpsat.search import Placer, Search, SearchState
from megatron_spindle.planner.cpsat.waves import makespan
from megatron_spindle.planner.placement import FlowCostModel, PlacementError, place
from megatron_spindle.planner.schedule import LevelAllocation, ScheduledWave

# of the time limit, kept for the placement of the last plan and the result after the solves
PLACEMENT_RESERVE = 0.15


def solve_cpsat(metagraph: MetaGraph, workload: Workload, cluster: ClusterSpec, curves: Mapping[str, Curve],
                greedy_waves: list[ScheduledWave], cost_model: FlowCostModel, memory_model: MemoryModel,
                time_limit: float, workers: int = 2, deterministic: bool = False, cross_level_overlap: bool = False,
                options: CpSatOptions | None = None,
                level_allocs: Sequence[LevelAllocation] | None = None) -> CpSatResult:
    """Refine the greedy (placed) waves with CP-SAT within ``time_limit`` seconds (model building and
    placement included); a zero limit returns them unchanged. ``deterministic``: seconds of the solver's
    deterministic time (the work clock, budget.py; model building and placement not counted).

    ``level_allocs`` (the allocator's LevelAllocations) supply C* and n*; without them the allocator runs
    here with its default inverse. With ``cross_level_overlap`` the level-barrier plan is found first and
    hints the overlap model, so the gain of overlap is measured against the best barrier plan
    (``barrier_makespan`` in the summary). Raises CpSatMemoryError when a MetaOp fits no device.
    """
    settings = options or CpSatOptions()
    greedy_makespan = makespan(greedy_waves)
    greedy_comm = inter_island_bytes(greedy_waves, metagraph, cluster, cost_model)
    raw_options = {m: curve_options(m, curves[m], greedy_waves) for m in metagraph.metaops}
    check_memory_fits(metagraph, raw_options, memory_model, cluster)
    allocs = _allocations(level_allocs, metagraph, curves, cluster)
    c_star = sum(float(a.c_star) for a in allocs) if allocs else None
    base = dict(greedy_makespan=greedy_makespan, c_star=c_star, greedy_inter_island_bytes=greedy_comm,
                inter_island_bytes=greedy_comm, cross_level_overlap=cross_level_overlap)
    if time_limit <= 0 or not greedy_waves:
        return CpSatResult(greedy_waves, "NOT_RUN", greedy_makespan, None, 0.0, 0.0, True,
                           notes=["time limit 0: the greedy plan is returned unchanged"], **base)
    budget = TimeBudget.of(time_limit * (1 - PLACEMENT_RESERVE), deterministic)
    unit = time_unit(greedy_makespan, metagraph)
    slice_options = {m: with_units(o, unit) for m, o in raw_options.items()}
    rounding = rounding_bound(metagraph, slice_options, unit)
    problem = Problem(metagraph, cluster, slice_options, cost_model, memory_model, settings, workers,
                      level_c_stars={a.level: float(a.c_star) for a in allocs},
                      n_star={m: float(n) for a in allocs for m, n in a.n_star.items()})
    placer = _heuristic_placer(metagraph, workload, cluster, cost_model, memory_model)
    state = Search(problem, greedy_waves, placer, cross_level_overlap).run(budget)
    if cross_level_overlap:
        base["barrier_makespan"] = state.barrier_makespan
    # the solver bounds the rounded makespan; minus the rounding bound it bounds the real one
    bound = max(0.0, state.bound_units * unit - rounding) if state.bound_units is not None else None
    base.update(status=state.status, best_bound=bound, time_unit=unit, rounding_error_bound=rounding,
                solve_seconds=state.seconds, solve_work=state.work)
    return _result(problem, state, greedy_waves, base)


def _result(problem: Problem, state: SearchState, greedy: list[ScheduledWave], base: dict) -> CpSatResult:
    """The search's best plan if it is strictly better than greedy (re-timed, counted again), else greedy."""
    notes = [_memory_note(problem), *([state.level_note] if state.level_note else []), *state.notes]
    greedy_makespan = base["greedy_makespan"]
    if state.best is greedy:
        return CpSatResult(greedy, objective=greedy_makespan, used_hint_only=True, **base,
                           notes=notes + ["the solver found no better plan: greedy plan returned unchanged"])
    new_makespan = makespan(state.best)
    new_comm = inter_island_bytes(state.best, problem.metagraph, problem.cluster, problem.cost_model)
    if not strictly_better(new_makespan, new_comm, greedy_makespan, base["greedy_inter_island_bytes"]):
        return CpSatResult(greedy, objective=greedy_makespan, used_hint_only=True, **base,
                           notes=notes + [f"solver plan ({new_makespan:.6g} s) is not better than "
                                          "greedy: greedy plan returned unchanged"])
    base["inter_island_bytes"] = new_comm
    return CpSatResult(state.best, objective=new_makespan, used_hint_only=False, notes=notes, **base)


def _allocations(level_allocs: Sequence[LevelAllocation] | None, metagraph: MetaGraph, curves: Mapping[str, Curve],
                 cluster: ClusterSpec) -> list[LevelAllocation]:
    """The allocator's LevelAllocations (C~* and n* per MetaLevel, paper eq. 8-9): as given, else the
    allocator run here with its default inverse; [] (no C*, no bracketing) for curves it rejects."""
    if level_allocs:
        return list(level_allocs)
    try:
        return [allocate_level(k, [metagraph.metaops[m] for m in lv], curves, cluster.num_devices)
                for k, lv in enumerate(metagraph.levels) if lv]
    except AllocationError:
        return []


def _heuristic_placer(metagraph: MetaGraph, workload: Workload, cluster: ClusterSpec, cost_model: FlowCostModel,
                      memory_model: MemoryModel) -> Placer:
    def place_waves(waves: list[ScheduledWave]) -> list[ScheduledWave] | None:
        try:
            return place(waves, metagraph, workload, cluster, cost_model, memory_model)
        except PlacementError:
            return None

    return place_waves


def _memory_note(problem: Problem) -> str:
    """Whether the search has the memory stage (per-device memory in a model when the barrier plan does not
    place), or checks per-device memory only after each solve."""
    if problem.exact_memory_possible:
        return "memory constraint active"
    return "memory constraint per slice in the model, per device checked after"
