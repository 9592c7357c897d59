"""Transfer routing (plan/routing.py): hand-checked messages for local copies, same-island and other-island
holders, TP and DP mismatches, the spreading of senders, and the number of messages at 1024 devices."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from megatron_spindle.plan.routing import (
    Message,
    Router,
    backward_messages,
    forward_messages,
    make_transfer,
    rows_by_route,
    transfer_kind,
)

LOCAL, INTRA, INTER = "local", "intra_island", "inter_island"
B = 4


@dataclass
class Layout:
    devices: list[int]
    tp: int = 1

    @property
    def dp(self) -> int:
        return len(self.devices) // self.tp


@pytest.mark.parametrize("producer, consumer, gpus_per_node, forward", [
    # same devices, same split: every device copies its own rows
    (Layout([0, 1]), Layout([0, 1]), 2, [Message(0, 0, 0, 0, 2, LOCAL), Message(1, 1, 0, 0, 2, LOCAL)]),
    # rows swapped between two devices of one node
    (Layout([0, 1]), Layout([1, 0]), 2, [Message(0, 1, 0, 0, 2, INTRA), Message(1, 0, 0, 0, 2, INTRA)]),
    # the consumer sits on the other node
    (Layout([0, 1]), Layout([2, 3]), 2, [Message(0, 2, 0, 0, 2, INTER), Message(1, 3, 0, 0, 2, INTER)]),
    # dp 1 -> dp 2: device 0 keeps its first half, sends the second half (rows 2..4) to device 1
    (Layout([0]), Layout([0, 1]), 2, [Message(0, 0, 0, 0, 2, LOCAL), Message(0, 1, 2, 0, 2, INTRA)]),
    # dp 2 -> dp 1 on one device: one local copy and one message, each to its place in the full batch
    (Layout([0, 1]), Layout([1]), 4, [Message(0, 1, 0, 0, 2, INTRA), Message(1, 1, 0, 2, 2, LOCAL)]),
    # a TP=2 producer holds every row on both devices: the consumers of its node take turns between them
    (Layout([0, 1], tp=2), Layout([2, 3]), 4, [Message(0, 2, 0, 0, 2, INTRA), Message(1, 3, 2, 0, 2, INTRA)]),
    # holders on two nodes: the one on the consumer's node sends, not the first one
    (Layout([0, 2], tp=2), Layout([3]), 2, [Message(2, 3, 0, 0, 4, INTRA)]),
    # no holder on the consumer's node: a holder of the rank sends across the network
    (Layout([0, 1, 2, 3], tp=2), Layout([4, 5]), 2, [Message(0, 4, 0, 0, 2, INTER), Message(2, 5, 0, 0, 2, INTER)]),
    # a TP=2 consumer: both of its devices need every row of their DP rank
    (Layout([0, 1]), Layout([0, 1], tp=2), 2, [Message(0, 0, 0, 0, 2, LOCAL), Message(1, 0, 0, 2, 2, INTRA),
                                                Message(0, 1, 0, 0, 2, INTRA), Message(1, 1, 0, 2, 2, LOCAL)]),
])
def test_forward_messages_by_hand(producer, consumer, gpus_per_node, forward):
    assert forward_messages(producer, consumer, B, gpus_per_node) == forward


def test_backward_reaches_every_producer_device_so_its_bytes_differ_when_tp_differs():
    """Producer TP=2 on nodes 0-1 (devices 0-3), consumer TP=1 on node 2: the forward delivers each row once
    (to one consumer device), the backward delivers each row to both TP ranks of the producer."""
    producer, consumer = Layout([0, 1, 2, 3], tp=2), Layout([4, 5])
    assert backward_messages(producer, consumer, B, 2) == [
        Message(4, 0, 0, 0, 2, INTER), Message(4, 1, 0, 0, 2, INTER),
        Message(5, 2, 0, 0, 2, INTER), Message(5, 3, 0, 0, 2, INTER)]
    t = make_transfer("p", "c", producer, consumer, B, 4000.0, 2)
    assert t.bytes_by_kind == {LOCAL: 0.0, INTRA: 0.0, INTER: 4000.0}
    assert t.backward_bytes_by_kind == {LOCAL: 0.0, INTRA: 0.0, INTER: 8000.0}
    assert (t.kind, t.src_devices, t.dst_devices) == (INTER, [0, 1, 2, 3], [4, 5])


def test_transfer_kind_is_the_worst_route_that_moves_bytes():
    assert transfer_kind({LOCAL: 5.0, INTRA: 0.0, INTER: 0.0}) == LOCAL
    assert transfer_kind({LOCAL: 5.0, INTRA: 1.0, INTER: 0.0}) == INTRA
    assert transfer_kind({LOCAL: 0.0, INTRA: 1.0, INTER: 1.0}) == INTER


def test_one_message_per_needing_device_and_overlapping_rank_at_1024_devices():
    """The routing work is its messages: a TP=8 consumer of a DP-1024 producer gets 8 ranks on each of its
    1024 devices (8192 messages), the backward one rank per producer device (1024), and nothing is compared
    pairwise (the old bytes-by-route loop did 1024 x 1024 per transfer)."""
    n, batch = 1024, 2048
    producer, consumer = Layout(list(range(n))), Layout(list(range(n)), tp=8)
    fwd = forward_messages(producer, consumer, batch, 8)
    bwd = backward_messages(producer, consumer, batch, 8)
    assert len(fwd) == 8 * n and len(bwd) == n
    assert rows_by_route(fwd) == {LOCAL: n * 2, INTRA: n * 14, INTER: 0}  # 16 rows per consumer device
    assert rows_by_route(bwd) == {LOCAL: n * 2, INTRA: 0, INTER: 0}  # every device holds its own 2 rows
    router = Router(8)
    assert router.route(producer, consumer, batch) is router.route(Layout(list(range(n))), consumer, batch)
