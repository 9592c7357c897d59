"""tools/checkpoint: HF -> ours -> train -> HF for every architecture, exactly, and HF export from scratch.

Tiny CLIP (both towers), Whisper, Llama and Qwen2 models (random weights, tests/tools/hf_models.py) convert into
one workload, pretrain_multitask.py trains it for 3 iterations (every parameter moves: the patch bias, Whisper's key
biases and Qwen2's q/k/v biases included), and the trained checkpoint goes back to Hugging Face - over the
original folders and from scratch (config.json from the workload) - with no --allow-inexact. Each exported model,
reloaded with from_pretrained, computes what our trained operators compute (fp32, relative error <= 1e-5).
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

from hf_models import H, clip, decoder, whisper  # noqa: E402

import pretrain_multitask  # noqa: E402
from megatron_spindle.checkpointing import load_checkpoint  # noqa: E402
from megatron_spindle.data.mock import TaskBatch  # noqa: E402
from megatron_spindle.graph.workload import load_workload  # noqa: E402
from tools.checkpoint import convert  # noqa: E402
from tools.checkpoint.common import ConversionError  # noqa: E402

RTOL = 1e-5
_ENC = f"num_layers: 2, hidden_size: {H}, num_heads: 2, ffn_hidden_size: 64, embed_dim: 16"
_DEC = f"num_layers: 2, hidden_size: {H}, num_heads: 4, num_query_groups: 2, ffn_hidden_size: 48"
WORKLOAD = f"""
name: roundtrip
modules:
  vision: {{kind: encoder, {_ENC}, frontend: {{type: patch, image_size: 8, patch_size: 4, in_channels: 3, pre_norm: true}}}}
  text: {{kind: encoder, {_ENC}, causal: true, head_pool: eos, eos_token_id: 1, frontend: {{type: text, vocab_size: 50}}}}
  audio: {{kind: encoder, {_ENC}, frontend: {{type: audio, stem: conv, patch_size: 2, in_channels: 8}}}}
  vis_proj: {{kind: projector, input_size: {H}, hidden_size: {H}}}
  llm: {{kind: llm, {_DEC}, frontend: {{type: text, vocab_size: 64}}}}
  qwen: {{kind: llm, {_DEC}, qkv_bias: true, frontend: {{type: text, vocab_size: 64}}}}
tasks:
  - {{name: vision_text, batch_size: 2, tokens: {{vision: 5, text: 7}}, loss: {{kind: contrastive, modules: [vision, text]}}}}
  - {{name: audio_text, batch_size: 2, tokens: {{audio: 6, text: 7}}, loss: {{kind: contrastive, modules: [audio, text]}}}}
  - name: caption
    batch_size: 2
    tokens: {{vision: 5, vis_proj: 5, llm: 12}}
    flows: [[vision, vis_proj], [vis_proj, llm]]
    loss: {{kind: lm, module: llm}}
  - {{name: lm, batch_size: 2, tokens: {{qwen: 9}}, loss: {{kind: lm, module: qwen}}}}
"""


def _run(argv: list[str]) -> list[str]:
    args = convert.parse_args(argv)
    lines: list[str] = []
    args.log = lines.append
    convert.convert(args)
    return lines


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """HF folders -> spindle (exact) -> 3 training iterations -> the trained state in our operators."""
    from megatron_spindle.models.reference import ReferenceModel

    tmp = tmp_path_factory.mktemp("roundtrip")
    (tmp / "w.yaml").write_text(WORKLOAD)
    models = {"clip": clip(), "whisper": whisper(), "llama": decoder("llama"), "qwen2": decoder("qwen2", bias_seed=1)}
    for name, model in models.items():
        model.save_pretrained(tmp / name)
    mapping = (f"vision={tmp / 'clip'},text={tmp / 'clip'},audio={tmp / 'whisper'},llm={tmp / 'llama'},"
               f"qwen={tmp / 'qwen2'}")
    _run(["--loader", "hf", "--saver", "spindle", "--workload", str(tmp / "w.yaml"), "--mapping", mapping,
          "--save-dir", str(tmp / "init")])
    assert pretrain_multitask.main(["--workload", str(tmp / "w.yaml"), "--mock-data", "--mock-data-samples", "8",
                                    "--train-iters", "3", "--lr", "1e-3", "--spindle-planner", "wavefront",
                                    "--log-interval", "3", "--load", str(tmp / "init"), "--save",
                                    str(tmp / "run")]) == 0
    workload = load_workload(tmp / "w.yaml")
    state = {k: v for u in load_checkpoint(tmp / "run").units.values() for k, v in u.model.items()}
    init = {k: v for u in load_checkpoint(tmp / "init").units.values() for k, v in u.model.items()}
    ref = ReferenceModel(workload)
    ref.load_full_state(state)
    ref.eval()
    return {"tmp": tmp, "models": models, "mapping": mapping, "workload": workload, "ref": ref, "state": state,
            "init": init}


# ----------------------------------------------------------------------------------------------- our outputs

_IMAGES = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(5))
_FEATURES = torch.randn(2, 8, 12, generator=torch.Generator().manual_seed(8))
_IDS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(9))


def _text_ids() -> torch.Tensor:
    ids = torch.randint(2, 50, (2, 7), generator=torch.Generator().manual_seed(6))
    ids[0, 4] = ids[1, 2] = ids[1, 5] = 1  # EOS: the first one counts
    return ids


@torch.no_grad()
def _ours(ref, what: str) -> torch.Tensor:
    """vision / text: the contrastive embedding; audio: the tower's normalised tokens; llm / qwen: logits."""
    if what == "vision":
        x = ref.operator("vision_text/vision")([ref.operator("vision_text/vision.frontend").frontend(_IMAGES)], None)
        return ref.operator("vision_text/vision.head")([x], None)[:, 0]
    if what == "text":
        ids = _text_ids()
        x = ref.operator("vision_text/text")([ref.operator("vision_text/text.frontend").frontend(ids)], None)
        batch = TaskBatch("vision_text", inputs={"text": ids}, global_batch_size=2)
        return ref.operator("vision_text/text.head")([x], batch)[:, 0]
    if what == "audio":
        x = ref.operator("audio_text/audio")([ref.operator("audio_text/audio.frontend").frontend(_FEATURES)], None)
        return ref.operator("audio_text/audio.head").head.final_norm(x)
    task = {"llm": "caption", "qwen": "lm"}[what]
    x = ref.operator(f"{task}/{what}")([ref.operator(f"{task}/{what}.frontend").frontend(_IDS)], None)
    return ref.operator(f"{task}/{what}.lm_head").lm_head(x.transpose(0, 1).contiguous()).transpose(0, 1)


@torch.no_grad()
def _theirs(model, what: str) -> torch.Tensor:
    if what == "vision":
        vm = getattr(model, "vision_model", model)
        return model.visual_projection(vm(pixel_values=_IMAGES).pooler_output)
    if what == "text":
        tm = getattr(model, "text_model", model)
        return model.text_projection(tm(input_ids=_text_ids()).pooler_output)
    if what == "audio":
        enc = getattr(model, "encoder", model)
        return enc(input_features=_FEATURES).last_hidden_state
    return model(input_ids=_IDS).logits


# ----------------------------------------------------------------------------------------------- tests


def test_training_moved_the_parameters_hf_cannot_hold(trained):
    """The round trip below is only a test if training made the awkward tensors non-zero."""
    s, i = trained["state"], trained["init"]
    assert not i["vision.frontend.patch_proj.bias"].any() and s["vision.frontend.patch_proj.bias"].abs().min() > 0
    for name in ("vision.head.final_norm.weight", "qwen.layers.0.self_attention.linear_qkv.bias",
                 "audio.layers.0.self_attention.linear_qkv.bias", "llm.layers.1.mlp.linear_fc2.weight"):
        assert not torch.equal(s[name], i[name]), name


def test_trained_export_over_the_reference_folders_is_exact(trained, tmp_path):
    """spindle -> hf over the original folders, no --allow-inexact: the trained patch bias is folded into CLIP's
    position embeddings, Whisper's key bias is dropped exactly, the Whisper tower's contrastive projection (no place
    in Whisper) is only noted; every exported model computes what ours computes."""
    tmp = trained["tmp"]
    lines = _run(["--loader", "spindle", "--saver", "hf", "--workload", str(tmp / "w.yaml"), "--load-dir",
                  str(tmp / "run"), "--mapping", trained["mapping"], "--save-dir", str(tmp_path / "out")])
    assert not any("WARNING" in line for line in lines)
    assert any("patch_proj.bias folded" in line for line in lines)
    assert any("audio.head.projection.weight" in line and "not exported" in line for line in lines)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["audio", "llm", "qwen", "vision+text"]
    ref = trained["ref"]
    clip_back = transformers.CLIPModel.from_pretrained(out / "vision+text").eval()
    assert _rel(_ours(ref, "vision"), _theirs(clip_back, "vision")) <= RTOL
    assert _rel(_ours(ref, "text"), _theirs(clip_back, "text")) <= RTOL
    # CLIP's post_layernorm is our vision head's final norm: the trained values land there
    assert torch.equal(clip_back.state_dict()["vision_model.post_layernorm.weight"],
                       trained["state"]["vision.head.final_norm.weight"])
    whisper_back = transformers.WhisperModel.from_pretrained(out / "audio").eval()
    assert _rel(_ours(ref, "audio"), _theirs(whisper_back, "audio")) <= RTOL
    assert _rel(_ours(ref, "llm"), _theirs(transformers.LlamaForCausalLM.from_pretrained(out / "llm"), "llm")) <= RTOL
    qwen_back = transformers.Qwen2ForCausalLM.from_pretrained(out / "qwen")
    assert _rel(_ours(ref, "qwen"), _theirs(qwen_back, "qwen")) <= RTOL
    # the tensors we do not hold are the reference's (Whisper's decoder)
    w = "decoder.layers.0.fc1.weight"
    assert torch.equal(whisper_back.state_dict()[w], trained["models"]["whisper"].state_dict()[w])


def test_export_from_scratch_for_each_hf_class(trained, tmp_path):
    """No --mapping: every module with an HF class is written from scratch (config.json from the workload);
    CLIPVisionModelWithProjection, CLIPTextModelWithProjection, WhisperEncoder, LlamaForCausalLM and
    Qwen2ForCausalLM reload with from_pretrained and compute what ours computes."""
    tmp = trained["tmp"]
    lines = _run(["--loader", "spindle", "--saver", "hf", "--workload", str(tmp / "w.yaml"), "--load-dir",
                  str(tmp / "run"), "--save-dir", str(tmp_path / "out")])
    assert not any("WARNING" in line for line in lines)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["audio", "llm", "qwen", "text", "vision"]
    assert any("vis_proj.projector" in line and "not exported" in line for line in lines)
    classes = {m: json.loads((out / m / "config.json").read_text())["architectures"][0] for m in
               ("vision", "text", "audio", "llm", "qwen")}
    assert classes == {"vision": "CLIPVisionModelWithProjection", "text": "CLIPTextModelWithProjection",
                       "audio": "WhisperEncoder", "llm": "LlamaForCausalLM", "qwen": "Qwen2ForCausalLM"}
    ref = trained["ref"]
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    for module, hf_class in classes.items():
        cls = WhisperEncoder if hf_class == "WhisperEncoder" else getattr(transformers, hf_class)
        model = cls.from_pretrained(out / module).eval()
        assert _rel(_ours(ref, module), _theirs(model, module)) <= RTOL, module
    # the numerics options came through the config
    llm = json.loads((out / "llm" / "config.json").read_text())
    assert llm["rms_norm_eps"] == 1e-5 and llm["num_key_value_heads"] == 2 and not llm["tie_word_embeddings"]
    assert json.loads((out / "text" / "config.json").read_text())["eos_token_id"] == 1


def test_export_from_scratch_to_a_chosen_class(trained, tmp_path):
    """--mapping MODULE=CLASS picks the class: the vision tower without its projection (CLIPVisionModel: pooler
    output = our head's normalised class token), the Llama-shaped llm as Qwen2 (zero q/k/v biases), the Qwen2 module
    as a Llama with attention_bias; a mix of a reference folder and from-scratch targets."""
    tmp = trained["tmp"]
    _run(["--loader", "spindle", "--saver", "hf", "--workload", str(tmp / "w.yaml"), "--load-dir", str(tmp / "run"),
          "--mapping", f"vision=CLIPVisionModel,llm=Qwen2ForCausalLM,qwen=LlamaForCausalLM,audio={tmp / 'whisper'}",
          "--save-dir", str(tmp_path / "out")])
    out, ref = tmp_path / "out", trained["ref"]
    vision = transformers.CLIPVisionModel.from_pretrained(out / "vision").eval()
    with torch.no_grad():
        x = ref.operator("vision_text/vision")([ref.operator("vision_text/vision.frontend").frontend(_IMAGES)], None)
        ours = ref.operator("vision_text/vision.head").head.final_norm(x)[:, 0]
        assert _rel(ours, vision(pixel_values=_IMAGES).pooler_output) <= RTOL
    as_qwen = transformers.Qwen2ForCausalLM.from_pretrained(out / "llm")
    assert _rel(_ours(ref, "llm"), _theirs(as_qwen, "llm")) <= RTOL
    as_llama = transformers.LlamaForCausalLM.from_pretrained(out / "qwen")
    assert as_llama.config.attention_bias
    assert _rel(_ours(ref, "qwen"), _theirs(as_llama, "qwen")) <= RTOL
    assert (out / "audio").is_dir()


def test_inexact_export_lists_every_tensor_with_its_max_error(trained, tmp_path, capsys):
    """The trained Qwen2 module exported over a Llama folder without biases: refused, naming each layer's q/k/v bias
    and its max error, nothing written; --allow-inexact converts and prints the same list as warnings."""
    tmp = trained["tmp"]
    argv = ["--loader", "spindle", "--saver", "hf", "--workload", str(tmp / "w.yaml"), "--load-dir", str(tmp / "run"),
            "--mapping", f"qwen={tmp / 'llama'}", "--save-dir", str(tmp_path / "out"), "--quiet"]
    assert convert.main(argv) == 2
    err = capsys.readouterr().err
    for i in range(2):
        bias = trained["state"][f"qwen.layers.{i}.self_attention.linear_qkv.bias"]
        assert f"qwen.layers.{i}.self_attention.linear_qkv.bias: max error {float(bias.abs().max()):.3g}" in err
    assert "2 tensor(s)" in err and "--allow-inexact" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    lines = _run(argv + ["--allow-inexact"])
    assert sum(line.startswith("WARNING: inexact: qwen.layers.") for line in lines) == 2


def test_from_scratch_export_refuses_what_the_class_cannot_compute(trained, tmp_path):
    """A patch tower without `pre_norm`: CLIP always applies pre_layrnorm, so the export is refused, naming it."""
    w = WORKLOAD.replace(", pre_norm: true", "")
    (tmp_path / "w.yaml").write_text(w)
    from megatron_spindle.checkpointing import UnitState, save_checkpoint

    ck = load_checkpoint(trained["tmp"] / "run")
    units = {u: UnitState({k: v for k, v in s.model.items() if "pre_norm" not in k}) for u, s in ck.units.items()}
    save_checkpoint(tmp_path / "ckpt", 3, units)
    with pytest.raises(ConversionError, match="pre_layrnorm"):
        _run(["--loader", "spindle", "--saver", "hf", "--workload", str(tmp_path / "w.yaml"), "--load-dir",
              str(tmp_path / "ckpt"), "--mapping", "vision=auto", "--save-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_reimport_of_the_export_is_exact(trained, tmp_path):
    """The from-scratch export converts back in exactly (no --allow-inexact) and gives the same outputs: the folded
    patch bias stays in the positions, the weights are otherwise ours."""
    from megatron_spindle.models.reference import ReferenceModel

    tmp = trained["tmp"]
    _run(["--loader", "spindle", "--saver", "hf", "--workload", str(tmp / "w.yaml"), "--load-dir", str(tmp / "run"),
          "--save-dir", str(tmp_path / "hf")])
    mapping = ",".join(f"{m}={tmp_path / 'hf' / m}" for m in ("vision", "text", "audio", "llm", "qwen"))
    _run(["--loader", "hf", "--saver", "spindle", "--workload", str(tmp / "w.yaml"), "--mapping", mapping,
          "--save-dir", str(tmp_path / "back")])
    ref = ReferenceModel(trained["workload"])
    ref.load_full_state({k: v for u in load_checkpoint(tmp_path / "back").units.values() for k, v in u.model.items()})
    ref.eval()
    for what in ("vision", "text", "audio", "llm", "qwen"):
        assert _rel(_ours(ref, what), _ours(trained["ref"], what)) <= RTOL, what
    same = load_checkpoint(tmp_path / "back").units["llm.layers.1"].model
    for k, v in same.items():
        assert torch.equal(v, trained["state"][k]), k


# ----------------------------------------------------------------------------------------------- towers without a head

_VLM = f"""
name: vlm
modules:
  vision: {{kind: encoder, {_ENC.replace(', embed_dim: 16', '')}, frontend: {{type: patch, image_size: 8, patch_size: 4, in_channels: 3, pre_norm: true}}}}
  audio: {{kind: encoder, {_ENC.replace(', embed_dim: 16', '')}, frontend: {{type: audio, stem: conv, patch_size: 2, in_channels: 8}}}}
  vis_proj: {{kind: projector, input_size: {H}, hidden_size: {H}}}
  aud_proj: {{kind: projector, input_size: {H}, hidden_size: {H}}}
  llm: {{kind: llm, {_DEC}, frontend: {{type: text, vocab_size: 64}}}}
tasks:
  - name: caption
    batch_size: 2
    tokens: {{vision: 5, vis_proj: 5, llm: 12}}
    flows: [[vision, vis_proj], [vis_proj, llm]]
    loss: {{kind: lm, module: llm}}
  - name: asr
    batch_size: 2
    tokens: {{audio: 6, aud_proj: 6, llm: 12}}
    flows: [[audio, aud_proj], [aud_proj, llm]]
    loss: {{kind: lm, module: llm}}
"""


@torch.no_grad()
def test_tower_feeding_a_projector(trained, tmp_path):
    """A CLIP vision tower that only feeds a projector (no contrastive head): post_layernorm and the projection act
    only on CLIP's pooled output, so the conversion is exact without them (noted, not refused): the tower's tokens
    are CLIP's last_hidden_state. Exported from scratch it is a CLIPVisionModel (identity post_layernorm) with the
    same last_hidden_state. Whisper's final LayerNorm acts on every token: dropping it is refused, per tensor."""
    from megatron_spindle.models import build_operator, metaop_infos

    tmp = trained["tmp"]
    (tmp_path / "w.yaml").write_text(_VLM)
    lines = _run(["--loader", "hf", "--saver", "spindle", "--workload", str(tmp_path / "w.yaml"), "--mapping",
                  f"vision={tmp / 'clip'}", "--save-dir", str(tmp_path / "in")])
    assert any("post_layernorm" in line and "pooled output" in line for line in lines)
    workload = load_workload(tmp_path / "w.yaml")
    infos = metaop_infos(workload)
    state = {k: v for u in load_checkpoint(tmp_path / "in").units.values() for k, v in u.model.items()}
    ops = [build_operator(workload, infos[m], 0, infos[m].num_layers) for m in ("caption/vision.frontend",
                                                                                 "caption/vision")]
    for op in ops:
        op.load_full_state(state)
    ours = ops[1]([ops[0].frontend(_IMAGES)], None)
    hf = trained["models"]["clip"].vision_model
    assert _rel(ours, hf(pixel_values=_IMAGES).last_hidden_state) <= RTOL
    _run(["--loader", "spindle", "--saver", "hf", "--workload", str(tmp_path / "w.yaml"), "--load-dir",
          str(tmp_path / "in"), "--mapping", "vision=auto", "--save-dir", str(tmp_path / "out")])
    back = transformers.CLIPVisionModel.from_pretrained(tmp_path / "out" / "vision").eval()
    assert _rel(ours, back(pixel_values=_IMAGES).last_hidden_state) <= RTOL
    post = [v for k, v in back.state_dict().items() if k.endswith("post_layernorm.weight")]  # prefix: by version
    assert len(post) == 1 and torch.equal(post[0], torch.ones(H))
    with pytest.raises(ConversionError, match=r"encoder\.layer_norm\.weight"):
        _run(["--loader", "hf", "--saver", "spindle", "--workload", str(tmp_path / "w.yaml"), "--mapping",
              f"audio={tmp / 'whisper'}", "--save-dir", str(tmp_path / "refused")])
