"""Where things live in a plan: a data-parallel rank's sample rows (and a device's rows of a task's batch over
the micro-batches, and which micro-batch counts a plan may use), the parameter units of a slice, the
producer/consumer slice pairs a plan needs, and the parameter device groups.

The functions take any slice with the plan's geometry (``metaop``, ``layer_start``, ``layer_end``, ``tp``,
``dp``, ``devices``): the plan's ``Slice`` and the planner's ``ScheduledSlice`` alike, so the planner, the
simulator and the runtime apply the same rules to what they hold.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from megatron_spindle.graph.opgraph import MetaGraph, MetaOp

SlicePos = tuple[int, int]  # (wave index, slice index in the wave)


class SliceGeometry(Protocol):
    metaop: str
    layer_start: int
    layer_end: int
    tp: int
    dp: int
    devices: Sequence[int] | None


def weight_scope(node_local_weights: bool, gpus_per_node: int) -> int | None:
    """The node size a ZeRO-3 slice's weight shards are confined to (``ExecutionSettings.node_local_weights``,
    ZeRO++'s hierarchical partitioning), or None: sharded over the slice's whole data-parallel group."""
    return gpus_per_node if node_local_weights else None


def dp_group(devices: Sequence[int], tp: int, device: int) -> tuple[int, ...]:
    """The data-parallel group of ``device`` in a slice on ``devices`` at ``tp``: the devices of its TP rank,
    ``devices[r % tp::tp]``, in DP rank order (plan/schema.py's layout)."""
    r = list(devices).index(device)
    return tuple(devices[r % tp::tp])


def weight_shard_group(devices: Sequence[int], tp: int, device: int, scope: int | None) -> tuple[int, ...]:
    """ZeRO-3: the devices over which ``device``, in a slice on ``devices`` at ``tp``, shards that slice's weights
    and gathers a layer of them: its data-parallel group (``dp_group``), and with a ``scope`` (``weight_scope``)
    only the group's members on ``device``'s node."""
    group = dp_group(devices, tp, device)
    if scope is None:
        return group
    return tuple(d for d in group if d // scope == device // scope)


def weight_shard_degree(s: SliceGeometry, scope: int | None) -> int:
    """The members of slice ``s``'s smallest weight shard group (``weight_shard_group``): what its device with
    the largest share divides its weights by; ``s.dp`` without a scope."""
    if scope is None or not s.devices:
        return s.dp
    # a device's group on its node is the devices of its TP rank there: count each (TP rank, node) once
    # (weight_shard_group per device is quadratic in the slice's size, and the planner asks for every option)
    members = Counter((i % s.tp, d // scope) for i, d in enumerate(s.devices))
    return min(members.values())


def dp_rows(rank: int, dp: int, batch: int) -> tuple[int, int]:
    """Samples ``[lo, hi)`` of data-parallel rank ``rank`` of ``dp``: rank k holds ``[k*B/dp, (k+1)*B/dp)``."""
    per_rank = batch // dp
    return rank * per_rank, (rank + 1) * per_rank


def micro_batch_metaop(metaop: MetaOp, micro_batches: int) -> MetaOp:
    """The MetaOp as one micro-batch runs it: its batch B / ``micro_batches`` (the plan's micro-batches split
    every task's batch into equal parts, each a whole run of the order)."""
    if micro_batches == 1:
        return metaop
    b, *rest = metaop.input_shape
    if b % micro_batches:
        raise ValueError(f"MetaOp '{metaop.id}': {micro_batches} micro-batches do not divide its batch {b}")
    return dataclasses.replace(metaop, input_shape=(b // micro_batches, *rest))


def batch_coupled_tasks(metaops: Iterable) -> list[str]:
    """Tasks whose loss couples the samples of a batch: a contrastive loss (its MetaOp of kind ``loss``) takes each
    sample's negatives from the rest of the batch, so m micro-batches change the loss itself (a softmax over B/m
    samples instead of B), where an LM loss, a sum over tokens, stays the same sum. Takes the MetaGraph's MetaOps
    or a plan's MetaOp records."""
    return sorted({m.task for m in metaops if m.kind == "loss"})


def whole_batch_tasks(setting: str, metaops: Iterable) -> list[str]:
    """The tasks whose batches ``--spindle-micro-batches setting`` keeps whole: under auto the batch-coupled ones
    (``batch_coupled_tasks``: chosen for memory, micro-batches must not change what is trained); none with a
    given N."""
    return batch_coupled_tasks(metaops) if setting == "auto" else []


def micro_batch_choices(setting: str, metaops: Iterable, auto_counts: Sequence[int]) -> list[int]:
    """The micro-batch counts a plan may use under ``--spindle-micro-batches setting``: N as given; auto: the
    planner's or baseline's ``auto_counts``, or 1 alone where a task's batch stays whole (``whole_batch_tasks``)."""
    if setting != "auto":
        return [int(setting)]
    return [1] if whole_batch_tasks(setting, metaops) else list(auto_counts)


def position_rows(position: int, tp: int, dp: int, batch: int) -> tuple[int, int]:
    """Samples of device ``devices[position]`` of a (tp, dp) slice: its DP rank is ``position // tp``."""
    return dp_rows(position // tp, dp, batch)


def input_rows(position: int, tp: int, dp: int, batch: int, micro_batches: int = 1) -> list[tuple[int, int]]:
    """Rows ``[lo, hi)`` of the task's global batch of ``batch`` that device ``devices[position]`` of a (tp, dp)
    slice processes over an iteration of ``micro_batches``: micro-batch j is the rows of "DP rank" j of
    ``micro_batches``, and the device takes its DP rank's share of each."""
    micro = batch // micro_batches
    out = []
    for j in range(micro_batches):
        start = dp_rows(j, micro_batches, batch)[0]
        lo, hi = position_rows(position, tp, dp, micro)
        out.append((start + lo, start + hi))
    return out


def slice_units(metaop: MetaOp, layer_start: int, layer_end: int) -> list[str]:
    """Parameter units a slice of the MetaOp trains (layers ``[layer_start, layer_end)``), in chain order, once:
    the units whose gradients are synchronised and stepped. A frozen MetaOp's weights (``held_units``) get no
    gradient, so a frozen slice trains none."""
    return [] if metaop.frozen else held_units(metaop, layer_start, layer_end)


def first_operators(metaop: MetaOp, s: SliceGeometry) -> dict[str, int]:
    """unit -> the slice's first operator (0-based, of its layers) using it: where its forward first needs the
    weights, and where its backward accumulates the unit's gradient last."""
    out: dict[str, int] = {}
    for i, names in enumerate(metaop.params[s.layer_start:s.layer_end]):
        for u in names:
            out.setdefault(u, i)
    return out


def held_units(metaop: MetaOp, layer_start: int, layer_end: int) -> list[str]:
    """Parameter units whose weights a slice of the MetaOp holds (layers ``[layer_start, layer_end)``), in chain
    order, once."""
    units: dict[str, None] = {}
    for names in metaop.params[layer_start:layer_end]:
        for name in names:
            units[name] = None
    return list(units)


def transfer_pairs(waves: Sequence[Sequence[SliceGeometry]], preds: Mapping[str, Sequence[str]],
                   num_layers: Mapping[str, int]) -> list[tuple[SlicePos, SlicePos]]:
    """(producer, consumer) slice positions whose data a transfer moves, consumers in plan order.

    A slice reads the previous slice of its MetaOp (the one ending at its first layer); a slice starting its
    MetaOp reads, per producer MetaOp in ``preds`` order, the slice holding that MetaOp's last layer. Only
    producers in earlier waves count (a plan with others is invalid, and ``validate_plan`` says so).
    """
    ending_at: dict[tuple[str, int], SlicePos] = {}
    for wi, slices in enumerate(waves):
        for si, s in enumerate(slices):
            ending_at[(s.metaop, s.layer_end)] = (wi, si)
    pairs = []
    for wi, slices in enumerate(waves):
        for si, s in enumerate(slices):
            if s.layer_start > 0:
                wanted = [(s.metaop, s.layer_start)]
            else:
                wanted = [(p, num_layers[p]) for p in preds.get(s.metaop, ())]
            for key in wanted:
                found = ending_at.get(key)
                if found is not None and found[0] < wi:
                    pairs.append((found, (wi, si)))
    return pairs


def graph_transfer_pairs(waves: Sequence[Sequence[SliceGeometry]],
                         metagraph: MetaGraph) -> list[tuple[SlicePos, SlicePos]]:
    """``transfer_pairs`` with the producers and layer counts of the workload's MetaGraph."""
    return transfer_pairs(waves, {m: metagraph.predecessors(m) for m in metagraph.metaops},
                          {m: op.num_layers for m, op in metagraph.metaops.items()})


def device_programs(waves: Sequence[Sequence[SliceGeometry]], num_devices: int) -> dict[tuple[SlicePos, ...], list[int]]:
    """Devices grouped by the slices they run (positions in wave order): what a device holds and does depends
    only on that, so per-device accounting can run once per group (a whole-cluster plan has one group)."""
    by_devices: dict[tuple[int, ...], list[SlicePos]] = {}  # slices sharing a device list are visited once
    for wi, slices in enumerate(waves):
        for si, s in enumerate(slices):
            by_devices.setdefault(tuple(s.devices), []).append((wi, si))
    sets: list[list[int]] = [[] for _ in range(num_devices)]
    for k, devices in enumerate(by_devices):
        for d in devices:
            sets[d].append(k)
    positions = list(by_devices.values())
    groups: dict[tuple[SlicePos, ...], list[int]] = {}
    programs: dict[tuple[int, ...], tuple[SlicePos, ...]] = {}
    for d, ks in enumerate(sets):
        key = tuple(ks)
        if key not in programs:
            programs[key] = tuple(sorted(p for k in ks for p in positions[k]))
        groups.setdefault(programs[key], []).append(d)
    return groups


def unit_holders(waves: Sequence[Sequence[SliceGeometry]], metaops: Mapping[str, MetaOp],
                 units_of: Callable[[MetaOp, int, int], list[str]] | None = None) -> dict[str, list[int]]:
    """unit -> sorted devices holding it (every device of every slice that trains it, or with ``units_of``
    ``held_units``, that holds its weights), units in first-use order."""
    units_of = units_of or slice_units
    holders: dict[str, set[int]] = {}
    for slices in waves:
        for s in slices:
            for u in units_of(metaops[s.metaop], s.layer_start, s.layer_end):
                holders.setdefault(u, set()).update(s.devices)
    return {u: sorted(devs) for u, devs in holders.items()}


def weight_holders(plan, metaops: Mapping[str, MetaOp]) -> dict[str, list[int]]:
    """unit -> the sorted devices holding its weights in ``plan``, frozen units included (the parameter device
    groups list only the units that train): whose checkpoint a rank writes (the lowest holder), what a task-set
    change hands over."""
    return unit_holders([w.slices for w in plan.waves], metaops, held_units)


def param_device_groups(waves: Sequence[Sequence[SliceGeometry]],
                        metaops: Mapping[str, MetaOp]) -> list[tuple[list[int], list[str]]]:
    """The parameter device group pool: units held by exactly the same devices form one group, as
    (devices, units); units in first-use order, groups sorted by their device lists."""
    pool: dict[tuple[int, ...], list[str]] = {}
    for unit, devices in unit_holders(waves, metaops).items():
        pool.setdefault(tuple(devices), []).append(unit)
    return [(list(devs), units) for devs, units in sorted(pool.items())]


def stepped_elements(waves: Sequence[Sequence[SliceGeometry]], metaops: Mapping[str, MetaOp],
                     param_count: Callable[[str], float], zero_stage: int,
                     num_devices: int) -> list[dict[str, float]]:
    """Per device: unit -> fp32 master elements its optimizer steps: the unit's TP shard (the smallest TP degree
    of the device's slices holding it, as the memory accounting counts it), divided over the slice's DP ranks
    with ZeRO stage >= 1; devices running the same slices share one dict."""
    held: list[dict[str, float]] = [{} for _ in range(num_devices)]
    for program, devices in device_programs(waves, num_devices).items():
        mine: dict[str, float] = {}
        for wi, si in program:
            s = waves[wi][si]
            for u in slice_units(metaops[s.metaop], s.layer_start, s.layer_end):
                elements = param_count(u) / s.tp / (s.dp if zero_stage >= 1 else 1)
                mine[u] = max(mine.get(u, 0.0), elements)
        for d in devices:
            held[d] = mine
    return held
