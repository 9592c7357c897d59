"""ZeRO stages 1 and 2: gradient buckets reduce-scattered into this rank's shard, the only part it keeps.

The buckets are grad_buffers.py's (same units, same launch order, so the gradient sync and the simulator see
one set of rules); only their storage differs. Each bucket of a group of ``members`` ranks has

- a *staging* buffer of ``members`` x ``row`` elements (of the main gradients' dtype: fp32, or bf16 with
  ``--grad-reduce-in-bf16``), member-major (runtime/shards.py): row ``j``
  holds member ``j``'s shards of the bucket's units. It is allocated when the bucket's first gradient is
  added (the exported gradients of a slice's micro-batch, runtime/grad_sync.py) and released as soon as
  the bucket's collective has completed;
- this rank's *shard row* of ``row`` elements, kept for the optimizer step: ``unit_grads[u]`` is unit ``u``'s
  shard (``UnitShard.size`` elements, zero-padded), the master's ``.grad`` (runtime/optimizer.py).

The collective is a reduce-scatter of the staging buffer into the shard row (``reduce_scatter_single``: NCCL
and, in torch 2.13, gloo), or, with ``reduce_scatter=False`` (a backend without one), an all-reduce of the
staging buffer and a copy of this rank's row. Numerically both are the full sum, sliced.

Micro-batches: a rank that keeps only shards cannot accumulate the full gradient, so every micro-batch's
buckets are reduce-scattered after its backward (DeepSpeed's way; plan/buckets.py ``synced_micro_batches``,
which the simulator charges). Each micro-batch has its own staging buffers, so one micro-batch's collectives
may still run while the next one adds its gradients; a completed collective adds its result to the shard row
(a step's first reduce-scatter of a bucket writes into the zeroed row directly). Likewise with a round per
segment (plan/buckets.py ``sync_rounds``): the ``micro`` key of ``add`` / ``reduce`` / ``settle`` is then the
round's (micro-batch, segment), so no full gradient outlives its segment's round. ZeRO-1 (the distributed
optimizer) uses the same buffers with the micro-batches accumulated in the operators, as at stage 0: one
round per step, after the last micro-batch.
"""

from __future__ import annotations

import torch

from megatron_spindle.runtime.grad_buffers import Bucket, buffer_layout, launch_order
from megatron_spindle.runtime.shards import (
    UnitShard,
    add_flat_to_rows,
    add_to_rows,
    reduce_scatter_rows,
    row_offsets,
    settle_rows,
)
from megatron_spindle.runtime.tp_shards import LocalPart, write_pairs


def _placed_flat(sh: UnitShard, grads: dict, device: torch.device) -> torch.Tensor:
    """The unit's flat fp32 gradient vector from full tensors and ``LocalPart``s: one zeroed vector, one copy."""
    flat = torch.zeros(sh.numel, dtype=torch.float32, device=device)
    views = sh.unflatten(flat)
    torch._foreach_copy_(*write_pairs([views[k] for k in sh.keys], [grads[k] for k in sh.keys]))
    return flat


REDUCE_SCATTER_BACKENDS = ("nccl", "gloo")  # have reduce_scatter_single (gloo: in torch 2.13, measured)


def backend_reduces_scatter(backend: str) -> bool:
    """Whether every part of a torch.distributed backend string (e.g. "cpu:gloo,cuda:nccl") reduce-scatters."""
    return all(part.split(":")[-1] in REDUCE_SCATTER_BACKENDS for part in str(backend).split(","))


class ShardedGradBuffers:
    """``buckets`` in launch order (grad_buffers.py's); ``unit_grads`` unit -> this rank's gradient shard;
    ``key_grads`` empty (nobody holds a unit's full gradient after the sync)."""

    sharded = True

    def __init__(self, unit_groups: list[tuple[tuple[int, ...], list[str]]], shards: dict[str, UnitShard],
                 order: dict[str, tuple[int, int]], bucket_numel: int | None, device: torch.device,
                 reduce_scatter: bool = True, dtype: torch.dtype = torch.float32):
        self.shards, self.device, self.reduce_scatter, self.dtype = shards, device, reduce_scatter, dtype
        self.unit_grads: dict[str, torch.Tensor] = {}
        self.key_grads: dict[str, torch.Tensor] = {}
        self.key_unit = {k: u for u, sh in shards.items() for k in sh.keys}
        buckets: list[Bucket] = []
        self._rows: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}  # bucket -> this rank's shard row
        self._staging: dict[tuple, torch.Tensor] = {}  # (bucket, micro-batch) -> members x row, while live
        self._results: dict[tuple, torch.Tensor] = {}  # (bucket, micro-batch) -> its row, beside an earlier sum
        self._written: set[tuple[tuple[int, ...], int]] = set()  # buckets whose row a collective wrote this step
        self._place: dict[str, tuple[tuple[tuple[int, ...], int], int]] = {}  # unit -> (bucket, column)
        for devices, units in unit_groups:
            for b in buffer_layout(devices, units, shards, order, bucket_numel)[1]:
                members = [shards[u] for u in b.units]
                row = torch.zeros(sum(s.size for s in members), dtype=dtype, device=device)
                for u, off in zip(b.units, row_offsets(members)):
                    self.unit_grads[u] = row[off:off + shards[u].size]
                    self._place[u] = ((b.devices, b.index), off)
                self._rows[b.devices, b.index] = row
                buckets.append(b)
        self.buckets = launch_order(buckets)
        self._members = {(b.devices, b.index): self.shards[b.units[0]].members for b in buckets}

    def _staging_of(self, key: tuple[tuple[int, ...], int], micro: int) -> torch.Tensor:
        if (key, micro) not in self._staging:
            self._staging[key, micro] = torch.zeros(self._members[key], self._rows[key].numel(),
                                                    dtype=self.dtype, device=self.device)
        return self._staging[key, micro]

    def add(self, grads: dict[str, torch.Tensor], keys: list[str], micro: int = 0) -> None:
        """Add full gradients (every key of each unit named in ``keys``) into micro-batch ``micro``'s staging; a
        unit with a TP rank's ``LocalPart`` is first written into one zeroed flat vector, each part where it sits
        (no full tensor per parameter)."""
        for u in dict.fromkeys(self.key_unit[k] for k in keys):
            sh = self.shards[u]
            key, off = self._place[u]
            if any(isinstance(grads[k], LocalPart) for k in sh.keys):
                add_flat_to_rows(self._staging_of(key, micro), off, sh, _placed_flat(sh, grads, self.device))
            else:
                add_to_rows(self._staging_of(key, micro), off, sh, grads)

    def reduce(self, b: Bucket, group, micro: int = 0):
        """Start the sum of micro-batch ``micro``'s bucket over its group (None for a one-device group: nothing
        to wait for)."""
        key = (b.devices, b.index)
        staging, row = self._staging_of(key, micro), self._rows[key]  # a TP follower adds nothing: zeros
        if group is None:
            return None
        if self.reduce_scatter and key in self._written:  # the row holds an earlier sum: reduce beside it
            self._results[key, micro] = torch.empty_like(row)
        self._written.add(key)
        return reduce_scatter_rows(self._results.get((key, micro), row), staging, group, self.reduce_scatter)

    def settle(self, b: Bucket, micro: int = 0) -> None:
        """Micro-batch ``micro``'s collective of the bucket has completed: its sum of this rank's row is added
        to the shard row, and its staging buffer is released."""
        key = (b.devices, b.index)
        staging = self._staging.pop((key, micro))
        scattered = self.reduce_scatter and len(b.devices) > 1  # a one-device group: its only row
        settle_rows(self._rows[key], staging, self.shards[b.units[0]].index, scattered,
                    self._results.pop((key, micro), None))

    def storage(self) -> list[torch.Tensor]:
        """The gradients this rank holds for the step (the shard rows)."""
        return list(self._rows.values())

    def held_bytes(self) -> int:
        """Bytes of gradient storage allocated now: the shard rows and the staging buffers still live."""
        return sum(t.numel() * t.element_size()
                   for t in [*self._rows.values(), *self._staging.values(), *self._results.values()])

    def zero_(self) -> None:
        self._staging.clear()
        self._results.clear()
        self._written.clear()
        for row in self._rows.values():
            row.zero_()
