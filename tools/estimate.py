#!/usr/bin/env python
"""The cost model's prediction for one transformer layer, one collective or one optimizer step, to hold against
your measurements.

    python tools/estimate.py layer --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 16384 \\
        --seq-length 2048 --micro-batch-size 8 [--num-query-groups 8] [--swiglu] \\
        [--tensor-model-parallel-size 2 [--sequence-parallel]] [--attention flash|unfused] [--gpu-type A800-80GB] \
        [--json]
    python tools/estimate.py collective --op all_reduce --bytes 64M --num-gpus 16 [--gpus-per-node 8] \\
        [--strided [--num-nodes 2]] [--gpu-type A800-80GB] [--json]
    python tools/estimate.py optimizer --num-parameters 7e9 [--bf16] [--clip-grad 1.0] \\
        [--use-distributed-optimizer --data-parallel-size 8] [--gpu-type A800-80GB] [--json]

layer: forward and backward of one layer on one GPU (kernels, TP all-reduces inside a node, the host's launch
floor; no gradient sync) and the achieved model FLOP/s of forward + backward per GPU. --json prints
{"forward_ms", "backward_ms", "tflops", "launch_floor_ms", "host_bound", ...}: the host's time to issue the
layer (measured per kernel, benchmarks/host_floor.py) and whether it, not the GPU, sets the layer's time.

collective: one collective over a group of --num-gpus GPUs: consecutive GPUs on nodes of --gpus-per-node, or with
--strided spread over --num-nodes nodes (default: one GPU per node) while the other groups of that layout (one per
local rank) communicate at the same time, as the data-parallel groups of a tensor-parallel layout do. --bytes as
nccl-tests counts it (all-reduce: the buffer; all-gather / reduce-scatter: the gathered buffer; all-to-all: a
rank's buffer, charged at an all-gather's bus bandwidth, no measured point; send_recv: the message), with K/M/G
suffixes (2**10...). --json prints {"seconds", "bus_bandwidth_gb_s", ...}: the nccl-tests bus bandwidth, GB = 1e9
bytes.

optimizer: one optimizer step on one GPU, streaming at the HBM bandwidth: the gradient norm's read (unless
--clip-grad 0), AdamW over the fp32 masters and, with --bf16, the bf16 weights written from them; over the GPU's
shard of the masters with --use-distributed-optimizer. --json prints {"seconds", "bytes_per_element",
"elements_per_gpu", ...}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from types import SimpleNamespace

from megatron_spindle.errors import CliArgumentParser, exit_on_user_error

SUFFIXES = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def byte_count(text: str) -> int:
    value = text.strip().upper().removesuffix("B")
    suffix = value[-1:] if value[-1:] in SUFFIXES and not value[-1:].isdigit() else ""
    number = value[: len(value) - len(suffix)]
    try:
        count = float(number) * SUFFIXES[suffix]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a byte count (e.g. 1048576, 64M, 1G)") from None
    if count <= 0 or count != int(count):
        raise argparse.ArgumentTypeError(f"'{text}': the byte count must be a positive whole number")
    return int(count)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def dropout_arg(text: str) -> float:
    from megatron_spindle.plan.schema import dropout_probability

    try:
        return dropout_probability(float(text), "dropout")
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a probability in [0, 1)") from None


def build_parser() -> argparse.ArgumentParser:
    from megatron_spindle.estimator.comm_model import COLLECTIVES
    from megatron_spindle.estimator.op_kernels import ATTENTION_KINDS
    from megatron_spindle.graph.cluster import NODE_TYPES
    from megatron_spindle.plan.schema import ATTENTION_BACKENDS

    parser = CliArgumentParser(prog="estimate.py", description=__doc__.strip().splitlines()[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CliArgumentParser)

    layer = sub.add_parser("layer", help="one transformer layer on one GPU", allow_abbrev=False,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = layer.add_argument_group("layer")
    g.add_argument("--hidden-size", type=positive_int, required=True)
    g.add_argument("--num-attention-heads", type=positive_int, required=True)
    g.add_argument("--ffn-hidden-size", type=positive_int, required=True)
    g.add_argument("--seq-length", type=positive_int, required=True)
    g.add_argument("--micro-batch-size", type=positive_int, required=True, help="samples on this GPU")
    g.add_argument("--num-query-groups", type=positive_int, default=None, help="GQA groups (default: = heads)")
    g.add_argument("--swiglu", action="store_true", help="gated SwiGLU MLP (3 FFN GEMMs) instead of GELU")
    g.add_argument("--tensor-model-parallel-size", type=positive_int, default=1)
    g.add_argument("--attention", choices=ATTENTION_KINDS, default=None, help="the attention kernel (default: flash)")
    g.add_argument("--masked-softmax-fusion", action="store_true",
                   help="unfused attention with a fused softmax kernel (default: torch's fp32 softmax)")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=None,
                   help="Megatron-LM's --attention-backend instead of --attention and --masked-softmax-fusion, charged "
                        "as the planner charges it: flash, fused and auto as FlashAttention, unfused with a fused "
                        "softmax, local (megatron-core's local spec) with torch's fp32 softmax")
    g.add_argument("--causal", action="store_true", help="causal attention mask (decoders)")
    g.add_argument("--disable-bias-linear", action="store_true", help="no linear biases, RMSNorm (llama style)")
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"), default="learned_absolute")
    g.add_argument("--recompute-granularity", choices=("none", "full"), default="none")
    g.add_argument("--frozen", action="store_true",
                   help="frozen weights (--freeze) with a trainable module before the layer: the backward computes "
                        "the input gradients only (megatron-core's LinearWithFrozenWeight)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron's sequence parallelism at TP > 1: norms and residual adds on 1/TP of the sequence, "
                        "an all-gather and a reduce-scatter for each TP all-reduce; as the planner applies it "
                        "(a sequence that TP does not divide is padded in a --causal layer, else runs without)")
    for name in ("--hidden-dropout", "--attention-dropout"):
        g.add_argument(name, type=dropout_arg, default=0.0, help="dropout probability (its kernels are charged "
                       "where it is not 0; attention dropout inside FlashAttention is not)")
    g.add_argument("--gpu-type", default="A800-80GB", choices=sorted(NODE_TYPES))
    g.add_argument("--json", action="store_true", help="print one JSON object")

    coll = sub.add_parser("collective", help="one collective over a group of GPUs", allow_abbrev=False,
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = coll.add_argument_group("collective")
    g.add_argument("--op", choices=COLLECTIVES, required=True)
    g.add_argument("--bytes", type=byte_count, required=True, help="nccl-tests size, e.g. 1048576, 64M, 1G")
    g.add_argument("--num-gpus", type=positive_int, required=True, help="GPUs in the group")
    g.add_argument("--gpus-per-node", type=positive_int, default=8)
    g.add_argument("--strided", action="store_true",
                   help="the group is spread over --num-nodes nodes, its sibling groups communicate at once")
    g.add_argument("--num-nodes", type=positive_int, default=None,
                   help="with --strided: nodes the group spans (default: --num-gpus, one GPU per node)")
    g.add_argument("--gpu-type", default="A800-80GB", choices=sorted(NODE_TYPES))
    g.add_argument("--json", action="store_true", help="print one JSON object")

    opt = sub.add_parser("optimizer", help="one optimizer step on one GPU", allow_abbrev=False,
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = opt.add_argument_group("optimizer")
    g.add_argument("--num-parameters", type=parameter_count, required=True, help="model parameters, e.g. 7e9")
    g.add_argument("--bf16", action="store_true", help="bf16 weights beside the fp32 masters (else fp32 weights)")
    g.add_argument("--clip-grad", type=float, default=1.0, help="gradient clipping (0: none, no norm)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="the masters and AdamW state sharded over the data-parallel group")
    g.add_argument("--data-parallel-size", type=positive_int, default=1)
    g.add_argument("--gpu-type", default="A800-80GB", choices=sorted(NODE_TYPES))
    g.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def parameter_count(text: str) -> int:
    """A whole positive number of parameters, e.g. 1048576 or 7e9."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of parameters (e.g. 7e9)") from None
    if not value >= 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"'{text}': the parameter count must be a positive whole number")
    return int(value)


def estimate_layer(args) -> dict:
    from megatron_spindle.estimator.cost_model import CostModelConfig, layer_launch_floor, layer_seconds
    from megatron_spindle.estimator.op_kernels import LayerShape
    from megatron_spindle.graph.cluster import make_cluster
    from megatron_spindle.plan.schema import sequence_parallel_runs, sequence_parallel_tokens

    cluster = make_cluster(8, 8, args.gpu_type)
    attention, fused_softmax = layer_attention(args)
    tp = args.tensor_model_parallel_size
    if tp > cluster.gpus_per_node:
        raise ValueError(f"--tensor-model-parallel-size {tp} is larger than a node ({cluster.gpus_per_node} GPUs)")
    shape = LayerShape(
        batch=args.micro_batch_size, seq=args.seq_length, hidden=args.hidden_size, heads=args.num_attention_heads,
        ffn=args.ffn_hidden_size, kv_groups=args.num_query_groups, swiglu=args.swiglu, causal=args.causal, tp=tp,
        attention=attention, bias=not args.disable_bias_linear,
        rotary=args.position_embedding_type == "rope", fused_softmax=fused_softmax,
        hidden_dropout=args.hidden_dropout > 0, attention_dropout=args.attention_dropout > 0)
    # the planner's rule (plan/schema.py), which reads only the module's causality
    sp = sequence_parallel_runs(args.sequence_parallel, "layer", tp, args.seq_length,
                                SimpleNamespace(is_causal=args.causal))
    timed = dataclasses.replace(shape, seq=sequence_parallel_tokens(args.seq_length, tp),
                                sequence_parallel=True) if sp else shape
    recompute = args.recompute_granularity == "full"
    config = CostModelConfig(attention=attention, fused_softmax=fused_softmax, recompute=recompute)
    forward, backward = layer_seconds(timed, cluster, config, args.frozen)
    floor = layer_launch_floor(timed, cluster, config, args.frozen)
    # model FLOPs of forward + backward on this GPU (the padding is not model work; frozen: no weight gradients)
    flops = (2 if args.frozen else 3) * shape.forward_flops()
    return {"forward_ms": forward * 1e3, "backward_ms": backward * 1e3, "tflops": flops / (forward + backward) / 1e12,
            "model_flops_per_gpu": flops, "launch_floor_ms": floor * 1e3,
            "host_bound": floor >= forward + backward - 1e-12, "gpu_type": args.gpu_type,
            "tensor_model_parallel_size": tp, "sequence_parallel": sp, "attention": attention,
            "fused_softmax": fused_softmax, "hidden_dropout": args.hidden_dropout,
            "attention_dropout": args.attention_dropout}


def layer_attention(args) -> tuple[str, bool]:
    """(attention kind, fused softmax) of the layer flags: --attention-backend by the planner's rule (plan/schema.py
    ``attention_kernels``), else --attention (default flash) and --masked-softmax-fusion."""
    from megatron_spindle.plan.schema import attention_kernels

    if args.attention_backend is None:
        return args.attention or "flash", args.masked_softmax_fusion
    if args.attention is not None or args.masked_softmax_fusion:
        raise ValueError("give --attention-backend, or --attention and --masked-softmax-fusion, not both")
    return attention_kernels(args.attention_backend)


def collective_group(args, cluster_of):
    """(cluster, group placement, concurrent groups) of the collective arguments."""
    from megatron_spindle.estimator.comm_model import GroupPlacement

    g, per_node = args.num_gpus, args.gpus_per_node
    if args.op == "send_recv" and g != 2:
        raise ValueError(f"--op send_recv is between two GPUs, got --num-gpus {g}")
    if not args.strided:
        if args.num_nodes is not None:
            raise ValueError("--num-nodes only goes with --strided")
        nodes = -(-g // per_node)
        cluster = cluster_of(nodes * per_node, per_node)
        return cluster, GroupPlacement.of_devices(range(g), cluster), 1
    nodes = args.num_nodes or g
    if nodes < 2:
        raise ValueError("--strided needs a group on at least 2 nodes (--num-nodes)")
    if g % nodes or g // nodes > per_node:
        raise ValueError(f"--strided: {g} GPUs do not spread evenly over {nodes} nodes of {per_node} GPUs")
    per_group_node = g // nodes
    cluster = cluster_of(nodes * per_node, per_node)
    return cluster, GroupPlacement((per_group_node,) * nodes), per_node // per_group_node


def estimate_collective(args) -> dict:
    from megatron_spindle.estimator.comm_model import CommModel, bus_factor
    from megatron_spindle.graph.cluster import make_cluster

    cluster, group, concurrent = collective_group(
        args, lambda n, per_node: make_cluster(n, per_node, args.gpu_type))
    seconds = CommModel(cluster).collective_seconds(args.op, args.bytes, group, concurrent)
    n = group.size
    busbw = bus_factor(args.op, n) * args.bytes / seconds if seconds > 0 else 0.0
    return {"seconds": seconds, "bus_bandwidth_gb_s": busbw / 1e9, "algorithm_bandwidth_gb_s":
            (args.bytes / seconds / 1e9 if seconds > 0 else 0.0), "op": args.op, "bytes": args.bytes,
            "num_gpus": n, "ranks_per_node": list(group.ranks_per_node), "concurrent_groups": concurrent,
            "gpu_type": args.gpu_type}


def estimate_optimizer(args) -> dict:
    from megatron_spindle.estimator.cost_model import CostModelConfig, optimizer_step_bytes
    from megatron_spindle.estimator.kernels import KernelModel
    from megatron_spindle.graph.cluster import gpu_type

    if args.clip_grad < 0:
        raise ValueError(f"--clip-grad must be >= 0 (0: no clipping), got {args.clip_grad}")
    config = CostModelConfig(grad_norm=args.clip_grad > 0)
    shards = args.data_parallel_size if args.use_distributed_optimizer else 1
    elements = -(-args.num_parameters // shards)
    per_element = optimizer_step_bytes(config, 2 if args.bf16 else 4)
    bandwidth = KernelModel(gpu_type(args.gpu_type), config.memory_efficiency).bandwidth
    return {"seconds": elements * per_element / bandwidth, "bytes_per_element": per_element,
            "elements_per_gpu": elements, "hbm_bandwidth_gb_s": bandwidth / 1e9, "gpu_type": args.gpu_type}


def describe(result: dict, command: str) -> str:
    if command == "layer":
        return (f"layer on one {result['gpu_type']} (tp {result['tensor_model_parallel_size']}"
                f"{' + sequence parallelism' if result['sequence_parallel'] else ''}, "
                f"{result['attention']} attention{' with a fused softmax' if result['fused_softmax'] else ''}): "
                f"forward {result['forward_ms']:.3f} ms, backward {result['backward_ms']:.3f} ms, "
                f"{result['tflops']:.3g} TFLOP/s (model FLOPs, fwd + bwd); the host issues it in "
                f"{result['launch_floor_ms']:.3f} ms"
                + (" (host-bound: the launch floor sets the time)" if result["host_bound"] else ""))
    if command == "optimizer":
        return (f"optimizer step on one {result['gpu_type']}: {result['seconds'] * 1e3:.3f} ms for "
                f"{result['elements_per_gpu']} master elements at {result['bytes_per_element']} bytes each "
                f"({result['hbm_bandwidth_gb_s']:.0f} GB/s)")
    return (f"{result['op']} of {result['bytes']} bytes over {result['num_gpus']} {result['gpu_type']} GPUs "
            f"({result['ranks_per_node']} per node, {result['concurrent_groups']} group(s) at once): "
            f"{result['seconds'] * 1e6:.1f} us, bus bandwidth {result['bus_bandwidth_gb_s']:.2f} GB/s")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with exit_on_user_error("estimate.py"):
        estimate = {"layer": estimate_layer, "collective": estimate_collective, "optimizer": estimate_optimizer}
        result = estimate[args.command](args)
    print(json.dumps(result) if args.json else describe(result, args.command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
