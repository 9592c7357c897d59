"""Names and full (TP-unsharded) shapes of a workload's parameter units, without building any operator.

A megatron-spindle checkpoint holds one entry per parameter unit (``"vision.layers.3"``, ``"llm.frontend"``,
``"llm.lm_head"``, ``"vis_proj.projector"``; ``"<module>@<task>.<...>"`` for ``shared: false`` modules) with
tensors named ``"<unit>.<submodule path>"`` exactly as ``SliceOperator.export_full_state`` names them (megatron-core
local layer spec). ``expected_units(workload)`` computes them from the workload spec alone, so a converter can
check a 10B-parameter checkpoint against a workload without allocating the model; tests/tools checks it against
the real operators.

Transformer Engine layer specs fuse the two pre-norms into the following linear layer; ``to_te_names`` and
``from_te_names`` (megatron_spindle/checkpointing/names.py, the one rule) translate between the two spellings.
"""

from __future__ import annotations

from megatron_spindle.data.mock import own_text_tokens
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import ModuleSpec, Workload, unit_module

Shape = tuple[int, ...]

def workload_units(workload: Workload) -> list[str]:
    """Every parameter unit of the workload's MetaOp graph, in graph (dependency) order."""
    graph = build_metagraph(workload)
    out: list[str] = []
    for level in graph.levels:
        for mid in level:
            for names in graph.metaops[mid].params:
                for unit in names:
                    if unit not in out:
                        out.append(unit)
    return out


def split_unit(unit: str) -> tuple[str, str, str]:
    """``"vision@t1.layers.3"`` -> (owner ``"vision@t1"``, module ``"vision"``, part ``"layers.3"``)."""
    owner, _, part = unit.partition(".")
    return owner, unit_module(owner), part


def layer_index(part: str) -> int | None:
    """3 for ``"layers.3"``; None for the other parts (frontend, head, projector, lm_head)."""
    return int(part.split(".")[1]) if part.startswith("layers.") else None


def frontend_max_tokens(workload: Workload, module: str) -> int:
    """Rows of a front end's learned position table: the most tokens its own front end makes in any task."""
    return max(own_text_tokens(workload, t.name, module) for t in workload.tasks if module in t.tokens)


def _frontend_shapes(workload: Workload, spec: ModuleSpec) -> dict[str, Shape]:
    fe, h = spec.frontend, spec.hidden_size
    if fe.type == "patch":
        out = {"patch_proj.weight": (h, fe.in_channels * fe.patch_size ** 2)}
        if fe.patch_bias:
            out["patch_proj.bias"] = (h,)
        if fe.class_tokens:
            out["class_token"] = (h,) if fe.class_tokens == 1 else (fe.class_tokens, h)
        out["position_embeddings"] = (fe.patch_tokens, h)
        if fe.pre_norm:
            out.update({"pre_norm.weight": (h,), "pre_norm.bias": (h,)})
        return out
    if fe.type == "audio" and fe.stem == "conv":
        return {"conv1.weight": (h, fe.in_channels, 3), "conv1.bias": (h,), "conv2.weight": (h, h, 3),
                "conv2.bias": (h,), "sinusoidal_positions": (frontend_max_tokens(workload, spec.name), h)}
    if fe.type in ("audio", "imu"):
        return {"window_proj.weight": (h, fe.in_channels * fe.patch_size), "window_proj.bias": (h,),
                "position_embeddings": (frontend_max_tokens(workload, spec.name), h)}
    out = {"word_embeddings.weight": (fe.vocab_size, h)}
    if spec.kind != "llm":
        out["position_embeddings"] = (frontend_max_tokens(workload, spec.name), h)
    return out


def _layer_shapes(spec: ModuleSpec) -> dict[str, Shape]:
    h, f = spec.hidden_size, spec.ffn_hidden_size
    d = h // spec.num_heads
    qkv = (spec.num_heads + 2 * spec.query_groups) * d
    if spec.kind == "llm":  # RMSNorm, SwiGLU ([gate; up] in linear_fc1), no biases (but q/k/v with qkv_bias)
        out = {"input_layernorm.weight": (h,), "self_attention.linear_proj.weight": (h, spec.num_heads * d),
               "self_attention.linear_qkv.weight": (qkv, h), "pre_mlp_layernorm.weight": (h,),
               "mlp.linear_fc1.weight": (2 * f, h), "mlp.linear_fc2.weight": (h, f)}
        if spec.qkv_bias:
            out["self_attention.linear_qkv.bias"] = (qkv,)
        return out
    return {"input_layernorm.weight": (h,), "input_layernorm.bias": (h,),
            "self_attention.linear_proj.weight": (h, spec.num_heads * d), "self_attention.linear_proj.bias": (h,),
            "self_attention.linear_qkv.weight": (qkv, h), "self_attention.linear_qkv.bias": (qkv,),
            "pre_mlp_layernorm.weight": (h,), "pre_mlp_layernorm.bias": (h,),
            "mlp.linear_fc1.weight": (f, h), "mlp.linear_fc1.bias": (f,),
            "mlp.linear_fc2.weight": (h, f), "mlp.linear_fc2.bias": (h,)}


def _part_shapes(workload: Workload, spec: ModuleSpec, part: str) -> dict[str, Shape]:
    h = spec.hidden_size
    if part == "frontend":
        return _frontend_shapes(workload, spec)
    if layer_index(part) is not None:
        return _layer_shapes(spec)
    if part == "head":
        return {"final_norm.weight": (h,), "final_norm.bias": (h,),
                "projection.weight": (spec.embed_dim or h, h)}
    if part == "lm_head":
        return {"final_norm.weight": (h,), "output_layer.weight": (spec.lm_vocab, h)}
    if part == "projector":
        return {"encoder.linear_fc1.weight": (h, spec.in_size), "encoder.linear_fc1.bias": (h,),
                "encoder.linear_fc2.weight": (h, h), "encoder.linear_fc2.bias": (h,)}
    raise ValueError(f"unknown parameter unit part '{part}'")


def unit_shapes(workload: Workload, unit: str) -> dict[str, Shape]:
    """``{"<unit>.<path>": full shape}`` of one parameter unit (local layer spec names)."""
    _, module, part = split_unit(unit)
    spec = workload.modules[module]
    return {f"{unit}.{k}": v for k, v in _part_shapes(workload, spec, part).items()}


def expected_units(workload: Workload) -> dict[str, dict[str, Shape]]:
    """``{unit: {tensor name: full shape}}`` for every parameter unit of the workload."""
    return {unit: unit_shapes(workload, unit) for unit in workload_units(workload)}
