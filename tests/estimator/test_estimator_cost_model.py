import pytest
from conftest import clip_like_spec

from megatron_spindle.estimator import AnalyticCostModel, CostModelConfig, EstimatorError, LayerCost
from megatron_spindle.estimator.kernels import KernelModel
from megatron_spindle.estimator.op_kernels import layer_time
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import workload_from_dict


def test_encoder_layer_flops_match_a_hand_count(tiny_clip, cluster8):
    workload, graph = tiny_clip
    model = AnalyticCostModel(workload, cluster8)
    # tiny-clip vision: B=4, S=17, H=64, 4 heads (no GQA), FFN 256, GELU MLP.
    qkv = 2 * 4 * 17 * 64 * (3 * 64)
    attention = 4 * 4 * 17 * 17 * 64
    out_proj = 2 * 4 * 17 * 64 * 64
    mlp = 2 * (2 * 4 * 17 * 64 * 256)
    assert model.flops(graph.metaops["vision_depth/vision"]) == 3 * (qkv + attention + out_proj + mlp)


def test_llm_layer_flops_use_gqa_and_swiglu(tiny_vlm, cluster8):
    workload, graph = tiny_vlm
    model = AnalyticCostModel(workload, cluster8)
    # tiny-vlm llm in "caption": B=4, S=25, H=64, 4 heads in 2 query groups (KV width 32), FFN 176, SwiGLU.
    qkv = 2 * 4 * 25 * 64 * (64 + 2 * 32)
    attention = 4 * 4 * 25 * 25 * 64
    out_proj = 2 * 4 * 25 * 64 * 64
    mlp = 3 * (2 * 4 * 25 * 64 * 176)
    assert model.flops(graph.metaops["caption/llm"]) == 3 * (qkv + attention + out_proj + mlp)


def test_light_op_flops(tiny_clip, tiny_vlm, cluster8):
    workload, graph = tiny_clip
    model = AnalyticCostModel(workload, cluster8)
    # patch frontend of vision: conv 3 x 4 x 4 -> 64 per token, B=4, 17 tokens.
    assert model.flops(graph.metaops["vision_depth/vision.frontend"]) == 3 * 2 * 4 * 17 * (3 * 16) * 64
    # audio frontend: 1D windows of 4 frames x 16 mel bins -> 48, B=8, 16 tokens.
    assert model.flops(graph.metaops["text_audio/audio.frontend"]) == 3 * 2 * 8 * 16 * (16 * 4) * 48
    assert model.flops(graph.metaops["text_audio/text.frontend"]) == 0  # gather: memory-bound
    assert model.memory_bytes(graph.metaops["text_audio/text.frontend"]) > 0
    assert model.flops(graph.metaops["text_audio/text.head"]) == 3 * 2 * 8 * 32 * 32
    assert model.flops(graph.metaops["text_audio/loss"]) == 3 * 2 * 8 * 8 * 32
    workload, graph = tiny_vlm
    model = AnalyticCostModel(workload, cluster8)
    assert model.flops(graph.metaops["caption/vis_proj"]) == 3 * 2 * 4 * 17 * (48 * 64 + 64 * 64)
    assert model.flops(graph.metaops["caption/llm.lm_head"]) == 3 * 2 * 4 * 25 * 64 * 256


def test_cross_attention_adds_an_attention_block(cluster8):
    plain = workload_from_dict(clip_like_spec())
    crossed = workload_from_dict(clip_like_spec(cross_attention=True))
    op_plain = build_metagraph(plain).metaops["vt/vision"]
    op_crossed = build_metagraph(crossed).metaops["vt/vision"]
    b, s, h = 256, 257, 1024
    block = 2 * b * s * h * 3 * h + 4 * b * s * s * h + 2 * b * s * h * h
    extra = AnalyticCostModel(crossed, cluster8).flops(op_crossed) - AnalyticCostModel(plain, cluster8).flops(
        op_plain
    )
    assert extra == 3 * block


def test_heavy_metaop_scales_better_than_light_ones(clip_like, cluster8):
    workload, graph = clip_like
    model = AnalyticCostModel(workload, cluster8)

    def speedup(metaop_id, n):
        metaop = graph.metaops[metaop_id]
        return model.layer_cost(metaop, 1, 1).total / model.layer_cost(metaop, 1, n).total

    vision = speedup("vt/vision", 8)
    assert vision > 6  # a ViT-L layer on batch 256: close to linear
    assert vision > speedup("vt/text", 8) > speedup("vt/text.head", 8)
    assert speedup("vt/text.head", 8) < 2


def test_layer_compute_is_the_kernel_models_forward_and_backward(clip_like, cluster8):
    workload, graph = clip_like
    model = AnalyticCostModel(workload, cluster8)
    vision = graph.metaops["vt/vision"]
    shape = model.layer_shape(vision, 2, 4)
    assert (shape.batch, shape.seq, shape.hidden, shape.tp, shape.attention) == (64, 257, 1024, 2, "flash")
    times = layer_time(KernelModel(cluster8.gpu), shape)
    assert model.layer_cost(vision, 2, 4).compute == pytest.approx(times.forward + times.backward)
    fwd, bwd = model.phase_seconds(vision, 2, 4)
    tp_allreduce = model.comm.tp_allreduce_seconds(64 * 257 * 1024 * 2, 2)
    assert fwd == pytest.approx(times.forward + 2 * tp_allreduce)
    assert bwd == pytest.approx(times.backward + 2 * tp_allreduce)
    # a ViT-L layer on 256 samples runs its GEMMs near the measured matmul rate, below it
    tflops = model.flops(vision) / model.layer_cost(vision, 1, 1).compute
    assert 0.6 * cluster8.gpu.matmul_flops < tflops < cluster8.gpu.matmul_flops


def test_unfused_attention_costs_more_than_flash_on_long_sequences(clip_like, cluster8):
    workload, graph = clip_like
    vision = graph.metaops["vt/vision"]
    flash = AnalyticCostModel(workload, cluster8).layer_cost(vision, 1, 1).compute
    unfused = AnalyticCostModel(workload, cluster8, config=CostModelConfig(attention="unfused"))
    assert unfused.layer_cost(vision, 1, 1).compute > flash


def test_tp_comm_only_with_tensor_parallelism(tiny_clip, cluster8):
    workload, graph = tiny_clip
    model = AnalyticCostModel(workload, cluster8)
    vision = graph.metaops["vision_depth/vision"]
    assert model.layer_cost(vision, 1, 4).tp_comm == 0
    assert model.layer_cost(vision, 2, 2).tp_comm > 0
    assert model.layer_cost(vision, 4, 1).tp_comm > model.layer_cost(vision, 2, 1).tp_comm


def test_tensor_parallel_replaces_grad_sync_by_activation_all_reduces(clip_like, cluster8):
    workload, graph = clip_like
    model = AnalyticCostModel(workload, cluster8)
    vision = graph.metaops["vt/vision"]
    dp_only, tp_only = model.layer_cost(vision, 1, 8), model.layer_cost(vision, 8, 1)
    assert tp_only.dp_sync == 0 and dp_only.tp_comm == 0
    assert dp_only.dp_sync > 0 and tp_only.tp_comm > 0


def test_inter_node_collectives_are_slower_than_intra_node(clip_like):
    workload, graph = clip_like
    vision = graph.metaops["vt/vision"]
    two_nodes = AnalyticCostModel(workload, make_cluster(16, gpus_per_node=8))
    one_node = AnalyticCostModel(workload, make_cluster(16, gpus_per_node=16))
    assert two_nodes.layer_cost(vision, 1, 16).dp_sync > one_node.layer_cost(vision, 1, 16).dp_sync
    assert two_nodes.layer_cost(vision, 1, 8).dp_sync == one_node.layer_cost(vision, 1, 8).dp_sync
    volume = 1e8
    assert two_nodes.allreduce_seconds(volume, 8, 16) > two_nodes.allreduce_seconds(volume, 8, 8)


def test_grad_sync_is_an_all_reduce_of_the_operator_params(clip_like, cluster8):
    workload, graph = clip_like
    model = AnalyticCostModel(workload, cluster8)
    vision = graph.metaops["vt/vision"]
    params = model.param_count("vision.layers.0")
    grad_bytes = params * 4  # fp32 grads
    # its bytes at the NVLink bus bandwidth, and its share (params / 40M-parameter bucket) of one latency
    latency = cluster8.collective_latency * params / 40e6
    expected = 2 * 3 / 4 * grad_bytes / cluster8.intra_node_bw + latency
    assert model.layer_cost(vision, 1, 4).dp_sync == pytest.approx(expected)
    assert model.layer_cost(vision, 2, 2).dp_sync == pytest.approx(
        2 * 1 / 2 * grad_bytes / 2 / cluster8.intra_node_bw + cluster8.collective_latency * params / 2 / 40e6
    )
    assert model.layer_cost(vision, 1, 1).dp_sync == 0


def test_bf16_gradients_halve_the_bytes_of_the_sync(clip_like, cluster8):
    workload, graph = clip_like
    vision = graph.metaops["vt/vision"]
    fp32 = AnalyticCostModel(workload, cluster8).layer_cost(vision, 1, 8).dp_sync
    bf16 = AnalyticCostModel(workload, cluster8, config=CostModelConfig(grad_bytes=2)).layer_cost(vision, 1, 8).dp_sync
    latency = cluster8.collective_latency * AnalyticCostModel(workload, cluster8).param_count("vision.layers.0") / 40e6
    assert fp32 - latency == pytest.approx(2 * (bf16 - latency))


def test_launch_floor_bounds_tiny_ops(tiny_clip, cluster8):
    workload, graph = tiny_clip
    model = AnalyticCostModel(workload, cluster8)
    for metaop in graph.metaops.values():
        cost = model.layer_cost(metaop, 1, 1)
        assert cost.compute + cost.launch >= model.launch_floor_seconds(metaop, 1, 1) - 1e-15
        assert cost.total == pytest.approx(
            cost.compute + cost.tp_comm + cost.dp_sync + cost.launch + cost.data_comm
        )


def test_the_launch_floor_is_the_measured_one_on_gpus_and_the_placeholder_on_the_cpu_type(tiny_clip, cluster8):
    from megatron_spindle.estimator.host import (
        CPU_PLACEHOLDER_HOST_SECONDS_PER_KERNEL,
        HOST_SECONDS_PER_KERNEL,
    )

    workload, graph = tiny_clip
    layer = next(m for m in graph.metaops.values() if m.kind == "layer")
    kt = AnalyticCostModel(workload, cluster8).kernel_time(layer, 1, 1)
    kernels = kt.forward_kernels + kt.backward_kernels
    for cluster, config, per_kernel in ((cluster8, None, HOST_SECONDS_PER_KERNEL),
                                        (make_cluster(8, 8, "CPU"), None, CPU_PLACEHOLDER_HOST_SECONDS_PER_KERNEL),
                                        (cluster8, CostModelConfig(launch_seconds=1e-3), 1e-3)):
        model = AnalyticCostModel(workload, cluster, config=config)
        assert model.launch_floor_seconds(layer, 1, 1) == pytest.approx(kernels * per_kernel)


def test_a_rerun_forward_pays_its_launches_where_the_layer_is_host_bound(tiny_clip, cluster8):
    """Full recomputation reruns the forward: GPU-bound, its kernels' seconds (and TP all-reduces); host-bound
    (tiny-clip's layers on an A800), the host launching them again."""
    from megatron_spindle.plan.schema import Recompute

    workload, graph = tiny_clip
    layer = next(m for m in graph.metaops.values() if m.kind == "layer")
    host_bound = AnalyticCostModel(workload, cluster8)
    kt = host_bound.kernel_time(layer, 1, 1)
    assert host_bound.launch_floor_seconds(layer, 1, 1) > kt.total  # the premise: tiny layers wait for the host
    full = host_bound.recompute_seconds(layer, 1, 1, Recompute("full"), 3)
    assert full == pytest.approx(3 * kt.forward_kernels * host_bound.launch_seconds)
    free = AnalyticCostModel(workload, cluster8, config=CostModelConfig(launch_seconds=0.0))
    assert free.recompute_seconds(layer, 1, 1, Recompute("full"), 3) == pytest.approx(3 * kt.forward)
    # full for one layer, the others' modules selectively: the two blocks' seconds
    both = free.recompute_seconds(layer, 1, 1, Recompute("full", 1, modules=("layernorm",)), 3)
    assert both == pytest.approx(kt.forward + free.recompute_seconds(
        layer, 1, 1, Recompute("selective", modules=("layernorm",)), 2))


def test_layer_cost_total_sums_its_parts():
    cost = LayerCost(compute=1.0, tp_comm=0.5, dp_sync=0.25, launch=0.125)
    assert cost.total == 1.875


def test_contrastive_loss_gathers_embeddings_only_with_dp(tiny_clip, cluster8):
    workload, graph = tiny_clip
    model = AnalyticCostModel(workload, cluster8)
    loss = graph.metaops["text_audio/loss"]
    assert model.layer_cost(loss, 1, 1).data_comm == 0
    assert model.layer_cost(loss, 1, 4).data_comm > 0


def test_activation_bytes_per_kind(tiny_clip, tiny_vlm, cluster8):
    workload, graph = tiny_clip
    model = AnalyticCostModel(workload, cluster8)
    assert model.activation_bytes(graph.metaops["vision_depth/vision"]) == 4 * 17 * 64 * 2
    assert model.activation_bytes(graph.metaops["vision_depth/vision.frontend"]) == 4 * 17 * 64 * 2
    assert model.activation_bytes(graph.metaops["vision_depth/vision.head"]) == 4 * 32 * 2  # B x embed_dim
    assert model.activation_bytes(graph.metaops["vision_depth/loss"]) == 0
    workload, graph = tiny_vlm
    model = AnalyticCostModel(workload, cluster8)
    assert model.activation_bytes(graph.metaops["asr/aud_proj"]) == 4 * (16 // 2) * 64 * 2  # pooled by 2
    assert model.activation_bytes(graph.metaops["caption/llm.lm_head"]) == 0


def test_param_counts_by_unit(tiny_clip, tiny_vlm, cluster8):
    workload, _ = tiny_clip
    model = AnalyticCostModel(workload, cluster8)
    h, f = 64, 256  # vision encoder: LayerNorms and biases
    layer = 2 * 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + (2 * h * f + f + h)
    assert model.param_count("vision.layers.3") == layer
    assert model.param_count("vision.frontend") == 3 * 16 * h + h + h + 17 * h  # conv, bias, cls, positions
    assert model.param_count("vision.head") == 2 * h + h * 32
    assert model.param_count("text.frontend") == 128 * 32
    workload, _ = tiny_vlm
    model = AnalyticCostModel(workload, cluster8)
    h, kv, f = 64, 32, 176  # llama style: RMSNorm, GQA, SwiGLU, no biases
    assert model.param_count("llm.layers.0") == 2 * h + h * (h + 2 * kv) + h * h + 3 * h * f
    assert model.param_count("llm.lm_head") == h + h * 256
    assert model.param_count("vis_proj.projector") == 48 * 64 + 64 + 64 * 64 + 64


def test_module_options_add_parameters_and_work(cluster8):
    """pre_norm adds a LayerNorm (params, memory traffic), the conv audio stem two k3 convs (params, FLOPs at the
    frame and token rates), qkv_bias an llm's q/k/v biases; activations add nothing."""
    spec = clip_like_spec()
    base = AnalyticCostModel(workload_from_dict(spec), cluster8)
    h = 1024
    spec = clip_like_spec(frontend={"type": "patch", "image_size": 224, "patch_size": 14, "in_channels": 3,
                                    "pre_norm": True}, activation="quick_gelu")
    w = workload_from_dict(spec)
    model = AnalyticCostModel(w, cluster8)
    assert model.param_count("vision.frontend") == base.param_count("vision.frontend") + 2 * h
    assert model.param_count("vision.layers.0") == base.param_count("vision.layers.0")
    fe = build_metagraph(w).metaops["vt/vision.frontend"]
    assert model.memory_bytes(fe) > base.memory_bytes(build_metagraph(base.workload).metaops["vt/vision.frontend"])
    audio = {"name": "a", "modules": {
        "audio": {"kind": "encoder", "num_layers": 1, "hidden_size": 64, "num_heads": 4, "ffn_hidden_size": 128,
                  "frontend": {"type": "audio", "patch_size": 2, "in_channels": 80, "stem": "conv"}},
        "llm": {"kind": "llm", "num_layers": 1, "hidden_size": 64, "num_heads": 4, "num_query_groups": 2,
                "ffn_hidden_size": 128, "qkv_bias": True, "frontend": {"type": "text", "vocab_size": 100}}},
        "tasks": [{"name": "t", "batch_size": 4, "tokens": {"audio": 10, "llm": 16}, "flows": [["audio", "llm"]],
                   "loss": {"kind": "lm", "module": "llm"}}]}
    w = workload_from_dict(audio)
    model = AnalyticCostModel(w, cluster8)
    h, kv, f = 64, 32, 128
    assert model.param_count("audio.frontend") == 3 * 80 * h + h + 3 * h * h + h
    assert model.param_count("llm.layers.0") == 2 * h + h * (h + 2 * kv) + (h + 2 * kv) + h * h + 3 * h * f
    fe = build_metagraph(w).metaops["t/audio.frontend"]
    assert model.forward_flops(fe) == 2.0 * 4 * 10 * (2 * 3 * 80 * h + 3 * h * h)


def test_param_count_of_a_per_task_owner(cluster8):
    spec = clip_like_spec(shared=False)
    workload = workload_from_dict(spec)
    graph = build_metagraph(workload)
    model = AnalyticCostModel(workload, cluster8)
    units = model.param_units(graph.metaops["vt/vision"])
    assert units == ["vision@vt.layers.0", "vision@vt.layers.1"]
    assert model.param_count("vision@vt.layers.1") == model.param_count("vision.layers.1")
    assert model.operator_param_count(graph.metaops["vt/vision"]) == model.param_count("vision.layers.0")


@pytest.mark.parametrize(
    "name, message",
    [
        ("vision", "expected '<module>.<unit>'"),
        ("ghost.layers.0", "module 'ghost'"),
        ("vision.layers.9", "layer index"),
        ("vision.projector", "not a projector"),
        ("vision.lm_head", "no vocab_size"),
        ("vision.weird", "unknown unit 'weird'"),
    ],
)
def test_bad_param_names_are_clear_errors(tiny_clip, cluster8, name, message):
    workload, _ = tiny_clip
    with pytest.raises(EstimatorError, match=message):
        AnalyticCostModel(workload, cluster8).param_count(name)


def test_invalid_configs_are_rejected(tiny_clip, cluster8):
    workload, graph = tiny_clip
    model = AnalyticCostModel(workload, cluster8)
    with pytest.raises(EstimatorError, match="does not divide the batch"):
        model.layer_cost(graph.metaops["vision_depth/vision"], 1, 3)
    with pytest.raises(EstimatorError, match="tp 2 is not valid"):
        model.layer_cost(graph.metaops["vision_depth/vision.head"], 2, 1)
    with pytest.raises(EstimatorError, match="tp must be a positive integer"):
        model.layer_cost(graph.metaops["vision_depth/vision"], 0, 1)


@pytest.mark.parametrize("kwargs, message", [
    ({"memory_efficiency": 1.5}, "memory_efficiency"),
    ({"grad_bytes": 3}, "grad_bytes must be 2"),
    ({"attention": "sparse"}, "attention must be one of"),
    ({"launch_seconds": -1.0}, "launch_seconds"),
])
def test_bad_cost_model_constants_are_rejected(kwargs, message):
    with pytest.raises(EstimatorError, match=message):
        CostModelConfig(**kwargs)


def test_the_host_floor_splits_by_the_measured_weight_of_a_forward_kernel():
    """Hand-computed: 10 forward and 20 backward kernels at 1 ms each, a forward kernel weighing 2.6 backward
    ones: the host spends 30 ms, 30 * 26 / 46 = 16.96 ms of it on the forward."""
    from megatron_spindle.estimator.host import HOST_FORWARD_KERNEL_WEIGHT, phase_times
    from megatron_spindle.estimator.op_kernels import LayerTime

    assert HOST_FORWARD_KERNEL_WEIGHT == 2.6
    host_forward = 30e-3 * 26 / 46
    # host-bound in both phases: the host's own split
    fwd, bwd = phase_times(LayerTime(1e-3, 2e-3, 10, 20), 0, 0.0, 1e-3)
    assert (fwd, bwd) == pytest.approx((host_forward, 30e-3 - host_forward))
    # GPU-bound in both: the kernels' time
    assert phase_times(LayerTime(20e-3, 40e-3, 10, 20), 0, 0.0, 1e-3) == pytest.approx((20e-3, 40e-3))
    # the forward waits for the host, the backward for the GPU: the backward's kernels cannot start before the
    # forward's end, so the layer takes more than either total (16.96 + 20 ms > 30 ms of host, 25 ms of GPU)
    fwd, bwd = phase_times(LayerTime(5e-3, 20e-3, 10, 20), 0, 0.0, 1e-3)
    assert (fwd, bwd) == pytest.approx((host_forward, 20e-3))
    # the forward's GPU work outlasts the host's, which runs ahead into the backward: max of the totals
    fwd, bwd = phase_times(LayerTime(25e-3, 2e-3, 10, 20), 0, 0.0, 1e-3)
    assert (fwd, bwd) == pytest.approx((25e-3, 5e-3))
    # the CPU type (one thread issues and runs): the larger total, split like the kernels' time
    assert phase_times(LayerTime(1e-3, 2e-3, 10, 20), 0, 0.0, 1e-3, None) == pytest.approx((10e-3, 20e-3))
    from megatron_spindle.estimator.host import host_forward_kernel_weight
    from megatron_spindle.graph.cluster import GPU_TYPES

    assert host_forward_kernel_weight(GPU_TYPES["CPU"]) is None
    assert host_forward_kernel_weight(GPU_TYPES["A800-80GB"]) == HOST_FORWARD_KERNEL_WEIGHT
