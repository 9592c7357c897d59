import json

import pytest

from megatron_spindle.estimator import (
    AnalyticCostModel,
    CurvePoint,
    EstimatorError,
    Measurement,
    ProfiledCostModel,
    estimate_curves,
    load_profile,
    load_profile_points,
    save_profile_points,
)
from megatron_spindle.estimator.profile import points_of, profile_to_dict
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.plan.schema import Recompute

MEASURED = {
    "vision_depth/vision": [
        CurvePoint(1, 1, 1, 2e-3),
        CurvePoint(2, 2, 1, 1.2e-3),
        CurvePoint(16, 4, 4, 4e-4),
    ],
    "text_audio/text.head": [CurvePoint(8, 1, 8, 3e-4)],
}


def test_save_load_round_trip_feeds_estimate_curves(tiny_clip, tmp_path):
    workload, graph = tiny_clip
    cluster = make_cluster(16)
    path = tmp_path / "profile.json"
    save_profile_points(path, workload, cluster, MEASURED)
    loaded = load_profile_points(path, workload, cluster)
    assert {m: sorted(p.seconds for p in pts) for m, pts in loaded.items()} == {
        m: sorted(p.seconds for p in pts) for m, pts in MEASURED.items()
    }
    assert all(p.source == "profiled" for pts in loaded.values() for p in pts)
    curves = estimate_curves(graph, workload, cluster, profile=loaded)
    assert curves["vision_depth/vision"].time(16) == 4e-4
    assert curves["text_audio/text.head"].source == "profiled"


def test_points_beyond_the_cluster_are_dropped(tiny_clip, tmp_path):
    workload, _ = tiny_clip
    path = tmp_path / "profile.json"
    save_profile_points(path, workload, make_cluster(16), MEASURED)
    loaded = load_profile_points(path, workload, make_cluster(8))
    assert [p.n for p in loaded["vision_depth/vision"]] == [1, 2]


def test_a_profile_of_another_workload_is_refused(tiny_clip, tmp_path):
    workload, _ = tiny_clip
    path = tmp_path / "profile.json"
    save_profile_points(path, workload, make_cluster(8), MEASURED)
    other = load_workload("tiny-vlm")
    with pytest.raises(EstimatorError, match="profile it again"):
        load_profile_points(path, other, make_cluster(8))


def test_a_profile_of_another_gpu_is_refused(tiny_clip, tmp_path):
    workload, _ = tiny_clip
    path = tmp_path / "profile.json"
    save_profile_points(path, workload, make_cluster(8), MEASURED)
    with pytest.raises(EstimatorError, match="profiled on GPU 'A800-80GB' but the cluster has 'H100'"):
        load_profile_points(path, workload, make_cluster(8, gpu_type_name="H100"))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d["points"].update({"t9/ghost": []}), "MetaOp 't9/ghost' is not in workload"),
        (lambda d: d["points"]["vision_depth/vision"].append({"n": 2, "tp": 1}), "a point is"),
        (
            lambda d: d["points"]["vision_depth/vision"].append({"n": 2, "tp": 1, "dp": 2, "seconds": -1}),
            "positive finite",
        ),
        (
            lambda d: d["points"]["text_audio/text.head"].append({"n": 2, "tp": 2, "dp": 1, "seconds": 1e-3}),
            r"\(tp=2, dp=1\) is not a valid config",
        ),
        (lambda d: d.update(version=7), "version 7 is not supported"),
        (lambda d: d.update(format="other"), "not a megatron-spindle-profile document"),
    ],
)
def test_malformed_profiles_are_clear_errors(tiny_clip, tmp_path, edit, message):
    workload, _ = tiny_clip
    cluster = make_cluster(8)
    doc = profile_to_dict(workload, cluster, MEASURED)
    edit(doc)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(EstimatorError, match=message):
        load_profile_points(path, workload, cluster)


def test_invalid_json_is_a_clear_error(tiny_clip, tmp_path):
    workload, _ = tiny_clip
    path = tmp_path / "profile.json"
    path.write_text("{not json")
    with pytest.raises(EstimatorError, match="not valid JSON"):
        load_profile_points(path, workload, make_cluster(8))


def test_planner_and_simulator_fill_unmeasured_configs_alike(tiny_clip, tmp_path):
    """One rule for a profile: the curve's fill and ProfiledCostModel scale the analytic cost by the same factor
    (geometric mean of measured / modelled at the measured configs), and measured configs cost what was measured."""
    workload, graph = tiny_clip
    cluster = make_cluster(8)
    base = AnalyticCostModel(workload, cluster)
    vision = graph.metaops["vision_depth/vision"]
    ratios = {(1, 1): 3.0, (2, 1): 5.0}
    measurements = [Measurement(vision.id, [vision.id], tp, dp, 1, base.layer_cost(vision, tp, dp).total * r, 0.0,
                                "none", 1.0) for (tp, dp), r in ratios.items()]
    path = tmp_path / "profile.json"
    save_profile_points(path, workload, cluster, points_of(measurements),
                        extra={"measurements": [m.to_dict() for m in measurements]})
    profile = load_profile(path, workload, cluster)
    assert profile.measurements == measurements and profile.optimizer is None
    curve = estimate_curves(graph, workload, cluster, profile=profile.points)[vision.id]
    model = ProfiledCostModel(workload, cluster, profile.measurements)
    scale = (3.0 * 5.0) ** 0.5
    assert model.scale(vision) == pytest.approx(scale)
    for n in (4, 8):  # not measured: the same scaled analytic cost on both sides (T(n): without the grad sync)
        tp, dp = curve.config(n)
        assert curve.time(n) == pytest.approx(model.layer_cost(vision, tp, dp).step)
        assert curve.time(n) == pytest.approx(scale * base.layer_cost(vision, tp, dp).step)
    assert curve.time(1) == model.layer_cost(vision, 1, 1).total == measurements[0].seconds
    two_blocks = Recompute("full", 1, modules=("layernorm",))  # scaled once, not once per block
    assert model.recompute_seconds(vision, 2, 1, two_blocks, 2) == pytest.approx(
        scale * base.recompute_seconds(vision, 2, 1, two_blocks, 2))


def test_measured_sharded_copies_and_their_phases(tiny_clip, tmp_path):
    """The sharded runtime's measured host copies (ZeRO 1 and 2): at the measured config, else at the measured
    config with the nearest tp; read back from a profile; charged to the phases by ``sharded_phases`` (weights
    once a step, gradients once a step at ZeRO-1 and every micro-batch at ZeRO-2; nothing at ZeRO-0, nothing on
    the analytic model)."""
    from megatron_spindle.estimator.cost_model import sharded_phases

    workload, graph = tiny_clip
    cluster = make_cluster(8)
    vision, audio = graph.metaops["vision_depth/vision"], graph.metaops["text_audio/audio"]
    one = Measurement(vision.id, [vision.id], 1, 2, 1, 0.010, 0.0, "none", 1.0, shard_load_seconds=0.002,
                      shard_grad_seconds=0.003)
    two = Measurement(vision.id, [vision.id], 2, 1, 1, 0.008, 0.0, "none", 1.0, shard_load_seconds=0.001,
                      shard_grad_seconds=0.004)
    path = tmp_path / "profile.json"
    save_profile_points(path, workload, cluster, points_of([one, two]),
                        extra={"measurements": [one.to_dict(), two.to_dict()]})
    model = ProfiledCostModel(workload, cluster, load_profile(path, workload, cluster).measurements)
    assert model.sharded_copy_seconds(vision, 1, 2) == (0.002, 0.003)
    assert model.sharded_copy_seconds(vision, 2, 1) == (0.001, 0.004)
    assert model.sharded_copy_seconds(vision, 1, 8) == (0.002, 0.003)  # the nearest tp
    assert model.sharded_copy_seconds(vision, 4, 2) == (0.001, 0.004)
    assert model.sharded_copy_seconds(audio, 1, 1) == (0.0, 0.0)  # not measured
    assert Measurement.from_dict({k: v for k, v in one.to_dict().items() if not k.startswith("shard_")}
                                 ).shard_load_seconds == 0.0  # profiles written before it
    assert sharded_phases(model, vision, 1, 2, 0) == (0.0, 0.0)
    assert sharded_phases(model, vision, 1, 2, 1) == pytest.approx((0.002, 0.003))
    assert sharded_phases(model, vision, 1, 2, 1, micro_batches=2) == pytest.approx((0.001, 0.0015))
    assert sharded_phases(model, vision, 1, 2, 2, micro_batches=2) == pytest.approx((0.001, 0.003))
    assert sharded_phases(AnalyticCostModel(workload, cluster), vision, 1, 2, 1) == (0.0, 0.0)


def test_measured_forward_splits_the_phases(tiny_clip, tmp_path):
    """A measurement with its forward timed splits compute as measured; one without (an older profile) like the
    analytic model at the same config."""
    workload, graph = tiny_clip
    cluster = make_cluster(8)
    base = AnalyticCostModel(workload, cluster)
    vision = graph.metaops["vision_depth/vision"]
    timed = Measurement(vision.id, [vision.id], 1, 1, 1, 0.010, 0.0, "none", 1.0, forward_seconds=0.006)
    untimed = Measurement(vision.id, [vision.id], 2, 1, 1, 0.008, 0.0, "none", 1.0)
    path = tmp_path / "profile.json"
    save_profile_points(path, workload, cluster, points_of([timed, untimed]),
                        extra={"measurements": [timed.to_dict(), untimed.to_dict()]})
    profile = load_profile(path, workload, cluster)
    assert profile.measurements == [timed, untimed]
    model = ProfiledCostModel(workload, cluster, profile.measurements)
    assert model.phase_seconds(vision, 1, 1) == pytest.approx((0.006, 0.004))
    fwd, bwd = base.phase_seconds(vision, 2, 1)
    assert model.phase_seconds(vision, 2, 1) == pytest.approx((0.008 * fwd / (fwd + bwd), 0.008 * bwd / (fwd + bwd)))


def test_measured_gradient_sync_is_fp32_s_and_bf16_plans_charge_the_comm_model(tiny_clip):
    """A profile times its DP gradient all-reduces in fp32 (PROFILED_GRAD_BYTES): a plan that reduces in fp32
    is charged the measurement, one that reduces in bf16 (--grad-reduce-in-bf16) the comm model at its bytes."""
    from megatron_spindle.estimator import CostModelConfig
    from megatron_spindle.estimator.profile import PROFILED_GRAD_BYTES

    workload, graph = tiny_clip
    cluster = make_cluster(8)
    vision = graph.metaops["vision_depth/vision"]
    measured = [Measurement(vision.id, [vision.id], 1, 2, 1, 0.010, 0.004, "none", 1.0)]
    assert PROFILED_GRAD_BYTES == 4
    assert ProfiledCostModel(workload, cluster, measured).layer_cost(vision, 1, 2).dp_sync == 0.004
    half = CostModelConfig(grad_bytes=2)
    bf16 = ProfiledCostModel(workload, cluster, measured, config=half).layer_cost(vision, 1, 2)
    assert bf16.compute == 0.010
    assert bf16.dp_sync == AnalyticCostModel(workload, cluster, config=half).layer_cost(vision, 1, 2).dp_sync > 0
