"""TP-sharded gradients (``settings.tp_sharded_grads``): which devices reduce which TP shard of a unit.

Megatron-LM and DeepSpeed keep a TP rank's gradients and optimizer state for its own shard only, and reduce
each shard over the ring of devices holding it. In a Spindle plan one unit may be held by several slices of
different TP degrees and device orders, so the rule is stated per unit:

- its **degree** t is its parameter device group's ``group_tp`` (the greatest common divisor of the TPs of the
  slices holding the group's units), so every holder slice's TP is a multiple of t;
- a device at TP rank r of a slice of TP s holds its part of **shard** ``p = r // (s / t)`` (megatron's TP
  chunks nest: TP rank r of s lies inside TP rank r // (s / t) of t, strided layouts included);
- the **ring** of shard p is every device holding a part of it, over every holder slice; a device may be in
  several rings of one unit (its TP rank differs between slices).

The shard's parameters (TP-split tensors) are kept, reduced and stepped as a unit of their own, the
*sub-unit* ``sub_unit(u, p, t)``, by its ring; the unit's replicated parameters (norms, row-parallel biases)
stay with the unit, on every member of its group. ``runtime_groups`` lists the sets of units reduced
together: the plan's groups, then per group the rings (sub-units with the same ring share one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megatron_spindle.graph.opgraph import MetaOp
from megatron_spindle.plan.buckets import group_tp, unit_holders
from megatron_spindle.plan.layout import SliceGeometry
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
