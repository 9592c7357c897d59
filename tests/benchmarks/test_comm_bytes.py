"""benchmarks/comm_bytes.py: the runtime's sets of units (plan/tp_shards.py) move exactly the bytes the simulator
charges where every shared unit is held at TP 1, and where units are held at TP 2 in one device order, in either
gradient layout (the two differ where a device holds a unit at different TP ranks, derived there)."""

import copy
import dataclasses

import pytest
from script_loader import load_script

bench = load_script("benchmarks/comm_bytes.py")


def test_tp1_plans_move_the_charged_bytes(wavefront_plan):
    """... in fp32 and, with --grad-reduce-in-bf16, bf16 gradients: half the bytes on both sides."""
    workload, _, result = wavefront_plan("clip-4", 16)
    totals = {}
    for dtype in ("fp32", "bf16"):
        plan = dataclasses.replace(result.plan, settings=dataclasses.replace(result.plan.settings, zero_stage=1,
                                                                            grad_reduce_dtype=dtype))
        row = bench.plan_bytes(plan, workload)
        assert row["tp_degrees"] == [1]
        top, most = row["busiest"], row["max"]
        assert top["model_grad"] > 0 and top["model_weights"] > 0
        same = lambda a, b: abs(a - b) <= 1e-9 * b  # noqa: E731 - summed in another order
        assert same(top["runtime_grad"], top["model_grad"]) and same(top["runtime_weights"], top["model_weights"])
        assert same(most["runtime_grad"], most["model_grad"])
        assert same(row["total"]["runtime_grad"], row["total"]["model_grad"])
        totals[dtype] = row["total"]["runtime_grad"]
    assert totals["fp32"] == pytest.approx(2 * totals["bf16"])



def test_tp2_plans_move_the_charged_bytes_in_both_layouts(wavefront_plan):
    workload, _, result = wavefront_plan("clip-4", 16)
    plan = copy.deepcopy(result.plan)
    for s in plan.slices():
        if s.kind == "layer" and len(s.devices) % 2 == 0:
            s.tp, s.dp = 2, len(s.devices) // 2
    totals = {}
    for sharded in (True, False):
        plan.settings = dataclasses.replace(plan.settings, tp_sharded_grads=sharded)
        row = bench.plan_bytes(plan, workload)
        assert row["tp_degrees"] == [1, 2]
        # summed in another order (clip-4's batches since the forty-second session: 2 in 1e16 apart)
        assert row["total"]["runtime_grad"] == pytest.approx(row["total"]["model_grad"], rel=1e-12)
        assert row["total"]["model_grad"] > 0
        assert abs(row["max"]["runtime_grad"] - row["max"]["model_grad"]) <= 1e-6 * row["max"]["model_grad"]
        totals[sharded] = row["total"]["runtime_grad"]
    assert totals[True] < totals[False]  # each TP shard over its ring, not the whole unit over every member



def test_zero3_redistributes_fewer_weight_bytes_than_zero1_gathers(wavefront_plan):
    """At ZeRO-3 the regathered groups' weights are redistributed (plan/buckets.py ``redistributed_params``): no
    device receives more than the simulator charges (its busiest member's part, on every member), and every
    device moves less than ZeRO-1's all-gather of the same groups."""
    workload, _, result = wavefront_plan("clip-4", 16)
    rows = {stage: bench.plan_bytes(dataclasses.replace(result.plan, settings=dataclasses.replace(
        result.plan.settings, zero_stage=stage)), workload) for stage in (1, 3)}
    three, one = rows[3], rows[1]
    assert three["max"]["runtime_weights"] > 0
    assert three["max"]["runtime_weights"] <= three["max"]["model_weights"] * (1 + 1e-9)
    assert three["max"]["model_weights"] < one["max"]["model_weights"]
    assert three["total"]["runtime_weights"] < one["total"]["runtime_weights"]
