"""benchmarks/comm_bytes.py: where every shared unit is held at TP 1 the runtime's layout moves exactly the bytes
the simulator charges (the comparison adds up; where a unit is reduced at TP > 1 the two differ, derived there)."""

import dataclasses

from script_loader import load_script

bench = load_script("benchmarks/comm_bytes.py")


def test_tp1_plans_move_the_charged_bytes(wavefront_plan):
    workload, _, result = wavefront_plan("clip-4", 16)
    plan = dataclasses.replace(result.plan, settings=dataclasses.replace(result.plan.settings, zero_stage=1))
    row = bench.plan_bytes(plan, workload)
    assert row["tp_degrees"] == [1]
    top, most = row["busiest"], row["max"]
    assert top["model_grad"] > 0 and top["model_weights"] > 0
    assert top["runtime_grad"] == top["model_grad"] and top["runtime_weights"] == top["model_weights"]
    assert most["runtime_grad"] == most["model_grad"]
    assert row["total"]["runtime_grad"] == row["total"]["model_grad"]

