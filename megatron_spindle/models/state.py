"""Full (TP-unsharded) parameter tensors: deterministic initialisation, sharding and gathering.

Full tensors are named ``"<unit>.<submodule path>"`` (e.g. ``"vision.layers.3.self_attention.linear_qkv.weight"``)
in megatron-core's local-spec spelling, whichever spec a layer is built on (checkpointing/names.py).
megatron-core marks tensor-parallel parameters with ``tensor_model_parallel``, ``partition_dim`` and
``partition_stride``:

- column-parallel weights and biases (``linear_qkv``, ``linear_fc1``, the LM ``output_layer``) and vocab-parallel
  embeddings are sharded along dim 0; row-parallel weights (``linear_proj``, ``linear_fc2``) along dim 1;
  row-parallel biases and norms are replicated;
- ``linear_qkv`` is laid out by query group (``[q heads of group 0, k, v, q heads of group 1, k, v, ...]``) so a TP
  shard is a contiguous block of dim 0 and the TP=1 tensor is the concatenation of the shards;
- SwiGLU ``linear_fc1`` has stride 2: the full tensor is ``[gate; up]`` and TP rank r holds
  ``[gate_r; up_r]`` (chunks r and r+tp of the 2*tp chunks of dim 0).
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.distributed as dist

from megatron_spindle.compat.groups import group_size


def _is_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def _dim_stride(param: torch.Tensor) -> tuple[int, int]:
    return int(getattr(param, "partition_dim", 0)), int(getattr(param, "partition_stride", 1))


def full_shape(param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    shape = list(param.shape)
    if _is_sharded(param):
        dim, _ = _dim_stride(param)
        shape[dim] *= tp_size
    return tuple(shape)


def shard_full_tensor(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's part of a full tensor, laid out as ``param``."""
    if not _is_sharded(param) or tp_size == 1:
        return full
    dim, stride = _dim_stride(param)
    chunks = torch.chunk(full, stride * tp_size, dim=dim)
    if stride == 1:
        return chunks[tp_rank]  # a view: its readers copy it (a concatenation of one chunk was a copy per tensor)
    return torch.cat(chunks[tp_rank::tp_size], dim=dim)


def unshard_local_tensors(locals_: list[torch.Tensor], param: torch.Tensor) -> torch.Tensor:
    """Inverse of ``shard_full_tensor`` given every TP rank's tensor (in TP rank order)."""
    if not _is_sharded(param) or len(locals_) == 1:
        return locals_[0]
    dim, stride = _dim_stride(param)
    per_rank = [torch.chunk(t, stride, dim=dim) for t in locals_]
    return torch.cat([per_rank[r][j] for j in range(stride) for r in range(len(locals_))], dim=dim)


def placed_full(tensor: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """A full tensor holding this TP rank's ``tensor`` where ``shard_full_tensor`` takes it from, zeros elsewhere:
    summed over the TP ranks, these are ``unshard_local_tensors`` of their tensors (no communication)."""
    tensor = tensor.detach()
    if not _is_sharded(param) or tp_size == 1:
        return tensor.clone()
    parts = [torch.zeros_like(tensor) for _ in range(tp_size)]
    parts[tp_rank] = tensor
    return unshard_local_tensors(parts, param)


def placed_pairs(full: torch.Tensor, tensor: torch.Tensor, param: torch.Tensor, tp_rank: int,
                 tp_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(views of ``full`` where this TP rank's ``tensor`` sits, the pieces of ``tensor`` that go there): adding
    each piece into its view adds ``placed_full`` of ``tensor`` into ``full`` without making it."""
    if not _is_sharded(param) or tp_size == 1:
        return [full], [tensor]
    dim, stride = _dim_stride(param)
    return list(torch.chunk(full, stride * tp_size, dim=dim)[tp_rank::tp_size]), list(torch.chunk(tensor, stride, dim))


def gather_full(tensor: torch.Tensor, param: torch.Tensor, tp_group) -> torch.Tensor:
    """Full tensor from this rank's ``tensor`` (the parameter or its gradient); collective over ``tp_group``."""
    tensor = tensor.detach()
    tp_size = group_size(tp_group)
    if not _is_sharded(param) or tp_size == 1:
        return tensor.clone()
    parts = [torch.empty_like(tensor) for _ in range(tp_size)]
    dist.all_gather(parts, tensor.contiguous(), group=tp_group)
    return unshard_local_tensors(parts, param)


def unit_seed(name: str, seed: int) -> int:
    digest = hashlib.sha256(f"spindle-init/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's position table ``[length, channels]``: ``[sin | cos]`` of position * timescale_i, with channels/2
    timescales geometric from 1 down to 1/max_timescale (an odd last channel is 0)."""
    half = channels // 2
    step = math.log(max_timescale) / max(half - 1, 1)
    inv_timescales = torch.exp(-step * torch.arange(half, dtype=torch.float32))
    angles = torch.arange(length, dtype=torch.float32)[:, None] * inv_timescales[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    return torch.nn.functional.pad(table, (0, channels - 2 * half))


def init_full_tensor(name: str, shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    """Deterministic full initial value of parameter ``name`` (``"<unit>.<path>"``), independent of TP layout:
    norms weight 1 and bias 0; ``sinusoidal_positions`` (the conv audio stem's) Whisper's sinusoids; everything
    else normal(0, std) from a generator seeded by the name."""
    parts = name.split(".")
    owner, leaf = (parts[-2] if len(parts) >= 2 else ""), parts[-1]
    if leaf == "sinusoidal_positions":
        return sinusoids(*shape)
    if "norm" in owner or leaf.startswith("layer_norm_"):  # local norms; TE's fused layer_norm_weight/bias
        return torch.ones(shape) if leaf.endswith("weight") else torch.zeros(shape)
    gen = torch.Generator().manual_seed(unit_seed(name, seed))
    return torch.randn(shape, generator=gen) * std
