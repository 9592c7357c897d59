"""The kernels of one transformer layer (and of the light operators) in forward and backward, timed by
``KernelModel``.

The layer is megatron-core's (local spec or Transformer Engine): pre-norm, QKV projection, attention (FlashAttention
or the unfused QK^T / softmax / PV path with its s^2 memory traffic), output projection, residual, pre-MLP norm,
FC1, activation (GELU, or SwiGLU for llama-style LLMs), FC2, residual. Tensor parallelism (Megatron style) splits
heads and the FFN over ``tp`` ranks; norms and residuals stay replicated, or with sequence parallelism
(``LayerShape.sequence_parallel``) run on 1/tp of the tokens. The
backward runs, per linear, a data-gradient and a weight-gradient GEMM, the elementwise backward of every
memory-bound kernel, and accumulates the weight gradients into fp32 main gradients (megatron-core DDP without
gradient-accumulation fusion). Full recomputation reruns the forward inside the backward.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_spindle.estimator.errors import EstimatorError
from megatron_spindle.estimator.kernels import KernelModel
from megatron_spindle.plan.schema import attention_kernels

ATTENTION_KINDS = ("flash", "unfused")
# Megatron TP all-reduces per layer: after attention and after the MLP, forward and backward (+2 for cross-attention).
TP_ALLREDUCES_FORWARD = 2


def rows_aligned(elements: int, dtype_bytes: int) -> bool:
    """Rows of ``elements`` values start 16 bytes apart or a multiple of it (what Hopper's TMA loads need)."""
    return (elements * dtype_bytes) % 16 == 0


@dataclass(frozen=True)
class LayerShape:
    """One transformer layer as run on one device: ``batch`` samples of its DP rank, TP degree ``tp``."""

    batch: int
    seq: int
    hidden: int
    heads: int
    ffn: int
    kv_groups: int | None = None  # GQA query groups (None: = heads)
    swiglu: bool = False
    causal: bool = False
    tp: int = 1
    attention: str = "flash"
    bias: bool = True  # encoder style (LayerNorm, biases); False: llama style (RMSNorm, no biases)
    rotary: bool = False
    fused_qkv: bool = True  # one QKV GEMM (megatron-core); False: separate q, k, v linears (HF models)
    cross_attention: bool = False  # a second attention block over a memory of the same length and width
    dtype_bytes: int = 2
    main_grad_bytes: int = 4  # weight gradients accumulated into fp32 main grads; 0: fused into the GEMM
    # Unfused attention's softmax: a fused bf16 kernel (apex / TE scaled-masked-softmax) or, False, torch ops in
    # fp32 (cast, softmax, cast back, plus a masked_fill for causal masks): megatron-core's fallback, which our
    # runtime takes (masked_softmax_fusion off), and what torch autocast runs.
    fused_softmax: bool = False
    # fp32 parameters cast to bf16 before every forward (torch FSDP MixedPrecision(param_dtype=bf16), autocast):
    # read 4 + write 2 bytes per parameter. megatron-core keeps bf16 parameters (False).
    param_cast: bool = False
    # Megatron's sequence parallelism: the norms and the residual adds run on 1/tp of the tokens (``seq`` is then
    # the sequence padded to a multiple of tp), and each TP all-reduce is an all-gather and a reduce-scatter.
    sequence_parallel: bool = False
    # Dropout (probability > 0) after the attention and MLP blocks (hidden) and on the attention probabilities:
    # a kernel that reads the activation and writes it and a one-byte mask (torch's native_dropout on a GPU), and
    # in the backward one that reads the gradient and the mask and writes the gradient. FlashAttention draws its
    # dropout inside the kernel (not charged: no measurement of its cost).
    hidden_dropout: bool = False
    attention_dropout: bool = False
    # The linears and the QKV split are Transformer Engine's (bias added in the GEMM's epilogue; the QKV output
    # split by TE's SplitAlongDim, whose backward copies nothing), or megatron-core's own (the local spec,
    # Megatron-LM's legacy layers): bias added by a separate kernel, torch.split's backward joins the q, k, v
    # gradients in a copy (aten::cat: 127 calls, 9.6 ms per iteration in the H100 profile of CLIP-4's step).
    # None: as our runtime builds it, TE's unless the local spec runs (``local_spec``).
    te_linears: bool | None = None
    # fc1's bias added inside the activation's kernel (Megatron-LM's default --bias-gelu-fusion), or False, as our
    # runtime runs (models/config.py: bias_activation_fusion off), by a separate add before it.
    bias_gelu_fusion: bool = False

    def __post_init__(self):
        for what in ("batch", "seq", "hidden", "heads", "ffn", "tp", "dtype_bytes"):
            if getattr(self, what) <= 0:
                raise EstimatorError(f"layer shape: {what} must be positive, got {getattr(self, what)}")
        groups = self.groups
        if self.hidden % self.heads:
            raise EstimatorError(f"layer shape: hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.heads % groups:
            raise EstimatorError(f"layer shape: heads {self.heads} are not a multiple of query groups {groups}")
        for what, value in (("heads", self.heads), ("query groups", groups), ("ffn", self.ffn)):
            if value % self.tp:
                raise EstimatorError(f"layer shape: tp {self.tp} does not divide the {what} ({value})")
        if self.attention not in ATTENTION_KINDS:
            raise EstimatorError(f"layer shape: attention must be one of {ATTENTION_KINDS}, got '{self.attention}'")

    @property
    def groups(self) -> int:
        return self.kv_groups or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def local_spec(self) -> bool:
        """megatron-core's local spec: unfused attention with torch's softmax (plan/schema.py
        ``attention_kernels("local")``); Transformer Engine's spec otherwise."""
        return (self.attention, self.fused_softmax) == attention_kernels("local")

    @property
    def megatron_linears(self) -> bool:
        """The linears are megatron-core's own, not Transformer Engine's (``te_linears``)."""
        return self.local_spec if self.te_linears is None else not self.te_linears

    @property
    def scores_aligned(self) -> bool:
        """The unfused attention's [seq x seq] scores and [seq x head dim] operands have 16-byte aligned rows (the
        batched GEMMs' condition for Hopper's fast kernels: kernels.HOPPER_UNALIGNED_RATE)."""
        return rows_aligned(self.seq, self.dtype_bytes) and rows_aligned(self.head_dim, self.dtype_bytes)

    @property
    def kv_width(self) -> int:
        return self.head_dim * self.groups

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def forward_flops(self) -> float:
        """Model FLOPs of the forward on this device (attention not discounted for causal masks)."""
        t, h, f = self.tokens, self.hidden, self.ffn
        block = 2 * t * h * (h + 2 * self.kv_width) + 4 * self.batch * self.seq**2 * h + 2 * t * h * h
        total = block + (6 if self.swiglu else 4) * t * h * f
        if self.cross_attention:
            total += block
        return total / self.tp

    @property
    def tp_allreduces(self) -> int:
        """TP all-reduces of the forward (the backward has as many); with sequence parallelism each is an
        all-gather and a reduce-scatter of the same bytes (``tp_collectives``)."""
        return (TP_ALLREDUCES_FORWARD + (1 if self.cross_attention else 0)) if self.tp > 1 else 0

    @property
    def tp_collectives(self) -> int:
        """TP collectives of the forward (the backward has as many)."""
        return self.tp_allreduces * (2 if self.sequence_parallel else 1)

    @property
    def tp_allreduce_bytes(self) -> float:
        return self.tokens * self.hidden * self.dtype_bytes

    def params(self) -> int:
        """Parameters of the layer on one TP rank (norms replicated)."""
        h, f, kv = self.hidden, self.ffn, self.kv_width
        attn = h * (h + 2 * kv) + h * h + ((h + 2 * kv) + h if self.bias else 0)
        mlp = (3 * h * f) if self.swiglu else (2 * h * f + (f + h if self.bias else 0))
        norms = (2 if self.bias else 1) * h * 2
        total = (attn + mlp) / self.tp + norms
        if self.cross_attention:
            total += attn / self.tp + (2 if self.bias else 1) * h
        return int(total)


@dataclass(frozen=True)
class Kernel:
    name: str
    phase: str  # forward | backward
    seconds: float
    launches: int = 1
    nbytes: float = 0.0  # what a memory-bound kernel reads and writes (0: a GEMM, or a time modelled otherwise)


@dataclass
class LayerTime:
    """Seconds of one layer on one device by phase, and the kernels it launches (for the host floor)."""

    forward: float
    backward: float
    forward_kernels: int
    backward_kernels: int
    kernels: list[Kernel] = field(default_factory=list, repr=False)

    @property
    def total(self) -> float:
        return self.forward + self.backward


class _Builder:
    def __init__(self, km: KernelModel, phase: str):
        self.km, self.phase, self.kernels = km, phase, []

    def gemm(self, name: str, m: float, n: float, k: float, batch: int = 1, aligned: bool = True) -> None:
        self.kernels.append(Kernel(name, self.phase, self.km.gemm(int(m), int(n), int(k), batch, aligned)))

    def memory(self, name: str, nbytes: float, kernels: int = 1) -> None:
        self.kernels.append(Kernel(name, self.phase, self.km.memory(nbytes, kernels), kernels, nbytes))

    def add(self, name: str, seconds: float) -> None:
        self.kernels.append(Kernel(name, self.phase, seconds))


def _attention_forward(b: _Builder, s: LayerShape, name: str) -> None:
    heads, hd, bs, d = s.heads // s.tp, s.head_dim, s.batch, s.dtype_bytes
    if s.attention == "flash":
        b.add(name, b.km.flash_attention(bs, heads, s.seq, s.seq, hd, s.causal)[0])
        return
    scores = bs * heads * s.seq * s.seq  # elements of the score matrix
    b.gemm(f"{name}.qk", s.seq, s.seq, hd, bs * heads, s.scores_aligned)  # baddbmm with the 1/sqrt(d) scale folded in
    if s.fused_softmax:  # read and write the bf16 scores once (mask applied inside)
        b.memory(f"{name}.softmax", 2 * d * scores)
    else:  # cast to fp32, (masked_fill,) softmax, cast back
        b.memory(f"{name}.softmax", (2 * d + 16 + (8 if s.causal else 0)) * scores, 4 if s.causal else 3)
    if s.attention_dropout:
        _dropout(b, f"{name}.dropout", d * scores, d)
    b.gemm(f"{name}.pv", s.seq, hd, s.seq, bs * heads, s.scores_aligned)
    b.memory(f"{name}.context_copy", 2 * s.tokens * s.hidden / s.tp * d)  # [b*np, s, hn] -> [s, b, h] contiguous


def _attention_backward(b: _Builder, s: LayerShape, name: str) -> None:
    heads, hd, bs, d = s.heads // s.tp, s.head_dim, s.batch, s.dtype_bytes
    if s.attention == "flash":
        b.add(name, b.km.flash_attention(bs, heads, s.seq, s.seq, hd, s.causal)[1])
        return
    scores = bs * heads * s.seq * s.seq
    b.memory(f"{name}.context_copy", 2 * s.tokens * s.hidden / s.tp * d)
    b.gemm(f"{name}.dp", s.seq, s.seq, hd, bs * heads, s.scores_aligned)  # dP = dO V^T
    b.gemm(f"{name}.dv", s.seq, hd, s.seq, bs * heads, s.scores_aligned)  # dV = P^T dO
    if s.attention_dropout:
        _dropout(b, f"{name}.dropout", d * scores, d)
    if s.fused_softmax:  # read P and dP, write dS
        b.memory(f"{name}.softmax", 3 * d * scores)
    else:  # the casts' and the fp32 softmax's (and masked_fill's) backward
        b.memory(f"{name}.softmax", (2 * d + 20 + (8 if s.causal else 0)) * scores, 4 if s.causal else 3)
    b.gemm(f"{name}.dq", s.seq, hd, s.seq, bs * heads, s.scores_aligned)  # dQ = dS K
    b.gemm(f"{name}.dk", s.seq, hd, s.seq, bs * heads, s.scores_aligned)  # dK = dS^T Q


def _forward(km: KernelModel, s: LayerShape) -> list[Kernel]:
    b = _Builder(km, "forward")
    t, h, d, tp = s.tokens, s.hidden, s.dtype_bytes, s.tp
    act = _norm_pass(s)
    qkv_out = (h + 2 * s.kv_width) / tp
    if s.param_cast:
        b.memory("param_cast", s.params() * (4 + d), _param_tensors(s))
    b.memory("norm1", 2 * act)
    if s.fused_qkv:
        b.gemm("qkv", t, qkv_out, h)
        if s.bias and s.megatron_linears:  # added after the GEMM (TE fuses it in)
            b.memory("qkv.bias", 2 * t * qkv_out * d)
    else:
        b.gemm("q", t, h / tp, h)
        b.gemm("k", t, s.kv_width / tp, h)
        b.gemm("v", t, s.kv_width / tp, h)
    if s.rotary:  # q and k: x * cos + rotate_half(x) * sin, unfused (4 kernels each, about 6 passes)
        b.memory("rotary", 6 * t * (h + s.kv_width) / tp * d, 8)
    _attention_forward(b, s, "attention")
    b.gemm("proj", t, h, h / tp)
    _residual(b, s, "residual1", act)
    if s.cross_attention:
        b.memory("norm_x", 2 * act)
        b.gemm("q_x", t, h / tp, h)
        b.gemm("kv_x", t, 2 * s.kv_width / tp, h)
        _attention_forward(b, s, "attention_x")
        b.gemm("proj_x", t, h, h / tp)
        _residual(b, s, "residual_x", act)
    ffn = s.ffn / tp
    fc1_out = (2 if s.swiglu else 1) * ffn
    b.memory("norm2", 2 * act)
    b.gemm("fc1", t, fc1_out, h)
    if s.bias and not s.bias_gelu_fusion:  # returned by fc1 and added apart
        b.memory("fc1.bias", 2 * t * fc1_out * d)
    b.memory("activation", (fc1_out + ffn) * t * d)  # GELU: read F, write F; SwiGLU: read 2F, write F
    b.gemm("fc2", t, h, ffn)
    _residual(b, s, "residual2", act)
    return b.kernels


def _norm_pass(s: LayerShape) -> float:
    """Bytes of one pass over the [tokens, hidden] activation the norms and residual adds read and write on this
    device: all the tokens, or with sequence parallelism this rank's 1/tp of them."""
    return s.tokens * s.hidden * s.dtype_bytes / (s.tp if s.sequence_parallel else 1)


def _residual(b: _Builder, s: LayerShape, name: str, act: float) -> None:
    """Megatron's bias-dropout-add unfused (our runtime: bias_dropout_fusion off): the bias add and the residual
    add each read two and write one activation; dropout between them (``_dropout``)."""
    b.memory(name, 6 * act if s.bias else 3 * act, 2 if s.bias else 1)
    if s.hidden_dropout:
        _dropout(b, f"{name}.dropout", act, s.dtype_bytes)


def _residual_backward(b: _Builder, s: LayerShape, name: str, act: float) -> None:
    """The branch gradient and the residual gradient, and the dropout's backward between them."""
    b.memory(name, 3 * act)
    if s.hidden_dropout:
        _dropout(b, f"{name}.dropout", act, s.dtype_bytes)


def _dropout(b: _Builder, name: str, nbytes: float, dtype_bytes: int) -> None:
    """One dropout over ``nbytes`` of activations, forward or backward alike: read them (the gradient) and a
    one-byte-per-element mask's worth, write them (the mask, forward; the gradient, backward)."""
    b.memory(name, 2 * nbytes + nbytes / dtype_bytes)


def _linear_backward(b: _Builder, s: LayerShape, name: str, tokens: float, out: float, inp: float) -> None:
    """dgrad (tokens x inp) and wgrad (out x inp) of a linear inp -> out, and its bias gradient."""
    b.gemm(f"{name}.dgrad", tokens, inp, out)
    b.gemm(f"{name}.wgrad", out, inp, tokens)
    if s.bias:
        b.memory(f"{name}.dbias", tokens * out * s.dtype_bytes)


def _backward(km: KernelModel, s: LayerShape) -> list[Kernel]:
    b = _Builder(km, "backward")
    t, h, d, tp = s.tokens, s.hidden, s.dtype_bytes, s.tp
    act = _norm_pass(s)
    ffn = s.ffn / tp
    fc1_out = (2 if s.swiglu else 1) * ffn
    _linear_backward(b, s, "fc2", t, h, ffn)
    b.memory("activation", (fc1_out + ffn + fc1_out) * t * d)  # read input and dy, write dx
    _linear_backward(b, s, "fc1", t, fc1_out, h)
    b.memory("norm2", 4 * act, 2)  # dx (read x, dy; write dx) and the weight grads (read x, dy)
    _residual_backward(b, s, "residual2", act)
    if s.cross_attention:
        _linear_backward(b, s, "proj_x", t, h, h / tp)
        _attention_backward(b, s, "attention_x")
        _linear_backward(b, s, "kv_x", t, 2 * s.kv_width / tp, h)
        _linear_backward(b, s, "q_x", t, h / tp, h)
        b.memory("norm_x", 4 * act, 2)
        _residual_backward(b, s, "residual_x", act)
    _linear_backward(b, s, "proj", t, h, h / tp)
    _attention_backward(b, s, "attention")
    if s.rotary:
        b.memory("rotary", 6 * t * (h + s.kv_width) / tp * d, 8)
    if s.fused_qkv and s.megatron_linears:  # torch.split's backward: read dq, dk, dv; write their join
        b.memory("qkv_split_copy", 2 * t * (h + 2 * s.kv_width) / tp * d)
    if s.fused_qkv:
        _linear_backward(b, s, "qkv", t, (h + 2 * s.kv_width) / tp, h)
    else:
        _linear_backward(b, s, "q", t, h / tp, h)
        _linear_backward(b, s, "k", t, s.kv_width / tp, h)
        _linear_backward(b, s, "v", t, s.kv_width / tp, h)
    b.memory("norm1", 4 * act, 2)
    _residual_backward(b, s, "residual1", act)
    if s.main_grad_bytes:  # main_grad += grad per parameter tensor: read the bf16 grad, read + write fp32
        b.memory("main_grad", s.params() * (d + 2 * s.main_grad_bytes), _param_tensors(s))
    return b.kernels


def _param_tensors(s: LayerShape) -> int:
    """Weight and bias tensors of the linears, weights (and biases) of the two norms."""
    linears = (4 if s.fused_qkv else 6) + (3 if s.cross_attention else 0)
    return (linears + 2 + (1 if s.cross_attention else 0)) * (2 if s.bias else 1)


def layer_kernel(km: KernelModel, shape: LayerShape, phase: str, name: str) -> Kernel:
    """The kernel ``name`` of ``phase`` as the model charges it for one layer of ``shape`` (e.g. ``norm1``,
    ``attention.softmax``): what a measurement of that one kernel is held against (benchmarks/gpu_validate.py)."""
    kernels = _forward(km, shape) if phase == "forward" else _backward(km, shape)
    found = [k for k in kernels if k.name == name]
    if len(found) != 1:
        raise EstimatorError(f"layer shape: no single {phase} kernel '{name}' (has {[k.name for k in kernels]})")
    return found[0]


def layer_time(km: KernelModel, shape: LayerShape, recompute: bool = False) -> LayerTime:
    """Forward and backward seconds of one layer on one device (no TP communication: see comm_model)."""
    forward = _forward(km, shape)
    backward = _backward(km, shape)
    if recompute:  # full recomputation: the forward runs again before the layer's backward
        backward = [dataclasses.replace(k, phase="backward") for k in forward] + backward
    return _time(forward, backward)


# backward kernels that only a weight's gradient needs (``_linear_backward``, the main-grad accumulation)
WEIGHT_GRAD_KERNELS = ("wgrad", "dbias", "main_grad")


def frozen_time(lt: LayerTime, backward: str) -> LayerTime:
    """``lt`` for an operator of frozen weights (graph/workload.py ``BACKWARDS``): "input" runs the backward
    without the weight-gradient kernels (megatron-core's ``LinearWithFrozenWeight``: dgrad only, nothing
    accumulated), "none" no backward at all; "full" is ``lt`` itself."""
    if backward == "full":
        return lt
    forward = [k for k in lt.kernels if k.phase == "forward"]
    kept = [] if backward == "none" else [k for k in lt.kernels if k.phase == "backward"
                                          and k.name.rpartition(".")[2] not in WEIGHT_GRAD_KERNELS]
    return _time(forward, kept)


def rerun_kernels(kernels: list[Kernel], modules: tuple[str, ...]) -> tuple[float, int]:
    """Forward seconds and launches of the kernels among a layer's that selective recomputation of ``modules``
    reruns (``RERUN_KERNELS``): the attention cores (QK^T, softmax, PV and the context copy, or the
    FlashAttention kernel; self- and cross-attention), the two pre-norms, the MLP."""
    names = {n for m in modules for n in RERUN_KERNELS[m]}
    rerun = [k for k in kernels if k.phase == "forward" and k.name.split(".")[0] in names]
    return sum(k.seconds for k in rerun), sum(k.launches for k in rerun)


# forward kernel names (_forward) per megatron-core recompute module; the cross-attention's norm is not rerun
RERUN_KERNELS = {"core_attn": ("attention", "attention_x"), "layernorm": ("norm1", "norm2"),
                 "mlp": ("fc1", "activation", "fc2")}


def _time(forward: list[Kernel], backward: list[Kernel]) -> LayerTime:
    return LayerTime(sum(k.seconds for k in forward), sum(k.seconds for k in backward),
                     sum(k.launches for k in forward), sum(k.launches for k in backward), forward + backward)


# ------------------------------------------------------------------------------------------ light operators


def light_time(km: KernelModel, gemms: list[tuple[float, float, float]], memory_bytes: float,
               memory_kernels: int) -> LayerTime:
    """A light operator: forward GEMMs (m, n, k), each with its dgrad and wgrad GEMM in the backward, and
    ``memory_bytes`` of memory-bound traffic (forward + backward; a third of it in the forward)."""
    fb, bb = _Builder(km, "forward"), _Builder(km, "backward")
    for m, n, k in gemms:
        fb.gemm("gemm", m, n, k)
        bb.gemm("gemm.dgrad", m, k, n)
        bb.gemm("gemm.wgrad", n, k, m)
    if memory_bytes > 0 or memory_kernels > 0:
        fwd_kernels = (memory_kernels + 2) // 3
        fb.memory("memory", memory_bytes / 3, fwd_kernels)
        bb.memory("memory", 2 * memory_bytes / 3, memory_kernels - fwd_kernels)
    return _time(fb.kernels, bb.kernels)
