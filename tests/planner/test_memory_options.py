"""The planner's memory options: recomputation per slice (none, selective, full recomputation of k layers),
micro-batches and the early backward, chosen only when memory needs them; Megatron-style overrides respected;
a plan that cannot fit at all names the MetaOp, the device and the bytes."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from planner_workloads import HEAVY, HEAVY_LM

from megatron_spindle.arguments import add_spindle_args, build_parser, planner_config_from_args
from megatron_spindle.baselines.memory_options import with_cheapest_recompute
from megatron_spindle.estimator import AnalyticCostModel, CostModelConfig, MemoryModel
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import workload_from_dict
from megatron_spindle.plan.memory import (
    ZeroSharded,
    activation_memory,
    device_step_cast_bytes,
    memory_breakdown,
    memory_options,
    plan_memory,
)
from megatron_spindle.plan.order import early_backward_order, slice_order
from megatron_spindle.plan.schema import ExecutionSettings, PlanError, Recompute
from megatron_spindle.plan.validate import validate_plan
from megatron_spindle.planner.assemble import assemble_plan
from megatron_spindle.planner.memory_options import (
    RecomputeError,
    RecomputePolicy,
    choose_recompute,
    slice_options,
)
from megatron_spindle.planner.memory_search import memory_needs, micro_batch_candidates
from megatron_spindle.planner.pipeline import PlannerConfig, plan_workload
from megatron_spindle.planner.report import plan_summary
from megatron_spindle.planner.schedule import ScheduledSlice, ScheduledWave
from megatron_spindle.simulator import simulate

GiB = 2**30


def with_memory(num_gpus: int, memory_bytes: float):
    c = make_cluster(num_gpus, num_gpus, "A800-80GB")
    return dataclasses.replace(c, gpu=dataclasses.replace(c.gpu, memory_bytes=memory_bytes))


def planned(w, cluster, **config):
    res = plan_workload(w, cluster, PlannerConfig(planner="wavefront", **config))
    validate_plan(res.plan, w, cluster, res.metagraph)
    sim = simulate(res.plan, w, cluster, res.cost_model, res.memory_model, metagraph=res.metagraph)
    assert max(sim.peak_memory) <= cluster.gpu.memory_bytes
    return res.plan, sim


def test_with_memory_to_spare_nothing_is_recomputed_and_one_micro_batch_runs():
    w = workload_from_dict(HEAVY)
    plan, _ = planned(w, make_cluster(4, 4))
    # no recomputation, ZeRO 0, m = 1, the plain order (and the user's --overlap-param-gather, on by default)
    assert plan.settings == ExecutionSettings(overlap_param_gather=True)


def test_a_plan_forced_into_full_recomputation_fits_with_cheaper_options_and_runs_faster():
    """Memory between the full-recomputation and the plain footprint of the vision chain: the old ladder's
    only answer was full recomputation of every layer; now some layers (or micro-batches) do."""
    w = workload_from_dict(HEAVY)
    tight = with_memory(4, 1.9 * GiB)
    full, full_sim = planned(w, tight, recompute="full", micro_batches="1")
    assert full.settings.recompute == Recompute("full")
    auto, auto_sim = planned(w, tight)
    choices = auto.settings.recompute_choices()
    assert auto.settings.recompute != Recompute("full") and choices != ["full"], choices
    assert auto_sim.iteration_time < full_sim.iteration_time
    assert auto.predicted["iteration_time"] < full.predicted["iteration_time"]
    with pytest.raises(PlanError, match="does not fit device memory"):
        planned(w, tight, recompute="none", micro_batches="1", distributed_optimizer="on")


def test_shared_recomputation_ladders_choose_what_each_candidate_would_alone(monkeypatch):
    """The memory search's candidates (micro-batch counts, ZeRO stages, rungs) share their slices' ladders
    (choose_recompute's ladder_cache): the plan is the one made with a fresh ladder per call."""
    from megatron_spindle.planner import memory_search

    w, tight = workload_from_dict(HEAVY), with_memory(4, 1.4 * GiB)  # candidates of several ZeRO stages

    def plan_dict():
        d = plan_workload(w, tight, PlannerConfig(planner="wavefront")).plan.to_dict()
        del d["planner"]["planning_seconds"]
        return d

    calls = []

    def counting(*args, **kwargs):
        calls.append((kwargs.get("ladder_cache", args[10] if len(args) > 10 else None), args[2].zero_stage))
        return choose_recompute(*args, **kwargs)

    monkeypatch.setattr(memory_search, "choose_recompute", counting)
    shared = plan_dict()
    caches = [cache for cache, _ in calls]
    assert all(c is caches[0] for c in caches) and caches[0], "one cache for the whole search"
    assert len({stage for _, stage in calls}) > 1
    monkeypatch.setattr(memory_search, "choose_recompute", lambda *a, **k: choose_recompute(*a[:10], **k))
    assert plan_dict() == shared
    assert shared["settings"]["slice_recompute"] or shared["settings"]["recompute"]["mode"] != "none"


def test_where_zero_1_needs_recomputation_the_gradients_are_sharded_too_and_nothing_is_recomputed():
    """HEAVY at twice its batch (at 64 its vision layers sit near the host's launch floor, where a rerun costs
    little GPU time) in 3 GiB on 4 devices: with the optimizer state sharded (ZeRO-1, Megatron's distributed
    optimizer) some layers must recompute; sharding the gradients as well (ZeRO-2) fits without, and that plan is
    faster."""
    spec = copy.deepcopy(HEAVY)
    spec["tasks"][0]["batch_size"] = 128
    w = workload_from_dict(spec)
    tight = with_memory(4, 3.0 * GiB)
    zero1, zero1_sim = planned(w, tight, distributed_optimizer="on")
    auto, auto_sim = planned(w, tight)
    assert zero1.settings.zero_stage == 1 and "none" in zero1.settings.recompute_choices()
    assert any(rc != "none" for rc in zero1.settings.recompute_choices())
    assert auto.settings.zero_stage == 2 and auto.settings.recompute_choices() == ["none"]
    assert auto.settings.micro_batches == 1
    assert auto_sim.iteration_time < zero1_sim.iteration_time
    assert "zero2" in memory_options(auto)


def test_micro_batches_are_chosen_by_predicted_time_and_recorded():
    w = workload_from_dict(HEAVY_LM)
    tight = with_memory(4, 1.9 * GiB)
    auto, _ = planned(w, tight)
    for m in (1, 2, 4):
        forced, _ = planned(w, tight, micro_batches=str(m))
        assert forced.settings.micro_batches == m
        assert all((64 // m) % s.dp == 0 for s in forced.slices())  # DP splits of a micro-batch
        assert auto.predicted["iteration_time"] <= forced.predicted["iteration_time"] * (1 + 1e-9)
        # C~* is the iteration's, like the waves: m times the levels' C~* of one micro-batch
        assert forced.predicted["c_star"] == pytest.approx(sum(lv.c_star for lv in forced.levels))
        assert forced.predicted["iteration_time"] >= forced.predicted["c_star"] * (1 - 1e-9)
        if m == 1:
            c_star_one = forced.predicted["c_star"]
        else:  # a micro-batch's relaxed optimum is at least 1/m of the whole batch's (less efficient kernels)
            assert forced.predicted["c_star"] >= c_star_one * (1 - 1e-9)
    assert micro_batch_candidates(PlannerConfig(), build_metagraph(w)) == [1, 2, 4, 8, 16, 32, 64]
    with pytest.raises(PlanError, match="--spindle-micro-batches 3 does not divide every task's batch"):
        plan_workload(w, tight, PlannerConfig(planner="wavefront", micro_batches="3"))


def test_auto_never_splits_the_batch_of_a_contrastive_loss():
    """A contrastive loss takes its negatives from its micro-batch, so micro-batches change what is trained: auto
    keeps one (and says how to ask for more where nothing fits), a given N is used and the plan says so."""
    w = workload_from_dict(HEAVY)
    g = build_metagraph(w)
    assert micro_batch_candidates(PlannerConfig(), g) == [1]
    assert micro_batch_candidates(PlannerConfig(micro_batches="4"), g) == [4]
    assert micro_batch_candidates(PlannerConfig(), build_metagraph(workload_from_dict(HEAVY_LM)))[:3] == [1, 2, 4]
    tight = with_memory(4, 1.2 * GiB)
    auto, _ = planned(w, tight)
    assert auto.settings.micro_batches == 1 and "note: " not in plan_summary(auto)
    said = []
    plan_workload(w, tight, PlannerConfig(planner="wavefront"), progress=said.append)
    assert auto.recomputes() and any(m.startswith("recomputing for memory where micro-batches might cost less: "
                                                  "--spindle-micro-batches auto keeps the batches of contrastive "
                                                  "tasks vt whole") for m in said), said
    given, _ = planned(w, tight, micro_batches="2")
    assert given.settings.micro_batches == 2
    assert ("note: 2 micro-batches split the batches of contrastive losses (tasks vt): each loss takes its negatives "
            "from its micro-batch, 1/2 of the task's batch") in plan_summary(given)
    with pytest.raises(PlanError) as e:
        plan_workload(w, with_memory(4, 0.2 * GiB), PlannerConfig(planner="wavefront"))
    assert "even with 1 micro-batch(es)" in str(e.value)
    assert str(e.value).endswith("--spindle-micro-batches auto splits no batch of a contrastive loss (tasks vt: "
                                 "micro-batches would shrink its negatives): give --spindle-micro-batches N to "
                                 "split them")


def test_a_plan_that_cannot_fit_even_with_every_option_names_the_metaop_the_device_and_the_bytes():
    w = workload_from_dict(HEAVY_LM)
    with pytest.raises(PlanError) as e:
        plan_workload(w, with_memory(4, 0.2 * GiB), PlannerConfig(planner="wavefront"))
    msg = str(e.value)
    assert "even with 64 micro-batch(es)" in msg and "full recomputation" in msg, msg
    assert "MetaOp '" in msg and "A800-80GB device has" in msg and " bytes" in msg, msg


def test_megatron_style_recompute_flags_are_used_as_given():
    parser = build_parser("plan", [add_spindle_args])
    w = workload_from_dict(HEAVY)
    for argv, want in ((["--recompute-granularity", "selective"], Recompute("selective")),
                       (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers",
                         "2"], Recompute("full", 2)),
                       (["--recompute-granularity", "full"], Recompute("full", 1, "uniform"))):
        config = dataclasses.replace(planner_config_from_args(parser.parse_args(argv)), planner="wavefront")
        plan = plan_workload(w, make_cluster(4, 4), config).plan
        assert plan.settings.recompute == want and not plan.settings.slice_recompute
    with pytest.raises(ValueError, match="need --recompute-granularity full"):
        PlannerConfig(recompute_method="block")
    with pytest.raises(ValueError, match="needs --recompute-granularity selective"):
        PlannerConfig(recompute_modules=("layernorm",))
    with pytest.raises(ValueError, match="unknown recompute_modules 'moe'"):
        PlannerConfig(recompute_granularity="selective", recompute_modules=("layernorm", "moe"))
    with pytest.raises(ValueError, match="auto or a positive integer"):
        PlannerConfig(micro_batches="many")


# ------------------------------------------------------------------------------------------ per slice


def test_each_slice_gets_the_cheapest_option_that_fits():
    """One device running the 8-layer vision chain: capacity between options picks exactly that option."""
    w = workload_from_dict(HEAVY)
    cluster = make_cluster(1, 1)
    g = build_metagraph(w)
    vision = g.metaops["vt/vision"]
    cost = AnalyticCostModel(w, cluster)
    numbers = ZeroSharded(MemoryModel(w, cluster, cost), 0)
    s = ScheduledSlice("vt/vision", 1, 1, 1, 0, 8, 1.0, devices=[0])
    ladder = slice_options(vision, s, numbers, cost, RecomputePolicy())
    assert [o.recompute for o in ladder][0] == Recompute() and ladder[-1].recompute == Recompute("full")
    assert all(a.seconds < b.seconds for a, b in zip(ladder, ladder[1:]))
    # each rung holds less, or needs less at its most, than every cheaper one
    assert all(b.held < min(a.held for a in ladder[:i]) or
               b.held + b.transient < min(a.held + a.transient for a in ladder[:i])
               for i, b in enumerate(ladder) if i)
    assert Recompute("full", 3) in [o.recompute for o in ladder]
    assert Recompute("full", 3, modules=("layernorm",)) in [o.recompute for o in ladder]
    waves, order = [[s]], slice_order([["vt"]], ExecutionSettings())
    params = memory_breakdown(waves, g.metaops, numbers, 1, order)[0][0]
    for option in ladder:  # alone on its device, a slice needs held + transient at its backward
        capacity = params + option.held + option.transient
        want = min((o for o in ladder if o.held + o.transient <= option.held + option.transient),
                   key=lambda o: o.seconds)
        got = choose_recompute(waves, g.metaops, numbers, cost, capacity, order, RecomputePolicy(), 1)
        assert got == {(0, 0): want.recompute}
    with pytest.raises(RecomputeError, match=r"device 0 \(device, .* GiB\) does not fit .*'vt/vision'"):
        choose_recompute(waves, g.metaops, numbers, cost, params + ladder[-1].held / 2, order, RecomputePolicy(), 1)


def test_the_step_s_fp32_gradient_copies_bound_what_recomputation_can_fit():
    """With bf16 main gradients the optimizer step's fp32 copies (4 bytes per parameter at ZeRO 0) come after the
    backward: a capacity under parameter state + copies cannot be met by recomputation (one line that says so,
    before any option is tried); above it, the activations' options are chosen as before."""
    w = workload_from_dict(HEAVY)
    cluster = make_cluster(1, 1)
    g = build_metagraph(w)
    cost = AnalyticCostModel(w, cluster, config=CostModelConfig(grad_bytes=2))
    numbers = ZeroSharded(MemoryModel(w, cluster, cost), 0)
    s = ScheduledSlice("vt/vision", 1, 1, 1, 0, 8, 1.0, devices=[0])
    waves, order = [[s]], slice_order([["vt"]], ExecutionSettings())
    params = memory_breakdown(waves, g.metaops, numbers, 1, order)[0][0]
    cast = device_step_cast_bytes(waves, g.metaops, numbers, [(0, 0)])
    ladder = slice_options(g.metaops["vt/vision"], s, numbers, cost, RecomputePolicy())
    assert cast == pytest.approx(params / 16 * 4)
    with pytest.raises(RecomputeError, match=r"does not fit the optimizer step: .* fp32 copies of its bf16 gradients"):
        choose_recompute(waves, g.metaops, numbers, cost, params + cast * 0.99, order, RecomputePolicy(), 1)
    leanest = params + max(cast, ladder[-1].held + ladder[-1].transient)
    got = choose_recompute(waves, g.metaops, numbers, cost, leanest, order, RecomputePolicy(), 1)[(0, 0)]
    chosen = next(o for o in ladder if o.recompute == got)
    assert got != Recompute() and params + chosen.held + chosen.transient <= leanest


MIXED = {
    "name": "mixed-depth",
    "modules": {
        "vision": {"kind": "encoder", "num_layers": 2, "hidden_size": 64, "num_heads": 4, "ffn_hidden_size": 256,
                   "embed_dim": 32, "frontend": {"type": "patch", "image_size": 16, "patch_size": 4,
                                                 "in_channels": 3}},
        "text": {"kind": "encoder", "num_layers": 2, "hidden_size": 32, "num_heads": 2, "ffn_hidden_size": 128,
                 "embed_dim": 32, "frontend": {"type": "text", "vocab_size": 128}},
        "proj": {"kind": "projector", "input_size": 64, "hidden_size": 64},
        "llm": {"kind": "llm", "num_layers": 4, "hidden_size": 64, "num_heads": 4, "num_query_groups": 2,
                "ffn_hidden_size": 176, "frontend": {"type": "text", "vocab_size": 256}},
    },
    "tasks": [
        {"name": "clip", "batch_size": 8, "tokens": {"vision": 17, "text": 12},
         "loss": {"kind": "contrastive", "modules": ["vision", "text"]}},
        {"name": "caption", "batch_size": 4, "tokens": {"vision": 17, "proj": 17, "llm": 25},
         "flows": [["vision", "proj"], ["proj", "llm"]], "loss": {"kind": "lm", "module": "llm"}},
    ],
}


def test_early_backward_frees_a_shallow_task_s_activations_and_is_used_where_the_plan_fits_no_other_way():
    w = workload_from_dict(MIXED)
    cluster = make_cluster(1, 1, "CPU")
    res = plan_workload(w, cluster, PlannerConfig(planner="wavefront"))
    plan = res.plan
    assert plan.settings.order is None  # memory to spare: the plain order
    tasks = [[s.task for s in wv.slices] for wv in plan.waves]
    early = dataclasses.replace(plan, settings=dataclasses.replace(plan.settings, order=early_backward_order(tasks)))
    validate_plan(early, w, cluster, res.metagraph)
    plain_peak = plan_memory(plan, res.metagraph.metaops, res.memory_model)[0]
    early_peak = plan_memory(early, res.metagraph.metaops, res.memory_model)[0]
    assert early_peak < plain_peak
    tight = dataclasses.replace(cluster, gpu=dataclasses.replace(cluster.gpu, memory_bytes=(early_peak + plain_peak) / 2))
    fixed = dict(planner="wavefront", micro_batches="1", placement="sequential")
    on = plan_workload(w, tight, PlannerConfig(**fixed, early_backward="on")).plan
    assert on.settings.order is not None and on.settings.recompute_choices() == ["none"]
    auto = plan_workload(w, tight, PlannerConfig(**fixed)).plan  # recomputing fits the plain order too
    assert auto.settings.order is None and auto.settings.recompute_choices() != ["none"]
    with pytest.raises(PlanError, match="does not fit device memory"):
        plan_workload(w, tight, PlannerConfig(**fixed, recompute="none", early_backward="off"))


def test_a_plan_without_recomputation_placed_without_the_cap_s_limits_is_picked_when_it_fits_and_is_faster():
    """3 GiB on 4 devices: the plain placement fits without recomputation, but the share limits under the cap
    leave out the faster configurations; placed on overcommitted devices the real activations fit all the
    same, so the planner (which compares every rung by its estimate) takes that plan."""
    w = workload_from_dict(HEAVY)
    tight = with_memory(4, 3.0 * GiB)
    plain, _ = planned(w, tight, recompute="none", micro_batches="1", distributed_optimizer="off")
    auto, auto_sim = planned(w, tight)
    assert plain.settings.recompute_choices() == ["none"]
    assert auto.settings.recompute_choices() == ["none"] and auto.settings.micro_batches == 1
    assert auto.predicted["planner_estimate"] < plain.predicted["planner_estimate"]
    assert max(auto_sim.peak_memory) <= tight.gpu.memory_bytes
    for m in ("1", "2", "4"):  # no forced count without recomputation is predicted faster
        forced, _ = planned(w, tight, recompute="none", micro_batches=m)
        assert auto.predicted["planner_estimate"] <= forced.predicted["planner_estimate"] * (1 + 1e-9)


def test_recomputation_goes_where_its_wave_has_slack():
    """Device 0 holds two halves of the vision chain, one the longest slice of wave 0, the other short beside a
    long text slice in wave 1; memory for one recomputed layer less. Given the waves' durations the layer is
    recomputed in wave 1's slack (lengthening nothing); counted in seconds alone, in the first half."""
    w = workload_from_dict(HEAVY)
    cluster = make_cluster(2, 2)
    g = build_metagraph(w)
    cost = AnalyticCostModel(w, cluster)
    numbers = ZeroSharded(MemoryModel(w, cluster, cost), 0)
    first = ScheduledSlice("vt/vision", 1, 1, 1, 0, 4, 1.0, devices=[0])
    second = ScheduledSlice("vt/vision", 1, 1, 1, 4, 8, 0.1, devices=[0])
    text = ScheduledSlice("vt/text", 1, 1, 1, 0, 4, 1.0, devices=[1])
    waves = [[first], [second, text]]
    order = slice_order([["vt"], ["vt", "vt"]], ExecutionSettings())
    params, peak = memory_breakdown(waves, g.metaops, numbers, 2, order)[0]
    one_layer = slice_options(g.metaops["vt/vision"], first, numbers, cost, RecomputePolicy())[0].held / 4
    capacity = params + peak - one_layer / 2
    args = (waves, g.metaops, numbers, cost, capacity, order, RecomputePolicy(), 2)
    by_seconds = choose_recompute(*args)
    by_waves = choose_recompute(*args, durations=[1.0, 1.0])
    assert by_seconds[(0, 0)].mode != "none" and by_seconds[(1, 0)].mode == "none"
    assert by_waves[(0, 0)].mode == "none" and by_waves[(1, 0)].mode != "none"


def test_a_plans_cheapest_recomputation_goes_where_its_wave_has_slack():
    """The same waves as a plan given the cheapest recomputation that fits (a plan made with memory unlimited,
    fitted by plan selection; baselines/memory_options.py): costed by what it lengthens the plan's waves, as
    the memory search costs it, the layer is recomputed in wave 1's slack."""
    w = workload_from_dict(HEAVY)
    cluster = make_cluster(2, 2)
    g = build_metagraph(w)
    cost = AnalyticCostModel(w, cluster)
    memory = MemoryModel(w, cluster, cost)
    first = ScheduledSlice("vt/vision", 1, 1, 1, 0, 4, 1.0, devices=[0])
    second = ScheduledSlice("vt/vision", 1, 1, 1, 4, 8, 0.1, devices=[0])
    text = ScheduledSlice("vt/text", 1, 1, 1, 0, 4, 1.0, devices=[1])
    level = g.metaops["vt/vision"].level
    waves = [ScheduledWave(level, 0.0, 1.0, [first]), ScheduledWave(level, 1.0, 1.0, [second, text])]
    plan = assemble_plan(w, cluster, g, waves, cost, memory, {}, validate=False)
    order = slice_order([["vt"], ["vt", "vt"]], ExecutionSettings())
    numbers = ZeroSharded(memory, 0)
    params, peak = memory_breakdown([wave.slices for wave in waves], g.metaops, numbers, 2, order)[0]
    one_layer = slice_options(g.metaops["vt/vision"], first, numbers, cost, RecomputePolicy())[0].held / 4
    tight = with_memory(2, params + peak - one_layer / 2)
    fitted = with_cheapest_recompute(plan, g, cost, MemoryModel(w, tight, cost), tight)
    assert [s.id for s in fitted.slices() if s.id in fitted.settings.slice_recompute] == [plan.waves[1].slices[0].id]
    assert max(plan_memory(fitted, g.metaops, MemoryModel(w, tight, cost))) <= tight.gpu.memory_bytes


def test_a_configuration_left_out_where_the_plan_never_goes_ends_the_search():
    """The vision chain on one device needs more than half a device, so that configuration is left out; the
    plan on 16 devices never runs vision on one device, so memory binds nothing: no further rung is planned."""
    w = workload_from_dict(HEAVY)
    probe = make_cluster(16, 8, "A800-80GB")
    g = build_metagraph(w)
    cost = AnalyticCostModel(w, probe)
    needs = memory_needs(g, w, probe, MemoryModel(w, probe, cost))
    one_device = max(n[(1, 1)] for n in needs.values())
    cluster = with_memory(16, 1.5 * one_device)
    said = []
    res = plan_workload(w, cluster, PlannerConfig(planner="wavefront"), progress=said.append)
    assert all(len(s.devices) > 1 for s in res.plan.slices() if s.module == "vision" and s.kind == "layer")
    assert [m for m in said if "estimated" in m] == [m for m in said if "estimated" in m][:1], said
    assert res.plan.settings.recompute_choices() in ([], ["none"])
    assert res.plan.planner["memory_limited"] is False  # more memory would plan the same


def test_a_slice_on_the_fewest_devices_memory_allows_records_the_search_as_memory_limited():
    """On 2 devices with 1.5x what the vision chain needs on one, vision on one device is left out and the
    allocator runs it on both, the fewest its limited curve allows: no slice would run faster, so the search
    ends at its first rung, but the plan records that memory may have shaped its allocation (plan selection then
    also plans with memory unlimited, megatron_spindle/autoplan.py). With 2.5x nothing is left out."""
    w = workload_from_dict(HEAVY)
    probe = make_cluster(16, 8, "A800-80GB")
    g = build_metagraph(w)
    cost = AnalyticCostModel(w, probe)
    one_device = memory_needs(g, w, probe, MemoryModel(w, probe, cost))["vt/vision"][(1, 1)]
    for factor, bound in ((1.5, True), (2.5, False)):
        said = []
        res = plan_workload(w, with_memory(2, factor * one_device), PlannerConfig(planner="wavefront"),
                            progress=said.append)
        vision = sorted(len(s.devices) for s in res.plan.slices() if s.module == "vision" and s.kind == "layer")
        assert (vision == [2]) == bound, vision
        assert len([m for m in said if "estimated" in m]) == 1, said
        assert res.plan.planner["memory_limited"] is bound and res.plan.settings.zero_stage == 0


def test_program_peaks_after_equal_peak_after():
    """The recomputation greedy's batched peak questions give the very floats of the one-at-a-time ones."""
    import random

    from megatron_spindle.plan.order import BWD, FWD
    from megatron_spindle.planner.memory_options import _Program

    rng = random.Random(0)
    keys = [(0, i) for i in range(5)]
    events = [(k, FWD) for k in keys] + [(k, BWD) for k in reversed(keys)]
    p = _Program([0], events, params=0.0)
    for k in keys:
        p.add(k, rng.uniform(0, 3e9), rng.uniform(0, 1e9))
    asked = p.peaks_after()
    for k in keys:
        for held, transient in ((-1e9, 0.0), (0.0, 2e9), (-0.3e9, 0.7e9), (5e9, 0.0)):
            assert asked(k, held, transient) == p.peak_after(k, held, transient)
    single = _Program([0], [(keys[0], FWD), (keys[0], BWD)], params=0.0)
    single.add(keys[0], 1e9, 1e8)
    assert single.peaks_after()(keys[0], -5e8, 0.0) == single.peak_after(keys[0], -5e8, 0.0)


def test_recompute_modules_flag_is_used_as_given_and_mlp_only_where_the_mlp_is_bias_free():
    """--recompute-modules layernorm mlp: every LLM layer slice reruns both, the encoders (MLPs with biases:
    megatron-core's MLP checkpoint cannot rerun them) the pre-norms alone; the plan says so and validates."""
    parser = build_parser("plan", [add_spindle_args])
    w = workload_from_dict(MIXED)
    args = parser.parse_args(["--recompute-granularity", "selective", "--recompute-modules", "mlp", "layernorm"])
    config = dataclasses.replace(planner_config_from_args(args), planner="wavefront")
    assert config.recompute_modules == ("mlp", "layernorm")
    plan = plan_workload(w, make_cluster(2, 2), config).plan
    modules = {plan.metaop(s.metaop).module: plan.settings.recompute_of(s.id).recompute_modules
               for s in plan.slices() if s.kind == "layer"}
    assert modules == {"llm": ("layernorm", "mlp"), "vision": ("layernorm",), "text": ("layernorm",)}
    validate_plan(plan, w)
    wrong = dataclasses.replace(plan, settings=dataclasses.replace(
        plan.settings, recompute=Recompute("selective", modules=("mlp",)), slice_recompute={}))
    with pytest.raises(PlanError, match="include mlp, which only llm modules can recompute"):
        validate_plan(wrong, w)


def mixed_llm_slice():
    """MIXED on 4 devices: (metagraph, its LLM MetaOp, cost model, ZeRO-0 numbers, the whole chain at TP 2)."""
    w = workload_from_dict(MIXED)
    cluster = make_cluster(4, 4)
    g = build_metagraph(w)
    llm = next(m for m in g.metaops.values() if m.kind == "layer" and m.module == "llm")
    cost = AnalyticCostModel(w, cluster)
    return g, llm, cost, ZeroSharded(MemoryModel(w, cluster, cost), 0), ScheduledSlice(
        llm.id, 2, 2, 1, 0, llm.num_layers, 1.0, devices=[0, 1])


def test_selective_modules_sit_on_the_ladder_between_none_and_full():
    """An LLM slice at TP 2: the pre-norms' recomputation (norms are not TP-sharded) frees a quarter of a layer
    for a short rerun and is a rung of its own; the MLP's frees more for more time; full holds the least; an
    encoder (MLP biases) is never offered the MLP's."""
    g, llm, cost, numbers, s = mixed_llm_slice()
    ladder = [o.recompute for o in slice_options(llm, s, numbers, cost, RecomputePolicy())]
    assert ladder[0] == Recompute() and Recompute("selective", modules=("layernorm",)) in ladder
    assert any("mlp" in rc.recompute_modules for rc in ladder) and ladder[-1] == Recompute("full")
    vision = g.metaops["clip/vision"] if "clip/vision" in g.metaops else next(
        m for m in g.metaops.values() if m.kind == "layer" and m.module == "vision")
    v = ScheduledSlice(vision.id, 1, 1, 1, 0, vision.num_layers, 1.0, devices=[0])
    assert not any("mlp" in o.recompute.recompute_modules
                   for o in slice_options(vision, v, numbers, cost, RecomputePolicy()))


def test_full_recomputation_of_some_layers_reruns_the_others_modules_where_that_is_cheaper():
    """The LLM slice at TP 2: full recomputation of its first k layers with the others' modules rerun (two
    megatron-core blocks) sits on the ladder, holding less than full recomputation of k layers alone for less
    time than one more fully recomputed layer; a capacity of exactly what it needs picks it."""
    g, llm, cost, numbers, s = mixed_llm_slice()
    ladder = slice_options(llm, s, numbers, cost, RecomputePolicy())
    both = next(o for o in ladder if o.recompute.mode == "full" and o.recompute.modules)
    k, rest = both.recompute.layers, both.recompute.modules
    assert both.recompute.blocks(llm.num_layers) == [
        (k, Recompute("full")), (llm.num_layers - k, Recompute("selective", modules=rest))]
    assert both.held < activation_memory(numbers, llm, 2, 2, llm.num_layers, Recompute("full", k))[0]
    assert both.seconds < cost.recompute_seconds(llm, 2, 2, Recompute("full", k + 1), llm.num_layers)
    waves, order = [[s]], slice_order([["caption"]], ExecutionSettings())
    params = memory_breakdown(waves, g.metaops, numbers, 2, order)[0][0]
    got = choose_recompute(waves, g.metaops, numbers, cost, params + both.held + both.transient, order,
                           RecomputePolicy(), 2)
    assert got == {(0, 0): both.recompute}


def test_overcommitted_placement_keeps_parameter_state_within_the_real_devices():
    """Placement on overcommitted devices plans activations that recomputation takes off afterwards; no
    recomputation frees parameter state, so a configuration whose chain holds more than half a real device in it
    is left out, though its whole chain fits half an overcommitted one (before, such plans could fit only at a
    higher ZeRO stage: QWen-VAL-70B / 256's LLM at TP 2)."""
    from megatron_spindle.planner.memory_search import (
        _allocate_schedule_place,
        chain_memories,
        param_state_bytes,
        per_config,
    )

    spec = copy.deepcopy(HEAVY)
    spec["tasks"][0]["batch_size"] = 8
    w = workload_from_dict(spec)
    g = build_metagraph(w)
    probe = make_cluster(2, 2, "A800-80GB")
    cost = AnalyticCostModel(w, probe)
    chains = chain_memories(g, w, probe, MemoryModel(w, probe, cost))
    params = per_config(chains, param_state_bytes)["vt/vision"][(1, 1)]
    whole = memory_needs(g, w, probe, MemoryModel(w, probe, cost))["vt/vision"][(1, 1)]
    cluster = with_memory(2, 1.6 * params)  # half of 2x holds the chain, half of 1x not its parameter state
    assert whole <= 1.6 * params and params > 0.5 * cluster.gpu.memory_bytes
    roomy = cluster.with_memory_factor(2.0)
    configs, shaped = {}, {}
    for real in (None, cluster):
        curves, _, _, bound, narrowed = _allocate_schedule_place(
            g, w, roomy, PlannerConfig(planner="wavefront"), None, cost, MemoryModel(w, roomy, cost),
            lambda msg: None, real=real)
        configs[real is None] = {n: (p.tp, p.dp) for n, p in curves["vt/vision"].points.items()}
        shaped[real is None] = bound or narrowed
    assert 1 in configs[True]  # the whole chain on one device: half of 2x holds it
    assert configs[False] == {2: (2, 1)}  # TP halves the parameter state per device; DP (ZeRO-0) does not
    # the limit is recorded as memory shaping the placement (plan selection then also plans without it)
    assert shaped == {True: False, False: True}


def test_a_stage_placed_unbound_skips_more_memory_only_for_stages_that_shard_as_much(monkeypatch):
    """A rung that placed with memory binding nothing means more memory would place the same at its ZeRO stage
    and above. A stage that shards less holds more, so its rungs on more memory are still tried (before, ZeRO-3
    placing freely on 2x devices skipped ZeRO-2 on 3x, QWen-VAL-70B / 256's best capped placement)."""
    import megatron_spindle.planner.memory_search as memory_search

    place_rung = memory_search._place_rung
    calls = []

    def only_zero3_on_2x(micro, workload, cluster, config, profile, stage, assumed, over, *rest):
        calls.append((stage, assumed.mode, over))
        if (stage, assumed.mode, over) != (3, "none", 2.0):
            raise PlanError("placement out of memory (test)")
        return place_rung(micro, workload, cluster, config, profile, stage, assumed, over, *rest)

    monkeypatch.setattr(memory_search, "_place_rung", only_zero3_on_2x)
    res = plan_workload(workload_from_dict(HEAVY), make_cluster(4, 4, "A800-80GB"), PlannerConfig(planner="wavefront"))
    assert res.plan.settings.zero_stage in (1, 2, 3)  # ZeRO-3's waves, their stage chosen again (test below)
    assert (1, "none", 3.0) in calls and (2, "none", 3.0) in calls
    assert (3, "none", 3.0) not in calls


def test_the_zero_stage_is_chosen_again_on_the_waves_as_planned(monkeypatch):
    """The search picks a rung's ZeRO stage on its waves as first placed; the waves the plan ends with get the stage
    the estimate times fastest among the sharded ones (OFASys-7 / 16's CP-SAT plan: ZeRO-3 chosen by 2 ms on the
    greedy waves, 38 ms slower than ZeRO-2 on the refined ones). Here only ZeRO-3 places (on 2x memory), and its
    waves fit ZeRO-1 without recomputation, which gathers no weights: the plan runs ZeRO-1."""
    import megatron_spindle.planner.memory_search as memory_search
    import megatron_spindle.planner.pipeline as pipeline

    place_rung, fastest = memory_search._place_rung, memory_search.fastest_zero_stage
    chosen = []

    def only_zero3_on_2x(micro, workload, cluster, config, profile, stage, assumed, over, *rest):
        if (stage, assumed.mode, over) != (3, "none", 2.0):
            raise PlanError("placement out of memory (test)")
        return place_rung(micro, workload, cluster, config, profile, stage, assumed, over, *rest)

    def recorded(cand, *args):
        out = fastest(cand, *args)
        chosen.append((cand, out))
        return out

    monkeypatch.setattr(memory_search, "_place_rung", only_zero3_on_2x)
    monkeypatch.setattr(pipeline, "fastest_zero_stage", recorded)
    w, cluster, config = workload_from_dict(HEAVY), make_cluster(4, 4, "A800-80GB"), PlannerConfig(planner="wavefront")
    res = plan_workload(w, cluster, config)
    assert res.plan.settings.zero_stage == 1
    cand, out = chosen[-1]
    assert cand.memory_model.zero_stage == 3 and not out.recomputes
    by_stage = {}
    for stage in (1, 2, 3):
        at = dataclasses.replace(cand, memory_model=MemoryModel(w, cluster, cand.cost_model, zero_stage=stage))
        by_stage[stage] = at.with_waves(cand.placed, cluster, config).estimate(w, cluster, res.metagraph)
    assert out.estimate(w, cluster, res.metagraph) == min(by_stage.values()) < by_stage[3]
    assert res.plan.predicted["planner_estimate"] == pytest.approx(min(by_stage.values()))
    # an unsharded plan stays unsharded: auto shards only where memory needs it
    unsharded = dataclasses.replace(out, memory_model=MemoryModel(w, cluster, out.cost_model, zero_stage=0))
    assert fastest(unsharded, w, cluster, res.metagraph, config) is unsharded
