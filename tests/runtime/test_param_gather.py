"""The overlapped weight all-gather (``overlap_param_gather``, runtime/param_gather.py) on one rank, in this
process: after a step the operators keep their old weights until they are about to run (a stand-in slice before
its forward, a megatron-core layer before its own forward: later layers still old), every reader of weights or masters sees the new ones (flush), loading
weights is not overwritten by a gather finishing later, evaluation and the trajectory equal the reference, and
stage 0 ignores the setting. (The asynchronous gloo all-gathers of 2 and 4 ranks are checked against the
reference in test_runtime_engine.py's spawned workers.)"""

from __future__ import annotations

import pytest
import torch
from harness import RTOL, check_engine_against, operator_weights, reference_trajectory
from plans import random_plan, with_settings
from standin import StandinReference, standin_batch, standin_factory

from megatron_spindle.graph.workload import load_workload
from megatron_spindle.runtime.distributed import distributed
from megatron_spindle.runtime.engine import EngineConfig, OptimizerConfig, RuntimeEngine
from megatron_spindle.runtime.slices import in_wave_order

OPT = OptimizerConfig(lr=1e-3, eps=1e-6, weight_decay=0.01)


@pytest.fixture(scope="module")
def world():
    torch.set_num_threads(1)
    with distributed("gloo") as ctx:
        yield ctx


def _engine(w, stage: int, overlap: bool, seed: int = 2) -> RuntimeEngine:
    """One bucket per unit (--ddp-bucket-size 1): a bucket's gather loads one unit."""
    plan = with_settings(random_plan(w, 1, seed), zero_stage=stage, overlap_param_gather=overlap, ddp_bucket_size=1)
    return RuntimeEngine(plan, w, 0, 1, EngineConfig(optimizer=OPT),
                         operator_factory=standin_factory, batch_fn=standin_batch)


def same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("stage", [1, 2])
def test_each_slice_waits_for_its_weights_just_before_its_forward(world, stage):
    w = load_workload("tiny-vlm")
    ref = StandinReference(w)
    traj = reference_trajectory(ref, {k.replace("__", "."): p for k, p in ref.full.items()},
                                {t.name: t.loss.weight for t in w.tasks}, OPT)
    engine = _engine(w, stage, overlap=True)
    assert engine.param_gather is not None and len(engine.param_gather.buckets) > 1
    check_engine_against(engine, traj, f"one rank zero{stage} overlapped gather")
    assert not engine.param_gather.pending  # full_state flushed

    old = operator_weights(engine)
    engine.train_step(3)
    pg = engine.param_gather
    assert pg.pending and all(pg.is_stale(ls) for ls in engine.local.values())
    assert same(operator_weights(engine), old)  # deferred: the operators still hold the weights before the step
    new = engine.master_optimizer.full_weights()  # the masters themselves, no flush
    assert not same(new, old)

    seen = []  # (slice, stale slices when its forward starts)
    forward = engine.schedule._forward_slice

    def spy(ls, *args):
        seen.append((ls.slice.id, {s for s in engine.local if pg.is_stale(engine.local[s])}))
        return forward(ls, *args)

    engine.schedule._forward_slice = spy
    engine.forward_backward(4)
    order = [ls.slice.id for ls in in_wave_order(engine.local)]
    assert [sid for sid, _ in seen] == order
    for i, (sid, stale) in enumerate(seen):  # loaded by its own forward at the latest (a bucket may hold units
        assert sid not in stale and stale <= set(order[i + 1:]), (sid, stale)  # of later slices too)
    assert seen[0][1]  # when the first slice runs, later ones still wait for their weights
    assert not pg.pending
    assert same(operator_weights(engine), {k: v for k, v in new.items()})


def test_every_reader_sees_the_new_weights_right_after_a_step(world):
    """evaluate, full_state, export_units and gather_grads right after a step equal those of an engine without
    the overlap; load_full_state right after a step is what the next forward runs on."""
    w = load_workload("tiny-vlm")
    plain, over = _engine(w, 1, overlap=False), _engine(w, 1, overlap=True)
    initial = plain.full_state()
    for step in range(2):
        assert plain.train_step(step) == over.train_step(step)
    assert over.param_gather.pending
    assert over.evaluate(5) == plain.evaluate(5)  # the validation forward waits like a training forward
    assert not over.param_gather.pending

    over.train_step(2), plain.train_step(2)
    assert same(over.full_state(), plain.full_state()) and not over.param_gather.pending
    assert same(operator_weights(over), plain.full_state())

    over.train_step(3), plain.train_step(3)
    ex_o, ex_p = over.export_units(), plain.export_units()
    assert set(ex_o) == set(ex_p)
    for u in ex_o:
        assert same(ex_o[u].model, ex_p[u].model)
    assert same(over.gather_grads(), plain.gather_grads())

    over.train_step(4)
    assert over.param_gather.pending
    over.load_full_state(initial)  # flushes first: no gather lands on top of what is loaded
    assert not over.param_gather.pending and same(operator_weights(over), initial)
    over.forward_backward(5)
    assert same(operator_weights(over), initial)
    fresh = _engine(w, 1, overlap=False)
    fresh.forward_backward(5)
    assert all(torch.allclose(g, fresh.gather_grads()[k], rtol=RTOL, atol=0) for k, g in over.gather_grads().items())

    over.train_step(6)
    over.close()  # waits for the gathers before the groups go
    assert not over.param_gather.pending


def test_stage_0_ignores_the_setting(world):
    w = load_workload("tiny-clip")
    engine = _engine(w, 0, overlap=True)
    assert engine.param_gather is None and engine.direct_units  # the replicated fast path, as without it
    engine.train_step(0)


def test_a_layer_waits_for_its_own_bucket_only(world):
    """megatron-core operators, one bucket per unit (--ddp-bucket-size 1): when a layer's forward starts its
    own weights are the masters' and the slice's later layers still hold the weights before the step; the
    trajectory equals an engine that gathers within the step."""
    from plans import sequential_plan

    w = load_workload("tiny-clip")
    plan = with_settings(sequential_plan(w, 1), zero_stage=1, overlap_param_gather=True, ddp_bucket_size=1)
    engine = RuntimeEngine(plan, w, 0, 1, EngineConfig(optimizer=OPT))
    plain = RuntimeEngine(with_settings(plan, overlap_param_gather=False), w, 0, 1, EngineConfig(optimizer=OPT))
    pg = engine.param_gather
    layered = [ls for ls in in_wave_order(engine.local) if len(ls.op.unit_modules()) > 1]
    assert layered and len(pg.buckets) == len(pg.bucket_of)  # one unit per bucket
    seen = []  # (unit, stale units of its slice when its forward starts)
    for ls in layered:
        for u, module in ls.op.unit_modules().items():
            module.register_forward_pre_hook(
                lambda m, a, u=u, ls=ls: seen.append((u, {v for v in ls.op.unit_modules() if v in pg._stale})))
    for step in range(3):
        assert engine.train_step(step) == plain.train_step(step)
        assert pg.pending or step == 0
    assert same(engine.full_state(), plain.full_state())
    stale_before = [(u, stale) for u, stale in seen[-sum(len(ls.op.unit_modules()) for ls in layered):]]
    for u, stale in stale_before:
        assert u not in stale  # its own bucket was waited for
    assert any(stale for _, stale in stale_before)  # and some later layer of the slice was not yet


def test_the_gather_after_the_step_holds_at_most_two_buckets():
    """Without the overlap (and for ZeRO-3's regathered groups) the weights come bucket by bucket: the next
    bucket's gather is issued before this one is waited for and loaded, never more (runtime/param_gather.py
    ``streamed_gathers``), in the given order and in the weights' dtype."""
    from megatron_spindle.runtime.param_gather import streamed_gathers

    events = []

    class Optimizer:  # records what streamed_gathers asks of the MasterOptimizer
        masters = {}

        def issue_gathers(self, vectors, unit_sets, async_op, dtype):
            assert async_op and dtype == torch.bfloat16
            events.extend(("issue", units[0]) for _, units in unit_sets)
            return [units[0] for _, units in unit_sets]

        def unflatten(self, units, pending):
            events.append(("wait", pending))
            return {pending: pending}

    buckets = [((0, 1), (name,)) for name in "abc"]
    for units, full in streamed_gathers(Optimizer(), buckets, torch.bfloat16):
        assert tuple(full) == units
        events.append(("load", *full))
    assert events == [("issue", "a"), ("issue", "b"), ("wait", "a"), ("load", "a"), ("issue", "c"),
                      ("wait", "b"), ("load", "b"), ("wait", "c"), ("load", "c")]
