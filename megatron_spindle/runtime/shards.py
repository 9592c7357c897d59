"""Flat per-unit layout of the optimizer state, replicated or sharded over a parameter device group.

A parameter unit's tensors ("<unit>.<path>", sorted by name) are flattened, in that order, into one fp32 vector
of ``numel`` elements. Sharded over a group of ``members`` ranks (the group's devices sorted ascending), the
member with index ``index`` in that sorted list keeps elements ``[index * size, (index + 1) * size)`` with
``size = ceil(numel / members)``; the last shard(s) are zero-padded to ``size``. The replicated optimizer
(zero_stage 0) is the case ``members = 1``, ``index = 0``: the shard is the whole unit.

Collectives over a group move one buffer of ``members`` rows: row ``j`` is member ``j``'s shards of every unit
of the group (units in the group's order), so all units of a group travel in one all-gather. The gradient
buckets of ZeRO-1 and 2 (runtime/grad_shards.py) use the same member-major rows, so that a reduce-scatter of the buffer leaves
each member exactly its shards (``add_to_rows``, ``reduce_scatter_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def chunk_bounds(member: int, size: int, numel: int) -> tuple[int, int]:
    """Elements ``[lo, hi)`` of a flat vector of ``numel`` elements that member ``member`` holds in chunks of
    ``size`` (the rest of its chunk is padding; empty for the last members when ``numel`` is small)."""
    lo = min(member * size, numel)
    return lo, min(lo + size, numel)


@dataclass
class UnitShard:
    unit: str
    keys: list[str]  # sorted "<unit>.<path>" names
    shapes: list[torch.Size]
    members: int
    index: int

    def __post_init__(self):
        # storage-less tensors of the unit's shapes, which torch's unflatten reads them from (made here, not in a
        # training step)
        self._templates = [torch.empty(shape, device="meta") for shape in self.shapes]

    @property
    def numel(self) -> int:
        return sum(s.numel() for s in self.shapes)

    @property
    def size(self) -> int:
        """Elements of one shard (padding included)."""
        return -(-self.numel // self.members)

    @property
    def valid(self) -> int:
        """Elements of this member's shard that are the unit's (the rest of the last members' is padding)."""
        return max(0, min(self.size, self.numel - self.index * self.size))

    def flat(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Full tensors of the unit (name -> tensor) -> one flat vector of ``numel`` elements in their own dtype, by
        one C++ concatenation (torch's, as DDP flattens: no Python view per tensor); a view of the tensor when the
        unit has one."""
        return _flatten_dense_tensors([tensors[k] for k in self.keys])

    def flatten(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Full tensors of the unit (name -> tensor) -> one new flat fp32 vector of ``numel`` elements."""
        return self.flat(tensors).to(torch.float32, copy=True)

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """A flat vector of ``numel`` elements -> the unit's full tensors (views of ``flat``, made in C++ from
        shape templates: two Python views per tensor were host time in every weight load on a GPU)."""
        if any(shape.numel() == 0 for shape in self.shapes):  # torch's makes those 1-D: keep their shape
            return {k: flat[:0].view(shape) if shape.numel() == 0 else v
                    for k, shape, v in zip(self.keys, self.shapes, _unflatten_dense_tensors(flat, self._templates))}
        return dict(zip(self.keys, _unflatten_dense_tensors(flat, self._templates)))

    def bounds(self, member: int | None = None) -> tuple[int, int]:
        """Elements ``[lo, hi)`` of the unit's flat vector that group member ``member`` (default: this one)
        holds (``chunk_bounds``)."""
        return chunk_bounds(self.index if member is None else member, self.size, self.numel)

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """A full flat vector -> this member's shard (a new tensor of ``size`` elements, zero-padded)."""
        lo, hi = self.bounds()
        out = flat.new_zeros(self.size)
        out[:hi - lo] = flat[lo:hi]
        return out


def row_offsets(shards: list[UnitShard]) -> list[int]:
    """Column of each unit's shard in a row of member-major rows (units in order, ``size`` columns each)."""
    out, off = [], 0
    for s in shards:
        out.append(off)
        off += s.size
    return out


def add_to_rows(rows: torch.Tensor, offset: int, shard: UnitShard, tensors: dict[str, torch.Tensor]) -> None:
    """Add a unit's full tensors (name -> tensor, e.g. its gradients, in their own dtype) into member-major rows
    (``members`` x row length) at the unit's columns ``[offset, offset + size)``: member ``j``'s row gets the
    unit's flat elements ``[j*size, (j+1)*size)``. At most three operations per unit whatever its tensor count:
    one concatenation (``UnitShard.flat``), one add for the members' whole rows and one for the last partial row;
    the adds promote a bf16 gradient into the fp32 rows exactly as a cast would. A cast per tensor and an add per
    member were host time in every backward wave on a GPU."""
    add_flat_to_rows(rows, offset, shard, shard.flat(tensors))


def add_flat_to_rows(rows: torch.Tensor, offset: int, shard: UnitShard, flat: torch.Tensor) -> None:
    """``add_to_rows`` of the unit's flat vector (``numel`` elements, any dtype): one or two adds."""
    flat = flat.to(rows.device)
    whole, size = shard.numel // shard.size, shard.size  # members whose row the unit fills
    if whole:
        rows[:whole, offset:offset + size].add_(flat[:whole * size].view(whole, size))
    if whole * size < shard.numel:
        rows[whole, offset:offset + shard.numel - whole * size].add_(flat[whole * size:])


def reduce_scatter_rows(out: torch.Tensor, rows: torch.Tensor, group, scatter: bool = True):
    """Sum member-major rows over ``group`` (asynchronously): with ``scatter`` a reduce-scatter writes this
    member's summed row into ``out`` (``reduce_scatter_single``, torch 2.13's name of
    ``reduce_scatter_tensor``); without, an all-reduce of ``rows`` in place, after which the caller copies its
    row (``settle_rows``). Returns the work handle."""
    if scatter:
        return dist.reduce_scatter_single(out, rows.view(-1), group=group, async_op=True)
    return dist.all_reduce(rows, group=group, async_op=True)


def settle_rows(out: torch.Tensor, rows: torch.Tensor, index: int, scatter: bool = True,
                result: torch.Tensor | None = None) -> None:
    """After ``reduce_scatter_rows`` completed: this member's summed row added to ``out`` (already there after a
    reduce-scatter into ``out`` itself; ``result``: the row a reduce-scatter wrote beside it)."""
    if not scatter:
        out.add_(rows[index])
    elif result is not None:
        out.add_(result)


class PendingGather:
    """An all-gather of a group's unit shards in flight (``issue_gather``); ``wait`` finishes it once and returns
    the full flat vectors (``numel`` elements each), nested as the ``parts`` it was issued with."""

    def __init__(self, shards: list[UnitShard], counts: list[int], rows: torch.Tensor | None, work=None,
                 done: list[list[torch.Tensor]] | None = None):
        self.shards, self.counts, self.rows, self.work = shards, counts, rows, work
        self._done = done

    def wait(self) -> list[list[torch.Tensor]]:
        if self._done is None:
            if self.work is not None:
                self.work.wait()
            out, off = [], 0
            for s, n in zip(self.shards, self.counts):
                full = []
                for _ in range(n):
                    full.append(self.rows[:, off:off + s.size].reshape(-1)[:s.numel])
                    off += s.size
                out.append(full)
            self._done, self.rows, self.work = out, None, None
        return self._done


def issue_gather(shards: list[UnitShard], parts: list[list[torch.Tensor]], group,
                 async_op: bool = False, dtype: torch.dtype | None = None) -> PendingGather:
    """Start the all-gather of the shards of a group's units: ``parts[u]`` are same-layout shard vectors of unit
    ``u`` on this rank (e.g. master, exp_avg, exp_avg_sq; the same count on every member), packed into one row
    (a copy: the shards may change afterwards; ``dtype``: cast to it, e.g. the weights' bf16, so that the
    collective moves those bytes). Collective over ``group`` when the units are sharded (``async_op``: without
    waiting for it). Unsharded units need no communication: the result is ready (as given)."""
    if not shards or shards[0].members == 1:
        return PendingGather(shards, [len(ps) for ps in parts], None,
                             done=[[p[:s.numel] for p in ps] for s, ps in zip(shards, parts)])
    row = torch.cat([p.reshape(-1) for ps in parts for p in ps])
    if dtype is not None:
        row = row.to(dtype)
    rows = row.new_empty(shards[0].members, row.numel())
    work = dist.all_gather(list(rows.unbind(0)), row, group=group, async_op=async_op)
    return PendingGather(shards, [len(ps) for ps in parts], rows, work)


def gather_units(shards: list[UnitShard], parts: list[list[torch.Tensor]], group) -> list[list[torch.Tensor]]:
    """All-gather the shards of a group's units now (``issue_gather``, then wait): the full flat vectors
    (``numel`` elements each) in the nesting of ``parts``. Collective over ``group`` when the units are sharded."""
    return issue_gather(shards, parts, group).wait()
