"""benchmarks/comm_bytes.py: where every shared unit is held at TP 1 the runtime's layout moves exactly the bytes
the simulator charges; TP > 1 slices add their TP gradient all-gathers, which the simulator does not charge."""

import dataclasses

from script_loader import load_script

bench = load_script("benchmarks/comm_bytes.py")


def test_tp1_plans_move_the_charged_bytes(wavefront_plan):
    workload, _, result = wavefront_plan("clip-4", 16)
    plan = dataclasses.replace(result.plan, settings=dataclasses.replace(result.plan.settings, zero_stage=1))
    row = bench.plan_bytes(plan, workload)
    assert row["tp_degrees"] == [1]
    top, most = row["busiest"], row["max"]
    assert top["model_grad"] > 0 and top["model_weights"] > 0 and top["runtime_tp"] == 0
    assert top["runtime_grad"] == top["model_grad"] and top["runtime_weights"] == top["model_weights"]
    assert most["runtime_grad"] == most["model_grad"]


def test_tp_slices_gather_their_gradients(wavefront_plan):
    workload, _, result = wavefront_plan("qwen-val-70b", 256)
    row = bench.plan_bytes(result.plan, workload)
    assert max(row["tp_degrees"]) > 1 and row["max"]["runtime_tp"] > 0
    assert row["max"]["runtime_grad"] >= row["max"]["model_grad"]
