"""runtime/weight_redistribution.py's layout arithmetic, by hand (the collectives themselves run in
test_runtime_engine.py's ZeRO-3 cases on 2 and 4 ranks, against the single-process reference)."""

from __future__ import annotations

import torch

from megatron_spindle.runtime.shards import UnitShard
from megatron_spindle.runtime.weight_redistribution import (
    Segment,
    gather_unit_segments,
    merged,
    pieces_in,
)


def test_ranges_merge_and_chunks_follow_the_shards_layout():
    assert merged([(5, 9), (0, 3), (3, 4), (8, 12), (20, 20)]) == [(0, 4), (5, 12)]
    sh = UnitShard("u", ["u.w"], [torch.Size([10])], members=4, index=0)  # chunks of ceil(10 / 4) = 3
    assert [sh.bounds(j) for j in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    tiny = UnitShard("t", ["t.w"], [torch.Size([2])], members=4, index=0)  # the last members hold padding only
    assert [tiny.bounds(j) for j in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert tiny.bounds() == (0, 1)  # its own member's


def test_pieces_are_the_needs_inside_one_members_chunks_in_bucket_order():
    needs = {"b": [(0, 2), (7, 10)], "a": [(2, 8)]}
    chunks = {"a": (3, 6), "b": (6, 9)}.__getitem__
    assert pieces_in(needs, ["a", "b"], chunks) == [("a", 3, 6), ("b", 7, 9)]
    assert pieces_in(needs, ["b", "a"], chunks) == [("b", 7, 9), ("a", 3, 6)]
    assert pieces_in(needs, ["c"], lambda u: (0, 10)) == []


def test_a_gather_units_shard_maps_onto_its_masters_or_not_at_all():
    """A gather unit of two parameters (sorted keys "l.a" 3x2 and "l.b" 4), chunk [4, 8) of its 10 elements: the
    last two of "l.a" and the first two of "l.b", at their offsets in the masters' flat vectors."""
    params = [torch.zeros(3, 2), torch.zeros(4)]
    places = {"l.a": ("l", 4, torch.Size([3, 2])), "l.b": ("l~tp0of2", 0, torch.Size([4]))}
    assert gather_unit_segments(["l.a", "l.b"], params, 4, 8, places.get) == [
        Segment("l", 8, 10, 0), Segment("l~tp0of2", 0, 2, 2)]
    assert gather_unit_segments(["l.a", "l.b"], params, 0, 3, places.get) == [Segment("l", 4, 7, 0)]
    # a parameter that is not the master tensor as it is (another shape: a TP part of another degree), or that
    # has no master place: the whole gather unit is loaded from full weights instead
    other = {**places, "l.b": ("l~tp0of2", 0, torch.Size([8]))}
    assert gather_unit_segments(["l.a", "l.b"], params, 4, 8, other.get) is None
    assert gather_unit_segments(["l.a", "l.b"], params, 4, 8, {"l.a": places["l.a"]}.get) is None
