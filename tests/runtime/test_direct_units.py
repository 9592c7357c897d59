"""The engine's fast path ("direct units", runtime/engine.py): on one rank, units whose parameters the operators
hold unchanged in canonical form alias the fp32 masters and the flat gradient buffers (no export, no push), a
unit whose operator permutes its layout stays on the generic path, and both follow the single-process reference.
(TP=2 slices and zero_stages 1, 2 are checked on 2 and 4 ranks in test_runtime_engine.py.)"""

import dataclasses

import pytest
import torch
from harness import check_engine_against, reference_trajectory
from plans import random_plan, sequential_plan
from standin import StandinOp, StandinReference, standin_batch, standin_factory

from megatron_spindle.compat.groups import ensure_torch_distributed
from megatron_spindle.data.mock import mock_batch
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.models.reference import ReferenceModel
from megatron_spindle.planner.pipeline import PlannerConfig, make_plan
from megatron_spindle.runtime.engine import EngineConfig, OptimizerConfig, RuntimeEngine

OPT = OptimizerConfig(lr=1e-3, eps=1e-6, weight_decay=0.01)


class PermutedStandin(StandinOp):
    """A stand-in that stores every ``fc1`` weight row-reversed (export and load undo it): its layer units
    are not held in canonical layout, so the engine must keep them on the generic path."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        with torch.no_grad():
            for d in self.defs:
                if d.key.endswith(".fc1"):
                    p = self.params[d.key.replace(".", "__")]
                    p.data = p.data.flip(0).contiguous()

    def p(self, key):
        x = super().p(key)
        return x.flip(0) if key.endswith(".fc1") and self.shared is None else x

    def export_full_state(self):
        return {k: v.flip(0) if k.endswith(".fc1") else v for k, v in super().export_full_state().items()}

    def load_full_state(self, state):
        super().load_full_state({k: v.flip(0) if k.endswith(".fc1") else v for k, v in state.items()})


def permuted_factory(workload, info, layer_start, layer_end, pg_collection=None, dp_group=None,
                     attention_backend="auto"):
    return PermutedStandin(workload, info, layer_start, layer_end, pg_collection=pg_collection, dp_group=dp_group)


def aliases(p: torch.Tensor, master: torch.Tensor) -> bool:
    return p.untyped_storage().data_ptr() == master.untyped_storage().data_ptr()


@pytest.fixture(scope="module", autouse=True)
def one_rank_world():
    torch.set_num_threads(1)
    ensure_torch_distributed()  # a one-process gloo world on a HashStore (no MASTER_PORT in the environment)


def test_real_operators_take_the_fast_path_and_match_the_reference():
    w = load_workload("tiny-clip")
    plan = make_plan(w, make_cluster(1, 1, "CPU"), PlannerConfig(planner="wavefront"))
    engine = RuntimeEngine(plan, w, 0, 1, EngineConfig(optimizer=OPT))
    assert engine.direct_units == sorted(engine.shards)  # every unit: TP 1, fp32, canonical layout
    assert not any(engine.generic_keys.values())
    for ls in engine.local.values():
        named = dict(ls.op.full_named_parameters())
        for k in ls.param_keys:
            u = engine.key_unit[k]
            assert aliases(named[k], engine.masters[u]), k
            assert named[k].grad is not None and aliases(named[k].grad, engine.masters[u].grad), k
    ref = ReferenceModel(w)
    run = lambda step: ref({t.name: mock_batch(w, t.name, step, 0) for t in w.tasks})  # noqa: E731
    traj = reference_trajectory(run, ref.full_named_parameters(), {t.name: t.loss.weight for t in w.tasks}, OPT)
    check_engine_against(engine, traj, "real tiny-clip direct")
    engine.optimizer.zero_grad(set_to_none=True)  # detaches the masters from their buffers: the step reattaches
    before = engine.full_state()
    engine.train_step(3)
    assert any(not torch.equal(v, before[k]) for k, v in engine.full_state().items())


@pytest.mark.parametrize("wname", ["tiny-clip", "tiny-vlm"])
def test_permuted_layout_stays_generic_beside_direct_units(wname):
    w = load_workload(wname)
    ref = StandinReference(w)
    params = {k.replace("__", "."): p for k, p in ref.full.items()}
    traj = reference_trajectory(ref, params, {t.name: t.loss.weight for t in w.tasks}, OPT)
    for plan in (sequential_plan(w, 1), random_plan(w, 1, 1)):  # the random plan splits layer chains
        engine = RuntimeEngine(plan, w, 0, 1, EngineConfig(optimizer=OPT), operator_factory=permuted_factory,
                               batch_fn=standin_batch)
        layers = {engine.key_unit[k] for k in engine.key_unit if k.endswith(".fc1")}
        assert layers and set(engine.direct_units) == set(engine.shards) - layers
        check_engine_against(engine, traj, f"permuted {wname}")


@pytest.mark.parametrize("stage", [1, 2])
def test_no_fast_path_for_low_precision_or_the_distributed_optimizer(stage):
    w = load_workload("tiny-clip")
    plan = sequential_plan(w, 1)
    sharded = sequential_plan(w, 1)
    sharded.settings = dataclasses.replace(sharded.settings, zero_stage=stage)
    assert RuntimeEngine(plan, w, 0, 1, operator_factory=standin_factory, batch_fn=standin_batch).direct_units
    assert RuntimeEngine(sharded, w, 0, 1, operator_factory=standin_factory, batch_fn=standin_batch).direct_units == []
    half = RuntimeEngine(plan, w, 0, 1, EngineConfig(dtype=torch.bfloat16), operator_factory=standin_factory,
                         batch_fn=standin_batch)
    assert half.direct_units == []
