"""The planning pipeline: memory-aware allocation, activation recomputation when needed, clear errors."""

import dataclasses

import pytest
from planner_workloads import HEAVY

from megatron_spindle.estimator import AnalyticCostModel, MemoryModel
from megatron_spindle.estimator.cost_model import CostModelConfig
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import workload_from_dict
from megatron_spindle.plan.schema import PlanError, Recompute
from megatron_spindle.plan.validate import validate_plan
from megatron_spindle.planner.memory_search import memory_needs
from megatron_spindle.planner.pipeline import PlannerConfig, make_plan, plan_workload


def cluster_with_memory(num_gpus: int, memory_bytes: float):
    c = make_cluster(num_gpus, num_gpus, "A800-80GB")
    return dataclasses.replace(c, gpu=dataclasses.replace(c.gpu, memory_bytes=memory_bytes))


def least_footprint(workload, cluster, recompute: bool) -> float:
    """The vision layers' smallest per-device footprint over all valid configurations."""
    cost = AnalyticCostModel(workload, cluster, config=CostModelConfig(recompute=recompute))
    needs = memory_needs(build_metagraph(workload), workload, cluster, MemoryModel(workload, cluster, cost))
    return min(needs["vt/vision"].values())


def test_recompute_shrinks_memory_and_costs_a_forward_pass():
    w = workload_from_dict(HEAVY)
    cluster = make_cluster(8)
    mg = build_metagraph(w)
    vision = mg.metaops["vt/vision"]
    plain = AnalyticCostModel(w, cluster)
    recomp = AnalyticCostModel(w, cluster, config=CostModelConfig(recompute=True))
    assert recomp.flops(vision) == pytest.approx(plain.flops(vision) * 4 / 3)
    held = {name: MemoryModel(w, cluster, cost).activation_bytes(vision, 1, 8, vision.num_layers)
            for name, cost in (("plain", plain), ("recompute", recomp))}
    assert held["recompute"] < 0.25 * held["plain"]


def test_auto_recompute_switches_on_only_when_memory_requires_it():
    w = workload_from_dict(HEAVY)
    roomy = make_plan(w, make_cluster(4, 4), PlannerConfig(planner="wavefront"))
    assert roomy.settings.recompute == Recompute("none")
    # Memory between the least footprint with and without recomputation: only a recomputing plan fits.
    base = make_cluster(4, 4)
    with_rc, without_rc = least_footprint(w, base, True), least_footprint(w, base, False)
    assert with_rc < without_rc
    tight = cluster_with_memory(4, (with_rc + without_rc) / 2)
    plan = make_plan(w, tight, PlannerConfig(planner="wavefront", micro_batches="1"))
    assert "full" in plan.settings.recompute_choices()[0]  # some layers recompute (tests/planner/test_memory_options)
    validate_plan(plan, w, tight, build_metagraph(w))
    with pytest.raises(PlanError, match="does not fit device memory"):
        make_plan(w, tight, PlannerConfig(planner="wavefront", recompute="none", micro_batches="1"))


def test_a_metaop_that_fits_nowhere_is_named_with_the_memory_it_needs():
    w = workload_from_dict(HEAVY)
    tiny = cluster_with_memory(4, least_footprint(w, make_cluster(4, 4), True) / 3)
    with pytest.raises(PlanError) as e:
        make_plan(w, tiny, PlannerConfig(planner="wavefront", micro_batches="1"))
    msg = str(e.value)
    assert "MetaOp 'vt/vision'" in msg and "does not fit device memory" in msg and "GiB) per device" in msg


def test_heavy_metaops_get_enough_devices_to_hold_their_activations():
    w = workload_from_dict(HEAVY)
    base = make_cluster(8, 8)
    mg = build_metagraph(w)
    memory = MemoryModel(w, base, AnalyticCostModel(w, base))
    on_one = memory_needs(mg, w, base, memory)["vt/vision"][(1, 1)]
    least = least_footprint(w, base, False)
    mem = max(4 * least, on_one / 2)
    assert mem < on_one  # the vision chain cannot run on a single device
    cluster = cluster_with_memory(8, mem)
    plan = make_plan(w, cluster, PlannerConfig(planner="wavefront", recompute="none"))
    validate_plan(plan, w, cluster, mg)
    assert max(plan.memory_per_device) <= mem
    assert all(s.tp * s.dp > 1 for s in plan.slices() if s.metaop == "vt/vision")


def test_planner_config_rejects_unknown_choices():
    with pytest.raises(ValueError, match="unknown placement 'random'"):
        PlannerConfig(placement="random")
    with pytest.raises(ValueError, match="unknown recompute 'sometimes'"):
        PlannerConfig(recompute="sometimes")


def test_the_overlapped_weight_gather_is_recorded_and_estimated_as_waited_for():
    """--overlap-param-gather (on by default) is recorded in the plan; the planner's estimate charges a group's
    weight gather only beyond the start of the first wave using it, never more than the gather after the step."""
    from megatron_spindle.graph.workload import load_workload
    from megatron_spindle.planner.objective import estimate_iteration

    w, cluster = load_workload("qwen-val"), make_cluster(16)
    on = make_plan(w, cluster, PlannerConfig(planner="wavefront", distributed_optimizer="on", select="none"))
    assert on.settings.overlap_param_gather and on.settings.zero_stage == 1
    assert not make_plan(w, cluster, PlannerConfig(planner="wavefront", distributed_optimizer="on", select="none",
                                                   overlap_param_gather=False)).settings.overlap_param_gather
    # the same waves without it (the memory search may pick another rung where the estimates come close)
    off = dataclasses.replace(on, settings=dataclasses.replace(on.settings, overlap_param_gather=False))
    g = build_metagraph(w)
    cost = AnalyticCostModel(w, cluster)
    after_step = estimate_iteration(off, g, cluster, cost).param_gather
    overlapped = estimate_iteration(on, g, cluster, cost).param_gather
    assert after_step > 0 and 0 <= overlapped < after_step
    assert on.predicted["planner_estimate_param_gather"] == pytest.approx(overlapped)


def test_sequence_parallel_plans_record_it_and_hold_less_where_it_applies():
    """--sequence-parallel on QWen-VAL / 8 GPUs (its LLM at TP 2 with Megatron's distributed optimizer, ZeRO-1; at
    ZeRO-3 it fits at TP 1 since the fifty-eighth session): the plan records it; the simulator's peak memory is the
    plan's (both from plan/'s rule); the same plan without it holds more on the devices of its TP > 1 layer slices, and
    the baselines' plans made with that cost model record it too."""
    from megatron_spindle.baselines import BASELINES, BaselineContext
    from megatron_spindle.graph.workload import load_workload
    from megatron_spindle.plan.memory import plan_memory
    from megatron_spindle.planner.pipeline import plan_workload
    from megatron_spindle.simulator import simulate

    w, c = load_workload("qwen-val"), make_cluster(8)
    result = plan_workload(w, c, PlannerConfig(planner="wavefront", select="none", sequence_parallel=True,
                                               distributed_optimizer="on"))
    plan = result.plan
    assert plan.settings.sequence_parallel and result.cost_model.config.sequence_parallel
    assert any(s.tp > 1 and s.kind == "layer" for s in plan.slices())
    sim = simulate(plan, w, c, result.cost_model, result.memory_model, metagraph=result.metagraph)
    assert sim.peak_memory == plan.memory_per_device
    assert simulate(plan, w, c, metagraph=result.metagraph).peak_memory == plan.memory_per_device  # default models
    without = dataclasses.replace(plan, settings=dataclasses.replace(plan.settings, sequence_parallel=False))
    more = plan_memory(without, result.metagraph.metaops, result.memory_model)
    split = {d for s in plan.slices() if s.tp > 1 and s.kind == "layer" for d in s.devices}
    assert all(more[d] > plan.memory_per_device[d] for d in split) and split
    ctx = BaselineContext(w, c, result.metagraph, result.cost_model, result.memory_model)
    assert BASELINES["megatron"](w, c, ctx).settings.sequence_parallel
    built = BaselineContext.build(w, c, choices=PlannerConfig(sequence_parallel=True))  # compare.py's, fallback's
    assert built.sequence_parallel and BASELINES["deepspeed"](w, c, built).settings.sequence_parallel


def test_attention_backend_is_planned_recorded_and_simulated_as_the_runtime_runs_it():
    """--attention-backend local (megatron-core's local spec: unfused attention, softmax in fp32) on QWen-VAL / 32
    GPUs: the plan records it and the planner's cost model charges it; the simulator's default models follow the
    plan's setting (its time and peak are the planner's models'), and the same plan charged as FlashAttention is
    faster and holds less (no scores kept). The baselines' plans record the backend they were timed with."""
    from megatron_spindle.baselines import BASELINES, BaselineContext
    from megatron_spindle.graph.workload import load_workload
    from megatron_spindle.planner.pipeline import plan_workload
    from megatron_spindle.simulator import simulate

    w, c = load_workload("qwen-val"), make_cluster(32)
    result = plan_workload(w, c, PlannerConfig(planner="wavefront", select="none", attention_backend="local"))
    plan = result.plan
    assert plan.settings.attention_backend == "local"
    assert (result.cost_model.config.attention, result.cost_model.config.fused_softmax) == ("unfused", False)
    planned = simulate(plan, w, c, result.cost_model, result.memory_model, metagraph=result.metagraph)
    default = simulate(plan, w, c, metagraph=result.metagraph)  # models built from the plan's settings
    assert default.iteration_time == pytest.approx(planned.iteration_time, rel=1e-9)
    assert default.peak_memory == plan.memory_per_device
    flash = dataclasses.replace(plan, settings=dataclasses.replace(plan.settings, attention_backend="flash"))
    fast = simulate(flash, w, c, metagraph=result.metagraph)
    assert fast.iteration_time < default.iteration_time
    assert max(fast.peak_memory) < max(default.peak_memory)
    built = BaselineContext.build(w, c, choices=PlannerConfig(attention_backend="unfused"))  # compare, fallback
    assert (built.cost_model.config.attention, built.cost_model.config.fused_softmax) == ("unfused", True)
    assert BASELINES["deepspeed"](w, c, built).settings.attention_backend == "unfused"


def test_gradient_norm_is_planned_recorded_and_simulated_as_the_runtime_runs_it():
    """--clip-grad 0 (no gradient norm in the optimizer step): every candidate autoplan selects among records it,
    the planner's model charges it, and the simulator's default models charge what the plan records, so the
    selected plan's predicted time is theirs; the same plan with the norm costs more (its gradients read once
    more). A plan written before the key loads with the norm, as it was simulated then."""
    from megatron_spindle.autoplan import autoplan
    from megatron_spindle.baselines import BASELINES, BaselineContext
    from megatron_spindle.graph.workload import load_workload
    from megatron_spindle.plan.schema import ExecutionSettings
    from megatron_spindle.planner.report import plan_summary
    from megatron_spindle.simulator import simulate

    w, c = load_workload("clip-4"), make_cluster(16)
    chosen = autoplan(w, c, PlannerConfig(planner="wavefront", grad_norm=False))
    plan = chosen.plan
    assert not plan.settings.grad_norm and not chosen.result.cost_model.config.grad_norm
    default = simulate(plan, w, c)  # models built from the plan's settings
    assert default.iteration_time == pytest.approx(plan.predicted["iteration_time"], rel=1e-9)
    normed = dataclasses.replace(plan, settings=dataclasses.replace(plan.settings, grad_norm=True))
    assert simulate(normed, w, c).optimizer_time > default.optimizer_time
    assert "no gradient norm" in plan_summary(plan) and "no gradient norm" not in plan_summary(normed)
    built = BaselineContext.build(w, c, choices=PlannerConfig(grad_norm=False))
    assert not BASELINES["deepspeed"](w, c, built).settings.grad_norm
    assert not BASELINES["megatron"](w, c, built.recomputing(True)).settings.grad_norm
    old = plan.settings.to_dict()
    del old["grad_norm"]
    assert ExecutionSettings.from_dict(old).grad_norm


def test_gradients_reduced_in_bf16_are_planned_recorded_and_simulated_as_the_runtime_runs_them():
    """--grad-reduce-in-bf16: every candidate autoplan selects among records it and the planner's model charges
    it; the simulator's default models charge what the plan records (the selected plan's predicted time is
    theirs): each parameter device group moves half the bytes of fp32's, every device holding trained weights
    holds less, and the optimizer step also casts the gradients to fp32. The baselines' plans record it too."""
    from megatron_spindle.autoplan import autoplan
    from megatron_spindle.baselines import BASELINES, BaselineContext
    from megatron_spindle.graph.workload import load_workload
    from megatron_spindle.planner.report import plan_summary
    from megatron_spindle.simulator import simulate

    w, c = load_workload("clip-4"), make_cluster(16)
    chosen = autoplan(w, c, PlannerConfig(planner="wavefront", grad_reduce_in_bf16=True))
    plan = chosen.plan
    assert plan.settings.grad_reduce_dtype == "bf16" and chosen.result.cost_model.config.grad_bytes == 2
    half = simulate(plan, w, c)  # models built from the plan's settings
    assert half.iteration_time == pytest.approx(plan.predicted["iteration_time"], rel=1e-9)
    fp32_plan = dataclasses.replace(plan, settings=dataclasses.replace(plan.settings, grad_reduce_dtype="fp32"))
    fp32 = simulate(fp32_plan, w, c)
    assert [2 * g.grad_bytes for g in half.grad_sync] == pytest.approx([g.grad_bytes for g in fp32.grad_sync])
    assert all(h < f for h, f in zip(half.peak_memory, fp32.peak_memory))  # every device trains something here
    steps = [(e - s, e32 - s32) for (s, e), (s32, e32) in zip(half.optimizer_steps, fp32.optimizer_steps)]
    assert all(h > f for h, f in steps if f > 0)  # the cast before each device's AdamW
    assert "gradient all-reduce in bf16" in plan_summary(plan)
    built = BaselineContext.build(w, c, choices=PlannerConfig(grad_reduce_in_bf16=True))
    assert BASELINES["deepspeed"](w, c, built).settings.grad_reduce_dtype == "bf16"
    assert BASELINES["megatron"](w, c, built.recomputing(True)).settings.grad_reduce_dtype == "bf16"


def test_attention_backend_on_a_cpu_is_the_local_spec():
    """A CPU runs megatron-core's local spec: auto plans record local, and a Transformer Engine backend is refused
    with one line that names the flag."""
    from megatron_spindle.graph.workload import load_workload

    w, c = load_workload("tiny-clip"), make_cluster(2, 2, "CPU")
    plan = make_plan(w, c, PlannerConfig(planner="wavefront", select="none"))
    assert plan.settings.attention_backend == "local"
    with pytest.raises(PlanError, match="--attention-backend flash is a Transformer Engine backend"):
        make_plan(w, c, PlannerConfig(planner="wavefront", select="none", attention_backend="flash"))


def test_a_profile_s_attention_backend_is_the_plan_s():
    """A profile records the attention it measured: auto plans on it run that one, and a plan for another backend
    is refused (its measured times would be of kernels the plan does not run)."""
    from megatron_spindle.estimator.profile import Profile
    from megatron_spindle.graph.workload import load_workload

    w, c = load_workload("tiny-clip"), make_cluster(8)
    measured_local = Profile({}, attention_backend="local")  # taken where TE was missing
    plan = make_plan(w, c, PlannerConfig(planner="wavefront", select="none"), profile=measured_local)
    assert plan.settings.attention_backend == "local"
    with pytest.raises(PlanError, match="the profile measured attention backend 'local', the plan is for 'flash'"):
        make_plan(w, c, PlannerConfig(planner="wavefront", select="none", attention_backend="flash"),
                  profile=measured_local)
    assert make_plan(w, c, PlannerConfig(planner="wavefront", select="none"),
                     profile=Profile({})).settings.attention_backend == "auto"  # written before the key


def test_whole_schedule_islands_are_kept_where_the_estimate_is_faster():
    """clip-4 on two nodes: the islands chosen for the whole schedule move fewer bytes across nodes than the greedy
    placement's, and the planner keeps them because its estimate of the plan is faster (planner/islands.py)."""
    from megatron_spindle.graph.workload import load_workload

    w, c = load_workload("clip-4"), make_cluster(16)
    results = {on: plan_workload(w, c, PlannerConfig(planner="wavefront", select="none", whole_schedule_islands=on))
               for on in (False, True)}
    plans = {on: r.plan for on, r in results.items()}
    off, on = plans[False].predicted, plans[True].predicted
    # the plan on the greedy placement's islands comes beside, for plan selection to time (autoplan.with_variants)
    assert results[False].greedy_islands is None
    assert results[True].greedy_islands.plan.waves == plans[False].waves
    assert "islands" not in results[True].greedy_islands.plan.planner
    assert on["inter_island_bytes"] < 0.8 * off["inter_island_bytes"]
    assert on["planner_estimate"] < off["planner_estimate"]
    assert "whole schedule" in plans[True].planner["islands"] and "islands" not in plans[False].planner
    assert [[len(s.devices) for s in wave.slices] for wave in plans[True].waves] == \
        [[len(s.devices) for s in wave.slices] for wave in plans[False].waves]
    one_node = make_cluster(8)
    assert plan_workload(w, one_node, PlannerConfig(planner="wavefront", select="none",
                                                    whole_schedule_islands=True)).plan.waves == \
        plan_workload(w, one_node, PlannerConfig(planner="wavefront", select="none")).plan.waves
