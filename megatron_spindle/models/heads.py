"""Heads: the pooled contrastive head of an encoder tower and the LLM's LM head."""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear
from torch import nn


def eos_positions(token_ids: torch.Tensor, eos_token_id: int | None) -> torch.Tensor:
    """Per sample, the position of the EOS token in ``token_ids [B, T]``: the first position holding
    ``eos_token_id``, or with ``None`` the position of the largest id (original CLIP: EOS has the largest id of the
    vocabulary; argmax returns the first maximum). A sample without ``eos_token_id`` pools position 0 (as
    Hugging Face's CLIP does)."""
    if eos_token_id is None:
        return token_ids.argmax(dim=-1)
    return (token_ids == eos_token_id).int().argmax(dim=-1)


class PooledHead(nn.Module):
    """Final LayerNorm, pooling, linear projection to ``out_dim``. ``[B, S, H] -> [B, 1, out_dim]``.

    ``pool``: ``cls`` (position 0: the class token), ``mean`` (over tokens) or ``eos`` (the row given by
    ``forward(hidden, positions)``, see ``eos_positions``)."""

    def __init__(self, hidden_size: int, out_dim: int, pool: str, eps: float, dtype: torch.dtype):
        super().__init__()
        if pool not in ("cls", "mean", "eos"):
            raise ValueError(f"PooledHead: unknown pool {pool!r}")
        self.pool = pool
        self.final_norm = nn.LayerNorm(hidden_size, eps=eps, dtype=dtype)
        self.projection = nn.Linear(hidden_size, out_dim, bias=False, dtype=dtype)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.final_norm(hidden)
        if self.pool == "cls":
            pooled = hidden[:, 0]
        elif self.pool == "mean":
            pooled = hidden.mean(dim=1)
        else:
            if positions is None:
                raise ValueError("PooledHead(pool='eos') needs the EOS position of every sample")
            pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), positions.to(hidden.device)]
        return self.projection(pooled).unsqueeze(1)


class LMHead(nn.Module):
    """Final RMSNorm + output layer (megatron ColumnParallelLinear: vocabulary split over the TP group).
    ``[T, B, H] -> [T, B, V/tp]`` logits of this TP rank's vocabulary block."""

    def __init__(self, hidden_size: int, vocab_size: int, config, tp_group):
        super().__init__()
        self.final_norm = nn.RMSNorm(hidden_size, eps=config.layernorm_epsilon, dtype=config.params_dtype)
        self.output_layer = ColumnParallelLinear(
            hidden_size, vocab_size, config=config, init_method=nn.init.zeros_, bias=False, gather_output=False,
            tp_group=tp_group,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits, _ = self.output_layer(self.final_norm(hidden))
        return logits
