"""The overlapped weight all-gather of ZeRO-1 and 2 (``ExecutionSettings.overlap_param_gather``; Megatron's
--overlap-param-gather).

Without it, the engine all-gathers every parameter device group's updated master shards right after the
optimizer step and loads the full weights into the operators before the step returns. With it, ``start``
issues every group's all-gather asynchronously (``async_op=True``) right after the step, in the optimizer's
``unit_groups`` order on every member, and returns; the operators keep their old weights ("stale") until
``before_forward`` of a slice waits for the gathers of the groups holding that slice's units (each group once)
and loads that slice's weights. Slices already loaded pay nothing. ``flush`` finishes everything (every pending
gather waited, every stale slice loaded): the engine calls it before anything else reads or writes weights or
masters (checkpoint export, loading, ``gather_grads``, ``close``) and before the next optimizer step.

No deadlock: every rank issues every one of its gathers right after its step, before it waits for any, and
issuing depends on nothing but what the step itself needed; so whenever a rank waits for a group's gather,
every member of that group has issued it or will without waiting for anything this rank does next. Ops on one
process group run in issue order (the same on every member), different groups independently (gloo and NCCL).
"""

from __future__ import annotations

import torch

from megatron_spindle.runtime import progress
from megatron_spindle.runtime.optimizer import MasterOptimizer
from megatron_spindle.runtime.shards import PendingGather
from megatron_spindle.runtime.slices import LocalSlice, in_wave_order


class ParamGather:
    """Deferred weight loading of the local slices after an optimizer step (one per engine)."""

    def __init__(self, optimizer: MasterOptimizer, local: dict[str, LocalSlice], key_unit: dict[str, str],
                 dtype: torch.dtype):
        self.optimizer, self.local, self.dtype = optimizer, local, dtype
        group_of = {u: i for i, (_, units) in enumerate(optimizer.unit_groups) for u in units}
        # slice id -> indices (into unit_groups) of the groups holding its units, ascending
        self.slice_groups = {sid: sorted({group_of[key_unit[k]] for k in ls.param_keys})
                             for sid, ls in local.items() if ls.param_keys}
        self._pending: dict[int, PendingGather] = {}
        self._full: dict[str, torch.Tensor] = {}  # gathered full weights not yet loaded everywhere
        self._stale: set[str] = set()  # slice ids whose operators still hold the weights before the step

    @property
    def pending(self) -> bool:
        """True while some local slice's operator does not hold the latest masters yet."""
        return bool(self._stale or self._pending)

    def is_stale(self, ls: LocalSlice) -> bool:
        return ls.slice.id in self._stale

    def start(self) -> None:
        """Issue every group's all-gather of the updated masters, asynchronously (right after the step, on
        every rank before any wait: see the module docstring). Anything still pending is finished first."""
        self.flush()
        self._pending = dict(enumerate(self.optimizer.issue_weight_gathers(async_op=True)))
        self._stale = set(self.slice_groups)

    def before_forward(self, ls: LocalSlice) -> None:
        """Before ``ls``'s forward: wait for the gathers of its groups and load its weights (nothing if loaded)."""
        if ls.slice.id not in self._stale:
            return
        for i in self.slice_groups[ls.slice.id]:
            self._finish(i)
        ls.op.load_full_state({k: self._full[k].to(self.dtype) for k in ls.param_keys})
        self._stale.discard(ls.slice.id)
        if not self._stale and not self._pending:
            self._full = {}

    def flush(self) -> None:
        """Wait for every pending gather and load every stale slice (wave order)."""
        for i in sorted(self._pending):
            self._finish(i)
        for ls in in_wave_order(self.local):
            self.before_forward(ls)
        self._full = {}

    def _finish(self, index: int) -> None:
        pending = self._pending.pop(index, None)
        if pending is None:
            return
        progress.point("the overlapped weight all-gather (params-all-gather) of",
                       [list(self.optimizer.unit_groups[index][0])])
        self._full.update(self.optimizer.group_weights(index, pending))
