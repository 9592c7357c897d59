"""Flat gradient buffers, one per parameter device group on each member, split into buckets.

Their dtype is the plan's ``grad_reduce_dtype`` (``GRAD_DTYPES``): fp32 main gradients, Megatron-LM's default for
bf16 training, or bf16 ones (``--grad-reduce-in-bf16``), which the engine casts to fp32 for the optimizer step.

A group's buffer holds its units one after the other, each flattened like its master (runtime/shards.py), in
the order the backward completes them (``backward_order``), so that consecutive units finish close in time
and a bucket, a contiguous range of whole units, is complete early. Buckets follow megatron-core DDP's
convention: units are added to the current bucket until it holds at least ``bucket_numel`` elements
(``--ddp-bucket-size``; default ``max(40M, 1M * group size)``, distributed_data_parallel_config.py). Layout and
buckets depend on the plan only, so every member of a group has the same ones.

``unit_grads`` / ``key_grads`` are views of the buffers: the unit's flat gradient and its full tensors.
``add`` / ``reduce`` / ``settle`` are what the gradient sync (grad_sync.py) asks of a bucket's storage; the
sharded storage of ZeRO-1 and 2 (grad_shards.py) answers the same calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_spindle.graph.opgraph import MetaGraph
from megatron_spindle.plan.buckets import (  # noqa: F401 - the bucket rules are plan/'s, shared with the simulator
    BUCKET_NUMEL_PER_MEMBER,
    DEFAULT_BUCKET_NUMEL,
    bucket_limit,
    completion_sorted,
    launch_key,
    split_buckets,
    unit_completion,
)
from megatron_spindle.plan.schema import Plan
from megatron_spindle.runtime.shards import UnitShard
from megatron_spindle.runtime.tp_shards import write_pairs

# the main gradients' dtype per plan setting grad_reduce_dtype (plan/schema.py REDUCE_DTYPE_BYTES)
GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def backward_order(plan: Plan, metagraph: MetaGraph) -> dict[str, tuple[int, int]]:
    """unit -> (wave, position in its slice, backward step) of the slice whose backward completes its gradient:
    over every slice of the plan holding it, the one whose backward runs last, and its lowest position there (a
    slice runs its layers' backward from last to first); plan/buckets.py ``unit_completion``."""
    return unit_completion([w.slices for w in plan.waves], metagraph.metaops, plan.settings)


@dataclass(frozen=True)
class Bucket:
    """Elements [start, end) of the buffer of the group ``devices``: whole units, in buffer order. ``done`` is
    the (wave, position) after which its last unit is complete (``backward_order``)."""

    devices: tuple[int, ...]
    index: int  # within its group
    units: tuple[str, ...]
    start: int
    end: int
    done: tuple  # plan/buckets.py Completion (wave, position, backward step) of its last unit

    @property
    def numel(self) -> int:
        return self.end - self.start


def launch_order(buckets: list[Bucket]) -> list[Bucket]:
    """The one order in which every rank issues the buckets' collectives: by completion in the backward
    (plan/buckets.py ``launch_key``), then by group and index. Buckets of one group come in index order (their units are
    in completion order), and any two ranks issue the buckets they share in the same relative order."""
    return sorted(buckets, key=lambda b: launch_key(b.done, b.devices, b.index))


class GradBuffers:
    """``buffers``: (sorted devices, flat buffer of ``dtype``) per group this rank holds units of; ``buckets`` in
    ``launch_order``; ``unit_grads`` unit -> flat view; ``key_grads`` "<unit>.<path>" -> full-shape view."""

    sharded = False

    def __init__(self, unit_groups: list[tuple[tuple[int, ...], list[str]]], shards: dict[str, UnitShard],
                 order: dict[str, tuple[int, int]], bucket_numel: int | None, device: torch.device,
                 dtype: torch.dtype = torch.float32):
        self.dtype = dtype
        self.buffers: list[tuple[tuple[int, ...], torch.Tensor]] = []
        self.unit_grads: dict[str, torch.Tensor] = {}
        self.key_grads: dict[str, torch.Tensor] = {}
        buckets: list[Bucket] = []
        self._views: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}
        for devices, units in unit_groups:
            units, group_buckets = buffer_layout(devices, units, shards, order, bucket_numel)
            buf = torch.zeros(sum(shards[u].numel for u in units), dtype=dtype, device=device)
            off = 0
            for u in units:
                self.unit_grads[u] = buf[off:off + shards[u].numel]
                self.key_grads.update(shards[u].unflatten(self.unit_grads[u]))
                off += shards[u].numel
            for b in group_buckets:
                buckets.append(b)
                self._views[b.devices, b.index] = buf[b.start:b.end]
            self.buffers.append((devices, buf))
        self.buckets = launch_order(buckets)

    def view(self, b: Bucket) -> torch.Tensor:
        """The bucket's elements of its group's buffer (a contiguous view)."""
        return self._views[b.devices, b.index]

    def add(self, grads: dict[str, torch.Tensor], keys: list[str], micro: int = 0) -> None:
        """Add full gradients of ``keys`` into the buffers (whatever the micro-batch: they accumulate); a TP rank's
        ``LocalPart`` of one is added where it sits."""
        accs, parts = write_pairs([self.key_grads[k] for k in keys], [grads[k] for k in keys])
        if accs:
            # one call for all keys: a bf16 gradient promotes into an fp32 buffer exactly as a cast would, and
            # a cast and an add per tensor from Python were host time in every backward wave on a GPU
            torch._foreach_add_(accs, parts)

    def reduce(self, b: Bucket, group, micro: int = 0):
        """Start the bucket's all-reduce over its group (None for a one-device group)."""
        return None if group is None else dist.all_reduce(self.view(b), group=group, async_op=True)

    def settle(self, b: Bucket, micro: int = 0) -> None:
        """The bucket's all-reduce completed: the buffer holds the sum in place."""

    def storage(self) -> list[torch.Tensor]:
        """The gradients this rank holds for the step (the group buffers)."""
        return [buf for _, buf in self.buffers]

    def held_bytes(self) -> int:
        return sum(buf.numel() * buf.element_size() for _, buf in self.buffers)

    def zero_(self) -> None:
        for _, buf in self.buffers:
            buf.zero_()


def buffer_layout(devices: tuple[int, ...], units: list[str], shards: dict[str, UnitShard],
                  order: dict[str, tuple[int, int]], bucket_numel: int | None) -> tuple[list[str], list[Bucket]]:
    """A group's units in buffer order (completion in the backward) and its buckets (``bucket_numel``, None:
    megatron's default for the group's size)."""
    units = completion_sorted(units, order)
    limit = bucket_limit(bucket_numel, len(devices))
    return units, _split(devices, units, shards, order, limit)


def _split(devices: tuple[int, ...], units: list[str], shards: dict[str, UnitShard],
           order: dict[str, tuple[int, int]], limit: int) -> list[Bucket]:
    """Whole units, in buffer order, closed once a bucket holds at least ``limit`` elements (plan/buckets.py)."""
    out: list[Bucket] = []
    start = 0
    for members in split_buckets(units, lambda u: shards[u].numel, limit):
        end = start + sum(shards[u].numel for u in members)
        out.append(Bucket(devices, len(out), tuple(members), start, end, order[members[-1]]))
        start = end
    return out
