"""Analytic cost model: seconds for ONE operator of a MetaOp (forward + backward) under a (tp, dp) config.

The time of an operator on n = tp * dp devices is the sum of

- compute: GEMM FLOPs at a sustained fraction of the datasheet peak, plus memory-bound element-wise work
  (norms, residual adds, activation functions, the embedding gather, cross entropy) at HBM bandwidth;
- tp_comm: the tensor-parallel all-reduces of a Megatron layer (2 forward, 2 backward) when tp > 1;
- dp_sync: the ring all-reduce of the operator's gradients over its dp ranks (the paper's c_m term);
- launch: the part of the per-kernel launch floor that the GPU work does not hide;
- data_comm: the contrastive loss's all-gather of the other DP ranks' embeddings when dp > 1.

The GEMM efficiency rises with the work per device and saturates (``eff_max * w / (w + w_half)``), so an
operator whose per-device work gets small stops speeding up: heavy vision layers scale almost linearly while
light text ops scale poorly, as the paper observes (Fig. 4).

Every constant below is an estimate for bf16 mixed-precision training with megatron-core kernels; profiles
(estimator.estimate_curves(profile=...)) override the model where measurements exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_spindle.estimator.configs import valid_tp_degrees
from megatron_spindle.estimator.errors import EstimatorError
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaOp
from megatron_spindle.graph.workload import ModuleSpec, Workload

# Backward costs twice the forward (gradients w.r.t. inputs and w.r.t. weights), so fwd + bwd = 3x forward.
FWD_BWD_FACTOR = 3

# Kernels launched per operator, forward + backward (about 1 : 2). A transformer layer runs ~12 kernels forward
# (2 norms, QKV GEMM, rotary/reshape, attention, output GEMM, 2 residual adds, FC1, activation, FC2, bias/dropout)
# and about twice as many backward. Light ops run a handful. The launch floor only matters for small ops.
KERNELS_PER_OPERATOR = {"layer": 36, "frontend": 9, "projector": 15, "head": 12, "lm_head": 15, "loss": 12}
CROSS_ATTENTION_KERNELS = 15  # norm, Q and KV GEMMs, attention, output GEMM, residual; fwd + bwd
TP_ALLREDUCES_PER_LAYER = 4  # Megatron TP: one after attention and one after the MLP, forward and backward
TP_ALLREDUCES_PER_CROSS_ATTENTION = 2  # the extra cross-attention block's output projection, fwd and bwd
# AdamW per fp32 master element: reads the master, exp_avg, exp_avg_sq and the gradient, writes the first three.
ADAMW_BYTES_PER_ELEMENT = 28


@dataclass(frozen=True)
class CostModelConfig:
    """Hardware-efficiency constants of the analytic model."""

    # Large bf16 GEMMs sustain ~70-80 % of datasheet peak; a whole layer (attention, short GEMMs) ~65 %.
    efficiency_max: float = 0.65
    # Per-device work at which GEMMs reach half of efficiency_max, as seconds of work at peak speed: kernels
    # under ~20 us at peak leave SMs idle (too few tiles, tail effects). Scaling with the peak makes faster GPUs
    # need more work to saturate, as they do (more SMs).
    half_efficiency_seconds: float = 20e-6
    # Streaming element-wise kernels reach ~70 % of HBM bandwidth.
    memory_efficiency: float = 0.7
    # PyTorch eager dispatch + CUDA launch per kernel: ~5-8 us; the GPU hides it only behind longer kernels.
    launch_seconds: float = 6e-6
    # Gradients are reduced in fp32 (main grads of mixed precision; the memory model counts 4 bytes for them).
    grad_bytes: int = 4
    # Full activation recomputation of transformer layers (Megatron's --recompute-granularity full): the
    # backward pass reruns each layer's forward, so a layer costs 4 forward passes instead of 3, and only each
    # layer's input is kept from forward to backward (see MemoryModel).
    recompute: bool = False

    def __post_init__(self):
        if not 0 < self.efficiency_max <= 1 or not 0 < self.memory_efficiency <= 1:
            raise EstimatorError("cost model: efficiencies must be in (0, 1]")
        if self.half_efficiency_seconds < 0 or self.launch_seconds < 0 or self.grad_bytes <= 0:
            raise EstimatorError(
                "cost model: half_efficiency_seconds and launch_seconds must be >= 0, grad_bytes > 0"
            )


@dataclass(frozen=True)
class OptimizerCost:
    """Seconds of one AdamW step: ``seconds_per_element`` per fp32 master element plus ``seconds_per_tensor``
    per stepped tensor (the engine steps one master per parameter unit; fused multi-tensor kernels make the
    latter ~0 on GPUs). ``source``: "analytic" (memory bandwidth of the cluster spec) or "measured"."""

    seconds_per_element: float
    seconds_per_tensor: float = 0.0
    source: str = "analytic"

    def __post_init__(self):
        if self.seconds_per_element < 0 or self.seconds_per_tensor < 0:
            raise EstimatorError("optimizer cost: seconds must be >= 0")

    def seconds(self, elements: float, tensors: int = 0) -> float:
        if elements <= 0:
            return 0.0
        return elements * self.seconds_per_element + tensors * self.seconds_per_tensor

    def to_dict(self) -> dict:
        return {"seconds_per_element": self.seconds_per_element, "seconds_per_tensor": self.seconds_per_tensor,
                "source": self.source}


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


@dataclass(frozen=True)
class _Traffic:
    """HBM bytes of memory-bound work for the whole batch, fwd + bwd: split by TP or replicated on TP ranks."""

    tp_sharded: float
    tp_replicated: float


def _parse_unit(param_name: str) -> tuple[str, str]:
    """'vision@t1.layers.3' -> ('vision@t1', 'layers.3'); 'llm.lm_head' -> ('llm', 'lm_head')."""
    owner, sep, unit = param_name.partition(".")
    if not sep or not owner or not unit:
        raise EstimatorError(
            f"parameter unit '{param_name}': expected '<module>.<unit>' with unit one of layers.<i>, frontend, "
            f"head, lm_head, projector"
        )
    return owner, unit


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
        self._param_counts: dict[str, int] = {}

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

    def _vocab(self, metaop: MetaOp, module: ModuleSpec) -> int:
        if not module.lm_vocab:
            raise EstimatorError(
                f"MetaOp '{metaop.id}': lm_head on module '{module.name}' without a vocab_size"
            )
        return module.lm_vocab

    @staticmethod
    def _embed_dim(module: ModuleSpec) -> int:
        return module.embed_dim or module.hidden_size

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
        """Forward + backward FLOPs of ONE operator of ``metaop`` for its whole batch (backward = 2x forward)."""
        factor = FWD_BWD_FACTOR + (1 if self.config.recompute and metaop.kind == "layer" else 0)
        return factor * self.forward_flops(metaop)

    # ------------------------------------------------------------------------------ memory-bound bytes

    def _traffic(self, metaop: MetaOp) -> _Traffic:
        d = self.dtype_bytes
        b, s, x = metaop.input_shape
        if metaop.kind == "loss":
            return _Traffic(FWD_BWD_FACTOR * 4.0 * b * b * 2, 0.0)  # fp32 softmax over the B x B logits
        module = self._module(metaop)
        h = module.hidden_size
        if metaop.kind == "layer":
            # Norms read + write (2 x 2 passes), residual adds read 2 + write 1 (2 x 3): 10 passes over B*S*H,
            # replicated on TP ranks (no sequence parallelism). The activation reads F and writes F (SwiGLU: 2F
            # in, F out) and is split by TP.
            passes = 10 + (5 if module.cross_attention else 0)
            act_passes = 3 if self._is_swiglu(module) else 2
            ffn = module.ffn_hidden_size
            return _Traffic(
                FWD_BWD_FACTOR * d * b * s * ffn * act_passes, FWD_BWD_FACTOR * d * b * s * h * passes
            )
        if metaop.kind == "frontend":
            fe = module.frontend
            if fe is not None and fe.type == "text":
                # Gather rows (read + write) forward; backward reads the gradient and scatter-adds into the fp32
                # embedding gradient (read + write 4 bytes).
                return _Traffic(b * s * h * (3 * d + 8.0), 0.0)
            passes = 3 + (2 if fe is not None and fe.pre_norm else 0)  # bias, position add, layout copy, norm
            if fe is not None and fe.stem == "conv":  # two GELUs (read + write), conv1's at the frame rate
                passes += 2 * fe.patch_size + 2
            return _Traffic(FWD_BWD_FACTOR * d * b * s * h * passes, 0.0)
        if metaop.kind == "projector":
            return _Traffic(FWD_BWD_FACTOR * d * b * s * h * 3, 0.0)  # activation read + write, pooling read
        if metaop.kind == "head":
            return _Traffic(
                FWD_BWD_FACTOR * d * b * s * h * 3, 0.0
            )  # final norm read + write, mean-pool read
        if metaop.kind == "lm_head":
            vocab = self._vocab(metaop, module)
            norm = FWD_BWD_FACTOR * d * b * s * h * 2
            cross_entropy = b * s * vocab * (2 * d + 8.0)  # logits in, fp32 softmax, fp32 grad, grad out
            return _Traffic(norm + cross_entropy, 0.0)
        raise EstimatorError(f"MetaOp '{metaop.id}': unknown kind '{metaop.kind}'")

    def memory_bytes(self, metaop: MetaOp) -> float:
        """HBM bytes moved by the memory-bound parts of one operator, whole batch, forward + backward."""
        traffic = self._traffic(metaop)
        return traffic.tp_sharded + traffic.tp_replicated

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
        module_name = owner.partition("@")[0]
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
            patches = (fe.image_size // fe.patch_size) ** 2 + (1 if fe.class_token else 0)
            cls = h if fe.class_token else 0
            pre_norm = 2 * h if fe.pre_norm else 0
            bias = h if fe.patch_bias else 0
            return fe.in_channels * fe.patch_size**2 * h + bias + cls + patches * h + pre_norm  # conv, cls, pos
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
        """Bytes one operator exchanges across DP ranks whatever n is (the paper's c_m): its fp32 gradients,
        and for a contrastive loss both embeddings."""
        grads = self.operator_param_count(metaop) * self.config.grad_bytes
        if metaop.kind == "loss":
            return grads + 2.0 * metaop.batch * metaop.hidden * self.dtype_bytes
        return float(grads)

    # ------------------------------------------------------------------------------------ communication

    def _link(self, devices_spanned: int) -> tuple[float, float]:
        """(bandwidth, latency) of a collective whose group spans ``devices_spanned`` compactly placed devices:
        NVLink when they fit in one node, else the network (the slowest link of a ring sets its speed)."""
        if devices_spanned <= self.cluster.gpus_per_node:
            return self.cluster.intra_node_bw, self.cluster.intra_node_latency
        return self.cluster.inter_node_bw, self.cluster.inter_node_latency

    def optimizer_cost(self) -> OptimizerCost:
        """AdamW is a streaming element-wise update: ``ADAMW_BYTES_PER_ELEMENT`` of HBM traffic per element."""
        bandwidth = self.cluster.gpu.memory_bandwidth * self.config.memory_efficiency
        return OptimizerCost(ADAMW_BYTES_PER_ELEMENT / bandwidth, 0.0, "analytic")

    def optimizer_seconds(self, elements: float, tensors: int = 0) -> float:
        """One AdamW step over ``tensors`` master tensors of ``elements`` fp32 elements in all."""
        return self.optimizer_cost().seconds(elements, tensors)

    def allreduce_seconds(self, num_bytes: float, ranks: int, devices_spanned: int) -> float:
        """Ring all-reduce of ``num_bytes`` per rank: 2(p-1)/p of the data over each link, 2(p-1) hops."""
        if ranks <= 1 or num_bytes <= 0:
            return 0.0
        bandwidth, latency = self._link(devices_spanned)
        return 2 * (ranks - 1) / ranks * num_bytes / bandwidth + 2 * (ranks - 1) * latency

    def allgather_seconds(self, total_bytes: float, ranks: int, devices_spanned: int) -> float:
        """Ring all-gather (or reduce-scatter) of ``total_bytes`` in all: (p-1)/p of it per link, p-1 hops."""
        if ranks <= 1 or total_bytes <= 0:
            return 0.0
        bandwidth, latency = self._link(devices_spanned)
        return (ranks - 1) / ranks * total_bytes / bandwidth + (ranks - 1) * latency

    # ---------------------------------------------------------------------------------------------- time

    def efficiency(self, per_device_flops: float) -> float:
        """Fraction of peak FLOP/s reached with ``per_device_flops`` of GEMM work: eff_max * w / (w + w_half)."""
        w_half = self.cluster.gpu.peak_flops * self.config.half_efficiency_seconds
        if per_device_flops <= 0:
            return 0.0
        return self.config.efficiency_max * per_device_flops / (per_device_flops + w_half)

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

    def compute_seconds(self, metaop: MetaOp, tp: int, dp: int) -> float:
        """GEMM time at the efficiency the per-device work reaches, plus memory-bound time at HBM bandwidth."""
        per_device_flops = self.flops(metaop) / (tp * dp)
        gemm = 0.0
        if per_device_flops > 0:
            gemm = per_device_flops / (self.cluster.gpu.peak_flops * self.efficiency(per_device_flops))
        traffic = self._traffic(metaop)
        per_device_bytes = traffic.tp_sharded / (tp * dp) + traffic.tp_replicated / dp
        memory = per_device_bytes / (self.cluster.gpu.memory_bandwidth * self.config.memory_efficiency)
        return gemm + memory

    def tp_comm_seconds(self, metaop: MetaOp, tp: int, dp: int) -> float:
        if tp == 1 or metaop.kind != "layer":
            return 0.0
        module = self._module(metaop)
        b, s, _ = metaop.input_shape
        count = TP_ALLREDUCES_PER_LAYER + (TP_ALLREDUCES_PER_CROSS_ATTENTION if module.cross_attention else 0)
        per_rank = b / dp * s * module.hidden_size * self.dtype_bytes
        return count * self.allreduce_seconds(per_rank, tp, tp)

    def dp_sync_seconds(self, metaop: MetaOp, tp: int, dp: int) -> float:
        grad_bytes = self.operator_param_count(metaop) / tp * self.config.grad_bytes
        return self.allreduce_seconds(grad_bytes, dp, tp * dp)

    def data_comm_seconds(self, metaop: MetaOp, tp: int, dp: int) -> float:
        if metaop.kind != "loss" or dp == 1:
            return 0.0
        b, _, width = metaop.input_shape
        embeddings = 2 * b * width * self.dtype_bytes  # both towers' embeddings
        return 2 * self.allgather_seconds(
            embeddings, dp, tp * dp
        )  # all-gather forward, reduce-scatter backward

    def launch_floor_seconds(self, metaop: MetaOp, tp: int) -> float:
        kernels = KERNELS_PER_OPERATOR[metaop.kind]
        if metaop.kind == "layer":
            module = self._module(metaop)
            kernels += CROSS_ATTENTION_KERNELS if module.cross_attention else 0
            if tp > 1:
                kernels += TP_ALLREDUCES_PER_LAYER + (
                    TP_ALLREDUCES_PER_CROSS_ATTENTION if module.cross_attention else 0
                )
        return kernels * self.config.launch_seconds

    def layer_cost(self, metaop: MetaOp, tp: int, dp: int) -> LayerCost:
        """Seconds for ONE operator of ``metaop``, forward + backward, on tp * dp devices."""
        self._check_config(metaop, tp, dp)
        compute = self.compute_seconds(metaop, tp, dp)
        tp_comm = self.tp_comm_seconds(metaop, tp, dp)
        # The host launches kernels asynchronously: only the part of the launch floor longer than the GPU work
        # on the stream (compute and TP all-reduces) shows up.
        launch = max(0.0, self.launch_floor_seconds(metaop, tp) - compute - tp_comm)
        return LayerCost(
            compute=compute,
            tp_comm=tp_comm,
            dp_sync=self.dp_sync_seconds(metaop, tp, dp),
            launch=launch,
            data_comm=self.data_comm_seconds(metaop, tp, dp),
        )
