"""Front ends: raw task inputs -> the first layer's token sequence ``[batch, tokens, hidden]``.

patch: images -> non-overlapping patches, a linear projection (a Conv2d with stride = kernel, as a linear over
       flattened patches; without a bias with ``patch_bias: false``, as CLIP's) + class token + learned positions
       (+ a LayerNorm with ``pre_norm``, CLIP's pre_layrnorm); a task's smaller images take the top-left corner of
       the position grid
audio / imu: ``[in_channels, frames]`` -> non-overlapping windows of ``patch_size`` frames, a linear projection +
       learned positions
audio with ``stem: conv`` (Whisper): conv1d(in_channels -> hidden, k3, pad 1) + GELU, conv1d(hidden -> hidden, k3,
       stride patch_size, pad 1) + GELU, + positions initialised to Whisper's sinusoids (``sinusoidal_positions``,
       trainable like every other parameter). ``frames // patch_size`` tokens, as the linear stem makes.
text:  token ids -> word embedding (megatron VocabParallelEmbedding) + learned positions for encoders; LLMs get
       positions from RoPE in their layers, so their text front end is the word embedding alone.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import VocabParallelEmbedding
from torch import nn
from torch.nn import functional as F

from megatron_spindle.graph.workload import FrontendSpec


class PatchFrontend(nn.Module):
    def __init__(self, fe: FrontendSpec, hidden_size: int, dtype: torch.dtype, eps: float = 1e-5):
        super().__init__()
        self.patch_size = fe.patch_size
        self.class_tokens = fe.class_tokens
        self.grid = fe.patch_grid
        num_positions = fe.patch_tokens
        self.patch_proj = nn.Linear(fe.in_channels * fe.patch_size**2, hidden_size, bias=fe.patch_bias, dtype=dtype)
        if fe.class_tokens:  # one slot is a [hidden] vector (CLIP's class_embedding), several a [len, hidden] table
            shape = (hidden_size,) if fe.class_tokens == 1 else (fe.class_tokens, hidden_size)
            self.class_token = nn.Parameter(torch.zeros(shape, dtype=dtype))
        self.position_embeddings = nn.Parameter(torch.zeros(num_positions, hidden_size, dtype=dtype))
        self.pre_norm = nn.LayerNorm(hidden_size, eps=eps, dtype=dtype) if fe.pre_norm else None

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        B, C, H, W = images.shape
        p = self.patch_size
        patches = images.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
        x = self.patch_proj(patches.reshape(B, (H // p) * (W // p), C * p * p))
        if self.class_tokens:
            x = torch.cat([self.class_token.view(self.class_tokens, -1).expand(B, -1, -1), x], dim=1)
        x = x + self._positions(H // p)
        return self.pre_norm(x) if self.pre_norm is not None else x

    def _positions(self, grid: int) -> torch.Tensor:
        """The learned positions of a ``grid`` x ``grid`` image: all of them at full size; for a smaller image
        (a task at a lower resolution) the top-left ``grid`` x ``grid`` of the full grid's, so that neighbouring
        patches keep neighbouring positions."""
        if grid == self.grid:
            return self.position_embeddings
        cls = self.class_tokens
        table = self.position_embeddings[cls:].view(self.grid, self.grid, -1)[:grid, :grid].reshape(grid * grid, -1)
        return torch.cat([self.position_embeddings[:cls], table]) if cls else table


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


class ConvStemFrontend(nn.Module):
    """Whisper's stem: ``[B, in_channels, frames]`` -> ``[B, frames // patch_size, H]`` (frames past a multiple of
    patch_size are dropped first, so the token count is the linear stem's)."""

    def __init__(self, fe: FrontendSpec, hidden_size: int, max_tokens: int, dtype: torch.dtype):
        super().__init__()
        self.patch_size = fe.patch_size
        self.conv1 = nn.Conv1d(fe.in_channels, hidden_size, kernel_size=3, padding=1, dtype=dtype)
        self.conv2 = nn.Conv1d(hidden_size, hidden_size, kernel_size=3, stride=fe.patch_size, padding=1, dtype=dtype)
        self.sinusoidal_positions = nn.Parameter(torch.zeros(max_tokens, hidden_size, dtype=dtype))

    def forward(self, signal: torch.Tensor) -> torch.Tensor:
        n = signal.shape[-1] // self.patch_size
        x = F.gelu(self.conv1(signal[..., : n * self.patch_size]))
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # [B, n, H]
        return x + self.sinusoidal_positions[:n]


class TextFrontend(nn.Module):
    """Word embedding (vocab-parallel under TP), plus learned positions when ``max_tokens`` is given, then dropout
    of ``config.hidden_dropout`` (megatron-core's LanguageModelEmbedding's)."""

    def __init__(self, fe: FrontendSpec, hidden_size: int, max_tokens: int | None, config, tp_group):
        super().__init__()
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)
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
        return self.embedding_dropout(x)
