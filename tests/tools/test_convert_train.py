"""End to end: a Hugging Face Llama converted into tiny-vlm's LLM backbone starts pretrain_multitask.py --load.

The converted checkpoint (HF weights for the llm units, the deterministic initialisation for the towers and
projectors, start-of-data position, no optimizer state) loads into the runtime engine under a fresh plan, and
after one AdamW step the saved LLM weights are within one learning-rate step of the HF weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

transformers = pytest.importorskip("transformers")

import pretrain_multitask  # noqa: E402
from megatron_spindle.checkpointing import load_checkpoint  # noqa: E402
from tools.checkpoint import convert  # noqa: E402

LR = 1e-3


def test_converted_llama_starts_training(tmp_path, capsys):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, rms_norm_eps=1e-5, bos_token_id=0,
                                   eos_token_id=1)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg)
    hf.save_pretrained(tmp_path / "llama")
    assert convert.main(["--loader", "hf", "--saver", "spindle", "--workload", "tiny-vlm", "--mapping",
                         f"llm={tmp_path / 'llama'}", "--save-dir", str(tmp_path / "init"), "--quiet"]) == 0
    hist: list = []
    rc = pretrain_multitask.main(["--workload", "tiny-vlm", "--mock-data", "--mock-data-samples", "16",
                                  "--train-iters", "1", "--lr", str(LR), "--spindle-planner", "wavefront",
                                  "--log-interval", "1", "--load", str(tmp_path / "init"), "--save",
                                  str(tmp_path / "run")], history=hist)
    assert rc == 0 and [h.iteration for h in hist] == [1]
    assert "loaded checkpoint" in capsys.readouterr().out
    trained = {k: v for u in load_checkpoint(tmp_path / "run").units.values() for k, v in u.model.items()}
    w_hf = hf.state_dict()["model.layers.2.mlp.down_proj.weight"]
    w = trained["llm.layers.2.mlp.linear_fc2.weight"]
    assert float((w - w_hf).abs().max()) <= 1.5 * LR  # one AdamW step away from the HF weight
    assert float((w - w_hf).abs().max()) > 0
    emb = trained["llm.frontend.word_embeddings.weight"]
    assert float((emb - hf.state_dict()["model.embed_tokens.weight"]).abs().max()) <= 1.5 * LR
