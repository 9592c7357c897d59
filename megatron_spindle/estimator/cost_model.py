"""Analytic cost model: seconds for ONE operator of a MetaOp (forward + backward) under a (tp, dp) config.

The time of an operator on n = tp * dp devices is the sum of

- compute: its kernels on one device (estimator/op_kernels.py timed by estimator/kernels.py): every GEMM by
  (M, N, K) with tile and wave quantisation on the GPU's SMs at the measured maximum achievable matmul rate,
  attention by implementation (FlashAttention by sequence length and head dim, or the unfused path with its s^2
  traffic), memory-bound kernels at the achieved HBM bandwidth, a fixed gap per kernel;
- tp_comm: the tensor-parallel all-reduces of a Megatron layer (2 forward, 2 backward) when tp > 1;
- dp_sync: the all-reduce of the operator's gradients over its dp ranks (the paper's c_m term), at the bus
  bandwidth of a DP group of a compact tp x dp block (estimator/comm_model.py: NVLink inside a node, the shared
  network across nodes), with its share of one bucket's latency. It is a separate field, not part of T(n)
  (``LayerCost.step``): the sync runs per parameter device group, bucketed and overlapped with the backward
  (comm_model.overlapped_backward_seconds; the simulator's grad_sync.py), and the planner accounts for it
  per group;
- launch: the part of the host's launch floor (kernels x launch_seconds) that the GPU work does not hide;
- data_comm: the contrastive loss's all-gather of the other DP ranks' embeddings when dp > 1.

Light operators (front ends, projectors, heads, LM head, contrastive loss) are a few GEMMs and memory-bound
traffic. Every hardware constant comes from graph/cluster.py and estimator/kernels.py, each with its source;
profiles (estimator.estimate_curves(profile=...)) override the model where measurements exist.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from megatron_spindle.estimator import host
from megatron_spindle.estimator.comm_model import CommModel, GroupPlacement, bucket_params
from megatron_spindle.estimator.configs import valid_tp_degrees
from megatron_spindle.estimator.errors import EstimatorError
from megatron_spindle.estimator.host import host_seconds, phase_times
from megatron_spindle.estimator.kernels import KernelModel
from megatron_spindle.estimator.light_ops import (
    FWD_BWD_FACTOR,
    embed_of,
    light_gemms,
    light_traffic,
    vocab_of,
)
from megatron_spindle.estimator.op_kernels import (
    ATTENTION_KINDS,
    LayerShape,
    LayerTime,
    frozen_time,
    layer_time,
    light_time,
    rerun_kernels,
)
from megatron_spindle.graph.cluster import HBM_STREAM_EFFICIENCY, ClusterSpec, GPUSpec
from megatron_spindle.graph.opgraph import MetaOp
from megatron_spindle.graph.workload import ModuleSpec, Workload, unit_module
from megatron_spindle.plan.schema import (
    REDUCE_DTYPE_BYTES,
    ExecutionSettings,
    attention_kernels,
    execution_choices,
    sequence_parallel_runs,
    sequence_parallel_tokens,
)

# Kernels launched per light operator, forward + backward (GEMMs included): an embedding gather or a patch
# projection with its bias, position add and layout copies; a 2-layer projector; a norm, pooling and projection;
# the LM head with its cross entropy; the contrastive loss's logits, softmax and reductions.
KERNELS_PER_OPERATOR = {"frontend": 9, "projector": 15, "head": 12, "lm_head": 15, "loss": 12}
# AdamW per fp32 master element: reads the master, exp_avg, exp_avg_sq and the gradient, writes the first three.
ADAMW_BYTES_PER_ELEMENT = 28
# The global gradient norm before the step reads every fp32 gradient once (gradient clipping: Megatron-LM's and
# pretrain_multitask.py's --clip-grad 1.0 by default, DeepSpeed's gradient_clipping).
GRAD_NORM_BYTES_PER_ELEMENT = 4
# Main gradients reduced in bf16 (--grad-reduce-in-bf16) are copied into fp32 gradients of the masters before
# the step (Megatron-LM's copy of model grads to main grads; runtime/optimizer.py): a 2-byte read, a 4-byte write.
GRAD_CAST_BYTES_PER_ELEMENT = 2 + 4
# After the step the model's weights are written from the masters: the fp32 master read, plus the weight written
# in the model's dtype (Megatron-LM's copy of main params into the model's, the runtime's load of the weights).
MASTER_READ_BYTES_PER_ELEMENT = 4


@dataclass(frozen=True)
class CostModelConfig:
    """Choices of the analytic model that are not hardware: the attention implementation, the gradient reduce
    dtype, recomputation, and the host's launch cost."""

    # flash: FlashAttention (Transformer Engine / flash-attn); unfused: QK^T, softmax, PV (megatron-core local spec)
    attention: str = "flash"
    # Achieved / datasheet HBM bandwidth of streaming kernels (graph/cluster.py HBM_STREAM_EFFICIENCY).
    memory_efficiency: float = HBM_STREAM_EFFICIENCY
    # Host seconds per counted kernel; None: the GPU type's (host_seconds_per_kernel).
    launch_seconds: float | None = None
    # Main gradients are accumulated and reduced in fp32 (4: mixed precision's default) or bf16 (2,
    # --grad-reduce-in-bf16); the memory model counts the same bytes for them.
    grad_bytes: int = 4
    # Full activation recomputation of transformer layers (Megatron's --recompute-granularity full): the
    # backward pass reruns each layer's forward, and only each layer's input is kept from forward to backward
    # (see MemoryModel).
    recompute: bool = False
    # fp32 parameters cast to bf16 before every forward (torch autocast / FSDP MixedPrecision frameworks);
    # megatron-core keeps bf16 parameters and fp32 masters in the optimizer (False).
    param_cast: bool = False
    # unfused attention with a fused softmax kernel (apex / TE); False: megatron-core's torch fp32 fallback
    fused_softmax: bool = False
    # Megatron's --sequence-parallel in the layers where plan/schema.py sequence_parallel_runs applies it: norms
    # and residual adds on 1/tp of the (padded) sequence, an all-gather and a reduce-scatter per TP all-reduce.
    # The memory model follows it by default.
    sequence_parallel: bool = False
    # The optimizer step computes the global gradient norm first (gradient clipping, Megatron's default).
    grad_norm: bool = True
    # Dropout probabilities of the transformer layers (--hidden-dropout, --attention-dropout): the masks' kernels
    # (op_kernels) and bytes (memory.py) are charged where they are not 0.
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0

    def __post_init__(self):
        if self.attention not in ATTENTION_KINDS:
            raise EstimatorError(f"cost model: attention must be one of {ATTENTION_KINDS}, got '{self.attention}'")
        if not 0 < self.memory_efficiency <= 1:
            raise EstimatorError("cost model: memory_efficiency must be in (0, 1]")
        if self.launch_seconds is not None and self.launch_seconds < 0:
            raise EstimatorError("cost model: launch_seconds must be >= 0")
        if self.grad_bytes not in (2, 4):
            raise EstimatorError(f"cost model: grad_bytes must be 2 (bf16) or 4 (fp32), got {self.grad_bytes}")


def execution_cost_config(choices=None) -> CostModelConfig:
    """The cost model's config for what the runtime runs, from ``choices`` (plan/schema.py
    ``EXECUTION_CHOICES``: a plan's settings or a ``PlannerConfig``; None: the defaults): ``--sequence-parallel``,
    the attention of ``--attention-backend`` (``attention_kernels``), whether the optimizer step computes the
    gradient norm (``--clip-grad`` > 0 or fp16 loss scaling), the layers' dropout and the dtype gradients are
    reduced in (``--grad-reduce-in-bf16``)."""
    chosen = execution_choices(choices if choices is not None else ExecutionSettings())
    attention, fused_softmax = attention_kernels(chosen["attention_backend"])
    return CostModelConfig(sequence_parallel=chosen["sequence_parallel"], attention=attention,
                           fused_softmax=fused_softmax, grad_norm=chosen["grad_norm"],
                           hidden_dropout=chosen["hidden_dropout"], attention_dropout=chosen["attention_dropout"],
                           grad_bytes=REDUCE_DTYPE_BYTES[chosen["grad_reduce_dtype"]])


def optimizer_step_bytes(config: CostModelConfig, dtype_bytes: int) -> int:
    """HBM bytes per fp32 master element of one optimizer step: the gradient norm's read (``grad_norm``), AdamW,
    and the model's weights written from the masters, unless the model computes in fp32 itself (its parameters
    are the masters, or fp32 parameters are cast per forward: ``param_cast``, charged in the layers)."""
    norm = GRAD_NORM_BYTES_PER_ELEMENT if config.grad_norm else 0
    cast = GRAD_CAST_BYTES_PER_ELEMENT if config.grad_bytes < 4 else 0
    separate = dtype_bytes < 4 and not config.param_cast
    weights = MASTER_READ_BYTES_PER_ELEMENT + dtype_bytes if separate else 0
    return cast + norm + ADAMW_BYTES_PER_ELEMENT + weights


@dataclass(frozen=True)
class OptimizerCost:
    """Seconds of one optimizer step: ``seconds_per_element`` per fp32 master element plus ``seconds_per_tensor``
    per stepped tensor (the engine steps one master per parameter unit; fused multi-tensor kernels make the
    latter ~0 on GPUs). ``source``: "analytic" (memory bandwidth of the cluster spec) or "measured".

    A profile measures AdamW in ``seconds_per_element`` and the step's other passes apart:
    ``norm_seconds_per_element`` (the gradient norm's read, which the step makes only where it clips or scales the
    loss) and ``weight_seconds_per_element`` (bf16 weights written from the fp32 masters; 0 in fp32, where they
    are one tensor); ``step_cost`` adds them up (0: not measured, profiles written before them)."""

    seconds_per_element: float
    seconds_per_tensor: float = 0.0
    source: str = "analytic"
    norm_seconds_per_element: float = 0.0
    weight_seconds_per_element: float = 0.0

    def __post_init__(self):
        if min(self.seconds_per_element, self.seconds_per_tensor, self.norm_seconds_per_element,
               self.weight_seconds_per_element) < 0:
            raise EstimatorError("optimizer cost: seconds must be >= 0")

    def seconds(self, elements: float, tensors: int = 0) -> float:
        if elements <= 0:
            return 0.0
        return elements * self.seconds_per_element + tensors * self.seconds_per_tensor

    def step_cost(self, grad_norm: bool) -> OptimizerCost:
        """The whole step as one cost: AdamW, the weights' write and, where ``grad_norm``, the gradient norm."""
        extra = self.weight_seconds_per_element + (self.norm_seconds_per_element if grad_norm else 0.0)
        return OptimizerCost(self.seconds_per_element + extra, self.seconds_per_tensor, self.source)

    def to_dict(self) -> dict:
        return {"seconds_per_element": self.seconds_per_element, "seconds_per_tensor": self.seconds_per_tensor,
                "source": self.source, "norm_seconds_per_element": self.norm_seconds_per_element,
                "weight_seconds_per_element": self.weight_seconds_per_element}


@dataclass(frozen=True)
class LayerCost:
    """Seconds for one operator, forward + backward, by cause."""

    compute: float
    tp_comm: float
    dp_sync: float
    launch: float
    data_comm: float = 0.0  # contrastive loss: all-gather of embeddings across DP ranks

    @property
    def total(self) -> float:
        return self.compute + self.tp_comm + self.dp_sync + self.launch + self.data_comm

    @property
    def step(self) -> float:
        """Forward + backward on the critical path, without the gradient sync: the scaling curves' T(n). The
        sync runs per parameter device group, bucketed and overlapped with the backward (the simulator's
        grad_sync.py; the planner's estimate in planner/objective.py)."""
        return self.total - self.dp_sync


def step_phases(cost_model, metaop: MetaOp, tp: int, dp: int, forward_fraction: float | None = None,
                recompute: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of ONE operator on the critical path, without its gradient sync: the cost
    model's ``phase_seconds`` plus a contrastive loss's data communication (its all-gather forward, its
    reduce-scatter backward). With ``forward_fraction``, or a cost model without ``phase_seconds`` (stand-ins),
    ``layer_cost(...).step`` is split by that fraction (default a third forward, a quarter with
    recomputation). The simulator times slices with it and the planner's estimate (planner/objective.py)
    too."""
    lc = cost_model.layer_cost(metaop, tp, dp)
    data = getattr(lc, "data_comm", 0.0)
    phases = getattr(cost_model, "phase_seconds", None)
    if phases is not None and forward_fraction is None:
        fwd, bwd = phases(metaop, tp, dp)
        return fwd + data / 2, bwd + data / 2
    fraction = forward_fraction
    if fraction is None:
        fraction = 1.0 / (FWD_BWD_FACTOR + (1 if recompute and metaop.kind == "layer" else 0))
    per_layer = lc.total - lc.dp_sync - data
    return fraction * per_layer + data / 2, (1.0 - fraction) * per_layer + data / 2


def sharded_phases(cost_model, metaop: MetaOp, tp: int, dp: int, zero_stage: int,
                   micro_batches: int = 1) -> tuple[float, float]:
    """(forward, backward) seconds ONE operator's phases of one micro-batch take longer for the sharded runtime's
    host copies (ZeRO 1 and 2, runtime/param_gather.py and grad_shards.py): loading the gathered weights into
    the operator before its first forward of the step, and copying its gradients into the staging rows (once a
    step at ZeRO-1, every micro-batch at ZeRO-2). The cost model's ``sharded_copy_seconds``: measured by a
    profile, 0 otherwise (and on models without it); the once-a-step parts are spread over the micro-batches.
    The simulator and the planner's estimate both charge it."""
    copies = getattr(cost_model, "sharded_copy_seconds", None)
    if zero_stage not in (1, 2) or copies is None:
        return 0.0, 0.0
    load, grads = copies(metaop, tp, dp)
    return load / micro_batches, grads if zero_stage == 2 else grads / micro_batches


def launch_seconds(config: CostModelConfig, gpu: GPUSpec) -> float:
    return host.host_seconds_per_kernel(gpu) if config.launch_seconds is None else config.launch_seconds


def layer_seconds(shape: LayerShape, cluster: ClusterSpec, config: CostModelConfig | None = None,
                  frozen: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of one transformer layer ``shape`` on one GPU of ``cluster``, TP all-reduces
    (over ``shape.tp`` GPUs of one node) and the launch floor included: what tools/estimate.py prints. ``frozen``:
    its weights are frozen and its backward computes the input gradients only (``frozen_time``)."""
    config = config or CostModelConfig()
    kernels = _layer_kernels(shape, cluster, config, frozen)
    comm = CommModel(cluster)
    seconds = comm.tp_collective_seconds(shape.tp_allreduce_bytes, shape.tp, shape.sequence_parallel)
    return phase_times(kernels, shape.tp_collectives, seconds, launch_seconds(config, cluster.gpu),
                       host.host_forward_kernel_weight(cluster.gpu))


def layer_launch_floor(shape: LayerShape, cluster: ClusterSpec, config: CostModelConfig | None = None,
                       frozen: bool = False) -> float:
    """The host's seconds to issue that layer's forward + backward: ``layer_seconds`` is at least this."""
    config = config or CostModelConfig()
    kernels = _layer_kernels(shape, cluster, config, frozen)
    return host_seconds(kernels, shape.tp_collectives, launch_seconds(config, cluster.gpu))


def _layer_kernels(shape: LayerShape, cluster: ClusterSpec, config: CostModelConfig, frozen: bool) -> LayerTime:
    kernels = layer_time(KernelModel(cluster.gpu, config.memory_efficiency), shape, config.recompute)
    return frozen_time(kernels, "input" if frozen else "full")


def _parse_unit(param_name: str) -> tuple[str, str]:
    """'vision@t1.layers.3' -> ('vision@t1', 'layers.3'); 'llm.lm_head' -> ('llm', 'lm_head')."""
    owner, sep, unit = param_name.partition(".")
    if not sep or not owner or not unit:
        raise EstimatorError(
            f"parameter unit '{param_name}': expected '<module>.<unit>' with unit one of layers.<i>, frontend, "
            f"head, lm_head, projector"
        )
    return owner, unit


def _operator_key(metaop: MetaOp, tp: int, dp: int) -> tuple:
    """What one operator's times depend on, for the cost model's memos."""
    return metaop.id, metaop.kind, metaop.module, tuple(metaop.input_shape), metaop.backward, tp, dp


class AnalyticCostModel:
    """Per-operator FLOPs, bytes and seconds of the MetaOps of ``workload`` on ``cluster``."""

    def __init__(
        self,
        workload: Workload,
        cluster: ClusterSpec,
        dtype_bytes: int = 2,
        config: CostModelConfig | None = None,
    ):
        if dtype_bytes <= 0:
            raise EstimatorError(f"cost model: dtype_bytes must be positive, got {dtype_bytes}")
        self.workload = workload
        self.cluster = cluster
        self.dtype_bytes = dtype_bytes
        self.config = config or CostModelConfig()
        self.kernels = KernelModel(cluster.gpu, self.config.memory_efficiency)
        self.comm = CommModel(cluster)
        self.launch_seconds = launch_seconds(self.config, cluster.gpu)
        self.host_forward_weight = host.host_forward_kernel_weight(cluster.gpu)
        self._param_counts: dict[str, int] = {}
        self._times: dict[tuple, LayerTime] = {}
        self._reruns: dict[tuple, float] = {}  # one operator's recomputation seconds (_block_recompute_seconds)

    def without_recompute(self) -> AnalyticCostModel:
        """A copy whose config does not add recomputation to every layer (a profiled model keeps its
        measurements), with its own memos."""
        out = copy.copy(self)
        out.config = dataclasses.replace(self.config, recompute=False)
        out._times, out._reruns = {}, {}
        return out

    # ------------------------------------------------------------------------------------------ shapes

    def _module(self, metaop: MetaOp) -> ModuleSpec:
        module = self.workload.modules.get(metaop.module)
        if module is None:
            raise EstimatorError(f"MetaOp '{metaop.id}': module '{metaop.module}' is not in the workload")
        return module

    @staticmethod
    def _is_swiglu(module: ModuleSpec) -> bool:
        # llama-style LLMs use a gated (SwiGLU) MLP; encoders use a plain GELU MLP.
        return module.kind == "llm"

    @staticmethod
    def _kv_width(module: ModuleSpec) -> int:
        return module.hidden_size // module.num_heads * module.query_groups

    _vocab = staticmethod(vocab_of)
    _embed_dim = staticmethod(embed_of)

    # ------------------------------------------------------------------------------------------- FLOPs

    def _layer_forward_flops(self, module: ModuleSpec, batch: int, tokens: int) -> float:
        b, s, h, f = batch, tokens, module.hidden_size, module.ffn_hidden_size
        qkv = 2 * b * s * h * (h + 2 * self._kv_width(module))
        # Scores QK^T and the weighted sum of V, each 2*B*S^2*H. Causal masks are not discounted: the tokens
        # per MetaOp are short enough that attention kernels gain little from skipping masked blocks.
        attention = 4 * b * s * s * h
        out_proj = 2 * b * s * h * h
        mlp = (6 if self._is_swiglu(module) else 4) * b * s * h * f  # 3 GEMMs (gate, up, down) or 2
        total = qkv + attention + out_proj + mlp
        if module.cross_attention:
            # A second attention block over the encoder memory; we assume memory of the same length and width.
            total += qkv + attention + out_proj
        return float(total)

    def forward_flops(self, metaop: MetaOp) -> float:
        """Forward FLOPs of one operator of ``metaop`` for its whole batch."""
        b, s, x = metaop.input_shape
        if metaop.kind == "loss":
            return 2.0 * b * b * x  # the B x B similarity matrix of the two embeddings (width x)
        module = self._module(metaop)
        h = module.hidden_size
        if metaop.kind == "layer":
            return self._layer_forward_flops(module, b, s)
        if metaop.kind == "frontend":
            fe = module.frontend
            if fe is None:
                raise EstimatorError(f"MetaOp '{metaop.id}': module '{module.name}' has no frontend")
            if fe.type == "text":
                return 0.0  # an embedding gather: memory-bound, counted in bytes
            if fe.stem == "conv":  # conv1 (k3) at the frame rate (s * patch_size frames), conv2 (k3) per token
                return 2.0 * b * s * (fe.patch_size * 3 * fe.in_channels * h + 3 * h * h)
            k = 2 if fe.type == "patch" else 1  # 2D patches vs 1D windows; the conv is a matmul per patch
            return 2.0 * b * s * (fe.in_channels * fe.patch_size**k) * h
        if metaop.kind == "projector":
            return 2.0 * b * s * (module.in_size * h + h * h)  # 2-layer MLP in_size -> hidden -> hidden
        if metaop.kind == "head":
            return 2.0 * b * h * self._embed_dim(module)  # linear on the mean-pooled token
        if metaop.kind == "lm_head":
            return 2.0 * b * s * h * self._vocab(metaop, module)
        raise EstimatorError(f"MetaOp '{metaop.id}': unknown kind '{metaop.kind}'")

    def flops(self, metaop: MetaOp) -> float:
        """Forward + backward FLOPs of ONE operator of ``metaop`` for its whole batch (backward = 2x forward: half
        of it the weight gradients, which frozen weights skip; no backward at all: ``MetaOp.backward`` "none")."""
        if metaop.backward == "none":
            return self.forward_flops(metaop)
        factor = FWD_BWD_FACTOR - (1 if metaop.frozen else 0)
        factor += 1 if self.config.recompute and metaop.kind == "layer" else 0
        return factor * self.forward_flops(metaop)

    # ------------------------------------------------------------------------------ memory-bound bytes

    def memory_bytes(self, metaop: MetaOp) -> float:
        """HBM bytes moved by the memory-bound parts of one light operator, whole batch, forward + backward
        (a layer's memory-bound kernels are listed in op_kernels.py)."""
        if metaop.kind == "layer":
            raise EstimatorError(f"MetaOp '{metaop.id}': a layer's memory traffic is per kernel (op_kernels.py)")
        return light_traffic(metaop, None if metaop.kind == "loss" else self._module(metaop), self.dtype_bytes,
                             self.config.hidden_dropout > 0)

    # ------------------------------------------------------------------------------------------ output

    def activation_bytes(self, metaop: MetaOp) -> float:
        """Bytes of ONE operator's output for the whole batch: what a transfer to the next slice moves."""
        b, s, _ = metaop.input_shape
        if metaop.kind in ("lm_head", "loss"):
            return 0.0  # only the scalar loss leaves these
        module = self._module(metaop)
        if metaop.kind == "projector":
            return float(b * (s // module.pool) * module.hidden_size * self.dtype_bytes)
        if metaop.kind == "head":
            return float(b * self._embed_dim(module) * self.dtype_bytes)
        return float(b * s * module.hidden_size * self.dtype_bytes)

    # ---------------------------------------------------------------------------------------- parameters

    def _module_of_owner(self, param_name: str, owner: str) -> ModuleSpec:
        module_name = unit_module(owner)
        module = self.workload.modules.get(module_name)
        if module is None:
            raise EstimatorError(
                f"parameter unit '{param_name}': module '{module_name}' is not in workload '{self.workload.name}' "
                f"(modules: {sorted(self.workload.modules)})"
            )
        return module

    def _layer_params(self, module: ModuleSpec) -> int:
        h, f, kv = module.hidden_size, module.ffn_hidden_size, self._kv_width(module)
        bias = module.kind != "llm"  # encoders (ViT/BERT style) carry biases; llama-style LLMs do not
        norm = 2 * h if bias else h  # LayerNorm (weight + bias) vs RMSNorm (weight)
        attention = h * (h + 2 * kv) + h * h + ((h + 2 * kv) + h if bias else 0)
        if module.qkv_bias and not bias:
            attention += h + 2 * kv  # q/k/v biases of an llm (Qwen2)
        if self._is_swiglu(module):
            mlp = 3 * h * f
        else:
            mlp = 2 * h * f + (f + h if bias else 0)
        total = 2 * norm + attention + mlp
        if module.cross_attention:
            total += norm + attention  # memory assumed to have the layer's own width
        return total

    def _frontend_params(self, param_name: str, module: ModuleSpec) -> int:
        fe = module.frontend
        if fe is None:
            raise EstimatorError(f"parameter unit '{param_name}': module '{module.name}' has no frontend")
        h = module.hidden_size
        if fe.type == "text":
            return fe.vocab_size * h  # position information from rotary / fixed embeddings: no weights
        if fe.type == "patch":
            cls = h * fe.class_tokens
            pre_norm = 2 * h if fe.pre_norm else 0
            bias = h if fe.patch_bias else 0
            return fe.in_channels * fe.patch_size**2 * h + bias + cls + fe.patch_tokens * h + pre_norm  # conv, cls, pos
        if fe.stem == "conv":
            return 3 * fe.in_channels * h + h + 3 * h * h + h  # two k3 convs with biases; sinusoidal positions
        return fe.in_channels * fe.patch_size * h + h  # 1D conv + bias; fixed position encodings

    def param_count(self, param_name: str) -> int:
        """Number of parameters of one unit: 'vision.layers.3', 'vision.frontend', 'vision.head',
        'llm.lm_head', 'vis_proj.projector', 'vision@t1.layers.0'. Memoised: placement asks per candidate."""
        count = self._param_counts.get(param_name)
        if count is None:
            count = self._param_counts[param_name] = self._count_params(param_name)
        return count

    def _count_params(self, param_name: str) -> int:
        owner, unit = _parse_unit(param_name)
        module = self._module_of_owner(param_name, owner)
        h = module.hidden_size
        if unit.startswith("layers."):
            index = unit.removeprefix("layers.")
            if not module.has_layers:
                raise EstimatorError(f"parameter unit '{param_name}': module '{module.name}' has no layers")
            if not index.isdigit() or int(index) >= module.num_layers:
                raise EstimatorError(
                    f"parameter unit '{param_name}': layer index must be in 0..{module.num_layers - 1}"
                )
            return self._layer_params(module)
        if unit == "frontend":
            return self._frontend_params(param_name, module)
        if unit == "projector":
            if module.kind != "projector":
                raise EstimatorError(
                    f"parameter unit '{param_name}': module '{module.name}' is not a projector"
                )
            return module.in_size * h + h + h * h + h
        if unit == "head":
            return 2 * h + h * self._embed_dim(module)  # final LayerNorm + projection without bias
        if unit == "lm_head":
            if not module.lm_vocab:
                raise EstimatorError(
                    f"parameter unit '{param_name}': module '{module.name}' has no vocab_size"
                )
            final_norm = h if module.kind == "llm" else 2 * h
            return final_norm + h * module.lm_vocab
        raise EstimatorError(
            f"parameter unit '{param_name}': unknown unit '{unit}' (expected layers.<i>, frontend, head, lm_head, "
            f"projector)"
        )

    @staticmethod
    def param_units(metaop: MetaOp) -> list[str]:
        """All parameter units the MetaOp uses (every operator of its chain), sorted."""
        return sorted(metaop.param_names())

    def operator_param_count(self, metaop: MetaOp) -> int:
        """Parameters used by ONE operator of the MetaOp (all operators of a chain are identical)."""
        if not metaop.params:
            return 0
        return sum(self.param_count(p) for p in metaop.params[0])

    def communication_bytes(self, metaop: MetaOp) -> float:
        """Bytes one operator exchanges across DP ranks whatever n is (the paper's c_m): its gradients (none
        for frozen weights), and for a contrastive loss both embeddings."""
        grads = 0 if metaop.frozen else self.operator_param_count(metaop) * self.config.grad_bytes
        if metaop.kind == "loss":
            return grads + 2.0 * metaop.batch * metaop.hidden * self.dtype_bytes
        return float(grads)

    # ------------------------------------------------------------------------------------ communication

    def optimizer_cost(self) -> OptimizerCost:
        """The optimizer step streams ``optimizer_bytes_per_element`` of HBM traffic per master element."""
        return OptimizerCost(self.optimizer_bytes_per_element() / self.kernels.bandwidth, 0.0, "analytic")

    def optimizer_bytes_per_element(self) -> int:
        return optimizer_step_bytes(self.config, self.dtype_bytes)

    def sharded_copy_seconds(self, metaop: MetaOp, tp: int, dp: int) -> tuple[float, float]:
        """(weights loaded, gradients staged) seconds of ONE operator's host copies under ZeRO 1 and 2
        (``sharded_phases``): not modelled analytically (0: on a GPU they are small kernels the host runs ahead
        of); a profile measures them (``ProfiledCostModel``)."""
        return 0.0, 0.0

    def optimizer_seconds(self, elements: float, tensors: int = 0) -> float:
        """One AdamW step over ``tensors`` master tensors of ``elements`` fp32 elements in all."""
        return self.optimizer_cost().seconds(elements, tensors)

    def _compact_group(self, ranks: int, devices_spanned: int) -> GroupPlacement:
        stride = max(1, devices_spanned // max(1, ranks))
        return GroupPlacement.strided(ranks, stride, self.cluster)

    def allreduce_seconds(self, num_bytes: float, ranks: int, devices_spanned: int) -> float:
        """All-reduce of ``num_bytes`` per rank over ``ranks`` ranks evenly strided over ``devices_spanned``
        compactly placed devices (the other groups of that block run at the same time)."""
        if ranks <= 1 or num_bytes <= 0:
            return 0.0
        group = self._compact_group(ranks, devices_spanned)
        concurrent = min(devices_spanned // ranks, self.cluster.gpus_per_node) if group.crosses_nodes else 1
        return self.comm.all_reduce(num_bytes, group, max(1, concurrent))

    def allgather_seconds(self, total_bytes: float, ranks: int, devices_spanned: int) -> float:
        """All-gather (or reduce-scatter) of ``total_bytes`` in all, laid out as in ``allreduce_seconds``."""
        if ranks <= 1 or total_bytes <= 0:
            return 0.0
        group = self._compact_group(ranks, devices_spanned)
        concurrent = min(devices_spanned // ranks, self.cluster.gpus_per_node) if group.crosses_nodes else 1
        return self.comm.all_gather(total_bytes, group, max(1, concurrent))

    # ------------------------------------------------------------------------------------------- kernels

    def _check_config(self, metaop: MetaOp, tp: int, dp: int) -> None:
        for what, value in (("tp", tp), ("dp", dp)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise EstimatorError(
                    f"MetaOp '{metaop.id}': {what} must be a positive integer, got {value!r}"
                )
        if metaop.batch % dp:
            raise EstimatorError(f"MetaOp '{metaop.id}': dp {dp} does not divide the batch {metaop.batch}")
        tps = valid_tp_degrees(metaop, self.workload, self.cluster)
        if tp not in tps:
            raise EstimatorError(f"MetaOp '{metaop.id}' ({metaop.kind}): tp {tp} is not valid (valid: {tps})")

    def layer_shape(self, metaop: MetaOp, tp: int, dp: int) -> LayerShape:
        """The transformer layer of a ``layer`` MetaOp as one device of a (tp, dp) config runs it."""
        if metaop.kind != "layer":
            raise EstimatorError(f"MetaOp '{metaop.id}': layer_shape needs a layer MetaOp, got '{metaop.kind}'")
        module = self._module(metaop)
        b, s, _ = metaop.input_shape
        llm = module.kind == "llm"
        sp = self.sequence_parallel(metaop, tp)
        return LayerShape(
            batch=b // dp, seq=sequence_parallel_tokens(s, tp) if sp else s, hidden=module.hidden_size,
            heads=module.num_heads,
            ffn=module.ffn_hidden_size, kv_groups=module.query_groups, swiglu=self._is_swiglu(module),
            causal=module.is_causal, tp=tp, attention=self.config.attention, bias=not llm, rotary=llm,
            cross_attention=module.cross_attention, dtype_bytes=self.dtype_bytes, param_cast=self.config.param_cast,
            fused_softmax=self.config.fused_softmax, sequence_parallel=sp,
            hidden_dropout=self.config.hidden_dropout > 0, attention_dropout=self.config.attention_dropout > 0,
            main_grad_bytes=self.config.grad_bytes,
        )

    def sequence_parallel(self, metaop: MetaOp, tp: int) -> bool:
        """Whether the MetaOp's operators run sequence-parallel at ``tp`` under this model's setting."""
        return sequence_parallel_runs(self.config.sequence_parallel, metaop.kind, tp, metaop.tokens,
                                      self.workload.modules.get(metaop.module))

    def kernel_time(self, metaop: MetaOp, tp: int, dp: int) -> LayerTime:
        """Forward and backward seconds of the kernels of ONE operator on one device of a (tp, dp) config
        (communication excluded). Memoised per (MetaOp, tp, dp)."""
        return self._kernel_time(metaop, tp, dp, self.config.recompute)

    def _kernel_time(self, metaop: MetaOp, tp: int, dp: int, recompute: bool) -> LayerTime:
        key = (*_operator_key(metaop, tp, dp), recompute)
        cached = self._times.get(key)
        if cached is not None:
            return cached
        if metaop.kind == "layer":
            result = layer_time(self.kernels, self.layer_shape(metaop, tp, dp), recompute)
        else:
            module = None if metaop.kind == "loss" else self._module(metaop)
            gemms = light_gemms(metaop, module, metaop.batch // dp)
            nbytes = self.memory_bytes(metaop) / dp
            memory_kernels = max(1, KERNELS_PER_OPERATOR[metaop.kind] - 3 * len(gemms))
            result = light_time(self.kernels, gemms, nbytes, memory_kernels)
        result = frozen_time(result, metaop.backward)
        self._times[key] = result
        return result

    def phase_seconds(self, metaop: MetaOp, tp: int, dp: int) -> tuple[float, float]:
        """(forward, backward) seconds of ONE operator on one device: kernels, TP all-reduces and the launch floor
        split by phase (no gradient sync, no contrastive all-gather)."""
        return self._analytic_phases(metaop, tp, dp)

    def _analytic_phases(self, metaop: MetaOp, tp: int, dp: int) -> tuple[float, float]:
        self._check_config(metaop, tp, dp)
        fwd, bwd = phase_times(self.kernel_time(metaop, tp, dp), self._tp_collectives(metaop, tp),
                               self._tp_collective_seconds(metaop, tp, dp), self.launch_seconds,
                               self.host_forward_weight)
        return (fwd, 0.0) if metaop.backward == "none" else (fwd, bwd)  # no backward: nor its TP all-reduces

    # ---------------------------------------------------------------------------------------------- time

    def compute_seconds(self, metaop: MetaOp, tp: int, dp: int) -> float:
        """GPU time of one operator's kernels, forward + backward, on one device."""
        return self.kernel_time(metaop, tp, dp).total

    def _tp_collectives(self, metaop: MetaOp, tp: int) -> int:
        """TP collectives of one operator's forward: its all-reduces, or with sequence parallelism an all-gather
        and a reduce-scatter for each."""
        if tp == 1 or metaop.kind != "layer":
            return 0
        return (2 + (1 if self._module(metaop).cross_attention else 0)) * (2 if self.sequence_parallel(metaop, tp)
                                                                            else 1)

    def _tp_collective_seconds(self, metaop: MetaOp, tp: int, dp: int) -> float:
        """Seconds of one of those collectives."""
        if tp == 1 or metaop.kind != "layer":
            return 0.0
        b, s, _ = metaop.input_shape
        sp = self.sequence_parallel(metaop, tp)
        tokens = b // dp * (sequence_parallel_tokens(s, tp) if sp else s)
        return self.comm.tp_collective_seconds(tokens * self._module(metaop).hidden_size * self.dtype_bytes, tp, sp)

    def tp_comm_seconds(self, metaop: MetaOp, tp: int, dp: int) -> float:
        """Megatron TP all-reduces of one operator (as many in the backward as in the forward)."""
        return 2 * self._tp_collectives(metaop, tp) * self._tp_collective_seconds(metaop, tp, dp)

    def dp_sync_seconds(self, metaop: MetaOp, tp: int, dp: int) -> float:
        """This operator's share of the bucketed gradient all-reduce over its dp ranks: its bytes at the DP
        group's bus bandwidth, and the bucket latency in proportion to its parameters."""
        params = 0 if metaop.frozen else self.operator_param_count(metaop) / tp
        if dp <= 1 or params <= 0:
            return 0.0
        group, concurrent = self.comm.dp_group(tp, dp)
        whole = self.comm.all_reduce(params * self.config.grad_bytes, group, concurrent)
        latency = self.comm.latency(group)
        return whole - latency + latency * min(1.0, params / bucket_params(dp))

    def data_comm_seconds(self, metaop: MetaOp, tp: int, dp: int) -> float:
        if metaop.kind != "loss" or dp == 1:
            return 0.0
        b, _, width = metaop.input_shape
        embeddings = 2 * b * width * self.dtype_bytes  # both towers' embeddings
        group, concurrent = self.comm.dp_group(tp, dp)
        # all-gather forward, reduce-scatter backward
        return self.comm.all_gather(embeddings, group, concurrent) + self.comm.reduce_scatter(
            embeddings, group, concurrent)

    def launch_floor_seconds(self, metaop: MetaOp, tp: int, dp: int = 1) -> float:
        """Host time to launch one operator's kernels and TP collectives, forward + backward."""
        return host_seconds(self.kernel_time(metaop, tp, dp), self._tp_collectives(metaop, tp), self.launch_seconds)

    def recompute_seconds(self, metaop: MetaOp, tp: int, dp: int, recompute, num_layers: int) -> float:
        """Seconds the backward of ``num_layers`` operators of ``metaop`` spends recomputing under ``recompute``
        (plan/schema.py ``Recompute``), on one device of a (tp, dp) config: selective reruns every layer's
        modules (op_kernels.rerun_kernels; the MLP's with its output's TP all-reduce), full reruns the whole
        forward of each recomputed layer, its TP all-reduces included (the others, with modules, as selective).
        Charged on top of ``phase_seconds`` of a model without ``config.recompute`` (the simulator does): a
        rerun launches its kernels again, so a host-bound layer pays them at the launch floor."""
        if metaop.kind != "layer" or num_layers <= 0 or metaop.backward == "none":
            return 0.0
        # full for some layers and selective for the others: two blocks
        return sum(self._block_recompute_seconds(metaop, tp, dp, rc, n)
                   for n, rc in recompute.blocks(num_layers))

    def _block_recompute_seconds(self, metaop: MetaOp, tp: int, dp: int, rc, num_layers: int) -> float:
        """``recompute_seconds`` of one block (``Recompute.blocks``)."""
        if rc.mode == "none":
            return 0.0
        self._check_config(metaop, tp, dp)
        modules = rc.recompute_modules if rc.mode == "selective" else None
        # memoised per operator: the planner's ladders ask for every k of full recomputation of a slice
        key = (*_operator_key(metaop, tp, dp), modules)
        rerun = self._reruns.get(key)
        if rerun is None:
            kernels = self._kernel_time(metaop, tp, dp, recompute=False)
            if modules is not None:
                seconds, launches = rerun_kernels(kernels.kernels, modules)
                allreduces = 1 if "mlp" in modules and tp > 1 else 0
                rerun = self._rerun_seconds(metaop, tp, dp, kernels, seconds, launches, allreduces)
            else:
                rerun = self._rerun_seconds(metaop, tp, dp, kernels, kernels.forward, kernels.forward_kernels,
                                            self._tp_collectives(metaop, tp))
            self._reruns[key] = rerun
        return (num_layers if modules is not None else rc.recomputed_layers(num_layers)) * rerun

    def _rerun_seconds(self, metaop: MetaOp, tp: int, dp: int, kernels: LayerTime, seconds: float, launches: int,
                       allreduces: int) -> float:
        """What one operator's forward + backward gains when its backward also reruns kernels of ``seconds`` and
        ``launches`` and ``allreduces`` TP all-reduces (phase_times: GPU time, or the host's launch floor)."""
        per_phase, ar_seconds = self._tp_collectives(metaop, tp), self._tp_collective_seconds(metaop, tp, dp)
        plain = sum(phase_times(kernels, per_phase, ar_seconds, self.launch_seconds, self.host_forward_weight))
        rerun = dataclasses.replace(kernels, backward=kernels.backward + seconds + allreduces * ar_seconds,
                                    backward_kernels=kernels.backward_kernels + launches + allreduces)
        return sum(phase_times(rerun, per_phase, ar_seconds, self.launch_seconds, self.host_forward_weight)) - plain

    def layer_cost(self, metaop: MetaOp, tp: int, dp: int) -> LayerCost:
        """Seconds for ONE operator of ``metaop``, forward + backward, on tp * dp devices."""
        fwd, bwd = self._analytic_phases(metaop, tp, dp)
        compute = self.compute_seconds(metaop, tp, dp)
        tp_comm = self.tp_comm_seconds(metaop, tp, dp)
        # The host launches kernels asynchronously: only the part of the launch floor longer than the GPU work
        # on the stream (compute and TP all-reduces) shows up, phase by phase (phase_times).
        return LayerCost(
            compute=compute,
            tp_comm=tp_comm,
            dp_sync=self.dp_sync_seconds(metaop, tp, dp),
            launch=max(0.0, fwd + bwd - compute - tp_comm),
            data_comm=self.data_comm_seconds(metaop, tp, dp),
        )
