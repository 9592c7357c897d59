"""Weight mappings between Hugging Face towers / decoders and megatron-spindle parameter units.

Supported (``family`` names):

- ``clip_vision``: ``CLIPVisionModel`` / ``CLIPVisionModelWithProjection`` / the vision half of ``CLIPModel``
  -> an encoder with a ``patch`` front end (class token; ``pre_norm: true`` holds ``pre_layrnorm``) and its
  contrastive head;
- ``clip_text``: ``CLIPTextModel`` / ``...WithProjection`` / the text half of ``CLIPModel`` -> an encoder with a
  ``text`` front end (learned positions; declare ``causal: true`` and ``head_pool: eos`` with the config's
  ``eos_token_id``, or none when it is 2: CLIP then pools the largest token id);
- ``whisper_encoder``: the encoder of ``WhisperModel`` / ``WhisperForConditionalGeneration`` / a bare
  ``WhisperEncoder`` -> an encoder's transformer layers and final LayerNorm, and with an ``audio`` front end
  declared ``stem: conv, patch_size: 2`` the conv stem and position table;
- ``llama`` / ``qwen2``: ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` -> an ``llm`` module (front end, layers,
  LM head; ``qkv_bias: true`` holds the q/k/v biases).

The module options (``activation``, ``norm_epsilon``, ``rotary_base``, ``rope_scaling_factor``, ...) must match
the HF config for an exact conversion; ``numerics_notes`` names each difference and the option that fixes it.

Layouts on our side (megatron-core): ``linear_qkv`` is grouped by query group
(``[q heads of group 0, k_0, v_0, q heads of group 1, k_1, v_1, ...]``), SwiGLU ``linear_fc1`` is ``[gate; up]``,
a patch front end is a Linear over ``(channel, row, column)``-flattened patches (= the Conv2d weight reshaped).

Each mapping works on plain tensors and on meta tensors (shape-only dry runs). ``import_unit`` returns the
unit's tensors plus the HF names it used; ``export_unit`` returns HF tensors plus ``Note``s: per tensor, what our
tensors hold that the HF layout cannot (a non-zero q/k/v bias a Llama without biases drops: inexact, with its
max error) and what has no place in the HF class (a contrastive projection on Whisper: not exported, which leaves
every output of the HF model exact). Rewrites that keep the function are exact and only noted: a patch bias is
folded into CLIP's position embeddings of the patch tokens (the class token gets no bias in our front end either),
Whisper's key bias is dropped (softmax ignores a per-query constant).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tools.checkpoint.common import Note
from tools.checkpoint.hf_io import HFCheckpointError, HFFolder
from tools.checkpoint.layout import layer_index

FAMILIES = ("clip_vision", "clip_text", "whisper_encoder", "llama", "qwen2")
IGNORED_SUFFIXES = ("position_ids", "rotary_emb.inv_freq", "embed_positions._float_tensor")
EPS_OURS = 1e-5  # models.config.ModelConfig.layernorm_epsilon (modules without norm_epsilon)
ROPE_BASE_OURS = 10000.0  # models.config.ModelConfig.rotary_base (llm modules without rotary_base)
HF_ACTIVATIONS = {"gelu": "gelu", "quick_gelu": "quick_gelu", "silu": "silu", "swish": "silu"}
# megatron-core's Llama-3 RoPE scaling (RotaryEmbedding._apply_scaling) takes only the factor
LLAMA3_ROPE_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass
class Tower:
    """Where one workload module's weights live in a Hugging Face folder, and its config."""

    family: str
    prefix: str  # e.g. "vision_model.", "model.encoder.", "model."
    config: dict
    projection: str | None = None  # "visual_projection.weight" / "text_projection.weight" (at the root)
    claimed: list[str] = field(default_factory=list)  # key prefixes this tower owns (unused ones are reported)

    @property
    def layer_prefix(self) -> str:
        return {"clip_vision": "encoder.layers.", "clip_text": "encoder.layers."}.get(self.family, "layers.")


# ------------------------------------------------------------------------------------------ fused layouts


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """Separate q [heads*d, ...], k, v [groups*d, ...] -> megatron's fused rows grouped by query group."""
    d = q.shape[0] // heads
    rest = tuple(q.shape[1:])
    qg = q.reshape(groups, heads // groups * d, *rest)
    kg, vg = k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape((heads + 2 * groups) * d, *rest)


def split_qkv(qkv: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``fuse_qkv``."""
    d = qkv.shape[0] // (heads + 2 * groups)
    rest = tuple(qkv.shape[1:])
    per = heads // groups * d
    g = qkv.reshape(groups, per + 2 * d, *rest)
    q, k, v = g[:, :per], g[:, per:per + d], g[:, per + d:]
    return q.reshape(heads * d, *rest), k.reshape(groups * d, *rest), v.reshape(groups * d, *rest)


def _is_zero(t: torch.Tensor) -> bool:
    return t.device.type == "meta" or not bool(t.any())


def _max_abs(t: torch.Tensor) -> float | None:
    return None if t.device.type == "meta" else float(t.detach().abs().max()) if t.numel() else 0.0


# ------------------------------------------------------------------------------------------ towers


def _sub_config(cfg: dict, key: str) -> dict:
    sub = cfg.get(key)
    if not isinstance(sub, dict):
        raise HFCheckpointError(f"CLIPModel config has no '{key}'")
    return sub


def find_tower(folder: HFFolder, module_kind: str, frontend_type: str | None) -> Tower:
    """The tower of ``folder`` that feeds a workload module of this kind / front end type."""
    cfg, mt = folder.config, folder.config.get("model_type")
    if mt in ("clip", "clip_vision_model", "clip_text_model"):
        vision = frontend_type == "patch" if mt == "clip" else mt == "clip_vision_model"
        family = "clip_vision" if vision else "clip_text"
        sub = (_sub_config(cfg, "vision_config" if vision else "text_config") if mt == "clip" else cfg)
        model_prefix = "vision_model." if vision else "text_model."
        anchor = "embeddings.patch_embedding.weight" if vision else "embeddings.token_embedding.weight"
        prefix = folder.find_prefix([model_prefix, ""], anchor)
        proj = "visual_projection.weight" if vision else "text_projection.weight"
        sub = dict(sub, projection_dim=cfg.get("projection_dim", sub.get("projection_dim")))
        claimed = [prefix, proj] if prefix else [""]
        return Tower(family, prefix, sub, proj if proj in folder else None, claimed)
    if mt == "whisper":
        prefix = folder.find_prefix(["model.encoder.", "encoder.", ""], "conv1.weight")
        return Tower("whisper_encoder", prefix, cfg, None, [prefix])
    if mt in ("llama", "qwen2"):
        prefix = folder.find_prefix(["model.", ""], "embed_tokens.weight")
        return Tower(mt, prefix, cfg, None, [""])
    raise HFCheckpointError(f"{folder.path}: model_type {mt!r} is not supported (supported: clip, "
                            f"clip_vision_model, clip_text_model, whisper, llama, qwen2)")


def tower_dims(tower: Tower) -> dict[str, int]:
    """Layers, width, heads, query groups, FFN width of a tower (HF config)."""
    c = tower.config
    if tower.family == "whisper_encoder":
        return {"num_layers": c["encoder_layers"], "hidden_size": c["d_model"],
                "num_heads": c["encoder_attention_heads"], "query_groups": c["encoder_attention_heads"],
                "ffn_hidden_size": c["encoder_ffn_dim"]}
    heads = c["num_attention_heads"]
    return {"num_layers": c["num_hidden_layers"], "hidden_size": c["hidden_size"], "num_heads": heads,
            "query_groups": c.get("num_key_value_heads") or heads, "ffn_hidden_size": c["intermediate_size"]}


def check_module_fits(tower: Tower, module, where: str) -> None:
    """Config-level checks that tensor shapes cannot catch (layer count, heads, query groups)."""
    dims = tower_dims(tower)  # widths are left to the tensor shape check, which names the tensor
    ours = {"num_layers": module.num_layers, "num_heads": module.num_heads, "query_groups": module.query_groups}
    for key, value in ours.items():
        if dims[key] != value:
            raise HFCheckpointError(f"module '{module.name}': {key} is {value} in the workload but {dims[key]} in "
                                    f"{where} ({tower.family})")
    c = tower.config
    if tower.family in ("llama", "qwen2"):
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        if head_dim * c["num_attention_heads"] != c["hidden_size"]:
            raise HFCheckpointError(f"module '{module.name}': {where} has head_dim {head_dim} x "
                                    f"{c['num_attention_heads']} heads != hidden_size {c['hidden_size']}; our "
                                    f"layers use kv_channels = hidden_size / num_heads")
        if module.kind != "llm":
            raise HFCheckpointError(f"module '{module.name}' is a {module.kind}; {tower.family} feeds llm modules")
    elif module.kind != "encoder":
        raise HFCheckpointError(f"module '{module.name}' is a {module.kind}; {tower.family} feeds encoder modules")


def clip_eos_token_id(config: dict) -> int | None:
    """The ``eos_token_id`` option matching a CLIP text config: HF's CLIP pools the argmax of the token ids when
    the config's eos_token_id is 2 (the original checkpoints), else the first position of eos_token_id."""
    eos = config.get("eos_token_id", 2)
    return None if eos == 2 else int(eos)


def numerics_notes(tower: Tower, module) -> list[str]:
    """Where our model computes something else than the HF model with these weights (and the workload option that
    would make it exact)."""
    c, notes = tower.config, []
    act = c.get("activation_function") if tower.family == "whisper_encoder" else c.get("hidden_act")
    if HF_ACTIVATIONS.get(act) != module.act:
        fix = f"declare `activation: {HF_ACTIVATIONS[act]}`" if act in HF_ACTIVATIONS else "not supported"
        notes.append(f"activation {act!r}: module '{module.name}' uses {module.act} ({fix})")
    eps = c.get("rms_norm_eps") if tower.family in ("llama", "qwen2") else c.get("layer_norm_eps", 1e-5)
    ours = EPS_OURS if module.norm_epsilon is None else float(module.norm_epsilon)
    if eps is not None and abs(float(eps) - ours) > 1e-12:
        notes.append(f"norm epsilon {eps}: module '{module.name}' uses {ours} (declare `norm_epsilon: {eps}`)")
    fe = module.frontend
    if tower.family == "clip_vision":
        if not (fe is not None and fe.pre_norm):
            notes.append("CLIP applies pre_layrnorm to the embeddings; declare `pre_norm: true` in the patch front "
                         "end (without it the tensors are dropped)")
        if module.pooling != "cls":
            notes.append(f"CLIP pools the class token; module '{module.name}' pools '{module.pooling}'")
    if tower.family == "clip_text":
        want = clip_eos_token_id(c)
        if module.pooling != "eos" or module.eos_token_id != want:
            how = "the largest token id" if want is None else f"the first token {want}"
            notes.append(f"CLIP pools the EOS token's hidden state ({how}); module '{module.name}' pools "
                         f"'{module.pooling}' (declare `head_pool: eos`"
                         f"{'' if want is None else f', eos_token_id: {want}'})")
        if not module.is_causal:
            notes.append(f"CLIP's text tower is causal; declare `causal: true` for module '{module.name}'")
    if tower.family == "whisper_encoder":
        if not (fe is not None and fe.type == "audio" and fe.stem == "conv" and fe.patch_size == 2):
            notes.append("Whisper's conv stem (conv1, conv2 stride 2, GELU) and sinusoidal positions: declare "
                         "`frontend: {type: audio, stem: conv, patch_size: 2}` (without it they are dropped)")
    if tower.family in ("llama", "qwen2"):
        rope = c.get("rope_parameters") or {}
        scaling = c.get("rope_scaling") or {}
        theta = rope.get("rope_theta", c.get("rope_theta", ROPE_BASE_OURS))
        base = ROPE_BASE_OURS if module.rotary_base is None else float(module.rotary_base)
        if abs(float(theta) - base) > 1e-6:
            notes.append(f"rope_theta {theta}: module '{module.name}' uses {base} (declare `rotary_base: {theta}`)")
        params = {**scaling, **{k: v for k, v in rope.items() if k != "rope_theta"}}
        rtype = params.get("rope_type", params.get("type", "default"))
        if rtype == "llama3":
            fixed = all(abs(float(params.get(k, v)) - v) < 1e-9 for k, v in LLAMA3_ROPE_FIXED.items())
            factor = float(params.get("factor", 8.0))
            if not fixed:
                notes.append(f"llama3 RoPE scaling with {params}: our layers support factor only (low/high "
                             f"frequency factors 1/4, 8192 original positions)")
            elif module.rope_scaling_factor is None or abs(float(module.rope_scaling_factor) - factor) > 1e-9:
                notes.append(f"llama3 RoPE scaling, factor {factor}: declare `rope_scaling_factor: {factor}` for "
                             f"module '{module.name}'")
        elif rtype not in (None, "default"):
            notes.append(f"rope_type {rtype!r} (RoPE scaling) is not implemented by our layers")
        elif module.rope_scaling_factor is not None:
            notes.append(f"module '{module.name}' declares rope_scaling_factor but the HF model has no RoPE scaling")
        if c.get("mlp_bias"):
            notes.append("MLP biases in the HF decoder: our llm layers have none")
    return notes


# ------------------------------------------------------------------------------------------ per-layer names


def _enc_layer_names(family: str) -> dict[str, str]:
    if family == "whisper_encoder":
        return {"ln1": "self_attn_layer_norm", "ln2": "final_layer_norm", "fc1": "fc1", "fc2": "fc2"}
    return {"ln1": "layer_norm1", "ln2": "layer_norm2", "fc1": "mlp.fc1", "fc2": "mlp.fc2"}


def _import_encoder_layer(get, p: str, family: str, heads: int, groups: int) -> dict[str, torch.Tensor]:
    n = _enc_layer_names(family)
    a = p + "self_attn."
    q_b, v_b = get(a + "q_proj.bias"), get(a + "v_proj.bias")
    k_b = get(a + "k_proj.bias") if family != "whisper_encoder" else torch.zeros_like(q_b[: v_b.shape[0]])
    return {
        "input_layernorm.weight": get(p + n["ln1"] + ".weight"), "input_layernorm.bias": get(p + n["ln1"] + ".bias"),
        "self_attention.linear_qkv.weight": fuse_qkv(get(a + "q_proj.weight"), get(a + "k_proj.weight"),
                                                     get(a + "v_proj.weight"), heads, groups),
        "self_attention.linear_qkv.bias": fuse_qkv(q_b, k_b, v_b, heads, groups),
        "self_attention.linear_proj.weight": get(a + "out_proj.weight"),
        "self_attention.linear_proj.bias": get(a + "out_proj.bias"),
        "pre_mlp_layernorm.weight": get(p + n["ln2"] + ".weight"), "pre_mlp_layernorm.bias": get(p + n["ln2"] + ".bias"),
        "mlp.linear_fc1.weight": get(p + n["fc1"] + ".weight"), "mlp.linear_fc1.bias": get(p + n["fc1"] + ".bias"),
        "mlp.linear_fc2.weight": get(p + n["fc2"] + ".weight"), "mlp.linear_fc2.bias": get(p + n["fc2"] + ".bias"),
    }


def _export_encoder_layer(t: dict, p: str, family: str, heads: int, groups: int) -> dict[str, torch.Tensor]:
    n = _enc_layer_names(family)
    a = p + "self_attn."
    q, k, v = split_qkv(t["self_attention.linear_qkv.weight"], heads, groups)
    qb, kb, vb = split_qkv(t["self_attention.linear_qkv.bias"], heads, groups)
    out = {p + n["ln1"] + ".weight": t["input_layernorm.weight"], p + n["ln1"] + ".bias": t["input_layernorm.bias"],
           a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v,
           a + "q_proj.bias": qb, a + "v_proj.bias": vb,
           a + "out_proj.weight": t["self_attention.linear_proj.weight"],
           a + "out_proj.bias": t["self_attention.linear_proj.bias"],
           p + n["ln2"] + ".weight": t["pre_mlp_layernorm.weight"], p + n["ln2"] + ".bias": t["pre_mlp_layernorm.bias"],
           p + n["fc1"] + ".weight": t["mlp.linear_fc1.weight"], p + n["fc1"] + ".bias": t["mlp.linear_fc1.bias"],
           p + n["fc2"] + ".weight": t["mlp.linear_fc2.weight"], p + n["fc2"] + ".bias": t["mlp.linear_fc2.bias"]}
    if family != "whisper_encoder":
        out[a + "k_proj.bias"] = kb
    # Whisper's k_proj has no bias. Dropping ours is exact: q.(k + b) adds q.b to every key's score of a query,
    # which softmax ignores (training moves it anyway: AdamW turns its ~0 gradient into lr-sized steps).
    return out


def _import_llm_layer(get, has, p: str, heads: int, groups: int, qkv_bias: bool,
                      notes: list[Note]) -> dict[str, torch.Tensor]:
    a, m = p + "self_attn.", p + "mlp."
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if has(a + proj + ".bias") and not _is_zero(get(a + proj + ".bias")) and not (qkv_bias and proj != "o_proj"):
            what = "no output-projection bias" if proj == "o_proj" else "no q/k/v biases (declare `qkv_bias: true`)"
            notes.append(Note(f"{a}{proj}.bias is non-zero; the llm module has {what}", tensor=f"{a}{proj}.bias",
                              max_error=_max_abs(get(a + proj + ".bias"))))
    out = {}
    if qkv_bias:
        q_w, k_w = get(a + "q_proj.weight"), get(a + "k_proj.weight")

        def bias(proj: str, rows: int, like: torch.Tensor) -> torch.Tensor:
            if has(a + proj + ".bias"):
                return get(a + proj + ".bias")
            return torch.zeros(rows, dtype=like.dtype, device=like.device)  # HF has none: zero is exact

        out["self_attention.linear_qkv.bias"] = fuse_qkv(bias("q_proj", q_w.shape[0], q_w),
                                                         bias("k_proj", k_w.shape[0], k_w),
                                                         bias("v_proj", k_w.shape[0], k_w), heads, groups)
    return out | {
        "input_layernorm.weight": get(p + "input_layernorm.weight"),
        "self_attention.linear_qkv.weight": fuse_qkv(get(a + "q_proj.weight"), get(a + "k_proj.weight"),
                                                     get(a + "v_proj.weight"), heads, groups),
        "self_attention.linear_proj.weight": get(a + "o_proj.weight"),
        "pre_mlp_layernorm.weight": get(p + "post_attention_layernorm.weight"),
        "mlp.linear_fc1.weight": torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")], dim=0),
        "mlp.linear_fc2.weight": get(m + "down_proj.weight"),
    }


def _export_llm_layer(t: dict, p: str, unit: str, heads: int, groups: int, has_tensor,
                      notes: list[Note]) -> dict[str, torch.Tensor]:
    a, m = p + "self_attn.", p + "mlp."
    q, k, v = split_qkv(t["self_attention.linear_qkv.weight"], heads, groups)
    gate, up = torch.chunk(t["mlp.linear_fc1.weight"], 2, dim=0)
    out = {p + "input_layernorm.weight": t["input_layernorm.weight"],
           a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v,
           a + "o_proj.weight": t["self_attention.linear_proj.weight"],
           p + "post_attention_layernorm.weight": t["pre_mlp_layernorm.weight"],
           m + "gate_proj.weight": gate, m + "up_proj.weight": up, m + "down_proj.weight": t["mlp.linear_fc2.weight"]}
    ours = t.get("self_attention.linear_qkv.bias")
    biases = split_qkv(ours, heads, groups) if ours is not None else [None] * 3
    dropped = []
    for name, w, b in (("q_proj", q, biases[0]), ("k_proj", k, biases[1]), ("v_proj", v, biases[2])):
        if has_tensor(a + name + ".bias"):
            out[a + name + ".bias"] = b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
        elif b is not None and not _is_zero(b):
            dropped.append((name, _max_abs(b)))
    if dropped:
        worst = max(e for _, e in dropped)
        notes.append(Note(f"the HF model has no {'/'.join(n for n, _ in dropped)} bias (dropped; declare it with "
                          f"a Qwen2 or `attention_bias` Llama reference)", tensor=f"{unit}.self_attention.linear_qkv.bias",
                          max_error=worst))
    if has_tensor(a + "o_proj.bias"):  # a Llama with attention_bias: zero is what our layer computes
        w = out[a + "o_proj.weight"]
        out[a + "o_proj.bias"] = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
    return out


# ------------------------------------------------------------------------------------------ units


def import_unit(folder: HFFolder, tower: Tower, module, part: str,
                fill) -> tuple[dict[str, torch.Tensor], set[str], list[Note]]:
    """Our tensors of one unit part (``"frontend"``, ``"layers.3"``, ``"head"``, ``"lm_head"``; names relative to
    the unit) from ``folder``; ``fill(rel_name, shape)`` gives tensors HF lacks (spindle-only parameters).
    Returns (tensors, HF names used, notes). An empty dict: the HF model has nothing for this part."""
    used: set[str] = set()
    notes: list[Note] = []

    def get(name: str) -> torch.Tensor:
        used.add(name)
        return folder.get(name)

    has = folder.__contains__
    p, fam = tower.prefix, tower.family
    heads, groups = module.num_heads, module.query_groups
    idx = layer_index(part)
    if idx is not None:
        lp = p + tower.layer_prefix + f"{idx}."
        if fam in ("llama", "qwen2"):
            return _import_llm_layer(get, has, lp, heads, groups, module.qkv_bias, notes), used, notes
        return _import_encoder_layer(get, lp, fam, heads, groups), used, notes
    if part == "frontend":
        return _import_frontend(get, tower, module), used, notes
    if part == "head":
        norm = {"clip_vision": "post_layernorm", "clip_text": "final_layer_norm", "whisper_encoder": "layer_norm"}
        if fam not in norm:
            return {}, used, notes
        h = module.hidden_size
        out = {"final_norm.weight": get(p + norm[fam] + ".weight"), "final_norm.bias": get(p + norm[fam] + ".bias")}
        shape = (module.embed_dim or h, h)
        if tower.projection is not None:
            out["projection.weight"] = get(tower.projection)
        else:
            out["projection.weight"] = fill("projection.weight", shape)
            notes.append(Note(f"{module.name}.head.projection.weight: no projection in the HF model, initialised",
                              inexact=False))
        return out, used, notes
    if part == "lm_head" and fam in ("llama", "qwen2"):
        out = {"final_norm.weight": get(p + "norm.weight")}
        out["output_layer.weight"] = get("lm_head.weight") if has("lm_head.weight") else get(p + "embed_tokens.weight")
        return out, used, notes
    return {}, used, notes


def _import_frontend(get, tower: Tower, module) -> dict[str, torch.Tensor]:
    p, fam = tower.prefix, tower.family
    if fam == "clip_vision":
        w = get(p + "embeddings.patch_embedding.weight")
        out = {"patch_proj.weight": w.reshape(w.shape[0], -1)}
        if module.frontend.patch_bias:  # CLIP has none: zero is exact
            out["patch_proj.bias"] = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
        out.update({"class_token": get(p + "embeddings.class_embedding"),
                    "position_embeddings": get(p + "embeddings.position_embedding.weight")})
        if module.frontend.pre_norm:
            out.update({"pre_norm.weight": get(p + "pre_layrnorm.weight"), "pre_norm.bias": get(p + "pre_layrnorm.bias")})
        return out
    if fam == "clip_text":
        return {"word_embeddings.weight": get(p + "embeddings.token_embedding.weight"),
                "position_embeddings": get(p + "embeddings.position_embedding.weight")}
    if fam in ("llama", "qwen2"):
        return {"word_embeddings.weight": get(p + "embed_tokens.weight")}
    fe = module.frontend
    if fam == "whisper_encoder" and fe is not None and fe.type == "audio" and fe.stem == "conv":
        return {"conv1.weight": get(p + "conv1.weight"), "conv1.bias": get(p + "conv1.bias"),
                "conv2.weight": get(p + "conv2.weight"), "conv2.bias": get(p + "conv2.bias"),
                "sinusoidal_positions": get(p + "embed_positions.weight")}
    return {}  # whisper with a linear stem: no counterpart


def export_unit(tower: Tower, module, part: str, unit: str, t: dict[str, torch.Tensor],
                has_tensor) -> tuple[dict[str, torch.Tensor], list[Note]]:
    """HF tensors for one of our unit parts (``t`` named relative to the unit). ``has_tensor(name)``: whether the
    target HF model has a tensor of that name (the reference folder's, or the from-scratch class's). Returns (HF
    tensors, notes; inexact ones name our tensor and its max error)."""
    notes: list[Note] = []
    p, fam = tower.prefix, tower.family
    heads, groups = module.num_heads, module.query_groups
    idx = layer_index(part)
    if idx is not None:
        lp = p + tower.layer_prefix + f"{idx}."
        if fam in ("llama", "qwen2"):
            return _export_llm_layer(t, lp, unit, heads, groups, has_tensor, notes), notes
        return _export_encoder_layer(t, lp, fam, heads, groups), notes
    if part == "frontend":
        return _export_frontend(tower, module, unit, t, notes), notes
    if part == "head" and fam in ("clip_vision", "clip_text", "whisper_encoder"):
        norm = {"clip_vision": "post_layernorm", "clip_text": "final_layer_norm", "whisper_encoder": "layer_norm"}[fam]
        out = {p + norm + ".weight": t["final_norm.weight"], p + norm + ".bias": t["final_norm.bias"]}
        if tower.projection is not None:
            out[tower.projection] = t["projection.weight"]
        else:
            notes.append(Note(f"{unit}.projection.weight: the {fam} model has no projection after its pooled output "
                              f"(not exported; every output of the HF model is still ours)", inexact=False))
        return out, notes
    if part == "lm_head" and fam in ("llama", "qwen2"):
        return {p + "norm.weight": t["final_norm.weight"], "lm_head.weight": t["output_layer.weight"]}, notes
    for name, v in t.items():
        notes.append(Note(f"no place in the {fam} model (dropped)", tensor=f"{unit}.{name}", max_error=_max_abs(v)))
    return {}, notes


def fold_patch_bias(positions: torch.Tensor, bias: torch.Tensor, class_tokens: int) -> torch.Tensor:
    """Position embeddings that absorb the patch projection's bias: ``(W x + b) + pos_i = W x + (pos_i + b)`` for
    every patch token; the class token (row 0) is concatenated after the projection in our front end as in CLIP's,
    so it never sees the bias and its row is unchanged. The result is exact up to one rounding of the addition."""
    if _is_zero(bias):
        return positions
    out = positions.clone()
    out[class_tokens:] += bias.to(out.dtype)
    return out


def _export_frontend(tower: Tower, module, unit: str, t: dict, notes: list[Note]) -> dict[str, torch.Tensor]:
    p, fam = tower.prefix, tower.family
    fe = module.frontend
    if fam == "clip_vision":
        w = t["patch_proj.weight"]
        positions = t["position_embeddings"]
        if "patch_proj.bias" in t and not _is_zero(t["patch_proj.bias"]):
            positions = fold_patch_bias(positions, t["patch_proj.bias"], fe.class_tokens)
            notes.append(Note(f"{unit}.patch_proj.bias folded into embeddings.position_embedding rows 1.. (CLIP's "
                              f"patch embedding has no bias; exact for every token)", inexact=False))
        out = {p + "embeddings.patch_embedding.weight": w.reshape(w.shape[0], fe.in_channels, fe.patch_size,
                                                                  fe.patch_size),
               p + "embeddings.class_embedding": t["class_token"],
               p + "embeddings.position_embedding.weight": positions}
        if "pre_norm.weight" in t:
            out.update({p + "pre_layrnorm.weight": t["pre_norm.weight"], p + "pre_layrnorm.bias": t["pre_norm.bias"]})
        return out
    if fam == "clip_text":
        return {p + "embeddings.token_embedding.weight": t["word_embeddings.weight"],
                p + "embeddings.position_embedding.weight": t["position_embeddings"]}
    if fam in ("llama", "qwen2"):
        return {p + "embed_tokens.weight": t["word_embeddings.weight"]}
    if fam == "whisper_encoder" and "conv1.weight" in t:
        return {p + "conv1.weight": t["conv1.weight"], p + "conv1.bias": t["conv1.bias"],
                p + "conv2.weight": t["conv2.weight"], p + "conv2.bias": t["conv2.bias"],
                p + "embed_positions.weight": t["sinusoidal_positions"]}
    for name, v in t.items():
        notes.append(Note(f"the {fam} front end has no counterpart in our model (dropped; the reference's is kept)",
                          tensor=f"{unit}.{name}", max_error=_max_abs(v)))
    return {}


def missing_part_tensors(tower: Tower, module, part: str, like: torch.Tensor) -> tuple[dict[str, torch.Tensor],
                                                                                     list[Note]]:
    """HF tensors of a part the workload has no unit for (a tower without a contrastive head: it only feeds a
    projector), for a from-scratch export: identity norms. CLIP's vision ``post_layernorm`` and projection act only
    on the pooled class token (``pooler_output``), which such a tower does not compute, so they leave every token
    output exact; Whisper's and CLIP text's final LayerNorm act on every token: inexact."""
    p, fam, h = tower.prefix, tower.family, module.hidden_size
    kw = {"dtype": like.dtype, "device": like.device}
    if part != "head" or fam not in ("clip_vision", "clip_text", "whisper_encoder"):
        return {}, []
    norm = {"clip_vision": "post_layernorm", "clip_text": "final_layer_norm", "whisper_encoder": "layer_norm"}[fam]
    out = {p + norm + ".weight": torch.ones(h, **kw), p + norm + ".bias": torch.zeros(h, **kw)}
    if tower.projection is not None:
        out[tower.projection] = torch.zeros(int(tower.config.get("projection_dim") or h), h, **kw)
    if fam == "clip_vision":
        return out, [Note(f"{module.name}: no contrastive head in the workload; {norm} (identity) and the projection "
                          f"act only on CLIP's pooled output (last_hidden_state is exact)", inexact=False)]
    return out, [Note(f"{module.name}: no head in the workload, so the tower's output lacks the {fam} model's final "
                      f"{norm} (written as identity, which still normalises)", tensor=f"{module.name}.head.final_norm")]


def unused_keys(folder: HFFolder, tower: Tower, used: set[str]) -> list[str]:
    """HF tensors of this tower (under its claimed prefixes) that no unit took: dropped by the conversion."""
    def claimed(key: str) -> bool:
        return any(key.startswith(prefix) for prefix in tower.claimed)  # "" claims the whole folder

    return sorted(k for k in folder.keys() if k not in used and not k.endswith(IGNORED_SUFFIXES) and claimed(k))


def pooled_only(tower: Tower, key: str) -> bool:
    """HF tensors that act only on a pooled output (CLIP's vision ``post_layernorm`` on the class token, the
    projections): dropping them leaves the tower's token outputs (``last_hidden_state``) exact, as when a tower
    feeds a projector instead of a contrastive head."""
    if tower.family == "clip_vision":
        return key.startswith(tower.prefix + "post_layernorm.") or key == tower.projection
    if tower.family == "clip_text":
        return key == tower.projection
    return False
