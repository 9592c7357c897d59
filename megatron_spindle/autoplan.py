"""Plan selection by simulation: the planner proposes a few plans, the simulator times each, the fastest wins.

The planner (megatron_spindle/planner) decides on its own estimate (waves of T(n), plus its estimate of the
transfers and of the gradient sync: planner/objective.py); the simulator (megatron_spindle/simulator) times a
plan with the full execution model (dataflow, link contention, bucketed sync overlapped with the backward,
network sharing). The planner never imports the simulator, so the selection lives here, above both, and every
entry point (tools/plan.py, pretrain_multitask.py, tools/compare.py, the benchmarks) calls ``autoplan``.

Candidates (``candidate_configs``; with ``--spindle-select none`` only the configured one):

- the configured planner (CP-SAT by default) and, when that is CP-SAT, the greedy wavefront plan, each with
  its light MetaLevels (front ends, heads, losses) laid out like the slices they exchange activations with
  (planner/light_levels.py) where that costs at most 1 % of the waves; and each of these planning runs (here,
  on sync-aware curves, with the early backward, with memory unlimited) also with each heavy level's last waves
  settled into one (``+tails``, planner/tails.py) where the planner's estimate of the placed plan is faster:
  its light levels pinned can still lose to the unsettled plan's, so the simulator decides;
- every planning run here on several nodes with the islands of its placement chosen for the whole schedule at
  once (planner/islands.py), where the planner's estimate of the placed plan is faster: a choice wave by wave
  cannot see that a slice's island decides where its MetaOp's next slices can go; and then also on its greedy
  placement's islands (``+greedy-islands``): the variants below (light levels pinned, ZeRO, buckets) can turn
  the estimate's preference around, so the simulator decides;
- on several nodes, the greedy plan with every slice inside one node (``max_slice_devices``): its collectives
  and hand-offs stay on NVLink, at some cost in balance;
- on several nodes, the configured planner with sync-aware curves (``--spindle-sync-aware``): each
  configuration's time carries the gradient sync it cannot hide (estimator/estimate.py ``exposed_sync_seconds``),
  so a MetaOp whose weights are large for its compute takes more tensor parallelism or fewer devices; with a
  shared MetaOp's sync split among the MetaOps that hold its weights, and, where the configured plan leaves a
  sizeable share of its device time in that sync, once more split among the MetaLevels that do;
- the configured planner's plans (with and without sync-aware curves) with the early backward, where they need
  memory options;
- on several nodes, the tasks partitioned over groups of whole nodes, each group's tasks planned by the
  wavefront planner on its nodes (planner/node_groups.py; its level tails settled where the group's estimate
  prefers it), one candidate per number of groups: activations
  never cross a node, only the shared towers' gradient sync does; with the CP-SAT planner, the fastest of
  them again with each group refined by CP-SAT;
- each of them with its light levels pinned to their partners' devices (planner/light_levels.py
  ``pinned_plan``): front ends, heads and losses run data-parallel on the devices of the slice they exchange
  activations with, so those hand-offs are local copies instead of transfers across devices and nodes, while
  the light waves multiply and the light units' parameter device groups follow the towers';
- each of them with the distributed optimizer (ZeRO-1) as well when it plans without: reduce-scatter in the
  backward and a weight all-gather after the step instead of the all-reduce, and less memory;
- where memory bound some plan above (a memory option, or memory shaped its planner's search), the configured
  and the greedy planner's plans made with memory unlimited (16x each device's, no memory option; each also on
  sync-aware curves), the node groups planned so too, each
  also with its light levels pinned, and then given ZeRO-3, ZeRO-2 or ZeRO-1 and
  each layer slice's cheapest recomputation that fits the real devices: the memory search limits every
  MetaOp's configurations before it schedules, and a plan that keeps the fastest configurations can pay less in
  recomputation than the limited ones cost; and there too the tasks in segments that run one after another
  (2 to 4 segments of balanced work, planner/task_segments.py), each segment's tasks planned together with memory
  unlimited and the plan fitted likewise: a device holds one segment's activations at a time, so whole batches
  and the fastest configurations can fit where every task at once recomputes (with the CP-SAT planner, the
  fastest partition again with each segment refined by CP-SAT);
- where the user left ``--ddp-bucket-size`` to the planner, the candidates within ``BUCKET_SLACK`` of the
  fastest also with gradient buckets of 20M and 10M parameters (``+buckets20M``, ``+buckets10M``) instead of
  megatron-core's default (40M, or 1M per member of larger groups): smaller buckets start reducing earlier in the
  backward and leave less of it exposed after, at one collective's latency each, so the simulator decides;
- the fallback ``task-sequential``: Spindle's runtime with each task on the whole cluster in turn (the
  Spindle-Seq plan of paper appendix H), so that the plan a user gets is never slower than that; reports name
  the cells where it wins (the wavefront planner then had nothing to gain).

The selected plan's ``predicted["iteration_time"]`` is the simulator's time (and ``predicted["simulated_*"]``
its breakdown); ``predicted["planner_estimate"]`` keeps the planner's own estimate, and
``plan.planner["selection"]`` lists every candidate with both.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_spindle.estimator.estimate import SHARER_COUNTS, weight_sharers
from megatron_spindle.estimator.profiled import ProfiledCostModel
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.workload import Workload
from megatron_spindle.parallel import parallel_map, pool_size
from megatron_spindle.plan.memory import memory_options, plan_memory
from megatron_spindle.plan.schema import Plan, PlanError
from megatron_spindle.plan.validate import validate_plan
from megatron_spindle.planner.light_levels import pinned_plan
from megatron_spindle.planner.node_groups import node_group_partitions, plan_node_groups
from megatron_spindle.planner.objective import estimate_iteration, exposed_sync_share
from megatron_spindle.planner.pipeline import PlannerConfig, PlanningResult, for_cluster, plan_workload
from megatron_spindle.planner.report import shown_candidates
from megatron_spindle.planner.task_segments import plan_task_segments, segment_partitions
from megatron_spindle.simulator import SimResult, simulate

NODE_GROUP_SOLVER_LIMIT = 2.0  # seconds of CP-SAT per node group
# sync-aware curves are tried with each way of counting weight sharers where the configured plan's configurations
# leave this share of its device time in gradient sync they cannot hide behind their backward (once below it)
SYNC_AWARE_MIN_SHARE = 0.1
TIE = 1e-6  # relative difference of simulated times under which candidates are equally fast
# gradient bucket sizes (parameters) plan selection tries besides megatron-core's default, where the user gave no
# --ddp-bucket-size: half and a quarter of its 40M; on the candidates at most BUCKET_SLACK slower than the fastest
BUCKET_SIZES = (20_000_000, 10_000_000)
BUCKET_SLACK = 0.05
# the memory "unlimited" plans are made with (times a device's), as benchmarks/paper_eval.py measures the cost of
# memory: enough that memory binds nothing in any paper cell
UNLIMITED_MEMORY_FACTOR = 16.0
PROGRESS_MIN_SECONDS = 1.0  # a kind of candidate whose planning takes longer is reported as it is added


@dataclass
class Candidate:
    name: str
    result: PlanningResult
    plan: Plan
    sim: SimResult
    planning_seconds: float

    @property
    def fits(self) -> bool:
        return max(self.plan.memory_per_device, default=0.0) <= self.result.memory_model.cluster.gpu.memory_bytes

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "simulated": self.sim.iteration_time,
                "planner_estimate": float(self.plan.predicted.get("planner_estimate", 0.0)),
                "makespan": float(self.plan.predicted.get("makespan", 0.0)), "zero_stage": self.plan.settings.zero_stage,
                "planning_seconds": self.planning_seconds, "fits": self.fits}


@dataclass
class AutoplanResult:
    """The selected plan (``result.plan``), its simulation, and every candidate."""

    result: PlanningResult
    sim: SimResult
    candidates: list[Candidate] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def plan(self) -> Plan:
        return self.result.plan


def selection_config(config: PlannerConfig) -> PlannerConfig:
    """What every planning run of plan selection adds to the configured planner: light levels laid out like their
    neighbours, settled tails beside, and whole-schedule islands unless the config turns them off."""
    return dataclasses.replace(config, light_follow=True, settle_tails=True,
                               whole_schedule_islands=config.whole_schedule_islands is not False)


def candidate_configs(config: PlannerConfig, cluster: ClusterSpec) -> list[tuple[str, PlannerConfig]]:
    """(name, planner config) of every candidate planning run (module docstring)."""
    if config.select == "none":
        return [(config.planner, config)]
    config = selection_config(config)
    out = [(config.planner, config)]
    greedy = dataclasses.replace(config, planner="wavefront")
    if config.planner != "wavefront":
        out.append(("wavefront", greedy))
    if cluster.num_nodes > 1 and config.max_slice_devices == 0:
        out.append(("wavefront-node-bounded", dataclasses.replace(greedy, max_slice_devices=cluster.gpus_per_node)))
    return out


def autoplan(workload: Workload, cluster: ClusterSpec, config: PlannerConfig | None = None,
             profile: dict | None = None, progress: Callable[[str], None] | None = None,
             sim_cost_model=None) -> AutoplanResult:
    """Plan every candidate, simulate each, keep the fastest that fits device memory (module docstring).
    ``profile``: a ``Profile`` (estimator/profile.py: its measurements give the planner's curves and its cost
    model, so the candidates are estimated and simulated on them) or curve points alone (the curves only);
    ``sim_cost_model``: the cost model the simulator times with (default: the planner's)."""
    config = for_cluster(config or PlannerConfig(), cluster, profile)
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    planned: list[tuple[str, PlanningResult, float]] = []
    placements: dict = {}  # the memory search's placements, shared by the candidates (planner/memory_search.py)
    configs = candidate_configs(config, cluster)
    for i, (name, cfg) in enumerate(configs):
        started = time.perf_counter()
        try:
            result = plan_workload(workload, cluster, cfg, profile, say if i == 0 else None, placements)
        except PlanError:  # a variant that cannot fit; the configured planner's error is the one to report
            if i == 0:
                raise
            continue
        planned.append((name, result, time.perf_counter() - started))
    variant_seconds = sum(secs for _, _, secs in planned[1:])  # a settled plan is made in its planner's run
    planned = with_variants(planned)
    _report(say, "the planners' variants", len(planned) - 1, variant_seconds)
    add = functools.partial(_add_candidates, planned, say)
    # (name, config, result, seconds) of the configured planner's runs: planned[0] is its plan (it raises, never skips)
    runs = [(planned[0][0], configs[0][1], planned[0][1], planned[0][2])] if planned else []
    runs += _sync_aware_run(workload, cluster, configs[0][1], profile, planned, placements)
    sync_aware = with_variants([(name, result, secs) for name, _, result, secs in runs[1:]])
    _report(say, "sync-aware curves", len(sync_aware), sum(secs for _, _, _, secs in runs[1:]))
    planned += sync_aware
    add("early backward", lambda: _early_backward_candidates(workload, cluster, profile, runs, placements))
    add("node groups", lambda: _node_group_candidates(workload, cluster, config, profile, planned, sim_cost_model))
    add("light levels pinned", lambda: _pinned_candidates(workload, cluster, config, planned))
    if config.select == "simulate" and not config.fixes_memory_options():
        bound = any(memory_bound(result.plan) for _, result, _ in planned)
        add("memory unlimited, then fitted",
            lambda: _unlimited_candidates(workload, cluster, configs[0][1], profile, planned, sim_cost_model))
        if bound:
            add("task segments", lambda: _task_segment_candidates(
                workload, cluster, unlimited_config(configs[0][1]), configs[0][1], profile, planned[0][1],
                sim_cost_model))
        add("task-sequential", lambda: _task_sequential(workload, cluster, config, planned[0][1], sim_cost_model))
    out = select_fastest(workload, cluster, planned, config, say, sim_cost_model)
    out.seconds = time.perf_counter() - t0
    out.plan.planner["selection_seconds"] = out.seconds
    return out


def with_variants(planned: list[tuple[str, PlanningResult, float]]) -> list[tuple[str, PlanningResult, float]]:
    """Each planned ``(name, result, seconds)`` followed by the variants its planner made beside it: ``name+tails``,
    its plan with level tails settled into one wave (planner/tails.py, ``PlanningResult.settled``), and, of each,
    ``+greedy-islands``, the plan on its placement's own islands where whole-schedule islands replaced them
    (planner/islands.py, ``PlanningResult.greedy_islands``)."""
    out = []
    for name, result, secs in planned:
        for tag, r in [("", result)] + ([("+tails", result.settled)] if result.settled else []):
            out.append((name + tag, r, secs))
            if r.greedy_islands is not None:
                out.append((f"{name}{tag}+greedy-islands", r.greedy_islands, secs))
    return out


def _report(say: Callable[[str], None], what: str, count: int, seconds: float) -> None:
    """A kind of candidate whose planning took ``PROGRESS_MIN_SECONDS`` or more, through ``say``: a long selection
    (minutes on a thousand GPUs) shows where it is."""
    if count and seconds >= PROGRESS_MIN_SECONDS:
        say(f"candidates: {what}: {count} in {seconds:.1f} s")


def _add_candidates(planned: list, say: Callable[[str], None], what: str, make: Callable[[], list]) -> None:
    """``planned += make()``, reported (``_report``) with the time ``make`` took."""
    started = time.perf_counter()
    new = make()
    _report(say, what, len(new), time.perf_counter() - started)
    planned.extend(new)


def _sync_aware_run(workload: Workload, cluster: ClusterSpec, config: PlannerConfig, profile,
                    planned: list[tuple[str, PlanningResult, float]], placements: dict | None = None):
    """The configured planner again on sync-aware curves, as ``[(name, config, result, planning seconds)]``, on
    several nodes. Where the configured plan's own configurations leave at least SYNC_AWARE_MIN_SHARE of its
    device time in gradient sync they cannot hide (planner/objective.py ``exposed_sync_share``): one run per way
    of counting a MetaOp's weight sharers (estimator/estimate.py ``weight_sharers``) that gives other counts,
    since whether sharers sync one copy depends on the placement, which the curves do not know. Below that
    share, one run (sharers by MetaOp): how the little exposed sync is split barely moves the curves, but the
    curves still steer configurations, and with them the waves and the placement, away from sync that the
    simulator charges (clip-7 / 32: 405 -> 371 ms, at an exposed share of 0.9 %). The simulator decides."""
    if config.select == "none" or config.sync_aware != "auto" or cluster.num_nodes < 2 or not planned:
        return []
    name, result, _ = planned[0]
    exposed = exposed_sync_share(result.plan, result.metagraph, result.cost_model) >= SYNC_AWARE_MIN_SHARE
    runs, counted = [], []
    for by in SHARER_COUNTS if exposed else SHARER_COUNTS[:1]:
        counts = weight_sharers(result.metagraph, by)
        if counts in counted:
            continue
        counted.append(counts)
        aware = dataclasses.replace(config, sync_aware="on", sync_sharers=by)
        started = time.perf_counter()
        try:
            aware_result = plan_workload(workload, cluster, aware, profile, placements=placements)
        except PlanError:
            continue
        suffix = "" if by == SHARER_COUNTS[0] else f"-by-{by}"
        runs.append((f"{name}-sync-aware{suffix}", aware, aware_result, time.perf_counter() - started))
    return runs


def _early_backward_candidates(workload: Workload, cluster: ClusterSpec, profile,
                               runs: list[tuple[str, PlannerConfig, PlanningResult, float]],
                               placements: dict | None = None):
    """The configured planner's plans (``runs``: as configured, and sync-aware) again with the early backward,
    where memory binds (the plan recomputes or splits micro-batches) and the planner left the order to it: the
    early backward lowers the peak, so it may need less of either, but whether its interleaving pays only the
    simulator can tell."""
    out = []
    for name, config, result, _ in runs:
        if config.select == "none" or config.early_backward != "auto":
            continue
        st = result.plan.settings
        if st.order is not None or not (result.plan.recomputes() or st.micro_batches > 1):
            continue
        started = time.perf_counter()
        try:
            early = plan_workload(workload, cluster, dataclasses.replace(config, early_backward="on",
                                                                         light_follow=True),
                                  profile, placements=placements)
        except PlanError:
            continue
        out.append((f"{name}+early-backward", early, time.perf_counter() - started))
    return with_variants(out)


def _node_group_candidates(workload: Workload, cluster: ClusterSpec, config: PlannerConfig, profile,
                           planned: list[tuple[str, PlanningResult, float]], sim_cost_model=None):
    """On several nodes, the tasks partitioned over groups of whole nodes, each group's wavefront plan on its
    nodes (planner/node_groups.py): no activation crosses a node, at some cost in balance and with the shared
    towers' gradient sync across the groups; one candidate per partition proposed. With the CP-SAT planner,
    the partition whose greedy plan simulates fastest again with each group refined by CP-SAT (at most
    NODE_GROUP_SOLVER_LIMIT seconds a group)."""
    if config.select == "none" or cluster.num_nodes < 2 or len(workload.tasks) < 2 or not planned:
        return []
    out, partitions = [], []
    group_config = selection_config(config)
    workers = pool_size(config.planning_workers, cluster.num_devices)
    proposed = node_group_partitions(workload, cluster, planned[0][1].metagraph)
    plans = parallel_map(_timed_or_none, [(plan_node_groups, (workload, cluster, p, group_config, profile))
                                          for p in proposed], workers)
    for partition, (result, seconds) in zip(proposed, plans):
        if result is None:  # a PlanError
            continue
        same = sum(len(p) == len(partition) for p in partitions)  # the k-group partitions: k, k-2, k-3, ...
        out.append((f"node-groups-{len(partition)}" + (f"-{same + 1}" if same else ""), result, seconds))
        partitions.append(partition)
    if config.planner != "cpsat" or not out:
        return out
    times = [sim.iteration_time for sim in parallel_map(
        _simulated, [_simulation(r.plan, r, workload, cluster, sim_cost_model) for _, r, _ in out], workers)]
    best = min(range(len(out)), key=times.__getitem__)
    started = time.perf_counter()
    limit = min(config.solver_time_limit, NODE_GROUP_SOLVER_LIMIT)
    try:
        refined = plan_node_groups(workload, cluster, partitions[best],
                                   dataclasses.replace(group_config, solver_time_limit=limit), profile, "cpsat")
    except PlanError:
        return out
    return out + [(f"{out[best][0]}+cpsat", refined, time.perf_counter() - started)]


def _simulation(plan: Plan, result: PlanningResult, workload: Workload, cluster: ClusterSpec, sim_cost_model):
    """``_simulated``'s arguments for ``plan`` (made from ``result``): the simulator times it on
    ``sim_cost_model`` where given, else on the planner's cost and memory models."""
    return (plan, workload, cluster, sim_cost_model or result.cost_model,
            None if sim_cost_model else result.memory_model, result.metagraph)


def _simulated(args) -> SimResult:
    """``simulate`` of ``_simulation``'s arguments (parallel_map's function)."""
    plan, workload, cluster, cost_model, memory_model, metagraph = args
    return simulate(plan, workload, cluster, cost_model, memory_model, metagraph=metagraph)


def _pinned_candidates(workload: Workload, cluster: ClusterSpec, config: PlannerConfig,
                       planned: list[tuple[str, PlanningResult, float]]):
    """Every candidate again with its light levels (front ends, heads, losses) on the devices of the slices they
    exchange activations with (planner/light_levels.py ``pinned_plan``): their hand-offs become local copies,
    at the price of more light waves and of parameter device groups that follow the towers. Whether that pays
    depends on the gradient sync and weight gathers of those groups, so the simulator decides."""
    if config.select == "none":
        return []
    pinned = parallel_map(_timed_or_none, [(pinned_plan, (r.plan, r.metagraph, r.curves, workload, cluster, r.cost_model,
                                                          r.memory_model, r.level_allocs)) for _, r, _ in planned],
                          pool_size(config.planning_workers, cluster.num_devices))
    return [(f"{name}+pinned", dataclasses.replace(result, plan=plan), seconds)
            for (name, result, _), (plan, seconds) in zip(planned, pinned) if plan is not None]


def _timed_or_none(job: tuple[Callable, tuple]) -> tuple[Any, float]:
    """(``fn(*args)``, its seconds) of ``job`` = (fn, args), the result None where ``fn`` raises a PlanError (a
    node-group partition that does not plan, light slices that do not fit their partners' devices): parallel_map's
    function for the planning steps, which run in worker processes."""
    fn, args = job
    started = time.perf_counter()
    try:
        return fn(*args), time.perf_counter() - started
    except PlanError:
        return None, time.perf_counter() - started


def select_fastest(workload: Workload, cluster: ClusterSpec, planned: list[tuple[str, PlanningResult, float]],
                   config: PlannerConfig | None = None, progress: Callable[[str], None] | None = None,
                   sim_cost_model=None) -> AutoplanResult:
    """Simulate the planned ``(name, result, planning seconds)`` (and their execution-settings variants) and
    keep the fastest that fits; its plan records the simulation (``record_simulation``) and the candidates."""
    config = config or PlannerConfig()
    say = progress or (lambda msg: None)
    workers = pool_size(config.planning_workers, cluster.num_devices)
    if workers > 1 and len(planned) > 1:
        say(f"simulating {len(planned)} candidate plans and their distributed-optimizer variants on {workers} "
            "processes")
    variants = [(label, result, plan, secs) for name, result, secs in planned
                for plan, label in _settings_variants(result, config, name)]
    candidates = _simulated_candidates(variants, workload, cluster, sim_cost_model, workers)
    fitting = [c for c in candidates if c.fits] or candidates
    fastest = min(c.sim.iteration_time for c in fitting)
    sized = _bucket_size_variants([c for c in fitting if c.sim.iteration_time <= fastest * (1 + BUCKET_SLACK)], config)
    if sized:
        candidates += _simulated_candidates(sized, workload, cluster, sim_cost_model, workers)
        fitting = [c for c in candidates if c.fits] or candidates
        fastest = min(c.sim.iteration_time for c in fitting)
    # ties (within TIE): the planner's own plans before the task-sequential fallback, then candidate order
    best = next(c for c in sorted(fitting, key=lambda c: c.name.startswith("task-sequential"))
                if c.sim.iteration_time <= fastest * (1 + TIE))
    if len(candidates) > 1:
        shown, hidden = shown_candidates([(c.name, c.sim.iteration_time) for c in candidates], best.name)
        say(f"selection: {best.name} (simulated {best.sim.iteration_time * 1e3:.1f} ms) of "
            + ", ".join(f"{name} {t * 1e3:.1f} ms" for name, t in shown)
            + (f" (the fastest {len(shown)} of {len(candidates)})" if hidden else ""))
    plan = best.plan
    record_simulation(plan, best.sim)
    plan.planner["selection"] = {"selected": best.name, "candidates": [c.summary() for c in candidates]}
    return AutoplanResult(dataclasses.replace(best.result, plan=plan), best.sim, candidates,
                          sum(secs for _, _, secs in planned))


def _simulated_candidates(variants: list, workload: Workload, cluster: ClusterSpec, sim_cost_model,
                          workers: int) -> list[Candidate]:
    """``(name, result, plan, planning seconds)`` each timed by the simulator (on ``workers`` processes)."""
    sims = parallel_map(_simulated, [_simulation(plan, result, workload, cluster, sim_cost_model)
                                     for _, result, plan, _ in variants], workers)
    return [Candidate(label, result, plan, sim, secs) for (label, result, plan, secs), sim in zip(variants, sims)]


def _bucket_size_variants(near: list[Candidate], config: PlannerConfig) -> list:
    """Where the user left ``--ddp-bucket-size`` to the planner: the candidates ``near`` the fastest with each
    of ``BUCKET_SIZES`` instead of megatron-core's default (the buckets' count and the backward left to hide
    each, against a latency per collective; the same waves, memory and estimate otherwise)."""
    if config.select != "simulate" or config.ddp_bucket_size is not None:
        return []
    out = []
    for c in near:
        if c.plan.settings.ddp_bucket_size is not None:
            continue
        param_count = c.result.cost_model.param_count
        largest = max((sum(param_count(u) for u in g.params) for g in c.plan.param_groups if len(g.devices) > 1),
                      default=0)
        for size in (s for s in BUCKET_SIZES if s < largest):  # else every group is one bucket either way
            out.append((f"{c.name}+buckets{size // 10**6}M", c.result,
                        _estimated_copy(c.plan, c.result, ddp_bucket_size=size), c.planning_seconds))
    return out


def _estimated_copy(plan: Plan, result: PlanningResult, **changes) -> Plan:
    """A copy of ``plan`` (its own planner and predicted dicts) under settings with ``changes``, the planner's
    estimate taken again for them."""
    out = dataclasses.replace(plan, planner=dict(plan.planner), predicted=dict(plan.predicted),
                              settings=dataclasses.replace(plan.settings, **changes))
    out.predicted.update(estimate_iteration(out, result.metagraph, result.memory_model.cluster,
                                            result.cost_model).as_predicted())
    return out


def _unlimited_candidates(workload: Workload, cluster: ClusterSpec, config: PlannerConfig, profile,
                          planned: list[tuple[str, PlanningResult, float]], sim_cost_model=None):
    """Where memory bound some plan of ``planned`` (``memory_bound``: it has the distributed optimizer,
    micro-batches or recomputation, or memory shaped its search: planner/memory_search.py), the configured
    planner and the greedy one again as if devices had UNLIMITED_MEMORY_FACTOR times their memory and no memory
    option at all (each also on sync-aware curves: ``_sync_aware_run``), the node groups on such devices
    (``_node_group_candidates``: each group's search is limited by its few nodes' memory), and each with its
    light levels pinned to their partners' devices
    (``_pinned_candidates``: the heads' memory, which the capped plans often cannot spare for it, is there),
    every such plan then given ZeRO-3, ZeRO-2 or ZeRO-1 and each layer slice's cheapest recomputation that fits
    the real devices (baselines/memory_options.py ``with_cheapest_recompute``, in the plan's own order):
    QWen-VAL-30B / 256's pinned one costs recomputation and saves 0.4 s of transfers. The memory search limits
    every MetaOp's configurations to what its whole chain fits before it schedules; a plan made without that
    limit keeps its fastest configurations and may pay less in recomputation than the limited ones cost
    (QWen-VAL-70B / 256: about 9.6 s where the capped search's plans simulate 11.9 s and more), or none (CLIP-10
    / 32: pinned on a node-group plan made without the limit, 549 ms at 45 GiB per device, where the capped
    candidates simulate 585 ms and more)."""
    if not any(memory_bound(result.plan) for _, result, _ in planned):
        return []  # memory bound nothing: the plans made without the limit are these
    first = planned[0][1]
    roomy = cluster.with_memory_factor(UNLIMITED_MEMORY_FACTOR)
    configured = unlimited_config(config)
    unlimited = []
    for planner in dict.fromkeys((config.planner, "wavefront")):
        plain = dataclasses.replace(configured, planner=planner)
        started = time.perf_counter()
        try:
            result = plan_workload(workload, roomy, plain, profile)
        except PlanError:
            continue
        unlimited.append((planner, result, time.perf_counter() - started))
        unlimited += [(name, aware, secs) for name, _, aware, secs
                      in _sync_aware_run(workload, roomy, plain, profile, unlimited[-1:])]
    unlimited += _node_group_candidates(workload, roomy, configured, profile, unlimited, sim_cost_model)
    unlimited = with_variants([(f"{name}-unlimited", result, secs) for name, result, secs in unlimited])
    unlimited += _pinned_candidates(workload, roomy, config, unlimited)  # pinned where the memory is there
    return [candidate for name, result, secs in unlimited
            for candidate in _fitted(name, result.plan, workload, cluster, config, first, secs)]


def unlimited_config(config: PlannerConfig) -> PlannerConfig:
    """``config`` without memory options, for the plans made with memory unlimited (then ``_fitted``)."""
    return dataclasses.replace(config, distributed_optimizer="off", recompute="none", micro_batches="1",
                               early_backward="off")


def _task_segment_candidates(workload: Workload, cluster: ClusterSpec, config: PlannerConfig,
                             fit_config: PlannerConfig, profile, first: PlanningResult, sim_cost_model=None):
    """The tasks in segments run one after another (planner/task_segments.py), each segment's tasks planned by
    the greedy wavefront planner with memory unlimited, one plan per partition proposed, each fitted to the real
    devices like the other plans made with memory unlimited (``_fitted``): a device holds one segment's
    activations at a time, so a plan can keep whole batches and its fastest configurations where the plans of
    every task at once recompute (clip-10 / 8: 1646 ms against 1780). With the CP-SAT planner, the partition
    whose fitted plan simulates fastest again with each segment refined by CP-SAT (at most
    NODE_GROUP_SOLVER_LIMIT seconds a segment). ``autoplan`` asks for them where memory bound some plan
    (``memory_bound``); none with ``--spindle-task-segments off``. ``config``: the configured planner's, without
    memory options (``unlimited_config``); ``fit_config``: the memory options the user allows (``_fitted``)."""
    if len(workload.tasks) < 2 or config.task_segments == "off":
        return []
    roomy = cluster.with_memory_factor(UNLIMITED_MEMORY_FACTOR)
    workers = pool_size(config.planning_workers, cluster.num_devices)
    proposed = segment_partitions(workload, cluster, first.metagraph)
    planned = parallel_map(_timed_or_none, [(plan_task_segments, (workload, roomy, p, config, profile))
                                            for p in proposed], workers)

    def fit(name, result, seconds):
        return _fitted(name, result.plan, workload, cluster, fit_config, first, seconds)

    fitted = [(p, c) for p, (result, secs) in zip(proposed, planned) if result is not None
              for c in fit(f"task-segments-{len(p)}-unlimited", result, secs)]
    out = [c for _, c in fitted]
    if config.planner != "cpsat" or not out:
        return out
    times = [sim.iteration_time for sim in parallel_map(
        _simulated, [_simulation(r.plan, r, workload, cluster, sim_cost_model) for _, r, _ in out], workers)]
    best = fitted[min(range(len(out)), key=times.__getitem__)][0]  # the partition of the fastest fitted plan
    started = time.perf_counter()
    limit = min(config.solver_time_limit, NODE_GROUP_SOLVER_LIMIT)
    try:
        refined = plan_task_segments(workload, roomy, best, dataclasses.replace(config, solver_time_limit=limit),
                                     profile, "cpsat")
    except PlanError:
        return out
    return out + fit(f"task-segments-{len(best)}-unlimited+cpsat", refined, time.perf_counter() - started)


def relaxed_optimum(workload: Workload, cluster: ClusterSpec, config: PlannerConfig | None = None,
                    profile=None) -> float:
    """C* with memory unlimited: the sum of the MetaLevels' relaxed optima (Theorem 1) on the planner's curves, every
    device count open to every MetaOp. No waves of T(n) with level barriers finish sooner, so it bounds what a
    wavefront plan's compute can reach on this cost model (a dataflow run or cross-level overlap could in principle
    go below it; no plan of the paper's cells does); transfers, gradient sync and the optimizer come on top."""
    config = dataclasses.replace(config or PlannerConfig(), planner="wavefront", select="none")
    roomy = cluster.with_memory_factor(UNLIMITED_MEMORY_FACTOR)
    return float(plan_workload(workload, roomy, config, profile).plan.predicted["c_star"])


def memory_bound(plan: Plan) -> bool:
    """Whether memory shaped ``plan``: it runs with a memory option (the distributed optimizer, micro-batches,
    recomputation), or memory limited its planner's search (``plan.planner["memory_limited"]``: a rung failed,
    or memory bound or narrowed a placement, planner/memory_search.py)."""
    st = plan.settings
    return bool(plan.planner.get("memory_limited")) or st.zero_stage > 0 or st.micro_batches > 1 \
        or plan.recomputes()


def _fitted(name: str, unlimited: Plan, workload: Workload, cluster: ClusterSpec, config: PlannerConfig,
            first: PlanningResult, seconds: float):
    """A plan made for more memory as candidates on ``cluster``: with ZeRO-3, ZeRO-3 with node-local weight
    shards (on several nodes: ZeRO++'s hierarchical partitioning, plan/layout.py ``weight_shard_group``), ZeRO-2,
    then ZeRO-1 (those ``config`` allows; ZeRO-0 where it allows none), each layer slice at the cheapest
    recomputation that fits (none where nothing does), timed on ``first``'s models."""
    from megatron_spindle.baselines.memory_options import with_cheapest_recompute
    from megatron_spindle.estimator import MemoryModel

    cost_model, metagraph = first.cost_model, first.metagraph
    memory_model = MemoryModel(workload, cluster, cost_model)  # no ZeRO of its own: the plan's settings shard
    out = []
    stages = [(z, False) for z in sorted((z for z in config.zero_stages() if z), reverse=True)] or [(0, False)]
    if stages[0][0] == 3 and cluster.num_nodes > 1:
        stages.insert(1, (3, True))
    for stage, node_local in stages:
        staged = dataclasses.replace(unlimited, cluster=cluster.to_dict(), cluster_digest=cluster.digest(),
                                     planner=dict(unlimited.planner), predicted=dict(unlimited.predicted),
                                     settings=dataclasses.replace(unlimited.settings, zero_stage=stage,
                                                                  node_local_weights=node_local))
        plan = with_cheapest_recompute(staged, metagraph, cost_model, memory_model, cluster)
        if plan is None:
            continue
        plan.memory_per_device = plan_memory(plan, metagraph.metaops, memory_model)
        plan.planner["memory_options"] = memory_options(plan)
        plan.predicted.update(estimate_iteration(plan, metagraph, cluster, cost_model).as_predicted())
        validate_plan(plan, workload, cluster, metagraph)
        label = f"{name}+zero{stage}" + ("-hpz" if node_local else "")
        out.append((label, dataclasses.replace(first, plan=plan, memory_model=memory_model, solver=None, timings={}),
                    seconds))
    return out


def _task_sequential(workload: Workload, cluster: ClusterSpec, config: PlannerConfig, first: PlanningResult,
                     sim_cost_model=None):
    """The fallback candidate: Spindle's runtime with each task on the whole cluster in turn (the Spindle-Seq
    plan, its memory options tuned like the baselines' among the ZeRO stages ``config`` allows), as a
    PlanningResult of the first planner run's models. Skipped with a profiled simulator or planner model (the
    baseline plans are timed by the analytic model)."""
    if sim_cost_model is not None or isinstance(first.cost_model, ProfiledCostModel):
        return []
    from megatron_spindle.baselines import BaselineContext, spindle_seq_plan

    started = time.perf_counter()
    ctx = BaselineContext.build(workload, cluster, metagraph=first.metagraph, choices=config)
    build = functools.partial(spindle_seq_plan, zero_stages=config.zero_stages())
    plan = build(workload, cluster, ctx)
    out = []
    if plan.planner.get("memory_ok", True):
        cost_model = ctx.recomputing(plan.settings.recompute.mode == "full")
        plan.predicted.update(estimate_iteration(plan, first.metagraph, cluster, cost_model.cost_model).as_predicted())
        result = dataclasses.replace(first, plan=plan, cost_model=cost_model.cost_model,
                                     memory_model=cost_model.memory_model, solver=None, timings={})
        out.append(("task-sequential", result, time.perf_counter() - started))
    if not plan.planner.get("memory_ok", True) or plan.recomputes():
        # memory binds: the same with micro-batches and per-slice recomputation (baselines/memory_options.py)
        from megatron_spindle.baselines.memory_options import with_memory_options

        started = time.perf_counter()
        try:
            seq, _, cost, memory = with_memory_options(build, workload, cluster, config.micro_batches,
                                                       metagraph=first.metagraph)
        except PlanError:
            return out
        seq.predicted.update(estimate_iteration(seq, first.metagraph, cluster, cost).as_predicted())
        result = dataclasses.replace(first, plan=seq, cost_model=cost, memory_model=memory, solver=None, timings={})
        out.append(("task-sequential+options", result, time.perf_counter() - started))
    return out


def record_simulation(plan: Plan, sim: SimResult) -> None:
    """The plan's predicted iteration time becomes the simulator's, with its breakdown beside; the waves'
    makespan of T(n) stays as ``makespan``."""
    predicted = plan.predicted
    predicted.setdefault("makespan", float(predicted.get("iteration_time", 0.0)))
    predicted["iteration_time"] = float(sim.iteration_time)
    for k, v in sim.breakdown().items():
        if k != "iteration_time":
            predicted[f"simulated_{k}"] = float(v)
    if predicted.get("c_star"):
        predicted["gap"] = predicted["makespan"] / predicted["c_star"] - 1.0


def _settings_variants(result: PlanningResult, config: PlannerConfig, name: str):
    """The plan as planned, and with the distributed optimizer when it has none and the user left it to the
    planner: the same waves, other execution settings (memory per device recomputed). Copies: the planning
    result's own plan is left as the planner made it."""
    settings = dataclasses.replace(result.plan.settings, overlap_param_gather=config.overlap_param_gather)
    plan = dataclasses.replace(result.plan, planner=dict(result.plan.planner), predicted=dict(result.plan.predicted),
                               settings=settings)
    plan.predicted.setdefault("makespan", float(plan.predicted.get("iteration_time", 0.0)))
    if settings != result.plan.settings:  # the user's runtime flag, on every candidate (e.g. the baselines')
        plan.predicted.update(estimate_iteration(plan, result.metagraph, result.memory_model.cluster,
                                                 result.cost_model).as_predicted())
    yield plan, name
    if (config.select == "none" or config.distributed_optimizer != "auto" or plan.settings.zero_stage != 0
            or plan.settings.segments is not None):  # the task-sequential plan's options are tuned already
        return
    sharded = _estimated_copy(plan, result, zero_stage=1)
    sharded.memory_per_device = plan_memory(sharded, result.metagraph.metaops, result.memory_model)
    yield sharded, f"{name}+zero1"
