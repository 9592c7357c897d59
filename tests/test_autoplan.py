"""Plan selection's candidates: sync-aware curves, plans made with memory unlimited, gradient bucket sizes
(megatron_spindle/autoplan.py)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_spindle.autoplan import (
    BUCKET_SIZES,
    SYNC_AWARE_MIN_SHARE,
    _sync_aware_run,
    autoplan,
    relaxed_optimum,
    select_fastest,
    with_variants,
)
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
    # the greedy plans run the 7B LLM at tp 1 across nodes and expose about 300 ms of its gradient sync
    unaware = {name: t for name, t in times.items() if "sync-aware" not in name}
    assert chosen.plan.planner["selection"]["selected"].startswith("wavefront-sync-aware")
    assert chosen.sim.iteration_time < min(unaware.values())
    # by 5 % but over the plan made with memory unlimited at ZeRO-3 with node-local weight shards (within 4 %)
    assert chosen.sim.iteration_time < 0.95 * min(t for name, t in unaware.items() if "zero3-hpz" not in name)
    sim = simulate(chosen.plan, w, c, chosen.result.cost_model, chosen.result.memory_model,
                   metagraph=chosen.result.metagraph)
    assert sim.iteration_time == pytest.approx(chosen.sim.iteration_time, rel=1e-9)
    # its curves charge the exposed sync: no LLM slice at tp 1 any more (the plain plan has them)
    plain = next(cand for cand in chosen.candidates if cand.name == "wavefront").plan
    def llm_tp(plan):
        return [s.tp for s in plan.slices() if s.module == "llm" and s.kind == "layer"]
    assert min(llm_tp(plain)) == 1 and min(llm_tp(chosen.plan)) > 1


@pytest.mark.parametrize("name, gpus, counts", [("qwen-val", 64, 2), ("clip-10", 32, 1), ("qwen-val", 8, 0)])
def test_sync_aware_runs_on_several_nodes_each_way_of_counting_where_the_sync_cannot_hide(name, gpus, counts):
    w, c = load_workload(name), make_cluster(gpus)
    config = PlannerConfig(planner="wavefront", light_follow=True)
    result = plan_workload(w, c, config)
    share = exposed_sync_share(result.plan, result.metagraph, result.cost_model)
    runs = _sync_aware_run(w, c, config, None, [("wavefront", result, 0.0)])
    assert len(runs) == counts
    if c.num_nodes > 1:  # on one node never: its sync crosses no network
        assert (share >= SYNC_AWARE_MIN_SHARE) == (counts == 2)
    if counts == 1:  # little exposed sync: the sharers counted by MetaOp alone
        assert [(n, a.sync_aware, a.sync_sharers) for n, a, _, _ in runs] == [("wavefront-sync-aware", "on", "metaop")]
    if counts == 2:  # once per way of counting the sharers of a weight: the three LLM MetaOps are one MetaLevel
        assert [(n, a.sync_aware, a.sync_sharers) for n, a, _, _ in runs] == [
            ("wavefront-sync-aware", "on", "metaop"), ("wavefront-sync-aware-by-level", "on", "level")]
        by_metaop, by_level = (r.plan for _, _, r, _ in runs)

        def llm_tp(plan):
            return sorted(s.tp for s in plan.slices() if s.module == "llm" and s.kind == "layer")
        # charged its whole sync, the LLM takes at least as much tensor parallelism as when charged a third
        assert min(llm_tp(by_level)) >= min(llm_tp(by_metaop)) > 1


def test_sync_aware_flag_forces_or_forbids_the_curves():
    """--spindle-sync-aware on: the planner itself plans on sync-aware curves (here without selection); off: plan
    selection never tries them."""
    w, c = load_workload("qwen-val"), make_cluster(64)
    plain = plan_workload(w, c, PlannerConfig(planner="wavefront", select="none", sync_aware="off"))
    aware = plan_workload(w, c, PlannerConfig(planner="wavefront", select="none", sync_aware="on"))

    def llm_tp(plan):
        return [s.tp for s in plan.slices() if s.module == "llm" and s.kind == "layer"]
    assert min(llm_tp(plain.plan)) == 1 and min(llm_tp(aware.plan)) > 1
    off = PlannerConfig(planner="wavefront", light_follow=True, sync_aware="off")
    assert _sync_aware_run(w, c, off, None, [("wavefront", plain, 0.0)]) == []
    with pytest.raises(ValueError, match="sync_aware"):
        PlannerConfig(sync_aware="yes")
    with pytest.raises(ValueError, match="sync_sharers"):
        PlannerConfig(sync_sharers="task")


def test_unlimited_plan_with_memory_options_is_a_candidate_where_memory_binds():
    """clip-4 on 8 GPUs needs the distributed optimizer: the plan made with memory unlimited, and that plan with
    its light levels pinned, come back with ZeRO-3, ZeRO-2 and ZeRO-1, each slice at the cheapest recomputation
    that fits; tiny-clip on 4 GPUs needs nothing: no candidate."""
    from megatron_spindle.autoplan import UNLIMITED_MEMORY_FACTOR, _unlimited_candidates, memory_bound
    from megatron_spindle.plan.validate import validate_plan
    from megatron_spindle.planner.light_levels import pinned_plan

    w, c = load_workload("clip-4"), make_cluster(8)
    config = PlannerConfig(planner="wavefront")
    first = plan_workload(w, c, config)
    assert first.plan.settings.zero_stage >= 1  # memory binds here
    out = _unlimited_candidates(w, c, config, None, [("wavefront", first, 0.0)])
    assert [name for name, _, _ in out] == [f"wavefront-unlimited{pin}+zero{z}" for pin in ("", "+pinned")
                                            for z in (3, 2, 1)]
    roomy = c.with_memory_factor(UNLIMITED_MEMORY_FACTOR)
    made = plan_workload(w, roomy, PlannerConfig(planner="wavefront", select="none", distributed_optimizer="off",
                                                 recompute="none", micro_batches="1", early_backward="off"))
    pinned = pinned_plan(made.plan, made.metagraph, made.curves, w, roomy, made.cost_model, made.memory_model,
                         made.level_allocs)
    for name, result, _ in out:
        plan = result.plan
        validate_plan(plan, w, c, result.metagraph)
        assert plan.settings.zero_stage == int(name[-1]) and plan.settings.micro_batches == 1
        assert max(plan.memory_per_device) <= c.gpu.memory_bytes  # fits the real devices
        unlimited = pinned if "+pinned" in name else made.plan
        assert [[(s.id, s.devices) for s in wv.slices] for wv in plan.waves] == \
            [[(s.id, s.devices) for s in wv.slices] for wv in unlimited.waves]  # the unlimited plan's layout
        assert plan.cluster == c.to_dict()
    # --spindle-distributed-optimizer on is Megatron's ZeRO-1: the fitted plans keep to it
    on = dataclasses.replace(config, distributed_optimizer="on")
    assert [name for name, _, _ in _unlimited_candidates(w, c, on, None, [("wavefront", first, 0.0)])] == \
        ["wavefront-unlimited+zero1", "wavefront-unlimited+pinned+zero1"]
    tiny = load_workload("tiny-clip")
    light = plan_workload(tiny, make_cluster(4), config)
    assert not memory_bound(light.plan)
    assert _unlimited_candidates(tiny, make_cluster(4), config, None, [("wavefront", light, 0.0)]) == []


def test_node_groups_planned_with_memory_unlimited_are_candidates_where_memory_narrowed_the_plan():
    """clip-4 on 16 GPUs plans without any memory option, yet memory narrowed its allocation (a slice on the
    fewest devices its limited curve allows): the plans made with memory unlimited are candidates, the node
    groups among them (each group's search is limited by its nodes' memory), planned on devices with room and
    laid out as there. On two nodes the fitted plans include ZeRO-3 with node-local weight shards (hpZ)."""
    from megatron_spindle.autoplan import UNLIMITED_MEMORY_FACTOR, _unlimited_candidates, memory_bound
    from megatron_spindle.planner.node_groups import node_group_partitions, plan_node_groups

    w, c = load_workload("clip-4"), make_cluster(16)
    config = PlannerConfig(planner="wavefront")
    first = plan_workload(w, c, config)
    st = first.plan.settings
    assert (st.zero_stage, st.micro_batches, st.slice_recompute) == (0, 1, {}) and memory_bound(first.plan)
    out = {name: result for name, result, _ in _unlimited_candidates(w, c, config, None, [("wavefront", first, 0.0)])}
    assert {"node-groups-2-unlimited+zero1", "node-groups-2-unlimited+pinned+zero1"} <= set(out)
    names = [name for name in out if name.startswith("wavefront-unlimited+zero")]
    assert names == [f"wavefront-unlimited+zero{z}" for z in ("3", "3-hpz", "2", "1")], names
    hpz, zero3 = out["wavefront-unlimited+zero3-hpz"].plan, out["wavefront-unlimited+zero3"].plan
    assert hpz.settings.node_local_weights and hpz.settings.zero_stage == 3 and hpz.weight_scope == 8
    assert max(zero3.memory_per_device) < max(hpz.memory_per_device) <= c.gpu.memory_bytes
    roomy = c.with_memory_factor(UNLIMITED_MEMORY_FACTOR)
    plain = dataclasses.replace(config, light_follow=True, settle_tails=True, distributed_optimizer="off",
                                recompute="none", micro_batches="1", early_backward="off")
    made = plan_node_groups(w, roomy, node_group_partitions(w, roomy)[0], plain)
    fitted = out["node-groups-2-unlimited+zero1"].plan
    assert [[(s.id, s.devices) for s in wv.slices] for wv in fitted.waves] == \
        [[(s.id, s.devices) for s in wv.slices] for wv in made.plan.waves]
    assert max(fitted.memory_per_device) <= c.gpu.memory_bytes and fitted.cluster == c.to_dict()


def test_unlimited_plan_with_memory_options_wins_on_qwen_val_70b(wavefront_plan, monkeypatch):
    """QWen-VAL-70B on 256 GPUs: the capped search limits the LLM's configurations to what its whole chain fits;
    the plan made with memory unlimited fits with ZeRO-3 and recomputation of some slices, and simulates faster.
    At ZeRO-2 and 1 it fits in no way: a rank stages the full gradient of an LLM layer it holds from its first
    backward to the last of the three tasks' (plan/memory.py staged_gradients), and ZeRO-1 keeps them whole.
    (Without the node groups and the sync-aware runs, tested above: on 32 nodes they cost this test about 45 s.)"""
    from megatron_spindle import autoplan as selection
    from megatron_spindle.autoplan import _unlimited_candidates

    monkeypatch.setattr(selection, "_node_group_candidates", lambda *args: [])
    monkeypatch.setattr(selection, "_sync_aware_run", lambda *args: [])

    w, c, capped = wavefront_plan("qwen-val-70b", 256)  # shared with tests/baselines/test_memory_agreement.py
    config = PlannerConfig(planner="wavefront")
    capped_time = simulate(capped.plan, w, c, capped.cost_model, capped.memory_model,
                           metagraph=capped.metagraph).iteration_time
    out = {name: result for name, result, _ in _unlimited_candidates(w, c, config, None, [("wavefront", capped, 0.0)])}
    assert list(out) == ["wavefront-unlimited+zero3", "wavefront-unlimited+pinned+zero3"]
    assert all(r.plan.recomputes() for r in out.values())  # memory still binds: some slices recompute
    time = min(simulate(r.plan, w, c, r.cost_model, r.memory_model, metagraph=r.metagraph).iteration_time
               for r in out.values())
    assert time < capped_time, (time, capped_time)


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
    tight = dataclasses.replace(c, gpu=dataclasses.replace(c.gpu, memory_bytes=(peak[1] + peak[2]) / 2))
    first = plan_workload(w, tight, PlannerConfig(planner="wavefront", select="none"))
    for setting, stages in (("auto", {2}), ("on", {1}), ("off", set())):  # ZeRO-0 fits no way here
        out = _task_sequential(w, tight, PlannerConfig(planner="wavefront", distributed_optimizer=setting), first)
        assert {result.plan.settings.zero_stage for _, result, _ in out} == stages, setting


def test_selection_tries_smaller_gradient_buckets_unless_the_user_gave_a_size():
    """Left to the planner, the gradient bucket size is chosen by simulation: on clip-10 / 32 the wavefront plans
    are timed with megatron-core's default and with BUCKET_SIZES (the plan records the winner, its estimate the
    same buckets); tiny-clip's groups are one bucket at any size, so nothing more is timed. A user's
    --ddp-bucket-size and --no-overlap-grad-reduce are recorded and charged, and nothing else is tried."""
    from megatron_spindle.planner.objective import estimate_iteration

    w, c = load_workload("clip-10"), make_cluster(32)
    config = PlannerConfig(planner="wavefront", planning_workers=1)
    result = plan_workload(w, c, config)
    chosen = select_fastest(w, c, [("wavefront", result, 0.0)], config)
    times = {cand.name: cand.sim.iteration_time for cand in chosen.candidates}
    sized = [f"wavefront{z}+buckets{s // 10**6}M" for z in ("", "+zero1") for s in BUCKET_SIZES]
    assert set(times) == {"wavefront", "wavefront+zero1", *sized}
    best = chosen.plan.planner["selection"]["selected"]
    assert times[best] == min(times.values()) and times[best] < min(times["wavefront"], times["wavefront+zero1"])
    assert chosen.plan.settings.ddp_bucket_size == int(best.rsplit("buckets", 1)[1][:-1]) * 10**6
    again = estimate_iteration(chosen.plan, result.metagraph, c, result.cost_model).total
    assert chosen.plan.predicted["planner_estimate"] == pytest.approx(again)
    given = dataclasses.replace(config, ddp_bucket_size=5_000_000, overlap_grad_reduce=False)
    fixed = select_fastest(w, c, [("wavefront", plan_workload(w, c, given), 0.0)], given)
    assert {cand.name for cand in fixed.candidates} == {"wavefront", "wavefront+zero1"}
    assert (fixed.plan.settings.ddp_bucket_size, fixed.plan.settings.overlap_grad_reduce) == (5_000_000, False)
    assert fixed.sim.iteration_time > chosen.sim.iteration_time  # every bucket after the backward
    tiny, c8 = load_workload("tiny-clip"), make_cluster(8)
    small = select_fastest(tiny, c8, [("wavefront", plan_workload(tiny, c8, config), 0.0)], config)
    assert not any("buckets" in cand.name for cand in small.candidates)


@pytest.mark.parametrize("name, gpus", [("ofasys-7", 8), ("clip-7", 16)])
def test_relaxed_optimum_bounds_the_waves_of_every_planner(name, gpus):
    """C* with memory unlimited (what paper_eval and tools/compare.py hold the paper's speedups against): no
    planner's waves finish sooner, and where memory keeps device counts from a MetaOp (OFASys-7 on 8 GPUs) the
    capped planners' own C* is higher."""
    w, c = load_workload(name), make_cluster(gpus)
    bound = relaxed_optimum(w, c)
    for planner in ("wavefront", "cpsat"):
        plan = plan_workload(w, c, PlannerConfig(planner=planner, select="none", solver_time_limit=1.0)).plan
        assert bound <= plan.predicted["c_star"] * (1 + 1e-9) and bound < plan.predicted["iteration_time"], planner
        if name == "ofasys-7":
            assert plan.predicted["c_star"] > 1.03 * bound, planner


def test_the_variants_a_planner_made_beside_its_plan_are_candidates_by_name():
    """``with_variants``: a plan, its settled tails, and of each the plan on its greedy placement's islands where
    whole-schedule islands replaced them; the variants keep their run's planning seconds."""
    from types import SimpleNamespace

    def result(settled=None, greedy_islands=None):
        return SimpleNamespace(settled=settled, greedy_islands=greedy_islands)

    plain, tails_greedy = result(), result()
    tails = result(greedy_islands=tails_greedy)
    whole = result(settled=tails, greedy_islands=plain)
    wavefront = result()
    out = with_variants([("cpsat", whole, 3.0), ("wavefront", wavefront, 1.0)])
    assert [(name, r, secs) for name, r, secs in out] == [
        ("cpsat", whole, 3.0), ("cpsat+greedy-islands", plain, 3.0), ("cpsat+tails", tails, 3.0),
        ("cpsat+tails+greedy-islands", tails_greedy, 3.0), ("wavefront", wavefront, 1.0)]
