"""The one planning entry point: workload + cluster -> Plan.

contract (graph) -> scaling curves (estimator) -> per-level allocation (bisection + bi-point) -> wavefront
waves -> placement -> [CP-SAT refinement] -> assembled, validated Plan.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from megatron_spindle.estimator import AnalyticCostModel, MemoryModel, estimate_curves
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaGraph, build_metagraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.planner.allocator import allocate_level
from megatron_spindle.planner.assemble import assemble_plan
from megatron_spindle.planner.placement import place
from megatron_spindle.planner.plan import Plan
from megatron_spindle.planner.schedule import LevelAllocation, ScheduledWave
from megatron_spindle.planner.validate import validate_plan
from megatron_spindle.planner.wavefront import schedule_levels

PLANNERS = ("wavefront", "cpsat")
INVERSES = ("rate", "time")
PLACEMENTS = ("spindle", "sequential")


@dataclass
class PlannerConfig:
    planner: str = "cpsat"  # wavefront: the paper's greedy path; cpsat: refined by OR-Tools CP-SAT
    inverse: str = "rate"  # T^-1 interpolation: linear in rate 1/T (consistent) or in T (paper eq. 11)
    placement: str = "spindle"  # spindle heuristics or the sequential ablation
    solver_time_limit: float = 10.0
    solver_workers: int = 2
    cross_level_overlap: bool = False

    def __post_init__(self):
        for name, value, allowed in (("planner", self.planner, PLANNERS), ("inverse", self.inverse, INVERSES),
                                     ("placement", self.placement, PLACEMENTS)):
            if value not in allowed:
                raise ValueError(f"unknown {name} '{value}' (expected one of {', '.join(allowed)})")
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
    cost_model = AnalyticCostModel(workload, cluster)
    memory_model = MemoryModel(workload, cluster, cost_model)
    curves = estimate_curves(metagraph, workload, cluster, cost_model=cost_model, profile=profile)
    say(f"scaling curves: {len(curves)} ({sum(c.source == 'profiled' for c in curves.values())} profiled)")
    lap("estimate")
    N = cluster.num_devices
    level_allocs = [
        allocate_level(k, [metagraph.metaops[m] for m in level], curves, N, mode=config.inverse)
        for k, level in enumerate(metagraph.levels)
    ]
    lap("allocate")
    waves = schedule_levels(level_allocs, metagraph, curves, N)
    say(f"wavefront: {len(waves)} waves")
    lap("schedule")
    placed = place(waves, metagraph, workload, cluster, cost_model, memory_model, strategy=config.placement)
    lap("place")
    settings: dict[str, Any] = {"planner": "wavefront", "requested": asdict(config)}
    solver = None
    final = placed
    if config.planner == "cpsat":
        from megatron_spindle.planner.cpsat import solve_cpsat

        say(f"cp-sat: refining the greedy plan (limit {config.solver_time_limit:g} s, "
            f"{config.solver_workers} workers)")
        solver = solve_cpsat(metagraph, workload, cluster, curves, placed, cost_model, memory_model,
                             time_limit=config.solver_time_limit, workers=config.solver_workers,
                             cross_level_overlap=config.cross_level_overlap)
        final = solver.waves
        settings["planner"] = "cpsat"
        settings["solver"] = solver.summary()
        lap("cpsat")
    plan = assemble_plan(workload, cluster, metagraph, final, cost_model, memory_model, settings,
                         level_allocs=level_allocs, curves=curves)
    validate_plan(plan, workload, cluster, metagraph)
    lap("assemble")
    plan.planner["planning_seconds"] = sum(timings.values())
    return PlanningResult(plan, metagraph, curves, level_allocs, placed, cost_model, memory_model, timings, solver)
