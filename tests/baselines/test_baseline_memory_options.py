"""Issue 14's memory options on a baseline's plan (baselines/memory_options.py): planned at a micro-batch's batch,
taken back to the workload with m micro-batches, the cheapest recomputation per slice that fits."""

from __future__ import annotations

import dataclasses

from megatron_spindle.baselines import BaselineContext, deepspeed_plan, spindle_seq_plan
from megatron_spindle.baselines.memory_options import micro_workload, retarget, with_memory_options
from megatron_spindle.estimator import AnalyticCostModel
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.plan.memory import plan_breakdown, plan_memory
from megatron_spindle.plan.validate import validate_plan


def test_a_micro_batch_plan_taken_back_is_a_valid_plan_of_the_workload():
    w, c = load_workload("tiny-vlm"), make_cluster(4, 2, "CPU")
    g = build_metagraph(w)
    small = micro_workload(w, 2)
    assert [t.batch_size for t in small.tasks] == [t.batch_size // 2 for t in w.tasks]
    plan = retarget(spindle_seq_plan(small, c, BaselineContext.build(small, c)), w, g, AnalyticCostModel(w, c), 2)
    validate_plan(plan, w, c, g, check_memory=False)
    assert plan.settings.micro_batches == 2 and plan.workload_digest == w.digest()
    assert all(list(i.input_shape) == list(g.metaops[i.id].input_shape) for i in plan.metaops)


def test_with_the_options_a_baseline_fits_where_its_plain_plan_did_not():
    w, c = load_workload("tiny-vlm"), make_cluster(4, 2, "CPU")
    ctx = BaselineContext.build(w, c)
    plain = deepspeed_plan(w, c, ctx)
    g = build_metagraph(w)
    worst = max(plan_breakdown(plain, g.metaops, ctx.memory_model), key=sum)  # (parameter state, activations)
    tight = dataclasses.replace(c, gpu=dataclasses.replace(c.gpu, memory_bytes=worst[0] + 0.6 * worst[1]))
    assert max(plan_memory(plain, g.metaops, ctx.memory_model)) > tight.gpu.memory_bytes
    plan, sim, cost, memory = with_memory_options(deepspeed_plan, w, tight)
    validate_plan(plan, w, tight, g)
    assert max(plan_memory(plan, g.metaops, memory)) <= tight.gpu.memory_bytes
    assert sim.iteration_time > 0 and max(sim.peak_memory) <= tight.gpu.memory_bytes


def test_spindle_seq_tunes_every_zero_stage_the_runtime_implements():
    """Spindle-Seq runs on Spindle's runtime, which shards gradients too (ZeRO-2): where ZeRO-1 needs
    recomputation and ZeRO-2 does not, it picks ZeRO-2; limited to Megatron's stages it recomputes."""
    w, c = load_workload("tiny-vlm"), make_cluster(4, 2, "CPU")
    g = build_metagraph(w)
    ctx = BaselineContext.build(w, c)
    peak = {z: max(plan_memory(spindle_seq_plan(w, c, ctx, zero_stages=(z,)), g.metaops, ctx.memory_model))
            for z in (1, 2)}
    assert peak[2] < peak[1]
    tight = dataclasses.replace(c, gpu=dataclasses.replace(c.gpu, memory_bytes=(peak[1] + peak[2]) / 2))
    tight_ctx = BaselineContext.build(w, tight)
    plan = spindle_seq_plan(w, tight, tight_ctx)
    assert plan.settings.zero_stage == 2 and plan.settings.recompute.mode == "none"
    assert "zero2" in plan.planner["search"]
    megatron_stages = spindle_seq_plan(w, tight, tight_ctx, zero_stages=(0, 1))
    assert megatron_stages.settings.recompute.mode == "full"
    assert not any(k.startswith("zero2") for k in megatron_stages.planner["search"])


def test_a_baseline_splits_a_contrastive_batch_only_when_told_to():
    """Spindle's rule (plan/layout.py micro_batch_choices): under auto a baseline too keeps one micro-batch where a
    task's loss is contrastive, recomputing where 2 micro-batches would not need to; a given count is used."""
    w, c = load_workload("tiny-clip"), make_cluster(2, 2, "CPU")
    g = build_metagraph(w)
    ctx = BaselineContext.build(w, c)
    plain = deepspeed_plan(w, c, ctx)
    # the leanest stage, ZeRO-3, with a fifth of its activations too many: one micro-batch must recompute, two
    # need not
    lean = dataclasses.replace(plain, settings=dataclasses.replace(plain.settings, zero_stage=3))
    worst = max(plan_breakdown(lean, g.metaops, ctx.memory_model), key=sum)
    tight = dataclasses.replace(c, gpu=dataclasses.replace(c.gpu, memory_bytes=worst[0] + 0.8 * worst[1]))
    auto, _, _, memory = with_memory_options(deepspeed_plan, w, tight)
    assert auto.settings.micro_batches == 1 and auto.recomputes()  # where 2 micro-batches would not recompute
    assert max(plan_memory(auto, g.metaops, memory)) <= tight.gpu.memory_bytes
    given, _, _, _ = with_memory_options(deepspeed_plan, w, tight, "2")
    assert given.settings.micro_batches == 2 and not given.recomputes()
    validate_plan(given, w, tight, g)
