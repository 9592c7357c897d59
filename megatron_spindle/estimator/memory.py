"""Device memory numbers of a slice: parameter state (weights, gradients, optimizer) and activations kept for
backward.

Mixed-precision training with Adam and no optimizer sharding holds 18 bytes per parameter: a bf16 weight (2),
an fp32 main gradient (4), an fp32 master weight (4) and the two fp32 Adam moments (4 + 4); the constants and
the ZeRO sharding rule are plan/memory.py's, which also holds the rules that add these numbers up per device.
"""

from __future__ import annotations

from megatron_spindle.estimator.cost_model import AnalyticCostModel
from megatron_spindle.estimator.errors import EstimatorError
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaOp
from megatron_spindle.graph.workload import ModuleSpec, Workload
from megatron_spindle.plan.memory import STATE_BYTES_PER_PARAM, zero_sharded_bytes


class MemoryModel:
    """Bytes per device for the slices of a plan."""

    def __init__(self, workload: Workload, cluster: ClusterSpec, cost_model: AnalyticCostModel | None = None,
                 distributed_optimizer: bool = False):
        # distributed_optimizer: the optimizer state (master weights, Adam moments) of a unit is sharded over
        # the data-parallel ranks that run it (ZeRO-1, Megatron's --use-distributed-optimizer).
        self.distributed_optimizer = distributed_optimizer
        self.workload = workload
        self.cluster = cluster
        self.cost_model = cost_model or AnalyticCostModel(workload, cluster)
        self.dtype_bytes = self.cost_model.dtype_bytes

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage ``param_state_bytes`` shards for: 1 with the distributed optimizer, else 0."""
        return 1 if self.distributed_optimizer else 0

    # ---------------------------------------------------------------------------------------- parameters

    def param_state_bytes(self, param_name: str, tp: int, dp: int = 1) -> float:
        """Weights + gradients + Adam state of one parameter unit on each of its tp ranks (the optimizer state
        split over ``dp`` ranks with the distributed optimizer: plan/memory.py's ZeRO rule). Norms and some
        biases are replicated rather than split by TP; they are tiny, so we divide everything by tp."""
        _check_positive("tp", tp)
        _check_positive("dp", dp)
        state = self.cost_model.param_count(param_name) / tp * STATE_BYTES_PER_PARAM
        return zero_sharded_bytes(state, self.zero_stage, dp)

    def slice_param_state_bytes(self, metaop: MetaOp, tp: int, layer_start: int, layer_end: int,
                                dp: int = 1) -> float:
        """Parameter state of layers [layer_start, layer_end) of the MetaOp's chain on one device."""
        _check_layer_range(metaop, layer_start, layer_end)
        units = {p for ps in metaop.params[layer_start:layer_end] for p in ps}
        return sum(self.param_state_bytes(p, tp, dp) for p in units)

    # --------------------------------------------------------------------------------------- activations

    def _transformer_layer(self, module: ModuleSpec, micro_batch: float, tokens: int, tp: int) -> float:
        """Activations of one layer (Korthikanti et al. 2022, no sequence parallelism), generalised to any FFN
        width, GQA and SwiGLU. Replicated on TP ranks: norm inputs (4 sbh), QKV and FC1 inputs (2 + 2), dropout
        masks (1 + 1). Split by TP: Q and the output-projection input (2 + 2), K and V (2 + 2 per KV width),
        the MLP intermediates (GELU: FC1 output + activation, 4 sbF; SwiGLU: gate, up, SiLU and product, 8 sbF)
        and the attention scores 5 a s^2 b (softmax output, dropout mask and output; kept as an upper bound:
        a flash-attention kernel stores none of them)."""
        s, b, h = tokens, micro_batch, module.hidden_size
        kv = h // module.num_heads * module.query_groups
        mlp = (8 if module.kind == "llm" else 4) * module.ffn_hidden_size
        replicated = 10 * s * b * h
        split = s * b * (4 * h + 4 * kv + mlp) + 5 * module.num_heads * s * s * b
        if module.cross_attention:
            replicated += 5 * s * b * h  # norm input, query input, dropout mask
            split += s * b * (4 * h + 4 * kv) + 5 * module.num_heads * s * s * b
        return replicated + split / tp

    def _light_op(self, metaop: MetaOp, micro_batch: float) -> float:
        d = self.dtype_bytes
        b, s = micro_batch, metaop.tokens
        if metaop.kind == "loss":
            # Both towers' embeddings gathered from all DP ranks, and the fp32 softmax of b x B logits.
            return 2 * metaop.batch * metaop.hidden * d + b * metaop.batch * 4
        module = self.workload.modules[metaop.module]
        h = module.hidden_size
        if metaop.kind == "frontend":
            fe = module.frontend
            if fe is None or fe.type == "text":
                return b * s * 8  # int64 token ids for the embedding gradient
            if fe.stem == "conv":  # input frames, conv1 output + GELU (frame rate), conv2 output + GELU
                return b * s * (fe.patch_size * (fe.in_channels + 2 * h) + 2 * h) * d
            k = 2 if fe.type == "patch" else 1
            extra = 2 * s * h if fe.pre_norm else 0  # the norm's input and output
            return b * (s * fe.in_channels * fe.patch_size**k + extra) * d  # raw patches for the weight gradient
        if metaop.kind == "projector":
            return b * s * (module.in_size + 2 * h) * d  # input, FC1 output, activation output
        if metaop.kind == "head":
            return b * (2 * s * h + h) * d  # norm input, normed tokens, pooled vector
        if metaop.kind == "lm_head":
            return b * s * 2 * h * d + b * s * module.lm_vocab * 4  # norm in/out and fp32 logits for CE
        raise EstimatorError(f"MetaOp '{metaop.id}': unknown kind '{metaop.kind}'")

    def activation_bytes(self, metaop: MetaOp, tp: int, dp: int, num_layers: int) -> float:
        """Bytes held on one device from forward to backward by ``num_layers`` operators of the MetaOp run
        with (tp, dp): each DP rank keeps its B/dp samples."""
        _check_positive("tp", tp)
        _check_positive("dp", dp)
        if metaop.batch % dp:
            raise EstimatorError(f"MetaOp '{metaop.id}': dp {dp} does not divide the batch {metaop.batch}")
        if not isinstance(num_layers, int) or not 0 <= num_layers <= metaop.num_layers:
            raise EstimatorError(
                f"MetaOp '{metaop.id}': num_layers must be an integer in 0..{metaop.num_layers}, got {num_layers!r}"
            )
        if metaop.kind != "loss" and metaop.module not in self.workload.modules:
            raise EstimatorError(f"MetaOp '{metaop.id}': module '{metaop.module}' is not in the workload")
        micro_batch = metaop.batch / dp
        if metaop.kind == "layer":
            module = self.workload.modules[metaop.module]
            per_layer = self._transformer_layer(module, micro_batch, metaop.tokens, tp) * self.dtype_bytes / 2
            if self.cost_model.config.recompute and num_layers:
                # Only each layer's input stays (replicated on TP ranks); one layer's full activations exist
                # while it is recomputed in backward.
                layer_input = micro_batch * metaop.tokens * module.hidden_size * self.dtype_bytes
                return num_layers * layer_input + per_layer
            return num_layers * per_layer
        return num_layers * self._light_op(metaop, micro_batch)


def _check_positive(what: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise EstimatorError(f"{what} must be a positive integer, got {value!r}")


def _check_layer_range(metaop: MetaOp, layer_start: int, layer_end: int) -> None:
    if not 0 <= layer_start <= layer_end <= metaop.num_layers:
        raise EstimatorError(
            f"MetaOp '{metaop.id}': layers [{layer_start}, {layer_end}) outside its chain of {metaop.num_layers}"
        )
