"""Module options for exact Hugging Face conversions: each changes the computation as documented, defaults change
nothing, and the estimator counts the parameters they add (TP=1, CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from megatron_spindle.data.mock import TaskBatch, mock_batch
from megatron_spindle.estimator.cost_model import AnalyticCostModel
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import workload_from_dict
from megatron_spindle.models import build_operator, metaop_infos
from megatron_spindle.models.config import quick_gelu
from megatron_spindle.models.reference import ReferenceModel
from megatron_spindle.models.state import sinusoids

H = 16


def _spec(**opts) -> dict:
    """Vision (patch), text (eos-capable) and audio towers, and an LLM captioning from vision; ``opts`` maps a
    module name to extra module fields (``"<module>.frontend"`` to extra front-end fields)."""
    mods = {
        "vision": {"kind": "encoder", "num_layers": 1, "hidden_size": H, "num_heads": 2, "ffn_hidden_size": 32,
                   "embed_dim": 8, "frontend": {"type": "patch", "image_size": 8, "patch_size": 4, "in_channels": 3}},
        "text": {"kind": "encoder", "num_layers": 1, "hidden_size": H, "num_heads": 2, "ffn_hidden_size": 32,
                 "embed_dim": 8, "causal": True, "frontend": {"type": "text", "vocab_size": 30}},
        "audio": {"kind": "encoder", "num_layers": 1, "hidden_size": H, "num_heads": 2, "ffn_hidden_size": 32,
                  "embed_dim": 8, "frontend": {"type": "audio", "patch_size": 2, "in_channels": 4}},
        "vis_proj": {"kind": "projector", "input_size": H, "hidden_size": H},
        "llm": {"kind": "llm", "num_layers": 1, "hidden_size": H, "num_heads": 4, "num_query_groups": 2,
                "ffn_hidden_size": 24, "frontend": {"type": "text", "vocab_size": 40}},
    }
    for key, extra in opts.items():
        module, _, part = key.partition(".")
        (mods[module][part] if part else mods[module]).update(extra)
    return {
        "name": "options",
        "modules": mods,
        "tasks": [
            {"name": "vt", "batch_size": 2, "tokens": {"vision": 5, "text": 6},
             "loss": {"kind": "contrastive", "modules": ["vision", "text"]}},
            {"name": "at", "batch_size": 2, "tokens": {"audio": 5, "text": 6},
             "loss": {"kind": "contrastive", "modules": ["audio", "text"]}},
            {"name": "cap", "batch_size": 2, "tokens": {"vision": 5, "vis_proj": 5, "llm": 9},
             "flows": [["vision", "vis_proj"], ["vis_proj", "llm"]], "loss": {"kind": "lm", "module": "llm"}},
        ],
    }


def _op(workload, metaop_id, scale: float = 1.0):
    """The operator, its weights scaled by ``scale`` (std 0.02 weights barely move the residual stream)."""
    info = metaop_infos(workload)[metaop_id]
    op = build_operator(workload, info, 0, info.num_layers)
    if scale != 1.0:
        op.load_full_state({k: v * scale for k, v in op.export_full_state().items()})
    return op


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def base():
    return workload_from_dict(_spec())


# ------------------------------------------------------------------------------------------------ activation


def test_quick_gelu_is_clips_activation():
    x = torch.linspace(-4, 4, 101)
    assert torch.allclose(quick_gelu(x), x * torch.sigmoid(1.702 * x))
    assert (quick_gelu(x) - F.gelu(x)).abs().max() > 1e-3


@torch.no_grad()
def test_activation_option_changes_the_mlp(base):
    """Same weights (named alike), different activation: outputs differ; the MLP applies exactly that function."""
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(0))
    ref = _op(base, "vt/vision", 5)
    quick = _op(workload_from_dict(_spec(vision={"activation": "quick_gelu"})), "vt/vision", 5)
    assert ref.export_full_state().keys() == quick.export_full_state().keys()
    assert _rel(quick([x], None) - x, ref([x], None) - x) > 2e-3  # the layers' updates of the residual stream
    assert ref.blocks[0].layers[0].mlp.activation_func is F.gelu
    assert quick.blocks[0].layers[0].mlp.activation_func is quick_gelu
    llm = _op(base, "cap/llm")
    geglu = _op(workload_from_dict(_spec(llm={"activation": "gelu"})), "cap/llm")
    assert llm.blocks[0].layers[0].mlp.activation_func is F.silu  # default: SwiGLU
    assert geglu.blocks[0].layers[0].mlp.activation_func is F.gelu and geglu.blocks[0].layers[0].config.gated_linear_unit


# ------------------------------------------------------------------------------------------------ pre_norm


@torch.no_grad()
def test_patch_pre_norm_is_a_layernorm_after_the_positions(base):
    images = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    plain = _op(base, "vt/vision.frontend")
    normed = _op(workload_from_dict(_spec(**{"vision.frontend": {"pre_norm": True}})), "vt/vision.frontend")
    extra = set(normed.export_full_state()) - set(plain.export_full_state())
    assert extra == {"vision.frontend.pre_norm.weight", "vision.frontend.pre_norm.bias"}
    normed.frontend.pre_norm.weight.normal_()
    normed.frontend.pre_norm.bias.normal_()
    ln = normed.frontend.pre_norm
    want = F.layer_norm(plain.frontend(images), (H,), ln.weight, ln.bias, 1e-5)
    assert _rel(normed.frontend(images), want) < 1e-6


@torch.no_grad()
def test_a_smaller_image_takes_the_top_left_of_the_position_grid():
    """image_size 12 / patch 4 is a 3 x 3 grid; a task declaring 2 x 2 + 1 tokens feeds 8 x 8 images: patch (r, c)
    gets the full grid's position (r, c), the class token its own; full-size images use every position."""
    w = workload_from_dict(_spec(**{"vision.frontend": {"image_size": 12}}))  # the tasks declare 5 vision tokens
    fe = _op(w, "vt/vision.frontend").frontend
    fe.position_embeddings.normal_(generator=torch.Generator().manual_seed(3))
    fe.class_token.normal_(generator=torch.Generator().manual_seed(4))
    small = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    patches = small.reshape(2, 3, 2, 4, 2, 4).permute(0, 2, 4, 1, 3, 5).reshape(2, 4, 48)
    rows = [0] + [1 + r * 3 + c for r in range(2) for c in range(2)]  # cls, (0,0), (0,1), (1,0), (1,1)
    want = torch.cat([fe.class_token.expand(2, 1, -1), fe.patch_proj(patches)], 1) + fe.position_embeddings[rows]
    assert torch.equal(fe(small), want)
    full = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(6))
    patches = full.reshape(2, 3, 3, 4, 3, 4).permute(0, 2, 4, 1, 3, 5).reshape(2, 9, 48)
    want = torch.cat([fe.class_token.expand(2, 1, -1), fe.patch_proj(patches)], 1) + fe.position_embeddings
    assert torch.equal(fe(full), want)


@torch.no_grad()
def test_class_token_len_puts_that_many_learned_slots_before_the_patches():
    """NeMo's ViT-g/14 (class_token_length 8): a [len, hidden] table of class tokens, each with its own position;
    the parameter counts of the estimator and of the checkpoint layout agree with the operator's."""
    from tools.checkpoint.layout import unit_shapes

    w = workload_from_dict(_spec(**{"vision.frontend": {"class_token_len": 3}},
                                 ) | {"tasks": [{"name": "vt", "batch_size": 2, "tokens": {"vision": 7, "text": 6},
                                                 "loss": {"kind": "contrastive", "modules": ["vision", "text"]}}]})
    op = _op(w, "vt/vision.frontend")
    fe = op.frontend
    assert fe.class_token.shape == (3, H) and fe.position_embeddings.shape == (7, H)
    fe.class_token.normal_(generator=torch.Generator().manual_seed(7))
    images = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(8))
    patches = images.reshape(2, 3, 2, 4, 2, 4).permute(0, 2, 4, 1, 3, 5).reshape(2, 4, 48)
    want = torch.cat([fe.class_token.expand(2, -1, -1), fe.patch_proj(patches)], 1) + fe.position_embeddings
    assert torch.equal(fe(images), want)
    state = op.export_full_state()
    shapes = unit_shapes(w, "vision.frontend")
    assert {k: tuple(v.shape) for k, v in state.items()} == shapes
    model = AnalyticCostModel(w, make_cluster(1, gpu_type_name="CPU"))
    assert model.param_count("vision.frontend") == sum(v.numel() for v in state.values())


# ------------------------------------------------------------------------------------------------ head pooling


@torch.no_grad()
def test_eos_pooling_picks_the_eos_row():
    """head_pool eos: the first position of eos_token_id in the module's own text (at the END of the sequence,
    after any incoming flow tokens); without eos_token_id the position of the largest id; cls and mean too."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(2, 30, (2, 6), generator=gen)
    ids[0, 3], ids[1, 1], ids[1, 4] = 1, 1, 1
    hidden = torch.randn(2, 9, H, generator=gen)  # 3 rows from other modules, then the 6 text rows
    batch = TaskBatch("vt", inputs={"text": ids}, global_batch_size=2)

    def pooled(**opts):
        op = _op(workload_from_dict(_spec(text=opts)), "vt/text.head")
        return op([hidden], batch)[:, 0], op.head

    out, head = pooled(head_pool="eos", eos_token_id=1)
    normed = head.final_norm(hidden)
    assert torch.allclose(out, head.projection(normed[[0, 1], [3 + 3, 3 + 1]]))
    out, head = pooled(head_pool="eos")  # argmax of the ids
    pos = 3 + ids.argmax(dim=1)
    assert torch.allclose(out, head.projection(head.final_norm(hidden)[[0, 1], pos]))
    out, head = pooled(head_pool="cls")
    assert torch.allclose(out, head.projection(head.final_norm(hidden)[:, 0]))
    out, head = pooled()  # default for a text tower: mean
    assert torch.allclose(out, head.projection(head.final_norm(hidden).mean(dim=1)))
    with pytest.raises(ValueError, match="eos pooling needs the token ids"):
        _op(workload_from_dict(_spec(text={"head_pool": "eos"})), "vt/text.head")([hidden], None)


# ------------------------------------------------------------------------------------------------ conv stem


@torch.no_grad()
def test_conv_audio_stem_is_whispers():
    """conv1d k3 + GELU, conv1d k3 stride patch_size + GELU, + positions initialised to Whisper's sinusoids;
    frames // patch_size tokens, as the workload declares."""
    workload = workload_from_dict(_spec(**{"audio.frontend": {"stem": "conv"}}))
    op = _op(workload, "at/audio.frontend")
    fe = op.frontend
    assert torch.equal(fe.sinusoidal_positions, sinusoids(5, H))
    assert sinusoids(3, 4)[2].tolist() == pytest.approx(
        [torch.sin(torch.tensor(2.0)).item(), torch.sin(torch.tensor(2e-4)).item(),
         torch.cos(torch.tensor(2.0)).item(), torch.cos(torch.tensor(2e-4)).item()], rel=1e-6)
    batch = mock_batch(workload, "at", 0)
    spec = batch.inputs["audio"]
    assert spec.shape == (2, 4, 10)  # 5 tokens * patch_size 2 frames
    out = op([], batch)
    x = F.gelu(F.conv1d(spec, fe.conv1.weight, fe.conv1.bias, padding=1))
    x = F.gelu(F.conv1d(x, fe.conv2.weight, fe.conv2.bias, stride=2, padding=1)).transpose(1, 2)
    assert out.shape == (2, 5, H)
    assert _rel(out, x + sinusoids(5, H)) < 1e-6
    assert fe(torch.randn(2, 4, 11)).shape == (2, 5, H)  # a frame past a multiple of patch_size is dropped


# ------------------------------------------------------------------------------------------------ llm options


@torch.no_grad()
def test_qkv_bias_adds_trained_qkv_biases(base):
    x = torch.randn(2, 9, H, generator=torch.Generator().manual_seed(3))
    plain = _op(base, "cap/llm", 5)
    biased = _op(workload_from_dict(_spec(llm={"qkv_bias": True})), "cap/llm", 5)
    extra = set(biased.export_full_state()) - set(plain.export_full_state())
    assert extra == {"llm.layers.0.self_attention.linear_qkv.bias"}
    assert all("linear_proj.bias" not in k and "fc1.bias" not in k for k in biased.export_full_state())
    qkv = biased.blocks[0].layers[0].self_attention.linear_qkv
    assert torch.count_nonzero(qkv.bias) > 0  # initialised like every other weight
    with_bias = biased([x], None)
    qkv.bias.zero_()
    assert _rel(biased([x], None), plain([x], None)) < 1e-6  # zero biases: the plain model
    assert _rel(with_bias - x, plain([x], None) - x) > 1e-2


@torch.no_grad()
def test_norm_epsilon_rotary_base_and_rope_scaling_per_module(base):
    x = torch.randn(2, 9, H, generator=torch.Generator().manual_seed(4))
    plain = _op(base, "cap/llm", 5)
    ref = plain([x], None)
    d = H // 4
    freqs = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    assert torch.allclose(plain.rotary.inv_freq, freqs)
    theta = _op(workload_from_dict(_spec(llm={"rotary_base": 500000.0})), "cap/llm", 5)
    assert torch.allclose(theta.rotary.inv_freq, 1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d)))
    assert _rel(theta([x], None) - x, ref - x) > 1e-3
    scaled = _op(workload_from_dict(_spec(llm={"rotary_base": 1e8, "rope_scaling_factor": 8.0})), "cap/llm")
    inv = scaled.rotary.inv_freq
    freqs = 1.0 / (1e8 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    low = 2 * torch.pi / freqs > 8192  # wavelengths beyond the original context: divided by the factor
    assert low.any() and torch.allclose(inv[low], freqs[low] / 8) and torch.allclose(inv[~low][:1], freqs[~low][:1])
    eps = _op(workload_from_dict(_spec(llm={"norm_epsilon": 0.5})), "cap/llm", 5)
    assert eps.blocks[0].layers[0].input_layernorm.eps == 0.5
    assert _rel(eps([x], None) - x, ref - x) > 1e-3
    lm = _op(workload_from_dict(_spec(llm={"norm_epsilon": 0.5})), "cap/llm.lm_head")
    assert lm.lm_head.final_norm.eps == 0.5
    head = _op(workload_from_dict(_spec(text={"norm_epsilon": 1e-6})), "vt/text.head")
    assert head.head.final_norm.eps == 1e-6
    assert _op(base, "vt/text.head").head.final_norm.eps == 1e-5  # ModelConfig default


# ------------------------------------------------------------------------------------------------ whole model


def test_every_option_trains_and_estimator_counts_its_parameters():
    """A workload using every option: the reference model runs each task, every new parameter gets a gradient, and
    the estimator's param_count equals the operators' parameters (the conv stem's position table aside, which the
    cost model leaves out as it does for every audio front end)."""
    workload = workload_from_dict(_spec(
        vision={"activation": "quick_gelu"}, **{"vision.frontend": {"pre_norm": True}},
        text={"head_pool": "eos", "eos_token_id": 1, "norm_epsilon": 1e-6},
        **{"audio.frontend": {"stem": "conv"}},
        llm={"qkv_bias": True, "rotary_base": 1e6, "rope_scaling_factor": 8.0, "norm_epsilon": 1e-6},
    ))
    ref = ReferenceModel(workload)
    losses = ref({t.name: mock_batch(workload, t.name, 0) for t in workload.tasks})
    assert all(torch.isfinite(v) for v in losses.values())
    ref.total_loss(losses).backward()
    grads = ref.export_full_grads()
    for name in ("vision.frontend.pre_norm.weight", "audio.frontend.conv1.weight", "audio.frontend.conv2.bias",
                 "llm.layers.0.self_attention.linear_qkv.bias"):
        assert grads[name].abs().sum() > 0, name
    model = AnalyticCostModel(workload, make_cluster(8, 8))
    params = ref.full_named_parameters()
    for unit in ("vision.frontend", "vision.layers.0", "text.head", "llm.layers.0", "llm.lm_head"):
        assert model.param_count(unit) == sum(p.numel() for k, p in params.items() if k.startswith(unit + ".")), unit
    audio = sum(p.numel() for k, p in params.items() if k.startswith("audio.frontend."))
    assert model.param_count("audio.frontend") == audio - 5 * H
    graph = build_metagraph(workload)
    fe = graph.metaops["at/audio.frontend"]
    assert model.forward_flops(fe) == 2.0 * 2 * 5 * (2 * 3 * 4 * H + 3 * H * H)


def test_default_options_keep_the_spec_and_digest(base):
    """Options at their defaults are left out of to_dict, so existing workloads keep their digests (plans and
    checkpoints are keyed by it); a set option is kept and changes the digest."""
    d = base.to_dict()
    assert set(d["modules"]["llm"]) == {
        "kind", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size", "num_query_groups", "frontend",
        "embed_dim", "input_size", "pool", "vocab_size", "causal", "cross_attention", "shared"}
    assert set(d["modules"]["vision"]["frontend"]) == {"type", "image_size", "patch_size", "in_channels",
                                                      "vocab_size", "class_token"}
    spec = copy.deepcopy(_spec(llm={"qkv_bias": True}, **{"audio.frontend": {"stem": "conv"}}))
    other = workload_from_dict(spec)
    assert other.digest() != base.digest()
    again = workload_from_dict(other.to_dict())
    assert again.digest() == other.digest() and again.modules["llm"].qkv_bias
    assert again.modules["audio"].frontend.stem == "conv"


def test_configs_do_not_trip_megatron_cores_deprecation_warnings():
    """Every rank builds a TransformerConfig per slice; megatron-core 0.16.1's default CUDA-graph scope ("full")
    is deprecated and warned on each. Ours name no deprecated value."""
    import warnings

    from megatron_spindle.models.config import (
        ModelConfig,
        lm_head_config,
        projector_config,
        transformer_config,
    )

    w = workload_from_dict({"name": "w", "modules": {
        "llm": {"kind": "llm", "num_layers": 1, "hidden_size": 16, "num_heads": 2, "ffn_hidden_size": 32,
                "frontend": {"type": "text", "vocab_size": 32}},
        "proj": {"kind": "projector", "input_size": 8, "hidden_size": 16}},
        "tasks": [{"name": "t", "batch_size": 1, "tokens": {"proj": 4, "llm": 4}, "flows": [["proj", "llm"]],
                   "loss": {"kind": "lm", "module": "llm"}}]})
    cfg = ModelConfig()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        transformer_config(w.modules["llm"], 1, 1, cfg)
        projector_config(w.modules["proj"], 1, cfg)
        lm_head_config(w.modules["llm"], 1, cfg)
