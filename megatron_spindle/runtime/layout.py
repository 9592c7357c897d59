"""Pure-Python layout logic of the runtime (no torch.distributed): which rows each device holds, the
point-to-point messages of a transfer, the transfers and parameter device groups a plan implies, and the
checks that must pass before any communication.

Row layout (planner/plan.py): device ``devices[r]`` of a slice has TP rank ``r % tp`` and DP rank ``r // tp``;
DP rank k holds samples ``[k*B/dp, (k+1)*B/dp)`` of the task batch B. All TP ranks of a DP rank hold the same
rows and, after the slice ran, identical outputs; so one source per row suffices.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_spindle.graph.opgraph import MetaGraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.planner.plan import ParamGroup, Plan, PlanError, Slice, Transfer


def dp_rank(s: Slice, device: int) -> int:
    return s.devices.index(device) // s.tp


def tp_rank(s: Slice, device: int) -> int:
    return s.devices.index(device) % s.tp


def rows(s: Slice, k: int, batch: int) -> tuple[int, int]:
    """Samples [start, end) of DP rank k."""
    n = batch // s.dp
    return k * n, (k + 1) * n


def dp_members(s: Slice, k: int) -> list[int]:
    """Devices of DP rank k, in TP rank order."""
    return s.devices[k * s.tp:(k + 1) * s.tp]


def is_tp_leader(s: Slice, device: int) -> bool:
    return tp_rank(s, device) == 0


@dataclass(frozen=True)
class Message:
    """``src`` sends rows ``[src_start, src_start+n)`` of its local shard to ``dst``, which puts them at
    ``[dst_start, dst_start+n)`` of its local shard. ``src == dst`` is a local copy."""

    src: int
    dst: int
    src_start: int
    dst_start: int
    n: int


def _route(holders: Slice, needers: Slice, batch: int) -> list[Message]:
    """Every device of ``needers`` gets its rows from the ``holders`` slice: from itself when it holds them
    (a local copy), else from the holder of TP rank ``(needer's TP rank) % holders.tp`` (spreads senders)."""
    msgs = []
    for c in needers.devices:
        j = dp_rank(needers, c)
        c0, c1 = rows(needers, j, batch)
        for k in range(holders.dp):
            p0, p1 = rows(holders, k, batch)
            a, b = max(c0, p0), min(c1, p1)
            if a >= b:
                continue
            cands = dp_members(holders, k)
            src = c if c in cands else cands[tp_rank(needers, c) % holders.tp]
            msgs.append(Message(src, c, a - p0, a - c0, b - a))
    return msgs


def forward_messages(producer: Slice, consumer: Slice, batch: int) -> list[Message]:
    """Activations: producer output rows -> each consumer device (replicated over the consumer's TP ranks)."""
    return _route(producer, consumer, batch)


def backward_messages(producer: Slice, consumer: Slice, batch: int) -> list[Message]:
    """Gradients: consumer input-gradient rows -> each producer device (all its TP ranks need them)."""
    return _route(consumer, producer, batch)


# ----------------------------------------------------------------------------------------- plan structure


def slice_units(metagraph: MetaGraph, s: Slice) -> list[str]:
    """Parameter units the slice's operator holds: those of layers [layer_start, layer_end) of its MetaOp."""
    m = metagraph.metaops[s.metaop]
    out: list[str] = []
    for ps in m.params[s.layer_start:s.layer_end]:
        out += [p for p in ps if p not in out]
    return out


def expected_transfers(plan: Plan) -> list[tuple[str, str]]:
    """(producer slice, consumer slice) pairs the plan needs: consecutive slices of one MetaOp, and the slice
    with a producer MetaOp's last layer -> the slice with the consumer MetaOp's first layer."""
    by_metaop: dict[str, list[Slice]] = {}
    for s in plan.slices():
        by_metaop.setdefault(s.metaop, []).append(s)
    for v in by_metaop.values():
        v.sort(key=lambda s: s.layer_start)
    pairs = []
    for m in plan.metaops:
        chain = by_metaop.get(m.id, [])
        for a, b in zip(chain, chain[1:]):
            pairs.append((a.id, b.id))
        if not chain:
            continue
        for p in m.preds:
            if by_metaop.get(p):
                pairs.append((by_metaop[p][-1].id, chain[0].id))
    return pairs


def expected_param_groups(plan: Plan, metagraph: MetaGraph) -> dict[str, tuple[int, ...]]:
    """unit -> sorted devices holding it (union over the slices that use it)."""
    holders: dict[str, set[int]] = {}
    for s in plan.slices():
        for u in slice_units(metagraph, s):
            holders.setdefault(u, set()).update(s.devices)
    return {u: tuple(sorted(d)) for u, d in holders.items()}


def derive_param_groups(plan: Plan, metagraph: MetaGraph) -> list[ParamGroup]:
    """The parameter device group pool {D_i -> {W_j}} of a plan (in first-use order)."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for u, devs in expected_param_groups(plan, metagraph).items():
        groups.setdefault(devs, []).append(u)
    return [ParamGroup(devices=list(d), params=ps) for d, ps in groups.items()]


def check_runnable(plan: Plan, workload: Workload, metagraph: MetaGraph, world_size: int) -> None:
    """Everything the runtime relies on, checked before any communication. Raises PlanError."""
    from megatron_spindle.planner.validate import validate_plan

    if plan.workload_digest != workload.digest():
        raise PlanError(f"plan was made for workload '{plan.workload_name}' ({plan.workload_digest}), "
                        f"not for '{workload.name}' ({workload.digest()})")
    for s in plan.slices():
        bad = [d for d in s.devices if not 0 <= d < world_size]
        if bad:
            raise PlanError(f"slice '{s.id}': devices {bad} are beyond the world size {world_size} "
                            f"(ranks 0..{world_size - 1})")
        m = metagraph.metaops.get(s.metaop)
        if m is None:
            raise PlanError(f"slice '{s.id}': MetaOp '{s.metaop}' does not exist in workload '{workload.name}'")
        if not 0 <= s.layer_start < s.layer_end <= m.num_layers:
            raise PlanError(f"slice '{s.id}': layer range [{s.layer_start}, {s.layer_end}) does not exist in "
                            f"MetaOp '{m.id}' of {m.num_layers} layers")
    for info in plan.metaops:
        m = metagraph.metaops.get(info.id)
        if m is None or m.num_layers != info.num_layers or list(m.input_shape) != list(info.input_shape):
            raise PlanError(f"plan MetaOp '{info.id}' does not match the workload's MetaOp graph")
    validate_plan(plan, workload=workload, metagraph=metagraph, check_memory=False)
    have = {(t.producer, t.consumer) for t in plan.transfers}
    need = expected_transfers(plan)
    missing = [p for p in need if p not in have]
    if missing:
        raise PlanError(f"plan lacks the transfers {missing[:3]} (producer slice -> consumer slice)")
    extra = sorted(have - set(need))
    if extra:
        raise PlanError(f"plan has transfers {extra[:3]} that no data flow needs")
    expected = expected_param_groups(plan, metagraph)
    listed: dict[str, tuple[int, ...]] = {}
    for g in plan.param_groups:
        for u in g.params:
            if u in listed:
                raise PlanError(f"parameter '{u}' is listed in two parameter device groups")
            listed[u] = tuple(sorted(g.devices))
    for u, devs in expected.items():
        if listed.get(u) != devs:
            raise PlanError(f"parameter '{u}' is held by devices {list(devs)} but the plan's param_groups "
                            f"give {list(listed[u]) if u in listed else 'none'}")


def transfer_input_index(plan: Plan, t: Transfer) -> int:
    """Position of a transfer's tensor in the consumer operator's ``inputs``: a continuation of the same
    MetaOp is input 0; otherwise the producer MetaOp's position in the consumer MetaOp's ``preds``."""
    p, c = plan.slice(t.producer), plan.slice(t.consumer)
    if p.metaop == c.metaop:
        return 0
    return plan.metaop(c.metaop).preds.index(p.metaop)
