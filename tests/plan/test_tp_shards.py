"""plan/tp_shards.py: which devices reduce which TP shard of a unit under TP-sharded gradients, the rule the
runtime's keys and process groups follow (runtime/tp_shards.py)."""

from __future__ import annotations

from types import SimpleNamespace

from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.plan.layout import slice_units
from megatron_spindle.plan.schema import ExecutionSettings
from megatron_spindle.plan.tp_shards import (
    UnitRings,
    base_unit,
    runtime_groups,
    shard_of,
    sub_unit,
    unit_rings,
)

SHARDED = ExecutionSettings(tp_sharded_grads=True)


def _clip_towers():
    g = build_metagraph(load_workload("tiny-clip"))
    vision = [m for m in g.metaops.values() if m.kind == "layer" and m.module == "vision"]  # two tasks share it
    return g, vision


def _slice(m, devices, tp):
    return SimpleNamespace(metaop=m.id, layer_start=0, layer_end=m.num_layers, tp=tp, dp=len(devices) // tp,
                           devices=devices)


def test_shard_of_nests_tp_ranks_in_the_shards_of_a_smaller_degree():
    s = SimpleNamespace(devices=[5, 4, 7, 6], tp=4)
    assert [shard_of(s, d, 2) for d in (5, 4, 7, 6)] == [0, 0, 1, 1]
    assert [shard_of(s, d, 4) for d in (5, 4, 7, 6)] == [0, 1, 2, 3]
    two = SimpleNamespace(devices=[0, 1, 2, 3], tp=2)  # two DP replicas of TP 2
    assert [shard_of(two, d, 2) for d in range(4)] == [0, 1, 0, 1]


def test_rings_of_a_unit_held_at_two_tp_degrees_in_two_orders():
    g, (a, b) = _clip_towers()
    waves = [[_slice(a, [0, 1, 2, 3], 2)], [_slice(b, [1, 0, 3, 2], 4)]]
    units = slice_units(a, 0, a.num_layers)
    rings = unit_rings(waves, g.metaops, [units], SHARDED)
    assert set(rings) == set(units)
    # TP 2 at [0, 1, 2, 3]: shard 0 on 0 and 2; TP 4 at [1, 0, 3, 2]: TP ranks 0, 1 (devices 1, 0) in shard 0
    assert rings[units[0]] == UnitRings(2, ((0, 1, 2), (1, 2, 3)))
    assert unit_rings(waves, g.metaops, [units], ExecutionSettings(tp_sharded_grads=False)) == {}  # whole units
    # the group's degree is its smallest holder TP: a TP-1 holder leaves the group whole
    assert unit_rings(waves + [[_slice(a, [0, 1, 2, 3], 1)]], g.metaops, [units], SHARDED) == {}


def test_the_degree_divides_every_holder_tp():
    g, (a, b) = _clip_towers()
    units = [slice_units(a, 0, a.num_layers)]
    six = [[_slice(a, list(range(6)), 6)], [_slice(b, [0, 1, 2, 3], 4)]]  # a 6-GPU node's TPs: shards of 2
    assert unit_rings(six, g.metaops, units, SHARDED)[units[0][0]] == UnitRings(2, ((0, 1, 2), (2, 3, 4, 5)))
    coprime = [[_slice(a, [0, 1], 2)], [_slice(b, [0, 1, 2], 3)]]  # nothing nests in both: whole units
    assert unit_rings(coprime, g.metaops, units, SHARDED) == {}


def test_runtime_groups_list_plan_groups_then_rings_merged_by_devices():
    rings = {"x": UnitRings(2, ((0, 1), (2, 3))), "y": UnitRings(2, ((0, 1), (2, 3)))}
    groups = runtime_groups([((3, 2, 1, 0), ["x", "y", "z"]), ((0, 1), ["w"])], rings)
    assert groups == [((0, 1, 2, 3), ["x", "y", "z"]),
                      ((0, 1), [sub_unit("x", 0, 2), sub_unit("y", 0, 2), "w"]),
                      ((2, 3), [sub_unit("x", 1, 2), sub_unit("y", 1, 2)])]
    assert base_unit(sub_unit("vision.layers.1", 1, 2)) == "vision.layers.1" == base_unit("vision.layers.1")
