"""AdamW on fp32 master weights, one flat master per parameter unit, replicated or ZeRO-1/2/3 sharded.

The AdamW step is elementwise, so it may run on any partition of a unit's elements:

- ``zero_stage`` 0: replicated. Every holder of a unit keeps its whole master and moments and steps them.
- ``zero_stage`` 1 (the distributed optimizer): a unit's master and moments are sharded over the members of its
  parameter device group (runtime/shards.py: the unit flattened, its tensors sorted by name; member i of the
  sorted group keeps elements [i*S, (i+1)*S), S = ceil(N / group size)). Each member steps its shard of the
  synchronised gradient, and the shards of all units of a group are all-gathered in one collective, so every
  holder loads identical full weights. Numerically equal to stage 0; master + moments drop to 1/size.
  The gradient is reduce-scattered into the same shards (runtime/grad_shards.py, as Megatron's distributed
  optimizer does): each bucket's full storage lives until its sync, the masters' ``.grad`` are the shards
  (``attach_grads``); the micro-batches accumulate in full before the one sync, as at stage 0.
- ``zero_stage`` 2: stage 1, and the gradient kept only as shards between micro-batches too: every
  micro-batch's buckets are reduce-scattered after its backward (plan/buckets.py). Numerically equal to
  stages 0 and 1.
- ``zero_stage`` 3: stage 2 here; the operators' weights are sharded too, over each slice's data-parallel ranks
  (runtime/weight_shards.py).

Whatever the layout, ``export_units`` / ``load_units`` / ``full_weights`` speak full tensors, so checkpoints are
layout-independent. At stages 1 to 3 ``export_units`` and ``full_weights`` are collective over the parameter
device groups; ``load_*`` never communicate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_spindle.checkpointing.checkpoint import CheckpointError, UnitState
from megatron_spindle.plan.schema import ParamGroup
from megatron_spindle.runtime.groups import PlanGroups
from megatron_spindle.runtime.shards import PendingGather, UnitShard, gather_units, issue_gather


def adamw_fused(device: torch.device) -> bool | None:
    """torch's fused AdamW on CUDA (one pass over each master's elements, as Megatron's fused Adam and as the cost
    model's ``ADAMW_BYTES_PER_ELEMENT`` charge: measured on an H200, clip-4's step with torch's default foreach
    implementation, about ten passes, took 27.6 ms where one pass is 8.2); the default elsewhere (None). The
    profiler measures the same implementation."""
    return True if device.type == "cuda" else None


@dataclass
class OptimizerConfig:
    """torch.optim.AdamW over the fp32 master weights. ``clip_grad``: clip the global gradient norm to this value
    before the step (runtime/clip.py; 0: no clipping, the library default; pretrain_multitask.py's --clip-grad
    defaults to Megatron's 1.0)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_grad: float = 0.0
    # Megatron-LM's rule: biases and 1-D parameters (norms, class tokens) get no weight decay; False decays every
    # parameter (torch AdamW over all of them)
    no_weight_decay_1d: bool = False

    def __post_init__(self):
        if not self.clip_grad >= 0:
            raise ValueError(f"clip_grad must be >= 0 (0: no clipping), got {self.clip_grad}")


def decays(name: str, shape: torch.Size) -> bool:
    """Megatron-LM's rule (``no_weight_decay_1d``): no weight decay on biases and 1-D parameters."""
    return not name.endswith(".bias") and len(shape) > 1


def param_ranges(shard: UnitShard, decayed: bool) -> list[tuple[int, int]]:
    """[lo, hi) ranges of a member's shard of a unit (its flat elements, tensors in ``keys`` order) that hold
    decayed parameters (or, ``decayed=False``, undecayed ones), adjacent ones merged."""
    out: list[tuple[int, int]] = []
    start, at = shard.index * shard.size, 0
    for key, shape in zip(shard.keys, shard.shapes):
        n = shape.numel()
        lo, hi = max(at, start) - start, min(at + n, start + shard.size) - start
        if decays(key, shape) == decayed and lo < hi:
            if out and out[-1][1] == lo:
                out[-1] = (out[-1][0], hi)
            else:
                out.append((lo, hi))
        at += n
    return out


class MasterOptimizer:
    """fp32 masters (``masters``: unit -> this rank's shard, the whole unit at stage 0), their layouts
    (``shards``) and one torch AdamW over them (``adamw``, None on a rank that holds nothing)."""

    def __init__(self, full: dict[str, torch.Tensor], key_unit: dict[str, str], param_groups: list[ParamGroup],
                 rank: int, zero_stage: int, config: OptimizerConfig, groups: PlanGroups, device: torch.device):
        self.groups, self.device = groups, device
        self.clip_grad = config.clip_grad
        self.shards: dict[str, UnitShard] = {}
        self.masters: dict[str, torch.nn.Parameter] = {}
        self.unit_groups: list[tuple[tuple[int, ...], list[str]]] = []  # (sorted devices, sorted units), plan order
        self._views: dict[str, tuple[int, dict[str, torch.Tensor]]] = {}  # unit -> (master's address, its views)
        held = set(key_unit.values())
        for pg in param_groups:
            devices = tuple(sorted(pg.devices))
            units = sorted(held & set(pg.params))
            if rank not in devices or not units:
                continue
            members, index = (len(devices), devices.index(rank)) if zero_stage >= 1 else (1, 0)
            for u in units:
                keys = sorted(k for k in full if key_unit[k] == u)
                sh = UnitShard(u, keys, [full[k].shape for k in keys], members, index)
                self.shards[u] = sh
                self.masters[u] = torch.nn.Parameter(sh.shard_of(sh.flatten(full)))
            self.unit_groups.append((devices, units))
        # Megatron-LM's rule: AdamW decays every element in its own pass (p *= 1 - lr * wd before the update, free
        # inside the fused kernel), and the few undecayed ones (biases, norms: well under 1 % of a model) are
        # scaled up by as much just before, in one multi-tensor call, so the step moves no more bytes than the
        # cost model's AdamW charges
        self.weight_decay = config.weight_decay
        self._undecayed = [self.masters[u].data[lo:hi] for u, sh in self.shards.items()
                           for lo, hi in param_ranges(sh, decayed=False)] if config.no_weight_decay_1d else []
        self.adamw = torch.optim.AdamW(list(self.masters.values()), lr=config.lr, betas=config.betas,
                                       eps=config.eps, weight_decay=config.weight_decay,
                                       fused=adamw_fused(device)) if self.masters else None

    # ---------------------------------------------------------------------------------------------- step
    def step(self, unit_grads: dict[str, torch.Tensor]) -> None:
        """One AdamW step from the synchronised gradient of every unit: the masters' ``.grad`` itself
        (``attach_grads``): the full flat gradient at stage 0, this member's shard of it at stages 1 to 3."""
        if self.adamw is None:
            return
        for u, p in self.masters.items():
            if p.grad is None:  # someone called zero_grad(set_to_none=True): reattach the buffer
                p.grad = unit_grads[u]
        if self._undecayed and self.weight_decay > 0:
            keep = 1.0 - self.adamw.param_groups[0]["lr"] * self.weight_decay
            if keep <= 0:
                raise ValueError(f"learning rate x weight decay = {1 - keep:g} >= 1: AdamW's decoupled decay "
                                 f"would zero the weights or flip their sign (lower --lr or --weight-decay)")
            torch._foreach_div_(self._undecayed, keep)
        self.adamw.step()

    def attach_grads(self, unit_grads: dict[str, torch.Tensor]) -> None:
        """The masters' gradients are the units' gradient storage (the full buffer, or the shard at stages 1
        and 2; no copy before the step)."""
        for u, p in self.masters.items():
            p.grad = unit_grads[u]

    def detach_grads(self) -> None:
        """The masters hold no gradient (the step's fp32 copies of bf16 gradients are released)."""
        for p in self.masters.values():
            p.grad = None

    def set_lr(self, lr: float) -> None:
        if self.adamw is not None:
            for g in self.adamw.param_groups:
                g["lr"] = lr

    def set_weight_decay(self, weight_decay: float) -> None:
        """The decay of the next steps (Megatron-LM's --start/--end-weight-decay schedule); the spared parameters
        stay spared."""
        self.weight_decay = weight_decay
        if self.adamw is not None:
            for g in self.adamw.param_groups:
                g["weight_decay"] = weight_decay

    # --------------------------------------------------------------------------------------------- state
    def full_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """"<unit>.<path>" -> full master weight (fp32 views; all-gathered over the groups at stages 1-3, in
        ``dtype`` when given: the model's weights need only their own dtype's bytes, as the cost model charges)."""
        return self.gather_full(self.masters, dtype)

    def gather_full(self, vectors: Mapping[str, torch.Tensor],
                    dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """"<unit>.<path>" -> full tensor, from each held unit's shard vector in ``vectors`` laid out like its
        master (the masters, the gradient shards); all-gathered over each group (in ``dtype`` when given),
        collective at stages 1-3."""
        full: dict[str, torch.Tensor] = {}
        for (_, units), pending in zip(self.unit_groups, self.issue_gathers(vectors, dtype=dtype)):
            full.update(self.unflatten(units, pending))
        return full

    def issue_gathers(self, vectors: Mapping[str, torch.Tensor],
                      unit_sets: Sequence[tuple[tuple[int, ...], Sequence[str]]] | None = None,
                      async_op: bool = False, dtype: torch.dtype | None = None) -> list[PendingGather]:
        """The all-gather of ``vectors``' shards of every (devices, units) of ``unit_sets`` (default
        ``unit_groups``; the gradient buckets for runtime/param_gather.py), in that order (the same on every
        member); ``async_op``: issued without waiting; ``dtype``: the bytes moved (default the vectors')."""
        sets = self.unit_groups if unit_sets is None else unit_sets
        return [issue_gather([self.shards[u] for u in units], [[vectors[u].detach()] for u in units],
                             self.groups.param_group(devices), async_op, dtype)
                for devices, units in sets]

    def unflatten(self, units: Sequence[str], pending: PendingGather) -> dict[str, torch.Tensor]:
        """"<unit>.<path>" -> full tensor of ``units`` (as issued together), once their gather finished."""
        full: dict[str, torch.Tensor] = {}
        for u, (v,) in zip(units, pending.wait()):
            full.update(self._master_views(u, v) or self.shards[u].unflatten(v))
        return full

    def _master_views(self, unit: str, vector: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The unit's full tensors as views of its whole master when ``vector`` is that master (an unsharded
        unit's weights), made once: two view operations per tensor every step were host time on a GPU. None
        for any other vector (a gathered row, a gradient)."""
        master = self.masters[unit]
        if self.shards[unit].members != 1 or vector.data_ptr() != master.data_ptr() or vector.dtype != master.dtype:
            return None
        ptr, views = self._views.get(unit, (None, None))
        if ptr != master.data_ptr():
            views = self.shards[unit].unflatten(master.detach())
            self._views[unit] = (master.data_ptr(), views)
        return views

    def load_weights(self, full: dict[str, torch.Tensor]) -> None:
        """Overwrite every master (this rank's shard) from full fp32 tensors on the device."""
        with torch.no_grad():
            for u, p in self.masters.items():
                sh = self.shards[u]
                p.copy_(sh.shard_of(sh.flatten(full)))

    def numel(self) -> dict[str, tuple[int, int]]:
        """unit -> (elements of its master shard on this rank, elements of the full unit)."""
        return {u: (self.masters[u].numel(), sh.numel) for u, sh in self.shards.items()}

    def export_units(self) -> dict[str, UnitState]:
        """Every unit in full form: fp32 weights and AdamW state (``optim`` empty before the first step).
        Collective over the parameter device groups at stages 1 to 3."""
        out: dict[str, UnitState] = {}
        for devices, units in self.unit_groups:
            states = [self._adam_state(u) for u in units]
            parts = [[self.masters[u].detach()] + ([st["exp_avg"], st["exp_avg_sq"]] if st else [])
                     for u, st in zip(units, states)]
            fulls = gather_units([self.shards[u] for u in units], parts, self.groups.param_group(devices))
            for u, st, vecs in zip(units, states, fulls):
                sh = self.shards[u]
                model = {k: v.clone() for k, v in sh.unflatten(vecs[0]).items()}
                optim = {}
                if st:
                    avg, sq = sh.unflatten(vecs[1]), sh.unflatten(vecs[2])
                    optim = {k: {"exp_avg": avg[k].clone(), "exp_avg_sq": sq[k].clone(), "step": float(st["step"])}
                             for k in sh.keys}
                out[u] = UnitState(model, optim)
        return out

    def load_optimizer_state(self, units: dict[str, UnitState]) -> None:
        """AdamW state of every unit from its full form (a unit without any starts afresh)."""
        if self.adamw is None:
            return
        for u, p in self.masters.items():
            self._load_adam_state(u, p, units[u].optim)

    def _adam_state(self, unit: str) -> dict[str, Any] | None:
        if self.adamw is None:
            return None
        return self.adamw.state.get(self.masters[unit]) or None

    def _load_adam_state(self, unit: str, p: torch.nn.Parameter, optim: dict[str, dict[str, Any]]) -> None:
        sh = self.shards[unit]
        present = [k for k in sh.keys if k in optim]
        if not present:
            self.adamw.state.pop(p, None)
            return
        steps = {float(optim[k]["step"]) for k in present}
        if len(present) != len(sh.keys) or len(steps) != 1:
            raise CheckpointError(f"unit '{unit}': AdamW state for {len(present)} of its {len(sh.keys)} tensors, "
                                  f"steps {sorted(steps)}: a unit's tensors must share one optimizer state")
        moment = lambda name: sh.shard_of(sh.flatten({k: optim[k][name].to(self.device) for k in sh.keys}))  # noqa: E731
        # the fused implementation keeps its step count on the masters' device, the others on the host
        step_device = p.device if self.adamw.defaults.get("fused") else "cpu"
        self.adamw.state[p] = {"step": torch.tensor(steps.pop(), dtype=torch.float32, device=step_device),
                               "exp_avg": moment("exp_avg"), "exp_avg_sq": moment("exp_avg_sq")}
