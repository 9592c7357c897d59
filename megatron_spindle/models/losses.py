"""Losses: contrastive InfoNCE over data-parallel replicas and (vocab-parallel) LM cross-entropy.

Convention for every loss (the runtime relies on it): a data-parallel rank returns its SHARE of the task loss, so
the task loss is the SUM of the returned values over the DP ranks, and parameter gradients are SUMMED (not
averaged) over DP ranks. With no DP group the share is the whole loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from megatron_spindle.compat.groups import group_rank, group_size
from megatron_spindle.data.mock import IGNORE_INDEX


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Losses are computed in fp32 (fp64 stays fp64)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class _GatherAlongBatch(torch.autograd.Function):
    """All-gather along dim 0 over a group; backward sums the gradients of all ranks and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group):
        ctx.group, ctx.rows = group, local.shape[0]
        parts = [torch.empty_like(local) for _ in range(group.size())]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        lo = group_rank(ctx.group) * ctx.rows
        return grad[lo : lo + ctx.rows], None


def gather_along_batch(local: torch.Tensor, dp_group) -> torch.Tensor:
    """Autograd-aware all-gather of per-rank rows (in DP rank order); identity without a group."""
    if group_size(dp_group) == 1:
        return local
    return _GatherAlongBatch.apply(local, dp_group)


def contrastive_loss(emb_a: torch.Tensor, emb_b: torch.Tensor, temperature: float, dp_group=None) -> torch.Tensor:
    """Symmetric InfoNCE between L2-normalised embeddings ``[b, D]`` of the local DP shard, over the batch gathered
    from all DP ranks. Returns this rank's share ``L / dp`` of the global loss L (sum over ranks = L)."""
    a = gather_along_batch(F.normalize(_at_least_fp32(emb_a), dim=-1), dp_group)
    b = gather_along_batch(F.normalize(_at_least_fp32(emb_b), dim=-1), dp_group)
    logits = a @ b.t() / temperature
    target = torch.arange(logits.shape[0], device=logits.device)
    loss = 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target))
    return loss / group_size(dp_group)


def vocab_parallel_token_losses(logits: torch.Tensor, target: torch.Tensor, tp_group) -> torch.Tensor:
    """Per-token cross-entropy when the vocabulary (last dim of ``logits``) is split over ``tp_group`` in contiguous
    blocks (rank r holds ids ``[r*V/tp, (r+1)*V/tp)``). Ignored targets (-100) give 0.

    Written here because megatron-core 0.16.1's ``vocab_parallel_cross_entropy`` only uses the global TP group.
    """
    logits = _at_least_fp32(logits)
    tp_size, tp_rank = group_size(tp_group), group_rank(tp_group)
    vocab_local = logits.shape[-1]
    logits_max = logits.detach().amax(dim=-1)
    if tp_size > 1:
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - logits_max.unsqueeze(-1)
    sum_exp = shifted.exp().sum(dim=-1)
    start = tp_rank * vocab_local
    valid = target != IGNORE_INDEX
    local_ids = target - start
    here = valid & (local_ids >= 0) & (local_ids < vocab_local)
    picked = shifted.gather(-1, local_ids.clamp(0, vocab_local - 1).unsqueeze(-1)).squeeze(-1) * here
    if tp_size > 1:
        sum_exp = reduce_from_tensor_model_parallel_region(sum_exp, group=tp_group)
        picked = reduce_from_tensor_model_parallel_region(picked, group=tp_group)
    return (sum_exp.log() - picked) * valid


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, num_label_tokens_global: int, tp_group=None) -> torch.Tensor:
    """LM cross-entropy share of this DP rank: the sum over its labelled tokens divided by the number of labelled
    tokens of the GLOBAL batch (summing over DP ranks gives the global token mean)."""
    token_losses = vocab_parallel_token_losses(logits, labels, tp_group)
    return token_losses.sum() / max(int(num_label_tokens_global), 1)
