"""Global gradient norm, gradient clipping and fp16 loss-scale handling, between the gradient sync and AdamW.

After the gradient sync (grad_sync.py) every holder of a parameter unit has the unit's full gradient (canonical,
TP-unsharded, summed over every slice that uses it) in its flat buffer (grad_buffers.py), replicated on each
member of the unit's parameter device group. The global L2 norm counts every unit once, whatever its replication
or TP degree: the lowest-ranked member of its group (the unit's *norm owner*) adds the unit's squared sum, and
one all-reduce (SUM) over the world gives the total. Every rank then knows the same norm and clips its own
buffers by the same coefficient, as ``torch.nn.utils.clip_grad_norm_`` does on the single-process model:
``max_norm / (norm + 1e-6)``, applied when below 1 (megatron-core's ``clip_grad_norm_fp32`` alike).
With ZeRO-1 and 2 (grad_shards.py) a rank holds only its shard of each unit's gradient: every member adds the squared
sum of its own shards; the shards of a group tile each unit exactly once (their zero padding adds nothing), so
the same world all-reduce gives the same total, and each rank scales only its shards (``norm_tensors``).

fp16 (``grad_scaler``: a megatron-core ``MegatronGradScaler``): the backward ran on ``loss * scale``, so the norm
of the buffers is divided by the scale (exact for the power-of-two scales the dynamic scaler uses) and the
buffers are multiplied once by ``clip_coef / scale``. A non-finite norm is megatron's "found inf": the step is
skipped and the scaler backs off; without a scaler a non-finite norm is reported and nothing is clipped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_spindle.errors import on_every_rank
from megatron_spindle.plan.schema import ParamGroup
from megatron_spindle.runtime import progress

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_ and megatron-core: max_norm / (total_norm + 1e-6)


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step did: the global gradient norm before clipping (None when nothing needed it:
    no clipping and no loss scaling), the loss scale of the backward, and whether the step was skipped
    (fp16 overflow)."""

    grad_norm: float | None = None
    loss_scale: float = 1.0
    skipped: bool = False
    num_zeros: int | None = None  # zeros in the gradients (EngineConfig.count_zeros), else None


def norm_owners(param_groups: list[ParamGroup]) -> dict[str, int]:
    """unit -> the rank that counts it in the global norm (the lowest device of its parameter device group)."""
    return {u: min(g.devices) for g in param_groups for u in g.params}


def norm_tensors(unit_grads: dict[str, torch.Tensor], param_groups: list[ParamGroup], rank: int,
                 sharded: bool, valid: Mapping[str, int] | None = None) -> list[torch.Tensor]:
    """The gradients this rank counts in the global norm: its shard of every unit it holds (ZeRO-1, 2), or the
    full gradients of the units it is the norm owner of (replicated gradients); with ``valid`` (unit -> elements
    that are the unit's: runtime/shards.py ``UnitShard.valid``) views without the shards' padding."""
    owners = norm_owners(param_groups)
    return [unit_grads[u][:valid[u]] if valid is not None else unit_grads[u]
            for u in sorted(unit_grads) if sharded or owners.get(u) == rank]


def global_norm(counted: list[torch.Tensor], device: torch.device, what: str) -> float:
    """The L2 norm over the world of the tensors each rank counts (``norm_tensors``: each element of the model
    once). Collective over the world (``what`` names the all-reduce in the progress report)."""
    sq = torch.zeros((), dtype=torch.float64, device=device)
    if counted:
        # accumulated in fp64 (the total is then the same, to 1e-14, however the units are split over ranks:
        # resuming on another plan stays exact), by one multi-tensor call: the fp64 copy of every gradient it
        # replaces took 14 of clip-4's 109 ms optimizer step on an H200
        sq += torch.stack(torch._foreach_norm(counted, 2, dtype=torch.float64)).square().sum()
    if dist.is_initialized() and dist.get_world_size() > 1:
        progress.point(what)
        dist.all_reduce(sq)
    return math.sqrt(float(sq))  # inf or nan when a value overflowed


class GradClipper:
    """The global norm of the gradients (``counted``: what this rank adds, each element of the model counted
    once over the world) and the in-place scaling of this rank's gradient storage (``storage``)."""

    def __init__(self, storage: list[torch.Tensor], counted: list[torch.Tensor], device: torch.device):
        self.storage, self.owned, self.device = storage, counted, device

    def norm(self) -> float:
        """The global L2 norm of the synchronised gradients (collective over the world; every rank calls it)."""
        return global_norm(self.owned, self.device, "the gradient-norm all-reduce (--clip-grad / loss scaler)")

    def zeros(self) -> int:
        """Elements of the synchronised gradients that are zero, each element of the model once (Megatron-LM's
        --log-num-zeros-in-grad; ``counted`` must leave the shards' padding out). Collective over the world."""
        n = torch.zeros((), dtype=torch.float64, device=self.device)
        for t in self.owned:
            n += t.numel() - torch.count_nonzero(t)
        if dist.is_initialized() and dist.get_world_size() > 1:
            progress.point("the all-reduce of the gradients' zeros (--log-num-zeros-in-grad)")
            dist.all_reduce(n)
        return int(n)

    def scale_(self, factor: float) -> None:
        """Multiply every gradient this rank holds by ``factor``."""
        if factor != 1.0:
            for buf in self.storage:
                buf.mul_(factor)


class NonFiniteStepError(ValueError):
    """A step whose loss or gradients are not finite (``check_finite``), raised alike on every rank before the
    optimizer step, so the weights stay as the last step left them."""


def check_finite(losses: dict[str, float], stats: StepStats, step: int, scaled: bool) -> None:
    """Megatron-LM's check for NaN in the loss and the gradients: every rank has the same losses and gradient
    norm, so every rank raises alike. ``scaled`` (fp16 loss scaling): a non-finite gradient is an overflow the
    scaler skips, not an error."""
    bad = sorted(t for t, v in losses.items() if not math.isfinite(v))
    norm_bad = not scaled and stats.grad_norm is not None and not math.isfinite(stats.grad_norm)
    if bad or norm_bad:
        what = [f"the loss of task(s) {', '.join(bad)}"] if bad else []
        what += [f"the gradient norm ({stats.grad_norm})"] if norm_bad else []
        verb = "is" if len(bad) + norm_bad == 1 else "are"
        raise on_every_rank(NonFiniteStepError(
            f"iteration {step + 1}: {' and '.join(what)} {verb} not finite; stopped before the optimizer step, the "
            f"weights are those of iteration {step} (lower the learning rate, or --no-check-for-nan-in-loss-and-grad "
            f"to train on)"))


def prepare_step(clipper: GradClipper, clip_grad: float, loss_scale: float, grad_scaler,
                 measure: bool = False) -> StepStats:
    """Unscale, measure and clip the synchronised gradients (see the module docstring); updates the scaler.
    Returns whether to skip the step. A no-op without clipping, loss scaling and ``measure`` (no collective
    either)."""
    if clip_grad <= 0 and grad_scaler is None and not measure:
        return StepStats(None, loss_scale, False)
    norm = clipper.norm() / loss_scale
    found_inf = not math.isfinite(norm)
    if grad_scaler is not None:
        grad_scaler.update(found_inf)
        if found_inf:
            return StepStats(norm, loss_scale, True)
    coef = 1.0
    if clip_grad > 0 and not found_inf:
        coef = min(1.0, clip_grad / (norm + CLIP_EPS))
    clipper.scale_(coef / loss_scale)
    return StepStats(norm, loss_scale, False)
