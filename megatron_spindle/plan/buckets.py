"""Gradient buckets of a plan: in which order the backward completes each parameter unit, how a parameter
device group's units are cut into buckets, and the one order in which every rank issues the buckets.

The runtime (runtime/grad_buffers.py, grad_sync.py) lays out and reduces its gradient buffers by these rules,
and the simulator times the same buckets, so both agree on what is reduced when:

- **Completion.** A unit's gradient is complete after the last backward that accumulates it: over every slice
  holding it, the one whose wave runs its backward last (plan/order.py's execution order: reverse wave order,
  ``backward_order``, segments or an explicit ``order``), and in that slice the unit's layer (a slice runs
  its layers' backward from last to first, so a lower position completes later). ``unit_completion`` gives
  per unit that slice's wave, the unit's position and the slice's backward step (``Completion``).
- **Buckets.** A group's units in completion order, whole units, closed once a bucket holds at least
  ``bucket_limit`` elements: the plan's ``ddp_bucket_size`` (Megatron-LM's ``--ddp-bucket-size``), else
  megatron-core DDP's default ``max(40M, 1M * group size)`` (distributed_data_parallel_config.py). Without
  ``overlap_grad_reduce`` every bucket is issued after the device's whole backward.
- **Launch order.** Buckets by the completion of their last unit (backward step, then position), then by
  group and index: buckets of one group come in index order, and any two ranks issue the buckets they share
  in the same relative order.
- **Micro-batches.** With m micro-batches the gradients accumulate in full over them and the buckets are
  reduced once, after the last micro-batch's accumulations; under ZeRO-2 and 3 a rank keeps only its shard of
  the gradient, so every micro-batch's buckets are reduce-scattered after its backward (DeepSpeed's way),
  ``synced_micro_batches``.
- **Rounds per segment.** Likewise under ZeRO-2 and 3, a plan with ``segments`` (plan/order.py) reduce-scatters
  after each segment's backward (``sync_rounds``: one round per segment of each synced micro-batch), as
  DeepSpeed does after every backward call: no rank holds a unit's full gradient from one segment to the next.
  A round reduces the buckets holding a unit that its segment's slices accumulate, every member of the group
  joining (a member that accumulates none of them there adds zeros), in the round's own launch order: the
  order above with each bucket's completion taken among the round's slices (``round_buckets``). A unit shared
  by k segments is reduced k times. Otherwise (ZeRO 0 and 1, or one segment) there is one round of every wave.
- **Weight gathers after the step** (``regathered_groups``): at ZeRO 1 and 2 every group's, at ZeRO 3 only
  those whose slices do not keep their weights sharded as the masters are. Bucket by bucket (the gradient
  buckets, in ``gather_order``), in the weights' dtype, one after another: a rank holds one or two buckets'
  gathered weights at a time, not every group's.
- **ZeRO-3's weights redistributed** (``redistributed_params``): a regathered group's members do not all-gather
  its updated weights at ZeRO-3; each receives, from the members whose master shards cover them, only the
  weights its slices keep (runtime/weight_redistribution.py), one all-to-all per bucket: a slice's DP shard of
  each unit, or the unit's whole TP shard where the slice has one DP rank or another TP degree than the
  group's shards (a rank receives 1/d of what an all-gather moved it for a slice at DP d).
- **Overlapped weight gathers** (``settings.overlap_param_gather``, Megatron's ``--overlap-param-gather``, at
  ZeRO 1, 2 and 3): after the optimizer step the updated weights are all-gathered (ZeRO-3: redistributed)
  bucket by bucket (the gradient buckets), issued at once in the order the next forward first uses them
  (``gather_order``: the first forward step using one of the bucket's units, then that unit's position, then
  group and index). At ZeRO 1 and 2 a layer's forward waits only for its own bucket; at ZeRO-3 a slice's
  forward waits for every bucket of its units before its first layer (``weights_wanted_at``), since a layer's
  weight shard must be in before the gather that the layer ahead of it issues.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from typing import NamedTuple, TypeVar

from megatron_spindle.graph.opgraph import MetaOp
from megatron_spindle.plan.layout import SliceGeometry, slice_units, weight_shard_degree, weight_shard_group
from megatron_spindle.plan.order import BWD, FWD, segments_of, slice_order
from megatron_spindle.plan.schema import ExecutionSettings

_B = TypeVar("_B")
DEFAULT_BUCKET_NUMEL = 40_000_000  # megatron-core DDP: max(40M, 1M * dp size) parameters per bucket
BUCKET_NUMEL_PER_MEMBER = 1_000_000

class Completion(NamedTuple):
    """Where the backward completes a unit: the slice's wave and the unit's position in it, and that slice's
    backward step in the plan's order (``slice_order``: 0 runs first)."""

    wave: int
    pos: int
    step: int


def completion_key(done) -> tuple:
    """Sort key by completion time: the backward step, then the position (lower positions complete later). A
    bare (wave, position) pair (the default order, where waves run backward in reverse) sorts latest wave
    first."""
    if len(done) > 2:
        return (done[2], -done[1])
    return (-done[0], -done[1])


def bucket_limit(ddp_bucket_size: int | None, members: int) -> int:
    """Elements per bucket of a parameter device group of ``members`` devices: ``ddp_bucket_size`` (a plan's
    setting), else megatron-core's default for the group's size."""
    if ddp_bucket_size is not None:
        return ddp_bucket_size
    return max(DEFAULT_BUCKET_NUMEL, BUCKET_NUMEL_PER_MEMBER * members)


def unit_completion(waves: Sequence[Sequence[SliceGeometry]], metaops: Mapping[str, MetaOp],
                    settings: ExecutionSettings, among: Container[int] | None = None) -> dict[str, Completion]:
    """unit -> (wave, position) of the slice whose backward completes it (module docstring): over the slices
    holding it (of the waves ``among``, default all), the one whose backward runs last in the plan's order
    (plan/order.py ``slice_order``), and in it the unit's position (the lowest, completed last). With the
    default order this is the smallest (wave, position)."""
    tasks = [[metaops[s.metaop].task for s in slices] for slices in waves]
    step = {(wi, si): k for k, (wi, si, phase) in enumerate(slice_order(tasks, settings)) if phase == BWD}
    last: dict[str, Completion] = {}
    for wi, slices in enumerate(waves):
        if among is not None and wi not in among:
            continue
        for si, s in enumerate(slices):
            for pos, u in enumerate(slice_units(metaops[s.metaop], s.layer_start, s.layer_end)):
                done = Completion(wi, pos, step[(wi, si)])
                if u not in last or completion_key(done) > completion_key(last[u]):
                    last[u] = done
    return last


def completion_sorted(units: Sequence[str], completion: Mapping[str, Completion]) -> list[str]:
    """Units in buffer order: by completion in the backward (ties by name)."""
    return sorted(units, key=lambda u: (completion_key(completion[u]), u))


def split_buckets(units: Sequence[str], numel: Callable[[str], int], limit: int) -> list[list[str]]:
    """Whole units, in the given order, closed once a bucket holds at least ``limit`` elements."""
    out: list[list[str]] = []
    members: list[str] = []
    size = 0
    for i, u in enumerate(units):
        members.append(u)
        size += numel(u)
        if size >= limit or i == len(units) - 1:
            out.append(members)
            members, size = [], 0
    return out


def launch_key(done: Completion, devices: Sequence[int], index: int) -> tuple:
    """Sort key of a bucket in the plan-wide launch order: ``done`` is the completion of its last unit, then
    the group and the index."""
    return (completion_key(done), tuple(devices), index)


def synced_micro_batches(zero_stage: int, micro_batches: int) -> range:
    """The micro-batches whose backward is followed by the gradient buckets' reduction (see the module's
    docstring): the last one, or every one when the ZeRO stage shards the gradients."""
    return range(micro_batches) if zero_stage >= 2 else range(micro_batches - 1, micro_batches)


def sync_rounds(num_waves: int, settings: ExecutionSettings) -> list[list[int]]:
    """The waves whose backward each gradient round of a synced micro-batch follows (module docstring): each
    segment's under ZeRO 2 and 3, else one round of every wave."""
    if settings.zero_stage >= 2:
        return segments_of(num_waves, settings)
    return [list(range(num_waves))]


def wave_rounds(num_waves: int, settings: ExecutionSettings) -> list[int]:
    """The gradient round (``sync_rounds``) of each wave."""
    out = [0] * num_waves
    for r, waves in enumerate(sync_rounds(num_waves, settings)):
        for w in waves:
            out[w] = r
    return out


def round_completions(waves: Sequence[Sequence[SliceGeometry]], metaops: Mapping[str, MetaOp],
                      settings: ExecutionSettings) -> list[dict[str, Completion]]:
    """Per gradient round (``sync_rounds``): unit -> its completion among the round's slices (only the units
    they accumulate)."""
    return [unit_completion(waves, metaops, settings, set(r)) for r in sync_rounds(len(waves), settings)]


def round_done(units: Iterable[str], completion: Mapping[str, Completion],
               unit: Callable[[str], str] = str) -> Completion | None:
    """When a round completes a bucket of ``units`` (each the plan's unit ``unit(u)``: the runtime's TP shard
    completes with its unit): the completion of the last of them it accumulates (None: it accumulates none)."""
    done = [completion[unit(u)] for u in units if unit(u) in completion]
    return max(done, key=completion_key) if done else None


def round_buckets(buckets: Iterable[_B], completion: Mapping[str, Completion],
                  unit: Callable[[str], str] = str) -> list[tuple[_B, Completion]]:
    """The buckets (anything with ``units``, ``devices`` and ``index``: the runtime's and the simulator's) one
    round reduces, each with its completion there (``round_done``), in the round's launch order."""
    out = [(b, d) for b in buckets if (d := round_done(b.units, completion, unit)) is not None]
    return sorted(out, key=lambda bd: launch_key(bd[1], bd[0].devices, bd[0].index))


def synced_rounds(waves: Sequence[Sequence[SliceGeometry]], metaops: Mapping[str, MetaOp],
                  settings: ExecutionSettings, buckets: Sequence[_B],
                  unit: Callable[[str], str] = str) -> list[list[tuple[_B, Completion]]] | None:
    """Each gradient round's buckets (``round_buckets``) of a synced micro-batch, in its launch order, each with
    its completion in the round; None where the plan has one round (every bucket, completed as laid out)."""
    rounds = round_completions(waves, metaops, settings)
    if len(rounds) == 1:
        return None
    return [round_buckets(buckets, completion, unit) for completion in rounds]


def regathered_groups(waves: Sequence[Sequence[SliceGeometry]], metaops: Mapping[str, MetaOp],
                      groups: Sequence[tuple[Sequence[int], Sequence[str]]], zero_stage: int,
                      scope: int | None = None) -> list[bool]:
    """Per parameter device group (devices, units): whether the optimizer step is followed by an all-gather of
    the group's updated weights over its devices.

    - ZeRO 0: never (every holder steps the whole master).
    - ZeRO 1 and 2: always (each member stepped its shard; every holder loads the full weights).
    - ZeRO 3 (runtime/weight_shards.py): each slice keeps its DP shard of its weights. Where every slice holding
      the group's units runs with TP 1 on exactly the group's devices, that shard is the member's master shard
      (same units, same flat layout, same members), cast: nothing to gather, as in DeepSpeed ZeRO-3. Elsewhere
      (a TP shard, or a unit shared by slices on other device sets, or weight shards confined to a node,
      ``scope``: plan/layout.py ``weight_scope``) the updated weights are redistributed and each slice keeps
      its shard of them."""
    if zero_stage not in (1, 2, 3):
        return [False] * len(groups)
    if zero_stage in (1, 2):
        return [True] * len(groups)
    holders = unit_holders(waves, metaops)
    out = []
    for devices, units in groups:  # the slice's DP ranks in the group's (sorted) member order
        own = sorted(devices)
        out.append(any(s.tp != 1 or list(s.devices or ()) != own or weight_shard_degree(s, scope) != s.dp
                       for u in units for s in holders.get(u, ())))
    return out


def redistributed_params(holders: Mapping[str, Sequence[SliceGeometry]], units: Iterable[str], degree: int,
                         param_count: Callable[[str], float], scope: int | None = None) -> dict[int, float]:
    """ZeRO-3, one bucket ``units`` of a regathered group whose TP shards have degree ``degree`` (``group_tp``):
    per member device, the parameters it needs when the updated weights are redistributed after the step (what
    it receives, counted with the part its own master chunk holds; module docstring; ``holders``:
    ``unit_holders``). Of a unit ``p`` a device keeps, per slice holding it there, its chunk of its TP part
    ``p / degree`` over the ``n`` devices of its weight shard group (the slice's DP ranks, or with a ``scope``
    those on its node: plan/layout.py ``weight_shard_group``) where the slice's TP is the shards' degree, else
    the whole TP part. Slices whose chunks are the same (the same ``n`` and position in it) count once, and a
    device needs at most ``p / degree``. The runtime's chunks are whole elements (``ceil``) and it sends an
    operator it cannot map onto the masters (a stand-in without unit modules) whole; this counts neither."""
    need: dict[int, float] = {}
    for u in units:
        whole = param_count(u) / degree
        chunks: dict[int, set[tuple[int, int]]] = {}  # device -> (n, position) of its chunks; (1, 0): whole
        for s in holders.get(u, ()):
            for d in s.devices or ():
                group = weight_shard_group(s.devices, s.tp, d, scope) if s.tp == degree else (d,)
                chunks.setdefault(d, set()).add((len(group), group.index(d)))
        for d, mine in chunks.items():
            need[d] = need.get(d, 0.0) + min(whole, sum(whole / n for n, _ in mine))
    return need


def regather_collective(zero_stage: int, holders: Mapping[str, Sequence[SliceGeometry]], units: Sequence[str],
                        degree: int, share: float, param_count: Callable[[str], float],
                        scope: int | None = None) -> tuple[str, float]:
    """(collective, parameters on its busiest ring) of one regathered bucket's weights after the step: at ZeRO-3
    an all-to-all of what its busiest member receives (``redistributed_params``), else an all-gather of the
    bucket's TP shard (``share`` of its parameters: plan/tp_shards.py ``GroupRing.share``)."""
    if zero_stage == 3:
        return "all_to_all", max(redistributed_params(holders, units, degree, param_count, scope).values(),
                                 default=0.0)
    return "all_gather", sum(param_count(u) for u in units) * share


def unit_holders(waves: Sequence[Sequence[SliceGeometry]],
                 metaops: Mapping[str, MetaOp]) -> dict[str, list[SliceGeometry]]:
    """unit -> every slice holding it, in wave order."""
    holders: dict[str, list[SliceGeometry]] = {}
    for slices in waves:
        for s in slices:
            for u in slice_units(metaops[s.metaop], s.layer_start, s.layer_end):
                holders.setdefault(u, []).append(s)
    return holders


def group_tp(waves: Sequence[Sequence[SliceGeometry]], metaops: Mapping[str, MetaOp],
             groups: Sequence[Sequence[str]], settings: ExecutionSettings) -> list[int]:
    """Per parameter device group (its units): the TP degree of the gradient shard each of its rings reduces,
    and of the weights' shard gathered after the step.

    - ``settings.tp_sharded_grads`` (Megatron-LM's, DeepSpeed's layout): the greatest common divisor of the TPs
      of the slices holding its units (1 when none does; the smallest of them for powers of two). A unit held at
      TP 2 and TP 4 is reduced in the TP-2 shard's layout, so each ring carries 1/2 of its gradient; the TP-4
      ranks' parts nest in those shards (plan/tp_shards.py).
    - Otherwise (our runtime's canonical layout): 1. Whole units, over one ring of every member, whatever TP
      holds them: a TP rank's contribution is zero outside its shard, but the buffer is reduced in full."""
    if not settings.tp_sharded_grads:
        return [1] * len(groups)
    holders = unit_holders(waves, metaops)
    return [math.gcd(*(s.tp for u in units for s in holders.get(u, ()))) or 1 for units in groups]


def overlaps_param_gather(settings: ExecutionSettings) -> bool:
    """Whether the weights' all-gather (ZeRO-3: redistribution) after the step is deferred to the next forward
    (Megatron's --overlap-param-gather): at ZeRO 1, 2 and 3 with the setting on."""
    return settings.overlap_param_gather and settings.zero_stage in (1, 2, 3)


def weights_wanted_at(zero_stage: int, operator: int) -> int:
    """With the overlapped weight gathers: before which of a slice's operators (its index in the slice) the
    forward waits for the bucket of a unit whose first operator there is ``operator`` (module docstring): that one
    at ZeRO 1 and 2, the slice's first at ZeRO-3."""
    return 0 if zero_stage == 3 else operator


class FirstUse(NamedTuple):
    """Where the forward first uses a unit: the forward step in the plan's order (``slice_order``: 0 runs first)
    and the unit's position in that slice (its layers run forward first to last)."""

    step: int
    pos: int


def unit_first_use(waves: Sequence[Sequence[SliceGeometry]], metaops: Mapping[str, MetaOp],
                   settings: ExecutionSettings) -> dict[str, FirstUse]:
    """unit -> the earliest forward step that uses it, and its position there (module docstring)."""
    tasks = [[metaops[s.metaop].task for s in slices] for slices in waves]
    first: dict[str, FirstUse] = {}
    for k, (wi, si, phase) in enumerate(slice_order(tasks, settings)):
        if phase != FWD:
            continue
        s = waves[wi][si]
        for pos, u in enumerate(slice_units(metaops[s.metaop], s.layer_start, s.layer_end)):
            if u not in first or FirstUse(k, pos) < first[u]:
                first[u] = FirstUse(k, pos)
    return first


def gather_order(buckets: Iterable[_B], first_use: Mapping[str, FirstUse]) -> list[_B]:
    """The buckets (anything with ``units``, ``devices`` and ``index``: the runtime's and the simulator's) in the
    weight gathers' issue order (module docstring)."""
    return sorted(buckets, key=lambda b: (min(first_use[u] for u in b.units), tuple(b.devices), b.index))
