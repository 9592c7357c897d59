"""Runtime engine vs a single-process reference, with stand-in operators (tests/runtime/standin.py) that
follow the operator contract with real TP sharding and DP-aware losses. Many plans per spawned world."""

from __future__ import annotations

import pytest
import torch

from harness import check_engine_against, reference_trajectory, spawn
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.planner.plan import PlanError
from megatron_spindle.runtime.engine import EngineConfig, OptimizerConfig, RuntimeEngine
from plans import random_plan, sequential_plan, unit_device_sets
from standin import StandinReference, standin_batch, standin_factory

OPT = OptimizerConfig(lr=1e-2, weight_decay=0.01)


def standin_trajectory(workload):
    ref = StandinReference(workload)
    params = {k.replace("__", "."): p for k, p in ref.full.items()}
    weights = {t.name: t.loss.weight for t in workload.tasks}
    return reference_trajectory(ref, params, weights, OPT)


def plan_cases(world: int):
    """(label, workload name, plan factory) for a world size; every plan family the engine must run."""
    cases = [("sequential", "tiny-clip", lambda w: sequential_plan(w, world)),
             ("sequential", "tiny-vlm", lambda w: sequential_plan(w, world))]
    if world >= 2:
        cases += [("sequential-tp2", "tiny-clip", lambda w: sequential_plan(w, world, tp=2)),
                  ("sequential-tp2", "tiny-vlm", lambda w: sequential_plan(w, world, tp=2))]
    for seed in (1, 2) if world > 1 else (1,):
        cases += [(f"spindle-{seed}", "tiny-clip", lambda w, s=seed: random_plan(w, world, s)),
                  (f"spindle-{seed}", "tiny-vlm", lambda w, s=seed: random_plan(w, world, s))]
    return cases


def bad_plans(workload, world: int):
    """Plans that must be refused before any communication, with a word of the expected message."""
    g_last = world  # a device beyond the world size
    good = sequential_plan(workload, world)
    beyond = sequential_plan(workload, world)
    beyond.waves[0].slices[0].devices = [g_last] + beyond.waves[0].slices[0].devices[1:]
    layers = sequential_plan(workload, world)
    s = next(s for s in layers.slices() if s.kind == "layer")
    s.layer_end += 3
    digest = sequential_plan(workload, world)
    digest.workload_digest = "0" * 16
    del good
    return [(beyond, "beyond the world size"), (layers, "does not exist"), (digest, "was made for workload")]


def _worker(rank, world, cases_world):
    cfg = EngineConfig(optimizer=OPT)
    workloads = {n: load_workload(n) for n in ("tiny-clip", "tiny-vlm")}
    # 1) wrong plans fail on every rank before any communication (no rank hangs in a collective)
    for plan, words in bad_plans(workloads["tiny-clip"], world):
        with pytest.raises(PlanError, match=words):
            RuntimeEngine(plan, workloads["tiny-clip"], rank, world, cfg, operator_factory=standin_factory,
                          batch_fn=standin_batch)
    # 2) every plan reproduces the reference: losses and gradients per step, weights after 3 steps
    refs = {n: standin_trajectory(w) for n, w in workloads.items()}
    properties = {"tp2": False, "concurrent": False, "shared_tower_moves": False}
    for label, wname, make in plan_cases(cases_world):
        w = workloads[wname]
        plan = make(w)
        properties["tp2"] |= any(s.tp == 2 for s in plan.slices())
        properties["concurrent"] |= any(len(wv.slices) > 1 for wv in plan.waves)
        if wname == "tiny-clip":
            properties["shared_tower_moves"] |= len(unit_device_sets(plan, "vision.layers.0")) > 1
        engine = RuntimeEngine(plan, w, rank, world, cfg, operator_factory=standin_factory, batch_fn=standin_batch)
        n = check_engine_against(engine, refs[wname], f"rank {rank} {wname} {label}")
        assert n > 0 or not any(rank in s.devices for s in plan.slices())
    if world > 1:
        assert all(properties.values()), properties


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [1, 2, 4])
def test_engine_matches_reference(world):
    spawn(_worker, world, world)


def test_wrong_plan_fails_before_any_communication():
    """torch.distributed is not even initialised here: the checks must come first."""
    w = load_workload("tiny-clip")
    for plan, words in bad_plans(w, 2):
        with pytest.raises(PlanError, match=words):
            RuntimeEngine(plan, w, 0, 2, operator_factory=standin_factory, batch_fn=standin_batch)


def test_plan_helper_covers_required_properties():
    w = load_workload("tiny-clip")
    p = random_plan(w, 4, 1)
    assert any(len(wv.slices) > 1 for wv in p.waves)
    ref = StandinReference(w)
    assert torch.isfinite(torch.stack(list(ref(0).values()))).all()
