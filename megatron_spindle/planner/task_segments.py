"""Tasks run in segments one after another, each segment's tasks planned together by the wavefront planner.

A wavefront plan runs every task's forward before the first backward, so its devices hold every task's
activations at once. Where they do not fit, the memory search recomputes layers or splits the batches into
micro-batches; recomputation repeats forwards, micro-batches shrink every kernel, and both are excluded or
costly for a contrastive loss (plan/layout.py ``whole_batch_tasks``). Segments split the tasks instead: each
segment's forward and backward run before the next segment starts (``ExecutionSettings.segments``, the
temporal decoupling the baselines run with one task per segment), the gradients of weights shared across
segments accumulate, and the optimizer steps once. The training is the same (every task's whole batch, one
step), and a device holds one segment's activations at a time; the price is that each segment's waves pack
fewer MetaOps, and the segments' waves run one after another.

``segment_partitions`` proposes, per number of segments (2 up to MAX_SEGMENTS), the tasks split into that many
segments of balanced work (longest task first onto the lightest segment); ``plan_task_segments`` plans each
segment's task subset on the whole cluster and concatenates the segments' waves into one plan of the workload.
Which partition pays (if any) only a simulation can tell: plan selection (megatron_spindle/autoplan.py) makes
them with memory unlimited and fits them to the devices, where memory binds its other plans.
"""

from __future__ import annotations

import dataclasses
import time

from megatron_spindle.estimator import AnalyticCostModel, MemoryModel
from megatron_spindle.estimator.profiled import planning_cost_model, profile_for
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaGraph, build_metagraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan.schema import ExecutionSettings, PlanError, Recompute
from megatron_spindle.planner.assemble import assemble_plan, slice_id
from megatron_spindle.planner.memory_search import run_settings
from megatron_spindle.planner.node_groups import assign_tasks, keep_group_allocations, task_work
from megatron_spindle.planner.objective import estimate_iteration
from megatron_spindle.planner.schedule import ScheduledWave, scheduled_slice

MAX_SEGMENTS = 4  # partitions tried: 2 .. min(tasks, MAX_SEGMENTS) segments


def segment_partitions(workload: Workload, cluster: ClusterSpec,
                       metagraph: MetaGraph | None = None) -> list[list[tuple[str, ...]]]:
    """Per number of segments (2 up to the tasks there are, at most MAX_SEGMENTS), the tasks in that many
    segments of balanced work; each segment's tasks in the workload's order, the segments in the order of
    their first task."""
    metagraph = metagraph or build_metagraph(workload)
    work = task_work(metagraph, AnalyticCostModel(workload, cluster))
    order = [t.name for t in workload.tasks]
    out = []
    for k in range(2, min(len(order), MAX_SEGMENTS) + 1):
        found = assign_tasks(work, [1] * k)
        if found is None:
            continue
        segments = sorted((tuple(sorted(g, key=order.index)) for g in found[1]), key=lambda g: order.index(g[0]))
        out.append(segments)
    return out


def plan_task_segments(workload: Workload, cluster: ClusterSpec, segments: list[tuple[str, ...]], config=None,
                       profile=None, planner: str = "wavefront"):
    """One plan of ``workload`` on ``cluster`` whose segments run the tasks of ``segments`` one after another,
    each segment's waves planned by ``planner`` on the whole cluster (module docstring), as a PlanningResult;
    raises PlanError when a segment does not plan, or plans an execution order or micro-batches of its own
    (segments merge only plain one-segment plans of one micro-batch)."""
    from megatron_spindle.planner.pipeline import PlannerConfig, PlanningResult, plan_workload

    config = dataclasses.replace(config or PlannerConfig(), planner=planner, select="none")
    started = time.perf_counter()
    metagraph = build_metagraph(workload)
    results = []
    for tasks in segments:
        subset = workload.subset(list(tasks))
        result = plan_workload(subset, cluster, config,
                               profile_for(profile, build_metagraph(subset).metaops, cluster.num_devices))
        results.append(result.settled or result)  # with config.settle_tails, where its estimate prefers it
    plans = [r.plan for r in results]
    if any(p.settings.order is not None or p.settings.segments is not None or p.settings.backward_order is not None
           or p.settings.micro_batches != 1 for p in plans):
        raise PlanError("a segment's plan has its own execution order or micro-batches; segments merge only plain "
                        "plans")
    waves, recompute, spans = _concatenate(metagraph, plans)
    zero = max(p.settings.zero_stage for p in plans)
    settings = ExecutionSettings(slice_recompute=recompute, zero_stage=zero, segments=spans, **run_settings(config))
    cost_model = planning_cost_model(workload, cluster, profile, config)
    memory_model = MemoryModel(workload, cluster, cost_model, zero_stage=zero)
    curves = {k: v for r in results for k, v in r.curves.items()}
    info = {"planner": f"{planner}-task-segments", "requested": dataclasses.asdict(config),
            "task_segments": [list(tasks) for tasks in segments],
            "memory_options": "; ".join(p.planner.get("memory_options", "") for p in plans),
            "memory_limited": any(p.planner.get("memory_limited", False) for p in plans)}
    plan = assemble_plan(workload, cluster, metagraph, waves, cost_model, memory_model, info, curves=curves,
                         settings=settings)
    keep_group_allocations(plan, plans)
    plan.predicted.update(estimate_iteration(plan, metagraph, cluster, cost_model).as_predicted())
    seconds = time.perf_counter() - started
    plan.planner["planning_seconds"] = seconds
    return PlanningResult(plan, metagraph, curves, [], waves, cost_model, memory_model, {"task_segments": seconds})


def _concatenate(metagraph: MetaGraph, plans) -> tuple[list[ScheduledWave], dict[str, Recompute],
                                                       tuple[tuple[int, ...], ...]]:
    """The segments' waves one after another (each at its MetaLevel of the whole workload), every layer
    slice's recomputation under its slice id in the concatenated plan, and the wave indices of each segment."""
    level_of = {mid: k for k, level in enumerate(metagraph.levels) for mid in level}
    waves: list[ScheduledWave] = []
    recompute: dict[str, Recompute] = {}
    spans = []
    start = 0.0
    for plan in plans:
        first = len(waves)
        for wave in plan.waves:
            unknown = [s.metaop for s in wave.slices if s.metaop not in level_of]
            if unknown:
                raise PlanError(f"a segment's MetaOp '{unknown[0]}' is not one of the workload's")
            index = len(waves)
            for s in wave.slices:
                rc = plan.settings.recompute_of(s.id)
                if s.kind == "layer" and rc.mode != "none":
                    recompute[slice_id(index, s.metaop)] = rc
            level = max(level_of[s.metaop] for s in wave.slices)
            waves.append(ScheduledWave(level, start, wave.duration, [scheduled_slice(s) for s in wave.slices]))
            start += wave.duration
        spans.append(tuple(range(first, len(waves))))
    return waves, recompute, tuple(spans)
