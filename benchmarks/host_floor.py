"""The host's time per transformer layer of our runtime: the launch floor of the cost model (issue 13, item 1).

Eager PyTorch spends host time on every op (Python, megatron-core's module logic, the dispatcher, the launch),
whatever the op's size; a layer whose kernels finish sooner waits for the host. The cost model charges
``kernels x HOST_SECONDS_PER_KERNEL`` per layer (estimator/host.py) against its GPU time. This measures that
floor on the runtime's own megatron-core layers (models.operator.build_operator, the spec the runtime takes here)
at tiny shapes, where the kernels take no time: forward and backward per layer, the aten ops they run, and the
host seconds per kernel of the cost model's kernel count for the same layer (op_kernels.layer_time), and how much
more host time a forward kernel takes than a backward one (the cost model's HOST_FORWARD_KERNEL_WEIGHT: the
forward runs megatron-core's Python, the backward autograd's C++).

On CPU the ops run in place, so the figure is host time plus the (negligible) work of 8-token tensors (the CPU
shim, compat/cpu.py, redirects only the causal mask's allocation, which a GPU run makes too). On CUDA
(``--device cuda``, also a step of benchmarks/gpu_validate.py) the time is the host's, synchronised once per
pass.

    python benchmarks/host_floor.py [--device cpu|cuda] [--repeats 30] [--out-dir DIR | --update-snapshot]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench_output import Recording, add_output_args

LAYERS = 8  # layers per timed pass (the operator's own Python around them amortised)
SHAPES = {  # tiny: the kernels take nothing next to the host
    "encoder": {"kind": "encoder", "hidden_size": 64, "num_heads": 4, "num_query_groups": 4, "ffn_hidden_size": 256},
    "llm": {"kind": "llm", "hidden_size": 64, "num_heads": 4, "num_query_groups": 2, "ffn_hidden_size": 224},
}
SEQ, BATCH = 8, 1


def model_kernels(name: str) -> tuple[int, int]:
    """Kernels the cost model counts for one such layer, forward and backward (unfused attention: the local spec)."""
    from megatron_spindle.estimator.kernels import KernelModel
    from megatron_spindle.estimator.op_kernels import LayerShape, layer_time
    from megatron_spindle.graph.cluster import GPU_TYPES

    s = SHAPES[name]
    llm = s["kind"] == "llm"
    shape = LayerShape(BATCH, SEQ, s["hidden_size"], s["num_heads"], s["ffn_hidden_size"],
                       kv_groups=s["num_query_groups"], swiglu=llm, causal=llm, attention="unfused", bias=not llm,
                       rotary=llm)
    t = layer_time(KernelModel(GPU_TYPES["A800-80GB"]), shape)
    return t.forward_kernels, t.backward_kernels


def _aten_ops(fn) -> int:
    """The aten ops ``fn()`` runs (host_ops.py's dispatch-mode counter)."""
    from host_ops import OperationCounter

    with OperationCounter() as counter:
        fn()
    return sum(counter.by_name.values())


def measure(torch, device: str, repeats: int) -> list[dict]:
    """One row per layer kind of ``SHAPES``: median host ms per layer by phase, aten ops, host seconds per kernel."""
    return [_measure_layer(torch, device, name, repeats) for name in SHAPES]


def _measure_layer(torch, device: str, name: str, repeats: int) -> dict:
    from megatron_spindle.graph.workload import workload_from_dict
    from megatron_spindle.models.config import ModelConfig
    from megatron_spindle.models.operator import build_operator, metaop_infos

    cuda, module = device == "cuda", SHAPES[name]
    spec = {"name": name, "modules": {"m": {**module, "num_layers": LAYERS}},
            "tasks": [{"name": "t", "batch_size": BATCH, "tokens": {"m": SEQ}}]}
    workload = workload_from_dict(spec)
    op = build_operator(workload, metaop_infos(workload)["t/m"], 0, LAYERS, config=ModelConfig(bf16=cuda))
    dtype = torch.bfloat16 if cuda else torch.float32
    op = op.to(device=device, dtype=dtype)
    x = torch.randn(BATCH, SEQ, module["hidden_size"], device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    for _ in range(5):  # warm-up (allocator, lazy inits)
        op([x], None).backward(grad)
    fwd_ops = _aten_ops(lambda: op([x], None))
    y = op([x], None)
    bwd_ops = _aten_ops(lambda: y.backward(grad))
    fwd, bwd = [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = op([x], None)
        t1 = time.perf_counter()
        y.backward(grad)
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        fwd.append((t1 - t0) / LAYERS)
        bwd.append((t2 - t1) / LAYERS)
    f, b = statistics.median(fwd), statistics.median(bwd)
    fk, bk = model_kernels(name)
    return {"layer": name, "forward_ms": f * 1e3, "backward_ms": b * 1e3, "forward_aten_ops": fwd_ops / LAYERS,
            "backward_aten_ops": bwd_ops / LAYERS, "model_kernels": fk + bk, "model_forward_kernels": fk,
            "model_backward_kernels": bk, "seconds_per_kernel": (f + b) / (fk + bk),
            "seconds_per_aten_op": (f + b) * LAYERS / (fwd_ops + bwd_ops)}


def forward_kernel_weight(rows: list[dict]) -> float:
    """Host time of a counted forward kernel over a backward one, pooled over the rows (the cost model's
    HOST_FORWARD_KERNEL_WEIGHT)."""
    forward = sum(r["forward_ms"] for r in rows) / sum(r["model_forward_kernels"] for r in rows)
    return forward / (sum(r["backward_ms"] for r in rows) / sum(r["model_backward_kernels"] for r in rows))


def table(rows: list[dict], current: float, weight: float) -> str:
    lines = [f"{'layer':<8} {'fwd ms':>7} {'bwd ms':>7} {'aten ops f/b':>13} {'model kernels f/b':>18} "
             f"{'host us / kernel':>17} {'host us / aten op':>18}"]
    for r in rows:
        kernels = f"{r['model_forward_kernels']}/{r['model_backward_kernels']}"
        lines.append(f"{r['layer']:<8} {r['forward_ms']:>7.3f} {r['backward_ms']:>7.3f} "
                     f"{r['forward_aten_ops']:>6.0f}/{r['backward_aten_ops']:<6.0f} {kernels:>18} "
                     f"{r['seconds_per_kernel'] * 1e6:>17.1f} {r['seconds_per_aten_op'] * 1e6:>18.1f}")
    mean = statistics.fmean(r["seconds_per_kernel"] for r in rows)
    lines.append(f"mean: {mean * 1e6:.1f} us per kernel; the cost model's HOST_SECONDS_PER_KERNEL: {current * 1e6:.1f} us")
    per_op = [r["seconds_per_aten_op"] * 1e6 for r in rows]
    lines.append(f"host us per aten op: {min(per_op):.1f}-{max(per_op):.1f} over the layers (per counted kernel "
                 f"the layers differ more: the local spec runs more aten ops per kernel the model counts in some)")
    lines.append(f"a forward kernel's host time / a backward one's: {forward_kernel_weight(rows):.2f}; the cost "
                 f"model's HOST_FORWARD_KERNEL_WEIGHT: {weight:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=30, help="timed passes (median)")
    add_output_args(parser)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    import torch

    from megatron_spindle.estimator.host import HOST_FORWARD_KERNEL_WEIGHT, HOST_SECONDS_PER_KERNEL

    if args.device == "cuda" and not torch.cuda.is_available():
        print("host_floor: CUDA is not available (use --device cpu)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    recording = Recording(args, "host_floor")
    start = time.perf_counter()
    print(f"host_floor: the runtime's megatron-core layers at hidden 64, {SEQ} tokens, batch {BATCH}, {LAYERS} layers "
          f"per pass, {args.repeats} passes (median), device {args.device}, torch {torch.__version__}")
    rows = measure(torch, args.device, args.repeats)
    print(table(rows, HOST_SECONDS_PER_KERNEL, HOST_FORWARD_KERNEL_WEIGHT))
    print(f"({time.perf_counter() - start:.0f} s)")
    recording.save({"device": args.device, "rows": rows, "host_seconds_per_kernel": HOST_SECONDS_PER_KERNEL,
                    "forward_kernel_weight": forward_kernel_weight(rows),
                    "host_forward_kernel_weight": HOST_FORWARD_KERNEL_WEIGHT})
    return 0


if __name__ == "__main__":
    sys.exit(main())
