"""Flat fp32 gradient buffers, one per parameter device group on each member, split into buckets.

A group's buffer holds its units one after the other, each flattened like its master (runtime/shards.py), in
the order the backward completes them (``backward_order``), so that consecutive units finish close in time
and a bucket, a contiguous range of whole units, is complete early. Buckets follow megatron-core DDP's
convention: units are added to the current bucket until it holds at least ``bucket_numel`` elements
(``--ddp-bucket-size``; default ``max(40M, 1M * group size)``, distributed_data_parallel_config.py). Layout and
buckets depend on the plan only, so every member of a group has the same ones.

``unit_grads`` / ``key_grads`` are views of the buffers: the unit's flat gradient and its full tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_spindle.graph.opgraph import MetaGraph
from megatron_spindle.plan.schema import Plan
from megatron_spindle.runtime.layout import slice_units
from megatron_spindle.runtime.shards import UnitShard

DEFAULT_BUCKET_NUMEL = 40_000_000  # megatron-core DDP: max(40M, 1M * dp size) parameters per bucket
BUCKET_NUMEL_PER_MEMBER = 1_000_000


def default_bucket_numel(members: int) -> int:
    return max(DEFAULT_BUCKET_NUMEL, BUCKET_NUMEL_PER_MEMBER * members)


def backward_order(plan: Plan, metagraph: MetaGraph) -> dict[str, tuple[int, int]]:
    """unit -> (wave, position in its slice) of the last backward that accumulates its gradient, over every
    slice of the plan holding it. The backward runs waves from last to first, and a slice's layers from last
    to first, so a unit is complete after the slice with the smallest (wave, position); a larger pair
    completes earlier."""
    last: dict[str, tuple[int, int]] = {}
    for wi, wave in enumerate(plan.waves):
        for s in wave.slices:
            for pos, u in enumerate(slice_units(metagraph, s)):
                last[u] = min(last.get(u, (wi, pos)), (wi, pos))
    return last


@dataclass(frozen=True)
class Bucket:
    """Elements [start, end) of the buffer of the group ``devices``: whole units, in buffer order. ``done`` is
    the (wave, position) after which its last unit is complete (``backward_order``)."""

    devices: tuple[int, ...]
    index: int  # within its group
    units: tuple[str, ...]
    start: int
    end: int
    done: tuple[int, int]

    @property
    def numel(self) -> int:
        return self.end - self.start


def launch_order(buckets: list[Bucket]) -> list[Bucket]:
    """The one order in which every rank issues the buckets' collectives: by completion in the backward
    (latest wave first), then by group and index. Buckets of one group come in index order (their units are
    in completion order), and any two ranks issue the buckets they share in the same relative order."""
    return sorted(buckets, key=lambda b: (-b.done[0], -b.done[1], b.devices, b.index))


class GradBuffers:
    """``buffers``: (sorted devices, flat fp32 buffer) per group this rank holds units of; ``buckets`` in
    ``launch_order``; ``unit_grads`` unit -> flat view; ``key_grads`` "<unit>.<path>" -> full-shape view."""

    def __init__(self, unit_groups: list[tuple[tuple[int, ...], list[str]]], shards: dict[str, UnitShard],
                 order: dict[str, tuple[int, int]], bucket_numel: int | None, device: torch.device):
        self.buffers: list[tuple[tuple[int, ...], torch.Tensor]] = []
        self.unit_grads: dict[str, torch.Tensor] = {}
        self.key_grads: dict[str, torch.Tensor] = {}
        buckets: list[Bucket] = []
        self._views: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}
        for devices, units in unit_groups:
            units = sorted(units, key=lambda u: (-order[u][0], -order[u][1], u))
            buf = torch.zeros(sum(shards[u].numel for u in units), dtype=torch.float32, device=device)
            off = 0
            for u in units:
                self.unit_grads[u] = buf[off:off + shards[u].numel]
                self.key_grads.update(shards[u].unflatten(self.unit_grads[u]))
                off += shards[u].numel
            limit = bucket_numel if bucket_numel is not None else default_bucket_numel(len(devices))
            for b in _split(devices, units, shards, order, limit):
                buckets.append(b)
                self._views[b.devices, b.index] = buf[b.start:b.end]
            self.buffers.append((devices, buf))
        self.buckets = launch_order(buckets)

    def view(self, b: Bucket) -> torch.Tensor:
        """The bucket's elements of its group's buffer (a contiguous view)."""
        return self._views[b.devices, b.index]

    def zero_(self) -> None:
        for _, buf in self.buffers:
            buf.zero_()


def _split(devices: tuple[int, ...], units: list[str], shards: dict[str, UnitShard],
           order: dict[str, tuple[int, int]], limit: int) -> list[Bucket]:
    """Whole units, in buffer order, closed once a bucket holds at least ``limit`` elements."""
    out: list[Bucket] = []
    start = off = 0
    members: list[str] = []
    for i, u in enumerate(units):
        members.append(u)
        off += shards[u].numel
        if off - start >= limit or i == len(units) - 1:
            out.append(Bucket(devices, len(out), tuple(members), start, off, order[members[-1]]))
            start, members = off, []
    return out
