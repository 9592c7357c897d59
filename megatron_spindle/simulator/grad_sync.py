"""Gradient synchronisation of a plan as the simulator runs it: the runtime's buckets (plan/buckets.py), each a
collective of its parameter device group timed by the comm model.

- **Buckets.** Per parameter device group (the plan's ``param_groups``), its units in the order the backward
  completes them, cut at the plan's bucket size (plan/buckets.py ``bucket_limit``), issued in
  the plan-wide launch order: what runtime/grad_buffers.py builds.
- **Readiness.** A member device issues a bucket once the last accumulation of its gradients on that device
  is done: in the device's last backward holding a unit of the bucket, at the unit's layer (a slice runs its
  layers' backward from last to first; a light operator's one unit is complete at the end of its backward).
  Without overlap (the plan's ``overlap_grad_reduce`` off) every bucket waits for the device's whole backward.
- **Rounds.** Under ZeRO 2 and 3 a plan with segments reduces after each segment's backward (plan/buckets.py
  ``sync_rounds``): each round's buckets, timed as above among that segment's backward tasks
  (``synced_buckets``); a member accumulating none of a bucket in the round issues it when it reaches the
  segment (the end of its last task before it).
- **Volume.** The TP ranks of a group reduce their own shards, each over the ring of devices holding it
  (``tp`` rings at once, each ``1/tp`` of the bucket, sharing the network of the nodes they cross), timed on
  the widest ring plan/tp_shards.py ``group_rings`` names, the runtime's; where a device sits in several rings
  of a unit (a plan whose TP groups cross), each member is charged what that busiest device reduces.
  ZeRO stage 0 all-reduces the bucket; stages 1-3 reduce-scatter it (each member keeps the gradient of the
  optimizer shard it steps), and stages 1 and 2 all-gather the updated bf16 weights after the optimizer step,
  one collective per group (``param_gathers``); stage 3 gathers weights in every layer's forward and
  backward (the compute tasks carry those), and after the step only where a group's weight shards are not its
  master shards (plan/buckets.py ``regathered_groups``), as an all-to-all of what each member keeps
  (``regather_collective``).
- **Time.** ``CommModel.collective_seconds`` with the number of cross-node collectives sharing the busiest
  node at the moment (the timeline's fluid sharing), and the overlap slowdown while the members compute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megatron_spindle.estimator.comm_model import CommModel, GroupPlacement
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaOp
from megatron_spindle.plan.buckets import (
    Completion,
    bucket_limit,
    completion_sorted,
    launch_key,
    regather_collective,
    regathered_groups,
    split_buckets,
    synced_rounds,
    unit_completion,
    unit_holders,
)
from megatron_spindle.plan.memory import WEIGHT_BYTES_PER_PARAM, grad_reduce_bytes
from megatron_spindle.plan.schema import Plan
from megatron_spindle.plan.tp_shards import group_rings


@dataclass
class BucketSync:
    """One bucket of one parameter device group (``group``: index in the plan's ``param_groups``)."""

    group: int
    devices: tuple[int, ...]
    index: int
    units: tuple[str, ...]
    params: int
    done: Completion
    op: str  # all_reduce | reduce_scatter
    nbytes: float  # per ring: the bucket's bytes of one TP shard
    ring: GroupPlacement  # the data-parallel ring of one TP rank
    rings: int  # TP rings running at once
    round: int = 0  # the gradient round (plan/buckets.py sync_rounds) of a synced bucket; ``done`` is its there
    # its weights after the optimizer step where its group regathers them (``param_gathers``; plan/buckets.py
    # regather_collective): the collective and its bytes on the busiest ring; else unset
    weight_op: str = "all_gather"
    weight_bytes: float = 0.0

    def launch_key(self) -> tuple:
        return launch_key(self.done, self.devices, self.index)


@dataclass
class GroupInfo:
    devices: tuple[int, ...]
    units: list[str]
    params: int
    tp: int  # TP rings running at once
    ring: GroupPlacement  # the widest of them
    share: float  # of the group's parameters, what the busiest member reduces (plan/tp_shards.py GroupRing)

    @property
    def ranks(self) -> int:
        return self.ring.size


def group_infos(plan: Plan, metaops: Mapping[str, MetaOp], param_count, cluster: ClusterSpec) -> list[GroupInfo]:
    rings = group_rings([w.slices for w in plan.waves], metaops, [(g.devices, g.params) for g in plan.param_groups],
                        plan.settings)
    out = []
    for g, r in zip(plan.param_groups, rings):
        params = sum(param_count(u) for u in g.params)
        out.append(GroupInfo(tuple(sorted(g.devices)), list(g.params), params, r.degree,
                             GroupPlacement.of_devices(r.devices, cluster), r.share))
    return out


def plan_buckets(plan: Plan, metaops: Mapping[str, MetaOp], param_count, groups: list[GroupInfo]) -> list[BucketSync]:
    """Every bucket that needs a collective (a group with more than one data-parallel rank), in launch order
    (cut at the plan's ``bucket_limit``)."""
    waves = [w.slices for w in plan.waves]
    completion = unit_completion(waves, metaops, plan.settings)
    holders = unit_holders(waves, metaops)
    gathering = set(param_gathers(plan, groups, metaops))
    op = "all_reduce" if plan.settings.zero_stage == 0 else "reduce_scatter"
    out = []
    for gi, g in enumerate(groups):
        if g.ranks <= 1 or not g.units:
            continue
        limit = bucket_limit(plan.settings.ddp_bucket_size, len(g.devices))
        ordered = completion_sorted(g.units, completion)
        for index, units in enumerate(split_buckets(ordered, param_count, limit)):
            params = sum(param_count(u) for u in units)
            nbytes = grad_reduce_bytes(params, plan.settings) * g.share
            weight = {}  # only the gathering groups' buckets move weights after the step
            if gi in gathering:
                weight_op, moved = regather_collective(plan.settings.zero_stage, holders, units, g.tp, g.share,
                                                       param_count, plan.weight_scope)
                weight = {"weight_op": weight_op, "weight_bytes": moved * WEIGHT_BYTES_PER_PARAM}
            out.append(BucketSync(gi, g.devices, index, tuple(units), params, completion[units[-1]], op, nbytes,
                                  g.ring, g.tp, **weight))
    return sorted(out, key=BucketSync.launch_key)


def synced_buckets(plan: Plan, metaops: Mapping[str, MetaOp], buckets: list[BucketSync]) -> list[BucketSync]:
    """The gradient collectives of one synced micro-batch in issue order: each round's buckets (plan/buckets.py
    ``synced_rounds``), each with its completion in its round. With one round, ``buckets`` themselves."""
    rounds = synced_rounds([w.slices for w in plan.waves], metaops, plan.settings, buckets)
    if rounds is None:
        return buckets
    return [dataclasses.replace(b, done=done, round=r) for r, bucket_dones in enumerate(rounds)
            for b, done in bucket_dones]


def param_gathers(plan: Plan, groups: list[GroupInfo], metaops: Mapping[str, MetaOp]) -> list[int]:
    """The groups whose updated bf16 weights are gathered after the optimizer step (plan/buckets.py
    ``regathered_groups``: ZeRO 1 and 2, and 3 where the weights' shards are not the masters'), bucket by bucket
    (``BucketSync.weight_op`` and ``weight_bytes``: ZeRO-3 redistributes them)."""
    regathered = regathered_groups([w.slices for w in plan.waves], metaops,
                                   [(g.devices, g.units) for g in groups], plan.settings.zero_stage,
                                   plan.weight_scope)
    return [gi for gi, g in enumerate(groups) if regathered[gi] and g.ranks > 1 and g.units]


class CollectiveTimer:
    """Seconds of a ring's collective at a sharing count, memoised (plans repeat bucket sizes)."""

    def __init__(self, comm: CommModel):
        self.comm = comm
        self._cache: dict[tuple, float] = {}

    def seconds(self, op: str, nbytes: float, ring: GroupPlacement, sharing: int = 1) -> float:
        key = (op, nbytes, ring.ranks_per_node, sharing if ring.crosses_nodes else 1)
        value = self._cache.get(key)
        if value is None:
            value = self._cache[key] = self.comm.collective_seconds(op, nbytes, ring, key[3])
        return value


def nodes_of(devices: Sequence[int], gpus_per_node: int) -> tuple[int, ...]:
    """The nodes a collective over ``devices`` crosses (empty when it stays inside one)."""
    nodes = tuple(sorted({d // gpus_per_node for d in devices}))
    return nodes if len(nodes) > 1 else ()
