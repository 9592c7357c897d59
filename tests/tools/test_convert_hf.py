"""tools/checkpoint: Hugging Face <-> megatron-spindle conversion against the real transformers implementations.

Tiny HF models are built from configs with random weights (every parameter perturbed, so norms and biases are not
trivially 1/0) and saved with save_pretrained. Each is converted into a megatron-spindle checkpoint for one
workload (CLIP vision + text towers, a Whisper encoder for audio, a Llama decoder for the LLM), loaded into our
operators (ReferenceModel), and the outputs are compared with the HF modules' on the same inputs (fp32, relative
error <= 1e-5). Then the checkpoint is converted back out over the original folders and reloaded with
from_pretrained: every weight is identical. The workload declares the module options that make the conversions
exact (CLIP: `pre_norm` on the patch front end, `head_pool: eos` on the text tower, `activation: quick_gelu` where
the checkpoint uses it; Whisper: the `conv` audio stem; Qwen2: `qkv_bias`), so the hf -> spindle conversion needs
no --allow-inexact; without an option the converter refuses, naming what differs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

transformers = pytest.importorskip("transformers")

from hf_models import H, llama3  # noqa: E402
from hf_models import clip as _clip  # noqa: E402
from hf_models import decoder as _decoder  # noqa: E402
from hf_models import same_weights as _assert_same_weights  # noqa: E402
from hf_models import whisper as _whisper  # noqa: E402

from megatron_spindle.checkpointing import load_checkpoint  # noqa: E402
from megatron_spindle.graph.workload import load_workload  # noqa: E402
from tools.checkpoint import convert  # noqa: E402
from tools.checkpoint.common import ConversionError  # noqa: E402
from tools.checkpoint.layout import expected_units  # noqa: E402

RTOL = 1e-5
WORKLOAD = f"""
name: convert-test
modules:
  vision:
    kind: encoder
    num_layers: 2
    hidden_size: {H}
    num_heads: 2
    ffn_hidden_size: 64
    embed_dim: 16
    frontend: {{type: patch, image_size: 8, patch_size: 4, in_channels: 3, pre_norm: true}}
  text:
    kind: encoder
    causal: true
    num_layers: 2
    hidden_size: {H}
    num_heads: 2
    ffn_hidden_size: 64
    embed_dim: 16
    head_pool: eos
    eos_token_id: 1
    frontend: {{type: text, vocab_size: 50}}
  audio:
    kind: encoder
    num_layers: 2
    hidden_size: {H}
    num_heads: 2
    ffn_hidden_size: 64
    embed_dim: 16
    frontend: {{type: audio, stem: conv, patch_size: 2, in_channels: 8}}
  vis_proj: {{kind: projector, input_size: {H}, hidden_size: {H}}}
  llm:
    kind: llm
    num_layers: 2
    hidden_size: {H}
    num_heads: 4
    num_query_groups: 2
    ffn_hidden_size: 48
    frontend: {{type: text, vocab_size: 64}}
tasks:
  - {{name: vision_text, batch_size: 2, tokens: {{vision: 5, text: 7}}, loss: {{kind: contrastive, modules: [vision, text]}}}}
  - {{name: audio_text, batch_size: 2, tokens: {{audio: 6, text: 7}}, loss: {{kind: contrastive, modules: [audio, text]}}}}
  - name: caption
    batch_size: 2
    tokens: {{vision: 5, vis_proj: 5, llm: 12}}
    flows: [[vision, vis_proj], [vis_proj, llm]]
    loss: {{kind: lm, module: llm}}
"""


def _run(argv: list[str]) -> str:
    args = convert.parse_args(argv)
    args.log = lambda s: None
    return convert.convert(args)


def _state(ckpt: Path) -> dict[str, torch.Tensor]:
    ck = load_checkpoint(ckpt)
    return {k: v for u in ck.units.values() for k, v in u.model.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """HF folders, the workload, one hf -> spindle conversion and the reference model holding its weights."""
    from megatron_spindle.models.reference import ReferenceModel

    tmp = tmp_path_factory.mktemp("convert")
    (tmp / "w.yaml").write_text(WORKLOAD)
    models = {"clip": _clip(), "whisper": _whisper(), "llama": _decoder()}
    for name, model in models.items():
        model.save_pretrained(tmp / name)
    mapping = f"vision={tmp / 'clip'},text={tmp / 'clip'},audio={tmp / 'whisper'},llm={tmp / 'llama'}"
    _run(["--loader", "hf", "--saver", "spindle", "--workload", str(tmp / "w.yaml"), "--mapping", mapping,
          "--save-dir", str(tmp / "spindle")])  # exact: no --allow-inexact
    workload = load_workload(tmp / "w.yaml")
    ref = ReferenceModel(workload)
    ref.load_full_state(_state(tmp / "spindle"))
    ref.eval()
    return {"tmp": tmp, "models": models, "mapping": mapping, "workload": workload, "ref": ref}


# ----------------------------------------------------------------------------------------------- layout


def test_layout_matches_the_operators(env):
    """tools/checkpoint/layout.py (names and shapes from the spec alone) equals the real operators' full state."""
    ref = env["ref"]
    have = {name: tuple(p.shape) for name, p in ref.full_named_parameters().items()}
    want = {name: shape for unit in expected_units(env["workload"]).values() for name, shape in unit.items()}
    assert want == have


# ----------------------------------------------------------------------------------------------- CLIP vision


@torch.no_grad()
def test_clip_vision_pieces_equal_hf(env):
    hf, ref = env["models"]["clip"], env["ref"]
    images = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    vm = hf.vision_model
    emb = ref.operator("vision_text/vision.frontend").frontend(images)  # pre_norm: true
    x = vm.pre_layrnorm(vm.embeddings(images))
    assert _rel(emb, x) <= RTOL
    ours = ref.operator("vision_text/vision")([x], None)
    theirs = vm.encoder(inputs_embeds=x).last_hidden_state
    assert _rel(ours, theirs) <= RTOL
    head = ref.operator("vision_text/vision.head")([theirs], None)[:, 0]
    assert _rel(head, hf.visual_projection(vm.post_layernorm(theirs[:, 0]))) <= RTOL


@torch.no_grad()
def test_clip_vision_tower_equals_hf(env):
    """Front end with `pre_norm: true` (CLIP's pre_layrnorm), layers, class-token head: CLIP's image embedding."""
    hf, ref = env["models"]["clip"], env["ref"]
    images = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    x = ref.operator("vision_text/vision.frontend").frontend(images)
    x = ref.operator("vision_text/vision")([x], None)
    ours = ref.operator("vision_text/vision.head")([x], None)[:, 0]
    theirs = hf.visual_projection(hf.vision_model(pixel_values=images).pooler_output)
    assert _rel(ours, theirs) <= RTOL


@torch.no_grad()
def test_clip_quick_gelu_layers_equal_hf(env, tmp_path):
    """A quick_gelu CLIP converts exactly into a module declaring `activation: quick_gelu`; the gelu workload
    refuses it (naming the option)."""
    hf = _clip(act="quick_gelu")
    hf.save_pretrained(tmp_path / "clip")
    with pytest.raises(ConversionError, match="declare `activation: quick_gelu`"):
        _run(["--loader", "hf", "--saver", "spindle", "--workload", str(env["tmp"] / "w.yaml"), "--mapping",
              f"vision={tmp_path / 'clip'}", "--save-dir", str(tmp_path / "refused")])
    (tmp_path / "w.yaml").write_text(WORKLOAD.replace("    embed_dim: 16\n    frontend: {type: patch",
                                                      "    embed_dim: 16\n    activation: quick_gelu\n"
                                                      "    frontend: {type: patch", 1))
    workload = load_workload(tmp_path / "w.yaml")
    assert workload.modules["vision"].activation == "quick_gelu"
    _run(["--loader", "hf", "--saver", "spindle", "--workload", str(tmp_path / "w.yaml"), "--mapping",
          f"vision={tmp_path / 'clip'}", "--save-dir", str(tmp_path / "out")])
    from megatron_spindle.models import build_operator, metaop_infos

    info = metaop_infos(workload)["vision_text/vision"]
    op = build_operator(workload, info, 0, info.num_layers)
    op.load_full_state(_state(tmp_path / "out"), strict=True)
    x = torch.randn(2, 5, H)
    assert _rel(op([x], None), hf.vision_model.encoder(inputs_embeds=x).last_hidden_state) <= RTOL


# ----------------------------------------------------------------------------------------------- CLIP text


@torch.no_grad()
def test_clip_text_tower_hidden_states_equal_hf(env):
    """Front end (tokens + learned positions), causal layers and the final LayerNorm equal CLIPTextModel's
    last_hidden_state."""
    hf, ref = env["models"]["clip"], env["ref"]
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(6))
    x = ref.operator("vision_text/text.frontend").frontend(ids)
    x = ref.operator("vision_text/text")([x], None)
    ours = ref.operator("vision_text/text.head").head.final_norm(x)
    assert _rel(ours, hf.text_model(input_ids=ids).last_hidden_state) <= RTOL


@torch.no_grad()
def test_clip_text_embedding_equals_hf(env):
    """`head_pool: eos, eos_token_id: 1`: the head pools the first EOS token's row, as CLIPTextModel does."""
    from megatron_spindle.data.mock import TaskBatch

    hf, ref = env["models"]["clip"], env["ref"]
    ids = torch.randint(2, 50, (2, 7), generator=torch.Generator().manual_seed(6))
    ids[0, 4] = ids[1, 2] = ids[1, 5] = 1  # EOS (sample 1: the first one counts)
    x = ref.operator("vision_text/text.frontend").frontend(ids)
    x = ref.operator("vision_text/text")([x], None)
    batch = TaskBatch("vision_text", inputs={"text": ids}, global_batch_size=2)
    ours = ref.operator("vision_text/text.head")([x], batch)[:, 0]
    assert _rel(ours, hf.text_projection(hf.text_model(input_ids=ids).pooler_output)) <= RTOL


# ----------------------------------------------------------------------------------------------- Whisper


@torch.no_grad()
def test_whisper_encoder_layers_equal_hf(env):
    enc, ref = env["models"]["whisper"].encoder, env["ref"]
    x = torch.randn(2, 6, H, generator=torch.Generator().manual_seed(7))
    theirs = x
    for layer in enc.layers:
        theirs = layer(theirs, None)
    ours = ref.operator("audio_text/audio")([x], None)
    assert _rel(ours, theirs) <= RTOL
    final = ref.operator("audio_text/audio.head").head.final_norm(ours)
    assert _rel(final, enc.layer_norm(theirs)) <= RTOL


@torch.no_grad()
def test_whisper_encoder_equals_hf(env):
    """`stem: conv, patch_size: 2`: 12 frames -> 6 tokens through Whisper's conv stem and position table."""
    enc, ref = env["models"]["whisper"].encoder, env["ref"]
    features = torch.randn(2, 8, 12, generator=torch.Generator().manual_seed(8))
    x = ref.operator("audio_text/audio.frontend").frontend(features)
    x = ref.operator("audio_text/audio")([x], None)
    ours = ref.operator("audio_text/audio.head").head.final_norm(x)
    assert _rel(ours, enc(input_features=features).last_hidden_state) <= RTOL


# ----------------------------------------------------------------------------------------------- decoders


@torch.no_grad()
def _our_logits(ref_or_state, workload, ids: torch.Tensor) -> torch.Tensor:
    from megatron_spindle.models import build_operator, metaop_infos

    infos = metaop_infos(workload)
    ops = [build_operator(workload, infos[m], 0, infos[m].num_layers) for m in
           ("caption/llm.frontend", "caption/llm", "caption/llm.lm_head")]
    for op in ops:
        op.load_full_state(ref_or_state, strict=True)
    x = ops[1]([ops[0].frontend(ids)], None)
    return ops[2].lm_head(x.transpose(0, 1).contiguous()).transpose(0, 1)


@torch.no_grad()
def test_llama_logits_equal_hf(env):
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(9))
    ours = _our_logits(_state(env["tmp"] / "spindle"), env["workload"], ids)
    assert _rel(ours, env["models"]["llama"](input_ids=ids).logits) <= RTOL


def _decoder_roundtrip(env, tmp_path, model, allow_inexact=False):
    model.save_pretrained(tmp_path / "hf")
    extra = ["--allow-inexact"] if allow_inexact else []
    _run(["--loader", "hf", "--saver", "spindle", "--workload", str(env["tmp"] / "w.yaml"), "--mapping",
          f"llm={tmp_path / 'hf'}", "--save-dir", str(tmp_path / "spindle")] + extra)
    return _state(tmp_path / "spindle")


@pytest.mark.parametrize("family,tie", [("qwen2", False), ("llama", True)])
@torch.no_grad()
def test_decoder_variants_equal_hf_and_round_trip(env, tmp_path, family, tie):
    """Qwen2 (zero q/k/v biases) and a Llama with tied embeddings: same logits, and back out identical."""
    model = _decoder(family, tie=tie)
    state = _decoder_roundtrip(env, tmp_path, model)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(9))
    assert _rel(_our_logits(state, env["workload"], ids), model(input_ids=ids).logits) <= RTOL
    _run(["--loader", "spindle", "--saver", "hf", "--workload", str(env["tmp"] / "w.yaml"), "--load-dir",
          str(tmp_path / "spindle"), "--mapping", f"llm={tmp_path / 'hf'}", "--save-dir", str(tmp_path / "back")])
    cls = type(model)
    back = cls.from_pretrained(tmp_path / "back" / "llm")
    assert back.config.tie_word_embeddings == tie
    _assert_same_weights(model, back)


def test_qwen2_nonzero_bias_is_refused(env, tmp_path):
    model = _decoder("qwen2", bias_seed=1)
    model.save_pretrained(tmp_path / "hf")
    with pytest.raises(ConversionError, match=r"q_proj\.bias is non-zero"):
        _run(["--loader", "hf", "--saver", "spindle", "--workload", str(env["tmp"] / "w.yaml"), "--mapping",
              f"llm={tmp_path / 'hf'}", "--save-dir", str(tmp_path / "spindle")])
    assert not (tmp_path / "spindle").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


@torch.no_grad()
def test_qwen2_with_biases_equals_hf(env, tmp_path):
    """`qkv_bias: true` (megatron add_qkv_bias): Qwen2 with non-zero q/k/v biases converts exactly, gives the same
    logits, and exports back identical."""
    model = _decoder("qwen2", bias_seed=1)
    (tmp_path / "w.yaml").write_text(WORKLOAD.replace("    num_query_groups: 2\n",
                                                      "    num_query_groups: 2\n    qkv_bias: true\n", 1))
    workload = load_workload(tmp_path / "w.yaml")
    assert workload.modules["llm"].qkv_bias
    model.save_pretrained(tmp_path / "hf")
    _run(["--loader", "hf", "--saver", "spindle", "--workload", str(tmp_path / "w.yaml"), "--mapping",
          f"llm={tmp_path / 'hf'}", "--save-dir", str(tmp_path / "spindle")])
    state = _state(tmp_path / "spindle")
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(9))
    assert _rel(_our_logits(state, workload, ids), model(input_ids=ids).logits) <= RTOL
    _run(["--loader", "spindle", "--saver", "hf", "--workload", str(tmp_path / "w.yaml"), "--load-dir",
          str(tmp_path / "spindle"), "--mapping", f"llm={tmp_path / 'hf'}", "--save-dir", str(tmp_path / "back")])
    _assert_same_weights(model, transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "back" / "llm"))


# ----------------------------------------------------------------------------------------------- round trip


def test_round_trip_back_to_hf_is_identical(env, tmp_path):
    """spindle -> hf over the original folders: CLIP (both towers into one folder), Whisper and Llama reload with
    from_pretrained and every weight equals the original's."""
    tmp = env["tmp"]
    _run(["--loader", "spindle", "--saver", "hf", "--workload", str(tmp / "w.yaml"), "--load-dir",
          str(tmp / "spindle"), "--mapping", env["mapping"], "--save-dir", str(tmp_path / "out")])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["audio", "llm", "vision+text"]
    models = env["models"]
    _assert_same_weights(models["clip"], transformers.CLIPModel.from_pretrained(tmp_path / "out" / "vision+text"))
    _assert_same_weights(models["whisper"], transformers.WhisperModel.from_pretrained(tmp_path / "out" / "audio"))
    _assert_same_weights(models["llama"], transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out" / "llm"))


def test_export_of_changed_weights_lands_in_hf(env, tmp_path):
    """A trained (here: edited) checkpoint exports its own weights, not the base's."""
    tmp = env["tmp"]
    from megatron_spindle.checkpointing import UnitState, save_checkpoint

    ck = load_checkpoint(tmp / "spindle")
    units = {u: UnitState({k: v + 0.5 for k, v in s.model.items()}) for u, s in ck.units.items()
             if u.startswith("llm.layers.1")}
    units.update({u: s for u, s in ck.units.items() if not u.startswith("llm.layers.1")})
    save_checkpoint(tmp_path / "edited", 7, units)
    _run(["--loader", "spindle", "--saver", "hf", "--workload", str(tmp / "w.yaml"), "--load-dir",
          str(tmp_path / "edited"), "--mapping", f"llm={tmp / 'llama'}", "--save-dir", str(tmp_path / "out")])
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out" / "llm")
    orig = env["models"]["llama"]
    w = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(back.state_dict()[w], orig.state_dict()[w] + 0.5)
    w0 = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(back.state_dict()[w0], orig.state_dict()[w0])


# ----------------------------------------------------------------------------------------------- bad input


def test_inexact_conversion_is_refused_by_default(env, tmp_path):
    """Without `pre_norm` on the patch front end CLIP's pre_layrnorm has no place: refused, nothing written."""
    (tmp_path / "w.yaml").write_text(WORKLOAD.replace(", pre_norm: true", ""))
    with pytest.raises(ConversionError, match="pre_layrnorm"):
        _run(["--loader", "hf", "--saver", "spindle", "--workload", str(tmp_path / "w.yaml"), "--mapping",
              f"vision={env['tmp'] / 'clip'}", "--save-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_shape_mismatch_names_tensor_and_shapes_and_writes_nothing(env, tmp_path, capsys):
    """A workload whose LLM vocabulary differs from the checkpoint's: exit 2, the tensor and both shapes named,
    no output folder and no temporary left behind."""
    (tmp_path / "w.yaml").write_text(WORKLOAD.replace("vocab_size: 64", "vocab_size: 80"))
    out = tmp_path / "out"
    rc = convert.main(["--loader", "hf", "--saver", "spindle", "--workload", str(tmp_path / "w.yaml"), "--mapping",
                       f"llm={env['tmp'] / 'llama'}", "--save-dir", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "llm.frontend.word_embeddings.weight" in err and "(64, 32)" in err and "(80, 32)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.yaml"]


def test_spindle_checkpoint_for_another_workload_is_refused(env, tmp_path, capsys):
    (tmp_path / "w.yaml").write_text(WORKLOAD.replace("ffn_hidden_size: 48", "ffn_hidden_size: 40"))
    rc = convert.main(["--loader", "spindle", "--saver", "spindle", "--workload", str(tmp_path / "w.yaml"),
                       "--load-dir", str(env["tmp"] / "spindle"), "--save-dir", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "llm.layers.0.mlp.linear_fc1.weight" in err and "(96, 32)" in err and "(80, 32)" in err
    assert not (tmp_path / "out").exists()


def test_converted_checkpoint_metadata_and_filled_units(env):
    """The spindle saver writes every unit of the workload (the projector, absent from every HF model, gets the
    deterministic initialisation the training run would use) and records where the weights came from."""
    from megatron_spindle.models import build_operator, metaop_infos

    ck = load_checkpoint(env["tmp"] / "spindle")
    assert set(ck.units) == set(expected_units(env["workload"]))
    assert ck.iteration == 0
    assert ck.metadata["workload_digest"] == env["workload"].digest()
    assert ck.metadata["extra"]["converted_from"].startswith("hf:")
    info = metaop_infos(env["workload"])["caption/vis_proj"]
    fresh = build_operator(env["workload"], info, 0, 1).export_full_state()
    for k, v in fresh.items():
        assert torch.equal(ck.units["vis_proj.projector"].model[k], v), k


def test_inspect_prints_units_shapes_iteration_and_plan(env, capsys):
    from tools.checkpoint import inspect_checkpoint as inspect_tool

    assert inspect_tool.main([str(env["tmp"] / "spindle")]) == 0
    out = capsys.readouterr().out
    assert "iteration: 0" in out
    assert "llm.layers.1" in out and "self_attention.linear_qkv.weight" in out and "(64, 32)" in out
    assert "float32" in out and "plan: none" in out
    assert "converted_from" in out
    assert inspect_tool.main([str(env["tmp"] / "llama")]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.self_attn.q_proj.weight" in out and "llama" in out
    json.loads(json.dumps(out))


def test_command_line_progress_and_inspect(env, tmp_path, capsys):
    """convert.main prints one progress line per unit; inspect_checkpoint.py runs as users run it (a script from
    another folder, importing its siblings as the package tools.checkpoint)."""
    import re
    import subprocess

    tmp = env["tmp"]
    assert convert.main(["--loader", "hf", "--saver", "spindle", "--workload", str(tmp / "w.yaml"), "--mapping",
                         f"llm={tmp / 'llama'}", "--save-dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    lines = re.findall(r"^\[\s*(\d+)/4\] (\S+): ", out, flags=re.M)
    assert [unit for _, unit in lines] == ["llm.frontend", "llm.layers.0", "llm.layers.1", "llm.lm_head"]
    assert "initialised 13 unit(s) the source does not have" in out
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "checkpoint" / "inspect_checkpoint.py"),
                        str(tmp_path / "out"), "--summary"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "iteration: 0" in r.stdout and "llm.lm_head" in r.stdout


def test_transformer_engine_names_and_mapping_file(env, tmp_path):
    """--layer-names te writes Transformer Engine spellings (fused pre-norms) that the spindle loader and the
    runtime's checkpoint reader read back (as the local spec's names); the mapping may come from a file; the round
    trip is still exact."""
    tmp = env["tmp"]
    (tmp_path / "map.txt").write_text(f"# module: HF folder\nllm: {tmp / 'llama'}\n")
    _run(["--loader", "hf", "--saver", "spindle", "--workload", str(tmp / "w.yaml"), "--mapping",
          str(tmp_path / "map.txt"), "--save-dir", str(tmp_path / "te"), "--layer-names", "te"])
    ckpt = next(p for p in (tmp_path / "te").iterdir() if (p / "metadata.json").is_file())
    names = set(json.loads((ckpt / "metadata.json").read_text())["units"]["llm.layers.0"]["tensors"])  # the files'
    assert "llm.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "llm.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in names)
    read = set(load_checkpoint(tmp_path / "te").units["llm.layers.0"].model)
    assert "llm.layers.0.input_layernorm.weight" in read and not any("layer_norm_weight" in n for n in read)
    _run(["--loader", "spindle", "--saver", "hf", "--workload", str(tmp / "w.yaml"), "--load-dir",
          str(tmp_path / "te"), "--mapping", str(tmp_path / "map.txt"), "--save-dir", str(tmp_path / "back")])
    _assert_same_weights(env["models"]["llama"],
                         transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back" / "llm"))


@torch.no_grad()
def test_whisper_key_bias_is_dropped_exactly(env, tmp_path):
    """Whisper's k_proj has no bias; a non-zero key bias in our layers (training moves it) is dropped on export
    and the exported encoder still computes what our layers compute (softmax ignores a per-query constant)."""
    from megatron_spindle.checkpointing import UnitState, save_checkpoint
    from megatron_spindle.models import build_operator, metaop_infos
    from tools.checkpoint.hf_mapping import fuse_qkv, split_qkv

    tmp = env["tmp"]
    ck = load_checkpoint(tmp / "spindle")
    units = dict(ck.units)
    for i in range(2):
        name = f"audio.layers.{i}.self_attention.linear_qkv.bias"
        model = dict(units[f"audio.layers.{i}"].model)
        q, k, v = split_qkv(model[name], 2, 2)
        model[name] = fuse_qkv(q, k + torch.randn(k.shape) * 0.5, v, 2, 2)
        units[f"audio.layers.{i}"] = UnitState(model)
    save_checkpoint(tmp_path / "edited", 1, units)
    _run(["--loader", "spindle", "--saver", "hf", "--workload", str(tmp / "w.yaml"), "--load-dir",
          str(tmp_path / "edited"), "--mapping", f"audio={tmp / 'whisper'}", "--save-dir", str(tmp_path / "out")])
    enc = transformers.WhisperModel.from_pretrained(tmp_path / "out" / "audio").encoder.eval()
    info = metaop_infos(env["workload"])["audio_text/audio"]
    op = build_operator(env["workload"], info, 0, info.num_layers)
    op.load_full_state(_state(tmp_path / "edited"))
    x = torch.randn(2, 6, H, generator=torch.Generator().manual_seed(12))
    theirs = x
    for layer in enc.layers:
        theirs = layer(theirs, None)
    assert _rel(op([x], None), theirs) <= RTOL


@torch.no_grad()
def test_llama3_rope_and_norm_epsilon_options(env, tmp_path):
    """A Llama-3.1-style decoder (rope_theta 500000, llama3 RoPE scaling, rms_norm_eps 1e-6): the default workload
    refuses it naming the options; declaring `rotary_base`, `rope_scaling_factor` and `norm_epsilon` converts it
    exactly (the scaled, smoothed and unscaled RoPE frequency bands all occur at head_dim 8)."""
    model = llama3(8.0)
    model.save_pretrained(tmp_path / "hf")
    with pytest.raises(ConversionError, match=r"declare `norm_epsilon: 1e-06`"):
        _decoder_roundtrip(env, tmp_path, model)
    from tools.checkpoint.hf_io import HFFolder
    from tools.checkpoint.hf_mapping import find_tower, numerics_notes

    tower = find_tower(HFFolder(tmp_path / "hf"), "llm", "text")
    notes = " | ".join(numerics_notes(tower, env["workload"].modules["llm"]))
    assert "declare `rotary_base: 500000.0`" in notes and "declare `rope_scaling_factor: 8.0`" in notes
    (tmp_path / "w.yaml").write_text(WORKLOAD.replace(
        "    num_query_groups: 2\n",
        "    num_query_groups: 2\n    rotary_base: 500000.0\n    rope_scaling_factor: 8.0\n    norm_epsilon: 1.0e-6\n",
        1))
    workload = load_workload(tmp_path / "w.yaml")
    _run(["--loader", "hf", "--saver", "spindle", "--workload", str(tmp_path / "w.yaml"), "--mapping",
          f"llm={tmp_path / 'hf'}", "--save-dir", str(tmp_path / "spindle")])
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(9))
    ours = _our_logits(_state(tmp_path / "spindle"), workload, ids)
    assert _rel(ours, model(input_ids=ids).logits) <= RTOL


def test_inspect_names_the_plans_devices_and_schema_version():
    """The plan line reads the plan JSON's own fields: devices from its cluster, its schema version (they printed
    '?' for fields plans do not have)."""
    from megatron_spindle.graph.cluster import make_cluster
    from megatron_spindle.graph.workload import load_workload
    from megatron_spindle.plan.io import plan_to_dict
    from megatron_spindle.planner.pipeline import PlannerConfig, make_plan
    from tools.checkpoint.inspect_checkpoint import _plan_line

    plan = make_plan(load_workload("tiny-clip"), make_cluster(4, 2, "CPU"), PlannerConfig(planner="wavefront"))
    line = _plan_line(plan_to_dict(plan))
    assert line == (f"plan: workload 'tiny-clip', 4 devices (CPU), {len(plan.waves)} waves, {len(plan.slices())} "
                    f"slices, schema version 2")
