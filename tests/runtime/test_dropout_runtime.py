"""Dropout in the runtime (models/dropout.py): the masks are drawn per layer, iteration, micro-batch and
data-parallel shard, so an engine whose slices are not data-parallel trains exactly as the single-process model
with the same seed, whatever its waves, layer cuts, recomputation and micro-batches; evaluation runs without
dropout. The multi-rank cases are test_runtime_engine.py's ``check_dropout``."""

import dataclasses

import pytest
from harness import check_engine_against
from plans import early_backward, recomputing, sequential_plan, single_device_plan, with_settings
from test_runtime_engine import OPT, real_trajectory

from megatron_spindle.graph.workload import load_workload
from megatron_spindle.models.config import ModelConfig
from megatron_spindle.plan.schema import Recompute
from megatron_spindle.runtime.engine import EngineConfig, RuntimeEngine

DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.2}
TURNS = (Recompute("selective"), Recompute("full"), Recompute(), Recompute("full", 1))


def dropout_plan(workload, world: int = 1, micro_batches: int = 2):
    """Every slice on one device, two micro-batches, each layer slice recomputed its own way, early backward."""
    plan = single_device_plan(workload, world, micro_batches)
    plan = early_backward(recomputing(plan, lambda i, s: TURNS[i % len(TURNS)]))
    return with_settings(plan, **DROPOUT)


@pytest.mark.parametrize("wname", ["tiny-vlm", "tiny-clip"])
def test_engine_draws_the_reference_masks(wname):
    w = load_workload(wname)
    ref = real_trajectory(w, 2, config=ModelConfig(**DROPOUT), dropout_seed=7)
    plain = real_trajectory(w, 2)
    assert all(abs(ref.losses[0][t] - plain.losses[0][t]) > 1e-4 for t in plain.losses[0]), "no dropout drawn"
    engine = RuntimeEngine(dropout_plan(w), w, 0, 1, EngineConfig(optimizer=OPT, dropout_seed=7))
    check_engine_against(engine, ref, f"dropout {wname}")
    engine.close()


def test_another_seed_draws_other_masks():
    w = load_workload("tiny-vlm")
    ref = real_trajectory(w, 2, config=ModelConfig(**DROPOUT), dropout_seed=7)
    engine = RuntimeEngine(dropout_plan(w), w, 0, 1, EngineConfig(optimizer=OPT, dropout_seed=8))
    losses = engine.train_step(0)
    assert all(abs(losses[t] - v) > 1e-5 for t, v in ref.losses[0].items())
    engine.close()


def test_evaluation_runs_without_dropout():
    """A plan with dropout evaluates as the same model without it (and trains afterwards with it again)."""
    w = load_workload("tiny-vlm")
    plan = sequential_plan(w, 1)
    cfg = EngineConfig(optimizer=OPT, dropout_seed=3)
    dropping = RuntimeEngine(with_settings(plan, **DROPOUT), w, 0, 1, cfg)
    plain = RuntimeEngine(plan, w, 0, 1, cfg)
    assert dropping.evaluate(5) == plain.evaluate(5)
    assert dropping.train_step(0) != plain.train_step(0)
    ref = real_trajectory(w, config=ModelConfig(**DROPOUT), dropout_seed=3)
    assert all(abs(ref.losses[1][t] - v) <= 1e-5 * max(1.0, abs(v)) for t, v in dropping.train_step(1).items())
    dropping.close()
    plain.close()


def test_plan_records_dropout():
    w = load_workload("tiny-clip")
    plan = dropout_plan(w)
    back = type(plan).from_dict(plan.to_dict())
    assert (back.settings.hidden_dropout, back.settings.attention_dropout) == (0.1, 0.2)
    old = plan.to_dict()
    for k in DROPOUT:  # a plan written before the keys ran without dropout
        del old["settings"][k]
    assert type(plan).from_dict(old).settings.hidden_dropout == 0.0
    from megatron_spindle.plan.schema import PlanError

    for bad in (1.0, -0.1, float("nan"), True, "0.1"):
        with pytest.raises(PlanError, match="hidden-dropout must be a probability in"):
            dataclasses.replace(plan.settings, hidden_dropout=bad)
