"""The CPU shim and the layer-spec choice (no CUDA on the test machines)."""

from __future__ import annotations

import pytest
import torch

from megatron_spindle.compat import apply_cpu_shim, layer_spec, te_available
from megatron_spindle.graph.workload import load_workload

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def test_cpu_shim_is_idempotent_and_patches_megatron_needs():
    assert apply_cpu_shim() and apply_cpu_shim()
    assert torch.cuda.current_device() == "cpu"
    torch.cuda.synchronize()  # a no-op instead of an error
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer.utils import get_default_causal_mask

    mask = get_default_causal_mask(4)  # hard-codes device="cuda"
    assert mask.device.type == "cpu" and mask.tolist()[0] == [False, True, True, True]
    with get_cuda_rng_tracker().fork():  # the CPU tracker forks the CPU generator and restores it
        inside = torch.rand(3)
    after_a = torch.rand(3)
    with get_cuda_rng_tracker().fork():
        inside_again = torch.rand(3)
    assert not torch.equal(inside, inside_again)  # the stream advances
    assert not torch.equal(after_a, inside_again)


def test_layer_spec_picks_local_spec_and_mask_types():
    from megatron.core.transformer.enums import AttnMaskType

    assert te_available() is False
    vlm = load_workload("tiny-vlm")
    enc, llm = layer_spec(vlm.modules["vision"]), layer_spec(vlm.modules["llm"])
    assert enc.submodules.self_attention.params["attn_mask_type"] == AttnMaskType.no_mask
    assert llm.submodules.self_attention.params["attn_mask_type"] == AttnMaskType.causal
    # the shared megatron spec is not modified
    assert layer_spec(vlm.modules["llm"]).submodules.self_attention.params["attn_mask_type"] == AttnMaskType.causal


def test_attention_backend_picks_the_spec_and_transformer_engine_switches(monkeypatch):
    """local builds megatron-core's local spec even where Transformer Engine is available; a TE backend where TE is
    missing is refused; where TE runs, flash, fused and unfused set TE's switches as megatron-core's LanguageModule
    does (auto leaves them to TE), and a switch the user set the other way is an error naming it."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_spindle.compat import cpu
    from megatron_spindle.plan.schema import PlanError

    vlm = load_workload("tiny-vlm")
    assert not cpu.uses_te_spec("auto") and not cpu.uses_te_spec("local")
    with pytest.raises(PlanError, match="attention backend 'flash' is Transformer Engine's, which is not available"):
        cpu.uses_te_spec("flash")
    monkeypatch.setattr(cpu, "te_available", lambda: True)
    assert cpu.uses_te_spec("auto") and cpu.uses_te_spec("unfused") and not cpu.uses_te_spec("local")
    local = cpu.layer_spec(vlm.modules["llm"], attention_backend="local")
    assert local.submodules.self_attention.submodules.core_attention is DotProductAttention
    env = {}
    cpu.select_te_attention("fused", env)
    assert env == {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "0"}
    for backend in ("auto", "local"):
        untouched = {"NVTE_FLASH_ATTN": "0"}
        cpu.select_te_attention(backend, untouched)
        assert untouched == {"NVTE_FLASH_ATTN": "0"}
    with pytest.raises(PlanError, match="NVTE_FLASH_ATTN=0 contradicts --attention-backend flash"):
        cpu.select_te_attention("flash", {"NVTE_FLASH_ATTN": "0"})


def test_dropout_is_configurable():
    from megatron_spindle.data.mock import mock_batch
    from megatron_spindle.models import ModelConfig, build_operator, metaop_infos

    w = load_workload("tiny-clip")
    info = metaop_infos(w)["vision_text/vision"]
    op = build_operator(w, info, 0, 1, config=ModelConfig(hidden_dropout=0.5, attention_dropout=0.5))
    x, batch = [torch.randn(2, 17, 64)], mock_batch(w, "vision_text", 0)
    assert not torch.equal(op(x, batch), op.eval()(x, batch))  # tests/models/test_dropout_masks.py: the masks


def test_llm_layers_are_llama_style_and_encoders_clip_style():
    from megatron_spindle.models import build_operator, metaop_infos

    w = load_workload("tiny-vlm")
    infos = metaop_infos(w)
    llm = build_operator(w, infos["caption/llm"], 0, 1).blocks[0].layers[0]
    enc = build_operator(w, infos["caption/vision"], 0, 1).blocks[0].layers[0]
    assert isinstance(llm.input_layernorm, torch.nn.RMSNorm) and isinstance(enc.input_layernorm, torch.nn.LayerNorm)
    assert llm.mlp.linear_fc1.weight.shape == (2 * 176, 64)  # SwiGLU: [gate; up]
    assert llm.self_attention.linear_qkv.weight.shape == (64 + 2 * 2 * 16, 64)  # GQA: 4 q heads, 2 kv groups
    assert llm.self_attention.linear_qkv.bias is None and enc.self_attention.linear_qkv.bias is not None


def test_layers_name_their_tensors_in_the_local_spelling_whatever_the_spec():
    """Transformer Engine's spec holds each pre-norm inside the next linear (``linear_qkv.layer_norm_weight``); an
    operator names those tensors as the local spec does, so checkpoints and the runtime's keys are one whatever
    spec built the layers. Emulated on a local-spec layer whose norms are moved where TE keeps them."""
    from megatron_spindle.models import build_operator, metaop_infos

    w = load_workload("tiny-vlm")
    op = build_operator(w, metaop_infos(w)["caption/llm"], 0, 1)
    local = op.export_full_state()
    layer = op.blocks[0].layers[0]
    for norm, linear in (("input_layernorm", layer.self_attention.linear_qkv), ("pre_mlp_layernorm",
                                                                                  layer.mlp.linear_fc1)):
        weight = getattr(layer, norm).weight
        delattr(layer, norm)
        linear.register_parameter("layer_norm_weight", weight)  # TE's place and name for it
    for cached in ("_named_by_unit", "_params_by_name"):
        op.__dict__.pop(cached, None)
    paths = [path for path, _ in op.named_parameters()]
    assert any(p.endswith("linear_qkv.layer_norm_weight") for p in paths)
    te_layout = op.export_full_state()
    assert sorted(te_layout) == sorted(local)
    assert all(torch.equal(te_layout[k], v) for k, v in local.items())
    op.load_full_state(local)  # a checkpoint's names load into it
