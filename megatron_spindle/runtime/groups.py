"""Process groups for a plan: every distinct device tuple becomes one torch.distributed group, exactly once.

``torch.distributed.new_group`` is collective over the whole world: every rank must call it for every group,
in the same order, member or not. ``PlanGroups`` therefore walks the plan in one deterministic order on all
ranks (waves, then slices in plan order: TP groups, then DP groups; then the parameter device groups) and
caches groups by their ordered device tuple.

Group ranks follow the plan's layout conventions (``plan/schema.py``): the TP group of a slice lists its
devices ``devices[k*tp : (k+1)*tp]`` in plan order, so torch's group rank equals the plan's TP rank
``r % tp``; the DP group lists ``devices[t::tp]``, so its group rank equals the plan's DP rank ``r // tp``
(we pass ``sort_ranks=False``; torch would otherwise sort the ranks). Parameter device groups are sorted.
A torch without ``sort_ranks`` (before 2.13) always sorts: plans whose tuples are sorted (every plan on one device,
and most others) run there; an unsorted tuple stops with one line that says so.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_spindle.plan.layout import dp_group, weight_shard_group
from megatron_spindle.plan.schema import Plan, Slice
from megatron_spindle.runtime.distributed import group_timeout

WEIGHT_GATHERS = "zero3-weights"  # GroupCache purpose of ZeRO-3's weight all-gathers


def tp_group_devices(s: Slice, device: int) -> tuple[int, ...]:
    """Devices of the TP group of ``device`` inside slice ``s`` (plan order = TP rank order)."""
    r = s.devices.index(device)
    k = r // s.tp
    return tuple(s.devices[k * s.tp:(k + 1) * s.tp])


def dp_group_devices(s: Slice, device: int) -> tuple[int, ...]:
    """Devices of the DP group of ``device`` inside slice ``s`` (plan order = DP rank order)."""
    return dp_group(s.devices, s.tp, device)


def all_tp_groups(s: Slice) -> list[tuple[int, ...]]:
    return [tuple(s.devices[k * s.tp:(k + 1) * s.tp]) for k in range(s.dp)]


def all_dp_groups(s: Slice) -> list[tuple[int, ...]]:
    return [tuple(s.devices[t::s.tp]) for t in range(s.tp)]


def new_group_in_order(devices: tuple[int, ...]):
    """``dist.new_group`` whose group ranks follow the order of ``devices``, with the default backend and the
    world's timeout (new_group's own default is torch's 30 minutes)."""
    if "sort_ranks" in inspect.signature(dist.new_group).parameters:
        return dist.new_group(list(devices), sort_ranks=False, timeout=group_timeout())
    if list(devices) != sorted(devices):
        raise RuntimeError(f"the plan orders the devices of a process group as {list(devices)}; this torch "
                           f"({torch.__version__}) sorts group ranks (new_group without sort_ranks): use torch >= 2.13")
    return dist.new_group(list(devices), timeout=group_timeout())


@dataclass
class GroupCache:
    """Ordered device tuple -> process group (``None`` on ranks outside the group). Creation is collective:
    call ``get`` with the same tuples in the same order on every rank."""

    rank: int
    groups: dict[tuple[int, ...], object] = field(default_factory=dict)
    created: list[tuple[int, ...]] = field(default_factory=list)  # creation order (for tests and debugging)

    def get(self, devices: tuple[int, ...], purpose: str = ""):
        """The group of ``devices``; a ``purpose`` gets a group of its own on the same devices (its collectives
        then never queue behind, or pair with, other collectives on those devices)."""
        devices = tuple(devices)
        key = (purpose, *devices) if purpose else devices
        if key not in self.groups:
            g = new_group_in_order(devices)
            self.groups[key] = g if self.rank in devices else None
            self.created.append(key)
        return self.groups[key]

    def destroy(self) -> None:
        """Destroy every group this cache created (local on each member; non-members hold none). The groups must
        be idle: no collective of theirs in flight, and nothing uses them afterwards."""
        for devices in reversed(self.created):
            g = self.groups.pop(devices, None)
            if g is not None:
                dist.destroy_process_group(g)
        self.created.clear()


class PlanGroups:
    """All process groups one plan needs.

    ``slice_pgs(slice_id)`` -> megatron-core ``ProcessGroupCollection`` with ``tp``, ``dp``, ``cp`` and ``pp``
    for this rank's position in that slice (``cp``/``pp`` are this rank alone: Spindle uses neither);
    ``param_group(devices)`` -> the group of one parameter device group (sorted devices);
    ``weight_group(slice_id)`` -> at ZeRO-3, a group of this rank's DP ranks in that slice (with node-local
    weight shards, those on its node: ``weight_group_devices``) for the weights' all-gathers alone
    (runtime/weight_shards.py): they run inside the slice's forward and backward, while the
    gradient buckets of a parameter group on the same devices are issued wherever each rank completes them.
    """

    def __init__(self, plan: Plan, rank: int, cache: GroupCache | None = None,
                 extra: list[tuple[int, ...]] = ()):
        self.plan = plan
        self.extra = list(extra)  # further sets of units reduced together (TP shards' rings: plan/tp_shards.py)
        self.rank = rank
        self.cache = cache if cache is not None else GroupCache(rank)
        self._slice_pgs: dict[str, object] = {}
        self._build()

    def _build(self) -> None:
        from megatron.core.process_groups_config import ProcessGroupCollection

        world = dist.get_world_size()
        singletons = [self.cache.get((d,)) for d in range(world)]  # one per rank, created on all ranks
        for s in self.plan.slices():
            for devs in all_tp_groups(s):
                self.cache.get(devs)
            for devs in all_dp_groups(s):
                self.cache.get(devs)
        for g in self.plan.param_groups:
            self.cache.get(tuple(sorted(g.devices)))
        for devices in self.extra:
            self.cache.get(tuple(sorted(devices)))
        if self.plan.settings.zero_stage == 3:
            scope = self.plan.weight_scope
            for s in self.plan.slices():
                for d in s.devices:
                    devs = weight_shard_group(s.devices, s.tp, d, scope)
                    if len(devs) > 1:
                        self.cache.get(devs, WEIGHT_GATHERS)
        me = singletons[self.rank]
        for s in self.plan.slices():
            if self.rank in s.devices:
                self._slice_pgs[s.id] = ProcessGroupCollection(
                    tp=self.cache.get(tp_group_devices(s, self.rank)),
                    dp=self.cache.get(dp_group_devices(s, self.rank)),
                    cp=me, pp=me)

    def slice_pgs(self, slice_id: str):
        return self._slice_pgs[slice_id]

    def param_group(self, devices) -> object:
        return self.cache.get(tuple(sorted(devices)))

    def weight_group_devices(self, slice_id: str) -> tuple[int, ...]:
        """At ZeRO-3, the devices this rank shards slice ``slice_id``'s weights over and gathers its layers from
        (plan/layout.py ``weight_shard_group``: its DP ranks, or those on its node), in group-rank order."""
        s = self.plan.slice(slice_id)
        return weight_shard_group(s.devices, s.tp, self.rank, self.plan.weight_scope)

    def weight_group(self, slice_id: str) -> object:
        return self.cache.get(self.weight_group_devices(slice_id), WEIGHT_GATHERS)
