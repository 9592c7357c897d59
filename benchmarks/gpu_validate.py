"""Measure the cost model's calibration points on the GPU at hand and print them against tools/estimate.py.

Ran on one H200 (twenty-ninth session; benchmarks/results/gpu/) and one H100 (fortieth; gpu/h100/); its --dry-run on
CPU is in the test suite.
benchmarks/gpu_validate.sh is the entry point.

One process, one GPU, no NCCL:
- GEMMs (bf16), each timed as a run of back-to-back calls (a CUDA graph replayed: ``kernel_ms``): the C1 regime
  (8192^3), a ViT-H QKV projection and a sweep for the Hopper tile model (``GEMM_SHAPES``),
  TFLOP/s measured vs KernelModel.gemm_rate;
- the unfused attention's kernels at CLIP-4's tower shapes (``ATTENTION_TOWERS``): its six batched GEMMs in
  megatron-core's strided layout and contiguous (and at tokens rounded up to a multiple of 8), its fp32 softmax, and
  the towers' LayerNorm forward and backward (GB/s against the bytes the model charges);
- device-to-device copies: 2 GiB (achieved HBM bandwidth vs the model's, datasheet x memory efficiency), and 4-64
  MiB back to back (the activations' sizes, where the model's memory-bound kernels were slow);
- FlashAttention-2 (torch SDPA's flash backend, the FA2 kernels) in the FA2 paper's setup (batch x seq = 16k
  tokens, hidden 2048, head dim 64 / 128, non-causal, fwd + bwd): TF/s vs KernelModel.flash_rate (C2, C3);
- the runtime's own megatron-core layers (models.operator.build_operator: Transformer Engine spec if TE imports,
  else the local spec) in bf16: a ViT-B/16 layer (OpenCLIP's tower, C6's small-tower regime) at micro-batches
  64 / 192, a ViT-H encoder layer (hidden 1280, 16 heads, FFN 5120, 257 tokens: Multitask-CLIP's vision tower) at
  micro-batches 8 / 32 / 64, and an LLM layer at micro-batches 1 / 2 / 4. The LLM layer is
  Llama-3-8B's (hidden 4096, 32 heads, 8 query groups, SwiGLU FFN 14336, sequence 2048, RoPE, causal): the width of
  C4's GPT layer with the GQA / SwiGLU / RMSNorm choices of current LLMs (QWen-VAL's backbone class), so one run
  checks the regime C4 checks on A100 on the GPU at hand. Forward and backward are timed apart and compared with
  ``tools/estimate.py layer --json``;
- the host's launch floor: the same layers at tiny shapes (benchmarks/host_floor.py), against the model's floor.

    python benchmarks/gpu_validate.py [--out-dir DIR] [--gpu-type H200] [--dry-run]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_NAMES = (("H200", "H200"), ("H100", "H100"), ("A800", "A800-80GB"), ("A100", "A100-80GB"))

VIT_H = {"hidden": 1280, "heads": 16, "groups": 16, "ffn": 5120, "seq": 257, "llm": False}
# ViT-B/16 (OpenCLIP's ViT-B-16 tower: width 768, 12 heads, MLP 3072, 197 tokens): the small-tower regime where C5 / C6
# find the model about 3x too fast end to end (benchmarks/cost_model_validation.py); measured here per layer
VIT_B = {"hidden": 768, "heads": 12, "groups": 12, "ffn": 3072, "seq": 197, "llm": False}
LLAMA3_8B = {"hidden": 4096, "heads": 32, "groups": 8, "ffn": 14336, "seq": 2048, "llm": True}
TINY_ENCODER = {"hidden": 64, "heads": 4, "groups": 4, "ffn": 256, "seq": 17, "llm": False}
TINY_LLM = {"hidden": 64, "heads": 4, "groups": 2, "ffn": 224, "seq": 32, "llm": True}


def detect_gpu_type(torch) -> str:
    name = torch.cuda.get_device_name().upper()
    for key, gpu_type in GPU_NAMES:
        if key in name:
            return gpu_type
    raise SystemExit(f"gpu_validate: CUDA device '{name}' matches no built-in GPU type; pass --gpu-type")


class Timer:
    """Median milliseconds of fn() over ``repeats`` runs after ``warmup``, device-synchronised."""

    def __init__(self, torch, device: str, warmup: int, repeats: int):
        self.torch, self.cuda, self.warmup, self.repeats = torch, device == "cuda", warmup, repeats

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def ms(self, fn, setup=None) -> float:
        times = []
        for i in range(self.warmup + self.repeats):
            state = setup() if setup else None
            self.sync()
            t0 = time.perf_counter()
            fn(state) if setup else fn()
            self.sync()
            if i >= self.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        return times[len(times) // 2]


# bf16 GEMMs (M, N, K): the C1 regime and a ViT-H QKV projection (8 x 257 tokens), then what the Hopper tile
# model's estimates (tile efficiencies, prologue / epilogue steps) need to be fitted: K from 256 to 4096 at a
# large output (the fixed cost per tile), M from 256 to 2048 at a large N and K (the tile choice and wave
# quantisation), and the small towers' own shapes at clip-4's per-task batch of 32: a text layer (32 x 77 tokens,
# width 1024: QKV, MLP in and out) and a ViT-S depth layer (32 x 197 tokens, width 384: QKV, MLP in), and a weight
# gradient (the output is the weight, K the tokens).
GEMM_SHAPES = (
    (8192, 8192, 8192), (8 * 257, 3 * 1280, 1280),
    (8192, 8192, 256), (8192, 8192, 512), (8192, 8192, 1024), (8192, 8192, 2048), (8192, 8192, 4096),
    (256, 8192, 8192), (512, 8192, 8192), (1024, 8192, 8192), (2048, 8192, 8192),
    (32 * 77, 3 * 1024, 1024), (32 * 77, 4096, 1024), (32 * 77, 1024, 4096),
    (32 * 197, 3 * 384, 384), (32 * 197, 1536, 384),
    (1024, 4096, 32 * 77),
)
# The unfused attention the local spec runs, at clip-4's per-task batch of 32, per tower (name, batch x heads,
# tokens, head dim): ViT-H (16 heads, 257 tokens, head dim 80), text (16 heads, 77 tokens, 64), audio (12 heads,
# 229 tokens, 64). On the fortieth session's H100 the step's bmm and baddbmm took 41 and 12 ms per iteration where
# the model puts 13 and 4, and LayerNorm 15 against 7 ms (the profiler's totals, benchmarks/results/README.md). The
# ``attention`` step times them kernel by kernel: the six batched GEMMs (QK^T and PV, and the backward's dQ, dK,
# dP, dV) in megatron-core's layout (strided views of [tokens, batch x heads, head dim], as DotProductAttention
# passes them to baddbmm / bmm) and contiguous; the contiguous two again with the tokens rounded up to a multiple
# of 8 (bf16 operands whose rows are not 16-byte aligned may take slower kernels: what separates an alignment
# cost from a short-K one); the fp32 softmax with its casts; the tower's LayerNorm forward and backward.
ATTENTION_TOWERS = (("vision", 32 * 16, 257, 80), ("text", 32 * 16, 77, 64), ("audio", 32 * 12, 229, 64))
NORM_SHAPES = (("vision", 32 * 257, 1280), ("text", 32 * 77, 1024), ("audio", 32 * 229, 768))


# Milliseconds of back-to-back calls per timed replay of a short kernel (``kernel_ms``): the replay's own launch and
# synchronisation, some 20 us, are then about 1 % of it.
BACK_TO_BACK_MS = 2.0


def kernel_ms(torch, timer, fn, device) -> tuple[float, float, str]:
    """(milliseconds per call on the device, milliseconds of one call timed alone, how) for a short kernel.

    One call timed alone includes the host's dispatch, the launch and the synchronisation around it: on the
    fortieth session's H100 host about 19 us per call (measured = 0.97 x model + 19 us over the 17 GEMMs, which
    made 15-80 us GEMMs look 1.2-2.2x slower than the model). A training step queues its kernels back to back,
    so the device's time is timed from enough calls in a row, captured in a CUDA graph (no host work between them)
    and replayed; on the CPU, or where the capture fails, the calls are issued in a loop between two
    synchronisations."""
    single = timer.ms(fn)
    calls = max(1, min(200, round(BACK_TO_BACK_MS / max(single, 1e-3))))
    if device == "cuda":
        try:
            fn()  # workspaces and the allocator's blocks exist before the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(calls):
                    fn()
            return timer.ms(graph.replay) / calls, single, f"CUDA graph of {calls} calls"
        except Exception as e:  # a capture the kernel does not allow: the calls in a loop, said in the table
            print(f"[gpu_validate] CUDA graph capture failed ({type(e).__name__}); timing calls in a loop",
                  flush=True)
    return timer.ms(lambda: [fn() for _ in range(calls)]) / calls, single, f"{calls} calls in a loop"


def compute_dtype(torch, device: str):
    """bf16 on a GPU, fp32 on the CPU's dry run."""
    return torch.bfloat16 if device == "cuda" else torch.float32


def gemm_points(torch, timer, km, device, dry) -> Iterator[dict]:
    shapes = [(64, 64, 64), (48, 96, 32)] if dry else GEMM_SHAPES
    dtype = compute_dtype(torch, device)
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        yield _gemm_point(torch, timer, km, device, f"gemm {m}x{n}x{k}", lambda a=a, b=b: torch.matmul(a, b),
                          1, m, n, k)


def _gemm_point(torch, timer, km, device, name: str, fn, batch: int, m: int, n: int, k: int,
                aligned: bool = True) -> dict:
    ms, single, how = kernel_ms(torch, timer, fn, device)
    return {"point": name, "unit": "TFLOP/s", "measured": 2.0 * batch * m * n * k / ms / 1e9,
            "model": km.gemm_rate(m, n, k, batch, aligned) / 1e12, "call_ms": ms, "single_call_ms": single,
            "timing": how}


def attention_bmm_points(torch, timer, km, device, dry) -> Iterator[dict]:
    """The unfused attention's six batched GEMMs of each tower, in megatron-core's layout and contiguous."""
    for tower in [("tiny", 4, 17, 16)] if dry else ATTENTION_TOWERS:
        yield from _tower_bmm_points(torch, timer, km, device, *tower)


def _tower_bmm_points(torch, timer, km, device, tower: str, heads: int, seq: int, hd: int) -> Iterator[dict]:
    from megatron_spindle.estimator.op_kernels import rows_aligned

    dtype = compute_dtype(torch, device)

    def rows(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)

    # [tokens, batch x heads, head dim] -> [batch x heads, tokens, head dim]: megatron-core's strided views
    q, k, v, dctx = (rows(seq, heads, hd).transpose(0, 1) for _ in range(4))
    probs, dscores = rows(heads, seq, seq), rows(heads, seq, seq)
    out = torch.empty(heads, seq, seq, device=device, dtype=dtype)
    layout = (  # (product, fn, M, N, K)
        ("qk", lambda: torch.baddbmm(out, q, k.transpose(1, 2), beta=0.0, alpha=hd ** -0.5), seq, seq, hd),
        ("pv", lambda: torch.bmm(probs, v), seq, hd, seq),
        ("dq", lambda: torch.bmm(dscores, k), seq, hd, seq),
        ("dk", lambda: torch.bmm(dscores.transpose(1, 2), q), seq, hd, seq),
        ("dp", lambda: torch.bmm(dctx, v.transpose(1, 2)), seq, seq, hd),
        ("dv", lambda: torch.bmm(probs.transpose(1, 2), dctx), seq, hd, seq),
    )

    def aligned(tokens: int) -> bool:  # the model's rule (op_kernels.LayerShape.scores_aligned) at the points' dtype
        return rows_aligned(tokens, dtype.itemsize) and rows_aligned(hd, dtype.itemsize)

    for product, fn, m, n, kk in layout:
        yield _gemm_point(torch, timer, km, device, f"bmm {tower} {product} megatron {heads}x{m}x{n}x{kk}", fn,
                          heads, m, n, kk, aligned(seq))
    for tokens in sorted({seq, -(-seq // 8) * 8}):
        for product, (m, n, kk) in (("qk", (tokens, tokens, hd)), ("pv", (tokens, hd, tokens))):
            a, b = rows(heads, m, kk), rows(heads, kk, n)
            yield _gemm_point(torch, timer, km, device, f"bmm {tower} {product} contiguous {heads}x{m}x{n}x{kk}",
                              lambda a=a, b=b: torch.bmm(a, b), heads, m, n, kk, aligned(tokens))


def attention_memory_points(torch, timer, km, device, dry) -> Iterator[dict]:
    """The local spec's fp32 softmax of the scores (cast up, softmax, cast down) and the towers' LayerNorm forward
    and backward, achieved GB/s against the model's (op_kernels: the bytes it charges over its time)."""
    for tower in [("tiny", 4, 17, 16)] if dry else ATTENTION_TOWERS:
        yield _softmax_point(torch, timer, km, device, *tower)
    for tower in [("tiny", 68, 64)] if dry else NORM_SHAPES:
        yield from _norm_points(torch, timer, km, device, *tower)


def _memory_point(torch, timer, device, name: str, fn, kernel) -> dict:
    """``fn`` timed against ``kernel`` (op_kernels.Kernel: the bytes the model charges it and their time)."""
    ms, _, how = kernel_ms(torch, timer, fn, device)
    return {"point": name, "unit": "GB/s", "measured": kernel.nbytes / ms / 1e6,
            "model": kernel.nbytes / kernel.seconds / 1e9, "call_ms": ms, "timing": how}


def _modelled(km, phase: str, name: str, dtype_bytes: int, batch_heads: int, seq: int, hidden: int,
              heads: int = 1):
    """The model's ``phase`` kernel ``name`` for one local-spec layer whose ``batch_heads`` heads (batch x heads
    of a tower, as one) see ``seq`` tokens of width ``hidden``: the bytes it charges come from op_kernels, not
    written again here."""
    from megatron_spindle.estimator.op_kernels import LayerShape, layer_kernel

    shape = LayerShape(batch=batch_heads // heads, seq=seq, hidden=hidden, heads=heads, ffn=4 * hidden,
                       attention="unfused", dtype_bytes=dtype_bytes)
    return layer_kernel(km, shape, phase, name)


def _softmax_point(torch, timer, km, device, tower: str, heads: int, seq: int, head_dim: int) -> dict:
    dtype = compute_dtype(torch, device)
    scores = torch.randn(heads, seq, seq, device=device, dtype=dtype)
    kernel = _modelled(km, "forward", "attention.softmax", scores.element_size(), heads, seq, heads * head_dim,
                       heads)
    return _memory_point(torch, timer, device, f"softmax fp32 {tower} {heads}x{seq}x{seq}",
                         lambda: torch.softmax(scores.float(), dim=-1).to(dtype), kernel)


def _norm_points(torch, timer, km, device, tower: str, tokens: int, hidden: int) -> Iterator[dict]:
    dtype = compute_dtype(torch, device)
    x, dy = (torch.randn(tokens, hidden, device=device, dtype=dtype) for _ in range(2))
    w, b = torch.ones(hidden, device=device, dtype=dtype), torch.zeros(hidden, device=device, dtype=dtype)
    _, mean, rstd = torch.native_layer_norm(x, [hidden], w, b, 1e-5)
    forward, backward = (_modelled(km, phase, "norm1", x.element_size(), 1, tokens, hidden)
                         for phase in ("forward", "backward"))
    yield _memory_point(torch, timer, device, f"layernorm forward {tower} {tokens}x{hidden}",
                        lambda: torch.native_layer_norm(x, [hidden], w, b, 1e-5), forward)
    yield _memory_point(torch, timer, device, f"layernorm backward {tower} {tokens}x{hidden}",
                        lambda: torch.ops.aten.native_layer_norm_backward(dy, x, [hidden], mean, rstd, w, b,
                                                                          [True, True, True]), backward)


def copy_point(torch, timer, km, device, dry) -> Iterator[dict]:
    """Device-to-device copies: 2 GiB (the achieved bandwidth the model takes), then the sizes of CLIP-4's
    activations (4-64 MiB: a text tower's [tokens, hidden] at batch 32 is 5 MiB, a ViT-H one 20 MiB, its QKV
    gradients 60 MiB), back to back, where the fortieth session's profile had the local spec's memory-bound kernels
    (LayerNorm, the QKV gradients' join) at a third to a half of the model's bandwidth."""
    for nbytes in (2**20, 2**22) if dry else (2 * 2**30, 2**22, 2**24, 2**26):
        src = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        if nbytes >= 2**30:  # long enough to time alone
            ms, how = timer.ms(lambda dst=dst, src=src: dst.copy_(src)), "timed alone"
        else:
            ms, _, how = kernel_ms(torch, timer, lambda dst=dst, src=src: dst.copy_(src), device)
        yield {"point": f"copy {nbytes >> 20} MiB", "unit": "GB/s", "measured": 2 * nbytes / ms / 1e6,
               "model": 2 * nbytes / km.memory(2 * nbytes) / 1e9, "call_ms": ms, "timing": how}


def flash_points(torch, timer, km, device, dry) -> Iterator[dict]:
    if dry or device != "cuda":
        return
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception:  # an older torch: no backend selection
        return
    for hd, seqs in ((64, (512, 1024, 2048)), (128, (512, 1024))):
        for seq in seqs:
            batch, heads = 16384 // seq, 2048 // hd
            q, k, v = (torch.randn(batch, heads, seq, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            grad = torch.randn(batch, heads, seq, hd, device="cuda", dtype=torch.bfloat16)

            def step(q=q, k=k, v=v, grad=grad):
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    torch.nn.functional.scaled_dot_product_attention(q, k, v).backward(grad)

            try:
                ms = timer.ms(step)
            except RuntimeError as e:  # no flash kernel for this GPU / dtype
                print(f"[gpu_validate] flash attention skipped: {e}".splitlines()[0], flush=True)
                return
            flops = 3.5 * 4.0 * batch * heads * seq * seq * hd
            yield {"point": f"flash fwd+bwd hd{hd} seq{seq}", "unit": "TFLOP/s", "measured": flops / ms / 1e9,
                   "model": km.flash_rate(batch, heads, seq, hd) / 1e12}


def estimate_layer(shape: dict, batch: int, gpu_type: str, attention_backend: str) -> dict:
    args = [sys.executable, str(ROOT / "tools" / "estimate.py"), "layer", "--hidden-size", str(shape["hidden"]),
            "--num-attention-heads", str(shape["heads"]), "--num-query-groups", str(shape["groups"]),
            "--ffn-hidden-size", str(shape["ffn"]), "--seq-length", str(shape["seq"]), "--micro-batch-size",
            str(batch), "--attention-backend", attention_backend, "--gpu-type", gpu_type, "--json"]
    if shape["llm"]:
        args += ["--swiglu", "--causal", "--disable-bias-linear", "--position-embedding-type", "rope"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(f"tools/estimate.py failed: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def layer_points(torch, timer, device, gpu_type, dry, layers: int) -> Iterator[dict]:
    from megatron_spindle.compat.cpu import te_available
    from megatron_spindle.graph.workload import workload_from_dict
    from megatron_spindle.models.config import ModelConfig
    from megatron_spindle.models.operator import build_operator, metaop_infos
    from megatron_spindle.plan.schema import resolve_attention_backend

    cases = ([("encoder", TINY_ENCODER, (2,)), ("llm", TINY_LLM, (1,))] if dry else
             [("vit-b", VIT_B, (64, 192)), ("vit-h", VIT_H, (8, 32, 64)), ("llama3-8b", LLAMA3_8B, (1, 2, 4))])
    # what the operators below build here (auto: TE's choice, else megatron-core's local spec), charged as the
    # planner charges it
    backend = resolve_attention_backend("auto", device, te_available())
    dtype = compute_dtype(torch, device)
    for name, shape, batches in cases:
        module = {"kind": "llm" if shape["llm"] else "encoder", "num_layers": layers,
                  "hidden_size": shape["hidden"], "num_heads": shape["heads"], "num_query_groups": shape["groups"],
                  "ffn_hidden_size": shape["ffn"]}
        for batch in batches:
            spec = {"name": name, "modules": {"m": module},
                    "tasks": [{"name": "t", "batch_size": batch, "tokens": {"m": shape["seq"]}}]}
            workload = workload_from_dict(spec)
            info = metaop_infos(workload)["t/m"]
            op = build_operator(workload, info, 0, layers, config=ModelConfig(bf16=device == "cuda"))
            op = op.to(device=device, dtype=dtype)
            x = torch.randn(batch, shape["seq"], shape["hidden"], device=device, dtype=dtype, requires_grad=True)
            fwd = timer.ms(lambda op=op, x=x: op([x], None)) / layers
            grad = torch.randn(batch, shape["seq"], shape["hidden"], device=device, dtype=dtype)
            bwd = timer.ms(lambda y, grad=grad: y.backward(grad), setup=lambda op=op, x=x: op([x], None)) / layers
            est = estimate_layer(shape, batch, gpu_type, backend)
            for phase, measured, model in (("forward", fwd, est["forward_ms"]), ("backward", bwd, est["backward_ms"])):
                yield {"point": f"{name} layer mb{batch} {phase}", "unit": "ms", "measured": measured,
                       "model": model}
            del op, x
            if device == "cuda":
                torch.cuda.empty_cache()


def host_points(torch, device, dry) -> Iterator[dict]:
    """The host's launch floor (benchmarks/host_floor.py): the runtime's layers at tiny shapes, fwd + bwd per layer,
    against the cost model's floor for them (its kernel count x HOST_SECONDS_PER_KERNEL)."""
    from host_floor import measure

    from megatron_spindle.estimator.host import HOST_SECONDS_PER_KERNEL

    for r in measure(torch, device, 3 if dry else 30):
        yield {"point": f"host floor, {r['layer']} layer fwd+bwd", "unit": "ms",
               "measured": r["forward_ms"] + r["backward_ms"], "model": r["model_kernels"] * HOST_SECONDS_PER_KERNEL * 1e3,
               "aten_ops": r["forward_aten_ops"] + r["backward_aten_ops"],
               "us_per_aten_op": r["seconds_per_aten_op"] * 1e6}


def single_call_summary(points: list[dict]) -> str:
    """How the GEMMs were timed, and what one call timed alone adds (the host's dispatch and synchronisation)."""
    timed = [p for p in points if "single_call_ms" in p]
    if not timed:
        return ""
    extra = sorted((p["single_call_ms"] - p["call_ms"]) * 1e3 for p in timed)
    return (f"\n  gemm timing: {timed[0]['timing']} (first shape); one call timed alone takes "
            f"{extra[len(extra) // 2]:.1f} us more (median; {extra[0]:.1f} to {extra[-1]:.1f})")


def table(points: list[dict]) -> str:
    lines = [f"{'point':<46}{'unit':>9}{'measured':>11}{'model':>11}{'model/meas':>12}"]
    for p in points:
        ratio = p["model"] / p["measured"] if p["measured"] else float("nan")
        lines.append(f"{p['point']:<46}{p['unit']:>9}{p['measured']:>11.4g}{p['model']:>11.4g}{ratio:>12.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, 1 warmup + 2 runs (CPU: implies it)")
    parser.add_argument("--gpu-type", default=None, help="built-in GPU type for the model (default: detected)")
    parser.add_argument("--out-dir", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "out" / "gpu_validate"))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--layers", type=int, default=2, help="layers timed together per layer point")
    parser.add_argument("--budget-seconds", type=float, default=210.0, help="skip what is left after this")
    args = parser.parse_args(argv)

    import torch

    from megatron_spindle.compat.cpu import apply_cpu_shim, te_available
    from megatron_spindle.estimator.kernels import KernelModel
    from megatron_spindle.graph.cluster import gpu_type

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_validate: CUDA is not available (use --device cpu --dry-run for a dry run)")
    dry = args.dry_run or device == "cpu"
    if device == "cpu":
        apply_cpu_shim()
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    gpu = args.gpu_type or ("CPU" if device == "cpu" else detect_gpu_type(torch))
    km = KernelModel(gpu_type(gpu))
    timer = Timer(torch, device, 1 if dry else args.warmup, 2 if dry else args.repeats)
    start = time.perf_counter()
    meta = {"gpu_type": gpu, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__, "transformer_engine": te_available(), "dry_run": dry}
    print(f"[gpu_validate] {meta}", flush=True)
    points: list[dict] = []
    steps = [("gemm", lambda: gemm_points(torch, timer, km, device, dry)),
             ("attention", lambda: itertools.chain(attention_bmm_points(torch, timer, km, device, dry),
                                                   attention_memory_points(torch, timer, km, device, dry))),
             ("copy", lambda: copy_point(torch, timer, km, device, dry)),
             ("flash", lambda: flash_points(torch, timer, km, device, dry)),
             ("layers", lambda: layer_points(torch, timer, device, gpu, dry, 1 if dry else args.layers)),
             ("host", lambda: host_points(torch, device, dry))]
    skipped, failed = [], {}
    for name, step in steps:
        if time.perf_counter() - start > args.budget_seconds:
            skipped.append(name)
            continue
        print(f"[gpu_validate] {name} ...", flush=True)
        try:
            for point in step():  # each point kept as it comes: a failure later in the step loses none
                points.append(point)
        except Exception as e:  # a GPU session is rare: the other steps still measure, the failure is reported
            traceback.print_exc()
            failed[name] = f"{type(e).__name__}: {e}".splitlines()[0]
    text = table(points) + "".join(f"\n  {p['point']}: {p['aten_ops']:.0f} aten ops, {p['us_per_aten_op']:.1f} us each"
                                   for p in points if "aten_ops" in p)
    text += single_call_summary(points)
    text += f"\nskipped (time budget): {', '.join(skipped)}" if skipped else ""
    text += "".join(f"\nFAILED {name}: {why}" for name, why in failed.items())
    text += f"\n({time.perf_counter() - start:.0f} s)"
    print(text)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_validate.json").write_text(json.dumps({"meta": meta, "points": points, "skipped": skipped,
                                                       "failed": failed}, indent=1))
    (out / "gpu_validate.txt").write_text(text + "\n")
    print(f"[gpu_validate] wrote {out / 'gpu_validate.json'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
