"""The one planning entry point: workload + cluster -> Plan.

contract (graph) -> scaling curves (estimator) -> per-level allocation (bisection + bi-point) -> wavefront
waves -> placement -> [CP-SAT refinement] -> assembled, validated Plan.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from megatron_spindle.estimator import AnalyticCostModel, MemoryModel, estimate_curves, valid_configs
from megatron_spindle.estimator.cost_model import CostModelConfig
from megatron_spindle.flags import check_choices, flag
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaGraph, build_metagraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan.memory import slice_memory
from megatron_spindle.plan.schema import ExecutionSettings, Plan, PlanError, Recompute
from megatron_spindle.plan.validate import validate_plan
from megatron_spindle.planner.allocator import allocate_level
from megatron_spindle.planner.assemble import assemble_plan
from megatron_spindle.planner.placement import PlacementError, place
from megatron_spindle.planner.schedule import LevelAllocation, ScheduledSlice, ScheduledWave
from megatron_spindle.planner.wavefront import schedule_levels

PLANNERS = ("wavefront", "cpsat")
MEMORY_SHARES = (0.5, 0.25, 0.125)
INVERSES = ("rate", "time")
PLACEMENTS = ("spindle", "sequential")
RECOMPUTE = ("auto", "none", "full")
DISTRIBUTED_OPTIMIZER = ("auto", "off", "on")


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
        "Full activation recomputation of transformer layers: auto plans without it and switches it on only "
        "when the plan does not fit device memory otherwise.", choices=RECOMPUTE))
    distributed_optimizer: str = field(default="auto", metadata=flag(
        "Shard each unit's optimizer state over the data-parallel ranks that run it (ZeRO-1, like "
        "--use-distributed-optimizer): auto switches it on only when memory requires it.",
        choices=DISTRIBUTED_OPTIMIZER))

    def __post_init__(self):
        check_choices(self)
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
                  profile: dict | None = None, progress: Callable[[str], None] | None = None) -> PlanningResult:
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
    ladder = memory_ladder(config)
    for i, (recompute, sharded) in enumerate(ladder):
        cost_model = AnalyticCostModel(workload, cluster, config=CostModelConfig(recompute=recompute))
        memory_model = MemoryModel(workload, cluster, cost_model, distributed_optimizer=sharded)
        try:
            curves, level_allocs, placed = _allocate_schedule_place(metagraph, workload, cluster, config, profile,
                                                                    cost_model, memory_model, say)
            break
        except PlanError:
            if i == len(ladder) - 1:
                raise
            nxt = ladder[i + 1]
            say("the plan does not fit device memory; replanning with "
                + " and ".join(what for what, on in (("the distributed optimizer", nxt[1]),
                                                    ("full activation recomputation", nxt[0])) if on))
    say(f"scaling curves: {len(curves)} ({sum(c.source == 'profiled' for c in curves.values())} profiled)")
    say(f"wavefront: {len(placed)} waves")
    lap("estimate+allocate+schedule+place")
    settings = ExecutionSettings(recompute=Recompute("full" if cost_model.config.recompute else "none"),
                                 zero_stage=memory_model.zero_stage)
    info: dict[str, Any] = {"planner": "wavefront", "requested": asdict(config)}
    solver = None
    final = placed
    if config.planner == "cpsat":
        from megatron_spindle.planner.cpsat import solve_cpsat

        say(f"cp-sat: refining the greedy plan (limit {config.solver_time_limit:g} s, "
            f"{config.solver_workers} workers)")
        solver = solve_cpsat(metagraph, workload, cluster, curves, placed, cost_model, memory_model,
                             time_limit=config.solver_time_limit, workers=config.solver_workers,
                             cross_level_overlap=config.cross_level_overlap, level_allocs=level_allocs)
        final = solver.waves
        info["planner"] = "cpsat"
        info["solver"] = solver.summary()
        lap("cpsat")
    plan = assemble_plan(workload, cluster, metagraph, final, cost_model, memory_model, info,
                         level_allocs=level_allocs, curves=curves, settings=settings)
    validate_plan(plan, workload, cluster, metagraph)
    lap("assemble")
    plan.planner["planning_seconds"] = sum(timings.values())
    return PlanningResult(plan, metagraph, curves, level_allocs, placed, cost_model, memory_model, timings, solver)


def _allocate_schedule_place(metagraph, workload, cluster, config, profile, cost_model, memory_model, say):
    """Curves, allocation, waves and placement, memory-aware: the paper's allocator ignores memory, and a heavy
    MetaOp on too few devices cannot hold its activations. Each MetaOp's configurations are first limited to
    those whose whole chain fits half a device; when placement still runs out of memory the share is halved
    and everything is replanned."""
    N = cluster.num_devices
    needs = memory_needs(metagraph, workload, cluster, memory_model)
    memory_allowed_configs(metagraph, needs, cluster, 1.0)  # a MetaOp that fits nowhere is named first
    total = sum(min(b * c[0] * c[1] for c, b in need.items()) for need in needs.values())
    if total > N * cluster.gpu.memory_bytes:
        # Even spread perfectly (and with weights stored per MetaOp), the chains need more than the cluster has.
        raise PlanError(f"the plan does not fit device memory: the MetaOps need at least {total / 2**30:.0f} GiB "
                        f"in all, the {N} devices have {N * cluster.gpu.memory_bytes / 2**30:.0f} GiB")
    for attempt, share in enumerate(MEMORY_SHARES):
        allowed = memory_allowed_configs(metagraph, needs, cluster, share)
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
            return curves, level_allocs, placed
        except PlacementError as e:
            if attempt == len(MEMORY_SHARES) - 1:
                raise PlanError(f"the plan does not fit device memory: {e}") from e
            say(f"placement out of memory; replanning with at most {100 * MEMORY_SHARES[attempt + 1]:.0f}% "
                f"of a device per MetaOp")
    raise AssertionError("unreachable")


def memory_ladder(config: PlannerConfig) -> list[tuple[bool, bool]]:
    """(recompute, distributed optimizer) settings to try in order, cheapest first: sharding the optimizer state
    costs nothing in time (its reduce-scatter + all-gather moves what an all-reduce moves); recomputation costs
    a forward pass per layer."""
    recompute = {"none": [False], "full": [True], "auto": [False, True]}[config.recompute]
    sharded = {"off": [False], "on": [True], "auto": [False, True]}[config.distributed_optimizer]
    ladder = sorted({(r, s) for r in recompute for s in sharded})
    # With recomputation on, sharding is free, so an unsharded recomputing rung is never worth trying.
    return [rung for rung in ladder if not (rung[0] and not rung[1] and (True, True) in ladder)]


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
                f"{least / 2**30:.1f} GiB per device even at its best configuration (tp {tp} x dp {dp} on "
                f"{tp * dp} devices), the device has {capacity / 2**30:.1f} GiB; no allocation of this batch fits "
                f"(use more devices, a batch with more divisors, or a smaller batch)")
        allowed[mid] = fits
    return allowed
