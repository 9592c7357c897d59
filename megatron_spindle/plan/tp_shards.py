"""TP-sharded gradients (``settings.tp_sharded_grads``): which devices reduce which TP shard of a unit.

Megatron-LM and DeepSpeed keep a TP rank's gradients and optimizer state for its own shard only, and reduce
each shard over the ring of devices holding it. In a Spindle plan one unit may be held by several slices of
different TP degrees and device orders, so the rule is stated per unit:

- its **degree** t is its parameter device group's ``group_tp`` (the greatest common divisor of the TPs of the
  slices holding the group's units), so every holder slice's TP is a multiple of t;
- a device at TP rank r of a slice of TP s holds its part of **shard** ``p = r // (s / t)`` (megatron's TP
  chunks nest: TP rank r of s lies inside TP rank r // (s / t) of t, strided layouts included);
- the **ring** of shard p is every device holding a part of it, over every holder slice. A device would be in
  several rings of one unit where its TP rank differs between slices; plans are assembled with each TP
  group's ranks ordered so that it does not (``aligned_device_orders``), and each ring is then the group's
  members of that shard, ``group size / t`` devices, as the simulator and the memory model count it.

The shard's parameters (TP-split tensors) are kept, reduced and stepped as a unit of their own, the
*sub-unit* ``sub_unit(u, p, t)``, by its ring; the unit's replicated parameters (norms, row-parallel biases)
stay with the unit, on every member of its group. ``runtime_groups`` lists the sets of units reduced
together: the plan's groups, then per group the rings (sub-units with the same ring share one).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megatron_spindle.graph.opgraph import MetaOp
from megatron_spindle.plan.buckets import group_tp, unit_holders
from megatron_spindle.plan.layout import SliceGeometry, slice_units
from megatron_spindle.plan.schema import ExecutionSettings

SUB_UNIT_MARK = "~tp"


def sub_unit(unit: str, shard: int, degree: int) -> str:
    """The name of TP shard ``shard`` of ``degree`` of ``unit`` (its TP-split parameters)."""
    return f"{unit}{SUB_UNIT_MARK}{shard}of{degree}"


def base_unit(name: str) -> str:
    """The unit a sub-unit belongs to (a unit's own name otherwise)."""
    return name.split(SUB_UNIT_MARK, 1)[0]


def shard_of(s: SliceGeometry, device: int, degree: int) -> int:
    """The TP shard of ``degree`` holding ``device``'s part of slice ``s``."""
    return (s.devices.index(device) % s.tp) // (s.tp // degree)


@dataclass(frozen=True)
class UnitRings:
    """A unit reduced by TP shard: its ``degree`` and the sorted devices of each shard's ring."""

    degree: int
    rings: tuple[tuple[int, ...], ...]


def unit_rings(waves: Sequence[Sequence[SliceGeometry]], metaops: Mapping[str, MetaOp],
               groups: Sequence[Sequence[str]], settings: ExecutionSettings) -> dict[str, UnitRings]:
    """unit -> its rings, for every unit of a group reduced by TP shard (degree > 1; none unless
    ``settings.tp_sharded_grads``)."""
    holders = unit_holders(waves, metaops)
    out: dict[str, UnitRings] = {}
    for units, degree in zip(groups, group_tp(waves, metaops, groups, settings)):
        if degree == 1:
            continue
        for u in units:
            rings: list[set[int]] = [set() for _ in range(degree)]
            for s in holders.get(u, ()):
                for d in s.devices:
                    rings[shard_of(s, d, degree)].add(d)
            out[u] = UnitRings(degree, tuple(tuple(sorted(r)) for r in rings))
    return out


def runtime_groups(param_groups: Sequence[tuple[Sequence[int], Sequence[str]]],
                   rings: Mapping[str, UnitRings]) -> list[tuple[tuple[int, ...], list[str]]]:
    """(sorted devices, units) of every set of units reduced together, the same list on every rank: each plan
    group with its units (their replicated parameters, and all of a unit not reduced by shard), then that
    group's rings, each with the sub-units it reduces. A ring on the devices of a set listed before joins it
    (buckets and process groups are keyed by devices)."""
    out: dict[tuple[int, ...], list[str]] = {}
    for devices, units in param_groups:
        out.setdefault(tuple(sorted(devices)), []).extend(units)
        for u in units:
            if u in rings:
                r = rings[u]
                for p, ring in enumerate(r.rings):
                    out.setdefault(ring, []).append(sub_unit(u, p, r.degree))
    return list(out.items())


def ring_surplus(waves: Sequence[Sequence[SliceGeometry]], metaops: Mapping[str, MetaOp],
                 groups: Sequence[Sequence[str]], settings: ExecutionSettings) -> int:
    """Ring memberships beyond one per device and unit, summed over the units reduced by TP shard: 0 when every
    device holds one TP shard of each unit (each ring is its group's ``size / t`` members of that shard)."""
    return sum(sum(map(len, r.rings)) - len({d for ring in r.rings for d in ring})
               for r in unit_rings(waves, metaops, groups, settings).values())


def aligned_device_orders(waves: Sequence[Sequence[SliceGeometry]], metaops: Mapping[str, MetaOp],
                          groups: Sequence[Sequence[str]], settings: ExecutionSettings,
                          effort: float = 2.0) -> list[list[list[int]]]:
    """Every slice's devices (per wave, per slice), reordered inside each of its TP groups so that a device
    holds the same TP shard of a unit in every slice holding it. Each shard's ring is then the group's members
    of that shard, ``group size / t`` devices, as the simulator and the memory model count it; otherwise a
    device holding a unit at TP rank 0 in one slice and 1 in another reduces and keeps both shards.

    Reordering inside a TP group is free: its devices keep their TP group and hold the same rows
    (plan/routing.py). Which order works is a joint choice over all slices (two slices' TP groups may cross,
    as a strided and a compact one do), so each device gets a shard label per degree from a CP-SAT model: every
    TP group of a holder slice holds each shard ``tp / t`` times. ``effort`` bounds its deterministic time (the
    result does not depend on the machine). The planned orders are kept when they already agree, or when the
    model does not find fewer ring memberships (``ring_surplus``)."""
    planned = [[list(s.devices or ()) for s in slices] for slices in waves]
    surplus = ring_surplus(waves, metaops, groups, settings) if settings.tp_sharded_grads else 0
    if surplus == 0:
        return planned
    held = _held_degrees(waves, metaops, groups, settings)
    labels = _shard_labels(waves, held, planned, effort)
    if labels is None:
        return planned
    orders = [[list(o) for o in slices] for slices in planned]
    for (wi, si), degrees in held.items():
        s, top = waves[wi][si], max(degrees)
        order = orders[wi][si]
        for k in range(0, len(order), s.tp):
            group = order[k:k + s.tp]
            order[k:k + s.tp] = sorted(group, key=lambda d: (labels[top, d], group.index(d)))
    reordered = [[_with_devices(s, o) for s, o in zip(slices, os)] for slices, os in zip(waves, orders)]
    if ring_surplus(reordered, metaops, groups, settings) >= surplus:
        return planned
    return orders


@dataclass(frozen=True)
class _Placed:
    metaop: str
    layer_start: int
    layer_end: int
    tp: int
    dp: int
    devices: tuple[int, ...]


def _with_devices(s: SliceGeometry, devices: Sequence[int]) -> _Placed:
    return _Placed(s.metaop, s.layer_start, s.layer_end, s.tp, s.dp, tuple(devices))


def _held_degrees(waves, metaops, groups, settings) -> dict[tuple[int, int], tuple[int, ...]]:
    """(wave, slice) -> the shard degrees (> 1) of the groups whose units the slice holds, for slices at TP > 1."""
    degrees = group_tp(waves, metaops, groups, settings)
    degree_of = {u: degrees[gi] for gi, units in enumerate(groups) for u in units}
    out = {}
    for wi, slices in enumerate(waves):
        for si, s in enumerate(slices):
            mine = {degree_of.get(u, 1) for u in slice_units(metaops[s.metaop], s.layer_start, s.layer_end)} - {1}
            if mine and s.tp > 1:
                out[wi, si] = tuple(sorted(mine))
    return out


def _shard_labels(waves, held, planned, effort: float) -> dict[tuple[int, int], int] | None:
    """(degree, device) -> shard, from CP-SAT: each TP group of each holder slice holds each shard ``tp / t``
    times (softly: the model minimises the shortfall), a slice's smaller degrees nest in its largest; hinted
    with the planned orders' first shards. None when no solution is found within ``effort``."""
    holders = tuple((degrees, waves[wi][si].tp, tuple(planned[wi][si])) for (wi, si), degrees in held.items())
    return _solved_shard_labels(holders, effort)


# Plan selection assembles many candidates on the same placements (ZeRO stages, buckets, recomputation), and
# the model is deterministic (one worker, a seed, deterministic time): the same holders, the same labels.
@functools.lru_cache(maxsize=256)
def _solved_shard_labels(holders: tuple[tuple[tuple[int, ...], int, tuple[int, ...]], ...],
                         effort: float) -> dict[tuple[int, int], int] | None:
    """``_shard_labels`` of the holder slices' (shard degrees, TP, planned device order), in the plan's order
    (the model's variables and constraints are made in it). The caller must not change the labels."""
    from ortools.sat.python import cp_model  # planning-time only: the runtime never builds this model

    model = cp_model.CpModel()
    x: dict[tuple[int, int, int], cp_model.IntVar] = {}

    def label(t: int, d: int) -> list:
        if (t, d, 0) not in x:
            for p in range(t):
                x[t, d, p] = model.new_bool_var(f"x{t}_{d}_{p}")
            model.add_exactly_one(x[t, d, p] for p in range(t))
        return [x[t, d, p] for p in range(t)]

    shortfall = []
    hinted: set[tuple[int, int]] = set()
    nested: set[tuple[int, int, int]] = set()
    for degrees, tp, order in holders:
        top = max(degrees)
        for k in range(0, len(order), tp):
            group = order[k:k + tp]
            for t in degrees:
                for p in range(t):
                    miss = model.new_int_var(0, tp // t, "")
                    model.add(sum(label(t, d)[p] for d in group) + miss >= tp // t)
                    shortfall.append(miss)
            for r, d in enumerate(group):
                for t in degrees:
                    if (t, d) not in hinted:
                        hinted.add((t, d))
                        for p, var in enumerate(label(t, d)):
                            model.add_hint(var, p == r // (tp // t))
                    if t != top and top % t == 0 and (t, top, d) not in nested:
                        nested.add((t, top, d))  # TP rank r of top lies in shard r // (top / t) of t
                        for p, var in enumerate(label(t, d)):
                            model.add(var == sum(label(top, d)[q] for q in range(top) if q // (top // t) == p))
    model.minimize(sum(shortfall))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_deterministic_time = effort
    if solver.solve(model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return {(t, d): p for (t, d, p), var in x.items() if solver.boolean_value(var)}


@dataclass(frozen=True)
class GroupRing:
    """How a parameter device group's gradients and gathered weights travel: ``degree`` rings at once (one per
    TP shard; 1: the whole group), the devices of the widest, and ``share``, the part of the group's parameters
    the busiest device reduces: 1 / degree where every device holds one shard of each unit, more where a device
    sits in several rings of a unit (a plan whose TP groups cross with no aligned order)."""

    degree: int
    devices: tuple[int, ...]
    share: float


def group_rings(waves: Sequence[Sequence[SliceGeometry]], metaops: Mapping[str, MetaOp],
                param_groups: Sequence[tuple[Sequence[int], Sequence[str]]],
                settings: ExecutionSettings) -> list[GroupRing]:
    """Per parameter device group (devices, units): its rings as the runtime forms them (``unit_rings``), the
    rule the simulator and the planner's estimate time gradient buckets and weight gathers by."""
    rings = unit_rings(waves, metaops, [units for _, units in param_groups], settings)
    out = []
    for devices, units in param_groups:
        if not units or units[0] not in rings:  # degree 1: the whole group, one ring
            out.append(GroupRing(1, tuple(sorted(devices)), 1.0))
            continue
        degree = rings[units[0]].degree  # the group's (every unit of it has its degree)
        widest, most = (), 1
        for layout in {rings[u].rings for u in units}:
            widest = max([widest, *layout], key=lambda r: (len(r), r))
            count: dict[int, int] = {}
            for ring in layout:
                for d in ring:
                    count[d] = count.get(d, 0) + 1
            most = max(most, *count.values())
        out.append(GroupRing(degree, widest, most / degree))
    return out
