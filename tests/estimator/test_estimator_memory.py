import pytest
from conftest import clip_like_spec

from megatron_spindle.estimator import AnalyticCostModel, EstimatorError, MemoryModel
from megatron_spindle.estimator.cost_model import CostModelConfig
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import workload_from_dict
from megatron_spindle.plan.schema import Recompute


def test_param_state_is_18_bytes_per_param_split_by_tp(tiny_clip, cluster8):
    workload, _ = tiny_clip
    memory = MemoryModel(workload, cluster8, tp_sharded_grads=False)
    count = AnalyticCostModel(workload, cluster8).param_count("vision.layers.0")
    assert memory.param_state_bytes("vision.layers.0", 1) == 18 * count
    assert memory.param_state_bytes("vision.layers.0", 4) == 18 * count / 4
    # one device's share at ZeRO 0 in whole units: the whole unit's gradient and optimizer state
    assert memory.param_state_bytes("vision.layers.0", 4, 1) == (2 / 4 + 16) * count
    sharded = MemoryModel(workload, cluster8)  # by TP shard, the default
    assert sharded.param_state_bytes("vision.layers.0", 4, 1) == 18 * count / 4


def test_slice_param_state_sums_its_layers(tiny_clip, cluster8):
    workload, graph = tiny_clip
    memory = MemoryModel(workload, cluster8)
    vision = graph.metaops["vision_depth/vision"]
    one = memory.param_state_bytes("vision.layers.0", 2, 1)
    assert memory.slice_param_state_bytes(vision, 2, 1, 4) == pytest.approx(3 * one)
    with pytest.raises(EstimatorError, match=r"layers \[2, 7\)"):
        memory.slice_param_state_bytes(vision, 1, 2, 7)


def test_layer_activations_are_what_megatron_core_saves(cluster8):
    """A GELU encoder layer, F = 4H, no GQA, T = b*s tokens, bf16: both norms' inputs, outputs and fp32 mean and
    rstd, the QKV output, the attention output, the MLP's biased FC1 output and GELU output:
    T*h*2*(4 + 12/t) + 16*T bytes, plus the softmax output 6*a*s^2*b/t (fp32, and bf16 again) unfused or the
    fp32 log-sum-exp 4*a*s*b/t with FlashAttention (Korthikanti et al.'s s*b*h*(10 + 24/t + 5*a*s/(h*t))
    counts dropout masks, which our operators do not make)."""
    workload = workload_from_dict(clip_like_spec())
    vision = build_metagraph(workload).metaops["vt/vision"]
    s, h, a = 257, 1024, 16
    for attention in ("unfused", "flash"):
        memory = MemoryModel(workload, cluster8, AnalyticCostModel(workload, cluster8, config=CostModelConfig(
            attention=attention)))
        for tp, dp in ((1, 1), (2, 4), (8, 1)):
            b = 256 / dp
            core = 6 * a * s * s * b / tp if attention == "unfused" else 4 * a * s * b / tp
            expected = s * b * h * 2 * (4 + 12 / tp) + 16 * s * b + core
            assert memory.activation_bytes(vision, tp, dp, 1) == pytest.approx(expected)
            assert memory.activation_bytes(vision, tp, dp, 2) == pytest.approx(2 * expected)


def test_recomputation_keeps_less_and_needs_one_layer_while_it_reruns(cluster8):
    workload = workload_from_dict(clip_like_spec(num_layers=6))
    vision = build_metagraph(workload).metaops["vt/vision"]
    memory = MemoryModel(workload, cluster8, AnalyticCostModel(workload, cluster8, config=CostModelConfig(
        attention="unfused")))
    layer = memory.layer_activations(workload.modules["vision"], 256, 257, 1)
    assert layer.input == 256 * 257 * 1024 * 2 and layer.selective < layer.full
    assert layer.full - layer.selective == pytest.approx(6 * 16 * 257 * 257 * 256)  # the softmax output
    L = vision.num_layers
    assert memory.activation_memory(vision, 1, 1, L, Recompute()) == (L * layer.full, 0.0)
    # rerunning the core needs its tensors beyond the MLP's and the second norm's, freed by then
    rerun_core = max(0.0, layer.core_saved - layer.mlp - (layer.norm + layer.input))
    assert memory.activation_memory(vision, 1, 1, L, Recompute("selective")) == (L * layer.selective, rerun_core)
    assert memory.activation_memory(vision, 1, 1, L, Recompute("full")) == (L * layer.input, layer.full - layer.input)
    held, transient = memory.activation_memory(vision, 1, 1, L, Recompute("full", 3))
    assert held == (L - 3) * layer.full + 3 * layer.input and transient == 0.0
    assert memory.activation_memory(vision, 1, 1, L, Recompute("full", 2, "uniform")) == (
        L // 2 * layer.input, 2 * layer.full - layer.input)
    # full for 3 layers, the pre-norms rerun in the others: the backward reaches the full block last
    sel_held, sel_transient = layer.selective_memory(("layernorm",))
    held, transient = memory.activation_memory(vision, 1, 1, L, Recompute("full", 3, modules=("layernorm",)))
    assert held == pytest.approx((L - 3) * sel_held + 3 * layer.input)
    assert transient == pytest.approx(max(sel_transient, 2 * layer.input + layer.full - held))
    default = MemoryModel(workload, cluster8, AnalyticCostModel(workload, cluster8, config=CostModelConfig(
        attention="unfused", recompute=True)))
    assert default.activation_bytes(vision, 1, 1, L) == L * layer.input


def test_activations_shrink_with_dp_and_tp_and_grow_with_layers(tiny_vlm, cluster8):
    workload, graph = tiny_vlm
    memory = MemoryModel(workload, cluster8)
    llm = graph.metaops["caption/llm"]
    base = memory.activation_bytes(llm, 1, 1, 1)
    assert memory.activation_bytes(llm, 1, 2, 1) == pytest.approx(base / 2, rel=0.02)  # RoPE cos/sin per position
    assert memory.activation_bytes(llm, 2, 1, 1) < base
    assert memory.activation_bytes(llm, 1, 1, 3) == pytest.approx(3 * base)
    assert memory.activation_bytes(llm, 1, 1, 0) == 0


def test_light_ops_hold_less_than_a_layer(tiny_vlm, cluster8):
    workload, graph = tiny_vlm
    memory = MemoryModel(workload, cluster8)
    layer = memory.activation_bytes(graph.metaops["caption/vision"], 1, 1, 1)
    for metaop_id in ("caption/vision.frontend", "caption/llm.frontend", "caption/vis_proj"):
        light = memory.activation_bytes(graph.metaops[metaop_id], 1, 1, 1)
        assert 0 < light < layer, metaop_id


def test_bad_memory_queries_are_rejected(tiny_clip, cluster8):
    workload, graph = tiny_clip
    memory = MemoryModel(workload, cluster8)
    vision = graph.metaops["vision_depth/vision"]
    with pytest.raises(EstimatorError, match="does not divide the batch"):
        memory.activation_bytes(vision, 1, 3, 1)
    with pytest.raises(EstimatorError, match="num_layers must be an integer in 0..4"):
        memory.activation_bytes(vision, 1, 1, 5)
    with pytest.raises(EstimatorError, match="tp must be a positive integer"):
        memory.param_state_bytes("vision.layers.0", 0)


def test_sequence_parallelism_divides_the_norms_and_the_layer_input_where_it_applies(cluster8):
    """257 tokens (ViT): at TP 2 a bidirectional encoder does not run sequence-parallel (the sequence does not
    divide) and keeps everything; a causal module of the same shape is padded to 258 tokens, its norms and input
    divided by TP; TP 1 never runs it. The plan's setting reaches the numbers through ZeroSharded."""
    from megatron_spindle.plan.memory import ZeroSharded

    workload = workload_from_dict(clip_like_spec(num_layers=2))
    vision = build_metagraph(workload).metaops["vt/vision"]
    memory = MemoryModel(workload, cluster8, AnalyticCostModel(workload, cluster8))
    module = workload.modules["vision"]
    b = vision.batch
    plain, split = (memory.layer_activations(module, b, 257, 2, sp) for sp in (False, True))
    h, d = module.hidden_size, memory.dtype_bytes
    assert split.input == b * 129 * h * d and plain.input == b * 257 * h * d
    assert split.norm < plain.norm and split.mlp > plain.mlp  # the MLP on the padded 258 tokens
    assert memory.activation_memory(vision, 2, 1, 2, Recompute(), sequence_parallel=True) == \
        memory.activation_memory(vision, 2, 1, 2, Recompute())  # 257 does not divide by 2: not applied
    causal = workload_from_dict(clip_like_spec(num_layers=2, causal=True))
    on = MemoryModel(causal, cluster8, AnalyticCostModel(causal, cluster8), sequence_parallel=True)
    metaop = build_metagraph(causal).metaops["vt/vision"]
    assert on.activation_memory(metaop, 2, 1, 2, Recompute()) == (2 * split.full, 0.0)
    assert on.activation_memory(metaop, 1, 1, 2, Recompute()) == memory.activation_memory(vision, 1, 1, 2, Recompute())
    assert ZeroSharded(on, 0, False).activation_memory(metaop, 2, 1, 2, Recompute()) == (2 * plain.full, 0.0)
