"""CP-SAT planner (issue 4): per-slice (n, tp, dp), layer split, wave order and devices chosen by OR-Tools.

Why a *wave-indexed* model rather than free start times
-------------------------------------------------------
The plan format (planner/plan.py) is a sequence of waves: within a wave the allocation is fixed, slices have
disjoint devices, and transfers happen only at wave boundaries; a wave lasts as long as its longest slice.
A continuous-time model (start times + NoOverlap2D rectangles) optimises a schedule that must afterwards be
cut into waves, and that cut either splits slices at non-layer boundaries or stretches waves, so the
solver's makespan is not the plan's makespan. Instead the model has a fixed number of wave *slots* in time
order and decides, per (MetaOp, slot), whether the MetaOp runs there, with which configuration and how many
layers. The objective ``sum_w D_w`` (D_w >= every slice time in slot w) is then exactly the iteration time of
the plan it encodes (up to the reported rounding), and the greedy plan maps one-to-one onto a solution (the
warm-start hint). A MetaOp's slices in successive slots run its layers in order, so "slices of one MetaOp
never overlap and run in order" holds by construction, and the waves need no cutting afterwards. The slots
bound the slices per MetaOp (the issue's K): the hint's wave count of its level plus ``extra_waves``.

Linearisation: for every (MetaOp m, slot w, option c) one boolean ``y`` (m runs in w with option c) and one
integer ``l`` in [0, L_m] with ``y <= l <= L_m * y``. The slice time is ``sum_c T_c * l_c`` (only the chosen
c is non-zero), so ``D_w >= sum_c T_c * l_c`` is linear; ``sum_{w,c} l = L_m`` runs every layer once. A
redundant energy cut ``N * D_w >= sum n_c * T_c * l_c`` lifts the LP bound to about C*.
Options c are the MetaOp's scaling-curve points (``curve.valid_ns`` with ``curve.config(n)``: the fastest
(tp, dp) for each n) plus any configuration the greedy plan uses that is not among them.

Devices: a slice gets a contiguous device range ``[o, o + n)`` with ``o`` a multiple of tp, so with tp
dividing the node size every TP group stays inside a node and gets the rank layout of planner/plan.py.
Ranges rather than device booleans keep the model small (one integer per slot instead of N booleans).
When nothing in the model depends on *which* devices (no communication phase, no per-device memory) the
model keeps only a device count per wave, ``sum n <= N``, and the ranges are packed afterwards
(``pack_ranges``: inside islands when possible, else left to right by decreasing tp, which always fits
when the tp degrees divide one another; otherwise the range variables stay in the model). Otherwise each
slot has an optional interval ``[o, o + n)`` and every slot a ``NoOverlap``. Ranges may cross islands, as the
greedy plan's device sets do (else its plan would not be a valid hint); the communication phase prices it.
The final devices come from ``placement.place()`` (islands, big flows first, weight co-location, memory
with backtracking) run on the solver's schedule, unless it fails or moves more bytes across islands than
the solver's own ranges.

Memory: a device of a slice holds the parameter state of its layers (``param_state_bytes(unit, tp, dp)``) and
its activations (``activation_bytes(metaop, tp, dp, l)``) for the iteration. In every model, per option,
``l <= capacity / per-layer bytes``. Per-device memory (booleans ``a[slot, d]`` for ``d`` in the range and a
linear load per device, conservative: shared weights summed, not stored once) is modelled only when it
can bind (every MetaOp's largest footprint on one device exceeds the capacity) on clusters of at most
``exact_memory_devices``; beyond that the number of variables grows with devices x slots, and the plan's
per-device memory (shared weights once, as the assembler counts) is checked after the solve instead, the
greedy plan being kept if no placement fits. A MetaOp whose single layer cannot fit a device in any
configuration raises ``CpSatMemoryError`` naming the MetaOp and the bytes it needs.

Levels and search: under the level barrier (default) the makespan is the sum of independent per-level
makespans, so when per-device memory is not modelled each MetaLevel is its own model. The slot model proves
bounds well but finds good plans for large levels slowly, so each level starts from the best of the greedy
waves and two constructions (planner/level_plans.py: ``efficient_waves``, wave by wave the most useful work
per device-second, a small portfolio of its knobs; ``few_wave_plans``, plans of at most K waves that hint the
K-slot models). Then *slot deepening*: models of 1, 2, ... slots with the options bracketed around each
MetaOp's continuous optimum n* (from the allocator) while they are proven (too few slots is a quick
infeasibility proof); *growth*: full-option models of the best plan's waves + ``final_extra_slots`` slots,
each hinted by the previous answer, while they improve (the last gives the level's bound); and a
*wave-window search* (``_lns_level``): a window of 2-3 waves re-solved exactly with each MetaOp's layer total
in the window fixed, spliced back when shorter. Levels share the time by what the greedy plan leaves above
their C~*; time left at the end goes to more rounds on the levels not proven optimal. Within a level the
waves are interchangeable, so they are ordered longest first. Levels are solved without the other levels'
per-device memory (activations are held for the whole iteration): if their union does not place, levels go
back to their greedy waves, least gain first, until it does; only if none does, the whole-graph model with
per-device memory runs (on clusters of at most ``exact_memory_devices``), hinted by the greedy plan.
With ``cross_level_overlap`` a whole-graph model follows, hinted by the barrier plan: slots are global, a
MetaOp may use the slots of its own level's block and of the ``level_window`` neighbouring blocks, and
precedence is explicit (a consumer's first slot after each producer's last slot); the summary reports the
barrier makespan and the gain. Large models skip CP-SAT's presolve, which otherwise can take the whole
limit before the hint is loaded.

Communication (second objective, lexicographic: a second solve with the makespan capped at the first
one's): each MetaOp has a home island; a slice outside it pays the MetaOp's activation bytes, an edge between
MetaOps with different homes the producer's activation bytes, and MetaOps sharing weights with different
homes the bf16 bytes of the shared weights (the soft co-location preference). It runs on clusters of several
islands up to ``comm_model_devices``; larger ones rely on the placement heuristics.

Time is integer: ``unit = 2 * rounding_tolerance * greedy_makespan / total_layers``; the rounding error of
any plan's makespan is at most ``sum_m L_m * max_c |T_c - unit * round(T_c / unit)|`` seconds, reported as
``rounding_error_bound`` (about ``rounding_tolerance * greedy_makespan``; ops shorter than half a unit are
kept at one unit so they are never free). ``best_bound`` is the solver's bound minus that error, so it
bounds the real makespan of every plan in the model.

Never worse than greedy: the greedy plan is a complete hint, every answer is re-timed in floating point,
and unless it is strictly better (shorter makespan, or equal makespan and fewer inter-island bytes) the
greedy waves come back unchanged with ``used_hint_only=True``. A zero time limit skips the solver. All
solves share one wall-clock deadline (model building included), leaving ``reserve_fraction`` for placement.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

from ortools.sat.python import cp_model

from megatron_spindle.plan.layout import graph_transfer_pairs
from megatron_spindle.plan.memory import peak_memory
from megatron_spindle.plan.routing import ROUTE_INTER, bytes_by_route, forward_messages
from megatron_spindle.planner.level_plans import efficient_waves, few_wave_plans
from megatron_spindle.planner.schedule import ScheduledSlice, ScheduledWave

_REL_EPS = 1e-9


class CpSatMemoryError(ValueError):
    """A MetaOp whose smallest possible slice does not fit one device's memory."""


@dataclass
class CpSatOptions:
    """Knobs of the model; the defaults suit the 10 s / 64-GPU target."""

    extra_waves: int = 2  # slots per level block beyond the greedy plan's wave count
    rounding_tolerance: float = 1e-4  # target relative rounding error of the makespan
    comm_time_fraction: float = 0.25  # share of the time limit for the communication phase
    level_window: int = 1  # cross-level overlap: neighbouring level blocks a MetaOp may move into
    exact_memory_devices: int = 16  # per-device memory variables only up to this many devices
    deepening_share: float = 0.5  # slot deepening: share of a level's remaining time per step
    final_extra_slots: int = 2  # a level's last model: the best plan's waves plus this many slots
    bracket_share: float = 0.35  # of a level's time, for the models with options bracketed around n*
    comm_model_devices: int = 16  # communication phase in CP-SAT up to this many devices (placement beyond)
    reserve_fraction: float = 0.15  # of the time limit, kept for extraction and placement after the solves
    light_presolve_slots: int = 150  # models with more slots skip presolve (it alone can eat the limit)
    min_level_seconds: float = 0.2  # floor of a level's time share (enough to load its hint)
    heuristic_share: float = 0.3  # of a level's time, at most, for the constructive plans (few_wave_plans)
    lns_window: int = 2  # waves re-solved together by the wave-window search
    lns_step_seconds: float = 0.25  # limit of one window model
    lns_max_failures: int = 60  # windows in a row without improvement before the search stops
    lns_share: float = 0.5  # of a level's time left after deepening, for the wave-window search
    overlap_time_fraction: float = 0.3  # cross-level overlap: share of the solve time for the overlap model
    final_slots_from_best: bool = True  # last model of a level sized from its best plan (else from greedy)
    memory_unit_bytes: int = 2**20
    comm_unit_bytes: int = 2**20
    seed: int = 0


@dataclass(frozen=True)
class SliceOption:
    n: int
    tp: int
    dp: int
    seconds: float  # per layer
    units: int  # per layer, integer time units


@dataclass
class CpSatResult:
    waves: list[ScheduledWave]
    status: str
    objective: float  # seconds: makespan of the returned waves (re-timed in floating point)
    best_bound: float | None  # seconds: lower bound on any plan of the model (None if not run), rounding included
    time_unit: float
    rounding_error_bound: float
    used_hint_only: bool
    greedy_makespan: float = 0.0
    c_star: float | None = None
    inter_island_bytes: float = 0.0
    greedy_inter_island_bytes: float = 0.0
    cross_level_overlap: bool = False
    barrier_makespan: float | None = None  # best level-barrier plan, when cross_level_overlap ran
    solve_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def gap_to_bound(self) -> float | None:
        if not self.best_bound:
            return None
        return self.objective / self.best_bound - 1.0

    def gap_to_c_star(self) -> float | None:
        if not self.c_star:
            return None
        return self.objective / self.c_star - 1.0

    def improvement(self) -> float:
        """Relative makespan reduction over the greedy plan (0 when the greedy plan is returned)."""
        return 1.0 - self.objective / self.greedy_makespan if self.greedy_makespan else 0.0

    def overlap_gain(self) -> float | None:
        """Relative makespan reduction of cross-level overlap over the best level-barrier plan."""
        if self.barrier_makespan is None or not self.barrier_makespan:
            return None
        return 1.0 - self.objective / self.barrier_makespan

    def summary(self) -> dict[str, Any]:
        """Flat JSON-able dict for plan.planner['solver'] and the plan summary line."""
        return {
            "status": self.status,
            "used_hint_only": self.used_hint_only,
            "makespan": self.objective,
            "greedy_makespan": self.greedy_makespan,
            "improvement": self.improvement(),
            "best_bound": self.best_bound,
            "gap_to_bound": self.gap_to_bound(),
            "c_star": self.c_star,
            "gap_to_c_star": self.gap_to_c_star(),
            "time_unit": self.time_unit,
            "rounding_error_bound": self.rounding_error_bound,
            "inter_island_bytes": self.inter_island_bytes,
            "greedy_inter_island_bytes": self.greedy_inter_island_bytes,
            "cross_level_overlap": self.cross_level_overlap,
            "barrier_makespan": self.barrier_makespan,
            "overlap_gain": self.overlap_gain(),
            "solve_seconds": self.solve_seconds,
            "notes": "; ".join(dict.fromkeys(self.notes)),
        }


# ------------------------------------------------------------------------------------------ entry point


def solve_cpsat(metagraph, workload, cluster, curves, greedy_waves: list[ScheduledWave], cost_model, memory_model,
                time_limit: float, workers: int = 2, cross_level_overlap: bool = False,
                options: CpSatOptions | None = None, level_allocs=None) -> CpSatResult:
    """Refine the greedy (placed) waves with CP-SAT; see the module docstring for the model.

    ``level_allocs`` (the allocator's LevelAllocations) supply C*; without them C* is recomputed with the
    allocator's default inverse. With ``cross_level_overlap`` the level-barrier model is solved first (70% of
    the time) and its answer is the hint of the overlap model, so the gain of overlap is measured against the
    best barrier plan (``barrier_makespan`` in the summary).
    """
    opts = options or CpSatOptions()
    greedy_makespan = makespan(greedy_waves)
    greedy_comm = inter_island_bytes(greedy_waves, metagraph, cluster, cost_model)
    slice_options = {m: _options_for(m, curves[m], greedy_waves) for m in metagraph.metaops}
    if memory_model is not None:
        check_memory_fits(metagraph, slice_options, memory_model, cluster)
    allocs = _allocations(level_allocs, metagraph, curves, cluster)
    level_c_stars = {a.level: float(a.c_star) for a in allocs}
    n_star = {m: float(n) for a in allocs for m, n in (getattr(a, "n_star", None) or {}).items()}
    c_star = sum(level_c_stars.values()) if level_c_stars else None
    base = dict(greedy_makespan=greedy_makespan, c_star=c_star,
                greedy_inter_island_bytes=greedy_comm, inter_island_bytes=greedy_comm,
                cross_level_overlap=cross_level_overlap)
    if time_limit <= 0 or not greedy_waves:
        return CpSatResult(greedy_waves, "NOT_RUN", greedy_makespan, None, 0.0, 0.0, True,
                           notes=["time limit 0: the greedy plan is returned unchanged"], **base)
    unit = _time_unit(greedy_makespan, metagraph, opts.rounding_tolerance)
    slice_options = {m: _with_units(o, unit) for m, o in slice_options.items()}
    rounding = _rounding_bound(metagraph, slice_options, unit)
    deadline = time.perf_counter() + time_limit * (1 - opts.reserve_fraction)
    ctx = _Context(metagraph, cluster, slice_options, cost_model, memory_model, opts, workers, workload, deadline,
                   level_c_stars, n_star)
    stage = _run_stages(ctx, greedy_waves, cross_level_overlap)
    if cross_level_overlap:
        base["barrier_makespan"] = stage.barrier_makespan
    # the solver bounds the rounded makespan; minus the rounding bound it bounds the real one
    bound_s = max(0.0, stage.bound_units * unit - rounding) if stage.bound_units is not None else None
    common = dict(status=stage.status, best_bound=bound_s, time_unit=unit, rounding_error_bound=rounding,
                  solve_seconds=stage.seconds)
    if stage.waves is None:
        return CpSatResult(greedy_waves, objective=greedy_makespan, used_hint_only=True, **common, **base,
                           notes=stage.notes + ["the solver found no better plan: greedy plan returned unchanged"])
    new_makespan = makespan(stage.waves)
    new_comm = inter_island_bytes(stage.waves, metagraph, cluster, cost_model)
    if not _strictly_better(new_makespan, new_comm, greedy_makespan, greedy_comm):
        return CpSatResult(greedy_waves, objective=greedy_makespan, used_hint_only=True, **common, **base,
                           notes=stage.notes + [f"solver plan ({new_makespan:.6g} s) is not better than "
                                                "greedy: greedy plan returned unchanged"])
    base["inter_island_bytes"] = new_comm
    return CpSatResult(stage.waves, objective=new_makespan, used_hint_only=False, notes=stage.notes, **common,
                       **base)


@dataclass
class _Context:
    """What every model of one solve_cpsat call shares."""

    metagraph: Any
    cluster: Any
    slice_options: dict[str, list[SliceOption]]
    cost_model: Any
    memory_model: Any
    opts: CpSatOptions
    workers: int
    workload: Any = None
    deadline: float = math.inf  # time.perf_counter() by which every solve must be over (model building counts)
    level_c_stars: dict[int, float] = field(default_factory=dict)  # MetaLevel index -> C~*
    n_star: dict[str, float] = field(default_factory=dict)  # MetaOp -> continuous optimum allocation

    def bracketed(self, metaops: list[str], plan: list[ScheduledWave]) -> _Context | None:
        """The same context with each MetaOp's options cut to the two device counts around its n* and the
        configurations ``plan`` uses; None without n*. Far fewer options: such models solve in a fraction
        of the time and seed the full ones."""
        if not all(m in self.n_star for m in metaops):
            return None
        used = {(s.metaop, s.n, s.tp, s.dp) for w in plan for s in w.slices}
        options = dict(self.slice_options)
        for m in metaops:
            ns = sorted({o.n for o in options[m]})
            keep = set([n for n in ns if n <= self.n_star[m]][-1:] + [n for n in ns if n > self.n_star[m]][:1])
            options[m] = [o for o in options[m] if o.n in keep or (m, o.n, o.tp, o.dp) in used]
        return replace(self, slice_options=options)

    def left(self) -> float:
        return max(0.0, self.deadline - time.perf_counter())

    def few_wave_plans(self, sub, max_waves: int, deadline: float = math.inf) -> dict[int, list[ScheduledWave]]:
        """few_wave_plans() and efficient_waves() for one level's sub-graph, with the per-slice memory bound
        of the models: the best plan found for each wave count."""
        caps = {}
        if self.memory_model is not None:
            for m, mo in sub.metaops.items():
                for c, o in enumerate(self.slice_options[m]):
                    cap = _layer_cap(mo, o, self.memory_model, self.cluster)
                    if cap is not None:
                        caps[(m, c)] = cap
        level = min((mo.level for mo in sub.metaops.values()), default=0)
        options = {m: self.slice_options[m] for m in sub.metaops}
        plans = few_wave_plans(sub.metaops, options, self.cluster.num_devices, max_waves, caps, level, deadline)
        # a small portfolio: which urgency and duration grid is best varies from level to level
        for urgency, grid in [(u, g) for u in (0.0, 2.0, 4.0, 8.0, 16.0) for g in (16, 24, 40)]:
            if time.perf_counter() > deadline:
                break
            waves = efficient_waves(sub.metaops, options, self.cluster.num_devices, caps, level, urgency, grid)
            if waves and (len(waves) not in plans or makespan(waves) < makespan(plans[len(waves)])):
                plans[len(waves)] = waves
        return {k: waves for k, waves in plans.items() if _with_ranges(waves, self.cluster)}

    def builder(self, hint: list[ScheduledWave], overlap: bool, metagraph=None, exact_memory: bool = False,
                with_comm: bool = False, block_size: int | None = None) -> _ModelBuilder:
        b = _ModelBuilder(metagraph or self.metagraph, self.cluster, self.slice_options, hint, self.cost_model,
                          self.memory_model, overlap, self.opts, with_comm, exact_memory, block_size)
        b.build()
        b.add_greedy_hint()
        return b

    @property
    def exact_memory(self) -> bool:
        """Per-device memory in the model: only when it can bind and the cluster is small (the variables
        grow with devices x slots); otherwise per-slice fit in the model and a check after it."""
        return (self.cluster.num_devices <= self.opts.exact_memory_devices
                and _memory_can_bind(self.metagraph, self.slice_options, self.memory_model, self.cluster))

    @property
    def has_comm(self) -> bool:
        """Communication phase in CP-SAT: several islands, and few enough devices for the range model to
        solve in time; larger clusters get their devices from placement.place() (see _finish_placement)."""
        return (self.cluster.num_nodes > 1 and self.cost_model is not None
                and self.cluster.num_devices <= self.opts.comm_model_devices)


@dataclass
class _Stage:
    """The best waves so far and what the solver said about them."""

    waves: list[ScheduledWave] | None
    status: str
    bound_units: float | None
    seconds: float
    notes: list[str] = field(default_factory=list)
    barrier_makespan: float | None = None
    levels: _Levels | None = None  # per-level solves, kept so that spare time can go on improving them


@dataclass
class _Levels:
    """Per-MetaLevel sub-problems of the level-barrier objective and the best result of each so far."""

    subs: list[Any]  # one MetaGraph per level
    hints: list[list[ScheduledWave]]  # the greedy waves of each level, re-timed from 0
    weights: list[float]  # time shares (_level_weight)
    results: list[_Stage] = field(default_factory=list)

    def stage(self, seconds: float) -> _Stage:
        bound = (None if any(r.bound_units is None for r in self.results)
                 else sum(r.bound_units for r in self.results))
        # every level has a plan (at worst its greedy waves); OPTIMAL only if every level was proven optimal
        optimal = sum(r.status == "OPTIMAL" for r in self.results)
        return _Stage(_concatenate([r.waves for r in self.results]),
                      "OPTIMAL" if optimal == len(self.results) else "FEASIBLE", bound, seconds,
                      [f"per-level solves: {optimal}/{len(self.results)} optimal"], levels=self)


def _run_stages(ctx: _Context, greedy: list[ScheduledWave], overlap: bool) -> _Stage:
    """Barrier plan per level; if no placement of it fits memory, the whole-graph model with per-device
    memory (small clusters) from the greedy hint; then optionally the cross-level overlap model and the
    communication phase, each hinted by the best plan so far. Returns placed waves, or None for greedy."""
    start = time.perf_counter()
    comm_share = ctx.opts.comm_time_fraction if ctx.has_comm else 0.0
    exact_possible = ctx.exact_memory
    notes = [_memory_note(ctx, exact_possible)]
    split = 0.5 if exact_possible else (1 - ctx.opts.overlap_time_fraction if overlap else 1.0)
    if _levels_mixed(ctx.metagraph, greedy):  # a hint across levels has no per-level decomposition
        stage = _solve_whole(ctx, greedy, False, ctx.left() * (1 - comm_share) * split)
    else:
        stage = _solve_per_level(ctx, greedy, ctx.left() * (1 - comm_share) * split)
    stage.notes = notes + stage.notes
    placed = [_finish_placement(ctx, stage.waves, stage.notes)] if _better(stage.waves, greedy) else []
    if exact_possible and placed != [None] and stage.levels is not None:
        # the per-level plan places within memory: the time held back for the whole-graph model goes to it
        more = _improve_levels(ctx, stage.levels, ctx.left() * (1 - comm_share) * split)
        if _better(more.waves, placed[0] if placed else greedy):
            again = _finish_placement(ctx, more.waves, stage.notes)
            if again is not None:
                placed, stage.status, stage.bound_units = [again], more.status, more.bound_units
                stage.notes[1:2] = more.notes  # the per-level note of the first pass is stale now
    if placed == [None] and stage.levels is not None:
        placed = [_revert_until_placed(ctx, stage.levels, stage.notes)]
    exact = exact_possible and placed == [None]
    if exact:
        whole = _solve_whole(ctx, greedy, False, ctx.left() * (1 - comm_share) * (0.5 if overlap else 1.0),
                             exact_memory=True)
        stage.notes.append(f"whole model with per-device memory {whole.status}")
        stage.status, stage.bound_units = whole.status, whole.bound_units
        placed = [_finish_placement(ctx, whole.waves, stage.notes)] if _better(whole.waves, greedy) else []
    best = placed[0] if placed and placed[0] is not None else greedy
    stage.barrier_makespan = makespan(best)
    if overlap:
        ov = _solve_whole(ctx, best, True, ctx.left() * (1 - comm_share), exact_memory=exact)
        stage.notes += [f"overlap model {ov.status}"]
        stage.bound_units = ov.bound_units  # only the overlap model bounds overlap plans
        if ov.waves is not None:
            stage.status = ov.status
        best = _prefer(ctx, ov.waves, best, stage.notes)
    if ctx.has_comm and ctx.left() > 0:
        builder = ctx.builder(best, overlap, exact_memory=exact, with_comm=True)
        waves, _, note = builder.solve_comm(ctx.left(), ctx.workers)
        stage.notes.append(note)
        best = _prefer(ctx, waves, best, stage.notes, allow_equal=True)
    stage.waves = None if best is greedy else best
    stage.seconds = time.perf_counter() - start
    return stage


def _revert_until_placed(ctx: _Context, levels: _Levels, notes: list[str]) -> list[ScheduledWave] | None:
    """Per-level plans are solved without the per-device memory of the other levels (activations are held
    for the whole iteration), so their union may not place. Put levels back to their greedy waves, the
    least gain first, until a placement fits; None if only the greedy plan does."""
    results = [r.waves for r in levels.results]
    gain = [makespan(h) - makespan(r) for h, r in zip(levels.hints, results)]
    for k in sorted((k for k in range(len(results)) if gain[k] > 0), key=lambda k: gain[k]):
        results[k] = levels.hints[k]
        if all(r is h for r, h in zip(results, levels.hints)):
            return None
        attempt: list[str] = []
        placed = _finish_placement(ctx, _concatenate(results), attempt)
        if placed is not None:
            kept = sum(r is not h for r, h in zip(results, levels.hints))
            notes.extend(attempt + [f"kept the solver plans of {kept}/{len(results)} levels (memory)"])
            return placed
    return None


def _levels_mixed(metagraph, waves: list[ScheduledWave]) -> bool:
    return any(len({metagraph.metaops[s.metaop].level for s in w.slices}) > 1 for w in waves)


def _better(waves: list[ScheduledWave] | None, than: list[ScheduledWave]) -> bool:
    return waves is not None and makespan(waves) < makespan(than)


def _prefer(ctx: _Context, waves: list[ScheduledWave] | None, best: list[ScheduledWave], notes: list[str],
            allow_equal: bool = False) -> list[ScheduledWave]:
    """The new waves, placed, if they beat ``best`` (or tie, for the communication phase) and fit memory."""
    if waves is None or makespan(waves) > makespan(best) or (not allow_equal and makespan(waves) == makespan(best)):
        return best
    placed = _finish_placement(ctx, waves, notes)
    return placed if placed is not None else best


def _finish_placement(ctx: _Context, waves: list[ScheduledWave], notes: list[str]) -> list[ScheduledWave] | None:
    """Devices for the solver's schedule: placement.place() (islands, big flows first, weight co-location,
    memory with backtracking) unless it fails or moves more bytes across islands than the solver's own
    ranges; the solver's ranges otherwise. Either must fit every device's memory (shared weights counted
    once, as the assembler does); if neither does, None (the caller keeps the greedy plan)."""
    candidates = []
    replaced = _replace(ctx, waves)
    if replaced is not None and _fits_memory(ctx, replaced):
        candidates.append(("placement heuristics", replaced))
    if _fits_memory(ctx, waves):
        candidates.append(("solver ranges", waves))
    if not candidates:
        notes.append("no placement of the solver schedule fits memory")
        return None
    name, best = min(candidates, key=lambda c: inter_island_bytes(c[1], ctx.metagraph, ctx.cluster, ctx.cost_model))
    notes.append(f"devices from {name}")
    return best


def _replace(ctx: _Context, waves: list[ScheduledWave]) -> list[ScheduledWave] | None:
    if ctx.workload is None or ctx.cost_model is None or ctx.memory_model is None:
        return None
    try:
        from megatron_spindle.planner.placement import PlacementError, place
    except ImportError:
        return None
    try:
        return place(waves, ctx.metagraph, ctx.workload, ctx.cluster, ctx.cost_model, ctx.memory_model)
    except (PlacementError, ValueError):
        return None


def _fits_memory(ctx: _Context, waves: list[ScheduledWave]) -> bool:
    if ctx.memory_model is None:
        return True
    cap = ctx.cluster.gpu.memory_bytes
    return all(b <= cap for b in device_memory(waves, ctx.metagraph, ctx.memory_model, ctx.cluster))


def device_memory(waves: list[ScheduledWave], metagraph, memory_model, cluster) -> list[float]:
    """Per-device bytes of placed waves run as one segment: plan/memory.py's accounting (each parameter unit's
    state once per device, at its largest share, plus every slice's activations), as the assembler does."""
    return peak_memory([w.slices for w in waves], metagraph.metaops, memory_model, cluster.num_devices)


def _memory_note(ctx: _Context, exact: bool) -> str:
    if ctx.memory_model is None:
        return "no memory model"
    return "memory constraint " + ("active" if exact else "per slice in the model, per device checked after")


def _solve_whole(ctx: _Context, hint: list[ScheduledWave], overlap: bool, limit: float,
                 exact_memory: bool = False) -> _Stage:
    start = time.perf_counter()
    builder = ctx.builder(hint, overlap, exact_memory=exact_memory)
    status, solver, _ = builder.solve_makespan(min(limit, ctx.left()), ctx.workers)
    if solver is None:
        return _Stage(None, status, None, time.perf_counter() - start)
    return _Stage(builder.extract(solver), status, solver.BestObjectiveBound(), time.perf_counter() - start)


def _solve_per_level(ctx: _Context, greedy: list[ScheduledWave], limit: float) -> _Stage:
    """One model per MetaLevel (exact for the barrier objective when memory cannot bind). The time is shared
    by _level_weight; levels solved early pass their time on, and what is left at the end goes to
    _improve_levels on the levels not proven optimal."""
    start = time.perf_counter()
    indices = [k for k, lv in enumerate(ctx.metagraph.levels) if lv]
    levels = [ctx.metagraph.levels[k] for k in indices]
    level_of = {m: k for k, lv in enumerate(levels) for m in lv}
    # each level's greedy waves re-timed from 0, so that makespans compare within the level
    hints = [_concatenate([[w for w in greedy if w.slices and level_of[w.slices[0].metaop] == k]])
             for k in range(len(levels))]
    weights = [_level_weight(hint, ctx.level_c_stars.get(k)) for k, hint in zip(indices, hints)]
    subs = [type(ctx.metagraph)({m: ctx.metagraph.metaops[m] for m in lv}, [], [list(lv)]) for lv in levels]
    state = _Levels(subs, hints, weights)
    for k, hint in enumerate(hints):
        share = _share(limit - (time.perf_counter() - start), weights[k:], ctx.opts.min_level_seconds)
        state.results.append(_solve_level(ctx, subs[k], hint, share))
    return _improve_levels(ctx, state, limit - (time.perf_counter() - start))


def _improve_levels(ctx: _Context, state: _Levels, limit: float) -> _Stage:
    """Rounds of _final_model over the levels not proven optimal, each hinted by its best plan and sized from
    it (its waves + final_extra_slots: a plan that improves on its predecessor with fewer waves gets a
    smaller, faster model next round), sharing ``limit`` by weight, until the time is spent or a round
    improves no level."""
    start = time.perf_counter()
    while True:
        pending = [k for k, r in enumerate(state.results) if r.status != "OPTIMAL"]
        improved = False
        for i, k in enumerate(pending):
            left = limit - (time.perf_counter() - start)
            if left < ctx.opts.min_level_seconds:
                break
            share = _share(left, [state.weights[j] for j in pending[i:]], ctx.opts.min_level_seconds)
            old = state.results[k]
            again = _final_model(ctx, state.subs[k], old.waves, len(state.hints[k]), time.perf_counter() + share)
            if again.bound_units is not None:
                improved |= makespan(again.waves) < makespan(old.waves) * (1 - _REL_EPS)
                state.results[k] = again
        if not improved or not pending or limit - (time.perf_counter() - start) < ctx.opts.min_level_seconds:
            return state.stage(time.perf_counter() - start)


def _share(left: float, weights: list[float], floor: float) -> float:
    """The first level's share of ``left`` seconds by weight, at least ``floor`` (if there is that much)."""
    return max(0.0, left * weights[0] / sum(weights), min(left, floor))


def _level_weight(hint: list[ScheduledWave], c_star: float | None) -> float:
    """Time share of a level: what the greedy plan leaves above the level's relaxed optimum (at least 2% of
    its duration, so every level gets some time), or its duration when C~* is unknown."""
    duration = sum(w.duration for w in hint)
    if c_star is None:
        return max(duration, 1e-12)
    return max(duration - c_star, 0.02 * duration, 1e-12)


def _solve_level(ctx: _Context, sub, greedy: list[ScheduledWave], limit: float) -> _Stage:
    """Slot deepening, then growth. The 1-slot model; then, with options bracketed around n*
    (ctx.bracketed), models of 2, 3, ... slots while they are proven (too few slots is a quick infeasibility
    proof); the first unproven slot count K gets ``bracket_share`` of the level's time. Then growth from the
    better start of that K-wave plan and the best plan so far: full-option models of the start's waves +
    ``final_extra_slots`` slots, each hinted by the previous answer, while they improve. Small models search
    far better than one large model in the same time (good plans need few waves: a level of 20 encoders on 8
    devices needs about 6, the greedy plan has 15), so growth starts from the K-wave plan even when it is
    still worse than the greedy one."""
    deadline = min(time.perf_counter() + limit, ctx.deadline)
    full = len(greedy) + ctx.opts.extra_waves
    few = ctx.few_wave_plans(sub, full, time.perf_counter() + limit * ctx.opts.heuristic_share)
    best = min([greedy, *few.values()], key=makespan)
    best, _ = _deepen(ctx, sub, best, range(1, 2), deadline, limit, few)
    small = None
    bracketed = ctx.bracketed(list(sub.metaops), best)
    if bracketed is not None:
        best, small = _deepen(bracketed, sub, best, range(2, full), deadline, limit, few,
                              last_limit=limit * ctx.opts.bracket_share)
    grown = _grow(ctx, sub, best, small, time.perf_counter() + (deadline - time.perf_counter()) * (1 - ctx.opts.lns_share))
    searched = _lns_level(ctx, sub, grown.waves, deadline)
    if makespan(searched) < makespan(grown.waves):
        grown.waves = searched
    return grown


def _deepen(ctx: _Context, sub, best: list[ScheduledWave], slot_counts: range, deadline: float, limit: float,
            few: dict[int, list[ScheduledWave]], last_limit: float | None = None,
            ) -> tuple[list[ScheduledWave], list[ScheduledWave] | None]:
    """Models of each slot count in turn, hinted by the best plan so far (or, if it has more waves than the
    model has slots, by the best few-wave plan that fits), while they are proven (optimal or infeasible) and
    half of ``limit`` remains; each gets ``deepening_share`` of the time left, or ``last_limit`` if given
    (proofs are quick, so only the first unproven model uses much of it). Returns the best plan and the
    answer of the last model (None if it found nothing)."""
    last = None
    for slots in slot_counts:
        left = min(deadline, ctx.deadline) - time.perf_counter()
        if left < limit * 0.5:
            break
        fitting = [w for w in (best, *few.values()) if len(w) <= slots]
        hint = min(fitting, key=makespan) if fitting else []
        builder = ctx.builder(hint, False, metagraph=sub, block_size=slots)
        budget = left * ctx.opts.deepening_share if last_limit is None else min(left, last_limit)
        status, solver, _ = builder.solve_makespan(budget, ctx.workers)
        last = builder.extract(solver) if solver is not None else None
        if last is not None and makespan(last) < makespan(best):
            best = last
        if status not in ("OPTIMAL", "INFEASIBLE"):  # too few slots is a quick proof: go on
            break
    return best, last


def _grow(ctx: _Context, sub, best: list[ScheduledWave], small: list[ScheduledWave] | None,
          deadline: float) -> _Stage:
    """Models of (start's waves + final_extra_slots) slots, each hinted by the previous answer and given
    half the time left (the last one all of it), from ``small`` if it has fewer waves than ``best``, while
    they improve. The last model's bound is the level's bound (for plans of that many waves)."""
    start = time.perf_counter()
    current = small if small is not None and len(small) < len(best) else best
    stage = _Stage(best, "UNKNOWN", None, 0.0)
    while True:
        left = min(deadline, ctx.deadline) - time.perf_counter()
        last = left < 2 * ctx.opts.min_level_seconds
        step = _final_model(ctx, sub, current, 0, time.perf_counter() + (left if last else left / 2))
        improved = makespan(step.waves) < makespan(current) * (1 - _REL_EPS)
        if makespan(step.waves) < makespan(best):
            best = step.waves
        if step.bound_units is not None:
            stage = _Stage(best, step.status, step.bound_units, 0.0)
        current = step.waves
        if last or not improved or step.status == "OPTIMAL":
            stage.waves, stage.seconds = best, time.perf_counter() - start
            return stage


def _final_model(ctx: _Context, sub, best: list[ScheduledWave], greedy_waves: int, deadline: float) -> _Stage:
    """The level's last model, hinted by its best plan: best's waves + final_extra_slots slots (or the
    greedy's count + extra_waves); its bound is the level's bound (for plans of that many waves)."""
    start = time.perf_counter()
    extra = ctx.opts.extra_waves
    if ctx.opts.final_slots_from_best:
        slots = len(best) + ctx.opts.final_extra_slots
    else:
        slots = max(greedy_waves + extra, len(best))
    builder = ctx.builder(best, False, metagraph=sub, block_size=slots)
    status, solver, _ = builder.solve_makespan(max(0.0, min(deadline, ctx.deadline) - time.perf_counter()),
                                               ctx.workers)
    if solver is None:
        return _Stage(best, status, None, time.perf_counter() - start)
    candidate = builder.extract(solver)
    return _Stage(candidate if makespan(candidate) < makespan(best) else best, status,
                  solver.BestObjectiveBound(), time.perf_counter() - start)


def _concatenate(parts: list[list[ScheduledWave]]) -> list[ScheduledWave]:
    """Waves of consecutive levels, re-timed back to back (each part may start at any time)."""
    out, t = [], 0.0
    for waves in parts:
        for w in sorted(waves, key=lambda w: w.start):
            out.append(ScheduledWave(w.level, t, w.duration, w.slices))
            t += w.duration
    return out


def _allocations(level_allocs, metagraph, curves, cluster) -> list:
    """The allocator's LevelAllocations (C~* and n* per MetaLevel, paper eq. 8-9): as given, else the
    allocator run here with its default inverse; [] if it cannot run."""
    if level_allocs:
        return list(level_allocs)
    try:
        from megatron_spindle.planner.allocator import allocate_level
    except ImportError:
        return []
    try:
        return [allocate_level(k, [metagraph.metaops[m] for m in lv], curves, cluster.num_devices)
                for k, lv in enumerate(metagraph.levels) if lv]
    except (ValueError, KeyError, AttributeError, TypeError):
        return []


# ------------------------------------------------------------------------------------------ helpers


def makespan(waves: list[ScheduledWave]) -> float:
    return max((w.end for w in waves), default=0.0)


def _strictly_better(ms: float, comm: float, ms_ref: float, comm_ref: float) -> bool:
    tol = _REL_EPS * max(1.0, ms_ref)
    if ms < ms_ref - tol:
        return True
    return ms <= ms_ref + tol and comm < comm_ref * (1 - 1e-9) - 1e-6


def _options_for(mid: str, curve, greedy_waves: list[ScheduledWave]) -> list[SliceOption]:
    """Curve points (fastest config per n) plus the greedy plan's own configs, so the hint is in the model."""
    opts: dict[tuple[int, int, int], SliceOption] = {}
    for n in curve.valid_ns:
        tp, dp = curve.config(n)
        opts[(n, tp, dp)] = SliceOption(n, tp, dp, float(curve.time(n)), 0)
    for w in greedy_waves:
        for s in w.slices:
            key = (s.n, s.tp, s.dp)
            if s.metaop == mid and key not in opts:
                layers = s.layer_end - s.layer_start
                opts[key] = SliceOption(s.n, s.tp, s.dp, s.time / layers, 0)
    return sorted(opts.values(), key=lambda o: (o.n, o.tp))


def _time_unit(greedy_makespan: float, metagraph, tolerance: float) -> float:
    total_layers = sum(m.num_layers for m in metagraph.metaops.values())
    return 2.0 * tolerance * max(greedy_makespan, 1e-12) / max(total_layers, 1)


def _with_units(options: list[SliceOption], unit: float) -> list[SliceOption]:
    return [SliceOption(o.n, o.tp, o.dp, o.seconds, max(1, round(o.seconds / unit))) for o in options]


def _rounding_bound(metagraph, slice_options: dict[str, list[SliceOption]], unit: float) -> float:
    """|true makespan - unit * model makespan| <= sum over waves of the worst slice error <= this."""
    return sum(m.num_layers * max(abs(o.seconds - o.units * unit) for o in slice_options[mid])
               for mid, m in metagraph.metaops.items())


def _layer_param_bytes(metaop, tp: int, dp: int, memory_model) -> float:
    """Parameter state of one layer of the MetaOp on one device (layers of a MetaOp are identical; dp
    matters with the distributed optimizer)."""
    if not metaop.params:
        return 0.0
    return float(sum(memory_model.param_state_bytes(p, tp, dp) for p in metaop.params[0]))


def _layer_bytes(metaop, o: SliceOption, memory_model) -> float:
    """Per-device bytes one layer of the MetaOp holds for the iteration under option o."""
    return (_layer_param_bytes(metaop, o.tp, o.dp, memory_model)
            + float(memory_model.activation_bytes(metaop, o.tp, o.dp, 1)))


def _layer_cap(metaop, o: SliceOption, memory_model, cluster) -> int | None:
    """Most layers of the MetaOp one slice with option o can hold on a device (None: no per-layer bytes)."""
    per_layer = _layer_bytes(metaop, o, memory_model)
    return int(cluster.gpu.memory_bytes // per_layer) if per_layer > 0 else None


def check_memory_fits(metagraph, slice_options: dict[str, list[SliceOption]], memory_model, cluster) -> None:
    """Raise CpSatMemoryError if some MetaOp cannot place even one layer on a device in any configuration."""
    cap = cluster.gpu.memory_bytes
    for mid, m in metagraph.metaops.items():
        need = min(_layer_bytes(m, o, memory_model) for o in slice_options[mid])
        if need > cap:
            raise CpSatMemoryError(
                f"MetaOp '{mid}' does not fit: one layer needs {need / 2**30:.2f} GiB per device in its most "
                f"sharded configuration, but a {cluster.gpu.name} device has {cap / 2**30:.2f} GiB")


def inter_island_bytes(waves: list[ScheduledWave], metagraph, cluster, cost_model) -> float:
    """Activation bytes crossing islands, forward: plan/routing.py's routes of the transfers plan/layout.py
    derives (slices without devices yet move nothing)."""
    if cost_model is None or cluster.num_nodes <= 1:
        return 0.0
    slices = [w.slices for w in waves]
    total = 0.0
    for (pw, ps), (cw, cs) in graph_transfer_pairs(slices, metagraph):
        src, dst = slices[pw][ps], slices[cw][cs]
        if src.devices is None or dst.devices is None:
            continue
        m = metagraph.metaops[src.metaop]
        messages = forward_messages(src, dst, m.batch, cluster.gpus_per_node)
        total += bytes_by_route(messages, float(cost_model.activation_bytes(m)) / m.batch)[ROUTE_INTER]
    return total


# ------------------------------------------------------------------------------------------ placement of hints


def pack_ranges(sizes: list[tuple[int, int]], cluster) -> list[int] | None:
    """Contiguous, tp-aligned start offsets for slices of (n, tp) that fit side by side, or None.

    First island-friendly (largest first: a slice that fits a node goes into one island, a larger one starts
    at an island boundary), else plain left-to-right by decreasing tp, which always succeeds when the total
    fits and the tp degrees divide one another (each start is then a multiple of the next tp).
    """
    return _pack_islands(sizes, cluster) or _pack_line(sizes, cluster.num_devices)


def _pack_islands(sizes: list[tuple[int, int]], cluster) -> list[int] | None:
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


def tp_degrees_nest(slice_options: dict[str, list[SliceOption]]) -> bool:
    """True when every pair of tp degrees in use divides one another (then any wave packs into ranges)."""
    tps = sorted({o.tp for opts in slice_options.values() for o in opts})
    return all(b % a == 0 for a, b in zip(tps, tps[1:]))


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


# ------------------------------------------------------------------------------------------ wave-window LNS


def _lns_level(ctx: _Context, sub, waves: list[ScheduledWave], deadline: float) -> list[ScheduledWave]:
    """Large-neighbourhood search over a level's waves: re-solve a small window of waves exactly, keeping
    each MetaOp's layer total inside the window, and splice the answer back if it is shorter.

    Waves of one level are interchangeable (a MetaOp's layer ranges follow the wave order, re-numbered after
    every splice), so a window is any set of waves: the one that wastes the most device time and up to
    ``lns_window - 1`` others that share the most MetaOps with it (ties broken at random). Its model has
    a handful of MetaOps and slots and usually solves to optimality in milliseconds, which the full level
    model, with its hundreds of variables, rarely does within the limit. A window that cannot improve is
    not tried again until the plan changes."""
    import random

    rng = random.Random(ctx.opts.seed)
    area = {m: min(o.n * o.seconds for o in ctx.slice_options[m]) for m in sub.metaops}
    best = _renumber(waves)
    tried: set[frozenset[int]] = set()
    failures = 0
    while min(deadline, ctx.deadline) - time.perf_counter() > ctx.opts.lns_step_seconds / 4:
        window = _pick_window(best, ctx.cluster.num_devices, ctx.opts.lns_window, rng, tried, area)
        if window is None or failures > ctx.opts.lns_max_failures:
            break
        tried.add(frozenset(window))
        old = [best[i] for i in window]
        new = _solve_window(ctx, sub, old, min(ctx.opts.lns_step_seconds,
                                               min(deadline, ctx.deadline) - time.perf_counter()))
        if new is not None and makespan(new) < sum(w.duration for w in old) * (1 - 1e-6):
            rest = [w for i, w in enumerate(best) if i not in window]
            best = _renumber(rest + new)
            tried.clear()
            failures = 0
        else:
            failures += 1
    return best


def _waste(w: ScheduledWave, N: int, area: dict[str, float]) -> float:
    """Device-seconds of the wave beyond the least its layers need (``area``: a MetaOp's least device-seconds
    per layer): idle devices and configurations that scale worse both count."""
    return N * w.duration - sum(area[s.metaop] * (s.layer_end - s.layer_start) for s in w.slices)


def _pick_window(waves: list[ScheduledWave], N: int, size: int, rng, tried,
                 area: dict[str, float]) -> list[int] | None:
    """Indices of a window not tried yet: an anchor by waste (the worst untried first) plus the waves
    sharing the most MetaOps with it."""
    order = sorted(range(len(waves)), key=lambda i: -_waste(waves[i], N, area))
    ops = [{s.metaop for s in w.slices} for w in waves]
    for anchor in order:
        others = sorted((i for i in range(len(waves)) if i != anchor),
                        key=lambda i: (-len(ops[i] & ops[anchor]), rng.random()))
        for k in range(min(size, len(waves)), 1, -1):
            window = [anchor] + others[:k - 1]
            if frozenset(window) not in tried:
                return window
        for i in others:  # pairs with every other wave
            if frozenset((anchor, i)) not in tried:
                return [anchor, i]
    return None


def _solve_window(ctx: _Context, sub, old: list[ScheduledWave], limit: float) -> list[ScheduledWave] | None:
    """The window's waves re-planned by the slot model over its MetaOps, each with its layer total there."""
    totals: dict[str, int] = {}
    for w in old:
        for s in w.slices:
            totals[s.metaop] = totals.get(s.metaop, 0) + s.layer_end - s.layer_start
    ops = {m: replace(sub.metaops[m], ops=sub.metaops[m].ops[:n], params=sub.metaops[m].params[:n])
           for m, n in totals.items()}
    window_graph = type(sub)(ops, [], [list(ops)])
    hint = _renumber([ScheduledWave(w.level, 0.0, w.duration, [replace(s) for s in w.slices]) for w in old])
    builder = ctx.builder(hint, False, metagraph=window_graph, block_size=len(old))
    status, solver, _ = builder.solve_makespan(limit, ctx.workers)
    return builder.extract(solver) if solver is not None else None


def _renumber(waves: list[ScheduledWave]) -> list[ScheduledWave]:
    """The waves longest first, re-timed from 0, each MetaOp's layer ranges consecutive in that order."""
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


def _with_ranges(waves: list[ScheduledWave], cluster) -> bool:
    """Give every slice a packed device range (pack_ranges); False if some wave does not pack."""
    for w in waves:
        starts = pack_ranges([(s.n, s.tp) for s in w.slices], cluster)
        if starts is None:
            return False
        for s, st in zip(w.slices, starts):
            s.devices = list(range(st, st + s.n))
    return True

# ------------------------------------------------------------------------------------------ the model


@dataclass
class _Slot:
    """Variables of one (MetaOp, wave slot) pair."""

    metaop: str
    wave: int
    y: list[Any]  # bool per option
    layers: list[Any]  # layer count per option
    present: Any
    size: Any
    offset: Any = None  # first device of the range (models with ranges only)
    end: Any = None  # offset + size (the interval's end)
    aligned: dict[int, Any] = field(default_factory=dict)  # tp -> q with offset == tp * q
    home: Any = None  # bool: the range lies in the MetaOp's home island


class _ModelBuilder:
    """Builds the wave-slot model; small methods per constraint family."""

    def __init__(self, metagraph, cluster, slice_options, greedy_waves, cost_model, memory_model,
                 cross_level_overlap: bool, opts: CpSatOptions, with_comm: bool = False,
                 exact_memory: bool = False, block_size: int | None = None):
        self.g = metagraph
        self.level_of = {m: k for k, lv in enumerate(metagraph.levels) for m in lv}
        self.with_comm = with_comm and cluster.num_nodes > 1 and cost_model is not None
        self.exact_memory = exact_memory and memory_model is not None
        # device ranges as variables only where they matter to the objective or the constraints; otherwise
        # a device count per wave, and ranges packed afterwards (always possible when tp degrees nest)
        self.ranges = self.exact_memory or self.with_comm or not tp_degrees_nest(slice_options)
        self.cluster = cluster
        self.options = slice_options
        self.greedy = sorted(greedy_waves, key=lambda w: w.start)
        self.cost_model = cost_model
        self.memory_model = memory_model
        self.overlap = cross_level_overlap
        self.opts = opts
        self.block_size = block_size  # slots per level; default: the hint's waves there plus extra_waves
        self.model = cp_model.CpModel()
        self.N = cluster.num_devices
        self.blocks = self._level_blocks()
        self.num_slots = self.blocks[-1][1] if self.blocks else 0
        self.slots: dict[tuple[str, int], _Slot] = {}
        self.durations: list[Any] = []
        self.used: list[Any] = []
        self.first: dict[str, Any] = {}  # cross-level overlap: first / last slot of each MetaOp
        self.last: dict[str, Any] = {}
        self.home_island: dict[str, Any] = {}
        self.makespan_expr = None
        self.comm_expr = None
        self.hint_units = 0  # model makespan of the hint

    # ---------------------------------------------------------------- structure
    def _level_blocks(self) -> list[tuple[int, int]]:
        """[start, end) slot indices per MetaLevel: the greedy's wave count there plus extra_waves."""
        counts = [0] * len(self.g.levels)
        for w in self.greedy:
            counts[self._wave_level(w)] += 1
        blocks, pos = [], 0
        for k, lv in enumerate(self.g.levels):
            wanted = counts[k] + self.opts.extra_waves if self.block_size is None else self.block_size
            size = max(counts[k], wanted) if lv else 0
            blocks.append((pos, pos + size))
            pos += size
        return blocks

    def _wave_level(self, w: ScheduledWave) -> int:
        return min(self.level_of[s.metaop] for s in w.slices)

    def _slot_range(self, mid: str) -> range:
        k = self.level_of[mid]
        if not self.overlap:
            return range(*self.blocks[k])
        lo = self.blocks[max(0, k - self.opts.level_window)][0]
        hi = self.blocks[min(len(self.blocks) - 1, k + self.opts.level_window)][1]
        return range(lo, hi)

    # ---------------------------------------------------------------- build
    def build(self) -> None:
        horizon = sum(m.num_layers * max(o.units for o in self.options[mid])
                      for mid, m in self.g.metaops.items())
        self.durations = [self.model.NewIntVar(0, horizon, f"D{w}") for w in range(self.num_slots)]
        for mid in self.g.metaops:
            for w in self._slot_range(mid):
                self.slots[(mid, w)] = self._new_slot(mid, w)
        self._layers_and_durations()
        if self.ranges:
            self._devices()
        else:
            self._capacity()
        if self.overlap:
            self._precedence()
        self._symmetry()
        if self.memory_model is not None:
            self._slice_memory()
        if self.exact_memory:
            self._memory()
        self.makespan_expr = sum(self.durations)
        if self.with_comm:
            self.comm_expr = self._communication()

    def _new_slot(self, mid: str, w: int) -> _Slot:
        m, L = self.model, self.g.metaops[mid].num_layers
        opts = self.options[mid]
        y = [m.NewBoolVar(f"y[{mid},{w},{c}]") for c in range(len(opts))]
        lay = [m.NewIntVar(0, L, f"l[{mid},{w},{c}]") for c in range(len(opts))]
        present = m.NewBoolVar(f"p[{mid},{w}]")
        m.Add(sum(y) == present)
        for yc, lc in zip(y, lay):
            m.Add(lc >= yc)
            m.Add(lc <= L * yc)
        max_n = max(o.n for o in opts)
        size = m.NewIntVar(0, max_n, f"n[{mid},{w}]")
        m.Add(size == sum(o.n * yc for o, yc in zip(opts, y)))
        return _Slot(mid, w, y, lay, present, size)

    def _layers_and_durations(self) -> None:
        for mid, mo in self.g.metaops.items():
            slots = [s for (m, _), s in self.slots.items() if m == mid]
            self.model.Add(sum(lc for s in slots for lc in s.layers) == mo.num_layers)
        energy: dict[int, list[Any]] = {}
        for s in self.slots.values():
            opts = self.options[s.metaop]
            self.model.Add(self.durations[s.wave] >= sum(o.units * lc for o, lc in zip(opts, s.layers)))
            energy.setdefault(s.wave, []).append(sum(o.n * o.units * lc for o, lc in zip(opts, s.layers)))
        for w, terms in energy.items():
            # redundant (implied by disjoint devices) but it lifts the LP bound towards C*
            self.model.Add(self.N * self.durations[w] >= sum(terms))

    def _capacity(self) -> None:
        """Without ranges: the slices of a wave use at most N devices."""
        per_wave: dict[int, list[Any]] = {}
        for s in self.slots.values():
            per_wave.setdefault(s.wave, []).append(s.size)
        for sizes in per_wave.values():
            self.model.Add(sum(sizes) <= self.N)

    def _devices(self) -> None:
        """Ranges per slot: NoOverlap per wave, inside [0, N), start a multiple of tp (TP groups stay in a
        node). Ranges may cross islands (the greedy plan's do); the communication phase prices that."""
        per_wave: dict[int, list[Any]] = {}
        for s in self.slots.values():
            s.offset = self.model.NewIntVar(0, self.N - 1, f"o[{s.metaop},{s.wave}]")
            s.end = self.model.NewIntVar(0, self.N, f"e[{s.metaop},{s.wave}]")
            iv = self.model.NewOptionalIntervalVar(s.offset, s.size, s.end, s.present, f"iv[{s.metaop},{s.wave}]")
            per_wave.setdefault(s.wave, []).append(iv)
            for o, yc in zip(self.options[s.metaop], s.y):
                if o.tp > 1:
                    if o.tp not in s.aligned:
                        s.aligned[o.tp] = self.model.NewIntVar(0, self.N // o.tp, f"q[{s.metaop},{s.wave},{o.tp}]")
                    self.model.Add(s.offset == o.tp * s.aligned[o.tp]).OnlyEnforceIf(yc)
        for ivs in per_wave.values():
            self.model.AddNoOverlap(ivs)

    def _precedence(self) -> None:
        """Cross-level mode: a consumer's first slot is after each producer's last slot."""
        first, last = self.first, self.last
        for mid in self.g.metaops:
            rng = self._slot_range(mid)
            first[mid] = self.model.NewIntVar(rng.start, rng.stop - 1, f"first[{mid}]")
            last[mid] = self.model.NewIntVar(rng.start, rng.stop - 1, f"last[{mid}]")
            for w in rng:
                p = self.slots[(mid, w)].present
                self.model.Add(first[mid] <= w).OnlyEnforceIf(p)
                self.model.Add(last[mid] >= w).OnlyEnforceIf(p)
        for src, dst in self.g.edges:
            self.model.Add(first[dst] >= last[src] + 1)

    def _symmetry(self) -> None:
        """Empty slots go last in each level block: slot w used => slot w-1 used (removes equivalent orders).

        Also right with cross-level overlap: moving an empty slot to the end of its block only shifts later
        slots of the same block, which stay inside every window that contained them."""
        used = []
        for w in range(self.num_slots):
            u = self.model.NewBoolVar(f"used[{w}]")
            ps = [s.present for s in self.slots.values() if s.wave == w]
            if ps:
                self.model.AddBoolOr(ps).OnlyEnforceIf(u)
            else:
                self.model.Add(u == 0)
            for p in ps:
                self.model.AddImplication(p, u)
            used.append(u)
        self.used = used
        for lo, hi in self.blocks:
            for w in range(lo + 1, hi):
                self.model.AddImplication(used[w], used[w - 1])
                if not self.overlap:
                    # no precedence inside a level: any order of its waves is the same plan (layer ranges
                    # follow the slot order), so keep the longest first
                    self.model.Add(self.durations[w - 1] >= self.durations[w])

    # ---------------------------------------------------------------- memory
    def _slot_bytes(self, s: _Slot) -> list[float]:
        mo = self.g.metaops[s.metaop]
        return [_layer_bytes(mo, o, self.memory_model) for o in self.options[s.metaop]]

    def _slice_memory(self) -> None:
        """Each device of a slice holds all its layers: l <= capacity / per-layer bytes, per option."""
        for s in self.slots.values():
            mo = self.g.metaops[s.metaop]
            for o, lc in zip(self.options[s.metaop], s.layers):
                cap = _layer_cap(mo, o, self.memory_model, self.cluster)
                if cap is not None:
                    self.model.Add(lc <= cap)

    def _memory(self) -> None:
        """Per-device booleans a[s, d] <=> d in the slot's range; sum of the slot bytes on d <= capacity."""
        mu = self.opts.memory_unit_bytes
        cap = int(self.cluster.gpu.memory_bytes // mu)
        load: dict[int, list[Any]] = {d: [] for d in range(self.N)}
        for s in self.slots.values():
            per_layer = [math.ceil(b / mu) for b in self._slot_bytes(s)]
            big = self.g.metaops[s.metaop].num_layers * max(per_layer)
            slot_bytes = sum(b * lc for b, lc in zip(per_layer, s.layers))
            on = []
            for d in range(self.N):
                a = self.model.NewBoolVar(f"a[{s.metaop},{s.wave},{d}]")
                self.model.Add(s.offset <= d).OnlyEnforceIf(a)
                self.model.Add(s.offset + s.size >= d + 1).OnlyEnforceIf(a)
                z = self.model.NewIntVar(0, big, f"z[{s.metaop},{s.wave},{d}]")
                self.model.Add(z >= slot_bytes - big * (1 - a))
                load[d].append(z)
                on.append(a)
            self.model.Add(sum(on) == s.size)
        for zs in load.values():
            self.model.Add(sum(zs) <= cap)

    # ---------------------------------------------------------------- communication
    def _communication(self):
        """Home islands, slices away from home, edges and weight sharing across islands (module docstring)."""
        m, G, islands = self.model, self.cluster.gpus_per_node, self.cluster.num_nodes
        cu = self.opts.comm_unit_bytes
        terms = []
        for mid in self.g.metaops:
            self.home_island[mid] = m.NewIntVar(0, islands - 1, f"home[{mid}]")
        for s in self.slots.values():
            h = self.home_island[s.metaop]
            s.home = m.NewBoolVar(f"athome[{s.metaop},{s.wave}]")
            m.Add(s.offset >= G * h).OnlyEnforceIf(s.home)
            m.Add(s.offset + s.size <= G * h + G).OnlyEnforceIf(s.home)
            away = m.NewBoolVar(f"away[{s.metaop},{s.wave}]")
            m.AddBoolOr([s.present.Not(), s.home, away])
            terms.append(self._mb(self.cost_model.activation_bytes(self.g.metaops[s.metaop]), cu) * away)
        for src, dst in self.g.edges:
            terms.append(self._mb(self.cost_model.activation_bytes(self.g.metaops[src]), cu)
                         * self._differ(src, dst))
        for a, b, nbytes in self._sharing_pairs():
            terms.append(self._mb(nbytes, cu) * self._differ(a, b))
        return sum(terms)

    @staticmethod
    def _mb(nbytes: float, unit: int) -> int:
        return max(1, math.ceil(float(nbytes) / unit))

    def _differ(self, a: str, b: str):
        d = self.model.NewBoolVar(f"differ[{a},{b}]")
        self.model.Add(self.home_island[a] == self.home_island[b]).OnlyEnforceIf(d.Not())
        return d

    def _sharing_pairs(self) -> list[tuple[str, str, float]]:
        ids = list(self.g.metaops)
        pairs = []
        for i, a in enumerate(ids):
            for b in ids[i + 1:]:
                shared = self.g.metaops[a].param_names() & self.g.metaops[b].param_names()
                if shared:
                    pairs.append((a, b, 2.0 * sum(self._param_count(p) for p in shared)))
        return pairs

    def _param_count(self, name: str) -> float:
        try:
            return float(self.cost_model.param_count(name))
        except (AttributeError, KeyError, ValueError):
            return 0.0

    # ---------------------------------------------------------------- hint
    def add_greedy_hint(self) -> None:
        """The greedy plan as a complete solution: wave i of level k -> slot block_k.start + i."""
        if not self.greedy:
            return
        counters = {k: lo for k, (lo, _) in enumerate(self.blocks)}
        hinted: set[tuple[str, int]] = set()
        durations = [0] * self.num_slots
        order = self.greedy if self.overlap else sorted(self.greedy, key=lambda w: -self._wave_units(w))
        for w in order:
            k = self._wave_level(w)
            slot = counters[k]
            counters[k] += 1
            durations[slot] = self._hint_wave(w, slot, hinted)
        for key, s in self.slots.items():
            if key not in hinted:
                self._hint_slot(s, None, 0, 0)
        for d, v in zip(self.durations, durations):
            self.model.AddHint(d, v)
        self.hint_units = sum(durations)
        for w, u in enumerate(self.used):
            self.model.AddHint(u, any(slot == w for _, slot in hinted))
        for mid, var in self.first.items():
            self.model.AddHint(var, min(w for m, w in hinted if m == mid))
        for mid, var in self.last.items():
            self.model.AddHint(var, max(w for m, w in hinted if m == mid))

    def _wave_units(self, w: ScheduledWave) -> int:
        """The wave's duration in the model's time units (its longest slice)."""
        return max(next((o.units for o in self.options[s.metaop] if (o.n, o.tp, o.dp) == (s.n, s.tp, s.dp)), 0)
                   * (s.layer_end - s.layer_start) for s in w.slices)

    def _hint_wave(self, w: ScheduledWave, slot: int, hinted: set) -> int:
        starts = [_range_start(s.devices, s.n) for s in w.slices]
        if any(st is None for st in starts) or not self._ranges_valid(w.slices, starts):
            starts = pack_ranges([(s.n, s.tp) for s in w.slices], self.cluster)
            if starts is None:
                starts = [0] * len(w.slices)
        longest = 0
        for s, st in zip(w.slices, starts):
            if (s.metaop, slot) not in self.slots:  # a cross-level hint in a barrier model: partial hint
                continue
            opts = self.options[s.metaop]
            c = next((i for i, o in enumerate(opts) if (o.n, o.tp, o.dp) == (s.n, s.tp, s.dp)), None)
            if c is None:  # not an option of this (restricted) model: partial hint
                continue
            layers = s.layer_end - s.layer_start
            self._hint_slot(self.slots[(s.metaop, slot)], c, layers, st)
            hinted.add((s.metaop, slot))
            longest = max(longest, opts[c].units * layers)
        return longest

    @staticmethod
    def _ranges_valid(slices: list[ScheduledSlice], starts: list[int]) -> bool:
        return all(st % s.tp == 0 for s, st in zip(slices, starts))

    def _hint_slot(self, s: _Slot, c: int | None, layers: int, start: int) -> None:
        m = self.model
        m.AddHint(s.present, c is not None)
        for i, (yc, lc) in enumerate(zip(s.y, s.layers)):
            m.AddHint(yc, i == c)
            m.AddHint(lc, layers if i == c else 0)
        if c is None:
            m.AddHint(s.size, 0)
            if self.ranges:
                m.AddHint(s.offset, 0)
                m.AddHint(s.end, 0)
            return
        m.AddHint(s.size, self.options[s.metaop][c].n)
        if not self.ranges:
            return
        m.AddHint(s.offset, start)
        m.AddHint(s.end, start + self.options[s.metaop][c].n)
        o = self.options[s.metaop][c]
        if o.tp in s.aligned:
            m.AddHint(s.aligned[o.tp], start // o.tp)

    # ---------------------------------------------------------------- solve
    def solve_makespan(self, limit: float, workers: int) -> tuple[str, Any, float]:
        """(status name, solver holding a solution or None, seconds)."""
        self.model.Minimize(self.makespan_expr)
        solver = _solver(limit, workers, self.opts.seed, presolve=len(self.slots) <= self.opts.light_presolve_slots)
        status = solver.Solve(self.model)
        found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
        return solver.StatusName(status), solver if found else None, solver.WallTime()

    def solve_comm(self, limit: float, workers: int) -> tuple[list[ScheduledWave] | None, float, str]:
        """Second objective: inter-island bytes, with the makespan capped at the hint's (lexicographic)."""
        self.model.Add(self.makespan_expr <= self.hint_units)
        self.model.Minimize(self.comm_expr)
        solver = _solver(limit, workers, self.opts.seed, presolve=len(self.slots) <= self.opts.light_presolve_slots)
        status = solver.Solve(self.model)
        name = solver.StatusName(status)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None, solver.WallTime(), f"communication phase {name}: makespan-phase plan kept"
        return self.extract(solver), solver.WallTime(), f"communication phase {name}"

    def extract(self, solver) -> list[ScheduledWave]:
        """Slots in order -> waves with float times; layer ranges accumulate per MetaOp."""
        done = {mid: 0 for mid in self.g.metaops}
        waves: list[ScheduledWave] = []
        t = 0.0
        for w in range(self.num_slots):
            slices = []
            for (mid, slot), s in self.slots.items():
                if slot != w or not solver.Value(s.present):
                    continue
                c = next(i for i, yc in enumerate(s.y) if solver.Value(yc))
                o, layers = self.options[mid][c], solver.Value(s.layers[c])
                start = solver.Value(s.offset) if self.ranges else 0
                slices.append(ScheduledSlice(mid, o.n, o.tp, o.dp, done[mid], done[mid] + layers,
                                             o.seconds * layers, list(range(start, start + o.n))))
                done[mid] += layers
            if not slices:
                continue
            if not self.ranges:
                self._pack(slices)
            duration = max(s.time for s in slices)
            level = min(self.g.metaops[s.metaop].level for s in slices)
            waves.append(ScheduledWave(level, t, duration, slices))
            t += duration
        return waves

    def _pack(self, slices: list[ScheduledSlice]) -> None:
        starts = pack_ranges([(s.n, s.tp) for s in slices], self.cluster)
        if starts is None:  # cannot happen when the tp degrees nest and the wave fits N (checked in build)
            raise RuntimeError("cp-sat: a wave of the solver does not pack into device ranges")
        for s, st in zip(slices, starts):
            s.devices = list(range(st, st + s.n))


def _memory_can_bind(metagraph, slice_options: dict[str, list[SliceOption]], memory_model, cluster) -> bool:
    """False when even every MetaOp's largest per-device footprint on one device fits: then the per-device
    memory variables are left out."""
    if memory_model is None:
        return False
    worst = sum(mo.num_layers * max(_layer_bytes(mo, o, memory_model) for o in slice_options[mid])
                for mid, mo in metagraph.metaops.items())
    return worst > cluster.gpu.memory_bytes


def _solver(limit: float, workers: int, seed: int, presolve: bool = True) -> cp_model.CpSolver:
    """Presolve (probing in particular) pays off on the per-level models, which it helps prove optimal, but
    on whole-graph models of large clusters it can take the whole limit before the hint is even loaded."""
    solver = cp_model.CpSolver()
    solver.parameters.cp_model_presolve = presolve
    solver.parameters.max_time_in_seconds = max(limit, 0.001)
    solver.parameters.num_workers = max(1, workers)
    solver.parameters.random_seed = seed
    return solver


def _range_start(devices: list[int] | None, n: int) -> int | None:
    if not devices or len(devices) != n:
        return None
    lo = min(devices)
    return lo if list(devices) == list(range(lo, lo + n)) else None
