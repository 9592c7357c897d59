"""The one planning entry point: workload + cluster -> Plan.

contract (graph) -> scaling curves (estimator) -> per-level allocation (bisection + bi-point) -> wavefront
waves -> placement -> [CP-SAT refinement] -> assembled, validated Plan.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from megatron_spindle.estimator import AnalyticCostModel, MemoryModel, estimate_curves, valid_configs
from megatron_spindle.flags import check_choices, flag
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaGraph, build_metagraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan.layout import micro_batch_metaop
from megatron_spindle.plan.memory import ZeroSharded, slice_memory
from megatron_spindle.plan.order import default_order, early_backward_order, slice_order
from megatron_spindle.plan.schema import ExecutionSettings, Plan, PlanError, Recompute
from megatron_spindle.plan.validate import validate_plan
from megatron_spindle.planner.allocator import allocate_level
from megatron_spindle.planner.assemble import assemble_plan, slice_id
from megatron_spindle.planner.light_levels import follow_neighbours
from megatron_spindle.planner.memory_options import (
    RecomputeError,
    RecomputePolicy,
    SliceKey,
    choose_recompute,
    recompute_seconds,
)
from megatron_spindle.planner.objective import estimate_iteration
from megatron_spindle.planner.placement import PlacementError, place
from megatron_spindle.planner.schedule import LevelAllocation, ScheduledSlice, ScheduledWave
from megatron_spindle.planner.wavefront import schedule_levels

PLANNERS = ("wavefront", "cpsat")
MEMORY_SHARES = (0.5, 0.25, 0.125)
INVERSES = ("rate", "time")
PLACEMENTS = ("spindle", "sequential")
RECOMPUTE = ("auto", "none", "selective", "full")
DISTRIBUTED_OPTIMIZER = ("auto", "off", "on")
EARLY_BACKWARD = ("auto", "on", "off")
MICRO_BATCH_TRIES = 2  # micro-batch counts tried beyond the first that fits (auto)
# device memory placement may plan with (times the device's) before recomputation takes the excess off: the more,
# the less memory limits the configurations and their balance, the more may have to be recomputed
OVERCOMMITS = (2.0, 3.0)
SELECTIONS = ("simulate", "none")
LIGHT_FOLLOW_SLACK = 0.01


@dataclass
class PlannerConfig:
    """How to plan; every field is a ``--spindle-*`` flag (megatron_spindle/flags.py)."""

    planner: str = field(default="cpsat", metadata=flag(
        "wavefront: the paper's greedy planner; cpsat: refined by an OR-Tools CP-SAT model warm-started from the "
        "greedy plan.", choices=PLANNERS))
    inverse: str = field(default="rate", metadata=flag(
        "Interpolation of T^-1 in the allocator: linear in rate 1/T (consistent with sum n* = N) or linear in T "
        "(the paper's eq. 11).", choices=INVERSES))
    placement: str = field(default="spindle", metadata=flag(
        "Device placement: island/flow/memory-aware heuristics, or consecutive devices (ablation).",
        choices=PLACEMENTS))
    solver_time_limit: float = field(default=10.0, metadata=flag("CP-SAT time limit in seconds."))
    solver_workers: int = field(default=2, metadata=flag("CP-SAT search workers."))
    cross_level_overlap: bool = field(default=False, metadata=flag(
        "CP-SAT: let a MetaOp start when its own producers end instead of at the level barrier."))
    recompute: str = field(default="auto", metadata=flag(
        "Activation recomputation of transformer layers: auto chooses per slice the cheapest of none, selective "
        "(the attention core) and full recomputation of k of its layers whose memory fits, and nothing when "
        "memory allows; none, selective, full: that for every layer. --recompute-granularity overrides it.",
        choices=RECOMPUTE))
    recompute_granularity: str | None = field(default=None, metadata=flag(
        "Megatron-style: recompute every layer slice's attention core (selective) or whole layers (full, with "
        "--recompute-method and --recompute-num-layers); the planner uses it as given.",
        name="--recompute-granularity", choices=("full", "selective")))
    recompute_method: str | None = field(default=None, metadata=flag(
        "With --recompute-granularity full: uniform (every layer, in chunks of --recompute-num-layers; the "
        "default) or block (the first --recompute-num-layers layers of every slice).",
        name="--recompute-method", choices=("uniform", "block")))
    recompute_num_layers: int | None = field(default=None, metadata=flag(
        "With --recompute-granularity full: layers per chunk (uniform, default 1) or recomputed layers per slice "
        "(block, default all).", name="--recompute-num-layers"))
    micro_batches: str = field(default="auto", metadata=flag(
        "Split every task's batch into N micro-batches (gradient accumulation; N divides every batch, and each "
        "slice's data-parallel degree divides a micro-batch): auto trades the per-device efficiency of smaller "
        "micro-batches against memory, 1 when memory allows.", metavar="auto|N"))
    early_backward: str = field(default="auto", metadata=flag(
        "Start a task's backward as soon as its loss is computed, one wave after each later forward wave "
        "(freeing its activations while other tasks' forward goes on): auto where the plan fits no other way; "
        "plan selection (--spindle-select simulate) also times it where it would only save recomputation.",
        choices=EARLY_BACKWARD))
    distributed_optimizer: str = field(default="auto", metadata=flag(
        "Shard each unit's optimizer state over the data-parallel ranks that run it (ZeRO-1, like "
        "--use-distributed-optimizer): auto switches it on only when memory requires it.",
        choices=DISTRIBUTED_OPTIMIZER))

    select: str = field(default="simulate", metadata=flag(
        "simulate: plan a few candidates (the configured planner, the greedy wavefront plan, node-bounded "
        "slices, the tasks partitioned over groups of nodes, with and without the distributed optimizer) and keep the one the simulator times fastest "
        "(megatron_spindle/autoplan.py); none: the configured planner's plan.", choices=SELECTIONS))
    # Not flags: variants plan selection (megatron_spindle/autoplan.py) asks for. At most this many devices per
    # slice (0: no limit), for MetaOps that have a configuration that small: a node (gpus_per_node) keeps every
    # slice's collectives and hand-offs on NVLink.
    max_slice_devices: int = 0
    # Light MetaLevels laid out like their neighbours (planner/light_levels.py) when that lengthens the waves
    # by at most LIGHT_FOLLOW_SLACK.
    light_follow: bool = False

    def __post_init__(self):
        check_choices(self)
        if self.micro_batches != "auto" and not (str(self.micro_batches).isdigit() and int(self.micro_batches) > 0):
            raise ValueError(f"--spindle-micro-batches must be auto or a positive integer, got {self.micro_batches!r}")
        self.micro_batches = str(self.micro_batches)
        if self.recompute_granularity != "full" and (self.recompute_method or self.recompute_num_layers is not None):
            raise ValueError("--recompute-method and --recompute-num-layers need --recompute-granularity full")
        if self.recompute_num_layers is not None and self.recompute_num_layers < 1:
            raise ValueError(f"--recompute-num-layers must be >= 1, got {self.recompute_num_layers}")

    def fixes_memory_options(self) -> bool:
        """The user gave recomputation, micro-batches or the early backward (a plan must use them)."""
        return (self.recompute != "auto" or self.recompute_granularity is not None or self.micro_batches != "auto"
                or self.early_backward == "on")
        if self.solver_time_limit < 0:
            raise ValueError(f"solver time limit must be >= 0, got {self.solver_time_limit}")
        if self.solver_workers < 1:
            raise ValueError(f"solver workers must be >= 1, got {self.solver_workers}")


@dataclass
class PlanningResult:
    """Everything planning produced; baselines and benchmarks reuse the intermediate pieces."""

    plan: Plan
    metagraph: MetaGraph
    curves: dict[str, Any]
    level_allocs: list[LevelAllocation]
    greedy_waves: list[ScheduledWave]
    cost_model: AnalyticCostModel
    memory_model: MemoryModel
    timings: dict[str, float] = field(default_factory=dict)
    solver: Any = None  # CpSatResult when the CP-SAT planner ran


def make_plan(workload: Workload, cluster: ClusterSpec, config: PlannerConfig | None = None,
              profile: dict | None = None, progress: Callable[[str], None] | None = None) -> Plan:
    return plan_workload(workload, cluster, config, profile, progress).plan


def plan_workload(workload: Workload, cluster: ClusterSpec, config: PlannerConfig | None = None,
                  profile: dict | None = None, progress: Callable[[str], None] | None = None,
                  placements: dict | None = None) -> PlanningResult:
    """``placements``: a dict shared by planning runs of the same workload, cluster and profile (plan selection's
    candidates, megatron_spindle/autoplan.py): the memory search's placements, which depend on neither the
    planner nor the order, are made once."""
    config = config or PlannerConfig()
    say = progress or (lambda msg: None)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t0
        now = time.perf_counter()
        timings[name] = now - t0
        t0 = now

    metagraph = build_metagraph(workload)
    say(f"graph: {len(metagraph.metaops)} MetaOps in {len(metagraph.levels)} MetaLevels")
    lap("contract")
    best = _memory_search(metagraph, workload, cluster, config, profile, say, placements)
    lap("estimate+allocate+schedule+place")
    say(f"scaling curves: {len(best.curves)} ({sum(c.source == 'profiled' for c in best.curves.values())} profiled)")
    say(f"wavefront: {len(best.waves)} waves; memory: {best.describe()}")
    info: dict[str, Any] = {"planner": "wavefront", "requested": asdict(config), "memory_options": best.describe()}
    solver, greedy = None, best.placed
    if config.planner == "cpsat":
        from megatron_spindle.planner.cpsat import solve_cpsat

        say(f"cp-sat: refining the greedy plan (limit {config.solver_time_limit:g} s, "
            f"{config.solver_workers} workers)")
        solver = solve_cpsat(best.metagraph, workload, best.placed_on, best.curves, best.placed, best.cost_model,
                             best.memory_model_placed, time_limit=config.solver_time_limit,
                             workers=config.solver_workers, cross_level_overlap=config.cross_level_overlap,
                             level_allocs=best.level_allocs)
        info["planner"] = "cpsat"
        info["solver"] = solver.summary()
        refined = best.with_waves(solver.waves, cluster, config)
        if refined is not None and (refined.recomputes or best.recomputes):
            # the solver times the waves without recomputation: what its plan needs recomputed may cost more
            refined = refined if refined.estimate(workload, cluster, metagraph) <= \
                best.estimate(workload, cluster, metagraph) else None
            if refined is None:
                info["notes"] = ["the CP-SAT plan needs more recomputation than it saves; the greedy plan is kept"]
        if refined is not None:
            best = refined
            info["memory_options"] = best.describe()
        else:
            info.setdefault("notes", ["the CP-SAT plan fits no recomputation choice; the greedy plan is kept"])
        lap("cpsat")
    if config.light_follow:
        relaid = _light_levels_follow(best.placed, best.metagraph, workload, best.placed_on, best.curves,
                                      best.cost_model, best.memory_model_placed, config)
        refined = best.with_waves(relaid, cluster, config) if relaid is not best.placed else None
        best = refined or best
    plan = assemble_plan(workload, cluster, metagraph, best.charged_waves(), best.cost_model, best.memory_model,
                         info, level_allocs=best.level_allocs, curves=best.curves, settings=best.settings())
    plan.predicted["micro_batch_time"] = plan.predicted["iteration_time"] / best.micro_batches
    _iteration_c_star(plan, best.micro_batches)
    validate_plan(plan, workload, cluster, metagraph)
    plan.predicted.update(estimate_iteration(plan, metagraph, cluster, best.cost_model).as_predicted())
    lap("assemble")
    plan.planner["planning_seconds"] = sum(timings.values())
    return PlanningResult(plan, metagraph, best.curves, best.level_allocs, greedy, best.cost_model,
                          best.memory_model, timings, solver)


def _light_levels_follow(waves, metagraph, workload, cluster, curves, cost_model, memory_model, config):
    """The waves with light levels laid out like their neighbours (planner/light_levels.py) and placed again;
    the waves as they are when that does not place."""
    relaid = follow_neighbours(waves, metagraph, curves, cluster.num_devices)
    before = max((w.end for w in waves), default=0.0)
    if relaid == list(waves) or max((w.end for w in relaid), default=0.0) > before * (1 + LIGHT_FOLLOW_SLACK):
        return waves
    try:
        return place(relaid, metagraph, workload, cluster, cost_model, memory_model, strategy=config.placement)
    except PlacementError:
        return waves


def _allocate_schedule_place(metagraph, workload, cluster, config, profile, cost_model, memory_model, say,
                             shares: tuple[float, ...] = MEMORY_SHARES):
    """Curves, allocation, waves and placement, memory-aware: the paper's allocator ignores memory, and a heavy
    MetaOp on too few devices cannot hold its activations. Each MetaOp's configurations are first limited to
    those whose whole chain fits ``shares[0]`` of a device (half by default); when placement still runs out of
    memory the next share is tried and everything is replanned. Also returns whether memory bound the plan (a
    configuration was left out or a share replanned): where it did not, more memory would plan the same."""
    N = cluster.num_devices
    needs = memory_needs(metagraph, workload, cluster, memory_model)
    memory_allowed_configs(metagraph, needs, cluster, 1.0)  # a MetaOp that fits nowhere is named first
    total = sum(min(b * c[0] * c[1] for c, b in need.items()) for need in needs.values())
    if total > N * cluster.gpu.memory_bytes:
        # Even spread perfectly (and with weights stored per MetaOp), the chains need more than the cluster has.
        raise PlanError(f"the plan does not fit device memory: the MetaOps need at least {total / 2**30:.0f} GiB "
                        f"in all, the {N} devices have {N * cluster.gpu.memory_bytes / 2**30:.0f} GiB")
    for attempt, share in enumerate(shares):
        allowed = cap_slice_devices(memory_allowed_configs(metagraph, needs, cluster, share), config.max_slice_devices)
        curves = estimate_curves(metagraph, workload, cluster, cost_model=cost_model, profile=profile,
                                 allowed=lambda m, tp, dp, fits=allowed: (tp, dp) in fits[m.id])
        level_allocs = [
            allocate_level(k, [metagraph.metaops[m] for m in level], curves, N, mode=config.inverse)
            for k, level in enumerate(metagraph.levels)
        ]
        waves = schedule_levels(level_allocs, metagraph, curves, N)
        try:
            placed = place(waves, metagraph, workload, cluster, cost_model, memory_model,
                           strategy=config.placement)
            bound = attempt > 0 or _restriction_binds(placed, curves, needs, share, metagraph, workload, cluster,
                                                      config, profile, cost_model)  # else more memory plans the same
            return curves, level_allocs, placed, bound
        except PlacementError as e:
            if attempt == len(shares) - 1:
                raise PlanError(f"the plan does not fit device memory: {e}") from e
            say(f"placement out of memory; replanning with at most {100 * shares[attempt + 1]:.0f}% "
                f"of a device per MetaOp")
    raise AssertionError("unreachable")


def _restriction_binds(placed, curves, needs, share, metagraph, workload, cluster, config, profile, cost_model) -> bool:
    """Whether a configuration left out for memory would have run some slice faster on its device count (one
    left out only where the plan never goes, e.g. a large MetaOp on 1 of 1024 devices, binds nothing)."""
    limit = share * cluster.gpu.memory_bytes
    if not any(b > limit for n in needs.values() for b in n.values()):
        return False
    every = cap_slice_devices({m: set(n) for m, n in needs.items()}, config.max_slice_devices)
    free = estimate_curves(metagraph, workload, cluster, cost_model=cost_model, profile=profile,
                           allowed=lambda m, tp, dp: (tp, dp) in every[m.id])
    return any(free[s.metaop].time(s.n) < curves[s.metaop].time(s.n) * (1 - 1e-9)
               for w in placed for s in w.slices)


def cap_slice_devices(allowed: dict[str, set[tuple[int, int]]], cap: int) -> dict[str, set[tuple[int, int]]]:
    """The allowed configurations limited to at most ``cap`` devices (0: unlimited), per MetaOp where any is
    left."""
    if cap <= 0:
        return allowed
    out = {}
    for mid, configs in allowed.items():
        small = {c for c in configs if c[0] * c[1] <= cap}
        out[mid] = small or configs
    return out


def recompute_policy(config: PlannerConfig) -> RecomputePolicy:
    """The recomputation the planner may choose: the Megatron-style flags as given, else --spindle-recompute."""
    if config.recompute_granularity == "selective":
        return RecomputePolicy(Recompute("selective"))
    if config.recompute_granularity == "full":
        if (config.recompute_method or "uniform") == "uniform":
            return RecomputePolicy(Recompute("full", config.recompute_num_layers or 1, "uniform"))
        return RecomputePolicy(Recompute("full", config.recompute_num_layers))
    if config.recompute == "auto":
        return RecomputePolicy()
    return RecomputePolicy(Recompute(config.recompute))


def memory_rungs(config: PlannerConfig, policy: RecomputePolicy) -> list[tuple[bool, Recompute, float]]:
    """(distributed optimizer, recomputation placement plans with, device memory placement may use / the
    device's) in order, cheapest first: sharding the optimizer state costs nothing in time (its reduce-scatter
    + all-gather moves what an all-reduce moves); recomputation costs a forward pass per layer, so placement
    first plans without it; then, where recomputation may be chosen per slice, without it on devices
    OVERCOMMITS times as large (placement balances the real activations, recomputation takes off what does not
    fit), then with every layer at its leanest (``policy.lean()``); the slices get the cheapest choice that
    fits afterwards. With recomputation, sharding is free, so an unsharded recomputing rung is never worth
    trying."""
    sharded = {"off": [False], "on": [True], "auto": [False, True]}[config.distributed_optimizer]
    if policy.fixed is not None:
        assumed = [(policy.fixed, 1.0)]
    else:
        assumed = [(Recompute(), 1.0)] + [(Recompute(), o) for o in OVERCOMMITS] + [(policy.lean(), 1.0)]
    rungs = [(z, rc, over) for rc, over in assumed for z in sharded]
    recomputing = [r for r in rungs if r[1].mode != "none" or r[2] > 1]
    return [r for r in rungs if not (r in recomputing and not r[0] and (True, r[1], r[2]) in rungs)]


def _iteration_c_star(plan: Plan, micro_batches: int) -> None:
    """C~* of the levels (allocated on one micro-batch) scaled to the iteration, as the waves are (m micro-batches)."""
    if micro_batches == 1 or "c_star" not in plan.predicted:
        return
    for level in plan.levels:
        level.c_star *= micro_batches
    c_star = plan.predicted["c_star"] = plan.predicted["c_star"] * micro_batches
    plan.predicted["gap"] = plan.predicted["iteration_time"] / c_star - 1.0 if c_star > 0 else 0.0


def micro_batch_candidates(config: PlannerConfig, metagraph: MetaGraph) -> list[int]:
    """Micro-batch counts to try, smallest first: each divides every MetaOp's batch (auto: the divisors of
    their gcd, thinned to roughly doubling steps, the gcd itself last)."""
    common = math.gcd(*{m.batch for m in metagraph.metaops.values()})
    if config.micro_batches != "auto":
        n = int(config.micro_batches)
        if common % n:
            batches = sorted({m.batch for m in metagraph.metaops.values()})
            raise PlanError(f"--spindle-micro-batches {n} does not divide every task's batch {batches}")
        return [n]
    out = []
    for d in range(1, common + 1):
        if common % d == 0 and (not out or d >= 2 * out[-1] or d == common):
            out.append(d)
    return out


def micro_metagraph(metagraph: MetaGraph, micro_batches: int) -> MetaGraph:
    """The MetaGraph as one micro-batch runs it (every batch divided by ``micro_batches``)."""
    if micro_batches == 1:
        return metagraph
    return dataclasses.replace(metagraph, metaops={mid: micro_batch_metaop(m, micro_batches)
                                                   for mid, m in metagraph.metaops.items()})


@dataclass
class _Candidate:
    """Placed waves of one micro-batch count and ZeRO stage, with the recomputation and order chosen for them."""

    micro_batches: int
    metagraph: MetaGraph  # as a micro-batch runs it
    cost_model: AnalyticCostModel
    memory_model: MemoryModel  # recomputation per slice from the settings
    memory_model_placed: MemoryModel  # what placement (and CP-SAT) planned with
    placed_on: ClusterSpec  # the cluster placement (and CP-SAT) planned on: device memory overcommitted or not
    policy: RecomputePolicy
    curves: dict[str, Any]
    level_allocs: list[LevelAllocation]
    placed: list[ScheduledWave]
    choices: dict[SliceKey, Recompute] = field(default_factory=dict)
    order: tuple | None = None
    extra: dict[SliceKey, float] = field(default_factory=dict)  # recomputation seconds per slice
    error: Exception | None = None  # why ``choose`` found nothing
    estimated: float | None = None

    @property
    def waves(self) -> list[ScheduledWave]:
        return self.placed

    @property
    def recomputes(self) -> bool:
        return any(rc.mode != "none" for rc in self.choices.values())

    @property
    def predicted(self) -> float:
        """The waves' makespan with recomputation, every micro-batch of them."""
        return max((w.end for w in self.charged_waves()), default=0.0)

    def estimate(self, workload: Workload, cluster: ClusterSpec, metagraph: MetaGraph) -> float:
        """The planner's estimate of the iteration (planner/objective.py: the waves plus transfers, what the
        gradient sync adds beyond the last micro-batch's backward, the optimizer step)."""
        if self.estimated is None:
            plan = assemble_plan(workload, cluster, metagraph, self.charged_waves(), self.cost_model,
                                 self.memory_model, {}, validate=False, settings=self.settings())
            self.estimated = estimate_iteration(plan, metagraph, cluster, self.cost_model).total
        return self.estimated

    def choose(self, cluster: ClusterSpec, config: PlannerConfig) -> bool:
        """Recomputation per slice, and the order: the plain one, or (``early_backward`` on, or auto when the
        plain order fits no recomputation choice) the early backward; False when nothing fits. The early
        backward lowers the peak, but the waves cannot tell what its interleaving costs: where it only saves
        recomputation, plan selection (megatron_spindle/autoplan.py) simulates it as another candidate."""
        tasks = [[self.metagraph.metaops[s.metaop].task for s in w.slices] for w in self.placed]
        early = early_backward_order(tasks)
        orders: list[tuple | None] = {"on": [early], "off": [None], "auto": [None, early]}[config.early_backward]
        if early == default_order(len(tasks)):
            orders = [None]
        numbers = ZeroSharded(self.memory_model, self.memory_model.zero_stage)
        waves = [w.slices for w in self.placed]
        for order in orders:
            steps = slice_order(tasks, ExecutionSettings(order=order))
            try:
                self.choices = choose_recompute(waves, self.metagraph.metaops, numbers, self.cost_model,
                                                cluster.gpu.memory_bytes, steps, self.policy, cluster.num_devices,
                                                cluster.gpu.name, [w.duration for w in self.placed])
            except RecomputeError as e:
                self.error = e
                continue
            self.order = order
            self.extra = recompute_seconds(waves, self.metagraph.metaops, self.cost_model, self.choices)
            return True
        return False

    def with_waves(self, waves: list[ScheduledWave], cluster: ClusterSpec, config: PlannerConfig) -> _Candidate | None:
        other = dataclasses.replace(self, placed=waves, choices={}, order=None, extra={}, estimated=None)
        return other if other.choose(cluster, config) else None

    def charged_waves(self) -> list[ScheduledWave]:
        """The placed waves as the plan records them: each slice's recomputation added to its time (waves
        stretched, later ones shifted by as much), and every time for the whole iteration, m micro-batches
        (the plan's wave times are an iteration's: ``predicted["micro_batch_time"]`` is one micro-batch's)."""
        m = self.micro_batches
        out, shift = [], 0.0
        for wi, w in enumerate(self.placed):
            slices = [dataclasses.replace(s, time=m * (s.time + self.extra.get((wi, si), 0.0)))
                      for si, s in enumerate(w.slices)]
            duration = max([m * w.duration] + [s.time for s in slices])
            out.append(ScheduledWave(w.level, m * w.start + shift, duration, slices))
            shift += duration - m * w.duration
        return out

    def settings(self) -> ExecutionSettings:
        layer = {k: rc for k, rc in self.choices.items()}
        distinct = set(layer.values())
        if self.policy.fixed is not None or len(distinct) <= 1:
            plan_wide, per_slice = (self.policy.fixed or next(iter(distinct), Recompute())), {}
        else:
            plan_wide = Recompute()
            per_slice = {slice_id(wi, self.placed[wi].slices[si].metaop): rc
                         for (wi, si), rc in layer.items() if rc.mode != "none"}
        return ExecutionSettings(recompute=plan_wide, slice_recompute=per_slice,
                                 zero_stage=self.memory_model.zero_stage, micro_batches=self.micro_batches,
                                 order=self.order)

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for rc in self.choices.values():
            counts[rc.describe()] = counts.get(rc.describe(), 0) + 1
        recompute = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()) if k != "none") or "none"
        return (f"{self.micro_batches} micro-batch(es), ZeRO-{self.memory_model.zero_stage}, recomputation: "
                f"{recompute}{', early backward' if self.order is not None else ''}")


def _memory_search(metagraph: MetaGraph, workload: Workload, cluster: ClusterSpec, config: PlannerConfig, profile,
                   say, placements: dict | None = None) -> _Candidate:
    """The memory options of the plan: for each micro-batch count (fewest first), every rung of
    ``memory_rungs`` that places and fits is a candidate, and the one the planner's estimate times fastest
    (planner/objective.py) wins. The first rung that fits is not always the fastest: placement under the cap
    limits the configurations and their balance, so a placement on overcommitted devices with a little
    recomputation (or none: the real activations may fit after all) can beat it, and a few more micro-batches
    can beat recomputation. A rung that fits with memory binding nothing (no recomputation, no configuration
    left out) ends its count, and such a count ends the search, as do a count that fits without recomputation
    and is no faster than the best before it (more micro-batches only cost efficiency from there) and
    MICRO_BATCH_TRIES more counts after the first that fits."""
    policy = recompute_policy(config)
    counts = micro_batch_candidates(config, metagraph)
    rungs = memory_rungs(config, policy)
    best: _Candidate | None = None
    error: Exception | None = None
    first_fit = None  # index of the first count that fits

    def faster(a: _Candidate, b: _Candidate | None) -> bool:
        return b is None or a.estimate(workload, cluster, metagraph) < b.estimate(workload, cluster, metagraph)

    for i, m in enumerate(counts):
        if first_fit is not None and i - first_fit > MICRO_BATCH_TRIES:
            break
        micro = micro_metagraph(metagraph, m)
        found, free, unbound = None, False, None  # unbound: the least overcommit that placed with memory binding nothing
        for sharded, assumed, over in rungs:
            if assumed.mode == "none" and unbound is not None and over > unbound:
                continue  # more memory would place the same
            if not sharded and i > 0 and config.distributed_optimizer == "auto":
                continue  # memory bound the first count: sharding the optimizer state costs no time
            key = (m, sharded, assumed, over, config.inverse, config.placement, config.max_slice_devices)
            if placements is None or key not in placements:
                try:
                    placed = _place_rung(micro, workload, cluster, config, profile if m == 1 else None, sharded,
                                         assumed, over, say)
                except PlanError as e:
                    placed = e
                if placements is not None:
                    placements[key] = placed
            placed = placements[key] if placements is not None else placed
            if isinstance(placed, PlanError):
                error = placed
                continue
            cost_model, placed_mm, roomy, curves, allocs, placed, bound = placed
            cand = _Candidate(m, micro, cost_model, MemoryModel(workload, cluster, cost_model,
                                                                distributed_optimizer=sharded),
                              placed_mm, roomy, policy, curves, allocs, placed)
            if not bound and assumed.mode == "none":
                unbound = over if unbound is None else min(unbound, over)
            if not cand.choose(cluster, config):
                error = cand.error
                continue
            say(f"{cand.describe()} (placed on {over:g}x device memory): estimated "
                f"{1e3 * cand.estimate(workload, cluster, metagraph):.1f} ms")
            if faster(cand, found):
                found = cand
            if over == 1 and not bound and not cand.recomputes:
                free = True
                break
        if found is None:
            if best is not None:
                break
            say(f"the plan does not fit device memory with {m} micro-batch(es)"
                + ("; trying more" if m != counts[-1] else ""))
            continue
        first_fit = i if first_fit is None else first_fit
        improves = faster(found, best)
        if improves:
            best = found
        if free or (not found.recomputes and not improves):
            break
    if best is None:
        m = counts[-1]
        raise PlanError(f"the plan does not fit device memory even with {m} micro-batch(es) (batches "
                        f"{sorted({op.batch // m for op in metagraph.metaops.values()})} per micro-batch), "
                        f"{policy.lean().describe()} recomputation and the distributed optimizer: {error}")
    return best


def _place_rung(micro, workload, cluster, config, profile, sharded, assumed, over, say):
    """One rung's placement: (cost model, memory model placed with, cluster placed on, curves, allocations,
    placed waves, whether memory bound it)."""
    cost_model = AnalyticCostModel(workload, cluster)
    placed_mm = MemoryModel(workload, cluster, cost_model, distributed_optimizer=sharded, recompute=assumed)
    # planning with every layer at its leanest, a chain may take the whole device: what it does not need is given
    # back to it slice by slice afterwards
    shares = (1.0,) + MEMORY_SHARES if assumed.mode != "none" else MEMORY_SHARES
    roomy = cluster if over == 1 else dataclasses.replace(cluster, gpu=dataclasses.replace(
        cluster.gpu, memory_bytes=over * cluster.gpu.memory_bytes))
    placed = _allocate_schedule_place(micro, workload, roomy, config, profile, cost_model, placed_mm, say, shares)
    return (cost_model, placed_mm, roomy) + placed


def memory_footprint(metaop, tp: int, dp: int, memory_model: MemoryModel) -> float:
    """Bytes per device of a MetaOp's whole chain at (tp, dp): parameter state plus activations held for backward."""
    chain = ScheduledSlice(metaop.id, tp * dp, tp, dp, 0, metaop.num_layers, 0.0)
    mem = slice_memory(metaop, chain, memory_model)
    return sum(mem.units.values()) + mem.activations


def memory_needs(metagraph: MetaGraph, workload: Workload, cluster: ClusterSpec,
                 memory_model: MemoryModel) -> dict[str, dict[tuple[int, int], float]]:
    """Per MetaOp, the footprint of each valid (tp, dp)."""
    return {mid: {c: memory_footprint(m, *c, memory_model) for c in valid_configs(m, workload, cluster)}
            for mid, m in metagraph.metaops.items()}


def memory_allowed_configs(metagraph: MetaGraph, needs: dict[str, dict[tuple[int, int], float]],
                           cluster: ClusterSpec, share: float) -> dict[str, set[tuple[int, int]]]:
    """Per MetaOp, the valid (tp, dp) whose footprint fits ``share`` of a device; when none does, those that fit
    the whole device. A MetaOp that fits under no configuration is an error naming it and the memory it needs."""
    capacity = cluster.gpu.memory_bytes
    allowed = {}
    for mid, need in needs.items():
        (tp, dp), least = min(need.items(), key=lambda item: item[1])
        # When no configuration fits the share, only the leanest ones (usually the widest DP) are allowed.
        fits = {c for c, b in need.items() if b <= max(share * capacity, least)}
        if least > capacity:
            m = metagraph.metaops[mid]
            raise PlanError(
                f"MetaOp '{mid}' (batch {m.batch}, {m.num_layers} layers) does not fit device memory: it needs "
                f"{least:.0f} bytes ({least / 2**30:.1f} GiB) per device even at its best configuration (tp {tp} x "
                f"dp {dp} on {tp * dp} devices), a {cluster.gpu.name} device has {capacity:.0f} bytes "
                f"({capacity / 2**30:.1f} GiB); no allocation of this batch fits (use more devices, a batch with "
                f"more divisors, or a smaller batch)")
        allowed[mid] = fits
    return allowed
