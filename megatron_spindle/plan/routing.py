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
from typing import NamedTuple, Protocol

from megatron_spindle.plan.layout import dp_rows
from megatron_spindle.plan.schema import TRANSFER_KINDS, Transfer

ROUTE_LOCAL, ROUTE_INTRA, ROUTE_INTER = TRANSFER_KINDS


class DeviceLayout(Protocol):
    devices: Sequence[int]
    tp: int
    dp: int


class Message(NamedTuple):
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
    n_tp = needers.tp
    holder_rank = {d: r // h_tp for r, d in enumerate(holders.devices)}
    members = [holders.devices[k * h_tp:(k + 1) * h_tp] for k in range(holders.dp)]
    by_island: list[dict[int, list[int]] | None] = [None] * holders.dp  # per rank, built when first needed
    turn: dict[tuple[int, int], int] = {}
    messages = []
    for r, d in enumerate(needers.devices):
        lo, hi = dp_rows(r // n_tp, needers.dp, batch)
        island = d // gpus_per_node
        own = holder_rank.get(d)
        for k in range(lo // h_per, (hi - 1) // h_per + 1):
            k_lo = k * h_per
            a, b = max(lo, k_lo), min(hi, k_lo + h_per)
            if own == k:
                messages.append(Message(d, d, a - k_lo, a - lo, b - a, ROUTE_LOCAL))
                continue
            islands = by_island[k]
            if islands is None:
                islands = by_island[k] = {}
                for h in members[k]:
                    islands.setdefault(h // gpus_per_node, []).append(h)
            near = islands.get(island)
            pool, key, route = (near, (k, island), ROUTE_INTRA) if near else (members[k], (k, -1), ROUTE_INTER)
            i = turn.get(key, 0)
            turn[key] = i + 1
            messages.append(Message(pool[i % len(pool)], d, a - k_lo, a - lo, b - a, route))
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


class Router:
    """Routes the transfers of one cluster, each distinct (holders, needers, batch) layout once: plans repeat
    layouts (a whole-cluster baseline routes every MetaOp between the same device lists), and the messages of
    one layout are thousands at 1024 devices. Returned lists are shared: read them, do not change them."""

    def __init__(self, gpus_per_node: int):
        self.gpus_per_node = gpus_per_node
        self._messages: dict[tuple, list[Message]] = {}
        self._rows: dict[tuple, dict[str, int]] = {}

    @staticmethod
    def key(holders: DeviceLayout, needers: DeviceLayout, batch: int) -> tuple:
        return tuple(holders.devices), holders.tp, holders.dp, tuple(needers.devices), needers.tp, needers.dp, batch

    def route(self, holders: DeviceLayout, needers: DeviceLayout, batch: int) -> list[Message]:
        key = self.key(holders, needers, batch)
        if key not in self._messages:
            self._messages[key] = route_rows(holders, needers, batch, self.gpus_per_node)
        return self._messages[key]

    def rows(self, holders: DeviceLayout, needers: DeviceLayout, batch: int) -> dict[str, int]:
        """Rows received per route (summed over the needing devices)."""
        key = self.key(holders, needers, batch)
        if key not in self._rows:
            self._rows[key] = rows_by_route(self.route(holders, needers, batch))
        return self._rows[key]

    def transfer(self, producer_id: str, consumer_id: str, producer: DeviceLayout, consumer: DeviceLayout,
                 batch: int, total_bytes: float, grad: bool = True) -> Transfer:
        """The plan's record of one transfer: ``total_bytes`` of the producer's output for the whole batch,
        routed forward and, where its gradient goes back (``grad``: not out of a module with no backward),
        backward."""
        per_row = total_bytes / batch
        forward = {k: n * per_row for k, n in self.rows(producer, consumer, batch).items()}
        backward = {k: n * per_row * grad for k, n in self.rows(consumer, producer, batch).items()}
        return Transfer(producer=producer_id, consumer=consumer_id, bytes=float(total_bytes),
                        kind=transfer_kind(forward), src_devices=list(producer.devices),
                        dst_devices=list(consumer.devices), bytes_by_kind=forward, backward_bytes_by_kind=backward)


def gradient_returns(backward: str) -> bool:
    """Whether a transfer out of a MetaOp whose backward is ``backward`` (graph/opgraph.py ``MetaOp.backward``)
    carries a gradient back: not out of one with no backward (a frozen module with nothing trainable upstream)."""
    return backward != "none"


def make_transfer(producer_id: str, consumer_id: str, producer: DeviceLayout, consumer: DeviceLayout, batch: int,
                  total_bytes: float, gpus_per_node: int) -> Transfer:
    """``Router.transfer`` for a single transfer."""
    return Router(gpus_per_node).transfer(producer_id, consumer_id, producer, consumer, batch, total_bytes)
