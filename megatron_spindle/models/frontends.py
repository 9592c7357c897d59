"""Front ends: raw task inputs -> the first layer's token sequence ``[batch, tokens, hidden]``.

patch: images -> non-overlapping patches, a linear projection (a Conv2d with stride = kernel, as a linear over
       flattened patches) + class token + learned positions
audio / imu: ``[in_channels, frames]`` -> non-overlapping windows of ``patch_size`` frames, a linear projection +
       learned positions
text:  token ids -> word embedding (megatron VocabParallelEmbedding) + learned positions for encoders; LLMs get
       positions from RoPE in their layers, so their text front end is the word embedding alone.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import VocabParallelEmbedding
from torch import nn

from megatron_spindle.graph.workload import FrontendSpec


class PatchFrontend(nn.Module):
    def __init__(self, fe: FrontendSpec, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.patch_size = fe.patch_size
        self.use_class_token = fe.class_token
        grid = fe.image_size // fe.patch_size
        num_positions = grid * grid + (1 if fe.class_token else 0)
        self.patch_proj = nn.Linear(fe.in_channels * fe.patch_size**2, hidden_size, dtype=dtype)
        if fe.class_token:
            self.class_token = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        self.position_embeddings = nn.Parameter(torch.zeros(num_positions, hidden_size, dtype=dtype))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        B, C, H, W = images.shape
        p = self.patch_size
        patches = images.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
        x = self.patch_proj(patches.reshape(B, (H // p) * (W // p), C * p * p))
        if self.use_class_token:
            x = torch.cat([self.class_token.expand(B, 1, -1), x], dim=1)
        return x + self.position_embeddings[: x.shape[1]]


class WindowFrontend(nn.Module):
    """Audio spectrogram patches and IMU windows: ``[B, in_channels, frames]`` -> ``[B, frames/patch_size, H]``."""

    def __init__(self, fe: FrontendSpec, hidden_size: int, max_tokens: int, dtype: torch.dtype):
        super().__init__()
        self.patch_size = fe.patch_size
        self.window_proj = nn.Linear(fe.in_channels * fe.patch_size, hidden_size, dtype=dtype)
        self.position_embeddings = nn.Parameter(torch.zeros(max_tokens, hidden_size, dtype=dtype))

    def forward(self, signal: torch.Tensor) -> torch.Tensor:
        B, C, T = signal.shape
        n = T // self.patch_size
        windows = signal[:, :, : n * self.patch_size].reshape(B, C, n, self.patch_size).permute(0, 2, 1, 3)
        x = self.window_proj(windows.reshape(B, n, C * self.patch_size))
        return x + self.position_embeddings[:n]


class TextFrontend(nn.Module):
    """Word embedding (vocab-parallel under TP), plus learned positions when ``max_tokens`` is given."""

    def __init__(self, fe: FrontendSpec, hidden_size: int, max_tokens: int | None, config, tp_group):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(
            fe.vocab_size, hidden_size, init_method=nn.init.zeros_, config=config, tp_group=tp_group
        )
        if max_tokens:
            self.position_embeddings = nn.Parameter(torch.zeros(max_tokens, hidden_size, dtype=config.params_dtype))
        else:
            self.position_embeddings = None

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(token_ids)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings[: x.shape[1]]
        return x
