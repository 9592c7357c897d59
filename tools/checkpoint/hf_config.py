"""Hugging Face configs <-> workload modules: ``config.json`` written from a module's hyper-parameters (HF export
from scratch, ``--saver hf`` without a reference folder), and the workload module that holds an HF model exactly
(``workload_from_hf.py``).

Neither direction needs transformers: configs are plain JSON in the keys every transformers version since 4.45
reads (``rope_theta`` / ``rope_scaling``, ``torch_dtype``).

Classes written from scratch (``HF_CLASSES``), by family:

- ``clip_vision``: ``CLIPVisionModel`` (no contrastive head in the workload) or ``CLIPVisionModelWithProjection``;
- ``clip_text``: ``CLIPTextModel`` / ``CLIPTextModelWithProjection``;
- ``whisper_encoder``: ``WhisperEncoder`` (a ``whisper`` config, encoder tensors without prefix: load it with
  ``WhisperEncoder.from_pretrained``);
- ``llama`` / ``qwen2``: ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (default: Qwen2 for a module with
  ``qkv_bias: true``, else Llama).
"""

from __future__ import annotations

from tools.checkpoint.common import ConversionError
from tools.checkpoint.hf_mapping import EPS_OURS, LLAMA3_ROPE_FIXED, ROPE_BASE_OURS, Tower, clip_eos_token_id
from tools.checkpoint.layout import frontend_max_tokens, workload_units

HF_CLASSES = {
    "CLIPVisionModel": "clip_vision", "CLIPVisionModelWithProjection": "clip_vision",
    "CLIPTextModel": "clip_text", "CLIPTextModelWithProjection": "clip_text",
    "WhisperEncoder": "whisper_encoder", "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
}
_ACT_TO_HF = {"gelu": "gelu", "quick_gelu": "quick_gelu", "silu": "silu"}


def module_family(spec) -> str | None:
    """The HF family a workload module can be exported to (None: no HF counterpart, e.g. projectors)."""
    fe = spec.frontend
    if spec.kind == "llm":
        return "qwen2" if spec.qkv_bias else "llama"
    if spec.kind != "encoder" or fe is None:
        return None
    if fe.type == "patch":
        return "clip_vision"
    if fe.type == "text":
        return "clip_text"
    if fe.type == "audio" and fe.stem == "conv":
        return "whisper_encoder"
    return None


def has_part(workload, module: str, part: str) -> bool:
    """Whether the (shared) module has a ``head`` / ``lm_head`` / ... unit in the workload's graph."""
    return f"{module}.{part}" in set(workload_units(workload))


def default_hf_class(workload, module: str) -> str:
    spec = workload.modules[module]
    family = module_family(spec)
    if family is None:
        raise ConversionError(f"module '{module}' ({spec.kind}, front end "
                              f"{spec.frontend.type if spec.frontend else None}) has no Hugging Face class to export "
                              f"to (supported: patch / text encoders, audio encoders with `stem: conv`, llm modules)")
    head = has_part(workload, module, "head")
    return {"clip_vision": "CLIPVisionModelWithProjection" if head else "CLIPVisionModel",
            "clip_text": "CLIPTextModelWithProjection" if head else "CLIPTextModel",
            "whisper_encoder": "WhisperEncoder", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]


def _eps(spec) -> float:
    return EPS_OURS if spec.norm_epsilon is None else float(spec.norm_epsilon)


def _check_family(spec, hf_class: str) -> str:
    family = HF_CLASSES.get(hf_class)
    if family is None:
        raise ConversionError(f"unknown Hugging Face class '{hf_class}' (supported: {', '.join(HF_CLASSES)})")
    ours = module_family(spec)
    fits = ours == family or (ours in ("llama", "qwen2") and family in ("llama", "qwen2"))
    if not fits:
        raise ConversionError(f"module '{spec.name}' cannot be exported as {hf_class} (its front end and kind make "
                              f"it a {ours or 'module without an HF class'})")
    if family in ("clip_vision", "clip_text", "whisper_encoder") and spec.query_groups != spec.num_heads:
        raise ConversionError(f"module '{spec.name}' uses grouped-query attention ({spec.query_groups} groups); "
                              f"{hf_class} has none")
    return family


def scratch_config(workload, module: str, hf_class: str) -> dict:
    """``config.json`` of ``hf_class`` holding ``module``'s hyper-parameters. Options the class cannot express are
    left to ``hf_mapping.numerics_notes`` (which compares this config with the module, as for any HF folder)."""
    spec = workload.modules[module]
    family = _check_family(spec, hf_class)
    h, fe = spec.hidden_size, spec.frontend
    act = _ACT_TO_HF[spec.act]
    common = {"architectures": [hf_class], "torch_dtype": "float32"}
    if family == "clip_vision":
        if fe.class_tokens != 1:
            raise ConversionError(f"module '{module}': CLIP's vision tower has one class token; the front end "
                                  f"declares {fe.class_tokens}")
        return common | {"model_type": "clip_vision_model", "hidden_size": h, "intermediate_size": spec.ffn_hidden_size,
                         "projection_dim": spec.embed_dim or h, "num_hidden_layers": spec.num_layers,
                         "num_attention_heads": spec.num_heads, "num_channels": fe.in_channels,
                         "image_size": fe.image_size, "patch_size": fe.patch_size, "hidden_act": act,
                         "layer_norm_eps": _eps(spec)}
    if family == "clip_text":
        eos = 2 if spec.eos_token_id is None else spec.eos_token_id  # CLIP: 2 means "pool the largest id"
        return common | {"model_type": "clip_text_model", "vocab_size": fe.vocab_size, "hidden_size": h,
                         "intermediate_size": spec.ffn_hidden_size, "projection_dim": spec.embed_dim or h,
                         "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
                         "max_position_embeddings": frontend_max_tokens(workload, module), "hidden_act": act,
                         "layer_norm_eps": _eps(spec), "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": eos}
    if family == "whisper_encoder":
        rows = frontend_max_tokens(workload, module)
        return common | {"model_type": "whisper", "d_model": h, "encoder_layers": spec.num_layers,
                         "encoder_attention_heads": spec.num_heads, "encoder_ffn_dim": spec.ffn_hidden_size,
                         "decoder_layers": spec.num_layers, "decoder_attention_heads": spec.num_heads,
                         "decoder_ffn_dim": spec.ffn_hidden_size, "num_mel_bins": fe.in_channels,
                         "max_source_positions": rows, "activation_function": act, "scale_embedding": False}
    # llama / qwen2
    if spec.lm_vocab != fe.vocab_size:
        raise ConversionError(f"module '{module}': input vocabulary {fe.vocab_size} and output vocabulary "
                              f"{spec.lm_vocab} differ; {hf_class} has one vocab_size")
    cfg = common | {"model_type": family, "vocab_size": fe.vocab_size, "hidden_size": h,
                    "intermediate_size": spec.ffn_hidden_size, "num_hidden_layers": spec.num_layers,
                    "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.query_groups,
                    "head_dim": h // spec.num_heads, "hidden_act": act, "rms_norm_eps": _eps(spec),
                    "rope_theta": ROPE_BASE_OURS if spec.rotary_base is None else float(spec.rotary_base),
                    "tie_word_embeddings": False, "max_position_embeddings": 4096}
    if spec.rope_scaling_factor is not None:
        factor = float(spec.rope_scaling_factor)
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": factor, **LLAMA3_ROPE_FIXED}
        cfg["max_position_embeddings"] = int(LLAMA3_ROPE_FIXED["original_max_position_embeddings"] * factor)
    if family == "llama":
        cfg.update(attention_bias=bool(spec.qkv_bias), mlp_bias=False)
    else:
        cfg.update(use_sliding_window=False)
    return cfg


def scratch_tower(hf_class: str, config: dict) -> Tower:
    """Where the tensors of ``hf_class`` live (prefixes as ``save_pretrained`` writes them)."""
    family = HF_CLASSES[hf_class]
    if family == "clip_vision":
        proj = "visual_projection.weight" if hf_class.endswith("WithProjection") else None
        return Tower(family, "vision_model.", config, proj, ["vision_model.", "visual_projection.weight"])
    if family == "clip_text":
        proj = "text_projection.weight" if hf_class.endswith("WithProjection") else None
        return Tower(family, "text_model.", config, proj, ["text_model.", "text_projection.weight"])
    if family == "whisper_encoder":
        return Tower(family, "", config, None, [""])
    return Tower(family, "model.", config, None, [""])


def scratch_has_bias(tower: Tower, name: str) -> bool:
    """Whether a from-scratch decoder of ``tower`` has the attention bias ``name`` (``...q_proj.bias``)."""
    if tower.family == "qwen2":
        return not name.endswith("o_proj.bias")
    return bool(tower.config.get("attention_bias"))


# ------------------------------------------------------------------------------------------ HF -> module


def module_from_tower(tower: Tower, name: str, has_projection: bool) -> dict:
    """The workload module (YAML mapping) that holds ``tower`` exactly: hyper-parameters and every numerics
    option, the ones equal to our defaults included (so the module does not depend on them)."""
    c, fam = tower.config, tower.family
    act = c.get("activation_function") if fam == "whisper_encoder" else c.get("hidden_act")
    from tools.checkpoint.hf_mapping import HF_ACTIVATIONS, tower_dims

    if act not in HF_ACTIVATIONS:
        raise ConversionError(f"module '{name}': activation {act!r} of the {fam} model is not supported")
    dims = tower_dims(tower)
    out: dict = {"kind": "llm" if fam in ("llama", "qwen2") else "encoder", "num_layers": dims["num_layers"],
                 "hidden_size": dims["hidden_size"], "num_heads": dims["num_heads"]}
    if dims["query_groups"] != dims["num_heads"]:
        out["num_query_groups"] = dims["query_groups"]
    out["ffn_hidden_size"] = dims["ffn_hidden_size"]
    out["activation"] = HF_ACTIVATIONS[act]
    if fam == "clip_vision":
        if has_projection:
            out["embed_dim"] = int(c["projection_dim"])
        out["norm_epsilon"] = float(c.get("layer_norm_eps", 1e-5))
        out["head_pool"] = "cls"
        out["frontend"] = {"type": "patch", "image_size": int(c["image_size"]), "patch_size": int(c["patch_size"]),
                           "in_channels": int(c.get("num_channels", 3)), "pre_norm": True, "patch_bias": False}
    elif fam == "clip_text":
        if has_projection:
            out["embed_dim"] = int(c["projection_dim"])
        out["causal"] = True
        out["norm_epsilon"] = float(c.get("layer_norm_eps", 1e-5))
        out["head_pool"] = "eos"
        eos = clip_eos_token_id(c)
        if eos is not None:
            out["eos_token_id"] = eos
        out["frontend"] = {"type": "text", "vocab_size": int(c["vocab_size"])}
    elif fam == "whisper_encoder":
        out["norm_epsilon"] = 1e-5  # Whisper's LayerNorms use torch's default
        out["frontend"] = {"type": "audio", "stem": "conv", "patch_size": 2, "in_channels": int(c["num_mel_bins"])}
    else:
        rope = c.get("rope_parameters") or {}
        scaling = {**(c.get("rope_scaling") or {}), **{k: v for k, v in rope.items() if k != "rope_theta"}}
        out["norm_epsilon"] = float(c.get("rms_norm_eps", 1e-6))
        out["rotary_base"] = float(rope.get("rope_theta", c.get("rope_theta", ROPE_BASE_OURS)))
        rtype = scaling.get("rope_type", scaling.get("type", "default"))
        if rtype == "llama3":
            out["rope_scaling_factor"] = float(scaling.get("factor", 8.0))
        elif rtype not in (None, "default"):
            raise ConversionError(f"module '{name}': rope_type {rtype!r} is not implemented by our layers")
        if fam == "qwen2" or c.get("attention_bias"):
            out["qkv_bias"] = True
        if c.get("mlp_bias"):
            raise ConversionError(f"module '{name}': MLP biases in the HF decoder; our llm layers have none")
        out["frontend"] = {"type": "text", "vocab_size": int(c["vocab_size"])}
    return out


def position_rows(tower: Tower) -> int | None:
    """Rows of the tower's learned / sinusoidal position table: the tokens a task must give the module (at most,
    and in one task exactly, since the table's shape is the most tokens of any task)."""
    c = tower.config
    if tower.family == "clip_text":
        return int(c["max_position_embeddings"])
    if tower.family == "whisper_encoder":
        return int(c["max_source_positions"])
    if tower.family == "clip_vision":
        return (int(c["image_size"]) // int(c["patch_size"])) ** 2 + 1
    return None
