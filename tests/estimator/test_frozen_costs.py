"""What frozen modules cost in the estimator and the plans made on it: dgrad-only or no backward, no gradient
sync, weights alone in memory."""

from __future__ import annotations

import pytest

from megatron_spindle.estimator import AnalyticCostModel, MemoryModel
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.plan.memory import WEIGHT_BYTES_PER_PARAM
from megatron_spindle.plan.schema import Recompute
from megatron_spindle.planner.pipeline import PlannerConfig, make_plan
from megatron_spindle.simulator import simulate


@pytest.fixture(scope="module")
def qwen():
    """QWen-VAL with its LLM frozen (the vision and audio towers train through it) and with its audio encoder
    frozen (nothing trains before it)."""
    base = load_workload("qwen-val")
    return base, base.frozen(["llm", "audio"]), make_cluster(16)


def test_frozen_layers_skip_weight_gradients_or_the_whole_backward(qwen):
    base, frozen, cluster = qwen
    full, cut = AnalyticCostModel(base, cluster), AnalyticCostModel(frozen, cluster)
    g, gf = build_metagraph(base).metaops, build_metagraph(frozen).metaops
    llm, audio = gf["vl/llm"], gf["al/audio"]
    assert (llm.backward, audio.backward) == ("input", "none")
    f0, b0 = full.phase_seconds(g["vl/llm"], 2, 2)
    f1, b1 = cut.phase_seconds(llm, 2, 2)
    assert f1 == pytest.approx(f0)
    assert 0.4 * b0 < b1 < 0.75 * b0  # dgrad GEMMs and the attention backward stay; wgrad and main grads go
    names = {k.name for k in cut.kernel_time(llm, 2, 2).kernels if k.phase == "backward"}
    assert names and not [n for n in names if n.endswith((".wgrad", ".dbias")) or n == "main_grad"]
    assert cut.phase_seconds(audio, 1, 4)[1] == 0.0
    assert cut.recompute_seconds(audio, 1, 4, Recompute("full"), audio.num_layers) == 0.0
    assert cut.recompute_seconds(llm, 2, 2, Recompute("full"), 1) > 0.0
    for m in (llm, audio):  # no gradient to synchronise
        assert cut.dp_sync_seconds(m, 1, 4) == 0.0 and cut.communication_bytes(m) == 0.0
    assert full.dp_sync_seconds(g["vl/llm"], 1, 4) > 0.0


def test_frozen_units_hold_their_weights_alone_whatever_the_zero_stage(qwen):
    base, frozen, cluster = qwen
    count = AnalyticCostModel(frozen, cluster).param_count("llm.layers.0")
    for stage in (0, 1, 2, 3):
        memory = MemoryModel(frozen, cluster, zero_stage=stage)
        assert memory.param_state_bytes("llm.layers.0", 2, 4) == WEIGHT_BYTES_PER_PARAM * count / 2
        assert memory.param_state_bytes("vision.layers.0", 1, 4) == MemoryModel(
            base, cluster, zero_stage=stage).param_state_bytes("vision.layers.0", 1, 4)
    memory, unfrozen = MemoryModel(frozen, cluster), MemoryModel(base, cluster)
    gf, g = build_metagraph(frozen).metaops, build_metagraph(base).metaops
    assert memory.activation_memory(gf["al/audio"], 1, 4, 2) == (0.0, 0.0)
    held, _ = memory.activation_memory(gf["vl/llm"], 1, 4, 2)
    assert 0 < held < unfrozen.activation_memory(g["vl/llm"], 1, 4, 2)[0]


def test_plans_leave_frozen_units_out_of_gradient_sync_and_are_faster(qwen):
    base, frozen, cluster = qwen
    config = PlannerConfig(planner="wavefront")
    plans = {name: make_plan(w, cluster, config) for name, w in (("base", base), ("frozen", frozen))}
    synced = {u for g in plans["frozen"].param_groups for u in g.params}
    assert synced and not [u for u in synced if frozen.is_frozen_unit(u)]
    assert any(frozen.is_frozen_unit(u) for g in plans["base"].param_groups for u in g.params)
    from megatron_spindle.plan.schema import Plan

    assert not any("backward" in m for m in plans["base"].to_dict()["metaops"])  # plans as they were written
    again = Plan.from_dict(plans["frozen"].to_dict())
    assert {m.id: m.backward for m in again.metaops} == {m.id: m.backward for m in plans["frozen"].metaops}
    assert {m.backward for m in again.metaops} == {"full", "input", "none"}
    times = {name: simulate(p, w, cluster).iteration_time
             for (name, p), w in zip(plans.items(), (base, frozen))}
    assert times["frozen"] < times["base"]
    assert max(plans["frozen"].memory_per_device) < max(plans["base"].memory_per_device)


def test_model_flops_count_what_frozen_modules_compute(qwen):
    """--log-throughput's model FLOPs: 3x a MetaOp's forward, 2x for a frozen module passing input gradients on,
    1x for one with no backward."""
    from megatron_spindle.training.throughput import task_model_flops

    _, frozen, cluster = qwen
    model = AnalyticCostModel(frozen, cluster)
    factor = {"full": 3, "input": 2, "none": 1}
    want = {t.name: 0.0 for t in frozen.tasks}
    for m in build_metagraph(frozen).metaops.values():
        want[m.task] += factor[m.backward] * model.forward_flops(m) * m.num_layers
    assert task_model_flops(frozen) == pytest.approx(want)
