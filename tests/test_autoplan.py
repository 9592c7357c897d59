"""Plan selection's sync-aware candidate and its plan made with memory unlimited (megatron_spindle/autoplan.py)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_spindle.autoplan import SYNC_AWARE_MIN_SHARE, _sync_aware_run, autoplan
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.planner.objective import exposed_sync_share
from megatron_spindle.planner.pipeline import PlannerConfig, plan_workload
from megatron_spindle.simulator import simulate


def test_sync_aware_plan_is_a_candidate_and_wins_on_qwen_val_64():
    w, c = load_workload("qwen-val"), make_cluster(64)
    chosen = autoplan(w, c, PlannerConfig(planner="wavefront"))
    times = {cand.name: cand.sim.iteration_time for cand in chosen.candidates}
    assert "wavefront-sync-aware" in times and "wavefront-sync-aware+pinned" in times
    # the greedy plans expose about 300 ms of the 7B LLM's gradient sync across nodes; the sync-aware curves
    # charge it, and their plan exposes less of it and is the fastest (in the runtime's layout, where TP does not
    # shrink a unit's sync, by 1-2 %; by 5 % while the model charged TP-sharded gradients)
    unaware = min((cand for cand in chosen.candidates if "sync-aware" not in cand.name),
                  key=lambda cand: cand.sim.iteration_time)
    assert chosen.plan.planner["selection"]["selected"].startswith("wavefront-sync-aware")
    assert chosen.sim.iteration_time < unaware.sim.iteration_time
    assert chosen.sim.grad_sync_time < 0.85 * unaware.sim.grad_sync_time
    sim = simulate(chosen.plan, w, c, chosen.result.cost_model, chosen.result.memory_model,
                   metagraph=chosen.result.metagraph)
    assert sim.iteration_time == pytest.approx(chosen.sim.iteration_time, rel=1e-9)


@pytest.mark.parametrize("name, gpus, tried", [("qwen-val", 64, True), ("clip-10", 32, False), ("qwen-val", 8, False)])
def test_sync_aware_run_only_where_the_sync_cannot_hide(name, gpus, tried):
    w, c = load_workload(name), make_cluster(gpus)
    config = PlannerConfig(planner="wavefront", light_follow=True)
    result = plan_workload(w, c, config)
    share = exposed_sync_share(result.plan, result.metagraph, result.cost_model)
    runs = _sync_aware_run(w, c, config, None, [("wavefront", result, 0.0)])
    assert bool(runs) == tried
    if c.num_nodes > 1:
        assert (share >= SYNC_AWARE_MIN_SHARE) == tried
    if tried:  # once per way of counting the sharers of a weight: the three LLM MetaOps are one MetaLevel
        assert [(n, a.sync_aware, a.sync_sharers) for n, a, _, _ in runs] == [
            ("wavefront-sync-aware", "on", "metaop"), ("wavefront-sync-aware-by-level", "on", "level")]
        # planned on curves that charge the sync, each plan exposes a smaller share of it
        for _, _, r, _ in runs:
            assert exposed_sync_share(r.plan, r.metagraph, r.cost_model) < share


def test_sync_aware_flag_forces_or_forbids_the_curves():
    """--spindle-sync-aware on: the planner itself plans on sync-aware curves (here without selection); off: plan
    selection never tries them."""
    w, c = load_workload("qwen-val"), make_cluster(64)
    plain = plan_workload(w, c, PlannerConfig(planner="wavefront", select="none", sync_aware="off"))
    aware = plan_workload(w, c, PlannerConfig(planner="wavefront", select="none", sync_aware="on"))

    # the forced curves charge the sync: a plan exposing less of it
    assert exposed_sync_share(aware.plan, aware.metagraph, aware.cost_model) < \
        exposed_sync_share(plain.plan, plain.metagraph, plain.cost_model)
    off = PlannerConfig(planner="wavefront", light_follow=True, sync_aware="off")
    assert _sync_aware_run(w, c, off, None, [("wavefront", plain, 0.0)]) == []
    with pytest.raises(ValueError, match="sync_aware"):
        PlannerConfig(sync_aware="yes")
    with pytest.raises(ValueError, match="sync_sharers"):
        PlannerConfig(sync_sharers="task")


def test_unlimited_plan_with_memory_options_is_a_candidate_where_memory_binds():
    """clip-4 on 8 GPUs needs the distributed optimizer: the plan made with memory unlimited comes back with ZeRO-3,
    ZeRO-2 and ZeRO-1, each slice at the cheapest recomputation that fits; clip-4 on 32 GPUs needs nothing: no
    candidate."""
    from megatron_spindle.autoplan import UNLIMITED_MEMORY_FACTOR, _unlimited_candidates
    from megatron_spindle.plan.validate import validate_plan

    w, c = load_workload("clip-4"), make_cluster(8)
    config = PlannerConfig(planner="wavefront")
    first = plan_workload(w, c, config)
    assert first.plan.settings.zero_stage >= 1  # memory binds here
    out = _unlimited_candidates(w, c, config, None, first)
    assert [name for name, _, _ in out] == [f"wavefront-unlimited+zero{z}" for z in (3, 2, 1)]
    roomy = c.with_memory_factor(UNLIMITED_MEMORY_FACTOR)
    unlimited = plan_workload(w, roomy, PlannerConfig(planner="wavefront", select="none", distributed_optimizer="off",
                                                      recompute="none", micro_batches="1", early_backward="off")).plan
    for name, result, _ in out:
        plan = result.plan
        validate_plan(plan, w, c, result.metagraph)
        assert plan.settings.zero_stage == int(name[-1]) and plan.settings.micro_batches == 1
        assert max(plan.memory_per_device) <= c.gpu.memory_bytes  # fits the real devices
        assert [[(s.id, s.devices) for s in wv.slices] for wv in plan.waves] == \
            [[(s.id, s.devices) for s in wv.slices] for wv in unlimited.waves]  # the unlimited plan's layout
        assert plan.cluster == c.to_dict()
    # --spindle-distributed-optimizer on is Megatron's ZeRO-1: the fitted plans keep to it
    on = dataclasses.replace(config, distributed_optimizer="on")
    assert [name for name, _, _ in _unlimited_candidates(w, c, on, None, first)] == ["wavefront-unlimited+zero1"]
    light = plan_workload(w, make_cluster(32), config)
    assert _unlimited_candidates(w, make_cluster(32), config, None, light) == []


def test_unlimited_plans_are_fitted_to_the_devices_on_qwen_val_70b(wavefront_plan):
    """QWen-VAL-70B on 256 GPUs: memory binds the capped plan; the plans made with 16x the memory come back
    fitted to the real devices, ZeRO-3 first, with recomputation of some slices where memory still binds. (While
    the model charged TP-sharded gradients the fitted ZeRO-2 plan was 26 % faster than the capped one; in the
    runtime's layout no ZeRO-2 refit fits and the ZeRO-3 ones are 1-12 % slower: plan selection keeps the
    capped plan.)"""
    from megatron_spindle.autoplan import _unlimited_candidates

    w, c, capped = wavefront_plan("qwen-val-70b", 256)  # shared with tests/baselines/test_memory_agreement.py
    out = {name: result for name, result, _ in _unlimited_candidates(w, c, PlannerConfig(planner="wavefront"), None,
                                                                     capped)}
    assert list(out)[0] == "wavefront-unlimited+zero3"
    for result in out.values():
        assert max(result.plan.memory_per_device) <= c.gpu.memory_bytes
    assert any(rc.mode != "none" for rc in out["wavefront-unlimited+zero3"].plan.settings.slice_recompute.values())


def test_task_sequential_candidate_keeps_to_the_zero_stages_allowed():
    """The task-sequential fallback tunes the ZeRO stage like Spindle's own plans: every stage the runtime
    implements under --spindle-distributed-optimizer auto (ZeRO-2 where ZeRO-1 would recompute), only ZeRO-1
    with on, and with off no candidate at all where ZeRO-0 cannot fit."""
    from megatron_spindle.autoplan import _task_sequential
    from megatron_spindle.baselines import BaselineContext, spindle_seq_plan
    from megatron_spindle.plan.memory import plan_memory

    w, c = load_workload("tiny-vlm"), make_cluster(4, 2, "CPU")
    ctx = BaselineContext.build(w, c)
    peak = {z: max(plan_memory(spindle_seq_plan(w, c, ctx, zero_stages=(z,)), ctx.metagraph.metaops,
                               ctx.memory_model)) for z in (1, 2)}
    # three quarters of the way from ZeRO-2's peak to ZeRO-1's: ZeRO-1 fits with micro-batches (at half the way
    # not: the 2-micro-batch plan's TP-2 slices hold their units' whole gradients, as the runtime does)
    tight = dataclasses.replace(c, gpu=dataclasses.replace(c.gpu, memory_bytes=peak[2] + 0.75 * (peak[1] - peak[2])))
    first = plan_workload(w, tight, PlannerConfig(planner="wavefront", select="none"))
    for setting, stages in (("auto", {2}), ("on", {1}), ("off", set())):  # ZeRO-0 fits no way here
        out = _task_sequential(w, tight, PlannerConfig(planner="wavefront", distributed_optimizer=setting), first)
        assert {result.plan.settings.zero_stage for _, result, _ in out} == stages, setting
