"""The cost model against every measured point of ../shared/cost-model-data.md (C1-C12).

For each point: what was measured, the measurement, the model's figure, model / measured and the verdict (inside
the point's band or not). C1-C4, C12: the per-kernel model (estimator/kernels.py, op_kernels.py) on the measured
shapes and implementation; C5-C7: a full training iteration of the measured CLIP models (defined below as
workloads) from AnalyticCostModel, with the gradient sync overlapped with the backward (comm_model); C8-C10: the
communication model (comm_model.py); C11: peak memory per device of plans made by the planner and timed by the
simulator (memory model: recalibrated by a later step, a miss is expected here).

C8-C10 are also where the model's communication constants come from (graph/cluster.py), so they check its
structure (sharing of a node's network, strided groups, overlap) rather than predict. C5-C7 include data loading,
the contrastive loss's all-gather and evaluation, which the model leaves out: their bands are one-sided.

    python benchmarks/cost_model_validation.py [--out-dir benchmarks/out] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

from bench_output import add_output_args, output_dir

from megatron_spindle.estimator import AnalyticCostModel, CostModelConfig
from megatron_spindle.estimator.comm_model import (
    OVERLAP_SLOWDOWN,
    CommModel,
    GroupPlacement,
    grad_buckets,
    overlapped_backward_seconds,
)
from megatron_spindle.estimator.kernels import KernelModel
from megatron_spindle.estimator.op_kernels import LayerShape, layer_time
from megatron_spindle.fileio import write_text_atomic
from megatron_spindle.graph.cluster import GB, GPU_TYPES, MIB_PER_MS, GiB, make_cluster
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import workload_from_dict

MIB = 2**20


@dataclasses.dataclass
class Row:
    point: str
    what: str
    measured: float
    model: float
    unit: str
    band: tuple[float, float]  # model / measured
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.model / self.measured if self.measured else math.nan

    @property
    def inside(self) -> bool:
        lo, hi = self.band
        return lo <= self.ratio <= hi

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "ratio": self.ratio, "inside": self.inside}


def a100() -> KernelModel:
    return KernelModel(GPU_TYPES["A100-80GB"])


# --------------------------------------------------------------------------------------------- kernels


def c1() -> list[Row]:
    """The model's best GEMM rate over the shapes mamf-finder sweeps (multiples of 1024 up to 16384)."""
    km, sizes = a100(), range(1024, 16385, 1024)
    best = max((km.gemm_rate(m, n, k), (m, n, k)) for m in sizes for n in sizes for k in sizes)
    at_mamf_shape = km.gemm_rate(6912, 16384, 2048)
    return [Row("C1", "best bf16 GEMM rate, A100", 267.9, best[0] / 1e12, "TF/s", (0.9, 1.05),
                f"at {best[1]}; at MAMF's best shape 6912x16384x2048: {at_mamf_shape / 1e12:.1f}")]


def c2_c3() -> list[Row]:
    """FlashAttention-2 fwd + bwd, non-causal, batch x seq = 16k tokens, hidden 2048 (FA2 paper, Fig. 4)."""
    km, rows = a100(), []
    for point, hd, measured in (("C2", 64, {512: 132, 1024: 162, 2048: 171}), ("C3", 128, {512: 131, 1024: 181})):
        for seq, value in measured.items():
            rate = km.flash_rate(16384 // seq, 2048 // hd, seq, hd)
            rows.append(Row(point, f"FA2 fwd+bwd, head dim {hd}, seq {seq}", value, rate / 1e12, "TF/s", (0.8, 1.2)))
    return rows


def c4() -> list[Row]:
    """Galvatron gpt_fa: one GPT layer (hidden 4096, 32 heads, seq 2048, FFN 16384), forward, bf16, FlashAttention,
    causal; Galvatron keeps fp32 parameters under FSDP MixedPrecision (a bf16 cast before every forward). Its layers
    are Megatron-LM's (``te_linears=False``: the QKV linear adds its bias apart) with Megatron-LM's default
    --bias-gelu-fusion (the ``--no-bias-gelu-fusion`` flag turns it off)."""
    km, rows = a100(), []
    for batch, measured in ((1, 5.150030326843263), (8, 8 * 3.8827391147613532)):
        shape = LayerShape(batch, 2048, 4096, 32, 16384, causal=True, attention="flash", param_cast=True,
                           te_linears=False, bias_gelu_fusion=True)
        rows.append(Row("C4", f"GPT layer forward, batch {batch}", measured, layer_time(km, shape).forward * 1e3,
                        "ms", (0.8, 1.2)))
    return rows


def c12() -> list[Row]:
    """Galvatron vit_hf (Megatron ParallelAttention: fused QKV, unfused attention; Megatron's fused softmax kernel
    needs seq % 4 == 0, so 197 tokens take the torch fp32 softmax), hidden 2560, 32 heads, FFN 10240, 197 tokens,
    batch 8, forward, FSDP MixedPrecision (bf16 cast before every forward)."""
    shape = LayerShape(8, 197, 2560, 32, 10240, attention="unfused", param_cast=True, te_linears=False,
                       bias_gelu_fusion=True)
    model = layer_time(a100(), shape).forward * 1e3
    return [Row("C12", "ViT layer forward (h 2560, 197 tokens), batch 8", 8 * 0.31299839814503994, model, "ms",
                (0.8, 1.2), f"flash attention instead: "
                f"{layer_time(a100(), dataclasses.replace(shape, attention='flash')).forward * 1e3:.2f} ms")]


# ------------------------------------------------------------------------------------------ CLIP models


def clip_workload(name: str, vision: dict, text: dict, vision_tokens: int, batch: int, embed: int) -> dict:
    return {"name": name, "modules": {"vision": {"kind": "encoder", "embed_dim": embed, **vision},
                                      "text": {"kind": "encoder", "embed_dim": embed, "causal": True, **text}},
            "tasks": [{"name": "clip", "batch_size": batch, "tokens": {"vision": vision_tokens, "text": text["seq"]},
                       "loss": {"kind": "contrastive", "modules": ["vision", "text"]}}]}


def tower(layers: int, hidden: int, heads: int, ffn: int, frontend: dict, **extra) -> dict:
    return {"num_layers": layers, "hidden_size": hidden, "num_heads": heads, "ffn_hidden_size": ffn,
            "frontend": frontend, **extra}


def _strip(spec: dict) -> dict:
    for m in spec["modules"].values():
        m.pop("seq", None)
    return spec


# OpenCLIP (mlfoundations/open_clip src/open_clip/model_configs/ViT-B-32.json, ViT-B-16.json): width 768, 12 layers,
# 12 heads, MLP 3072, pre-LN; text width 512, 8 heads, 12 layers, 77 tokens, causal; embedding 512.
OPENCLIP_TEXT = tower(12, 512, 8, 2048, {"type": "text", "vocab_size": 49408}, seq=77)


def openclip_b(patch: int, batch: int) -> dict:
    vision = tower(12, 768, 12, 3072, {"type": "patch", "image_size": 224, "patch_size": patch, "in_channels": 3,
                                       "pre_norm": True})
    tokens = (224 // patch) ** 2 + 1
    return _strip(clip_workload(f"openclip-vit-b-{patch}", vision, dict(OPENCLIP_TEXT), tokens, batch, 512))


def nemo_vit_g14(batch: int) -> dict:
    """NVIDIA/NeMo-Framework-Launcher conf/training/clip/vit_g_14.yaml: vision 40 layers, hidden 1408, 22 heads,
    FFN 6144, 256 patches + 8 class-token slots; text 24 layers, hidden 1024, 16 heads, FFN 4096, 80 tokens."""
    vision = tower(40, 1408, 22, 6144, {"type": "patch", "image_size": 224, "patch_size": 14, "in_channels": 3,
                                        "pre_norm": True, "class_token_len": 8})
    text = tower(24, 1024, 16, 4096, {"type": "text", "vocab_size": 49408}, seq=80)
    return _strip(clip_workload("nemo-vit-g-14", vision, text, 264, batch, 1024))


@dataclasses.dataclass
class Iteration:
    forward: float
    backward: float
    sync_exposed: float
    optimizer: float

    @property
    def seconds(self) -> float:
        return self.forward + self.backward + self.sync_exposed + self.optimizer


def dp_iteration(spec: dict, cluster, config: CostModelConfig, bucket_params: int, recompute_layers: dict | None = None,
                 extra_bytes_per_param: float = 0.0) -> Iteration:
    """One data-parallel iteration per GPU: every operator's forward and backward (kernels, launch floor), the
    bucketed gradient all-reduce over all GPUs overlapped with the backward, then AdamW (plus
    ``extra_bytes_per_param`` of streaming state updates, e.g. an EMA). The contrastive all-gather is left out."""
    workload = workload_from_dict(spec)
    graph = build_metagraph(workload)
    n = cluster.num_devices
    plain = AnalyticCostModel(workload, cluster, config=config)
    recomputed = AnalyticCostModel(workload, cluster, config=dataclasses.replace(config, recompute=True))
    forward = backward = 0.0
    for m in graph.metaops.values():
        fwd, bwd = plain.phase_seconds(m, 1, n)
        layers = m.num_layers
        again = min(layers, (recompute_layers or {}).get(m.module, 0)) if m.kind == "layer" else 0
        forward += fwd * layers
        backward += bwd * (layers - again) + recomputed.phase_seconds(m, 1, n)[1] * again
    units = {u for m in graph.metaops.values() for u in plain.param_units(m)}
    params = sum(plain.param_count(u) for u in units)
    group = GroupPlacement.of_devices(range(n), cluster)
    syncs = [plain.comm.all_reduce(b * config.grad_bytes, group) for b in grad_buckets(params, n, bucket_params)]
    overlap = overlapped_backward_seconds(backward, syncs)
    optimizer = plain.optimizer_seconds(params, len(units)) + params * extra_bytes_per_param / plain.kernels.bandwidth
    return Iteration(forward, overlap.backward_end, overlap.exposed_sync, optimizer)


# JUWELS Booster (OpenCLIP's LAION-400M runs): 4 A100-40GB per node (HBM2 1.555 TB/s, NVIDIA A100 datasheet),
# 4x HDR 200 Gbps InfiniBand per node (90 % of 4 x 25 GB/s, as for DGX A100 in graph/cluster.py).
def juwels(num_gpus: int):
    cluster = make_cluster(num_gpus, 4, "A100-80GB")
    gpu = dataclasses.replace(cluster.gpu, name="A100-40GB", memory_bytes=40 * GiB, memory_bandwidth=1.555e12)
    return dataclasses.replace(cluster, gpu=gpu, inter_node_bw=90 * GB, node_network_bw=90 * GB)


# OpenCLIP trained with torch AMP (fp32 parameters cast per forward), nn.MultiheadAttention (unfused; autocast
# runs its softmax in fp32), DDP's 25 MB buckets of fp32 gradients, no gradient clipping (its --grad-clip-norm
# defaults to none).
OPENCLIP_CONFIG = CostModelConfig(attention="unfused", param_cast=True, grad_bytes=4, grad_norm=False)
TORCH_DDP_BUCKET_PARAMS = 25 * MIB // 4


def c5_c6() -> list[Row]:
    rows = []
    for point, patch, batch, gpus, measured in (("C5", 32, 256, 128, 785.0), ("C6", 16, 192, 176, 337.0)):
        it = dp_iteration(openclip_b(patch, batch * gpus), juwels(gpus), OPENCLIP_CONFIG, TORCH_DDP_BUCKET_PARAMS)
        rows.append(Row(point, f"OpenCLIP ViT-B/{patch}, batch {batch}/GPU, {gpus} A100-40GB", measured,
                        batch / it.seconds, "samples/s/GPU", (0.0, 1.5),
                        f"iteration {it.seconds * 1e3:.0f} ms = fwd {it.forward * 1e3:.0f} + bwd "
                        f"{it.backward * 1e3:.0f} + exposed sync {it.sync_exposed * 1e3:.1f} + optimizer "
                        f"{it.optimizer * 1e3:.1f}"))
    return rows


# NeMo: bf16 O1 (fp32 parameters, autocast), unfused attention with fused softmax (264 and 80 tokens are multiples of
# 4, so Megatron's scaled-masked-softmax kernel runs), 125 MB gradient chunks, full recomputation of 8 of the 40
# vision layers, gradient clipping (a norm), fused Adam plus an EMA of the weights every step (read the EMA and
# the weights, write the EMA: 12 bytes per parameter). Micro batch 80 per GPU (the launcher's config; the
# performance page does not say).
NEMO_CONFIG = CostModelConfig(attention="unfused", fused_softmax=True, param_cast=True, grad_bytes=4)
NEMO_BUCKET_PARAMS = 125 * MIB // 4
NEMO_MICRO_BATCH = 80
NEMO_MEASURED = {1: 559.0, 2: 1115.0, 4: 2190.0, 8: 4407.0, 16: 8633.0}


def c7() -> list[Row]:
    totals = {}
    for nodes in NEMO_MEASURED:
        gpus = 8 * nodes
        it = dp_iteration(nemo_vit_g14(NEMO_MICRO_BATCH * gpus), make_cluster(gpus, 8, "A100-80GB"), NEMO_CONFIG,
                          NEMO_BUCKET_PARAMS, recompute_layers={"vision": 8}, extra_bytes_per_param=12)
        totals[nodes] = (NEMO_MICRO_BATCH * gpus / it.seconds, it)
    scaling = totals[16][0] / totals[1][0]
    measured = NEMO_MEASURED[16] / NEMO_MEASURED[1]
    one, sixteen = totals[1][1], totals[16][1]
    return [
        Row("C7", "NeMo CLIP ViT-g/14 scaling 1 -> 16 DGX A100 nodes", measured, scaling, "x", (0.9, 1.1)),
        Row("C7", "NeMo CLIP ViT-g/14, 1 node, total", NEMO_MEASURED[1], totals[1][0], "samples/s", (0.0, 1.5),
            f"iteration {one.seconds * 1e3:.0f} ms, exposed sync {one.sync_exposed * 1e3:.1f} ms"),
        Row("C7", "NeMo CLIP ViT-g/14, 16 nodes, total", NEMO_MEASURED[16], totals[16][0], "samples/s", (0.0, 1.5),
            f"iteration {sixteen.seconds * 1e3:.0f} ms, exposed sync {sixteen.sync_exposed * 1e3:.1f} ms"),
    ]


# -------------------------------------------------------------------------------------------- network


def _busbw(op: str, nbytes: float, ranks: int, seconds: float) -> float:
    factor = 2 * (ranks - 1) / ranks if op == "all_reduce" else (ranks - 1) / ranks
    return factor * nbytes / seconds


# Galvatron's profile_allreduce.py all-reduces bs x 512 x 1024 fp32 activations (bs 32: 64 MiB) per layer.
GALVATRON_MESSAGE = 32 * 512 * 1024 * 4


def c8_c9() -> list[Row]:
    cluster = make_cluster(16, 8, "A800-80GB")
    comm = CommModel(cluster)
    rows = []
    for n, measured in ((8, 153.454), (4, 152.376), (2, 151.229)):
        t = comm.concurrent_seconds([("all_reduce", GALVATRON_MESSAGE, list(range(n)))])[0]
        rows.append(Row("C8", f"all-reduce in a node, {n} GPUs", measured * MIB_PER_MS / GB,
                        _busbw("all_reduce", GALVATRON_MESSAGE, n, t) / GB, "GB/s", (0.8, 1.2),
                        f"file: {measured} MiB/ms"))
    t = comm.concurrent_seconds([("all_reduce", GALVATRON_MESSAGE, list(range(16)))])[0]
    rows.append(Row("C9", "all-reduce over 2 nodes, 16 GPUs", 45.6885 * MIB_PER_MS / GB,
                    _busbw("all_reduce", GALVATRON_MESSAGE, 16, t) / GB, "GB/s", (0.75, 1.25), "file: 45.6885 MiB/ms"))
    for size, measured in ((2, 9.28218), (4, 19.2516), (8, 32.111)):
        stride = 16 // size  # Galvatron's strided (consec_0) groups: rank i, i + 16/size, ...
        groups = [[first + j * stride for j in range(size)] for first in range(stride)]
        t = comm.concurrent_seconds([("all_reduce", GALVATRON_MESSAGE, g) for g in groups])[0]
        rows.append(Row("C9", f"strided groups of {size}, {len(groups)} at once", measured * MIB_PER_MS / GB,
                        _busbw("all_reduce", GALVATRON_MESSAGE, size, t) / GB, "GB/s", (0.75, 1.25),
                        f"file: {measured} MiB/ms"))
    return rows


def c10() -> list[Row]:
    """The compute slowdown the model applies: a backward fully overlapped by one long all-reduce."""
    times = overlapped_backward_seconds(1.0, [100.0], ready=[0.0])
    return [Row("C10", "compute slowdown while a gradient all-reduce overlaps", 1.145979403115153,
                times.backward_end, "x", (0.95, 1.05), f"OVERLAP_SLOWDOWN = {OVERLAP_SLOWDOWN:.4f}")]


# --------------------------------------------------------------------------------------------- memory


def c11() -> list[Row]:
    """Peak memory per device on CLIP-4 / 16 GPUs: Spindle's plan (as tools/plan.py selects it, with CP-SAT on
    its deterministic limit as paper_eval.py runs it, so the row is paper_eval's plan whatever the machine's load:
    the default wall-clock limit gave 42.5 and 43.8 GiB in two runs) and the DeepSpeed / Megatron-LM baselines
    (memory options tuned: the fastest that fits), through the planner and the simulator (paper Fig. 15 in GB;
    we read it as GiB = what the simulator reports)."""
    from megatron_spindle.autoplan import autoplan
    from megatron_spindle.baselines import BASELINES, BaselineContext
    from megatron_spindle.graph.workload import load_workload
    from megatron_spindle.planner.pipeline import PlannerConfig
    from megatron_spindle.simulator import simulate

    workload, cluster = load_workload("clip-4"), make_cluster(16)
    chosen = autoplan(workload, cluster, PlannerConfig(solver_deterministic=True))
    peaks = {"spindle": max(chosen.sim.peak_memory) / GiB}
    ctx = BaselineContext.build(workload, cluster, metagraph=chosen.result.metagraph)
    for name in ("deepspeed", "megatron"):
        plan = BASELINES[name](workload, cluster, ctx)
        s = simulate(plan, workload, cluster, ctx.cost_model, ctx.memory_model, metagraph=ctx.metagraph)
        peaks[name] = max(s.peak_memory) / GiB
    rows = []
    for name, (lo, hi) in (("spindle", (13.0, 20.0)), ("deepspeed", (20.0, 23.0)), ("megatron", (20.0, 23.0))):
        value = peaks[name]
        nearest = min(max(value, lo), hi)  # the measured range's nearest edge (the value itself inside it)
        rows.append(Row("C11", f"peak memory per device, CLIP-4 / 16 GPUs, {name}", nearest, value, "GiB",
                        (0.8, 1.2), f"paper {lo:.0f}-{hi:.0f} GB"))
    return rows


# (point ids, the function that computes their rows): every point of cost-model-data.md
POINTS = [(("C1",), c1), (("C2", "C3"), c2_c3), (("C4",), c4), (("C5", "C6"), c5_c6), (("C7",), c7),
          (("C8", "C9"), c8_c9), (("C10",), c10), (("C11",), c11), (("C12",), c12)]
POINT_IDS = tuple(f"C{i}" for i in range(1, 13))


def table(rows: list[Row]) -> str:
    lines = [f"{'id':<4} {'what':<56} {'measured':>10} {'model':>10} {'unit':<14} {'ratio':>6} "
             f"{'band':>11}  verdict"]
    for r in rows:
        band = f"{r.band[0]:.2f}-{r.band[1]:.2f}" if r.band[0] > 0 else f"<= {r.band[1]:.2f}"
        lines.append(f"{r.point:<4} {r.what[:56]:<56} {r.measured:>10.4g} {r.model:>10.4g} {r.unit:<14} "
                     f"{r.ratio:>6.2f} {band:>11}  {'inside' if r.inside else 'MISSED'}")
        if r.note:
            lines.append(f"{'':<5}{r.note}")
    inside = sum(r.inside for r in rows)
    lines.append(f"\n{inside} of {len(rows)} rows inside their band")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    parser.add_argument("--skip-memory", action="store_true", help="leave out C11 (it plans CLIP-4 on 16 GPUs)")
    add_output_args(parser)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    rows: list[Row] = []
    for ids, fn in POINTS:
        if ids == ("C11",) and args.skip_memory:
            continue
        print(f"[validate] {', '.join(ids)} ...", file=sys.stderr, flush=True)
        rows += fn()
    text = table(rows) + f"\n({time.perf_counter() - t0:.0f} s)"
    out = output_dir(args)
    write_text_atomic(out / "cost_model_validation.json", json.dumps([r.to_dict() for r in rows], indent=1))
    write_text_atomic(out / "cost_model_validation.txt", text + "\n")
    print(json.dumps([r.to_dict() for r in rows], indent=1) if args.json else text)
    print(f"wrote {out / 'cost_model_validation.json'} and {out / 'cost_model_validation.txt'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
