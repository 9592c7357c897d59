"""Bucketed gradient synchronisation, overlapped with the backward (megatron-core DDP's overlap_grad_reduce).

Each bucket (runtime/grad_buffers.py) is summed over its parameter device group by one asynchronous all-reduce
(``async_op=True``, inside that group's process group), issued as soon as every gradient in it is complete on
this rank, while the rest of the backward runs; ``finish`` waits on every handle before the optimizer step.

- **Completion.** A unit held by several local slices (a tower shared by several tasks, or split over several
  waves) accumulates its gradient once per slice. Each bucket expects one accumulation per (local slice,
  parameter key) of its units; a direct parameter (runtime/direct.py) reports its accumulation from a
  ``register_post_accumulate_grad_hook``, and once a slice's backward is over every key it holds counts as
  accumulated (generic keys after their exported gradients were added to the buffer). A bucket is complete
  when nothing it expects is missing: after the last accumulation of every gradient in it.
- **Order.** Collectives of one process group must be issued in the same order on every member. Completion
  order differs between ranks (they run different slices), so buckets are issued in one plan-wide order
  (``grad_buffers.launch_order``): a bucket is issued only after every bucket before it that this rank holds;
  the rest wait until the earlier ones complete. Any two ranks therefore issue the buckets they share in the
  same relative order, inside a group and across groups (which NCCL also needs when a device joins several
  communicators). The order follows the backward (latest wave first), so waiting costs little. Relative to
  the backward's TP collectives and transfers a bucket may still be issued at different points on different
  ranks. No rank ever waits on a bucket before ``finish``, so gloo (one set of threads per group) always
  progresses; NCCL only promises progress for one order across communicators, which holds while their
  kernels can run side by side (not verified on GPUs here). ``overlap_grad_reduce=False`` issues every
  bucket after the backward: one total order, no overlap.
- **Micro-batches.** With m micro-batches every gradient accumulates m times (one per micro-batch and local
  slice): a bucket expects m accumulations per (slice, key), so it completes, and is issued, during the last
  micro-batch's backward. Generic gradients accumulate in the operators over the micro-batches and are added
  to the buffers once, after the slice's last backward.
- **ZeRO-1 and 2** (grad_shards.py): the same buckets, each summed by a reduce-scatter into this rank's
  shard (the distributed optimizer steps only that). A slice's operator gradients are dropped once added, and
  a bucket's full storage as soon as its collective has completed (checked, never waited for, after each
  slice's backward; the rest in ``finish``). At stage 1 the micro-batches accumulate in the operators, as at
  stage 0. A ZeRO-2 rank holds shards only and cannot accumulate full gradients, so every micro-batch is a round of its own
  (plan/buckets.py ``synced_micro_batches``): its buckets expect one accumulation per (slice, key), the
  operators' gradients are added after each micro-batch's backward, and the buckets are issued, in launch
  order, during that micro-batch's backward; the next micro-batch starts the launch order again.
- **Rounds per segment.** Likewise at ZeRO 2 and 3 a plan with segments reduces after each segment's backward
  (plan/buckets.py ``sync_rounds``): ``rounds`` lists each round's buckets in its launch order (each with its
  completion in the round), the schedule says when a segment begins (``segment_start``), and a round's buckets
  expect the accumulations of the local slices of its segment. A bucket this rank accumulates nothing of in a
  round is complete at once: issued, in order, when the rank reaches the segment. Each round adds into its own
  staging buffers (grad_shards.py), released once its collective has completed.
- No barrier precedes the sync, and nothing waits on a handle before ``finish``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_spindle.plan.buckets import synced_micro_batches
from megatron_spindle.plan.tp_shards import base_unit
from megatron_spindle.runtime import progress
from megatron_spindle.runtime.direct import DirectBinding
from megatron_spindle.runtime.grad_buffers import Bucket, GradBuffers
from megatron_spindle.runtime.grad_shards import ShardedGradBuffers
from megatron_spindle.runtime.groups import PlanGroups
from megatron_spindle.runtime.opstate import full_grads
from megatron_spindle.runtime.slices import LocalSlice


class GradSync:
    """One step's gradient synchronisation: ``start_step``, then ``slice_done`` after each local slice's
    backward (the schedule calls it), then ``finish``. ``overlap=False`` issues every bucket in ``finish``
    (after the whole backward). ``on_launch(bucket)`` is told each bucket when it is issued (a bucket of a
    one-device group needs no collective but is reported all the same)."""

    def __init__(self, buffers: GradBuffers | ShardedGradBuffers, local: dict[str, LocalSlice], binding: DirectBinding,
                 key_unit: dict[str, str], groups: PlanGroups, overlap: bool = True,
                 on_launch: Callable[[Bucket], None] | None = None, micro_batches: int = 1, zero_stage: int = 0,
                 rounds: list[list[Bucket]] | None = None, wave_rounds: list[int] | None = None):
        self.buffers, self.local, self.binding, self.groups = buffers, local, binding, groups
        self.overlap, self.on_launch = overlap, on_launch
        self.micro_batches = micro_batches
        # every micro-batch a round of its own (ZeRO-2: plan/buckets.py), else one round of all micro-batches;
        # the accumulations a bucket expects per (slice, key) in a round
        self._each_micro = len(synced_micro_batches(zero_stage, micro_batches)) == micro_batches
        self._per_round = 1 if self._each_micro else micro_batches
        self._micro = 0
        # the rounds of a synced micro-batch (one, or one per segment), each its buckets in launch order
        self.rounds = rounds or [list(buffers.buckets)]
        position = {(b.devices, b.index): i for i, b in enumerate(buffers.buckets)}
        self._order = [[position[b.devices, b.index] for b in r] for r in self.rounds]
        at = {u: i for i, b in enumerate(buffers.buckets) for u in b.units}
        self._bucket_of: dict[tuple[str, str], int] = {}  # (slice id, key) -> bucket position
        self._expected = [[0] * len(buffers.buckets) for _ in self.rounds]  # per round and bucket
        for sid, ls in local.items():
            expected = self._expected[wave_rounds[ls.wave] if wave_rounds else 0]
            for k in ls.param_keys:
                i = at[key_unit[k]]
                self._bucket_of[sid, k] = i
                expected[i] += self._per_round
        self._round = 0
        self._key = 0  # the round's key into the buffers' staging: micro-batch * rounds + round
        self._missing = list(self._expected[0])
        # slice id -> its generic keys unit by unit (a unit's TP shard with its unit: runtime/tp_shards.py):
        # exported one unit at a time, so that a rank holds one unit's full-shape gradients at once, not its
        # whole operator's
        self._generic_units: dict[str, list[tuple[str, list[str]]]] = {}
        for sid, keys in binding.generic_keys.items():
            by_unit: dict[str, list[str]] = {}
            for k in keys:
                by_unit.setdefault(base_unit(key_unit[k]), []).append(k)
            self._generic_units[sid] = list(by_unit.items())
        # slice id -> its operator's parameters, listed once (their gradients are dropped after every export)
        self._op_params = {sid: list(ls.op.parameters()) for sid, ls in local.items()}
        self._counted: set[tuple[str, str, int]] = set()  # (slice id, key, micro-batch)
        self._next = 0  # position in the round's launch order of the first bucket not issued yet
        self._handles: list = []
        self._active = False
        self._groups_in_flight = sorted({tuple(b.devices) for b in buffers.buckets if len(b.devices) > 1})
        if overlap:
            for sid, params in binding.params.items():
                for k, p in params.items():
                    p.register_post_accumulate_grad_hook(self._hook(sid, k))

    def _hook(self, sid: str, key: str) -> Callable[[torch.Tensor], None]:
        def accumulated(_param: torch.Tensor) -> None:
            if not self._active:  # a backward outside the engine's step
                return
            if (sid, key, self._micro) in self._counted:
                raise RuntimeError(f"slice '{sid}': the gradient of '{key}' was accumulated twice in one backward; "
                                   f"the bucketed gradient sync expects one accumulation per slice "
                                   f"(a plan without overlap_grad_reduce waits for the whole backward)")
            self._count(sid, key)
            self._advance()
        return accumulated

    def _count(self, sid: str, key: str) -> None:
        self._counted.add((sid, key, self._micro))
        self._missing[self._bucket_of[sid, key]] -= 1

    def _advance(self) -> None:
        """Issue, in the round's launch order, every bucket whose predecessors are issued and which is complete."""
        order = self._order[self._round]
        while self._next < len(order) and self._missing[order[self._next]] == 0:
            self._launch(self.rounds[self._round][self._next])
            self._next += 1

    def _launch(self, b: Bucket) -> None:
        group = self.groups.param_group(b.devices) if len(b.devices) > 1 else None
        self._handles.append((b, self._key, self.buffers.reduce(b, group, self._key)))
        if self.on_launch is not None:
            self.on_launch(b)

    def _settle_completed(self) -> None:
        """Sharded buckets: release the full storage of the buckets whose collectives have completed (never
        waits), in issue order, so that a later micro-batch's sum is added to a row only after the earlier
        collectives writing it are done."""
        while self._handles:
            b, micro, h = self._handles[0]
            if h is not None and not h.is_completed():
                return
            if h is not None:
                h.wait()  # completed: returns at once (on CUDA it orders the release after the kernel)
            self.buffers.settle(b, micro)
            self._handles.pop(0)

    # ------------------------------------------------------------------------------------------------ step
    def start_step(self) -> None:
        """Zero the buffers and the gradients of parameters outside them; expect every accumulation again."""
        self._wait()  # handles of a step that raised
        self.buffers.zero_()
        for params in self.binding.free_params.values():
            for p in params:
                p.grad = None
        self._round = self._key = 0
        self._missing = list(self._expected[0])
        self._counted.clear()
        self._next = 0
        self._micro = 0
        self._active = True

    def micro_start(self, index: int) -> None:
        """Micro-batch ``index`` begins (the schedule says so before each, then ``segment_start(0)``)."""
        self._micro = index

    def segment_start(self, index: int) -> None:
        """Segment ``index`` of the plan's order begins (the schedule says so before each, in every micro-batch;
        one segment without them). Where it begins a round (under ZeRO-2 and 3 every micro-batch is one, and with
        segments every segment), the previous round's buckets are all complete here (every local slice has run
        its backward there): issue what is left of them, and begin this round."""
        next_segment = index > 0 and len(self.rounds) > 1
        next_micro_batch = index == 0 and self._micro > 0 and self._each_micro
        if next_segment or next_micro_batch:
            self._begin_round(index)

    def _begin_round(self, index: int) -> None:
        """Issue what is left of the round now running, then begin round ``index`` of the current micro-batch:
        the buckets this rank accumulates nothing of there are issued at once (in order)."""
        self._check_all_issued()
        self._round, self._key = index, self._micro * len(self.rounds) + index
        self._missing = list(self._expected[index])
        self._next = 0
        if self.overlap:
            self._advance()
        if self.buffers.sharded:
            self._settle_completed()

    def slice_done(self, ls: LocalSlice) -> None:
        """After the slice's backward: add its generic gradients to the buffers, unit by unit, and count every
        key it holds as accumulated. Each TP rank adds its own part (``export_grad_contributions``: zeros where
        another TP rank's shard sits), which the group's reduction sums; an operator without it exports its full
        gradients once (collective over its TP group) and its TP leader adds them."""
        sid = ls.slice.id
        # accumulated in the operator over the micro-batches, or (ZeRO-2) added after each
        export = self._each_micro or self._micro == self.micro_batches - 1
        generic = self.binding.generic_keys[sid]
        if export and generic and not hasattr(ls.op, "export_grad_contributions"):
            g = full_grads(ls.op, ls.keys.canonical)  # one export of the whole operator (stand-ins: never split)
            if ls.tp_leader:
                self.buffers.add(ls.keys.to_runtime(g), generic, self._key)
        elif export:
            for unit, keys in self._generic_units.get(sid, ()):  # every TP rank its part: the reduction sums them
                self.buffers.add(ls.keys.runtime_grads(ls.op, [unit]), keys, self._key)
        if export and self.buffers.sharded:  # the operator's full gradients are in the buckets now
            for p in self._op_params[sid]:
                p.grad = None
        for k in ls.param_keys:
            if (sid, k, self._micro) not in self._counted:
                self._count(sid, k)
        if self.overlap:
            self._advance()
        if self.buffers.sharded:
            self._settle_completed()

    def finish(self) -> None:
        """Issue what is left (in order) and wait for every all-reduce: the buffers then hold the total
        gradients. Call after every local slice's ``slice_done``."""
        progress.point("the gradient all-reduces of", self._groups_in_flight)
        self._check_all_issued()
        self._wait()
        self._active = False

    def _check_all_issued(self) -> None:
        """Issue the buckets left (in order); each must be complete after the (micro-batch's) backward."""
        self._advance()
        if self._next != len(self._order[self._round]):
            b = self.rounds[self._round][self._next]
            raise RuntimeError(f"gradient bucket {b.index} of devices {list(b.devices)} misses "
                               f"{self._missing[self._order[self._round][self._next]]} accumulation(s) after the "
                               f"backward")

    def _wait(self) -> None:
        for b, micro, h in self._handles:
            if h is not None:
                h.wait()
            self.buffers.settle(b, micro)
        self._handles.clear()
