"""plan/buckets.py's rules for the weights' all-gather after the optimizer step (``regathered_groups``), which the
simulator, the planner's estimate and the runtime (runtime/weight_shards.py) all follow, and for the TP shard a
group's gradient rings reduce (``group_tp``: the simulator's and the planner's)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.plan.buckets import (
    group_tp,
    overlaps_param_gather,
    redistributed_params,
    regather_collective,
    regathered_groups,
    unit_holders,
    weights_wanted_at,
)
from megatron_spindle.plan.layout import slice_units, weight_shard_group
from megatron_spindle.plan.schema import ExecutionSettings


def _layer_slice(metaops, metaop_id, devices, tp=1):
    m = metaops[metaop_id]
    return SimpleNamespace(metaop=metaop_id, layer_start=0, layer_end=m.num_layers, tp=tp, dp=len(devices) // tp,
                           devices=devices)


def test_regathered_groups_by_stage_and_layout():
    g = build_metagraph(load_workload("tiny-vlm"))
    vision = next(m for m in g.metaops.values() if m.kind == "layer" and m.module == "vision")
    audio = next(m for m in g.metaops.values() if m.kind == "layer" and m.module == "audio")
    units = lambda m: slice_units(m, 0, m.num_layers)  # noqa: E731
    groups = [((0, 1), units(vision)), ((2, 3), units(audio))]

    def rule(vision_slices, audio_slices, stage=3):
        waves = [[_layer_slice(g.metaops, vision.id, d, tp) for d, tp in vision_slices],
                 [_layer_slice(g.metaops, audio.id, d, tp) for d, tp in audio_slices]]
        return regathered_groups(waves, g.metaops, groups, stage)

    aligned = ([([0, 1], 1)], [([2, 3], 1)])
    assert rule(*aligned, stage=0) == [False, False]  # replicated masters: every holder steps the whole unit
    assert rule(*aligned, stage=1) == rule(*aligned, stage=2) == [True, True]
    assert rule(*aligned) == [False, False]  # ZeRO-3: each weight shard is the master shard
    assert rule([([0, 1], 2)], [([2, 3], 1)]) == [True, False]  # a TP shard is not a master shard
    assert rule([([1, 0], 1)], [([2, 3], 1)]) == [True, False]  # DP ranks in another order than the members
    # the vision tower also run on device 0 alone (its group would then be (0, 1) still): shared elsewhere
    assert rule([([0, 1], 1), ([0], 1)], [([2, 3], 1)]) == [True, False]


def test_overlapped_param_gather_with_the_distributed_optimizer_and_at_zero_3():
    for stage, expected in ((0, False), (1, True), (2, True), (3, True)):
        assert overlaps_param_gather(ExecutionSettings(zero_stage=stage, overlap_param_gather=True)) is expected
    assert not overlaps_param_gather(ExecutionSettings(zero_stage=1, overlap_param_gather=False))
    assert not overlaps_param_gather(ExecutionSettings(zero_stage=3, overlap_param_gather=False))


def test_zero3_slices_wait_for_their_weights_before_their_first_layer():
    """ZeRO 1 and 2: a layer waits for its own bucket; ZeRO-3: every bucket before the slice's first layer (the
    layer ahead of a layer issues its gather, from its shard)."""
    assert [weights_wanted_at(stage, 5) for stage in (1, 2, 3)] == [5, 5, 0]
    assert weights_wanted_at(3, 0) == weights_wanted_at(1, 0) == 0


def test_group_tp_is_the_smallest_holder_tp_in_the_tp_sharded_layout():
    g = build_metagraph(load_workload("tiny-vlm"))
    vision = next(m for m in g.metaops.values() if m.kind == "layer" and m.module == "vision")
    audio = next(m for m in g.metaops.values() if m.kind == "layer" and m.module == "audio")
    half = vision.num_layers // 2
    first = SimpleNamespace(**{**vars(_layer_slice(g.metaops, vision.id, [0, 1, 2, 3], tp=4)), "layer_end": half})
    waves = [[first, _layer_slice(g.metaops, audio.id, [4, 5], tp=2)],
             [_layer_slice(g.metaops, vision.id, [0, 1], tp=2)]]
    head = slice_units(vision, 0, half)
    tail = slice_units(vision, half, vision.num_layers)
    groups = [head, tail, slice_units(audio, 0, audio.num_layers), ["nobody.holds.this"]]
    sharded = ExecutionSettings(tp_sharded_grads=True)
    # the first layers are held at TP 4 and TP 2 (reduced in the TP-2 layout), the rest at TP 2 alone
    assert group_tp(waves, g.metaops, groups, sharded) == [2, 2, 2, 1]
    # the whole-unit layout (plans written before the flag) reduces whole units whatever TP holds them
    assert group_tp(waves, g.metaops, groups, ExecutionSettings(tp_sharded_grads=False)) == [1, 1, 1, 1]
    waves[1][0].tp = 1
    assert group_tp(waves, g.metaops, groups, sharded) == [1, 1, 2, 1]
    waves[1] = []
    assert group_tp(waves, g.metaops, [head, tail], sharded) == [4, 1]


def test_zero3_redistribution_receives_what_each_member_keeps():
    """A hand count of plan/buckets.py ``redistributed_params``: a unit of 1200 parameters held by a DP-4 slice on
    devices 0-3 and a DP-2 slice on devices 2-3 and 4-5 (three holders in all), and one held at TP 2 x DP 2."""
    s = lambda devices, tp=1: SimpleNamespace(devices=devices, tp=tp, dp=len(devices) // tp)  # noqa: E731
    holders = {"a": [s([0, 1, 2, 3]), s([2, 3])], "b": [s([4, 5])], "c": [s([0, 1, 2, 3], tp=2)]}
    count = {"a": 1200, "b": 600, "c": 800}.__getitem__
    # devices 0 and 1 keep a quarter of a (300); 2 and 3 a quarter and a half of it (300 + 600); 4 and 5 half of b
    assert redistributed_params(holders, ["a", "b"], 1, count) == {0: 300, 1: 300, 2: 900, 3: 900, 4: 300, 5: 300}
    # a device holding a unit twice never receives more than the whole of it
    twice = {"a": [s([0, 1]), s([0])]}
    assert redistributed_params(twice, ["a"], 1, count) == {0: 1200, 1: 600}
    # c at TP 2 in a group of degree 2: each device keeps half of its TP shard (800 / 2 / 2); in the whole-unit
    # layout (degree 1) a TP-2 slice's part is not a master tensor as it is, so it receives the unit whole
    assert redistributed_params(holders, ["c"], 2, count) == {d: 200 for d in range(4)}
    assert redistributed_params(holders, ["c"], 1, count) == {d: 800 for d in range(4)}
    # the collective a regathered bucket's weights take after the step: ZeRO-3 an all-to-all of the busiest
    # member's part, ZeRO 1 and 2 an all-gather of the bucket's TP shard
    assert regather_collective(3, holders, ["a", "b"], 1, 1.0, count) == ("all_to_all", 900)
    assert regather_collective(1, holders, ["a", "b"], 1, 0.5, count) == ("all_gather", pytest.approx(900))
    # two slices with the same chunks on a device need them once
    same = {"a": [s([0, 1, 2, 3]), s([0, 1, 2, 3])]}
    assert redistributed_params(same, ["a"], 1, count) == {d: 300 for d in range(4)}


def test_node_local_weight_shards():
    """ZeRO-3 with the weights sharded over a slice's DP ranks on each node (``scope`` 2: nodes {0, 1}, {2, 3},
    ...): a device keeps half of a unit held on four devices, so the group is redistributed even where the slice
    runs at TP 1 on exactly its group's devices (plan/layout.py ``weight_shard_group``)."""
    assert weight_shard_group([0, 1, 2, 3, 4, 5, 6, 7], 2, 5, None) == (1, 3, 5, 7)  # TP rank 1's DP group
    assert weight_shard_group([0, 1, 2, 3, 4, 5, 6, 7], 2, 5, 4) == (5, 7)  # ... on device 5's node
    assert weight_shard_group([4, 0, 5, 1], 1, 5, 4) == (4, 5)  # in the slice's order
    s = lambda devices, tp=1: SimpleNamespace(devices=devices, tp=tp, dp=len(devices) // tp)  # noqa: E731
    count = {"a": 1200}.__getitem__
    assert redistributed_params({"a": [s([0, 1, 2, 3])]}, ["a"], 1, count, scope=2) == {d: 600 for d in range(4)}
    assert regather_collective(3, {"a": [s([0, 1, 2, 3])]}, ["a"], 1, 1.0, count, 2) == ("all_to_all", 600)
    g = build_metagraph(load_workload("tiny-vlm"))
    vision = next(m for m in g.metaops.values() if m.kind == "layer" and m.module == "vision")
    waves = [[_layer_slice(g.metaops, vision.id, [0, 1, 2, 3])]]
    units = slice_units(vision, 0, vision.num_layers)
    assert [regathered_groups(waves, g.metaops, [((0, 1, 2, 3), units)], 3, scope)
            for scope in (None, 2, 4)] == [[False], [True], [False]]


def test_zero3_redistribution_of_a_plan_is_a_dp_fraction_of_the_all_gather():
    g = build_metagraph(load_workload("tiny-vlm"))
    vision = next(m for m in g.metaops.values() if m.kind == "layer" and m.module == "vision")
    waves = [[_layer_slice(g.metaops, vision.id, [0, 1, 2, 3])], [_layer_slice(g.metaops, vision.id, [3, 2, 1, 0])]]
    units = slice_units(vision, 0, vision.num_layers)
    count = lambda u: 1000  # noqa: E731
    # the same devices in another order: regathered, and each member receives its quarter of every unit twice
    assert regathered_groups(waves, g.metaops, [((0, 1, 2, 3), units)], 3) == [True]
    need = redistributed_params(unit_holders(waves, g.metaops), units, 1, count)
    assert need == {d: pytest.approx(len(units) * 500) for d in range(4)}
