"""The per-kernel model (estimator/kernels.py, op_kernels.py) and the communication model (comm_model.py) against
hand-computed values."""

import dataclasses

import pytest

from megatron_spindle.estimator import AnalyticCostModel, CostModelConfig, EstimatorError
from megatron_spindle.estimator.comm_model import (
    OVERLAP_SLOWDOWN,
    CommModel,
    GroupPlacement,
    grad_buckets,
    overlapped_backward_seconds,
)
from megatron_spindle.estimator.kernels import (
    AMPERE_FLASH,
    FAMILIES,
    FLASH_FORWARD_SPEEDUP,
    GPU_KERNEL_GAP_SECONDS,
    HOPPER_UNALIGNED_RATE,
    KernelFamily,
    KernelModel,
    Tile,
)
from megatron_spindle.estimator.op_kernels import LayerShape, layer_kernel, layer_time
from megatron_spindle.graph.cluster import GPU_TYPES, HBM_STREAM_EFFICIENCY, make_cluster
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.plan.schema import REDUCE_DTYPE_BYTES

A800 = GPU_TYPES["A800-80GB"]
SM_RATE = 267.9e12 / 108  # the measured matmul rate (C1) shared by A800's 108 SMs


TILE_128 = Tile(128, 128, 32, 1.0)


def one_tile_model(tile=TILE_128, overhead=0) -> KernelModel:
    """A800 with a single tile shape, no split-K, no kernel gap and HBM too fast to bind: GEMM times are the tile
    model's, computable by hand."""
    return KernelModel(dataclasses.replace(A800, memory_bandwidth=1e18),
                       family=KernelFamily((tile,), overhead, (1,), AMPERE_FLASH, 0.0))


# ------------------------------------------------------------------------------------------------ GEMMs


def test_a_gemm_one_tile_over_a_wave_takes_two_waves():
    km = one_tile_model()
    one_wave = km.gemm(128 * 108, 128, 4096)  # 108 tiles of 128 x 128: one per SM
    tile_seconds = 2 * 128 * 128 * 4096 / SM_RATE
    assert one_wave == pytest.approx(tile_seconds)
    assert km.gemm(128 * 109, 128, 4096) == pytest.approx(2 * tile_seconds)  # 109 tiles: a second wave
    assert km.gemm(128 * 216, 128, 4096) == pytest.approx(2 * tile_seconds)  # 216 tiles: still two
    # a partial tile costs a whole one (tile quantisation)
    assert km.gemm(128 * 108 - 1, 127, 4090) == pytest.approx(2 * 128 * 128 * 4096 / SM_RATE)


def test_the_main_loop_has_a_fixed_prologue_and_epilogue():
    km = one_tile_model(overhead=4)
    assert km.gemm(128 * 108, 128, 64) == pytest.approx(2 * 128 * 128 * 32 * (2 + 4) / SM_RATE)


def test_full_waves_with_long_k_reach_the_measured_matmul_rate_never_more():
    km = KernelModel(A800)
    rate = km.gemm_rate(256 * 108 * 4, 128 * 8, 16384)
    assert 0.95 * 267.9e12 < rate <= 267.9e12
    for shape in [(1000, 1000, 1000), (4096, 4096, 4096), (257 * 64, 3072, 1024), (64, 64, 64)]:
        assert km.gemm_rate(*shape) <= 267.9e12
    # the best tile and split-K are picked: a short-and-wide weight gradient beats the one-tile model
    assert km.gemm(1024, 1024, 65536) < one_tile_model(Tile(256, 128, 32, 1.0), 4).gemm(1024, 1024, 65536)


def test_a_gemm_takes_at_least_its_operands_hbm_traffic():
    km = KernelModel(A800)
    bandwidth = A800.memory_bandwidth * HBM_STREAM_EFFICIENCY
    # the unfused attention's product by P on the audio tower (384 heads of 229 x 64 x 229): the tiles alone
    # would take 24 us, reading P and V and writing the context in bf16 takes 36 us
    traffic = 2 * 384 * (229 * 229 + 229 * 64 + 229 * 64) / bandwidth
    assert one_tile_model(Tile(128, 64, 32, 0.82), 4).gemm(229, 64, 229, 384) < traffic
    assert km.gemm(229, 64, 229, 384) == pytest.approx(traffic + GPU_KERNEL_GAP_SECONDS)
    # an output 128 wide does about 127 FLOP per byte moved, under the A800's ~155 (its matmul rate over its
    # bandwidth), whatever K: the traffic binds; 256 wide does about 251 and the tiles bind
    tiles = KernelModel(A800, family=KernelFamily((TILE_128,), 0, (1,), AMPERE_FLASH, 0.0))
    m, k = 128 * 108, 4096
    assert tiles.gemm(m, 128, k) == pytest.approx(2 * (m * k + k * 128 + m * 128) / bandwidth)
    assert tiles.gemm(m, 128, k) > one_tile_model().gemm(m, 128, k)
    assert tiles.gemm(m, 256, k) == pytest.approx(one_tile_model().gemm(m, 256, k))


def test_unaligned_gemms_run_at_the_fallback_rate_on_hopper_only():
    h100 = GPU_TYPES["H100"]
    tiles = KernelFamily((Tile(128, 128, 64, 1.0),), 0, (1,), None, 0.0, HOPPER_UNALIGNED_RATE)
    km = KernelModel(dataclasses.replace(h100, memory_bandwidth=1e18), family=tiles)
    # one wave of 128 x 128 tiles, K of 4 steps: the tile time at the SM's rate, then at 0.30 of it
    aligned = 2 * 128 * 128 * 256 / (h100.achievable_matmul_flops / h100.sm_count)
    assert km.gemm(128 * h100.sm_count, 128, 256) == pytest.approx(aligned)
    assert km.gemm(128 * h100.sm_count, 128, 256, aligned=False) == pytest.approx(aligned / HOPPER_UNALIGNED_RATE)
    # Ampere's cost of misalignment is unmeasured: none charged
    a800 = KernelModel(A800)
    assert a800.gemm(257, 257, 80, 512, aligned=False) == a800.gemm(257, 257, 80, 512)


def test_unfused_attention_at_an_odd_token_count_charges_the_unaligned_products():
    km = KernelModel(GPU_TYPES["H100"])
    kernels = {}
    for seq in (256, 257, 264):
        shape = LayerShape(32, seq, 1280, 16, 5120, attention="unfused")
        lt = layer_time(km, shape)
        kernels[seq] = {k.name: k.seconds for k in lt.kernels}
        assert shape.scores_aligned == (seq != 257)
    products = ("attention.qk", "attention.pv")
    for name in products:  # the aligned neighbours bracket the same work; 257 pays the fallback rate
        assert kernels[257][name] > 2 * kernels[264][name] > 2 * kernels[256][name]
        assert kernels[257][name] == km.gemm(*((257, 257, 80) if name.endswith("qk") else (257, 80, 257)), 512,
                                            aligned=False)
    assert kernels[257]["fc1"] == pytest.approx(kernels[256]["fc1"] * 257 / 256, rel=0.05)  # linears unchanged


def test_megatron_core_linears_add_their_bias_apart_and_join_the_qkv_gradients_in_a_copy():
    km = KernelModel(A800)
    t, h, f = 8 * 256, 1024, 4096
    local = LayerShape(8, 256, h, 16, f, attention="unfused")  # plan/schema attention_kernels("local")

    def kernels(shape):
        return {(k.phase, k.name): k.seconds for k in layer_time(km, shape).kernels}

    mine = kernels(local)
    assert mine["backward", "qkv_split_copy"] == pytest.approx(km.memory(2 * t * 3 * h * 2))  # read 3, write 1
    assert mine["forward", "qkv.bias"] == pytest.approx(km.memory(2 * t * 3 * h * 2))
    assert mine["forward", "fc1.bias"] == pytest.approx(km.memory(2 * t * f * 2))  # bias_activation_fusion off
    te = kernels(dataclasses.replace(local, attention="flash"))  # TE's spec: bias in the GEMM, SplitAlongDim
    assert {n for _, n in te} & {"qkv_split_copy", "qkv.bias"} == set() and ("forward", "fc1.bias") in te
    legacy = kernels(dataclasses.replace(local, attention="flash", te_linears=False, bias_gelu_fusion=True))
    assert ("forward", "qkv.bias") in legacy and ("backward", "qkv_split_copy") in legacy
    assert ("forward", "fc1.bias") not in legacy  # Megatron-LM's fused bias-GELU
    llama = kernels(dataclasses.replace(local, bias=False))
    assert {n for _, n in llama} & {"qkv.bias", "fc1.bias"} == set() and ("backward", "qkv_split_copy") in llama
    separate = kernels(dataclasses.replace(local, fused_qkv=False))  # HF's q, k, v linears: nothing to join
    assert ("backward", "qkv_split_copy") not in separate


def test_cpu_gemms_are_flops_at_the_matmul_rate():
    km = KernelModel(GPU_TYPES["CPU"])
    assert km.gemm(100, 30, 7) == pytest.approx(2 * 100 * 30 * 7 / 50e9)
    assert km.memory(1e6) == pytest.approx(1e6 / (20e9 * HBM_STREAM_EFFICIENCY))


# -------------------------------------------------------------------------------------------- attention


def test_flash_attention_follows_the_fa2_curve_and_its_grid():
    km = KernelModel(A800)
    batch, heads, seq, hd = 27, 4, 512, 64  # 27 x 4 x (512 / 128) = 432 blocks = 4 full waves
    flops = 4 * batch * heads * seq * seq * hd
    rate = 189.5e12 * seq / (seq + 223.0)
    total = 3.5 * flops / rate
    share = 1 / (1 + 2.5 * FLASH_FORWARD_SPEEDUP)
    fwd, bwd = km.flash_attention(batch, heads, seq, seq, hd)
    assert fwd == pytest.approx(share * total + GPU_KERNEL_GAP_SECONDS)
    assert bwd == pytest.approx((1 - share) * total + GPU_KERNEL_GAP_SECONDS)
    # 433 blocks take five waves (5 x 108 block slots) where 432 take four; 200 query rows pad to 256
    odd = km.flash_attention(1, 433, 128, 128, hd)
    full = km.flash_attention(1, 432, 128, 128, hd)
    assert odd[0] - GPU_KERNEL_GAP_SECONDS == pytest.approx((full[0] - GPU_KERNEL_GAP_SECONDS) * 5 / 4)
    padded = km.flash_attention(1, 432, 200, 200, hd)[0] - GPU_KERNEL_GAP_SECONDS
    per_flop = 189.5e12 * 200 / (200 + 223.0)
    # 432 heads x 2 query blocks = 864 blocks = 8 full waves; the 200 rows run as 256
    assert padded == pytest.approx(share * 3.5 * 4 * 432 * 200 * 200 * hd / per_flop * 256 / 200)
    assert km.flash_rate(8, 16, 2048, 128) > km.flash_rate(8, 16, 512, 128)  # longer sequences are more efficient


def test_unfused_attention_moves_the_score_matrix_through_memory():
    km = KernelModel(A800)

    def softmax_seconds(seq, fused=True):
        shape = LayerShape(8, seq, 1024, 16, 4096, attention="unfused", fused_softmax=fused)
        return next(k.seconds for k in layer_time(km, shape).kernels if k.name == "attention.softmax")

    scores = 8 * 16 * 1024 * 1024  # batch x heads x s x s
    bandwidth = A800.memory_bandwidth * HBM_STREAM_EFFICIENCY
    assert softmax_seconds(1024) == pytest.approx(2 * 2 * scores / bandwidth + GPU_KERNEL_GAP_SECONDS)  # bf16 r+w
    assert softmax_seconds(2048) - GPU_KERNEL_GAP_SECONDS == pytest.approx(
        4 * (softmax_seconds(1024) - GPU_KERNEL_GAP_SECONDS))
    # megatron-core's torch fallback: fp32 cast (2 + 4), softmax (4 + 4), cast back (4 + 2) bytes per score
    assert softmax_seconds(1024, fused=False) == pytest.approx(20 * scores / bandwidth + 3 * GPU_KERNEL_GAP_SECONDS)
    flash = layer_time(km, LayerShape(8, 2048, 1024, 16, 4096, attention="flash")).total
    assert layer_time(km, LayerShape(8, 2048, 1024, 16, 4096, attention="unfused")).total > flash


def test_memory_bound_kernels_run_at_the_achieved_bandwidth():
    km = KernelModel(A800)
    assert km.memory(1e9, kernels=3) == pytest.approx(1e9 / (2.039e12 * 0.85) + 3 * GPU_KERNEL_GAP_SECONDS)
    shape = LayerShape(4, 128, 1024, 16, 4096)
    norm = next(k for k in layer_time(km, shape).kernels if k.name == "norm1" and k.phase == "forward")
    assert norm.seconds == pytest.approx(2 * 4 * 128 * 1024 * 2 / (2.039e12 * 0.85) + GPU_KERNEL_GAP_SECONDS)
    # each kernel carries the bytes it is charged, which gpu_validate holds a measurement against (layer_kernel)
    assert norm.nbytes == 2 * 4 * 128 * 1024 * 2 and norm == layer_kernel(km, shape, "forward", "norm1")
    back = layer_kernel(km, shape, "backward", "norm1")
    assert (back.nbytes, back.launches) == (2 * norm.nbytes, 2)
    assert layer_kernel(km, shape, "forward", "qkv").nbytes == 0  # a GEMM
    with pytest.raises(EstimatorError, match="no single backward kernel 'attention.softmax'"):
        layer_kernel(km, shape, "backward", "attention.softmax")  # FlashAttention: one kernel, "attention"


def test_layer_shape_rejects_what_megatron_core_rejects():
    with pytest.raises(EstimatorError, match="tp 3 does not divide the heads"):
        LayerShape(1, 8, 96, 4, 96, tp=3)
    with pytest.raises(EstimatorError, match="not a multiple of heads"):
        LayerShape(1, 8, 100, 3, 64)
    assert set(FAMILIES) == {"ampere", "hopper", "cpu"}


def test_recomputation_reruns_the_forward_in_the_backward():
    km = KernelModel(A800)
    shape = LayerShape(8, 257, 1280, 16, 5120)
    plain, again = layer_time(km, shape), layer_time(km, shape, recompute=True)
    assert again.forward == plain.forward
    assert again.backward == pytest.approx(plain.backward + plain.forward)


def test_sequence_parallelism_runs_the_norms_on_a_part_and_swaps_each_all_reduce_for_two_collectives():
    """A 70B LLM layer at TP 8: the same kernels but the norms' and residual adds' memory passes divided by 8, and
    each TP all-reduce an all-gather and a reduce-scatter of the same activation (one more latency each). The
    cost model pads a causal module's sequence and leaves a bidirectional one that does not divide alone."""
    km = KernelModel(A800)
    shape = LayerShape(1, 2048, 8192, 64, 28672, kv_groups=8, swiglu=True, causal=True, tp=8, bias=False, rotary=True)
    plain, split = layer_time(km, shape), layer_time(km, dataclasses.replace(shape, sequence_parallel=True))
    norms = {k.name: k.seconds for k in plain.kernels if k.name.split(".")[0] in ("norm1", "norm2", "residual1",
                                                                                "residual2")}
    parts = {k.name: k.seconds for k in split.kernels if k.name in norms}
    assert len(norms) == 4 and parts.keys() == norms.keys() and all(parts[k] < norms[k] for k in norms)
    others = [(k.name, k.seconds) for k in plain.kernels if k.name not in norms]
    assert others == [(k.name, k.seconds) for k in split.kernels if k.name not in norms]
    comm = CommModel(make_cluster(8))
    nbytes = shape.tp_allreduce_bytes
    ar, ag = comm.tp_collective_seconds(nbytes, 8), comm.tp_collective_seconds(nbytes, 8, sequence_parallel=True)
    assert ag == comm.all_gather(nbytes, GroupPlacement.strided(8, 1, make_cluster(8))) and ag < ar < 2 * ag
    assert dataclasses.replace(shape, sequence_parallel=True).tp_collectives == 2 * shape.tp_collectives == 4
    # through the cost model: a bidirectional tower of an odd token count keeps it off; the LLM's are padded
    w = load_workload("tiny-vlm")
    metaops = build_metagraph(w).metaops
    on = AnalyticCostModel(w, make_cluster(8), config=CostModelConfig(sequence_parallel=True))
    llm = next(m for m in metaops.values() if m.kind == "layer" and m.module == "llm")
    assert on.sequence_parallel(llm, 2) and not on.sequence_parallel(llm, 1)
    assert on.layer_shape(llm, 2, 1).seq == -(-llm.tokens // 2) * 2
    odd = next(m for m in metaops.values() if m.kind == "layer" and m.tokens % 2)
    assert not on.sequence_parallel(odd, 2), odd.id


# -------------------------------------------------------------------------------------------- collectives


def test_a_collective_pays_one_latency():
    comm = CommModel(make_cluster(16))  # 2 nodes of 8 A800
    tiny = 8.0
    assert comm.all_reduce(tiny, GroupPlacement((8,))) == pytest.approx(43.83e-6, rel=1e-3)
    assert comm.all_reduce(tiny, GroupPlacement((1, 1))) == pytest.approx(19.9e-6, rel=1e-3)
    assert comm.all_reduce(tiny, GroupPlacement((8, 8))) == pytest.approx(43.83e-6 + 19.9e-6, rel=1e-3)
    assert comm.all_reduce(1e9, GroupPlacement((1,))) == 0.0


def test_bus_bandwidth_inside_a_node_and_across_nodes():
    cluster = make_cluster(16)
    comm = CommModel(cluster)
    nbytes = 2**30
    t = comm.all_reduce(nbytes, GroupPlacement((8,)))
    assert t == pytest.approx(43.83e-6 + 2 * 7 / 8 * nbytes / cluster.intra_node_bw)
    t = comm.all_gather(nbytes, GroupPlacement((8, 8)))  # 8 rails per node do not bind, the ring does
    assert t == pytest.approx(43.83e-6 + 19.9e-6 + 15 / 16 * nbytes / cluster.inter_node_bw)
    t = comm.all_gather(nbytes, GroupPlacement((2, 2)))  # 2 GPUs per node: their 2 network paths bind
    assert t == pytest.approx(43.83e-6 + 19.9e-6 + 3 / 4 * nbytes / (2 * cluster.network_rail_bw))
    t = comm.send_recv(nbytes, cross_node=True)
    assert t == pytest.approx(19.9e-6 + nbytes / cluster.network_rail_bw)
    with pytest.raises(EstimatorError, match="collective must be one of"):
        comm.collective_seconds("broadcast", 1.0, GroupPlacement((2,)))


def test_an_all_to_all_moves_a_ranks_buffer_at_the_all_gathers_bus_bandwidth():
    """No measured all-to-all point exists (cost-model-data.md): the model's assumption is an all-gather's bus
    bandwidth, the nccl-tests factor (n-1)/n of a rank's buffer, and one latency."""
    cluster = make_cluster(16)
    comm = CommModel(cluster)
    nbytes = 2**30
    t = comm.collective_seconds("all_to_all", nbytes, GroupPlacement((8, 8)))
    assert t == pytest.approx(43.83e-6 + 19.9e-6 + 15 / 16 * nbytes / cluster.inter_node_bw)
    assert t == comm.all_gather(nbytes, GroupPlacement((8, 8)))
    inside = comm.collective_seconds("all_to_all", nbytes, GroupPlacement((4,)))
    assert inside == pytest.approx(43.83e-6 + 3 / 4 * nbytes / cluster.intra_node_bw)
    assert comm.collective_seconds("all_to_all", nbytes, GroupPlacement((1,))) == 0.0


def test_concurrent_cross_node_groups_share_the_node_network():
    cluster = make_cluster(16, network_rail_bw=50e9, inter_node_bw=60e9, node_network_bw=80e9)
    comm = CommModel(cluster)
    nbytes = 2**28
    alone = comm.concurrent_seconds([("all_reduce", nbytes, [0, 8])])[0]
    assert alone == pytest.approx(19.9e-6 + nbytes / 50e9)  # one GPU per node: its own network path
    pairs = [("all_reduce", nbytes, [i, i + 8]) for i in range(8)]  # 8 strided groups at once
    shared = comm.concurrent_seconds(pairs)
    assert shared == pytest.approx([19.9e-6 + nbytes / (80e9 / 8)] * 8)  # each gets an eighth of the node
    # groups inside one node do not touch the network, nor slow the others down
    mixed = comm.concurrent_seconds([("all_reduce", nbytes, [0, 8]), ("all_reduce", nbytes, [1, 2])])
    assert mixed[0] == pytest.approx(alone)
    # the DP groups of a compact tp x dp block are strided: tp of them cross each node at once
    group, concurrent = comm.dp_group(tp=2, dp=8)
    assert group.ranks_per_node == (4, 4) and concurrent == 2


def test_gradients_reduced_in_bf16_move_half_the_bytes_of_fp32():
    assert REDUCE_DTYPE_BYTES == {"fp32": 4, "bf16": 2}
    comm = CommModel(make_cluster(8))
    params, group = 100_000_000, GroupPlacement((8,))
    fp32 = comm.all_reduce(params * REDUCE_DTYPE_BYTES["fp32"], group) - 43.83e-6
    bf16 = comm.all_reduce(params * REDUCE_DTYPE_BYTES["bf16"], group) - 43.83e-6
    assert fp32 == pytest.approx(2 * bf16)


def test_nvlink_sharp_only_for_large_all_reduces_over_more_than_four_gpus():
    comm = CommModel(make_cluster(8, gpu_type_name="H200"))
    big = 2**30
    assert comm.bus_bandwidth("all_reduce", GroupPlacement((8,)), big) == pytest.approx(473.1e9)
    assert comm.bus_bandwidth("all_reduce", GroupPlacement((4,)), big) == pytest.approx(367.61e9)
    assert comm.bus_bandwidth("all_gather", GroupPlacement((8,)), big) == pytest.approx(367.61e9)
    assert comm.bus_bandwidth("all_reduce", GroupPlacement((8,)), 2**20) == pytest.approx(367.61e9)


# ------------------------------------------------------------------------------------------------ overlap


def test_bucketed_sync_overlaps_the_backward_with_the_measured_slowdown():
    a = OVERLAP_SLOWDOWN
    assert a == pytest.approx(1.146, abs=1e-3)  # C10
    t = overlapped_backward_seconds(1.0, [0.1] * 4)  # buckets ready at 1/4, 2/4, 3/4 and the end
    assert t.backward_end == pytest.approx(1.0 + 3 * 0.1 * (a - 1))  # three buckets overlap compute
    assert t.sync_end == pytest.approx(t.backward_end + 0.1)  # the last one runs after the backward
    assert t.exposed_sync == pytest.approx(0.1)
    slow = overlapped_backward_seconds(1.0, [0.5] * 2)  # syncs longer than the compute between them
    assert slow.backward_end == pytest.approx(1.0 + 0.5 * (a - 1))
    assert slow.sync_end == pytest.approx(slow.backward_end + 0.5)
    assert overlapped_backward_seconds(1.0, []).end == 1.0
    assert overlapped_backward_seconds(0.0, [0.2, 0.3]).sync_end == pytest.approx(0.5)
    with pytest.raises(EstimatorError, match="ready fractions"):
        overlapped_backward_seconds(1.0, [0.1, 0.1], ready=[0.8, 0.2])


def test_grad_buckets_follow_megatron_core_defaults():
    assert grad_buckets(100_000_000, 8) == [40_000_000, 40_000_000, 20_000_000]
    assert grad_buckets(100_000_000, 64) == [64_000_000, 36_000_000]  # max(40M, 1M x dp)
    assert grad_buckets(10, 8, bucket=4) == [4, 4, 2]


# ------------------------------------------------------------------------------------------- CPU type


def test_cpu_type_keeps_working(tiny_clip):
    workload, graph = tiny_clip
    cluster = make_cluster(4, gpu_type_name="CPU")
    model = AnalyticCostModel(workload, cluster)
    vision = graph.metaops["vision_depth/vision"]
    cost = model.layer_cost(vision, 1, 2)
    assert cost.compute > 0 and cost.dp_sync > 0 and cost.total > 0
    assert model.layer_cost(vision, 1, 1).total > model.layer_cost(vision, 1, 4).compute
    with pytest.raises(EstimatorError, match="unknown kernel family"):
        KernelModel(dataclasses.replace(cluster.gpu, arch="tpu"))
    assert CostModelConfig().memory_efficiency == HBM_STREAM_EFFICIENCY


def test_measured_point_to_point_latency_and_overlap_replace_the_defaults():
    cluster = make_cluster(16)  # 2 nodes of 8 A800
    comm = CommModel(cluster)
    assert comm.send_recv_latency(False) == pytest.approx(43.83e-6)  # no measurement: a small collective's
    assert comm.overlap_slowdown == OVERLAP_SLOWDOWN
    measured = CommModel(dataclasses.replace(cluster, p2p_latency=80e-6, overlap_slowdown=2.0))
    assert measured.send_recv_latency(False) == 80e-6
    assert measured.send_recv_latency(True) == comm.send_recv_latency(True)  # across nodes: not measured here
    assert measured.overlap_slowdown == 2.0
    assert comm.overlap_latency == 0.0  # GPUs: no scheduling delay
    assert CommModel(dataclasses.replace(cluster, overlap_latency=3e-3)).overlap_latency == 3e-3


def test_overlap_latency_lengthens_a_bucket_beside_the_backward():
    # one bucket of 0.1 s ready at the start of a 1 s backward, slowdown 2, latency 0.3 s: the bucket runs at
    # 1 / (2 * 0.1 + 0.3) = 2 per second beside the compute, so it ends at 0.5 s; the compute did 0.25 s of work
    # by then and the rest alone: it ends at 0.5 + 0.75 = 1.25 s
    t = overlapped_backward_seconds(1.0, [0.1], ready=[0.0], slowdown=2.0, latency=0.3)
    assert t.backward_end == pytest.approx(1.25) and t.end == pytest.approx(1.25)
    # a bucket after the backward runs alone: no latency
    assert overlapped_backward_seconds(1.0, [0.1], ready=[1.0], slowdown=2.0, latency=0.3).end == pytest.approx(1.1)
    with pytest.raises(EstimatorError):
        overlapped_backward_seconds(1.0, [0.1], latency=-1.0)


def test_profile_only_cluster_fields_keep_old_digests_and_are_checked():
    from megatron_spindle.graph.cluster import ClusterError, ClusterSpec

    cluster = make_cluster(16)
    assert not {"message_host_seconds", "overlap_slowdown", "overlap_latency"} & set(cluster.to_dict())
    measured = dataclasses.replace(cluster, message_host_seconds=5e-5, overlap_slowdown=2.0, p2p_latency=1e-4,
                                   overlap_latency=2e-3)
    assert measured.digest() != cluster.digest()
    assert ClusterSpec.from_dict(measured.to_dict()) == measured
    assert ClusterSpec.from_dict(cluster.to_dict()).digest() == cluster.digest()
    with pytest.raises(ClusterError, match="overlap_slowdown"):
        dataclasses.replace(cluster, overlap_slowdown=0.5)
    with pytest.raises(ClusterError, match="message_host_seconds"):
        dataclasses.replace(cluster, message_host_seconds=-1.0)
    with pytest.raises(ClusterError, match="overlap_latency"):
        dataclasses.replace(cluster, overlap_latency=-1e-3)
