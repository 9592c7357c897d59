"""Communication times of the simulator: inter-wave activation transfers and gradient all-reduces.

Transfers are timed from plan/routing.py's messages, the ones the runtime sends: every consumer device
receives the rows of its data-parallel rank (each of its TP ranks), from itself (a local copy), a holder on its
island (NVLink) or another island (network); the backward sends the input gradients to every producer device
the same way. A direction of a transfer takes as long as its busiest device, sending or receiving, plus one
link latency when anything leaves a device.

Gradient all-reduces are rings over the data-parallel replicas of each TP shard (the TP ranks reduce their
shards in parallel, each over its own ring), at NVLink speed when the group sits in one island and at the
per-GPU network share otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.plan.routing import ROUTE_INTER, ROUTE_INTRA, ROUTE_LOCAL, Message
from megatron_spindle.plan.schema import TRANSFER_KINDS


@dataclass
class TransferLoad:
    """Bytes one direction of a transfer moves, per device and route: what a device receives and sends."""

    received: dict[int, dict[str, float]] = field(default_factory=dict)
    sent: dict[int, dict[str, float]] = field(default_factory=dict)

    def total_by_route(self) -> dict[str, float]:
        out = {k: 0.0 for k in TRANSFER_KINDS}
        for routes in self.received.values():
            for k, b in routes.items():
                out[k] += b
        return out

    @property
    def devices(self) -> set[int]:
        return set(self.received) | set(self.sent)


def transfer_load(messages: Iterable[Message], bytes_per_row: float) -> TransferLoad:
    """Per-device bytes of routed messages: every receiver, and every sender that is not the receiver."""
    received: dict[tuple[int, str], int] = {}
    sent: dict[tuple[int, str], int] = {}
    for m in messages:
        key = (m.dst, m.route)
        received[key] = received.get(key, 0) + m.n
        if m.src != m.dst:
            key = (m.src, m.route)
            sent[key] = sent.get(key, 0) + m.n
    load = TransferLoad()
    for table, rows in ((load.received, received), (load.sent, sent)):
        for (device, route), n in rows.items():
            if n and bytes_per_row > 0:
                table.setdefault(device, dict.fromkeys(TRANSFER_KINDS, 0.0))[route] += n * bytes_per_row
    return load


def route_bandwidths(cluster: ClusterSpec) -> dict[str, float]:
    """Bytes/s per device of each route: a device-to-device copy reads and writes HBM."""
    return {ROUTE_LOCAL: cluster.gpu.memory_bandwidth / 2, ROUTE_INTRA: cluster.intra_node_bw,
            ROUTE_INTER: cluster.inter_node_bw}


def transfer_seconds(load: TransferLoad, cluster: ClusterSpec) -> float:
    """Time of one transfer: its busiest device (receiving or sending), plus a latency if anything moves."""
    bw = route_bandwidths(cluster)
    worst = 0.0
    for table in (load.received, load.sent):
        for routes in table.values():
            worst = max(worst, sum(b / bw[k] for k, b in routes.items()))
    moved = load.total_by_route()
    if moved[ROUTE_INTER] > 0:
        worst += cluster.inter_node_latency
    elif moved[ROUTE_INTRA] > 0:
        worst += cluster.intra_node_latency
    return worst


def ring_allreduce_seconds(nbytes: float, ranks: int, cross_island: bool, cluster: ClusterSpec) -> float:
    """Ring all-reduce of ``nbytes`` per rank over ``ranks`` ranks: 2(p-1)/p of the data per link, 2(p-1) hops."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    bw = cluster.inter_node_bw if cross_island else cluster.intra_node_bw
    lat = cluster.inter_node_latency if cross_island else cluster.intra_node_latency
    return 2 * (ranks - 1) / ranks * nbytes / bw + 2 * (ranks - 1) * lat


def ring_allgather_seconds(total_bytes: float, ranks: int, cross_island: bool, cluster: ClusterSpec) -> float:
    """Ring all-gather (or reduce-scatter) of ``total_bytes`` in all: (p-1)/p of it per link, p-1 hops."""
    if ranks <= 1 or total_bytes <= 0:
        return 0.0
    bw = cluster.inter_node_bw if cross_island else cluster.intra_node_bw
    lat = cluster.inter_node_latency if cross_island else cluster.intra_node_latency
    return (ranks - 1) / ranks * total_bytes / bw + (ranks - 1) * lat
