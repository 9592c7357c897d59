"""tools/checkpoint/workload_from_hf.py: the modules section it writes converts HF checkpoints exactly, with no
hand edits; and the `patch_bias: false` option it uses for CLIP (layout, estimator, digest)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

transformers = pytest.importorskip("transformers")

from hf_models import clip, decoder, llama3, whisper  # noqa: E402

from megatron_spindle.checkpointing import load_checkpoint  # noqa: E402
from megatron_spindle.graph.workload import load_workload, workload_from_dict  # noqa: E402
from tools.checkpoint import convert, workload_from_hf  # noqa: E402

TASKS = """
  vis_proj: {kind: projector, input_size: 32, hidden_size: 32}
tasks:
  - {name: vision_text, batch_size: 2, tokens: {vision: 5, text: 7}, loss: {kind: contrastive, modules: [vision, text]}}
  - name: caption
    batch_size: 2
    tokens: {vision: 5, vis_proj: 5, llm: 12}
    flows: [[vision, vis_proj], [vis_proj, llm]]
    loss: {kind: lm, module: llm}
  - {name: audio_text, batch_size: 2, tokens: {audio: 6, text: 7}, loss: {kind: contrastive, modules: [audio, text]}}
  - {name: lm, batch_size: 2, tokens: {qwen: 9}, loss: {kind: lm, module: qwen}}
"""


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wfh")
    models = {"clip": clip("quick_gelu"), "whisper": whisper(), "llama3": llama3(32.0), "qwen2": decoder("qwen2", bias_seed=2)}
    for name, model in models.items():
        model.save_pretrained(tmp / name)
    return tmp, models


def test_generated_modules_convert_exactly(folders, tmp_path, capsys):
    tmp, models = folders
    mapping = f"vision={tmp / 'clip'},text={tmp / 'clip'},audio={tmp / 'whisper'},llm={tmp / 'llama3'},qwen={tmp / 'qwen2'}"
    out = tmp_path / "modules.yaml"
    assert workload_from_hf.main(["--mapping", mapping, "--out", str(out)]) == 0
    text = out.read_text()
    spec = yaml.safe_load(text)["modules"]
    assert spec["llm"]["norm_epsilon"] == 1e-6 and spec["llm"]["rotary_base"] == 500000.0
    assert spec["llm"]["rope_scaling_factor"] == 32.0 and spec["llm"]["activation"] == "silu"
    assert spec["qwen"]["qkv_bias"] is True
    assert spec["vision"]["activation"] == "quick_gelu" and spec["vision"]["embed_dim"] == 16
    assert spec["vision"]["frontend"] == {"type": "patch", "image_size": 8, "patch_size": 4, "in_channels": 3,
                                          "pre_norm": True, "patch_bias": False}
    assert spec["text"]["causal"] and spec["text"]["head_pool"] == "eos" and spec["text"]["eos_token_id"] == 1
    assert spec["audio"]["frontend"] == {"type": "audio", "stem": "conv", "patch_size": 2, "in_channels": 8}
    assert "# audio: whisper_encoder" in text and "tokens: at most 6" in text and "tokens: 5 in every task" in text
    assert "# no projection in the HF model: add embed_dim" in text
    # what a user adds: tasks, a projector, and (Whisper has no projection) the audio tower's embedding width
    text = text.replace("  audio:\n", "  audio:\n    embed_dim: 16\n", 1)
    (tmp_path / "w.yaml").write_text("name: from-hf\n" + text + TASKS)
    workload = load_workload(tmp_path / "w.yaml")
    args = convert.parse_args(["--loader", "hf", "--saver", "spindle", "--workload", str(tmp_path / "w.yaml"),
                               "--mapping", mapping, "--save-dir", str(tmp_path / "ckpt")])  # no --allow-inexact
    args.log = lambda s: None
    convert.convert(args)
    from megatron_spindle.models.reference import ReferenceModel

    ref = ReferenceModel(workload)
    ref.load_full_state({k: v for u in load_checkpoint(tmp_path / "ckpt").units.values() for k, v in u.model.items()})
    ref.eval()
    images = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        x = ref.operator("vision_text/vision")([ref.operator("vision_text/vision.frontend").frontend(images)], None)
        ours = ref.operator("vision_text/vision.head")([x], None)[:, 0]
        theirs = models["clip"].visual_projection(models["clip"].vision_model(pixel_values=images).pooler_output)
        assert float((ours - theirs).norm() / theirs.norm()) <= 1e-5
        x = ref.operator("caption/llm")([ref.operator("caption/llm.frontend").frontend(ids)], None)
        logits = ref.operator("caption/llm.lm_head").lm_head(x.transpose(0, 1).contiguous()).transpose(0, 1)
        theirs = models["llama3"](input_ids=ids).logits
        assert float((logits - theirs).norm() / theirs.norm()) <= 1e-5


def test_bad_input_writes_nothing(folders, tmp_path, capsys):
    tmp, _ = folders
    out = tmp_path / "m.yaml"
    assert workload_from_hf.main(["--mapping", f"vision={tmp / 'clip'}", "--out", str(out)]) == 2
    assert "--clip-tower" in capsys.readouterr().err and not out.exists()
    assert workload_from_hf.main(["--mapping", f"text={tmp / 'clip'}", "--clip-tower", "text=text",
                                  "--out", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["modules"]["text"]["frontend"]["type"] == "text"
    before = out.read_text()
    assert workload_from_hf.main(["--mapping", f"llm={tmp / 'llama3'}", "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err and out.read_text() == before
    assert workload_from_hf.main(["--mapping", f"llm={tmp_path}", "--out", str(tmp_path / "x.yaml")]) == 2
    assert "no config.json" in capsys.readouterr().err and not (tmp_path / "x.yaml").exists()


def test_patch_bias_option_layout_estimator_and_digest():
    """`patch_bias: false`: no bias tensor in the operator or the layout, the estimator counts h fewer parameters;
    at its default it is left out of to_dict (digests of existing workloads unchanged)."""
    from megatron_spindle.estimator.cost_model import AnalyticCostModel
    from megatron_spindle.graph.builtin import builtin_workload_path
    from megatron_spindle.graph.cluster import make_cluster
    from megatron_spindle.models import build_operator, metaop_infos
    from tools.checkpoint.layout import unit_shapes

    def spec(**fe):
        return {"name": "pb", "modules": {"vision": {
            "kind": "encoder", "num_layers": 1, "hidden_size": 16, "num_heads": 2, "ffn_hidden_size": 32,
            "frontend": {"type": "patch", "image_size": 8, "patch_size": 4, "in_channels": 3, **fe}}},
            "tasks": [{"name": "t", "batch_size": 2, "tokens": {"vision": 5}}]}

    base, nobias = workload_from_dict(spec()), workload_from_dict(spec(patch_bias=False))
    info = metaop_infos(nobias)["t/vision.frontend"]
    params = dict(build_operator(nobias, info, 0, 1).full_named_parameters())
    assert "vision.frontend.patch_proj.bias" not in params
    assert set(params) == set(unit_shapes(nobias, "vision.frontend"))
    cluster = make_cluster(8, 8)
    assert AnalyticCostModel(nobias, cluster).param_count("vision.frontend") == sum(p.numel() for p in params.values())
    assert AnalyticCostModel(base, cluster).param_count("vision.frontend") == \
        AnalyticCostModel(nobias, cluster).param_count("vision.frontend") + 16
    assert "patch_bias" not in base.to_dict()["modules"]["vision"]["frontend"]
    assert nobias.digest() != base.digest()
    for name in ("tiny-clip", "tiny-vlm"):
        w = load_workload(builtin_workload_path(name))
        assert all("patch_bias" not in (m.get("frontend") or {}) for m in w.to_dict()["modules"].values())
    with pytest.raises(ValueError, match="patch_bias is for patch front ends"):
        workload_from_dict({**spec(), "modules": {"t": {"kind": "encoder", "num_layers": 1, "hidden_size": 16,
                                                        "num_heads": 2, "ffn_hidden_size": 32, "frontend": {
                                                            "type": "text", "vocab_size": 9, "patch_bias": False}}},
                            "tasks": [{"name": "t", "batch_size": 2, "tokens": {"t": 5}}]})
