"""Plan schema version 2: typed execution settings, save/load, version-1 files converted on load, bad versions
refused with the way to replan, and the settings checked against the plan (order, segments, recomputation)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_spindle.baselines import BaselineContext, spindle_seq_plan
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.plan.io import load_plan, plan_from_dict, plan_to_dict
from megatron_spindle.plan.order import BWD, FWD, early_backward_order, execution_steps, slice_order
from megatron_spindle.plan.schema import (
    ExecutionSettings,
    Plan,
    PlanError,
    Recompute,
    attention_kernels,
    fitted_recompute,
    recompute_fits,
    resolve_attention_backend,
)
from megatron_spindle.plan.validate import validate_plan
from megatron_spindle.planner.pipeline import PlannerConfig, make_plan


@pytest.fixture(scope="module")
def baseline():
    """A temporally decoupled plan: one segment per task, on two nodes of two devices."""
    w, c = load_workload("tiny-vlm"), make_cluster(4, 2, "CPU")
    return spindle_seq_plan(w, c, BaselineContext.build(w, c)), w, c


def as_version_1(plan: Plan) -> dict:
    """What the previous version wrote for this plan: settings in the planner dict, forward bytes only (by
    its own routing rule, here deliberately wrong), parameter groups counted as bf16 weights."""
    d = plan_to_dict(plan)
    settings = d.pop("settings")
    d["schema_version"] = 1
    d["planner"] = {**d["planner"], "recompute": settings["recompute"]["mode"] == "full",
                    "zero_stage": settings["zero_stage"], "segments": settings["segments"]}
    for t in d["transfers"]:
        del t["backward_bytes_by_kind"]
        t["bytes_by_kind"] = {"local": 0.0, "intra_island": t["bytes"], "inter_island": 0.0}
    for g in d["param_groups"]:
        g["bytes"] = g["bytes"] / plan.settings.grad_reduce_bytes * 2
    return d


def test_version_2_round_trip_keeps_every_setting(tmp_path, baseline):
    plan, w, c = baseline
    assert plan.settings.segments and len(plan.settings.segments) == len(w.tasks)
    odd = dataclasses.replace(plan, settings=dataclasses.replace(
        plan.settings, zero_stage=2, micro_batches=4, grad_reduce_dtype="bf16", backward_order=tuple(
            reversed(range(len(plan.waves)))), slice_recompute={plan.waves[0].slices[0].id: Recompute("full", 0)}))
    odd.save(tmp_path / "plan.json")
    assert json.loads((tmp_path / "plan.json").read_text())["schema_version"] == 2
    assert Plan.load(tmp_path / "plan.json") == odd
    hpz = dataclasses.replace(odd, settings=dataclasses.replace(odd.settings, zero_stage=3, node_local_weights=True))
    hpz.save(tmp_path / "hpz.json")
    assert Plan.load(tmp_path / "hpz.json") == hpz and hpz.weight_scope == hpz.gpus_per_node
    assert odd.weight_scope is None


def test_version_1_file_converts_to_the_typed_settings_and_today_s_routing(tmp_path, baseline):
    plan, w, c = baseline
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(as_version_1(plan)))
    loaded = load_plan(path)
    # settings typed, transfers routed again, group bytes the all-reduce volume; version 1 predates the overlapped
    # weight gather (its plans gathered within the step) and the attention backend (auto: as those plans ran)
    assert loaded.settings.overlap_param_gather is False
    assert loaded == dataclasses.replace(plan, settings=dataclasses.replace(plan.settings, overlap_param_gather=False))
    assert "segments" not in loaded.planner and "zero_stage" not in loaded.planner
    validate_plan(loaded, w, c)
    spindle = make_plan(w, c, PlannerConfig(planner="wavefront", distributed_optimizer="on"))
    assert spindle.settings.zero_stage == 1
    assert spindle.settings.attention_backend == "local"  # a CPU cluster runs megatron-core's local spec
    assert plan_from_dict(as_version_1(spindle)) == dataclasses.replace(
        spindle, settings=dataclasses.replace(spindle.settings, overlap_param_gather=False, attention_backend="auto"))


def test_unknown_versions_and_malformed_files_say_how_to_replan(tmp_path, baseline):
    plan = baseline[0]
    d = plan_to_dict(plan)
    with pytest.raises(PlanError, match=r"schema version 3 is not supported.*python tools/plan.py"):
        plan_from_dict({**d, "schema_version": 3})
    with pytest.raises(PlanError, match="not a megatron-spindle plan"):
        plan_from_dict({**d, "format": "something-else"})
    broken = as_version_1(plan)
    del broken["waves"]
    with pytest.raises(PlanError, match=r"malformed version-1 plan.*python tools/plan.py"):
        plan_from_dict(broken)
    with pytest.raises(PlanError, match="malformed plan"):
        plan_from_dict({**d, "settings": {**d["settings"], "no_such_setting": 1}})
    with pytest.raises(PlanError, match="overlap_param_gather must be true or false"):
        plan_from_dict({**d, "settings": {**d["settings"], "overlap_param_gather": "yes"}})
    saved = plan_to_dict(plan)
    assert plan_from_dict(saved).settings.overlap_param_gather is plan.settings.overlap_param_gather
    del saved["settings"]["overlap_param_gather"]  # written before the setting: the gather ends in the step
    assert plan_from_dict(saved).settings.overlap_param_gather is False
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(PlanError, match="not valid JSON"):
        load_plan(tmp_path / "bad.json")


def test_settings_reject_values_they_cannot_mean():
    with pytest.raises(PlanError, match="zero_stage"):
        ExecutionSettings(zero_stage=4)
    with pytest.raises(PlanError, match="micro_batches"):
        ExecutionSettings(micro_batches=0)
    with pytest.raises(PlanError, match="grad_reduce_dtype"):
        ExecutionSettings(grad_reduce_dtype="fp8")
    with pytest.raises(PlanError, match="node_local_weights shards the weights of ZeRO stage 3, not 2"):
        ExecutionSettings(zero_stage=2, node_local_weights=True)
    with pytest.raises(PlanError, match="recompute mode 'some'"):
        Recompute("some")
    with pytest.raises(PlanError, match="only 'full' takes a count"):
        Recompute("selective", 2)
    assert ExecutionSettings().grad_reduce_bytes == 4 and ExecutionSettings(grad_reduce_dtype="bf16").grad_reduce_bytes == 2


def test_recompute_choices_say_how_many_layers_recompute():
    assert Recompute().recomputed_layers(4) == Recompute("selective").recomputed_layers(4) == 0
    assert Recompute("full").recomputed_layers(4) == 4 and Recompute("full", 2).recomputed_layers(4) == 2
    assert Recompute("full", 6).recomputed_layers(4) == 4 and Recompute("full", 3, "uniform").recomputed_layers(4) == 4
    assert Recompute("full", 0).for_layers(4) == Recompute() and Recompute("full", 4).for_layers(4) == Recompute("full")
    assert Recompute("full", 2, "uniform").chunk() == 2 and Recompute("full").chunk() == 1
    with pytest.raises(PlanError, match="method 'sideways'"):
        Recompute("full", 2, "sideways")
    with pytest.raises(PlanError, match="uniform"):
        Recompute("selective", method="uniform")
    settings = ExecutionSettings(recompute=Recompute("selective"), slice_recompute={"w0:a": Recompute("full", 2)})
    assert settings.recompute_of("w0:a") == Recompute("full", 2) and settings.recompute_of("w1:b").mode == "selective"
    assert ExecutionSettings.from_dict(settings.to_dict()) == settings


def test_selective_recompute_modules_are_megatron_core_s_and_round_trip():
    both = Recompute("selective", modules=("mlp", "layernorm"))
    assert both.modules == ("layernorm", "mlp") and both.recompute_modules == ("layernorm", "mlp")
    assert Recompute("selective", modules=("core_attn",)) == Recompute("selective")  # megatron-core's default
    assert Recompute("selective").recompute_modules == ("core_attn",) and Recompute("full").recompute_modules == ()
    assert both.describe() == "selective (layernorm, mlp)" and Recompute("selective").describe() == "selective"
    settings = ExecutionSettings(recompute=both, slice_recompute={"w0:a": Recompute("selective", modules=("mlp",))})
    d = json.loads(json.dumps(settings.to_dict()))
    assert d["recompute"]["modules"] == ["layernorm", "mlp"] and d["slice_recompute"]["w0:a"]["modules"] == ["mlp"]
    assert ExecutionSettings.from_dict(d) == settings
    assert "modules" not in ExecutionSettings(recompute=Recompute("selective")).to_dict()["recompute"]
    for bad, words in (((), "at least one"), (("moe",), "each one of core_attn, layernorm, mlp"),
                       ("mlp", "a list of module names")):
        with pytest.raises(PlanError, match=words):
            Recompute("selective", modules=bad)
    with pytest.raises(PlanError, match="only mode 'selective', or 'full' with method 'block'"):
        Recompute("full", 2, "uniform", modules=("mlp",))
    with pytest.raises(PlanError, match="got mode 'none'"):
        Recompute("none", modules=("mlp",))
    assert fitted_recompute(both, "encoder") == Recompute("selective", modules=("layernorm",))
    assert fitted_recompute(Recompute("selective", modules=("mlp",)), "encoder") == Recompute("selective")
    assert fitted_recompute(both, "llm") == both and recompute_fits(both, "llm") and not recompute_fits(both, "encoder")


def test_full_recomputation_of_k_layers_with_the_others_selective_is_two_megatron_core_blocks():
    rc = Recompute("full", 3, modules=("layernorm", "core_attn"))
    assert rc.modules == ("core_attn", "layernorm") and rc.recompute_modules == ("core_attn", "layernorm")
    assert rc.describe() == "full (3 layers) + selective (core_attn, layernorm)"
    assert rc.blocks(8) == [(3, Recompute("full")), (5, Recompute("selective", modules=("core_attn", "layernorm")))]
    assert Recompute("full", 3, modules=("core_attn",)).blocks(4)[1] == (1, Recompute("selective"))
    # its plainest form: every layer full, or none full (the others' modules alone)
    assert rc.for_layers(3) == rc.for_layers(2) == Recompute("full") and rc.blocks(3) == [(3, Recompute("full"))]
    assert Recompute("full", 0, modules=("mlp",)).for_layers(4) == Recompute("selective", modules=("mlp",))
    assert Recompute("full", 3).blocks(8) == [(8, Recompute("full", 3))]  # the others rerun nothing: one block
    assert recompute_fits(rc, "encoder") and not recompute_fits(Recompute("full", 1, modules=("mlp",)), "encoder")
    assert fitted_recompute(Recompute("full", 2, modules=("layernorm", "mlp")), "encoder") == \
        Recompute("full", 2, modules=("layernorm",))
    settings = ExecutionSettings(slice_recompute={"w0:a": rc})
    d = json.loads(json.dumps(settings.to_dict()))
    assert d["slice_recompute"]["w0:a"] == {"mode": "full", "layers": 3, "modules": ["core_attn", "layernorm"]}
    assert ExecutionSettings.from_dict(d) == settings


def test_execution_order_of_segments_an_explicit_backward_order_and_steps():
    def waves(steps):
        return [(w, p) for w, p, _ in steps]

    assert waves(execution_steps(3, ExecutionSettings())) == [(0, FWD), (1, FWD), (2, FWD), (2, BWD), (1, BWD),
                                                              (0, BWD)]
    assert waves(execution_steps(3, ExecutionSettings(segments=[[2], [0, 1]]))) == [
        (2, FWD), (2, BWD), (0, FWD), (1, FWD), (1, BWD), (0, BWD)]
    assert waves(execution_steps(3, ExecutionSettings(backward_order=[2, 0, 1]))) == [
        (0, FWD), (1, FWD), (2, FWD), (2, BWD), (0, BWD), (1, BWD)]
    with pytest.raises(PlanError, match="every wave index 0..2 exactly once"):
        execution_steps(3, ExecutionSettings(segments=[[0], [0, 1, 2]]))
    with pytest.raises(PlanError, match="backward_order"):
        execution_steps(3, ExecutionSettings(backward_order=[0, 1]))
    # task b finishes in wave 1: one of its waves runs backward after each later forward wave (wave 1's before
    # wave 2's forward), the rest with everything else; a backward wave runs its slices in reverse
    tasks = [["a", "b"], ["a", "b"], ["a"]]
    early = ExecutionSettings(order=early_backward_order(tasks))
    assert slice_order(tasks, early) == [(0, 0, FWD), (0, 1, FWD), (1, 0, FWD), (1, 1, FWD), (1, 1, BWD),
                                         (2, 0, FWD), (2, 0, BWD), (1, 0, BWD), (0, 0, BWD), (0, 1, BWD)]
    five = [["a", "b"], ["a", "b"], ["a", "b"], ["a"], ["a"]]  # b's backward spread over a's last forwards
    assert [st for st in early_backward_order(five) if st[2] == "b"] == [(2, BWD, "b"), (1, BWD, "b"), (0, BWD, "b")]
    assert early_backward_order(five).index((1, BWD, "b")) == early_backward_order(five).index((3, FWD, None)) + 1
    assert ExecutionSettings.from_dict(json.loads(json.dumps(early.to_dict()))) == early
    with pytest.raises(PlanError, match="replaces segments"):
        ExecutionSettings(order=early.order, segments=[[0, 1, 2]])
    with pytest.raises(PlanError, match="never runs the bwd of slice 0 of wave 2"):
        slice_order(tasks, ExecutionSettings(order=[st for st in early.order if st != (2, BWD, "a")]))
    with pytest.raises(PlanError, match="backward of slice 1 of wave 0 before its forward"):
        slice_order(tasks, ExecutionSettings(order=[(0, BWD, "b")] + list(early.order)))
    with pytest.raises(PlanError, match="wave 2 has no slice of task 'b'"):
        slice_order(tasks, ExecutionSettings(order=list(early.order) + [(2, FWD, "b")]))


def test_validate_checks_the_settings_against_the_waves(baseline):
    plan, w, c = baseline
    forward_order = tuple(range(len(plan.waves)))
    early = dataclasses.replace(plan, settings=dataclasses.replace(plan.settings, segments=None,
                                                                   backward_order=forward_order))
    with pytest.raises(PlanError, match=r"runs the backward of slice 0 of wave 0 before that of slice 0 of wave \d+, "
                                        r"which reads its output"):
        validate_plan(early, w, c)
    unknown = dataclasses.replace(plan, settings=dataclasses.replace(
        plan.settings, slice_recompute={"w99:nothing": Recompute("full")}))
    with pytest.raises(PlanError, match="names slice 'w99:nothing'"):
        validate_plan(unknown, w, c)
    moved = plan_from_dict(plan_to_dict(plan))
    moved.transfers[0].bytes_by_kind = {"local": 0.0, "intra_island": 0.0, "inter_island": 7 * moved.transfers[0].bytes}
    with pytest.raises(PlanError, match="not the routing of its"):
        validate_plan(moved, w, c)
    renumbered = plan_from_dict(plan_to_dict(plan))
    renumbered.waves[1].index = 7
    with pytest.raises(PlanError, match="wave at position 1 has index 7"):
        validate_plan(renumbered, w, c)


def test_attention_backend_round_trips_and_old_plans_run_as_they_did(tmp_path, baseline):
    """settings.attention_backend is saved and loaded; a plan written before the key loads as auto (TE's choice
    where TE runs, else the local spec: how those plans ran); a backend outside Megatron's names is refused."""
    plan = baseline[0]
    local = dataclasses.replace(plan, settings=dataclasses.replace(plan.settings, attention_backend="local"))
    local.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").settings.attention_backend == "local"
    d = plan_to_dict(local)
    del d["settings"]["attention_backend"]
    assert plan_from_dict(d).settings.attention_backend == "auto"
    with pytest.raises(PlanError, match="attention_backend 'sdpa' is not one of auto, flash, fused, unfused, local"):
        ExecutionSettings(attention_backend="sdpa")


def test_gradient_sync_flags_round_trip_and_old_plans_run_as_they_did(tmp_path, baseline):
    """settings.overlap_grad_reduce and ddp_bucket_size (--overlap-grad-reduce, --ddp-bucket-size) are saved and
    loaded; a plan written before the keys loads overlapped, with megatron-core's bucket size (how those plans ran);
    a bucket size that is not a positive count is refused."""
    plan = baseline[0]
    own = dataclasses.replace(plan, settings=dataclasses.replace(plan.settings, overlap_grad_reduce=False,
                                                                  ddp_bucket_size=10_000_000))
    own.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json").settings
    assert (loaded.overlap_grad_reduce, loaded.ddp_bucket_size) == (False, 10_000_000)
    d = plan_to_dict(own)
    del d["settings"]["overlap_grad_reduce"], d["settings"]["ddp_bucket_size"]
    old = plan_from_dict(d).settings
    assert (old.overlap_grad_reduce, old.ddp_bucket_size) == (True, None)
    for bad in (0, -5, 2.5, True, "40M"):
        with pytest.raises(PlanError, match="ddp_bucket_size must be a positive integer or null"):
            ExecutionSettings(ddp_bucket_size=bad)
    with pytest.raises(PlanError, match="overlap_grad_reduce must be true or false"):
        ExecutionSettings(overlap_grad_reduce="yes")


def test_attention_backends_name_the_kernels_the_models_charge():
    """flash, fused and auto are fused attention (FlashAttention's cost, no scores kept); TE's unfused backend
    writes the scores with a fused softmax; the local spec writes them and soft-maxes in fp32 torch ops."""
    assert [attention_kernels(b) for b in ("auto", "flash", "fused", "unfused", "local")] == [
        ("flash", False), ("flash", False), ("flash", False), ("unfused", True), ("unfused", False)]
    # planning for a GPU type elsewhere: TE assumed (Megatron-LM's default spec); here without TE, or on a CPU:
    # auto is the local spec and a TE backend is refused
    assert [resolve_attention_backend(b, "hopper") for b in ("auto", "fused", "local")] == ["auto", "fused", "local"]
    assert resolve_attention_backend("auto", "hopper", te_present=False) == "local"
    assert resolve_attention_backend("auto", "cpu") == "local"
    with pytest.raises(PlanError, match="cannot run on this machine, where Transformer Engine is not available"):
        resolve_attention_backend("unfused", "ampere", te_present=False)
    with pytest.raises(PlanError, match="--attention-backend must be one of"):
        resolve_attention_backend("sdpa", "ampere")


def test_recomputes_asks_the_layer_slices_only(baseline):
    """``Plan.recomputes``: some layer slice's own or global choice is not "none"; a choice recorded for a
    front end or head, or a per-slice "none", does not count."""
    plan, _, _ = baseline
    layer = next(s for s in plan.slices() if s.kind == "layer")
    other = next(s for s in plan.slices() if s.kind != "layer")

    def with_settings(**kw):
        return dataclasses.replace(plan, settings=dataclasses.replace(plan.settings, **kw))

    assert not plan.recomputes()
    assert with_settings(slice_recompute={layer.id: Recompute("selective")}).recomputes()
    assert with_settings(recompute=Recompute("full")).recomputes()
    assert not with_settings(slice_recompute={other.id: Recompute("full")}).recomputes()
    assert not with_settings(recompute=Recompute("full"), slice_recompute={
        s.id: Recompute() for s in plan.slices() if s.kind == "layer"}).recomputes()
