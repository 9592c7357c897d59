"""Transfer routing: which device sends which rows of a producer slice's output to which consumer device (and
the input gradients back), by which route. The runtime sends these messages, the simulator times them, and
the plan's bytes by route are their sum.

Every device of the needing slice needs the rows of its own data-parallel rank (all its TP ranks need them).
The holding slice's DP rank k holds rows ``[k*B/dp, (k+1)*B/dp)`` on each of its TP ranks, identically (the
output of a TP group is replicated; so is the input gradient). For every (needing device, overlapping holder
rank) one message carries the overlap, from:

1. the needing device itself when it is one of the holders: a ``local`` copy;
2. else a holder on the same island (node): ``intra_island``;
3. else any holder: ``inter_island``.

Among equivalent holders (same rank, same island class) senders take turns in the needing devices' order, so
the sending spreads deterministically. Each needing DP rank overlaps a contiguous run of holder ranks, so the
routing of a transfer takes time linear in its messages: at most ``tp_needing * (dp_holding + dp_needing)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from megatron_spindle.plan.layout import dp_rows
from megatron_spindle.plan.schema import TRANSFER_KINDS, Transfer

ROUTE_LOCAL, ROUTE_INTRA, ROUTE_INTER = TRANSFER_KINDS


class DeviceLayout(Protocol):
    devices: Sequence[int]
    tp: int
    dp: int


@dataclass(frozen=True)
class Message:
    """``src`` sends rows ``[src_start, src_start+n)`` of its local shard to ``dst``, which puts them at
    ``[dst_start, dst_start+n)`` of its local shard; ``src == dst`` is a local copy."""

    src: int
    dst: int
    src_start: int
    dst_start: int
    n: int
    route: str


def route_rows(holders: DeviceLayout, needers: DeviceLayout, batch: int, gpus_per_node: int) -> list[Message]:
    """Messages that give every device of ``needers`` its rows out of ``holders`` (see the module docstring)."""
    h_tp, h_per = holders.tp, batch // holders.dp
    holder_rank = {d: r // h_tp for r, d in enumerate(holders.devices)}
    turn: dict[tuple[int, int], int] = {}
    messages = []
    for r, d in enumerate(needers.devices):
        lo, hi = dp_rows(r // needers.tp, needers.dp, batch)
        island = d // gpus_per_node
        for k in range(lo // h_per, (hi - 1) // h_per + 1):
            k_lo = k * h_per
            a, b = max(lo, k_lo), min(hi, k_lo + h_per)
            if holder_rank.get(d) == k:
                src, route = d, ROUTE_LOCAL
            else:
                members = holders.devices[k * h_tp:(k + 1) * h_tp]
                near = [h for h in members if h // gpus_per_node == island]
                pool, key = (near, (k, island)) if near else (members, (k, -1))
                i = turn.get(key, 0)
                turn[key] = i + 1
                src, route = pool[i % len(pool)], (ROUTE_INTRA if near else ROUTE_INTER)
            messages.append(Message(src, d, a - k_lo, a - lo, b - a, route))
    return messages


def forward_messages(producer: DeviceLayout, consumer: DeviceLayout, batch: int, gpus_per_node: int) -> list[Message]:
    """Activations: producer output rows -> every consumer device (each of its TP ranks)."""
    return route_rows(producer, consumer, batch, gpus_per_node)


def backward_messages(producer: DeviceLayout, consumer: DeviceLayout, batch: int,
                      gpus_per_node: int) -> list[Message]:
    """Gradients: consumer input-gradient rows -> every producer device (each of its TP ranks)."""
    return route_rows(consumer, producer, batch, gpus_per_node)


def rows_by_route(messages: Iterable[Message]) -> dict[str, int]:
    out = dict.fromkeys(TRANSFER_KINDS, 0)
    for m in messages:
        out[m.route] += m.n
    return out


def bytes_by_route(messages: Iterable[Message], bytes_per_row: float) -> dict[str, float]:
    """Bytes received per route, summed over the receiving devices."""
    return {k: rows * bytes_per_row for k, rows in rows_by_route(messages).items()}


def transfer_kind(bytes_by_kind: dict[str, float]) -> str:
    """"local" when nothing moves, "intra_island" when all moved bytes stay inside nodes, else "inter_island"."""
    if bytes_by_kind.get(ROUTE_INTER, 0.0) > 0:
        return ROUTE_INTER
    if bytes_by_kind.get(ROUTE_INTRA, 0.0) > 0:
        return ROUTE_INTRA
    return ROUTE_LOCAL


def make_transfer(producer_id: str, consumer_id: str, producer: DeviceLayout, consumer: DeviceLayout, batch: int,
                  total_bytes: float, gpus_per_node: int) -> Transfer:
    """The plan's record of one transfer: ``total_bytes`` of the producer's output for the whole batch, routed
    forward and backward."""
    per_row = total_bytes / batch
    forward = bytes_by_route(forward_messages(producer, consumer, batch, gpus_per_node), per_row)
    backward = bytes_by_route(backward_messages(producer, consumer, batch, gpus_per_node), per_row)
    return Transfer(producer=producer_id, consumer=consumer_id, bytes=float(total_bytes), kind=transfer_kind(forward),
                    src_devices=list(producer.devices), dst_devices=list(consumer.devices), bytes_by_kind=forward,
                    backward_bytes_by_kind=backward)
