"""Task segments (planner/task_segments.py): the tasks split into segments that run one after another, each
segment's tasks planned together; plan selection fits them to memory where its other plans recompute."""

from __future__ import annotations

import copy
import dataclasses

from planner_workloads import HEAVY

from megatron_spindle.autoplan import autoplan
from megatron_spindle.estimator import AnalyticCostModel
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import load_workload, workload_from_dict
from megatron_spindle.plan.buckets import wave_rounds
from megatron_spindle.plan.memory import ZeroSharded, plan_memory, staged_gradients
from megatron_spindle.plan.order import slice_order
from megatron_spindle.plan.schema import PlanError
from megatron_spindle.plan.validate import validate_plan
from megatron_spindle.planner.node_groups import task_work
from megatron_spindle.planner.pipeline import PlannerConfig
from megatron_spindle.planner.report import plan_summary
from megatron_spindle.planner.task_segments import MAX_SEGMENTS, plan_task_segments, segment_partitions

GiB = 2**30


def heavy_pairs():
    """HEAVY's contrastive task three times over the same two towers: each task's activations fit a device
    alone, the three together do not."""
    d = copy.deepcopy(HEAVY)
    d["name"] = "heavy-pairs"
    d["tasks"] = [dict(copy.deepcopy(HEAVY["tasks"][0]), name=f"vt{i}") for i in range(3)]
    return workload_from_dict(d)


def test_each_partition_holds_every_task_once_in_balanced_segments():
    w = load_workload("clip-10")
    cluster = make_cluster(8)
    partitions = segment_partitions(w, cluster)
    assert [len(p) for p in partitions] == list(range(2, MAX_SEGMENTS + 1))
    names = sorted(t.name for t in w.tasks)
    work = task_work(build_metagraph(w), AnalyticCostModel(w, cluster))
    for segments in partitions:
        assert sorted(t for seg in segments for t in seg) == names
        assert all(seg for seg in segments)
        # longest task first onto the lightest segment: no segment exceeds the mean by more than one task
        loads = [sum(work[t] for t in seg) for seg in segments]
        assert max(loads) <= sum(loads) / len(loads) + max(work.values())
    assert [len(p) for p in segment_partitions(w.subset(["vision_text", "text_audio"]), cluster)] == [2]


def test_the_segments_run_one_after_another_and_hold_one_segments_activations():
    w = load_workload("tiny-clip")
    cluster = make_cluster(4, gpu_type_name="CPU")
    segments = segment_partitions(w, cluster)[0]
    result = plan_task_segments(w, cluster, segments, PlannerConfig(planner="wavefront"))
    plan = result.plan
    validate_plan(plan, w, cluster, result.metagraph)
    assert plan.planner["task_segments"] == [list(s) for s in segments]
    spans = plan.settings.segments
    assert [i for span in spans for i in span] == list(range(len(plan.waves)))
    for span, tasks in zip(spans, segments):  # each segment's waves run its own tasks only
        assert {s.task for i in span for s in plan.waves[i].slices} == set(tasks)
    order = slice_order([[s.task for s in wave.slices] for wave in plan.waves], plan.settings)
    segment_of = {i: k for k, span in enumerate(spans) for i in span}
    assert [segment_of[w_] for w_, _, _ in order] == sorted(segment_of[w_] for w_, _, _ in order)
    summary = plan_summary(plan)  # what tools/plan.py and pretrain_multitask.py print
    assert "2 segments, one after another" in summary
    assert " | ".join(" + ".join(seg) for seg in segments) in summary
    # at ZeRO-2 a rank keeps gradient shards, and reduce-scatters after each segment (plan/buckets.py sync_rounds):
    # nothing is staged from one segment to the next; in one round the towers both segments train would be
    # (plan/memory.py staged_gradients; the runtime's buffers: tests/runtime/test_grad_sync.py)
    zero2 = dataclasses.replace(plan.settings, zero_stage=2)
    waves = [wv.slices for wv in plan.waves]
    order = slice_order([[s.task for s in wv] for wv in waves], plan.settings)
    every = {(wi, si) for wi, si, _ in order}
    numbers = ZeroSharded.of(result.memory_model, zero2)
    rounds = wave_rounds(len(waves), zero2)
    assert rounds == [0] * len(spans[0]) + [1] * len(spans[1])
    assert not staged_gradients(waves, result.metagraph.metaops, numbers, order, every, rounds=rounds)
    one_round = staged_gradients(waves, result.metagraph.metaops, numbers, order, every)
    span = set(spans[0])
    assert one_round and all(order[g.start][0] in span and order[g.end][0] not in span for g in one_round)
    # the same waves as one segment hold every task's activations until the first backward
    whole = dataclasses.replace(plan, settings=dataclasses.replace(plan.settings, segments=None))
    assert max(plan_memory(plan, result.metagraph.metaops, result.memory_model)) \
        < max(plan_memory(whole, result.metagraph.metaops, result.memory_model))


def test_a_segment_with_an_order_of_its_own_is_refused():
    w = load_workload("tiny-clip")
    cluster = make_cluster(4, gpu_type_name="CPU")
    segments = segment_partitions(w, cluster)[0]
    try:
        plan_task_segments(w, cluster, segments, PlannerConfig(planner="wavefront", micro_batches="2"))
    except PlanError as e:
        assert "segments merge only plain plans" in str(e)
    else:
        raise AssertionError("a segment planned with two micro-batches was merged")


def test_where_every_task_together_must_recompute_selection_runs_the_tasks_in_segments_instead():
    """4 GiB a device: every plan of the three tasks at once recomputes (a contrastive loss keeps one
    micro-batch); two segments fit without recomputation (at ZeRO-2), and run faster."""
    w = heavy_pairs()
    c = make_cluster(4, 4)
    cluster = dataclasses.replace(c, gpu=dataclasses.replace(c.gpu, memory_bytes=4 * GiB))
    chosen = autoplan(w, cluster, PlannerConfig(planner="wavefront"))
    fitting = [c for c in chosen.candidates if c.fits]
    segmented = [c for c in fitting if c.name.startswith("task-segments-")]
    at_once = [c for c in fitting if not c.name.startswith(("task-segments-", "task-sequential"))]
    assert segmented and at_once
    assert all(c.plan.recomputes() and c.plan.settings.micro_batches == 1 for c in at_once)
    assert min(c.sim.iteration_time for c in segmented) < min(c.sim.iteration_time for c in at_once)
    plan = chosen.plan
    assert plan.planner["selection"]["selected"].startswith("task-segments-2-")
    assert len(plan.settings.segments) == 2 and plan.settings.micro_batches == 1
    assert any(not c.plan.recomputes() and len(c.plan.settings.segments) == 2 for c in segmented)
    assert max(plan.memory_per_device) <= cluster.gpu.memory_bytes
    off = autoplan(w, cluster, PlannerConfig(planner="wavefront", task_segments="off"))  # --spindle-task-segments off
    assert not any(c.name.startswith("task-segments-") for c in off.candidates)
    assert off.plan.settings.segments is None or off.plan.planner["selection"]["selected"].startswith("task-sequential")
