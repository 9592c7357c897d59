"""plan/tp_shards.py: which devices reduce which TP shard of a unit under TP-sharded gradients, the rule the
runtime's keys and process groups follow (runtime/tp_shards.py)."""

from __future__ import annotations

from types import SimpleNamespace

from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.plan import tp_shards
from megatron_spindle.plan.layout import slice_units
from megatron_spindle.plan.schema import ExecutionSettings
from megatron_spindle.plan.tp_shards import (
    UnitRings,
    aligned_device_orders,
    base_unit,
    ring_surplus,
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


def _reordered(waves, orders):
    return [[SimpleNamespace(**{**vars(s), "devices": o}) for s, o in zip(ws, os)] for ws, os in zip(waves, orders)]


def _tp_groups(devices, tp):
    return [set(devices[k:k + tp]) for k in range(0, len(devices), tp)]


def test_crossing_tp_groups_are_ordered_so_each_device_holds_one_shard():
    # the twenty-fourth session's 70B plan: one slice's TP-4 groups strided, the other's compact
    g, (a, b) = _clip_towers()
    units = [slice_units(a, 0, a.num_layers)]
    waves = [[_slice(a, [0, 4, 2, 3, 1, 6, 5, 7], 4)], [_slice(b, list(range(8)), 4)]]
    assert ring_surplus(waves, g.metaops, units, SHARDED) > 0
    orders = aligned_device_orders(waves, g.metaops, units, SHARDED)
    for s, order in zip((w[0] for w in waves), (o[0] for o in orders)):
        assert _tp_groups(order, 4) == _tp_groups(s.devices, 4)  # only TP ranks move
    aligned = _reordered(waves, orders)
    assert ring_surplus(aligned, g.metaops, units, SHARDED) == 0
    assert all(len(r) == 2 for r in unit_rings(aligned, g.metaops, units, SHARDED)[units[0][0]].rings)


def test_the_shard_labels_of_the_same_holders_are_solved_once():
    """Plan selection assembles many candidates on one placement: the labels' CP-SAT model, deterministic,
    is solved once per holders (their degrees, TP and planned orders); another planned order is another
    model."""
    g, (a, b) = _clip_towers()
    units = [slice_units(a, 0, a.num_layers)]
    waves = [[_slice(a, [0, 4, 2, 3, 1, 6, 5, 7], 4)], [_slice(b, list(range(8)), 4)]]
    tp_shards._solved_shard_labels.cache_clear()
    first = aligned_device_orders(waves, g.metaops, units, SHARDED)
    assert tp_shards._solved_shard_labels.cache_info().misses == 1
    assert aligned_device_orders(waves, g.metaops, units, SHARDED) == first
    assert tp_shards._solved_shard_labels.cache_info().hits == 1
    other = [[_slice(a, [0, 4, 2, 3, 1, 6, 7, 5], 4)], [_slice(b, list(range(8)), 4)]]
    assert _tp_groups(aligned_device_orders(other, g.metaops, units, SHARDED)[0][0], 4) == _tp_groups(
        other[0][0].devices, 4)
    assert tp_shards._solved_shard_labels.cache_info().misses == 2


def test_nested_degrees_in_one_slice_are_ordered_together():
    # a's first layer is shared with b at TP 2 (degree 2), the rest only by a and c at TP 4 (degree 4)
    g, (a, b) = _clip_towers()
    first, rest = [slice_units(a, 0, 1)], [slice_units(a, 1, a.num_layers)]
    shared_b = SimpleNamespace(metaop=b.id, layer_start=0, layer_end=1, tp=2, dp=2, devices=[1, 3, 2, 0])
    again_a = SimpleNamespace(metaop=a.id, layer_start=1, layer_end=a.num_layers, tp=4, dp=1, devices=[3, 1, 0, 2])
    waves = [[_slice(a, [0, 1, 2, 3], 4)], [shared_b], [again_a]]
    groups = first + rest
    assert ring_surplus(waves, g.metaops, groups, SHARDED) > 0
    aligned = _reordered(waves, aligned_device_orders(waves, g.metaops, groups, SHARDED))
    assert ring_surplus(aligned, g.metaops, groups, SHARDED) == 0


def test_aligned_or_unshardable_orders_are_kept():
    g, (a, b) = _clip_towers()
    units = [slice_units(a, 0, a.num_layers)]
    aligned = [[_slice(a, [0, 1, 2, 3], 2)], [_slice(b, [2, 3, 0, 1], 2)]]
    assert aligned_device_orders(aligned, g.metaops, units, SHARDED) == [[[0, 1, 2, 3]], [[2, 3, 0, 1]]]
    crossed = [[_slice(a, [0, 1, 2, 3], 2)], [_slice(b, [1, 0, 3, 2], 2)]]
    whole = ExecutionSettings(tp_sharded_grads=False)
    assert aligned_device_orders(crossed, g.metaops, units, whole) == [[[0, 1, 2, 3]], [[1, 0, 3, 2]]]
    # an odd cycle of TP-2 pairs has no order with one shard per device: never worse than planned
    cycle = [[_slice(a, [0, 1], 2)], [_slice(b, [1, 2], 2)], [_slice(a, [2, 0], 2)]]
    orders = aligned_device_orders(cycle, g.metaops, units, SHARDED)
    assert (ring_surplus(_reordered(cycle, orders), g.metaops, units, SHARDED)
            <= ring_surplus(cycle, g.metaops, units, SHARDED))


def test_runtime_groups_list_plan_groups_then_rings_merged_by_devices():
    rings = {"x": UnitRings(2, ((0, 1), (2, 3))), "y": UnitRings(2, ((0, 1), (2, 3)))}
    groups = runtime_groups([((3, 2, 1, 0), ["x", "y", "z"]), ((0, 1), ["w"])], rings)
    assert groups == [((0, 1, 2, 3), ["x", "y", "z"]),
                      ((0, 1), [sub_unit("x", 0, 2), sub_unit("y", 0, 2), "w"]),
                      ((2, 3), [sub_unit("x", 1, 2), sub_unit("y", 1, 2)])]
    assert base_unit(sub_unit("vision.layers.1", 1, 2)) == "vision.layers.1" == base_unit("vision.layers.1")
