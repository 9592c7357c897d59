"""Tasks partitioned over groups of whole nodes, each group planned by the wavefront planner on its nodes.

On several nodes the wavefront plan of all tasks on the whole cluster moves a MetaOp's activations between
nodes whenever consecutive waves place its slices on other devices, and across nodes each GPU sends at its
own network path, far slower than NVLink. Here every task runs on one group of whole nodes: the group's
tasks are planned together (their wavefront on the group's devices), so a task's hand-offs never leave its
nodes; only the gradient sync of weights shared by tasks of several groups (a shared tower) crosses nodes, in
the parameter device groups plan/derive.py builds from the merged slices.

``node_group_partitions`` proposes, per number of groups, the split of the nodes and the assignment of tasks
(longest task first onto the group with the least work per node) with the best balance of work per node;
``plan_node_groups`` plans each group (``plan_workload`` of the workload's task subset on a cluster of the
group's nodes) and merges the groups' waves MetaLevel by MetaLevel (the j-th wave of each group at a level
run side by side, on disjoint devices) into one plan of the whole workload. Which partition (if any) is worth
it only a simulation can tell: plan selection (megatron_spindle/autoplan.py) times them as candidates.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass

from megatron_spindle.estimator import AnalyticCostModel, MemoryModel
from megatron_spindle.estimator.profiled import planning_cost_model, profile_for
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaGraph, build_metagraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan.layout import whole_batch_tasks
from megatron_spindle.plan.schema import ExecutionSettings, Plan, PlanError, Recompute
from megatron_spindle.planner.assemble import assemble_plan, slice_id
from megatron_spindle.planner.memory_search import run_settings
from megatron_spindle.planner.objective import estimate_iteration
from megatron_spindle.planner.schedule import ScheduledWave, scheduled_slice

MAX_GROUPS = 8  # partitions tried: 2 .. min(nodes, tasks, MAX_GROUPS) groups
# group sizes are tried in steps of ceil(nodes / MAX_SIZE_STEPS) nodes: every size up to 32 nodes (3318 sets of
# sizes into 2-8 groups); beyond, they grow fast (64 nodes: 116262, 4 s for clip-20's 20 tasks; 128 nodes: about
# 3e6, which the enumeration of all 1e11 cuts it replaced never finished, on 1024 GPUs)
MAX_SIZE_STEPS = 32
# worst work per node, relative to the balanced partition's, that fewer shared parameters across groups may cost
SHARING_TOLERANCES = (1.1, 1.25)


@dataclass(frozen=True)
class NodeGroup:
    tasks: tuple[str, ...]
    first_node: int
    num_nodes: int


def task_work(metagraph: MetaGraph, cost_model: AnalyticCostModel) -> dict[str, float]:
    """FLOPs of each task's forward + backward (every layer of every MetaOp), for balancing the groups."""
    out: dict[str, float] = {}
    for m in metagraph.metaops.values():
        out[m.task] = out.get(m.task, 0.0) + cost_model.flops(m) * m.num_layers
    return out


def _compositions(total: int, parts: int, most: int | None = None):
    """Every way to write ``total`` as a sum of ``parts`` positive integers, non-increasing, each at most
    ``most``, in lexicographic order (smallest first part first)."""
    most = total if most is None else most
    if parts == 1:
        if 1 <= total <= most:
            yield [total]
        return
    for first in range(-(-total // parts), min(most, total - parts + 1) + 1):
        for rest in _compositions(total - first, parts - 1, first):
            yield [first, *rest]


def group_sizes(nodes: int, groups: int):
    """The group sizes (in nodes, non-increasing) tried for ``groups`` groups: every composition of the nodes,
    or, beyond MAX_SIZE_STEPS nodes, of that many steps of ceil(nodes / MAX_SIZE_STEPS) nodes, the nodes left
    over going to the first (largest) group."""
    step = -(-nodes // MAX_SIZE_STEPS)
    steps = nodes // step
    for sizes in _compositions(steps, groups):
        yield [sizes[0] * step + nodes - steps * step, *(s * step for s in sizes[1:])]


def assign_tasks(work: dict[str, float], sizes: list[int]) -> tuple[float, list[list[str]]] | None:
    """Longest task first onto the group whose work per node stays lowest; (worst work per node, groups), or
    None when a group gets no task."""
    groups: list[list[str]] = [[] for _ in sizes]
    load = [0.0] * len(sizes)
    for task in sorted(work, key=lambda t: (-work[t], t)):
        g = min(range(len(sizes)), key=lambda i: ((load[i] + work[task]) / sizes[i], i))
        groups[g].append(task)
        load[g] += work[task]
    if any(not g for g in groups):
        return None
    return max(x / n for x, n in zip(load, sizes)), groups


def task_params(metagraph: MetaGraph, cost_model: AnalyticCostModel) -> dict[str, dict[str, int]]:
    """Per task, the parameters of every weight unit it trains (shared towers appear under several tasks)."""
    out: dict[str, dict[str, int]] = {}
    for m in metagraph.metaops.values():
        for name in m.trained_param_names():  # frozen weights are never synchronised
            out.setdefault(m.task, {})[name] = cost_model.param_count(name)
    return out


def shared_cut(groups: list[list[str]], params: dict[str, dict[str, int]]) -> int:
    """Parameters whose gradient sync crosses groups: each unit counted once per group beyond the first."""
    seen: dict[str, tuple[int, set[int]]] = {}
    for gi, tasks in enumerate(groups):
        for t in tasks:
            for name, count in params.get(t, {}).items():
                seen.setdefault(name, (count, set()))[1].add(gi)
    return sum(count * (len(gs) - 1) for count, gs in seen.values())


def _rebalance_for_sharing(groups: list[list[str]], sizes: list[int], work: dict[str, float],
                           params: dict[str, dict[str, int]], tolerance: float) -> list[list[str]]:
    """Moves and swaps of tasks between groups that lower the parameters synced across groups while the worst
    work per node stays within ``tolerance`` times the balanced assignment's (first improvement, to a fixed
    point)."""
    limit = tolerance * max(sum(work[t] for t in g) / n for g, n in zip(groups, sizes))
    groups = [list(g) for g in groups]

    def ok(gs):
        return all(gs) and max(sum(work[t] for t in g) / n for g, n in zip(gs, sizes)) <= limit * (1 + 1e-12)

    best = shared_cut(groups, params)
    improved = True
    while improved:
        improved = False
        for a, b in itertools.permutations(range(len(groups)), 2):
            for t in list(groups[a]):
                options = [None] + list(groups[b])  # move t to b, or swap it with one of b's tasks
                for u in options:
                    trial = [list(g) for g in groups]
                    trial[a].remove(t)
                    trial[b].append(t)
                    if u is not None:
                        trial[b].remove(u)
                        trial[a].append(u)
                    if ok(trial) and shared_cut(trial, params) < best:
                        groups, best, improved = trial, shared_cut(trial, params), True
                        break
                if improved:
                    break
            if improved:
                break
    return groups


def node_group_partitions(workload: Workload, cluster: ClusterSpec,
                          metagraph: MetaGraph | None = None) -> list[list[NodeGroup]]:
    """Per number of groups (2 up to the nodes and tasks there are), the best-balanced partition, and the
    partitions that sync fewer shared parameters across groups at up to SHARING_TOLERANCES times its worst
    work per node (distinct partitions only)."""
    metagraph = metagraph or build_metagraph(workload)
    cost_model = AnalyticCostModel(workload, cluster)
    work = task_work(metagraph, cost_model)
    params = task_params(metagraph, cost_model)
    order = [t.name for t in workload.tasks]
    out: list[list[NodeGroup]] = []
    seen = set()
    for k in range(2, min(cluster.num_nodes, len(order), MAX_GROUPS) + 1):
        best = None
        for sizes in group_sizes(cluster.num_nodes, k):
            found = assign_tasks(work, sizes)
            if found is not None and (best is None or found[0] < best[0]):
                best = (found[0], sizes, found[1])
        if best is None:
            continue
        _, sizes, balanced = best
        for groups in [balanced] + [_rebalance_for_sharing(balanced, sizes, work, params, tol)
                                    for tol in SHARING_TOLERANCES]:
            first, partition = 0, []
            for n, tasks in zip(sizes, groups):
                partition.append(NodeGroup(tuple(sorted(tasks, key=order.index)), first, n))
                first += n
            key = tuple(partition)
            if key not in seen:
                seen.add(key)
                out.append(partition)
    return out


def describe(partition: list[NodeGroup]) -> str:
    return " | ".join(f"{'+'.join(g.tasks)} on {g.num_nodes} node(s)" for g in partition)


def plan_node_groups(workload: Workload, cluster: ClusterSpec, partition: list[NodeGroup], config=None,
                     profile=None, planner: str = "wavefront"):
    """One plan of ``workload`` on ``cluster`` in which each group's tasks run on its nodes only (module
    docstring), as a PlanningResult; raises PlanError when a group does not plan or the groups' execution
    settings cannot be merged (an explicit order such as the early backward). ``planner``: each group's
    planner, the greedy wavefront (default) or CP-SAT refining it (``config.solver_time_limit`` per group)."""
    from megatron_spindle.planner.pipeline import PlannerConfig, PlanningResult, plan_workload

    config = dataclasses.replace(config or PlannerConfig(), planner=planner, select="none")
    started = time.perf_counter()
    metagraph = build_metagraph(workload)
    if whole_batch_tasks(config.micro_batches, metagraph.metaops.values()):
        config = dataclasses.replace(config, micro_batches="1")  # the whole plan's rule, not each group's own
    results = [_plan_group(workload, cluster, g, config, profile, plan_workload) for g in partition]
    counts = {r.plan.settings.micro_batches for r in results}
    if len(counts) > 1:  # one micro-batch count for the whole plan: the groups again with the largest
        config = dataclasses.replace(config, micro_batches=str(max(counts)))
        results = [_plan_group(workload, cluster, g, config, profile, plan_workload) for g in partition]
    # with config.settle_tails, a group's settled plan where its planner's estimate prefers it (planner/tails.py)
    results = [r.settled or r for r in results]
    plans = [r.plan for r in results]
    if any(p.settings.order is not None or p.settings.segments is not None
           or p.settings.backward_order is not None for p in plans):
        raise PlanError("a node group's plan has its own execution order; node groups merge only plain orders")
    waves, recompute = _merge_waves(metagraph, partition, cluster, plans)
    zero = max(p.settings.zero_stage for p in plans)
    settings = ExecutionSettings(slice_recompute=recompute, zero_stage=zero,
                                 micro_batches=plans[0].settings.micro_batches, **run_settings(config))
    # the groups' own (profiled where given)
    cost_model = planning_cost_model(workload, cluster, profile, config)
    memory_model = MemoryModel(workload, cluster, cost_model, zero_stage=zero)
    curves = {k: v for r in results for k, v in r.curves.items()}
    info = {"planner": f"{planner}-node-groups", "requested": dataclasses.asdict(config),
            "node_groups": [dataclasses.asdict(g) for g in partition],
            "memory_options": "; ".join(r.plan.planner.get("memory_options", "") for r in results),
            "memory_limited": any(r.plan.planner.get("memory_limited", False) for r in results)}
    plan = assemble_plan(workload, cluster, metagraph, waves, cost_model, memory_model, info, curves=curves,
                         settings=settings)
    keep_group_allocations(plan, [r.plan for r in results])
    plan.predicted.update(estimate_iteration(plan, metagraph, cluster, cost_model).as_predicted())
    seconds = time.perf_counter() - started
    plan.planner["planning_seconds"] = seconds
    return PlanningResult(plan, metagraph, curves, [], waves, cost_model, memory_model, {"node_groups": seconds})


def keep_group_allocations(plan: Plan, group_plans: list[Plan]) -> None:
    """Each MetaOp's allocation tuples and n* as its group's allocator made them (on the group's devices): the
    merged plan has no allocator of its own."""
    planned = {m.id: m for p in group_plans for m in p.metaops}
    for info in plan.metaops:
        if info.id in planned:
            info.allocation = [list(t) for t in planned[info.id].allocation]
            info.n_star = planned[info.id].n_star


def _plan_group(workload, cluster, group: NodeGroup, config, profile, plan_workload):
    sub_cluster = dataclasses.replace(cluster, num_nodes=group.num_nodes)
    subset = workload.subset(list(group.tasks))
    return plan_workload(subset, sub_cluster, config,
                         profile_for(profile, build_metagraph(subset).metaops, sub_cluster.num_devices))


def _merge_waves(metagraph: MetaGraph, partition: list[NodeGroup], cluster: ClusterSpec,
                 plans: list[Plan]) -> tuple[list[ScheduledWave], dict[str, Recompute]]:
    """The groups' waves with devices moved onto their nodes, the j-th wave of every group at each MetaLevel
    of the whole workload side by side; and every layer slice's recomputation under its merged slice id."""
    level_of = {mid: k for k, level in enumerate(metagraph.levels) for mid in level}
    per_level: dict[int, list[list]] = {}  # level -> per group, that group's waves at the level
    for gi, (group, plan) in enumerate(zip(partition, plans)):
        offset = group.first_node * cluster.gpus_per_node
        for wave in plan.waves:
            levels = set()
            for s in wave.slices:
                if s.metaop not in level_of:
                    raise PlanError(f"node group {gi}: MetaOp '{s.metaop}' is not one of the workload's")
                levels.add(level_of[s.metaop])
            if len(levels) != 1:
                raise PlanError(f"node group {gi}: wave {wave.index} spans MetaLevels {sorted(levels)}")
            rows = per_level.setdefault(levels.pop(), [[] for _ in partition])
            rows[gi].append((wave, offset, plan.settings))
    merged: list[ScheduledWave] = []
    recompute: dict[str, Recompute] = {}
    start = 0.0
    for level in sorted(per_level):
        for row in itertools.zip_longest(*per_level[level]):
            parts = [x for x in row if x is not None]
            index = len(merged)
            slices = []
            for wave, offset, settings in parts:
                for s in wave.slices:
                    slices.append(scheduled_slice(s, offset))
                    rc = settings.recompute_of(s.id)
                    if s.kind == "layer" and rc.mode != "none":
                        recompute[slice_id(index, s.metaop)] = rc
            duration = max(w.duration for w, _, _ in parts)
            merged.append(ScheduledWave(level, start, duration, slices))
            start += duration
    return merged, recompute
