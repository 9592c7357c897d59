"""The masters' AdamW (runtime/optimizer.py): torch's fused implementation on CUDA."""

from __future__ import annotations

import torch
from plans import sequential_plan

from megatron_spindle.compat.groups import ensure_torch_distributed
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.runtime.engine import RuntimeEngine


def test_the_fused_adamw_a_gpu_steps_with_matches_the_default_from_a_loaded_state(monkeypatch):
    """On CUDA the masters step with torch's fused AdamW (runtime/optimizer.py ``adamw_fused``), whose step count
    lives on the device; forced here on the CPU (torch fuses AdamW there too). From the same loaded weights and
    AdamW state (two steps in), one step gives the default implementation's weights up to rounding. (Whole
    trajectories drift further apart: Adam normalises near-zero gradients, which amplifies a rounding difference.)"""
    from megatron_spindle.runtime import optimizer

    torch.set_num_threads(1)
    ensure_torch_distributed()
    w = load_workload("tiny-clip")
    plan = sequential_plan(w, 1)
    first = RuntimeEngine(plan, w, 0, 1)
    first.train_step(0)
    first.train_step(1)
    state = first.export_units()

    def resumed_step(fused: bool) -> tuple[RuntimeEngine, dict]:
        monkeypatch.setattr(optimizer, "adamw_fused", lambda device: True if fused else None)
        engine = RuntimeEngine(plan, w, 0, 1)
        engine.load_units(state)
        engine.train_step(2)
        return engine, engine.export_units()

    fused, fused_state = resumed_step(True)
    default, default_state = resumed_step(False)
    assert fused.optimizer.defaults["fused"] and not default.optimizer.defaults["fused"]
    for unit, after in default_state.items():
        for key, weight in after.model.items():
            torch.testing.assert_close(fused_state[unit].model[key], weight, rtol=1e-6, atol=3e-7)
            assert not torch.equal(weight, state[unit].model[key])  # the step moved it
        assert {k: s["step"] for k, s in fused_state[unit].optim.items()} == {k: 3.0 for k in after.optim}
