"""Inter-wave activation transfers: bytes per device and route, and their time (what the simulator charges and
the planner estimates).

Transfers are timed from plan/routing.py's messages, the ones the runtime sends: every consumer device
receives the rows of its data-parallel rank (each of its TP ranks), from itself (a local copy), a holder on its
island (NVLink) or another island (network); the backward sends the input gradients to every producer device
the same way. A direction of a transfer takes as long as its busiest device, sending or receiving, plus one
point-to-point latency when anything leaves a device. Bandwidths and latencies are the comm model's
(estimator/comm_model.py). Where a device loses compute time per message it sends or receives
(``ClusterSpec.message_host_seconds``, measured on CPU devices), ``transfer_host_seconds`` is what the busiest
device of a direction loses: the simulator and the planner add it to the sender's and the receiver's phase.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from megatron_spindle.estimator.comm_model import CommModel
from megatron_spindle.plan.routing import ROUTE_INTER, ROUTE_INTRA, ROUTE_LOCAL, Message
from megatron_spindle.plan.schema import TRANSFER_KINDS


@dataclass
class TransferLoad:
    """Bytes one direction of a transfer moves, per device and route: what a device receives and sends."""

    received: dict[int, dict[str, float]] = field(default_factory=dict)
    sent: dict[int, dict[str, float]] = field(default_factory=dict)
    messages: dict[int, int] = field(default_factory=dict)  # per device, messages it sends or receives to others

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
    load = TransferLoad()
    for m in messages:
        key = (m.dst, m.route)
        received[key] = received.get(key, 0) + m.n
        if m.src != m.dst and m.n:
            key = (m.src, m.route)
            sent[key] = sent.get(key, 0) + m.n
            for device in (m.src, m.dst):
                load.messages[device] = load.messages.get(device, 0) + 1
    for table, rows in ((load.received, received), (load.sent, sent)):
        for (device, route), n in rows.items():
            if n and bytes_per_row > 0:
                table.setdefault(device, dict.fromkeys(TRANSFER_KINDS, 0.0))[route] += n * bytes_per_row
    return load


def route_bandwidths(comm: CommModel) -> dict[str, float]:
    """Bytes/s per device of each route (the comm model's): a local device-to-device copy reads and writes HBM,
    NVLink point to point inside a node, the GPU's own network path across nodes."""
    return {ROUTE_LOCAL: comm.local_copy_bandwidth(), ROUTE_INTRA: comm.send_recv_bandwidth(False),
            ROUTE_INTER: comm.send_recv_bandwidth(True)}


def link_devices(load: TransferLoad) -> tuple[int, ...]:
    """The devices whose links a transfer occupies while it runs: every device it involves when anything leaves
    a device, none when it is local copies only."""
    moved = load.total_by_route()
    return tuple(sorted(load.devices)) if moved[ROUTE_INTRA] > 0 or moved[ROUTE_INTER] > 0 else ()


def transfer_host_seconds(load: TransferLoad, comm: CommModel) -> float:
    """Compute time the busiest device of a transfer loses to its messages (``message_host_seconds`` each)."""
    return comm.cluster.message_host_seconds * max(load.messages.values(), default=0)


def transfer_seconds(load: TransferLoad, comm: CommModel) -> float:
    """Time of one transfer: its busiest device (receiving or sending), plus one point-to-point latency of the
    slowest route that moves anything."""
    bw = route_bandwidths(comm)
    worst = 0.0
    for table in (load.received, load.sent):
        for routes in table.values():
            worst = max(worst, sum(b / bw[k] for k, b in routes.items()))
    moved = load.total_by_route()
    if moved[ROUTE_INTER] > 0:
        worst += comm.send_recv_latency(True)
    elif moved[ROUTE_INTRA] > 0:
        worst += comm.send_recv_latency(False)
    return worst
