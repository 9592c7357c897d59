"""Per-kernel GPU time: GEMMs with tile and wave quantisation, FlashAttention by sequence length and head dim,
memory-bound kernels at measured bandwidth.

- GEMM (M, N, K): cuBLAS cuts C into tiles (tm x tn), each computed by one thread block looping over K in steps of
  tk; the blocks run in waves over the SMs. The time is the number of waves (per SM: ceil(tiles / SMs)) times one
  tile's time, with the best tile and split-K for the shape (cuBLAS's heuristics pick among them). A tile's main
  loop has ``ceil(K / tk)`` steps plus a fixed prologue/epilogue. The per-SM rate is the GPU's *measured* maximum
  achievable matmul rate (MAMF, C1) divided by its SM count: a GEMM of whole waves and long K reaches MAMF, never
  more. Nor faster than HBM moves its operands (the roofline's memory side). On Hopper a GEMM whose operand
  rows are not 16-byte aligned runs older kernels at a measured fraction of that rate.
- FlashAttention (FA2): fwd + bwd rate ``R(d) * s / (s + s0(d))`` in the FlashAttention-2 paper's convention
  (FLOPs = 3.5 x 4 b h s^2 d: the backward recomputes the scores), fitted to its Fig. 4 (C2, C3), times the wave
  and query-block padding of its grid (b * heads * ceil(s / 128) blocks).
- Memory-bound kernels: bytes at the achieved HBM bandwidth.
- Every kernel costs a fixed gap on the GPU stream (launch latency, ramp-up and drain).

Kernel families (``GPUSpec.arch``): ``ampere`` (A100 / A800), ``hopper`` (H100 / H200) and ``cpu``: the CPU
"GPU type" of tests and the gloo runtime, which has no tiles, no waves and no attention curve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from megatron_spindle.estimator.errors import EstimatorError
from megatron_spindle.graph.cluster import HBM_STREAM_EFFICIENCY, GPUSpec


@dataclass(frozen=True)
class Tile:
    """A GEMM tile (m x n, k per main-loop step) and its sustained rate relative to the best tile."""

    m: int
    n: int
    k: int
    efficiency: float


# The tiles cuBLAS uses, largest (most efficient: most reuse per byte loaded) to smallest: NVIDIA "Matrix
# Multiplication Background User's Guide" (DU-09799-001), 2.3 "Typical Tile Dimensions In cuBLAS And Performance".
# Relative efficiencies of the smaller tiles are estimates (the guide plots them below the 256x128 tile).
AMPERE_TILES = (
    Tile(256, 128, 32, 1.0), Tile(128, 256, 32, 1.0), Tile(128, 128, 32, 0.93), Tile(256, 64, 32, 0.9),
    Tile(64, 256, 32, 0.9), Tile(128, 64, 32, 0.82), Tile(64, 128, 32, 0.82), Tile(64, 64, 32, 0.65),
)
# Hopper wgmma kernels (CUTLASS 3 / cuBLAS) use the same shapes with k steps of 64 (estimate: efficiencies as Ampere).
# Held against 17 bf16 GEMMs on an H100 (fortieth session, timed one call at a time, which adds ~19 us): measured =
# 0.97 x this model + 19 us, and less 19 us 0.84-1.18x of it; to be fitted once GEMMs are timed back to back.
HOPPER_TILES = tuple(Tile(t.m, t.n, 64, t.efficiency) for t in AMPERE_TILES)
# Prologue (filling a 3-4 stage cp.async / TMA pipeline) plus epilogue (storing the tile), in main-loop steps:
# estimate. With it a 6912x16384x2048 GEMM (C1's best shape, 64 steps) runs at 64 / 68 of MAMF.
TILE_OVERHEAD_STEPS = 4
# Split-K factors cuBLAS considers for short-and-wide outputs with long K (weight gradients); partial sums are
# written and reduced in fp32.
SPLIT_K = (1, 2, 4, 8)
# Bytes per GEMM operand element on a GPU (bf16 inputs and output; fp32 accumulation stays on chip). A GEMM takes
# at least its operands' HBM traffic (each read once, the output written once) at the achieved bandwidth: short
# K with a long other side (the unfused attention's products by P: K = tokens, N = head dim) is memory-bound, at
# about 49 FLOP per byte on ViT-H's 257 x 80 x 257, below the ~280 at which an H100's matmul rate and HBM meet.
GEMM_OPERAND_BYTES = 2
# Gap between two dependent kernels on one stream when the host is ahead: launch latency, ramp-up and drain
# (estimate: 1-4 us on A100 / H100).
GPU_KERNEL_GAP_SECONDS = 2e-6


@dataclass(frozen=True)
class FlashCurve:
    """FlashAttention fwd + bwd rate ``rate * s / (s + seq_half)`` at head dims 64 and 128 (interpolated between,
    clamped outside), in FLOP/s of the FA2 convention."""

    rate_hd64: float
    seq_half_hd64: float
    rate_hd128: float
    seq_half_hd128: float
    block_q: int = 128  # query rows per thread block (FA2's Br on A100 / H100)

    def rate(self, head_dim: int, seq_k: float) -> float:
        w = min(1.0, max(0.0, (head_dim - 64) / 64))
        rate = (1 - w) * self.rate_hd64 + w * self.rate_hd128
        half = (1 - w) * self.seq_half_hd64 + w * self.seq_half_hd128
        return rate * seq_k / (seq_k + half)


# A100 (C2, C3: FlashAttention-2 paper, arXiv 2307.08691, Fig. 4, fwd + bwd, non-causal, batch x seq = 16k tokens):
# - head dim 64: 132 / 162 / 171 TF/s at 512 / 1k / 2k. R * s / (s + s0) through 512 and 2k: s0 = 223, R = 189.5
#   (1k: 155.6, 4 % under the figure).
# - head dim 128: 131 / 181 TF/s at 512 / 1k. The two points alone put R above MAMF; we take R = 70 % of the 312
#   TF/s peak (the paper's upper range of utilisation, an estimate of the long-sequence plateau) and s0 = 290,
#   which splits the error between the two points (+6 % / -6 %).
AMPERE_FLASH = FlashCurve(rate_hd64=189.5e12, seq_half_hd64=223.0, rate_hd128=0.70 * 312e12, seq_half_hd128=290.0)
# H100 / H200: measured on an H200 (benchmarks/gpu_validate.sh, torch 2.11's SDPA flash backend, i.e. the FA2
# kernels, in the paper's setup; benchmarks/results/gpu/, the mean of two runs): head dim 64: 158 / 203 / 241 TF/s
# at 512 / 1k / 2k; head dim 128: 163 / 218 TF/s at 512 / 1k. Fitted as A100's (this model, padding included,
# through 512 and 2k; through both points): R = 300 TF/s, s0 = 428 (1k: 205, +1 %); R = 340 TF/s, s0 = 520. The
# FA2 paper's H100 plateau at head dim 128, 335 TF/s, agrees; the half-rate lengths are about twice A100's (the
# estimate this replaces took A100's, which put the model 1.05-1.28x above these measurements).
HOPPER_FLASH = FlashCurve(rate_hd64=300e12, seq_half_hd64=428.0, rate_hd128=340e12, seq_half_hd128=520.0)
# The forward takes 1 of the 3.5 FLOP units and runs about 15 % faster per FLOP than the backward (FA2 paper,
# Figs. 5 and 6, estimate): forward share of the fwd + bwd time = 1 / (1 + 2.5 * 1.15).
FLASH_FORWARD_SPEEDUP = 1.15
FLASH_BACKWARD_FLOP_FACTOR = 2.5  # FA2 convention: the backward does 2.5x the forward's matmul FLOPs

# A GEMM whose operand rows are not 16-byte aligned (bf16: a row length not a multiple of 8, as the unfused
# attention's [tokens x tokens] scores at an odd token count) cannot use Hopper's sm90 kernels: their TMA loads need
# every stride a multiple of 16 bytes (CUDA driver API, cuTensorMapEncodeTiled). cuBLAS then runs Turing-generation
# tensor-op kernels: the profiles of CLIP-4's step show `cutlass_75_tensorop_bf16_s1688gemm` kernels for the
# towers' batched products, all at odd token counts (77, 197, 229, 251, 257), where the linears run `nvjet_sm90`.
# Those products took 52.6 ms per iteration on an H100 (fortieth session) and 52.2 on an H200 (twenty-ninth): the
# same SMs, whatever the HBM. This model's aligned kernels for the same 732 products take 15.3 ms plus their gaps:
# the rate of the fallback kernels is 0.30 of the aligned rate, fitted on those two profiles
# (benchmarks/results/README.md, "Forty-first session"; gpu_validate's attention step measures it kernel by kernel).
# Ampere's aligned kernels are the same generation of mma kernels; its cost of misalignment is unmeasured (1.0).
HOPPER_UNALIGNED_RATE = 0.30

KERNEL_FAMILIES = ("ampere", "hopper", "cpu")


@dataclass(frozen=True)
class KernelFamily:
    tiles: tuple[Tile, ...]
    tile_overhead_steps: int
    split_k: tuple[int, ...]
    flash: FlashCurve | None  # None: attention at the matmul rate, no curve (cpu)
    kernel_gap: float
    unaligned_rate: float = 1.0  # a GEMM's rate with operand rows not 16-byte aligned, relative to aligned


FAMILIES = {
    "ampere": KernelFamily(AMPERE_TILES, TILE_OVERHEAD_STEPS, SPLIT_K, AMPERE_FLASH, GPU_KERNEL_GAP_SECONDS),
    "hopper": KernelFamily(HOPPER_TILES, TILE_OVERHEAD_STEPS, SPLIT_K, HOPPER_FLASH, GPU_KERNEL_GAP_SECONDS,
                           HOPPER_UNALIGNED_RATE),
    "cpu": KernelFamily((Tile(1, 1, 1, 1.0),), 0, (1,), None, 0.0),
}


def kernel_family(gpu: GPUSpec) -> KernelFamily:
    family = FAMILIES.get(gpu.arch)
    if family is None:
        raise EstimatorError(f"GPU '{gpu.name}': unknown kernel family '{gpu.arch}' (known: {KERNEL_FAMILIES})")
    return family


class KernelModel:
    """Seconds of single kernels on one ``gpu``."""

    def __init__(self, gpu: GPUSpec, memory_efficiency: float = HBM_STREAM_EFFICIENCY,
                 family: KernelFamily | None = None):
        if not 0 < memory_efficiency <= 1:
            raise EstimatorError(f"kernel model: memory_efficiency must be in (0, 1], got {memory_efficiency}")
        self.gpu = gpu
        self.family = family or kernel_family(gpu)
        self.matmul_rate = gpu.achievable_matmul_flops
        self.sm_rate = self.matmul_rate / max(1, gpu.sm_count)
        self.bandwidth = gpu.memory_bandwidth * memory_efficiency
        self._gemm = lru_cache(maxsize=65536)(self._gemm_uncached)

    def __getstate__(self) -> dict:  # pickled without its cache (to other processes: autoplan's parallel work)
        return {k: v for k, v in self.__dict__.items() if k != "_gemm"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._gemm = lru_cache(maxsize=65536)(self._gemm_uncached)

    # --------------------------------------------------------------------------------------------- GEMM

    def gemm(self, m: int, n: int, k: int, batch: int = 1, aligned: bool = True) -> float:
        """Seconds of ``batch`` independent (m x k) @ (k x n) products in one kernel, plus the kernel gap;
        ``aligned``: every operand's rows are 16-byte aligned (the caller knows the layout)."""
        if min(m, n, k, batch) <= 0:
            return 0.0
        return self._gemm(int(m), int(n), int(k), int(batch), bool(aligned)) + self.family.kernel_gap

    def gemm_rate(self, m: int, n: int, k: int, batch: int = 1, aligned: bool = True) -> float:
        """Achieved FLOP/s of that GEMM (kernel gap included)."""
        seconds = self.gemm(m, n, k, batch, aligned)
        return 2.0 * m * n * k * batch / seconds if seconds > 0 else 0.0

    def _gemm_uncached(self, m: int, n: int, k: int, batch: int, aligned: bool = True) -> float:
        if self.gpu.arch == "cpu":  # no tiles or waves: FLOPs at the matmul rate
            return 2.0 * m * n * k * batch / self.matmul_rate
        family, sms = self.family, max(1, self.gpu.sm_count)
        sm_rate = self.sm_rate * (1.0 if aligned else family.unaligned_rate)
        # the roofline's memory side: no kernel reads A and B and writes C faster than HBM streams them
        operands = GEMM_OPERAND_BYTES * (m * k + k * n + m * n) * batch / self.bandwidth
        best = math.inf
        for tile in family.tiles:
            for split in family.split_k:
                if split > 1 and k < split * 4 * tile.k:  # each split keeps at least 4 main-loop steps
                    continue
                steps = math.ceil(math.ceil(k / split) / tile.k) + family.tile_overhead_steps
                tiles = math.ceil(m / tile.m) * math.ceil(n / tile.n) * split * batch
                rounds = math.ceil(tiles / sms)
                seconds = rounds * 2.0 * tile.m * tile.n * tile.k * steps / (sm_rate * tile.efficiency)
                seconds = max(seconds, operands)
                if split > 1:  # fp32 partial sums written, read back and reduced into the bf16 output
                    seconds += (2 * split * 4 + 2) * m * n * batch / self.bandwidth
                best = min(best, seconds)
        return best

    # ------------------------------------------------------------------------------------------ attention

    def flash_attention(self, batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int,
                        causal: bool = False) -> tuple[float, float]:
        """(forward, backward) seconds of one FlashAttention call over ``batch * heads`` (query) heads."""
        if min(batch, heads, seq_q, seq_k, head_dim) <= 0:
            return 0.0, 0.0
        keys = seq_k / 2 if causal and seq_q == seq_k else seq_k  # a causal block visits half the keys on average
        fwd_flops = 4.0 * batch * heads * seq_q * keys * head_dim
        flash = self.family.flash
        if flash is None:  # cpu: the matmuls at the matmul rate, the backward twice the forward
            forward = fwd_flops / self.matmul_rate
            return forward, 2 * forward
        rate = flash.rate(head_dim, keys)
        blocks_per_head = math.ceil(seq_q / flash.block_q)
        padding = blocks_per_head * flash.block_q / seq_q
        blocks = batch * heads * blocks_per_head
        sms = max(1, self.gpu.sm_count)
        waves = blocks / (math.ceil(blocks / sms) * sms)
        total = (1 + FLASH_BACKWARD_FLOP_FACTOR) * fwd_flops / rate * padding / waves
        forward_share = 1.0 / (1.0 + FLASH_BACKWARD_FLOP_FACTOR * FLASH_FORWARD_SPEEDUP)
        gap = self.family.kernel_gap
        return total * forward_share + gap, total * (1 - forward_share) + gap

    def flash_rate(self, batch: int, heads: int, seq: int, head_dim: int, causal: bool = False) -> float:
        """fwd + bwd FLOP/s of FlashAttention in the FA2 paper's convention (3.5 x the forward FLOPs)."""
        forward, backward = self.flash_attention(batch, heads, seq, seq, head_dim, causal)
        flops = 3.5 * 4.0 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
        return flops / (forward + backward)

    # ------------------------------------------------------------------------------------------- memory

    def memory(self, nbytes: float, kernels: int = 1) -> float:
        """Seconds of ``kernels`` streaming kernels that move ``nbytes`` of HBM traffic in all."""
        if nbytes <= 0 and kernels <= 0:
            return 0.0
        return max(0.0, nbytes) / self.bandwidth + kernels * self.family.kernel_gap
