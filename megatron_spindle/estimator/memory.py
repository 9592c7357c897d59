"""Device memory numbers of a slice: parameter state (weights, gradients, optimizer) and activations kept for
backward.

Mixed-precision training with Adam and no optimizer sharding holds 18 bytes per parameter: a bf16 weight (2),
an fp32 main gradient (4), an fp32 master weight (4) and the two fp32 Adam moments (4 + 4); the constants and
the ZeRO sharding rule are plan/memory.py's, which also holds the rules that add these numbers up per device.

Activations are what the operators' autograd graph saves, tensor by tensor, as megatron-core's local layer
spec and our operators (models/) save them: measured on CPU with ``torch.autograd.graph.saved_tensors_hooks``
(tests/runtime/test_memory_measured.py compares whole plans against the runtime). A transformer layer on one
device of a (tp, dp) slice, T = b * s tokens of its data-parallel shard, d bytes per activation element:

- pre-attention norm: its input and per-token statistics (LayerNorm: mean and rstd; RMSNorm: rstd and the
  normalised input), and its output (the QKV projection's input);
- attention, unfused (megatron-core's DotProductAttention): the QKV output (q, k, v are views of it), or new
  q and k after RoPE and k, v expanded to every head under GQA; the softmax output ``a s^2 b / tp`` (in fp32
  and again in d bytes when d < 4: the softmax runs in fp32); FlashAttention (``CostModelConfig.attention``):
  q, k, v and the per-row log-sum-exp, no s^2 term;
- the attention output (the output projection's input), the residual (the MLP norm's input), that norm;
- MLP: GELU keeps the biased FC1 output and the activation (2 T F / tp); SwiGLU the FC1 output, the SiLU
  output, the linear half and their product (5 T F / tp).

Recomputation (``Recompute``): ``selective`` reruns the parts ``recompute_modules`` names, in every layer:
``core_attn`` keeps what enters the attention core (q, k, v before any expansion) instead of what it saves
inside; ``layernorm`` keeps each pre-norm's input only (its statistics are not saved, and its output is released
once used: megatron-core's ``CheckpointWithoutOutput``); ``mlp`` keeps the MLP's input only (the pre-MLP norm's
output, counted with that norm). While one layer's backward reruns them it needs that layer's rerun tensors
again (``core``, the MLP's, a norm's output). ``full`` keeps a recomputed layer's input only, and needs one
layer's (a chunk's) full activations while its backward runs; with modules, the layers it does not recompute
fully are selective's (two blocks, one after another).

Dropout (``--hidden-dropout``, ``--attention-dropout`` > 0) keeps its mask for the backward: torch's
``native_dropout`` on a GPU a one-byte mask, on a CPU the scaled noise in the activations' dtype (what it
multiplies by). Hidden dropout runs on each block's output (the positions of the layer input here, under sequence
parallelism 1/tp of them); unfused attention's on the probabilities, whose dropped copy the PV product then keeps
(in fp32 that is a new tensor beside the softmax output; in 16 bits it replaces the 16-bit copy of the fp32
softmax output); FlashAttention's inside its kernel (nothing kept). Selective recomputation of the core reruns
its dropout, which replays the same mask (megatron-core restores the RNG states).

Sequence parallelism (Megatron's ``--sequence-parallel``, where plan/schema.py ``sequence_parallel_runs`` applies
it): the sequence is padded to a multiple of tp (causal modules), the pre-norms run on this rank's 1/tp of it,
so their inputs, statistics and outputs, and the layer's input, are of s / tp positions; the tensors inside
attention and the MLP are of the whole (padded) sequence at 1/tp of the width, as without it (the column-parallel
projections save their sequence-parallel input and gather it again in the backward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_spindle.estimator.cost_model import AnalyticCostModel
from megatron_spindle.estimator.errors import EstimatorError
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaOp
from megatron_spindle.graph.workload import ModuleSpec, Workload, output_tokens
from megatron_spindle.plan.memory import unit_state_bytes, zero_sharded_bytes
from megatron_spindle.plan.schema import Recompute, sequence_parallel_runs, sequence_parallel_tokens

FP32, INT64 = 4, 8


@dataclass(frozen=True)
class LayerActivations:
    """Bytes one transformer layer saves on one device: ``full`` without recomputation, ``selective`` with its
    attention core recomputed, ``input`` the layer's input (all a fully recomputed layer keeps). For the
    selective modules: ``norm`` what one pre-norm holds beyond its input (its statistics and output: what
    layernorm recomputation frees, per norm), ``mlp`` the MLP's own tensors (what MLP recomputation frees, and
    needs again while it reruns), ``core_saved`` the core's tensors before the layer's backward frees anything
    (what rerunning the core needs beyond what that backward has freed by then: ``selective_memory``)."""

    full: float
    selective: float
    input: float
    norm: float = 0.0
    mlp: float = 0.0
    core_saved: float = 0.0
    mlp_checkpoint: float = 0.0  # what MLP recomputation keeps that the layer did not: frozen, the MLP's input

    def selective_memory(self, modules: tuple[str, ...]) -> tuple[float, float]:
        """(held, transient) of one layer whose selective recomputation reruns ``modules`` (plan/schema.py
        RECOMPUTE_MODULES). The backward reruns the MLP first (its input norm's output with it under layernorm
        recomputation), then the second norm, then the attention core, having freed the MLP's tensors and the
        second norm's (its input, of the layer input's size, and the rest) by then."""
        core_attn, layernorm, mlp = ("core_attn" in modules, "layernorm" in modules, "mlp" in modules)
        held = self.full
        held -= (self.full - self.selective) if core_attn else 0.0
        held -= 2 * self.norm if layernorm else 0.0
        # the MLP's input is its checkpoint's, unless layernorm recomputation releases that norm's output
        held -= self.mlp - (0.0 if layernorm else self.mlp_checkpoint) if mlp else 0.0
        freed = (0.0 if mlp else self.mlp) + self.input + (0.0 if layernorm else self.norm)  # the second norm's
        transient = max(self.mlp + (self.norm if layernorm else 0.0) if mlp else 0.0,
                        self.norm if layernorm else 0.0,
                        max(0.0, self.core_saved - freed) if core_attn else 0.0)
        return held, transient


class MemoryModel:
    """Bytes per device for the slices of a plan. ``recompute``: the recomputation of slices that name none
    (default: full recomputation of every layer when the cost model's ``config.recompute``, else none)."""

    def __init__(self, workload: Workload, cluster: ClusterSpec, cost_model: AnalyticCostModel | None = None,
                 distributed_optimizer: bool = False, recompute: Recompute | None = None,
                 zero_stage: int | None = None, sequence_parallel: bool | None = None,
                 tp_sharded_grads: bool = True):
        # distributed_optimizer: the optimizer state (master weights, Adam moments) of a unit is sharded over
        # the data-parallel ranks that run it (ZeRO-1, Megatron's --use-distributed-optimizer); ``zero_stage``
        # instead names the stage (2: the gradients too)
        self._zero_stage = zero_stage if zero_stage is not None else (1 if distributed_optimizer else 0)
        self.distributed_optimizer = self._zero_stage >= 1
        # the gradients' layout the stage shards in (plan/schema.py ExecutionSettings.tp_sharded_grads)
        self.tp_sharded_grads = tp_sharded_grads
        self.workload = workload
        self.cluster = cluster
        self.cost_model = cost_model or AnalyticCostModel(workload, cluster)
        self.dtype_bytes = self.cost_model.dtype_bytes
        self.grad_bytes = self.cost_model.config.grad_bytes  # main gradients (plan/memory.py)
        self.attention = self.cost_model.config.attention
        if recompute is None:
            recompute = Recompute("full" if self.cost_model.config.recompute else "none")
        self.recompute = recompute
        self.hidden_dropout = self.cost_model.config.hidden_dropout > 0
        self.attention_dropout = self.cost_model.config.attention_dropout > 0
        # bytes per element a dropout keeps: native_dropout's bool mask on GPUs, the dtype's noise on CPUs
        self.mask_bytes = self.dtype_bytes if cluster.gpu.arch == "cpu" else 1
        # the plan setting (None: the cost model's); where it applies: plan/schema.py sequence_parallel_runs
        self.sequence_parallel = self.cost_model.config.sequence_parallel if sequence_parallel is None \
            else sequence_parallel
        self._activations: dict[tuple, tuple[float, float]] = {}  # activation_memory's answers

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage ``param_state_bytes`` shards for: as given, else 1 with the distributed optimizer, 0
        without."""
        return self._zero_stage

    # ---------------------------------------------------------------------------------------- parameters

    def param_state_bytes(self, param_name: str, tp: int, dp: int | None = None,
                          weight_dp: int | None = None) -> float:
        """Weights + gradients + Adam state of one parameter unit on each of its tp ranks. Without ``dp``: the
        unsharded state of a TP rank (plan/memory.py ``MemoryNumbers``, which ``ZeroSharded`` shards); with it,
        one device's share under this model's ZeRO stage and gradient layout (plan/memory.py
        ``zero_sharded_bytes``). Norms and some biases are replicated rather than split by TP; they are tiny, so
        we divide everything by tp. A frozen module's unit holds its weights alone (plan/memory.py
        ``unit_state_bytes``). ``weight_dp``: ZeRO-3's weights sharded over that many devices, not ``dp``."""
        _check_positive("tp", tp)
        frozen = self.is_frozen_unit(param_name)
        state = unit_state_bytes(self.cost_model.param_count(param_name) / tp, frozen, self.grad_bytes)
        if dp is None:
            return state
        _check_positive("dp", dp)
        return zero_sharded_bytes(state, self.zero_stage, dp, tp, self.tp_sharded_grads, frozen, self.grad_bytes,
                                  weight_dp)

    def is_frozen_unit(self, param_name: str) -> bool:
        return self.workload.is_frozen_unit(param_name)

    def slice_param_state_bytes(self, metaop: MetaOp, tp: int, layer_start: int, layer_end: int,
                                dp: int = 1) -> float:
        """Parameter state of layers [layer_start, layer_end) of the MetaOp's chain on one device."""
        _check_layer_range(metaop, layer_start, layer_end)
        units = {p for ps in metaop.params[layer_start:layer_end] for p in ps}
        return sum(self.param_state_bytes(p, tp, dp) for p in units)

    # --------------------------------------------------------------------------------------- activations

    def _norm(self, module: ModuleSpec, tokens: float, frozen: bool = False) -> float:
        """What a pre-norm saves besides its output: its input and per-token statistics (RMSNorm, composed of
        torch ops: rstd and the normalised input, which only the weight's gradient reads; LayerNorm: mean and
        rstd)."""
        h, d = module.hidden_size, self.dtype_bytes
        if module.kind == "llm":
            return tokens * ((1 if frozen else 2) * h * d + FP32)
        return tokens * (h * d + 2 * FP32)

    def _attention(self, module: ModuleSpec, b: float, s: int, tp: int,
                   kv_len: int | None = None) -> tuple[float, float, float]:
        """(saved without recomputation, saved with the core recomputed, saved inside the core) of one
        attention block's core on one device, excluding its output; ``kv_len``: keys from a memory of that
        length (cross-attention, no RoPE), else self-attention."""
        h, a, d = module.hidden_size, module.num_heads, self.dtype_bytes
        kv = h // a * module.query_groups
        sk = s if kv_len is None else kv_len
        tq, tk = b * s, b * sk
        rotary, gqa = module.kind == "llm" and kv_len is None, module.query_groups < a
        qkv = (tq * h + 2 * tk * kv) / tp * d  # the projection's output: q, k, v are views of it
        q_rope = tq * h / tp * d if rotary else 0.0  # RoPE makes new q and k
        k_rope = tk * kv / tp * d if rotary else 0.0
        entering = q_rope + k_rope + qkv  # q, k, v as the core receives them (v is always a view)
        if self.attention == "flash":
            lse = a / tp * s * b * FP32
            return entering + lse, entering, lse
        # unfused: baddbmm keeps q and k, the PV product the softmax output and v; under GQA k and v are first
        # repeated to every query head (new tensors), so the projection's output stays only through views
        expanded = 2 * tk * h / tp * d if gqa else 0.0
        probs = a / tp * s * sk * b * (d + (FP32 if d < FP32 else 0))
        if self.attention_dropout:  # its mask, and the dropped copy where the fp32 softmax output is kept as is
            probs += a / tp * s * sk * b * (self.mask_bytes + (d if d >= FP32 else 0))
        k_kept = 0.0 if gqa else k_rope
        views = (not rotary) or (not gqa)
        kept = q_rope + k_kept + expanded + (qkv if views else 0.0) + probs
        return kept, entering, probs + expanded

    def layer_activations(self, module: ModuleSpec, micro_batch: float, tokens: int, tp: int,
                          sequence_parallel: bool = False, frozen: bool = False) -> LayerActivations:
        """Bytes one transformer layer of ``module`` saves on one device for ``micro_batch`` samples of
        ``tokens`` tokens at TP degree ``tp``, sequence-parallel or not (see the module docstring). ``frozen``:
        its weights need no gradient (a frozen module whose input needs one): megatron-core's linears then keep
        only their weights (``LinearWithFrozenWeight``), so the tensors only a projection's weight gradient
        reads are not saved: the norms' outputs, the attention output, the second MLP linear's input (and under
        cross-attention the memory)."""
        b, h, d = micro_batch, module.hidden_size, self.dtype_bytes
        s = sequence_parallel_tokens(tokens, tp) if sequence_parallel else tokens  # padded (causal modules)
        t = b * s
        local = t // tp if sequence_parallel else t  # positions of the norms and the layer input here
        f = module.ffn_hidden_size
        mlp = ((5 if module.kind == "llm" else 2) - frozen) * t * f / tp * d  # frozen: not the FC2 input
        kept = 0 if frozen else 1  # tensors only a projection's weight gradient reads
        norm = self._norm(module, local, frozen) + kept * local * h * d  # input, statistics, output (a projection's input)
        block = 2 * norm + kept * t * h / tp * d  # both norms and the attention output (the output projection's input)
        if module.kind == "llm":  # RoPE's cos and sin of q and k, per position
            block += 4 * s * (h // module.num_heads) * d
        if self.hidden_dropout:  # the masks of the attention's and the MLP's bias-dropout-add
            block += (3 if module.cross_attention else 2) * local * h * self.mask_bytes
        plain, entering, core = self._attention(module, b, s, tp)
        full, selective = block + plain + mlp, block + entering + mlp
        if module.cross_attention:  # a second attention block over a memory as long and wide as the layer's
            cross_plain, cross_entering, cross_core = self._attention(module, b, s, tp, kv_len=s)
            extra = norm + kept * (t * h / tp * d + t * h * d)  # its norm, output, and the memory (the k/v input)
            full += extra + cross_plain
            selective += extra + cross_entering
            core += cross_core
        # what recomputing a norm frees: frozen, only its statistics (its input is the checkpoint's, its output
        # was not kept); the MLP's checkpoint keeps the MLP's input, which a frozen FC1 did not
        return LayerActivations(full, selective, input=local * h * d, norm=norm - local * h * d, mlp=mlp,
                                core_saved=core, mlp_checkpoint=(1 - kept) * local * h * d)

    def _light_op(self, metaop: MetaOp, micro_batch: float, tp: int = 1) -> float:
        d = self.dtype_bytes
        b, s = micro_batch, metaop.tokens
        if metaop.kind == "loss":
            # fp32: each tower's embedding and norm, both normalised towers gathered over DP ranks, the two
            # log-softmaxes of the B x B logits every rank computes, the targets.
            batch, width = metaop.batch, metaop.hidden
            return FP32 * (2 * b * width + 4 * b + 2 * batch * width) + 2 * batch * batch * FP32 + INT64 * batch
        module = self.workload.modules[metaop.module]
        h = module.hidden_size
        if metaop.kind == "frontend":
            fe = module.frontend
            if fe is None or fe.type == "text":  # token ids for the embedding gradient, the dropout's mask
                return b * s * (INT64 + (h * self.mask_bytes if self.hidden_dropout else 0))
            if fe.stem == "conv":  # input frames, conv1 output + GELU (frame rate), conv2 output
                return b * s * (fe.patch_size * (fe.in_channels + 2 * h) + h) * d
            if fe.type == "patch":
                patches = s - fe.class_tokens
                extra = s * (h * d + 2 * FP32) if fe.pre_norm else 0  # the norm's input and statistics
                return b * (patches * fe.in_channels * fe.patch_size**2 * d + extra)  # patches for the weight grad
            return b * s * fe.in_channels * fe.patch_size * d  # windows for the weight gradient
        # frozen (a module between trainable ones): the linears keep no input, only their weights
        if metaop.kind == "projector":
            tokens = s // module.pool
            if metaop.frozen:
                return b * tokens * h * d  # the activation's input (the FC1 output)
            return b * tokens * (module.in_size + 2 * h) * d  # (pooled) input, FC1 output, activation output
        if metaop.kind == "head":
            pooled = b * s * h * d if module.pooling == "cls" else b * h * d  # a view of the norm output, or a copy
            # norm input and statistics, what the projection reads
            return b * s * (h * d + 2 * FP32) + (0 if metaop.frozen else pooled)
        if metaop.kind == "lm_head":
            text = self._own_text_tokens(metaop)
            t = b * text
            vocab = module.lm_vocab / tp
            # the text positions' copy, the RMSNorm's rstd, normalised input and output (frozen: neither, only
            # the weight gradients read them); two fp32 [T, V] tensors of the cross entropy (logits, their exp),
            # the targets, per-token sums and masks
            copies = 1 if metaop.frozen else 3
            return t * (copies * h * d + FP32) + 2 * t * vocab * FP32 + t * (INT64 + FP32 + 2)
        raise EstimatorError(f"MetaOp '{metaop.id}': unknown kind '{metaop.kind}'")

    def _own_text_tokens(self, metaop: MetaOp) -> int:
        """Tokens of the LM module's own text in the task (the positions that carry labels)."""
        task = self.workload.task(metaop.task)
        own = task.tokens[metaop.module] - sum(output_tokens(self.workload, task, p)
                                               for p in task.predecessors(metaop.module))
        return max(0, own)

    def _check(self, metaop: MetaOp, tp: int, dp: int, num_layers: int) -> None:
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

    def activation_memory(self, metaop: MetaOp, tp: int, dp: int, num_layers: int,
                          recompute: Recompute | None = None,
                          sequence_parallel: bool | None = None) -> tuple[float, float]:
        """(held, transient) bytes on one device of ``num_layers`` operators of the MetaOp run with (tp, dp):
        what they keep from forward to backward (each DP rank its B/dp samples), and what their backward needs
        beyond that while it recomputes (``recompute``; None: the model's own), in a plan with sequence
        parallelism enabled or not (``sequence_parallel``; None: the model's own)."""
        # memoised: the planner's recomputation ladders ask for every option of every slice (about a million
        # questions in a 256-GPU selection), most of them about the same layers
        key = (metaop.id, metaop.kind, metaop.module, tuple(metaop.input_shape), len(metaop.ops), metaop.backward,
               metaop.frozen, tp, dp, num_layers, recompute, sequence_parallel)
        known = self._activations.get(key)
        if known is None:
            known = self._activations[key] = self._activation_memory(metaop, tp, dp, num_layers, recompute,
                                                                     sequence_parallel)
        return known

    def _activation_memory(self, metaop: MetaOp, tp: int, dp: int, num_layers: int, recompute: Recompute | None,
                           sequence_parallel: bool | None) -> tuple[float, float]:
        self._check(metaop, tp, dp, num_layers)
        micro_batch = metaop.batch / dp
        if metaop.backward == "none":  # a frozen module with nothing trainable upstream: no autograd graph
            return 0.0, 0.0
        if metaop.kind != "layer":
            return num_layers * self._light_op(metaop, micro_batch, tp), 0.0
        if num_layers == 0:
            return 0.0, 0.0
        rc = (recompute or self.recompute).for_layers(num_layers)
        blocks = rc.blocks(num_layers)
        if len(blocks) > 1:
            return _one_after_another([self.activation_memory(metaop, tp, dp, n, r, sequence_parallel)
                                       for n, r in blocks])
        module = self.workload.modules[metaop.module]
        enabled = self.sequence_parallel if sequence_parallel is None else sequence_parallel
        sp = sequence_parallel_runs(enabled, metaop.kind, tp, metaop.tokens, module)
        layer = self.layer_activations(module, micro_batch, metaop.tokens, tp, sp, frozen=metaop.frozen)
        if rc.mode == "none":
            return num_layers * layer.full, 0.0
        if rc.mode == "selective":
            held, transient = layer.selective_memory(rc.recompute_modules)
            return num_layers * held, transient
        if rc.method == "uniform":  # chunks of `chunk` layers keep one input each; one chunk is rerun at a time
            chunk = rc.chunk(num_layers)
            return math.ceil(num_layers / chunk) * layer.input, max(0.0, chunk * layer.full - layer.input)
        k = rc.recomputed_layers(num_layers)  # the first k layers recompute, one at a time
        held = (num_layers - k) * layer.full + k * layer.input
        # the backward reaches the recomputed layers once the others' activations are freed
        transient = max(0.0, (k - 1) * layer.input + layer.full - held)
        return held, transient

    def activation_bytes(self, metaop: MetaOp, tp: int, dp: int, num_layers: int,
                         recompute: Recompute | None = None) -> float:
        """Bytes held on one device from forward to backward (``activation_memory``'s first part)."""
        return self.activation_memory(metaop, tp, dp, num_layers, recompute)[0]


def _one_after_another(blocks: list[tuple[float, float]]) -> tuple[float, float]:
    """(held, transient) of consecutive blocks of layers, each's (held, transient): the backward runs the last
    block first, and a block's transient comes on top of what it and the blocks before it still hold."""
    total, before, peak = sum(held for held, _ in blocks), 0.0, 0.0
    for held, transient in blocks:
        before += held
        peak = max(peak, before + transient)
    return total, max(0.0, peak - total)


def _check_positive(what: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise EstimatorError(f"{what} must be a positive integer, got {value!r}")


def _check_layer_range(metaop: MetaOp, layer_start: int, layer_end: int) -> None:
    if not 0 <= layer_start <= layer_end <= metaop.num_layers:
        raise EstimatorError(
            f"MetaOp '{metaop.id}': layers [{layer_start}, {layer_end}) outside its chain of {metaop.num_layers}"
        )
