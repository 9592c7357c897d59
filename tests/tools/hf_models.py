"""Tiny Hugging Face models built from configs with random weights (no downloads), for the conversion tests.

Every parameter is perturbed, so norms and biases are not trivially 1 / 0. ``H`` is the width of every model.
"""

from __future__ import annotations

import torch
import transformers

H = 32


def perturb(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


def clip(act: str = "gelu"):
    vc = dict(hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=8,
              patch_size=4, num_channels=3, hidden_act=act)
    tc = dict(hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=50,
              max_position_embeddings=7, hidden_act=act, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    cfg = transformers.CLIPConfig(vision_config=vc, text_config=tc, projection_dim=16)
    torch.manual_seed(0)
    return perturb(transformers.CLIPModel(cfg), 1)


def whisper():
    cfg = transformers.WhisperConfig(d_model=H, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
                                     decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                     num_mel_bins=8, max_source_positions=6, vocab_size=60, pad_token_id=0,
                                     bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    torch.manual_seed(0)
    return perturb(transformers.WhisperModel(cfg), 2)


def decoder(family: str = "llama", tie: bool = False, bias_seed: int | None = None, seed: int = 3):
    """A Llama or Qwen2 decoder (GQA 4 heads / 2 groups); Qwen2's q/k/v biases are zero unless ``bias_seed``."""
    kw = dict(hidden_size=H, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=64, rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
    perturb(model, seed)
    if family == "qwen2":
        gen = torch.Generator().manual_seed(bias_seed or 0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_proj.bias"):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1 if bias_seed is not None else torch.zeros_like(p))
    return model


def llama3(factor: float = 8.0):
    """A Llama-3.x-style decoder: rope_theta 500000, llama3 RoPE scaling by ``factor``, rms_norm_eps 1e-6."""
    cfg = transformers.LlamaConfig(hidden_size=H, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, rms_norm_eps=1e-6, bos_token_id=0,
                                   eos_token_id=1, max_position_embeddings=131072, rope_theta=500000.0,
                                   rope_scaling={"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    torch.manual_seed(0)
    return perturb(transformers.LlamaForCausalLM(cfg), 4)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k
