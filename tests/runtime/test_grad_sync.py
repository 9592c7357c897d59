"""Bucketed gradient sync (runtime/grad_buffers.py, grad_sync.py) on one rank: bucket layout and order, and
buckets issued during the backward, a unit shared by several slices only after its last accumulation, and
ZeRO-2's release of a bucket's full storage once synchronised.
(The all-reduces themselves, with several buckets per group, run on 2 and 4 ranks in test_runtime_engine.py.)"""

import dataclasses

import pytest
import torch
from harness import LaunchLog, check_engine_against, check_launches, reference_trajectory
from plans import random_plan, sequential_plan
from standin import StandinReference, standin_batch, standin_factory

from megatron_spindle.compat.groups import ensure_torch_distributed
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.plan.buckets import bucket_limit
from megatron_spindle.runtime.engine import EngineConfig, OptimizerConfig, RuntimeEngine
from megatron_spindle.runtime.grad_buffers import Bucket, _split, launch_order
from megatron_spindle.runtime.shards import UnitShard

OPT = OptimizerConfig(lr=1e-3, eps=1e-6, weight_decay=0.01)


@pytest.fixture(scope="module", autouse=True)
def one_rank_world():
    torch.set_num_threads(1)
    ensure_torch_distributed()


def test_default_bucket_size_is_megatrons():
    assert bucket_limit(None, 1) == bucket_limit(None, 40) == 40_000_000
    assert bucket_limit(None, 64) == 64_000_000
    assert bucket_limit(5, 64) == 5  # the plan's --ddp-bucket-size


def test_buckets_are_whole_units_closed_at_the_size():
    shards = {u: UnitShard(u, [f"{u}.w"], [torch.Size([n])], 1, 0) for u, n in (("a", 3), ("b", 4), ("c", 2))}
    order = {"a": (2, 0), "b": (1, 1), "c": (1, 0)}
    got = _split((0, 1), ["a", "b", "c"], shards, order, limit=5)
    assert [(b.units, b.start, b.end, b.done) for b in got] == [(("a", "b"), 0, 7, (1, 1)), (("c",), 7, 9, (1, 0))]
    big = _split((0, 1), ["a", "b", "c"], shards, order, limit=1)
    assert [b.units for b in big] == [("a",), ("b",), ("c",)]


def test_launch_order_follows_the_backward_and_keeps_each_groups_order():
    b = lambda devs, i, done: Bucket(devs, i, (f"u{devs}{i}",), 0, 1, done)  # noqa: E731
    buckets = [b((0, 1), 0, (5, 1)), b((0, 1), 1, (2, 0)), b((1, 2), 0, (5, 0)), b((1, 2), 1, (0, 3))]
    assert launch_order(buckets) == [buckets[0], buckets[2], buckets[1], buckets[3]]


@pytest.mark.parametrize("stage,micro", [(0, 1), (1, 2), (2, 1), (2, 2)])
@pytest.mark.parametrize("wname", ["tiny-clip", "tiny-vlm"])
def test_buckets_are_issued_during_the_backward_after_their_last_accumulation(wname, stage, micro):
    """At zero_stage 1 and 2 also: each bucket's full storage is released as soon as its sync has completed
    (on one rank at once: before the backward goes on), so only the shards are held after the backward; with
    two micro-batches stage 2 issues and releases every bucket in each, stage 1 in the last."""
    w = load_workload(wname)
    ref = StandinReference(w)
    traj = reference_trajectory(lambda step: ref(step, micro_batches=micro),
                                {k.replace("__", "."): p for k, p in ref.full.items()},
                                {t.name: t.loss.weight for t in w.tasks}, OPT)
    plan = random_plan(w, 1, 1, micro_batches=micro)  # shared towers: one unit in two slices of different waves
    plan.settings = dataclasses.replace(plan.settings, zero_stage=stage, ddp_bucket_size=1)
    engine = RuntimeEngine(plan, w, 0, 1, EngineConfig(optimizer=OPT),
                           operator_factory=standin_factory, batch_fn=standin_batch)
    buffers = engine.grad_buffers
    shared = [b for b in buffers.buckets if sum(set(b.units) <= set(ls.units) for ls in engine.local.values()) > 1]
    assert shared and len(buffers.buckets) == len(engine.shards)  # one unit per bucket
    assert any(b.done[0] > 0 for b in buffers.buckets)
    log = LaunchLog(engine)
    settle = buffers.settle
    buffers.settle = lambda b, micro=0: (log.events.append(("settle", b)), settle(b, micro))[1]
    check_engine_against(engine, traj, f"one rank {wname} tiny buckets zero{stage} m{micro}")
    check_launches(log, wname)
    if stage >= 1:
        rounds = micro if stage == 2 else 1  # stage 1 accumulates the micro-batches before its one sync
        for events in log.steps():
            at = {kind: [i for i, e in enumerate(events) if e[0] == kind] for kind in ("launch", "settle")}
            # each once per micro-batch, in launch order
            assert [events[i][1] for i in at["settle"]] == buffers.buckets * rounds
            for i, j in zip(at["launch"], at["settle"]):
                assert i < j and not any(e[0] == "backward" for e in events[i:j]), "released late"
        assert engine.held_grad_bytes() == 4 * sum(sh.size for sh in engine.shards.values())


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_without_overlap_every_bucket_waits_for_the_whole_backward(stage):
    w = load_workload("tiny-clip")
    plan = sequential_plan(w, 1)
    plan.settings = dataclasses.replace(plan.settings, zero_stage=stage, ddp_bucket_size=1, overlap_grad_reduce=False)
    engine = RuntimeEngine(plan, w, 0, 1, EngineConfig(),
                           operator_factory=standin_factory, batch_fn=standin_batch)
    log = LaunchLog(engine)
    engine.train_step(0)
    check_launches(log, "no overlap", overlap=False)
    if stage >= 1:  # released in finish
        assert engine.held_grad_bytes() == 4 * sum(sh.size for sh in engine.shards.values())


def test_generic_gradients_are_exported_one_unit_at_a_time():
    """A slice's gradients that the runtime adds to its buffers (each TP rank its part, runtime/grad_sync.py) come
    one parameter unit at a time, so a rank holds one unit's full-shape gradients at once, not its whole
    operator's: here bf16 megatron-core operators on one rank (bf16 units are not direct), whose contribution is
    the whole gradient (TP 1)."""
    w = load_workload("tiny-clip")
    engine = RuntimeEngine(sequential_plan(w, 1), w, 0, 1, EngineConfig(optimizer=OPT, dtype=torch.bfloat16))
    exported = []  # the units of each export call
    for ls in engine.local.values():
        original = ls.op.export_grad_contributions

        def recording(units=None, op=ls.op, original=original):
            exported.append(None if units is None else set(units))
            grads = original(units)
            assert units is None or all(any(k.startswith(u + ".") for u in units) for k in grads)
            full = op.export_full_grads(units)
            assert set(grads) == set(full) and all(torch.equal(grads[k], full[k]) for k in grads)
            return grads

        ls.op.export_grad_contributions = recording
    engine.train_step(0)
    layered = [ls for ls in engine.local.values() if len(ls.op.units()) > 1]
    assert layered and exported and all(units is not None and len(units) == 1 for units in exported)
    assert len(exported) == sum(len(ls.op.units()) for ls in engine.local.values())


def _held_and_staged(w, plan, rounds):
    """The gradient bytes a one-rank ZeRO-2 engine holds beyond its shards after every step of one training
    step, and what plan/memory.py ``staged_gradients`` counts there with the gradient rounds ``rounds``."""
    from megatron_spindle.estimator import AnalyticCostModel, MemoryModel
    from megatron_spindle.graph.cluster import make_cluster
    from megatron_spindle.graph.opgraph import build_metagraph
    from megatron_spindle.plan.memory import ZeroSharded, staged_gradients
    from megatron_spindle.plan.order import slice_order

    engine = RuntimeEngine(plan, w, 0, 1, EngineConfig(optimizer=OPT))
    held = []
    log = LaunchLog(engine)
    logged = engine.on_wave
    engine.on_wave = lambda phase, wave, seconds: (logged(phase, wave, seconds), held.append(engine.held_grad_bytes()))
    engine.train_step(0)
    shards = 4 * sum(sh.size for sh in engine.shards.values())
    cluster = make_cluster(1, gpu_type_name="CPU")
    numbers = ZeroSharded.of(MemoryModel(w, cluster, AnalyticCostModel(w, cluster)), plan.settings)
    waves = [wv.slices for wv in plan.waves]
    order = slice_order([[s.task for s in wv] for wv in waves], plan.settings)
    assert all(len(wv) == 1 for wv in waves) and len(held) == len(order)  # a step, a slice
    staged = staged_gradients(waves, build_metagraph(w).metaops, numbers, order, {(wi, si) for wi, si, _ in order},
                              rounds=rounds)
    model = [sum(g.bytes for g in staged if g.start <= k < g.end) for k in range(len(order))]
    return [h - shards for h in held], model, order, log


def test_gradients_staged_across_steps_are_what_the_memory_model_counts():
    """ZeRO-2 with an early backward (one gradient round): a tower shared by tasks whose backward runs at
    different points keeps its full gradient in a staging buffer from its first accumulation until the step
    completing it, beside the forwards in between. After every step of the order, the storage the rank holds
    beyond its shards is what plan/memory.py ``staged_gradients`` counts (within 1 % of its peak: a bucket
    completed by a step is released at the next settle)."""
    from plans import early_backward

    w = load_workload("tiny-vlm")
    plan = early_backward(sequential_plan(w, 1))
    plan.settings = dataclasses.replace(plan.settings, zero_stage=2, ddp_bucket_size=1)
    held, model, _, _ = _held_and_staged(w, plan, None)
    assert max(model) > 0 and held[-1] == 0
    for k, (runtime, predicted) in enumerate(zip(held, model)):
        assert abs(runtime - predicted) <= 0.01 * max(model), (k, runtime, predicted)


def test_segments_reduce_scatter_each_round_and_stage_nothing_across_segments():
    """ZeRO-2 on task segments (planner/task_segments.py): a round of reduce-scatters follows each segment's
    backward (plan/buckets.py ``sync_rounds``), so a tower shared by both segments is reduced in both and no
    full gradient outlives its segment. The rank holds only its shards after every step, as the memory model
    with the plan's rounds counts; with one round it would have staged the tower through the second segment's
    forward. Every bucket is issued in each round that accumulates it, in that round's launch order."""
    from plans import planner_task_segments

    from megatron_spindle.graph.opgraph import build_metagraph
    from megatron_spindle.plan.buckets import round_completions, sync_rounds, wave_rounds
    from megatron_spindle.plan.order import FWD

    w = load_workload("tiny-clip")
    plan = planner_task_segments(w, 1)
    plan.settings = dataclasses.replace(plan.settings, zero_stage=2, ddp_bucket_size=1)
    assert len(sync_rounds(len(plan.waves), plan.settings)) == len(plan.settings.segments) == 2
    held, model, order, log = _held_and_staged(w, plan, wave_rounds(len(plan.waves), plan.settings))
    assert held == [0] * len(order) and model == [0.0] * len(order)
    _, one_round, _, _ = _held_and_staged(w, plan, None)
    assert one_round[order.index((plan.settings.segments[1][0], 0, FWD))] == max(one_round) > 0
    rounds = round_completions([wv.slices for wv in plan.waves], build_metagraph(w).metaops, plan.settings)
    shared = [u for u in rounds[0] if u in rounds[1]]
    assert shared  # a tower both segments train
    launched = [(b.devices, b.index, b.units) for e in log.events if e[0] == "launch" for b in [e[1]]]
    expected = [(b.devices, b.index, b.units) for r in log.engine.grad_sync.rounds for b in r]
    assert launched == expected
    assert all(sum(u in units for _, _, units in launched) == 2 for u in shared)
