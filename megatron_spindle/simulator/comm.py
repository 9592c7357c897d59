"""Communication times of the simulator: inter-wave activation transfers and gradient all-reduces.

Transfers are timed from where the rows actually live. The producer slice's device ``r`` holds the samples of
its data-parallel rank (plan.py layout); every consumer device needs the samples of its own data-parallel
rank (all TP ranks of a consumer need them). Each needed row range is fetched from a holder, preferring the
device itself (a local copy), then a holder on the same island (NVLink), then any holder (network); holders
of the same rows share the sending. A transfer takes as long as its busiest device, sending or receiving,
plus one link latency when anything leaves a device.

Gradient all-reduces are rings over the data-parallel replicas of each TP shard (the TP ranks reduce their
shards in parallel, each over its own ring), at NVLink speed when the group sits in one island and at the
per-GPU network share otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.planner.plan import TRANSFER_KINDS

ROUTE_LOCAL, ROUTE_INTRA, ROUTE_INTER = TRANSFER_KINDS


def sample_range(position: int, tp: int, dp: int, batch: int) -> tuple[int, int]:
    """Samples [lo, hi) held by device ``devices[position]`` of a (tp, dp) slice (plan.py layout)."""
    per_rank = batch // dp
    rank = position // tp
    return rank * per_rank, (rank + 1) * per_rank


@dataclass
class TransferLoad:
    """Bytes one transfer moves, per device and route: what a device receives and what it sends."""

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


def _add(table: dict[int, dict[str, float]], device: int, route: str, nbytes: float) -> None:
    row = table.setdefault(device, {k: 0.0 for k in TRANSFER_KINDS})
    row[route] += nbytes


def transfer_load(total_bytes: float, batch: int, src_devices: Sequence[int], src_tp: int, src_dp: int,
                  dst_devices: Sequence[int], dst_tp: int, dst_dp: int, cluster: ClusterSpec) -> TransferLoad:
    """Route every row range a consumer device needs to a producer device that holds it."""
    load = TransferLoad()
    if total_bytes <= 0 or batch <= 0:
        return load
    per_sample = total_bytes / batch
    src_per_rank = batch // src_dp
    turn: dict[int, int] = {}  # round-robin among remote holders of the same producer rank
    for r, d in enumerate(dst_devices):
        lo, hi = sample_range(r, dst_tp, dst_dp, batch)
        for rank in range(lo // src_per_rank, (hi - 1) // src_per_rank + 1):
            common = min(hi, (rank + 1) * src_per_rank) - max(lo, rank * src_per_rank)
            if common <= 0:
                continue
            nbytes = common * per_sample
            devs = src_devices[rank * src_tp:(rank + 1) * src_tp]
            if d in devs:
                _add(load.received, d, ROUTE_LOCAL, nbytes)
                continue
            near = [h for h in devs if cluster.island(h) == cluster.island(d)]
            pool = near or devs
            k = turn.get(rank, 0)
            turn[rank] = k + 1
            src = pool[k % len(pool)]
            route = ROUTE_INTRA if near else ROUTE_INTER
            _add(load.received, d, route, nbytes)
            _add(load.sent, src, route, nbytes)
    return load


def transfer_seconds(load: TransferLoad, cluster: ClusterSpec) -> float:
    """Time of one transfer: its busiest device (receiving or sending), plus a latency if anything moves."""
    bw = {ROUTE_LOCAL: cluster.gpu.memory_bandwidth / 2,  # a device-to-device copy reads and writes HBM
          ROUTE_INTRA: cluster.intra_node_bw, ROUTE_INTER: cluster.inter_node_bw}
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


def group_spans_islands(devices: Sequence[int], cluster: ClusterSpec) -> bool:
    return not cluster.same_island(devices)


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
