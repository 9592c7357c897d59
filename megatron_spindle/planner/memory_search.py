"""The planner's memory search: which micro-batch count, ZeRO stage and recomputation a plan runs with.

For each micro-batch count (fewest first) the MetaGraph as one micro-batch runs it is allocated, scheduled and
placed on every rung of ``memory_rungs`` (ZeRO stage, the recomputation placement assumes, device memory
overcommitted or not); each rung that places gets the cheapest recomputation per slice that fits
(planner/memory_options.py), and the planner's estimate (planner/objective.py) picks the fastest candidate.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatron_spindle.estimator import AnalyticCostModel, MemoryModel, estimate_curves, valid_configs
from megatron_spindle.estimator.profiled import planning_cost_model, profile_points
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaGraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan.layout import micro_batch_choices, micro_batch_metaop, whole_batch_tasks
from megatron_spindle.plan.memory import SliceMemory, ZeroSharded, slice_memory
from megatron_spindle.plan.order import default_order, early_backward_order, slice_order
from megatron_spindle.plan.schema import ExecutionSettings, PlanError, Recompute, execution_choices
from megatron_spindle.planner.allocator import allocate_level
from megatron_spindle.planner.assemble import assemble_plan, slice_id
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

if TYPE_CHECKING:
    from megatron_spindle.planner.pipeline import PlannerConfig

MEMORY_SHARES = (0.5, 0.25, 0.125)
MICRO_BATCH_TRIES = 2  # micro-batch counts tried beyond the first that fits (auto)
# device memory placement may plan with (times the device's) before recomputation takes the excess off: the more,
# the less memory limits the configurations and their balance, the more may have to be recomputed
OVERCOMMITS = (2.0, 3.0)
# the share of a real device a chain's parameter state may take where placement overcommits memory: the rest
# holds what recomputation cannot free (each layer's input, the recomputed layer's working set)
PARAM_SHARE = MEMORY_SHARES[0]


def _allocate_schedule_place(metagraph, workload, cluster, config, profile, cost_model, memory_model, say,
                             shares: tuple[float, ...] = MEMORY_SHARES, curve_cache: dict | None = None,
                             real: ClusterSpec | None = None):
    """Curves, allocation, waves and placement, memory-aware: the paper's allocator ignores memory, and a heavy
    MetaOp on too few devices cannot hold its activations. Each MetaOp's configurations are first limited to
    those whose whole chain fits ``shares[0]`` of a device (half by default); when placement still runs out of
    memory the next share is tried and everything is replanned. ``real``: the devices the plan will run on,
    where ``cluster`` overcommits their memory (recomputation takes the excess activations off afterwards); no
    recomputation frees parameter state, so a chain's must also fit PARAM_SHARE of a real device
    (``param_allowed_configs``), whatever share the attempt gives the whole chain on ``cluster``.
    Also returns whether memory bound the plan (a configuration left out would have run a slice faster, or a
    share replanned), and whether it may have shaped the allocation (bound, or a slice sits on the fewest
    devices its limited curve allows where more memory allows fewer): where it did neither, more memory would
    plan the same."""
    N = cluster.num_devices
    chains = chain_memories(metagraph, workload, cluster, memory_model)
    needs = per_config(chains, held_bytes)
    memory_allowed_configs(metagraph, needs, cluster, 1.0)  # a MetaOp that fits nowhere is named first
    total = sum(min(b * c[0] * c[1] for c, b in need.items()) for need in needs.values())
    if total > N * cluster.gpu.memory_bytes:
        # Even spread perfectly (and with weights stored per MetaOp), the chains need more than the cluster has.
        raise PlanError(f"the plan does not fit device memory: the MetaOps need at least {total / 2**30:.0f} GiB "
                        f"in all, the {N} devices have {N * cluster.gpu.memory_bytes / 2**30:.0f} GiB")
    param_needs = per_config(chains, param_state_bytes) \
        if real is not None and real.gpu.memory_bytes < cluster.gpu.memory_bytes else None
    for attempt, share in enumerate(shares):
        allowed = memory_allowed_configs(metagraph, needs, cluster, share)
        if param_needs is not None:
            allowed = param_allowed_configs(allowed, param_needs, PARAM_SHARE * real.gpu.memory_bytes)
        allowed = cap_slice_devices(allowed, config.max_slice_devices)
        curves = estimate_curves(metagraph, workload, cluster, cost_model=cost_model, profile=profile,
                                 allowed=lambda m, tp, dp, fits=allowed: (tp, dp) in fits[m.id], cache=curve_cache,
                                 sync_sharers=config.curve_sync_sharers())
        level_allocs = [
            allocate_level(k, [metagraph.metaops[m] for m in level], curves, N, mode=config.inverse)
            for k, level in enumerate(metagraph.levels)
        ]
        waves = schedule_levels(level_allocs, metagraph, curves, N)
        try:
            placed = place(waves, metagraph, workload, cluster, cost_model, memory_model,
                           strategy=config.placement)
            binds, narrows = _restriction_effect(placed, curves, needs, allowed, metagraph, workload, cluster, config,
                                                 profile, cost_model, curve_cache)
            return curves, level_allocs, placed, attempt > 0 or binds, attempt > 0 or binds or narrows
        except PlacementError as e:
            if attempt == len(shares) - 1:
                raise PlanError(f"the plan does not fit device memory: {e}") from e
            say(f"placement out of memory; replanning with at most {100 * shares[attempt + 1]:.0f}% "
                f"of a device per MetaOp")
    raise AssertionError("unreachable")


def _restriction_effect(placed, curves, needs, allowed, metagraph, workload, cluster, config, profile, cost_model,
                        curve_cache: dict | None = None) -> tuple[bool, bool]:
    """(binds, narrows): whether a configuration left out for memory would have run some slice faster on its
    device count, and whether some slice sits on the fewest devices its limited curve allows where the curve
    without the limit goes lower (the allocator may have wanted fewer). One left out only where the plan never
    goes (a large MetaOp on 1 of 1024 devices) does neither. The search goes on past a rung that binds; one that
    only narrows it records (plan selection then also plans with memory unlimited: megatron_spindle/autoplan.py)."""
    every = cap_slice_devices({m: set(n) for m, n in needs.items()}, config.max_slice_devices)
    if allowed == every:  # memory left no configuration out (``allowed``: what the curves were limited to)
        return False, False
    free = estimate_curves(metagraph, workload, cluster, cost_model=cost_model, profile=profile,
                           allowed=lambda m, tp, dp: (tp, dp) in every[m.id], cache=curve_cache,
                           sync_sharers=config.curve_sync_sharers())
    slices = [s for w in placed for s in w.slices]
    return (any(free[s.metaop].time(s.n) < curves[s.metaop].time(s.n) * (1 - 1e-9) for s in slices),
            any(s.n == curves[s.metaop].valid_ns[0] > free[s.metaop].valid_ns[0] for s in slices))


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


def run_settings(config: PlannerConfig) -> dict:
    """The plan settings the user's flags fix, whatever the memory options: ``--overlap-param-gather`` and the
    execution choices (plan/schema.py ``EXECUTION_CHOICES``)."""
    return {"overlap_param_gather": config.overlap_param_gather, **execution_choices(config)}


def recompute_policy(config: PlannerConfig) -> RecomputePolicy:
    """The recomputation the planner may choose: the Megatron-style flags as given, else --spindle-recompute."""
    if config.recompute_granularity == "selective":
        return RecomputePolicy(Recompute("selective", modules=config.recompute_modules))
    if config.recompute_granularity == "full":
        if (config.recompute_method or "uniform") == "uniform":
            return RecomputePolicy(Recompute("full", config.recompute_num_layers or 1, "uniform"))
        return RecomputePolicy(Recompute("full", config.recompute_num_layers))
    if config.recompute == "auto":
        return RecomputePolicy()
    return RecomputePolicy(Recompute(config.recompute))


def memory_rungs(config: PlannerConfig, policy: RecomputePolicy) -> list[tuple[int, Recompute, float]]:
    """(ZeRO stage, recomputation placement plans with, device memory placement may use / the device's) in
    order, cheapest first: sharding the optimizer state (ZeRO-1, the distributed optimizer) costs nothing in
    time (its reduce-scatter + all-gather moves what an all-reduce moves), nor do the gradients (ZeRO-2) with one
    micro-batch, while with m they are reduce-scattered after every micro-batch's backward; sharding the weights
    too (ZeRO-3) all-gathers each layer's weights before its forward and its backward, mostly behind the previous
    layer's compute (estimator/slice_time.py); recomputation costs a
    forward pass per layer, so placement first plans without it; then, where recomputation may be chosen per
    slice, without it on devices OVERCOMMITS times as large (placement balances the real activations,
    recomputation takes off what does not fit), then with every layer at its leanest (``policy.lean()``); the
    slices get the cheapest choice that fits afterwards. With recomputation, sharding is free, so an unsharded
    recomputing rung is never worth trying. ``--spindle-distributed-optimizer on`` is Megatron's: ZeRO-1."""
    stages = config.zero_stages()
    if policy.fixed is not None:
        assumed = [(policy.fixed, 1.0)]
    else:
        assumed = [(Recompute(), 1.0)] + [(Recompute(), o) for o in OVERCOMMITS] + [(policy.lean(), 1.0)]
    rungs = [(z, rc, over) for rc, over in assumed for z in stages]
    recomputing = [r for r in rungs if r[1].mode != "none" or r[2] > 1]
    return [r for r in rungs if not (r in recomputing and r[0] == 0 and (1, r[1], r[2]) in rungs)]


def micro_batch_candidates(config: PlannerConfig, metagraph: MetaGraph) -> list[int]:
    """Micro-batch counts to try, smallest first: each divides every MetaOp's batch (auto: the divisors of
    their gcd, thinned to roughly doubling steps, the gcd itself last; 1 alone where a task's loss couples its
    batch, plan/layout.py micro_batch_choices)."""
    common = math.gcd(*{m.batch for m in metagraph.metaops.values()})
    if config.micro_batches != "auto":
        n = int(config.micro_batches)
        if common % n:
            batches = sorted({m.batch for m in metagraph.metaops.values()})
            raise PlanError(f"--spindle-micro-batches {n} does not divide every task's batch {batches}")
    divisors = []
    for d in range(1, common + 1):
        if common % d == 0 and (not divisors or d >= 2 * divisors[-1] or d == common):
            divisors.append(d)
    return micro_batch_choices(config.micro_batches, metagraph.metaops.values(), divisors)


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
    ladder_cache: dict = field(default_factory=dict)  # the search's: its candidates share the cost model and policy
    # what the runtime runs besides the memory options (``run_settings``): the plan records it, so the estimate
    # the search decides on charges it too
    run: dict = field(default_factory=dict)
    # whether memory limited the search that chose this candidate (``search_memory_options``): where it did not,
    # and the plan has no memory option, more memory would plan the same
    memory_limited: bool = False

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
        numbers = ZeroSharded(self.memory_model, self.memory_model.zero_stage,
                              tp_sharded=self.memory_model.tp_sharded_grads)
        waves = [w.slices for w in self.placed]
        for order in orders:
            steps = slice_order(tasks, ExecutionSettings(order=order))
            try:
                self.choices = choose_recompute(waves, self.metagraph.metaops, numbers, self.cost_model,
                                                cluster.gpu.memory_bytes, steps, self.policy, cluster.num_devices,
                                                cluster.gpu.name, [w.duration for w in self.placed],
                                                self.ladder_cache)
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
        fixed = self.policy.fixed  # as given, unless MLP recomputation was left out for some modules
        narrowed = fixed is not None and any(rc.recompute_modules != fixed.recompute_modules for rc in distinct)
        if (fixed is not None and not narrowed) or len(distinct) <= 1:
            plan_wide, per_slice = (self.policy.fixed or next(iter(distinct), Recompute())), {}
        else:
            plan_wide = Recompute()
            per_slice = {slice_id(wi, self.placed[wi].slices[si].metaop): rc
                         for (wi, si), rc in layer.items() if rc.mode != "none"}
        return ExecutionSettings(recompute=plan_wide, slice_recompute=per_slice,
                                 zero_stage=self.memory_model.zero_stage, micro_batches=self.micro_batches,
                                 order=self.order, **self.run)

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for rc in self.choices.values():
            counts[rc.describe()] = counts.get(rc.describe(), 0) + 1
        recompute = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()) if k != "none") or "none"
        return (f"{self.micro_batches} micro-batch(es), ZeRO-{self.memory_model.zero_stage}, recomputation: "
                f"{recompute}{', early backward' if self.order is not None else ''}")


def search_memory_options(metagraph: MetaGraph, workload: Workload, cluster: ClusterSpec, config: PlannerConfig,
                          profile, say, placements: dict | None = None) -> _Candidate:
    """The memory options of the plan (``profile``: a ``Profile``, whose measurements then time the candidates,
    or curve points alone): for each micro-batch count (fewest first), every rung of
    ``memory_rungs`` that places and fits is a candidate, and the one the planner's estimate times fastest
    (planner/objective.py) wins. The first rung that fits is not always the fastest: placement under the cap
    limits the configurations and their balance, so a placement on overcommitted devices with a little
    recomputation (or none: the real activations may fit after all) can beat it, and a few more micro-batches
    can beat recomputation. A rung that fits with memory binding nothing (no recomputation, no configuration
    left out) ends its count, and such a count ends the search, as do a count that fits without recomputation
    and is no faster than the best before it (more micro-batches only cost efficiency from there) and
    MICRO_BATCH_TRIES more counts after the first that fits. The winner's ``memory_limited`` says whether memory
    limited the search: a rung failed, or memory bound or narrowed a rung's placement (``_restriction_effect``);
    what the winner's settings show (recomputation, micro-batches, ZeRO) it leaves to them."""
    policy = recompute_policy(config)
    limited = False  # some rung failed for memory, or memory bound or narrowed its placement
    counts = micro_batch_candidates(config, metagraph)
    rungs = memory_rungs(config, policy)
    best: _Candidate | None = None
    error: Exception | None = None
    first_fit = None  # index of the first count that fits
    cost_model = planning_cost_model(workload, cluster, profile, config)  # shared by the rungs
    curve_cache: dict = {}
    ladder_cache: dict = {}  # recomputation ladders, shared by the candidates (one cost model and policy)
    points = profile_points(profile)

    def faster(a: _Candidate, b: _Candidate | None) -> bool:
        return b is None or a.estimate(workload, cluster, metagraph) < b.estimate(workload, cluster, metagraph)

    for i, m in enumerate(counts):
        if first_fit is not None and i - first_fit > MICRO_BATCH_TRIES:
            break
        micro = micro_metagraph(metagraph, m)
        found, free = None, False
        # per ZeRO stage, the least overcommit that placed with memory binding nothing: more memory would place the
        # same at that stage and at those that shard more, not at one that shards less (it holds more)
        unbound: dict[int, float] = {}
        # (assumed, over) where ZeRO-1 or 2 placed with memory binding nothing, recomputing nothing
        roomy_sharded = set()
        for stage, assumed, over in rungs:
            if assumed.mode == "none" and over > min((o for z, o in unbound.items() if z <= stage), default=math.inf):
                continue  # more memory would place the same
            if stage == 0 and i > 0 and config.distributed_optimizer == "auto":
                continue  # memory bound the first count: sharding the optimizer state costs no time
            if stage >= 2 and (assumed, over) in roomy_sharded:
                continue  # sharding the gradients (or the weights) too would place the same, no faster
            key = (m, stage, assumed, over, config.inverse, config.placement, config.max_slice_devices,
                   config.curve_sync_sharers())
            if placements is None or key not in placements:
                try:
                    placed = _place_rung(micro, workload, cluster, config, points if m == 1 else None, stage,
                                         assumed, over, say, cost_model, curve_cache)
                except PlanError as e:
                    placed = e
                if placements is not None:
                    placements[key] = placed
            placed = placements[key] if placements is not None else placed
            if isinstance(placed, PlanError):
                error, limited = placed, True
                continue
            rung_cost_model, placed_mm, roomy, curves, allocs, placed, bound, narrowed = placed
            cand = _Candidate(m, micro, rung_cost_model,
                              MemoryModel(workload, cluster, rung_cost_model, zero_stage=stage),
                              placed_mm, roomy, policy, curves, allocs, placed, ladder_cache=ladder_cache,
                              run=run_settings(config))
            limited = limited or narrowed
            if not bound and assumed.mode == "none":
                unbound[stage] = min(unbound.get(stage, math.inf), over)
            if not cand.choose(cluster, config):
                error, limited = cand.error, True
                continue
            if stage in (1, 2) and not bound and not cand.recomputes:
                roomy_sharded.add((assumed, over))
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
    whole = whole_batch_tasks(config.micro_batches, metagraph.metaops.values())
    if best is None:
        m = counts[-1]
        raise PlanError(f"the plan does not fit device memory even with {m} micro-batch(es) (batches "
                        f"{sorted({op.batch // m for op in metagraph.metaops.values()})} per micro-batch), "
                        f"{policy.lean().describe()} recomputation and ZeRO-{max(r[0] for r in rungs)}: {error}"
                        + (f"; --spindle-micro-batches auto splits no batch of a contrastive loss (tasks "
                           f"{', '.join(whole)}: micro-batches would shrink its negatives): give "
                           f"--spindle-micro-batches N to split them" if whole else ""))
    if whole and best.recomputes:
        say(f"recomputing for memory where micro-batches might cost less: --spindle-micro-batches auto keeps the "
            f"batches of contrastive tasks {', '.join(whole)} whole (split, each loss would see fewer negatives); "
            f"give --spindle-micro-batches N to plan with them")
    best.memory_limited = limited
    return best


def fastest_zero_stage(cand: _Candidate, workload: Workload, cluster: ClusterSpec, metagraph: MetaGraph,
                       config: PlannerConfig) -> _Candidate:
    """``cand``'s waves at the ZeRO stage (of those ``config`` allows) the planner's estimate times fastest, each
    with the cheapest recomputation that fits: the search chose the stage on the waves as first placed, and the
    CP-SAT model, settled tails or islands change them, so a near-tie there can turn (OFASys-7 / 16: ZeRO-3 ahead
    by 2 ms on the greedy waves, 38 ms behind ZeRO-2 on the refined ones). ``cand`` itself on a tie. Only among
    the sharded stages, where the search sharded: unsharded, it stays so (auto shards only where memory needs it)."""
    if cand.memory_model.zero_stage == 0:
        return cand
    options = [cand]
    for stage in config.zero_stages():
        if stage in (0, cand.memory_model.zero_stage):
            continue
        other = dataclasses.replace(cand, memory_model=MemoryModel(workload, cluster, cand.cost_model,
                                                                   zero_stage=stage))
        option = other.with_waves(cand.placed, cluster, config)
        if option is not None:
            options.append(option)
    return min(options, key=lambda o: o.estimate(workload, cluster, metagraph))


def _place_rung(micro, workload, cluster, config, profile, stage, assumed, over, say, cost_model, curve_cache):
    """One rung's placement: (cost model, memory model placed with, cluster placed on, curves, allocations,
    placed waves, whether memory bound it, whether it narrowed it). ``cost_model`` and ``curve_cache``: the
    search's, shared by its rungs (the cost model memoises per MetaOp shape, so micro-batch counts do not mix)."""
    placed_mm = MemoryModel(workload, cluster, cost_model, recompute=assumed, zero_stage=stage)
    # planning with every layer at its leanest, a chain may take the whole device: what it does not need is given
    # back to it slice by slice afterwards
    shares = (1.0,) + MEMORY_SHARES if assumed.mode != "none" else MEMORY_SHARES
    roomy = cluster if over == 1 else cluster.with_memory_factor(over)
    placed = _allocate_schedule_place(micro, workload, roomy, config, profile, cost_model, placed_mm, say, shares,
                                      curve_cache, cluster)
    return (cost_model, placed_mm, roomy) + placed


def _chain_memory(metaop, tp: int, dp: int, memory_model: MemoryModel) -> SliceMemory:
    """The memory of a MetaOp's whole chain (every layer) on one set of tp x dp devices."""
    return slice_memory(metaop, ScheduledSlice(metaop.id, tp * dp, tp, dp, 0, metaop.num_layers, 0.0), memory_model)


def param_state_bytes(mem: SliceMemory) -> float:
    """Bytes per device of a chain's parameter state (under its memory model's ZeRO stage)."""
    return sum(mem.units.values())


def held_bytes(mem: SliceMemory) -> float:
    """Bytes per device of a chain's memory: parameter state plus activations held for backward."""
    return param_state_bytes(mem) + mem.activations


def chain_memories(metagraph: MetaGraph, workload: Workload, cluster: ClusterSpec,
                   memory_model: MemoryModel) -> dict[str, dict[tuple[int, int], SliceMemory]]:
    """Per MetaOp, its whole chain's memory at each valid (tp, dp)."""
    return {mid: {c: _chain_memory(m, *c, memory_model) for c in valid_configs(m, workload, cluster)}
            for mid, m in metagraph.metaops.items()}


def per_config(chains: dict[str, dict[tuple[int, int], SliceMemory]],
               measure: Callable[[SliceMemory], float]) -> dict[str, dict[tuple[int, int], float]]:
    """``measure`` (``held_bytes``, ``param_state_bytes``) of every chain of ``chain_memories``."""
    return {mid: {c: measure(mem) for c, mem in by_config.items()} for mid, by_config in chains.items()}


def memory_needs(metagraph: MetaGraph, workload: Workload, cluster: ClusterSpec,
                 memory_model: MemoryModel) -> dict[str, dict[tuple[int, int], float]]:
    """Per MetaOp, the footprint of each valid (tp, dp)."""
    return per_config(chain_memories(metagraph, workload, cluster, memory_model), held_bytes)


def param_allowed_configs(allowed: dict[str, set[tuple[int, int]]],
                          param_needs: dict[str, dict[tuple[int, int], float]],
                          limit: float) -> dict[str, set[tuple[int, int]]]:
    """The ``allowed`` configurations whose parameter state (``param_needs``) is at most ``limit`` bytes, per
    MetaOp; where none is, those of its least parameter state (a MetaOp's configurations are never all left
    out: recomputation and placement then decide whether the plan fits)."""
    out = {}
    for mid, configs in allowed.items():
        need = param_needs[mid]
        least = min(need[c] for c in configs)
        out[mid] = {c for c in configs if need[c] <= max(limit, least)}
    return out


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
