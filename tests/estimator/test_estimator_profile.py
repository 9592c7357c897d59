import json

import pytest

from megatron_spindle.estimator import (
    CurvePoint,
    EstimatorError,
    estimate_curves,
    load_profile_points,
    save_profile_points,
)
from megatron_spindle.estimator.profile import profile_to_dict
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.workload import load_workload

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
