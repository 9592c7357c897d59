"""ZeRO-3 after the optimizer step: each rank's weights redistributed from the updated master shards.

plan/buckets.py ``regathered_groups`` names the parameter device groups whose slices do not keep their weights
sharded as the masters are (a TP shard, a unit shared by slices on other device sets; a one-device group's
master is whole). Of such a unit a rank needs only what its slices keep:

- a *fed* gather unit (runtime/weight_shards.py ``GatherUnit``), whose every parameter is a master tensor as it
  is (a replicated tensor, or a TP shard of the slice's own degree: ``SliceKeys.own``), needs its DP shard: a few
  ranges of its runtime units' flat master vectors (``gather_unit_segments``), written straight into the shard;
- anything else (a slice with one DP rank, an operator gathered whole, a TP part of another degree than its
  unit's shards) needs its runtime units whole, loaded as full tensors.

Each rank states its needs once, when the engine is built (one ``all_gather_object``). After each step, per
bucket (the gradient buckets in ``gather_order``, the buckets the weights were all-gathered in before), one
``all_to_all_single`` over the bucket's group sends each member the pieces of its needs that this member's
master chunk holds, cast to the weights' dtype; the next bucket's is issued before this one is waited for. A
rank of a slice at DP d so receives about 1/d of what an all-gather moved it (plan/buckets.py
``redistributed_params``, what the cost model charges). Deadlock-free as the all-gathers were: every rank issues
its buckets in the one gather order, and a bucket that moves nothing anywhere is skipped by every member alike.

With --overlap-param-gather (plan/buckets.py ``overlaps_param_gather``) ``start`` issues every bucket's
all-to-all right after the step and returns; the engine lands a bucket (``land``) before the forward of the
first local slice holding one of its units (``pending_for``), and every pending one before anything reads the
weights. Deadlock-free as runtime/param_gather.py: every rank issues all of its buckets before it waits for
any, and waits depend on nothing but those issues.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_spindle.runtime import progress
from megatron_spindle.runtime.shards import UnitShard

Range = tuple[int, int]


@dataclass(frozen=True)
class Segment:
    """Elements ``[lo, hi)`` of runtime unit ``unit``'s flat vector, at ``pos`` in a gather unit's shard."""

    unit: str
    lo: int
    hi: int
    pos: int


def merged(ranges: Iterable[Range]) -> list[Range]:
    """Ranges sorted, overlapping and touching ones joined, empty ones dropped."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if hi <= lo:
            continue
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def pieces_in(needs: Mapping[str, Sequence[Range]], units: Sequence[str],
              chunk_of: Callable[[str], Range]) -> list[tuple[str, int, int]]:
    """The pieces (unit, lo, hi) of ``needs`` inside one member's chunks (``chunk_of``), in the order they travel:
    units in the bucket's order, each one's ranges ascending."""
    out = []
    for u in units:
        a, b = chunk_of(u)
        for lo, hi in needs.get(u, ()):
            lo, hi = max(lo, a), min(hi, b)
            if lo < hi:
                out.append((u, lo, hi))
    return out


def gather_unit_segments(keys: Sequence[str], params: Sequence[torch.Tensor], lo: int, hi: int,
                         where: Callable[[str], tuple[str, int, torch.Size] | None]) -> list[Segment] | None:
    """The segments making elements ``[lo, hi)`` of a gather unit's flat parameters (``keys`` / ``params`` in
    its order), given ``where(key)``: (runtime unit, offset of the key's tensor in that unit's flat vector,
    its shape), or None where the parameter is not a master tensor as it is. None if any is not."""
    out, pos = [], 0
    for k, p in zip(keys, params):
        found = where(k)
        if found is None or tuple(found[2]) != tuple(p.shape):
            return None
        unit, offset, _ = found
        a, b = max(pos, lo), min(pos + p.numel(), hi)
        if a < b:
            out.append(Segment(unit, offset + a - pos, offset + b - pos, a - lo))
        pos += p.numel()
    return out


def _elements(needs: Mapping[str, Sequence[Range]], units: Sequence[str],
              chunk_of: Callable[[str], Range] | None = None) -> int:
    """Elements of ``needs`` in ``units`` (inside the chunks ``chunk_of`` gives, when given)."""
    if chunk_of is None:
        return sum(hi - lo for u in units for lo, hi in needs.get(u, ()))
    return sum(hi - lo for _, lo, hi in pieces_in(needs, units, chunk_of))


@dataclass
class _Bucket:
    devices: tuple[int, ...]
    units: tuple[str, ...]
    send: list[tuple[str, int, int]]  # pieces this rank sends, member by member
    send_splits: list[int]
    recv: list[tuple[str, int, int]]  # pieces it receives, member by member
    recv_splits: list[int]
    moves: bool  # whether any member sends anything (the same answer on every member)


class WeightRedistribution:
    """One rank's side of the redistribution (module docstring). ``needs[r]``: rank r's needs (runtime unit ->
    merged ranges); ``fed``: this rank's fed gather units, each with its segments (writing ``unit.shard``);
    ``whole``: the runtime units this rank needs whole, returned as full tensors. ``received`` counts the
    elements the last ``stream`` received from the other members."""

    def __init__(self, buckets: Sequence[tuple[tuple[int, ...], Sequence[str]]], shards: Mapping[str, UnitShard],
                 needs: Sequence[Mapping[str, Sequence[Range]]], rank: int,
                 group_of: Callable[[tuple[int, ...]], object], fed: Sequence[tuple[object, list[Segment]]],
                 whole: set[str]):
        self.shards, self.group_of, self.rank, self.whole = shards, group_of, rank, whole
        self.fed = list(fed)
        self.received = 0
        self._landing: dict[str, list[tuple[object, Segment]]] = {}
        for g, segments in self.fed:
            for s in segments:
                self._landing.setdefault(s.unit, []).append((g, s))
        self.buckets = [self._bucket(tuple(sorted(devices)), tuple(units), needs) for devices, units in buckets]
        self.bucket_of = {u: i for i, b in enumerate(self.buckets) for u in b.units}
        self._pending: dict[int, tuple] = {}  # bucket index -> (received, work) of an all-to-all ``start`` issued

    def _bucket(self, devices: tuple[int, ...], units: tuple[str, ...],
                needs: Sequence[Mapping[str, Sequence[Range]]]) -> _Bucket:
        me = devices.index(self.rank)
        chunks = [(lambda u, j=j: self.shards[u].bounds(j)) for j in range(len(devices))]
        send = [pieces_in(needs[d], units, chunks[me]) for d in devices]
        recv = [pieces_in(needs[self.rank], units, chunks[j]) for j in range(len(devices))]
        # whether some member needs what another holds: then every member joins the all-to-all
        moves = any(_elements(needs[d], units) > _elements(needs[d], units, chunks[i]) for i, d in enumerate(devices))
        return _Bucket(devices, units, [p for ps in send for p in ps], [sum(h - lo for _, lo, h in ps) for ps in send],
                       [p for ps in recv for p in ps], [sum(h - lo for _, lo, h in ps) for ps in recv], moves)

    def prepare(self) -> None:
        """Before the step's writes: no fed unit holds full weights or has a gather in flight (its shard is about
        to change)."""
        for g, _ in self.fed:
            g.settle()
            g.free()

    def stream(self, masters: Mapping[str, torch.Tensor],
               dtype: torch.dtype) -> Iterator[tuple[tuple[str, ...], dict[str, torch.Tensor]]]:
        """Per bucket, in order: (its units, the full tensors of its ``whole`` units), once its pieces are in
        (the fed shards written). ``masters``: this rank's updated master shards."""
        self.received = 0
        following = self._issue(0, masters, dtype)
        for i, b in enumerate(self.buckets):
            pending, following = following, self._issue(i + 1, masters, dtype)
            progress.point("the weight redistribution after the optimizer step of", [list(b.devices)])
            yield b.units, self._land(b, *pending)

    @property
    def pending(self) -> bool:
        """Whether some bucket ``start`` issued is not landed yet."""
        return bool(self._pending)

    def start(self, masters: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
        """Issue every bucket's all-to-all at once (module docstring); ``land`` each before its pieces are used."""
        if self._pending:
            raise RuntimeError("ZeRO-3: a weight redistribution is still pending; land it before the next one")
        self.received = 0
        self._pending = {i: self._issue(i, masters, dtype) for i in range(len(self.buckets))}

    @property
    def pending_buckets(self) -> list[int]:
        """Every pending bucket, in issue order."""
        return sorted(self._pending)

    def pending_for(self, units: Iterable[str]) -> list[int]:
        """The pending buckets holding any of ``units``, in issue order."""
        return sorted({i for u in units if (i := self.bucket_of.get(u)) is not None and i in self._pending})

    def land(self, index: int) -> tuple[tuple[str, ...], dict[str, torch.Tensor]]:
        """Wait for pending bucket ``index`` and write its pieces (``stream``'s yield for that bucket)."""
        b = self.buckets[index]
        out, work = self._pending.pop(index)
        progress.point("the overlapped weight redistribution (params-all-gather) of", [list(b.devices)])
        return b.units, self._land(b, out, work)

    def _issue(self, index: int, masters: Mapping[str, torch.Tensor], dtype: torch.dtype):
        if index >= len(self.buckets):
            return None, None
        b = self.buckets[index]
        me = b.devices.index(self.rank)
        parts = []
        for u, lo, hi in b.send:
            start = self.shards[u].bounds(me)[0]
            parts.append(masters[u].detach()[lo - start:hi - start])
        send = torch.cat(parts).to(dtype) if parts else torch.empty(0, dtype=dtype)
        if not b.moves:  # everything this rank needs of it is its own
            return send, None
        out = send.new_empty(sum(b.recv_splits))
        work = dist.all_to_all_single(out, send, b.recv_splits, b.send_splits, group=self.group_of(b.devices),
                                      async_op=True)
        return out, work

    def _land(self, b: _Bucket, out: torch.Tensor, work) -> dict[str, torch.Tensor]:
        if work is not None:
            work.wait()
        me = b.devices.index(self.rank)
        self.received += sum(n for j, n in enumerate(b.recv_splits) if j != me)
        flats = {u: out.new_empty(self.shards[u].numel) for u in b.units if u in self.whole}
        dests, sources, offset = [], [], 0
        for u, lo, hi in b.recv:
            piece = out[offset:offset + hi - lo]
            offset += hi - lo
            if u in flats:
                dests.append(flats[u][lo:hi])
                sources.append(piece)
            for g, s in self._landing.get(u, ()):
                a, z = max(lo, s.lo), min(hi, s.hi)
                if a < z:
                    dests.append(g.shard[s.pos + a - s.lo:s.pos + z - s.lo])
                    sources.append(piece[a - lo:z - lo])
        if dests:
            torch._foreach_copy_(dests, sources)
        full: dict[str, torch.Tensor] = {}
        for u, flat in flats.items():
            full.update(self.shards[u].unflatten(flat))
        return full
