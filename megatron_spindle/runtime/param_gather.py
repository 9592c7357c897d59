"""The overlapped weight all-gather of ZeRO-1 and 2 (``ExecutionSettings.overlap_param_gather``; Megatron's
--overlap-param-gather; ZeRO-3's overlapped redistribution: weight_redistribution.py).

Without it, the engine all-gathers every parameter device group's updated master shards right after the
optimizer step and loads the full weights into the operators before the step returns. With it, ``start``
issues the all-gather of every gradient bucket (the same buckets, runtime/grad_buffers.py) asynchronously
(``async_op=True``) right after the step, in plan/buckets.py's ``gather_order`` (the order the next
forward first uses them, the same on every member), and returns; the operators keep their old weights
("stale") until a layer is about to run: a forward pre-hook on each unit's module waits for that unit's
bucket and loads the bucket's weights into every local operator holding them, so a slice's later layers
overlap their gathers with its earlier layers' forward, as the simulator charges. ``before_forward`` of a
slice loads whatever of it no hook covers. ``flush`` finishes everything: the engine calls it before anything
else reads or writes weights or masters (checkpoint export, loading, ``close``) and before the next step.

No deadlock: every rank issues every one of its gathers right after its step, before it waits for any, and
issuing depends on nothing but what the step itself needed; so whenever a rank waits for a bucket's gather,
every member of its group has issued it or will without waiting for anything this rank does next. Ops on one
process group run in issue order (the same on every member), different groups independently (gloo and NCCL).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial

import torch

from megatron_spindle.plan.buckets import gather_order
from megatron_spindle.plan.tp_shards import base_unit
from megatron_spindle.runtime import progress
from megatron_spindle.runtime.optimizer import MasterOptimizer
from megatron_spindle.runtime.shards import PendingGather
from megatron_spindle.runtime.slices import LocalSlice, local_slice_units, unit_holders


class ParamGather:
    """Deferred weight loading of the local slices after an optimizer step (one per engine). ``buckets``:
    (group devices, units) of every bucket this rank holds, in gather order."""

    def __init__(self, optimizer: MasterOptimizer, local: dict[str, LocalSlice], key_unit: dict[str, str],
                 dtype: torch.dtype, buckets: Sequence[tuple[tuple[int, ...], tuple[str, ...]]],
                 timed: Callable[[Callable[[], None]], None] | None = None):
        """``timed(fn)``: runs ``fn`` (a wait and load), e.g. under the engine's ``params-all-gather`` timer."""
        self.optimizer, self.dtype = optimizer, dtype
        self._timed = timed or (lambda fn: fn())
        self.buckets = list(buckets)
        self.bucket_of = {u: i for i, (_, units) in enumerate(self.buckets) for u in units}
        self.holders = unit_holders(local, key_unit)  # unit -> the local slices holding it, their keys of it
        self.slice_units = local_slice_units(local, key_unit)
        self._hooks = []
        self.unhooked: dict[str, list[str]] = {}  # slice id -> its gathered units no layer hook loads
        for sid, ls in local.items():
            modules = ls.op.unit_modules() if hasattr(ls.op, "unit_modules") else {}  # stand-ins have none
            for u in self.slice_units[sid]:  # a unit's TP shard (runtime/tp_shards.py) before its unit's layer
                if base_unit(u) in modules and u in self.bucket_of:
                    self._hooks.append(modules[base_unit(u)].register_forward_pre_hook(partial(self._before_unit, u)))
                elif u in self.bucket_of:
                    self.unhooked.setdefault(sid, []).append(u)
        self._pending: dict[int, PendingGather] = {}
        self._stale: set[str] = set()  # units whose operators still hold the weights before the step

    @property
    def pending(self) -> bool:
        """True while some local operator does not hold the latest masters yet."""
        return bool(self._stale or self._pending)

    def is_stale(self, ls: LocalSlice) -> bool:
        """Whether some of the slice's units still hold the weights before the step."""
        return any(u in self._stale for u in self.slice_units[ls.slice.id])

    def start(self) -> None:
        """Issue every bucket's all-gather of the updated masters, asynchronously (right after the step, on
        every rank before any wait: see the module docstring). Anything still pending is finished first."""
        self.flush()
        opt = self.optimizer
        gathers = opt.issue_gathers(opt.masters, self.buckets, async_op=True, dtype=self.dtype)  # the weights' bytes
        self._pending = dict(enumerate(gathers))
        self._stale = set(self.bucket_of)

    def before_forward(self, ls: LocalSlice) -> None:
        """Before ``ls``'s forward: the units of it no layer hook loads (nothing when every unit has one)."""
        for u in self.unhooked.get(ls.slice.id, ()):
            if u in self._stale:
                self._load(self.bucket_of[u])

    def flush(self) -> None:
        """Wait for every pending gather and load every stale unit (gather order)."""
        for i in sorted(self._pending):
            self._load(i)
        self._stale.clear()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _before_unit(self, unit: str, module, args) -> None:
        if unit in self._stale:
            self._load(self.bucket_of[unit])

    def _load(self, index: int) -> None:
        """Wait for bucket ``index``'s gather and load its units into every local operator holding them."""
        pending = self._pending.pop(index, None)
        if pending is not None:
            self._timed(partial(self._finish, index, pending))

    def _finish(self, index: int, pending: PendingGather) -> None:
        devices, units = self.buckets[index]
        progress.point("the overlapped weight all-gather (params-all-gather) of", [list(devices)])
        full = self.optimizer.unflatten(units, pending)
        for u in units:
            for ls, keys in self.holders.get(u, ()):  # load_full_state casts (a one-device group's fp32 masters)
                ls.keys.load(ls.op, {k: full[k] for k in keys}, strict=False)
            self._stale.discard(u)


def streamed_gathers(optimizer: MasterOptimizer, buckets: Sequence[tuple[tuple[int, ...], Sequence[str]]],
                     dtype: torch.dtype) -> Iterator[tuple[Sequence[str], dict[str, torch.Tensor]]]:
    """The updated weights after the step without --overlap-param-gather (plan/buckets.py): (units, full
    tensors) of each bucket in turn, all-gathered in ``dtype``, the next bucket's gather issued before this one
    is waited for. A rank holds at most two buckets' gathered weights (every group's at once, before). Deadlock-
    free as the overlapped gathers are: every rank issues and waits for its buckets in the one gather order."""
    issue = partial(optimizer.issue_gathers, optimizer.masters, async_op=True, dtype=dtype)
    following = issue(buckets[:1])
    for i, (devices, units) in enumerate(buckets):
        pending, following = following[0], issue(buckets[i + 1:i + 2])
        progress.point("the weight all-gather after the optimizer step of", [list(devices)])
        yield units, optimizer.unflatten(units, pending)


def gather_buckets(grad_buckets, first_use) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    """(devices, units) of the gradient buckets in the weight gathers' issue order (plan/buckets.py)."""
    return [(b.devices, b.units) for b in gather_order(grad_buckets, first_use)]
