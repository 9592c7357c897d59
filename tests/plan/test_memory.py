"""Per-device memory rules (plan/memory.py) on hand-built slices: a unit once at its largest share, ZeRO
sharding over the slice's DP ranks, activations from forward to backward with the peak over the order."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from megatron_spindle.estimator import AnalyticCostModel, CostModelConfig, MemoryModel
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.opgraph import MetaOp, build_metagraph
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.plan.layout import device_programs, weight_shard_degree, weight_shard_group
from megatron_spindle.plan.memory import (
    STATE_BYTES_PER_PARAM,
    WEIGHT_BYTES_PER_PARAM,
    DeviceMemory,
    SliceMemory,
    ZeroSharded,
    gathered_weight_bytes,
    memory_breakdown,
    peak_memory,
    step_cast_bytes,
    zero_state_bytes_per_param,
)
from megatron_spindle.plan.order import FWD, slice_order
from megatron_spindle.plan.schema import ExecutionSettings


@dataclass
class S:  # the slice geometry the rules read
    metaop: str
    devices: list[int]
    tp: int = 1
    layer_start: int = 0
    layer_end: int = 2

    @property
    def dp(self) -> int:
        return len(self.devices) // self.tp


class Numbers:
    """1000 bytes of training state per unit (split over tp), 10 bytes of activations per layer and sample."""

    def param_state_bytes(self, unit, tp):
        return 1000.0 / tp

    def activation_bytes(self, metaop, tp, dp, num_layers):
        return 10.0 * num_layers * metaop.batch / dp


def op(mid: str, units: list[str], batch: int = 4) -> MetaOp:
    return MetaOp(mid, "layer", (batch, 8, 16), [f"{mid}#{i}" for i in range(len(units))], [(u,) for u in units],
                  "t", "m", "layer", 0, 0)


METAOPS = {"a": op("a", ["w.0", "w.1"]), "b": op("b", ["w.0", "w.1"]), "c": op("c", ["v.0", "v.1"])}


def test_a_unit_counts_once_at_its_largest_share():
    """a and b share w.0 and w.1; device 0 runs a at tp 1 and b at tp 2: it holds 2 x 1000 (not 1000 + 500)."""
    waves = [[S("a", [0])], [S("b", [0, 1], tp=2)]]
    memory = peak_memory(waves, METAOPS, ZeroSharded(Numbers(), 0, tp_sharded=True), 3)
    acts_a, acts_b = 10 * 2 * 4, 10 * 2 * 4  # b: dp 1 on 2 devices (tp 2)
    assert memory == [2000 + acts_a + acts_b, 2 * 500 + acts_b, 0.0]


def test_the_whole_unit_layout_holds_whole_units_of_gradients():
    """The whole-unit layout (``tp_sharded_grads`` False: plans written before the flag) keeps a TP-2 unit's
    gradient whole at ZeRO 0 and 1, and its optimizer state whole at ZeRO 0; the ZeRO shards of whole units
    weigh what a TP shard's over dp would."""
    per_shard_param = {0: 2 + 16 * 2, 1: 2 + 4 * 2 + 12 / 2, 2: 2 + 16 / 2, 3: 18 / 2}
    for stage, per_param in per_shard_param.items():
        assert zero_state_bytes_per_param(stage, 2, tp=2, tp_sharded=False) == pytest.approx(per_param)
        assert zero_state_bytes_per_param(stage, 2, tp=1, tp_sharded=False) == zero_state_bytes_per_param(stage, 2)
        # b at TP 2 and DP 2 on four devices: each holds 500 bytes of state of a TP shard, as the rule scales it
        waves = [[S("b", [0, 1, 2, 3], tp=2)]]
        gathered = 2 * 500 * WEIGHT_BYTES_PER_PARAM / STATE_BYTES_PER_PARAM if stage == 3 else 0.0
        held = peak_memory(waves, METAOPS, ZeroSharded(Numbers(), stage, tp_sharded=False), 4)[0] \
            - 10 * 2 * 4 / 2 - gathered
        assert held == pytest.approx(2 * 500 * per_param / STATE_BYTES_PER_PARAM)
    # settings carry the layout into the plan's accounting
    assert ZeroSharded.of(Numbers(), ExecutionSettings(zero_stage=1)).tp_sharded
    assert not ZeroSharded.of(Numbers(), ExecutionSettings(zero_stage=1, tp_sharded_grads=False)).tp_sharded


def test_zero_shards_the_state_over_the_slice_s_data_parallel_ranks():
    """At stage 3 a device also holds, while the slice runs, two layers' full bf16 weights (the one running and
    the next, prefetched: runtime/weight_shards.py): 2 x 1000 x 2 / 18 bytes; none on one DP rank."""
    waves = [[S("c", [0, 1, 2, 3])]]  # dp 4
    for stage, per_param in ((0, 18), (1, 2 + 4 + 12 / 4), (2, 2 + 16 / 4), (3, 18 / 4)):
        assert zero_state_bytes_per_param(stage, 4) == pytest.approx(per_param)
        gathered = 2 * 1000 * WEIGHT_BYTES_PER_PARAM / STATE_BYTES_PER_PARAM if stage == 3 else 0.0
        held = peak_memory(waves, METAOPS, ZeroSharded(Numbers(), stage), 4)[0] - 10 * 2 * 4 / 4 - gathered
        assert held == pytest.approx(2 * 1000 * per_param / STATE_BYTES_PER_PARAM)
    one = peak_memory([[S("c", [0])]], METAOPS, ZeroSharded(Numbers(), 3), 1)[0]
    assert one == pytest.approx(2 * 1000 + 10 * 2 * 4)


def test_node_local_weight_shards_divide_the_weights_by_the_slice_s_ranks_on_a_node():
    """ZeRO-3 with node-local weight shards (hpZ): masters, moments and gradients over the 4 DP ranks, the bf16
    weights over the 2 of them on each 2-device node: 2 / 2 + 16 / 4 bytes per parameter; with 4 per node, as
    ZeRO-3. The weight shard degree is the slice's smallest node group."""
    assert zero_state_bytes_per_param(3, 4, weight_dp=2) == pytest.approx(2 / 2 + 16 / 4)
    assert zero_state_bytes_per_param(3, 4, weight_dp=4) == zero_state_bytes_per_param(3, 4)
    waves = [[S("c", [0, 1, 2, 3])]]
    settings = ExecutionSettings(zero_stage=3, node_local_weights=True)
    for per_node, weight_dp in ((2, 2), (4, 4), (1, 1)):
        numbers = ZeroSharded.of(Numbers(), settings, per_node)
        assert numbers.weight_scope == per_node
        gathered = 2 * 1000 * WEIGHT_BYTES_PER_PARAM / STATE_BYTES_PER_PARAM if weight_dp > 1 else 0.0
        held = peak_memory(waves, METAOPS, numbers, 4)[0] - 10 * 2 * 4 / 4 - gathered
        per_param = zero_state_bytes_per_param(3, 4, weight_dp=weight_dp)
        assert held == pytest.approx(2 * 1000 * per_param / STATE_BYTES_PER_PARAM), per_node
    assert weight_shard_degree(S("c", [0, 1, 2, 3, 4, 5]), 4) == 2  # nodes {0-3} and {4, 5}: the smaller
    with pytest.raises(ValueError, match="gpus_per_node"):
        ZeroSharded.of(Numbers(), settings)


def test_the_weight_shard_degree_is_the_smallest_group_any_device_of_the_slice_gathers_from():
    """``weight_shard_degree`` counts (TP rank, node) pairs; it is the definition over every device's
    ``weight_shard_group``, on strided and compact TP groups and nodes the slice covers unevenly."""
    slices = [S("c", [0, 1, 2, 3, 4, 5]), S("c", [0, 4, 1, 5, 2, 6, 3, 7], tp=2),
              S("c", [0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15], tp=4), S("c", [3, 2, 9, 8, 17, 16], tp=2),
              S("c", list(range(0, 24, 3)), tp=2), S("c", [5])]
    expected = {4: [2, 4, 1, 1, 1, 1], 8: [6, 4, 1, 1, 1, 1]}
    for scope, want in expected.items():
        got = [weight_shard_degree(s, scope) for s in slices]
        assert got == [min(len(weight_shard_group(s.devices, s.tp, d, scope)) for d in s.devices) for s in slices]
        assert got == want, scope


def test_the_estimator_s_distributed_optimizer_is_the_same_rule_exactly():
    w, c = load_workload("tiny-clip"), make_cluster(8)
    cost = AnalyticCostModel(w, c)
    sharded, plain = MemoryModel(w, c, cost, distributed_optimizer=True), MemoryModel(w, c, cost)
    for unit in ("vision.layers.0", "text.frontend"):
        for tp, dp in ((1, 1), (1, 8), (2, 4)):
            assert sharded.param_state_bytes(unit, tp, dp) == ZeroSharded(plain, 1).param_state_bytes(unit, tp, dp)
            assert plain.param_state_bytes(unit, tp, dp) == ZeroSharded(sharded, 0).param_state_bytes(unit, tp, dp)


def test_bf16_main_gradients_hold_two_bytes_per_parameter_under_every_zero_stage():
    """--grad-reduce-in-bf16 (the cost model's grad_bytes 2): a unit's state is 2 + 2 + 12 bytes per parameter,
    sharded by ZeRO as fp32's 18 are; the estimator's numbers and ``ZeroSharded`` of them apply the same rule."""
    assert [zero_state_bytes_per_param(z, 4, grad_bytes=2) for z in (0, 1, 2, 3)] == \
        pytest.approx([16, 2 + 2 + 12 / 4, 2 + 14 / 4, 16 / 4])
    w, c = load_workload("tiny-clip"), make_cluster(8)
    half = MemoryModel(w, c, AnalyticCostModel(w, c, config=CostModelConfig(grad_bytes=2)))
    full = MemoryModel(w, c, AnalyticCostModel(w, c))
    params = full.cost_model.param_count("vision.layers.0")
    assert half.param_state_bytes("vision.layers.0", 1) == pytest.approx(16 * params)
    for stage in (0, 1, 2, 3):
        sharded = ZeroSharded(half, stage)
        assert sharded.param_state_bytes("vision.layers.0", 2, 4) == pytest.approx(
            params / 2 * zero_state_bytes_per_param(stage, 4, 2, grad_bytes=2))
        assert ZeroSharded(full, stage).param_state_bytes("vision.layers.0", 2, 4) == pytest.approx(
            params / 2 * zero_state_bytes_per_param(stage, 4, 2))
    layer = build_metagraph(w).metaops["vision_text/vision"]  # ZeRO-3's gathered weights are bf16 either way
    assert gathered_weight_bytes(ZeroSharded(half, 3), layer, 1, 4, 2) == pytest.approx(
        gathered_weight_bytes(ZeroSharded(full, 3), layer, 1, 4, 2))


class HalfGradNumbers(Numbers):
    """``Numbers`` of 100 parameters per unit with bf16 main gradients (16 bytes each); no activations."""

    grad_bytes = 2

    def param_state_bytes(self, unit, tp):
        return 1600.0 / tp

    def activation_bytes(self, metaop, tp, dp, num_layers):
        return 0.0


def test_the_step_s_fp32_copies_of_bf16_gradients_count_where_they_exceed_the_activations():
    """The optimizer step casts bf16 main gradients to fp32: 4 bytes per parameter of the TP rank at ZeRO 0, of
    its shard above (``step_cast_bytes``), a unit counted once per device at its largest copy; the peak is the
    larger of the activations' and the copies' (made after the backward)."""
    waves = [[S("a", [0, 1])], [S("b", [0, 1], tp=2)], [S("c", [1])]]  # a and b share w.0, w.1
    for stage, a_dp in ((0, 1), (1, 2), (2, 2), (3, 2)):
        numbers = ZeroSharded(HalfGradNumbers(), stage)
        assert step_cast_bytes(numbers, "w.0", 1, 2) == pytest.approx(400 / a_dp)
        params, peak = zip(*memory_breakdown(waves, METAOPS, numbers, 3))
        # at ZeRO 2 and 3 device 0 also stages w.0 and w.1 (whole: a holds them at TP 1, 200 bytes each in bf16)
        # from b's backward to a's (staged_gradients), beside a's gathered weights at ZeRO-3 (2 layers, 400)
        staged = 2 * 200.0 if stage >= 2 else 0.0
        gathered = 400.0 if stage == 3 else 0.0
        assert peak == pytest.approx((max(2 * 400 / a_dp, staged + gathered), 2 * 400 / a_dp + 2 * 400, 0.0))
        assert params[0] == pytest.approx(2 * 1600 * zero_state_bytes_per_param(stage, 2, grad_bytes=2) / 16)
    fp32 = HalfGradNumbers()
    fp32.grad_bytes = 4  # the fp32 gradients are the masters': no copies
    assert [p for _, p in memory_breakdown(waves, METAOPS, ZeroSharded(fp32, 0), 3)] == [0.0, 0.0, 0.0]


def test_activations_live_from_forward_to_backward_and_segments_free_them():
    waves = [[S("a", [0])], [S("c", [0])]]
    one = peak_memory(waves, METAOPS, ZeroSharded(Numbers(), 0), 1)
    apart = peak_memory(waves, METAOPS, ZeroSharded(Numbers(), 0), 1,
                        slice_order([["t"], ["t"]], ExecutionSettings(segments=[[0], [1]])))
    assert one == [4000 + 80 + 80] and apart == [4000 + 80]


def test_device_memory_need_is_what_the_total_grows_by():
    memory = DeviceMemory(1, capacity=10_000)
    first = SliceMemory({"w.0": 1000.0, "w.1": 1000.0}, 50.0)
    assert memory.need(0, first) == 2050
    memory.forward(0, first)
    shared = SliceMemory({"w.0": 500.0, "v.0": 300.0}, 20.0)  # w.0 held already, at a larger share
    assert memory.need(0, shared) == 300 + 20
    memory.forward(0, shared)
    memory.backward(0, shared)
    memory.backward(0, first)
    assert memory.total(0) == 2300 + 70 and memory.free(0) == 10_000 - 2370
    again = SliceMemory({"v.0": 300.0}, 60.0)  # after the backward, 60 fits under the 70 peak
    assert memory.need(0, again) == 0


def test_devices_running_the_same_slices_are_grouped():
    waves = [[S("a", [0, 1]), S("c", [2])], [S("b", [0, 1, 2, 3], tp=2)]]
    assert device_programs(waves, 5) == {((0, 0), (1, 0)): [0, 1], ((0, 1), (1, 0)): [2], ((1, 0),): [3], (): [4]}


def test_plan_memory_of_a_real_plan_matches_device_by_device_accounting():
    """The grouped accounting equals running every device on its own (DeviceMemory per device)."""
    from megatron_spindle.plan.memory import plan_memory, slice_memory
    from megatron_spindle.planner.pipeline import PlannerConfig, plan_workload

    w = load_workload("tiny-vlm")
    res = plan_workload(w, make_cluster(8, 4, "CPU"), PlannerConfig(planner="wavefront"))
    plan, g = res.plan, build_metagraph(w)
    numbers = ZeroSharded(res.memory_model, plan.settings.zero_stage)
    each = DeviceMemory(plan.num_devices)
    for wi, si, phase in slice_order([[s.task for s in w.slices] for w in plan.waves], plan.settings):
        s = plan.waves[wi].slices[si]
        for d in s.devices:
            sm = slice_memory(g.metaops[s.metaop], s, numbers, plan.settings.recompute_of(s.id))
            (each.forward if phase == FWD else each.backward)(d, sm)
    assert plan_memory(plan, g.metaops, res.memory_model) == each.totals() == plan.memory_per_device
