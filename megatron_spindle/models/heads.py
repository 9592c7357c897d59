"""Heads: the pooled contrastive head of an encoder tower and the LLM's LM head."""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear
from torch import nn


class PooledHead(nn.Module):
    """Final LayerNorm, pooling (class token at position 0, or the mean over tokens), linear projection to
    ``out_dim``. ``[B, S, H] -> [B, 1, out_dim]``."""

    def __init__(self, hidden_size: int, out_dim: int, pool_class_token: bool, eps: float, dtype: torch.dtype):
        super().__init__()
        self.pool_class_token = pool_class_token
        self.final_norm = nn.LayerNorm(hidden_size, eps=eps, dtype=dtype)
        self.projection = nn.Linear(hidden_size, out_dim, bias=False, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.final_norm(hidden)
        pooled = hidden[:, 0] if self.pool_class_token else hidden.mean(dim=1)
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
