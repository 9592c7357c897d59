"""Model settings shared by every operator, and the megatron-core TransformerConfig of a workload module."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnBackend

from megatron_spindle.graph.workload import ModuleSpec
from megatron_spindle.plan.schema import (
    ATTENTION_BACKENDS,
    DROPOUTS,
    Recompute,
    dropout_probability,
    recompute_fits,
)


@dataclass
class ModelConfig:
    """Numerics and initialisation of the operators (the same for every module).

    ``bf16`` keeps parameters in bfloat16 and needs CUDA; on CPU parameters are fp32.
    ``init_seed`` is mixed into every parameter unit's seed: two runs with the same seed start from identical
    full weights whatever their TP layout or plan.
    """

    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    bf16: bool = False
    init_std: float = 0.02
    init_seed: int = 0
    layernorm_epsilon: float = 1e-5
    rotary_base: int = 10000
    # Activation recomputation of the transformer layers (the plan's settings.recompute_of(slice)), done by
    # megatron-core itself (``recompute_fields``): a Recompute, or True for full recomputation of every layer.
    recompute: Recompute | bool = False
    # Megatron's sequence parallelism in the transformer layers of TP > 1 slices (``--sequence-parallel``): the
    # norms, residuals and dropouts run on 1/TP of the sequence, so their activations are divided by TP too.
    sequence_parallel: bool = False
    # The attention core of the transformer layers (the plan's settings.attention_backend, Megatron's
    # --attention-backend): local builds megatron-core's local spec, the others Transformer Engine's where it is
    # available (compat/cpu.py uses_te_spec).
    attention_backend: str = "auto"

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float32

    @property
    def recomputation(self) -> Recompute:
        if isinstance(self.recompute, Recompute):
            return self.recompute
        return Recompute("full" if self.recompute else "none")

    def __post_init__(self):
        if self.bf16 and not torch.cuda.is_available():
            raise ValueError("ModelConfig(bf16=True) needs CUDA; CPU runs keep fp32 parameters")
        for name in DROPOUTS:
            setattr(self, name, dropout_probability(getattr(self, name), name))
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got '{self.attention_backend}'")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's activation: ``x * sigmoid(1.702 x)``."""
    return x * torch.sigmoid(1.702 * x)


ACTIVATION_FUNCS = {"gelu": F.gelu, "quick_gelu": quick_gelu, "silu": F.silu}


def norm_epsilon(module: ModuleSpec, cfg: ModelConfig) -> float:
    """Epsilon of every norm of ``module``: its ``norm_epsilon`` or the ModelConfig default."""
    return cfg.layernorm_epsilon if module.norm_epsilon is None else float(module.norm_epsilon)


def rotary_base(module: ModuleSpec, cfg: ModelConfig) -> float:
    """RoPE base of an llm module: its ``rotary_base`` or the ModelConfig default."""
    return cfg.rotary_base if module.rotary_base is None else module.rotary_base


def _base_kwargs(cfg: ModelConfig, tp_size: int, module: ModuleSpec | None = None) -> dict:
    """Settings every config needs on CPU/gloo: no sequence parallelism (only the transformer layers take it,
    ``transformer_config``), no fused kernels (each would compile with torch.compile on first use, ~20 s), and
    ``batch_p2p_comm=False`` (batched p2p on gloo mixes up same-shaped messages when the previous and next rank
    are one peer)."""
    return dict(
        tensor_model_parallel_size=tp_size,
        sequence_parallel=False,
        use_cpu_initialization=True,
        perform_initialization=True,  # overwritten by the deterministic per-unit init
        params_dtype=cfg.params_dtype,
        bf16=cfg.bf16,
        pipeline_dtype=cfg.params_dtype,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        layernorm_epsilon=cfg.layernorm_epsilon if module is None else norm_epsilon(module, cfg),
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        batch_p2p_comm=False,
        # no CUDA graphs; megatron-core 0.16.1's default scope "full" is deprecated and warns on every rank
        cuda_graph_scope=[],
    )


def recompute_fields(recompute: Recompute, num_layers: int) -> dict:
    """megatron-core's TransformerConfig fields for ``recompute`` of a block of ``num_layers`` layers:
    selective recomputes the recompute's modules (``recompute_modules``: the attention core, the pre-norms,
    the MLP; megatron-core's default ["core_attn"] where none are named); full with the
    block method checkpoints the first k layers one by one, with the uniform method every chunk of k (the largest
    divisor of the block's layer count up to k)."""
    blocks = recompute.blocks(num_layers)
    if len(blocks) > 1:
        raise ValueError(f"recompute '{recompute.describe()}' of {num_layers} layers takes one TransformerBlock per "
                         f"granularity (Recompute.blocks), not one config")
    rc = blocks[0][1]
    if rc.mode == "none":
        return {}
    if rc.mode == "selective":
        return dict(recompute_granularity="selective", recompute_modules=list(rc.recompute_modules))
    if rc.method == "uniform":
        return dict(recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=rc.chunk(num_layers))
    return dict(recompute_granularity="full", recompute_method="block",
                recompute_num_layers=rc.recomputed_layers(num_layers))


def transformer_config(module: ModuleSpec, num_layers: int, tp_size: int, cfg: ModelConfig) -> TransformerConfig:
    """Encoders: LayerNorm, GELU MLP with biases, bidirectional. LLMs: RMSNorm, SwiGLU without biases, GQA.
    Module options: ``activation`` (the MLP's; gated for llm modules), ``qkv_bias`` (llm q/k/v biases,
    megatron's add_qkv_bias), ``norm_epsilon``."""
    is_llm = module.kind == "llm"
    if not recompute_fits(cfg.recomputation, module.kind):
        raise ValueError(f"module '{module.name}': MLP recomputation needs a bias-free MLP (plan/schema.py "
                         f"MLP_RECOMPUTE_KINDS); megatron-core's checkpoint of an MLP with biases never returns")
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=module.hidden_size,
        num_attention_heads=module.num_heads,
        num_query_groups=module.query_groups,
        ffn_hidden_size=module.ffn_hidden_size,
        kv_channels=module.hidden_size // module.num_heads,
        normalization="RMSNorm" if is_llm else "LayerNorm",
        gated_linear_unit=is_llm,
        activation_func=ACTIVATION_FUNCS[module.act],
        add_bias_linear=not is_llm,
        add_qkv_bias=is_llm and module.qkv_bias,
        **{**_base_kwargs(cfg, tp_size, module), "sequence_parallel": sequence_parallel(cfg, tp_size)},
        attention_backend=AttnBackend[cfg.attention_backend],
        **recompute_fields(cfg.recomputation, num_layers),
    )


def sequence_parallel(cfg: ModelConfig, tp_size: int) -> bool:
    """Whether a layer slice on ``tp_size`` TP ranks runs sequence-parallel (megatron-core needs TP > 1 for it)."""
    return cfg.sequence_parallel and tp_size > 1


def projector_config(module: ModuleSpec, tp_size: int, cfg: ModelConfig) -> TransformerConfig:
    """The projector MLP ``input_size -> hidden -> hidden`` with GELU (megatron MLP: ffn_hidden_size = hidden)."""
    return TransformerConfig(
        num_layers=1,
        hidden_size=module.hidden_size,
        num_attention_heads=tp_size,  # unused by the MLP; megatron requires heads % tp == 0
        ffn_hidden_size=module.hidden_size,
        activation_func=F.gelu,
        add_bias_linear=True,
        **_base_kwargs(cfg, tp_size),
    )


def lm_head_config(module: ModuleSpec, tp_size: int, cfg: ModelConfig) -> TransformerConfig:
    """Config for the LM output layer (ColumnParallelLinear), its final RMSNorm and text word embeddings."""
    return TransformerConfig(
        num_layers=1,
        hidden_size=module.hidden_size,
        num_attention_heads=tp_size,  # no attention here; megatron requires heads % tp == 0
        ffn_hidden_size=module.ffn_hidden_size or 4 * module.hidden_size,
        normalization="RMSNorm",
        add_bias_linear=False,
        **_base_kwargs(cfg, tp_size, module),
    )
