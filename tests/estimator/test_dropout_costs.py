"""What dropout costs in the estimator and the plans made on it: a memory-bound kernel per mask in each phase, and
the masks' bytes (a byte per element on a GPU); nothing for FlashAttention's own dropout. CPU bytes are checked
against the runtime in tests/runtime/test_memory_measured.py."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_spindle.estimator import AnalyticCostModel, MemoryModel, execution_cost_config
from megatron_spindle.estimator.cost_model import CostModelConfig
from megatron_spindle.estimator.op_kernels import KernelModel, LayerShape, layer_time
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.planner.pipeline import PlannerConfig, make_plan
from megatron_spindle.planner.report import plan_summary
from megatron_spindle.simulator import simulate

SHAPE = LayerShape(batch=4, seq=256, hidden=1024, heads=16, ffn=4096, attention="unfused")


def kernels(shape: LayerShape, cluster) -> dict[str, float]:
    km = KernelModel(cluster.gpu)
    return {f"{k.phase}:{k.name}": k.seconds for k in layer_time(km, shape).kernels}


def test_each_mask_is_a_kernel_per_phase():
    cluster = make_cluster(8)
    plain = kernels(SHAPE, cluster)
    dropped = kernels(dataclasses.replace(SHAPE, hidden_dropout=True, attention_dropout=True), cluster)
    added = {k: v for k, v in dropped.items() if k not in plain}
    assert sorted(added) == sorted(f"{phase}:{name}.dropout" for phase in ("forward", "backward")
                                   for name in ("residual1", "residual2", "attention"))
    assert {k: v for k, v in dropped.items() if k in plain} == plain
    km = KernelModel(cluster.gpu)
    act = SHAPE.tokens * SHAPE.hidden * SHAPE.dtype_bytes  # read, write, and a byte per element
    assert added["forward:residual1.dropout"] == pytest.approx(km.memory(2 * act + act / SHAPE.dtype_bytes))
    scores = SHAPE.batch * SHAPE.heads * SHAPE.seq ** 2
    assert added["backward:attention.dropout"] == pytest.approx(km.memory((2 * SHAPE.dtype_bytes + 1) * scores))
    flash = dataclasses.replace(SHAPE, attention="flash")
    assert kernels(dataclasses.replace(flash, attention_dropout=True), cluster) == kernels(flash, cluster)


def test_masks_are_a_byte_per_element_on_gpus():
    w = load_workload("tiny-vlm")
    cluster = make_cluster(8)
    module = w.modules["llm"]
    b, s = 2, 64

    def layer(**dropout):
        cost = AnalyticCostModel(w, cluster, config=CostModelConfig(attention="unfused", **dropout))
        return MemoryModel(w, cluster, cost).layer_activations(module, b, s, 1)

    plain, hidden, attention = layer(), layer(hidden_dropout=0.1), layer(attention_dropout=0.1)
    assert hidden.full - plain.full == 2 * b * s * module.hidden_size  # two masks of the layer's width
    assert hidden.selective - plain.selective == hidden.full - plain.full
    assert hidden.input == plain.input  # a fully recomputed layer keeps its input alone
    scores = b * module.num_heads * s * s
    assert attention.full - plain.full == scores  # 16 bits: the dropped copy replaces the softmax's cast
    assert attention.selective == plain.selective  # the core's masks are drawn again when it reruns
    assert attention.core_saved - plain.core_saved == scores


def test_plans_charge_dropout():
    """The plan records the planner's dropout, and the simulator charges it as the planner did."""
    w = load_workload("tiny-clip")
    cluster = make_cluster(8)
    plain = make_plan(w, cluster, PlannerConfig(planner="wavefront"))
    config = PlannerConfig(planner="wavefront", hidden_dropout=0.1, attention_dropout=0.1, attention_backend="local")
    plan = make_plan(w, cluster, config)
    assert (plan.settings.hidden_dropout, plan.settings.attention_dropout) == (0.1, 0.1)
    assert execution_cost_config(plan.settings).hidden_dropout == 0.1
    local = make_plan(w, cluster, dataclasses.replace(config, hidden_dropout=0.0, attention_dropout=0.0))
    assert simulate(plan, w, cluster).iteration_time > simulate(local, w, cluster).iteration_time
    assert plain.settings.hidden_dropout == 0.0
    assert "dropout hidden 0.1 attention 0.1" in plan_summary(plan) and "dropout" not in plan_summary(plain)
    with pytest.raises(ValueError, match="--hidden-dropout must be a probability"):
        PlannerConfig(hidden_dropout=1.0)


def test_metaop_costs_grow_with_dropout():
    w = load_workload("tiny-vlm")
    cluster = make_cluster(8)
    m = build_metagraph(w).metaops["caption/llm"]
    plain = AnalyticCostModel(w, cluster, config=CostModelConfig(attention="unfused"))
    dropping = AnalyticCostModel(w, cluster, config=CostModelConfig(attention="unfused", hidden_dropout=0.1))
    assert all(a > b for a, b in zip(dropping.phase_seconds(m, 1, 2), plain.phase_seconds(m, 1, 2)))


def test_a_profile_measured_with_other_dropout_is_refused():
    from megatron_spindle.estimator.profile import Profile
    from megatron_spindle.plan.schema import PlanError
    from megatron_spindle.planner.pipeline import for_cluster
    from megatron_spindle.profiler.settings import ProfilerSettings

    profile = Profile(points={})  # written before the profiler took dropout: measured without
    with pytest.raises(PlanError, match="the profile measured --hidden-dropout 0, the plan is for 0.1: give "
                                        "--hidden-dropout 0, or profile with --hidden-dropout 0.1"):
        for_cluster(PlannerConfig(hidden_dropout=0.1), make_cluster(8), profile)
    assert for_cluster(PlannerConfig(), make_cluster(8), profile).hidden_dropout == 0.0
    measured = Profile(points={}, dropout={"hidden_dropout": 0.1, "attention_dropout": 0.0})
    assert for_cluster(PlannerConfig(hidden_dropout=0.1), make_cluster(8), measured).hidden_dropout == 0.1
    assert ProfilerSettings(attention_dropout=0.2).to_dict()["attention_dropout"] == 0.2  # recorded, a cache key


def test_text_front_ends_drop_their_embeddings():
    w = load_workload("tiny-vlm")
    cluster = make_cluster(8)
    m = build_metagraph(w).metaops["caption/llm.frontend"]
    b, s, h = m.input_shape[0], m.tokens, w.modules["llm"].hidden_size

    def models(**dropout):
        cost = AnalyticCostModel(w, cluster, config=CostModelConfig(**dropout))
        return cost, MemoryModel(w, cluster, cost)

    (c0, m0), (c1, m1) = models(), models(hidden_dropout=0.1)
    assert m1.activation_bytes(m, 1, 1, 1) - m0.activation_bytes(m, 1, 1, 1) == b * s * h  # a byte per element
    d = c0.dtype_bytes
    assert c1.memory_bytes(m) - c0.memory_bytes(m) == 2 * (2 * d + 1) * b * s * h  # each phase's kernel
    patches = build_metagraph(w).metaops["caption/vision.frontend"]
    assert c1.memory_bytes(patches) == c0.memory_bytes(patches)
