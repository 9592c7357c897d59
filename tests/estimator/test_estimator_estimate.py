import math

import pytest

from megatron_spindle.estimator import (
    AnalyticCostModel,
    CostModelConfig,
    CurvePoint,
    EstimatorError,
    estimate_curves,
    valid_configs,
    valid_ns,
)
from megatron_spindle.estimator.comm_model import OVERLAP_SLOWDOWN, CommModel
from megatron_spindle.estimator.estimate import exposed_sync_seconds, weight_sharers
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import load_workload


@pytest.mark.parametrize("name", ["tiny_clip", "tiny_vlm"])
def test_curves_for_builtin_workloads(name, request, cluster8):
    workload, graph = request.getfixturevalue(name)
    model = AnalyticCostModel(workload, cluster8)
    curves = estimate_curves(graph, workload, cluster8)
    assert set(curves) == set(graph.metaops)
    for metaop_id, curve in curves.items():
        metaop = graph.metaops[metaop_id]
        assert curve.metaop == metaop_id and curve.source == "analytic"
        assert curve.valid_ns == valid_ns(metaop, workload, cluster8)
        for n in curve.valid_ns:
            tp, dp = curve.config(n)
            assert tp * dp == n
            candidates = [
                model.layer_cost(metaop, t, d).step  # T(n): without the grad sync
                for t, d in valid_configs(metaop, workload, cluster8)
                if t * d == n
            ]
            assert curve.time(n) == min(candidates)  # the fastest config at n
        assert curve.fit_error < 0.1


def test_heavy_curve_scales_better_than_light_curve(clip_like, cluster8):
    workload, graph = clip_like
    curves = estimate_curves(graph, workload, cluster8)
    assert curves["vt/vision"].speedup(8) > curves["vt/text.head"].speedup(8)


def test_profiled_points_take_precedence(tiny_clip, cluster8):
    workload, graph = tiny_clip
    analytic = estimate_curves(graph, workload, cluster8)["vision_depth/vision"]
    measured = [CurvePoint(1, 1, 1, 3e-3), CurvePoint(2, 1, 2, 1.8e-3), CurvePoint(2, 2, 1, 1.6e-3)]
    profile = {"vision_depth/vision": measured}
    curves = estimate_curves(graph, workload, cluster8, profile=profile, calibrate=False)
    curve = curves["vision_depth/vision"]
    assert curve.source == "profiled"
    assert curve.time(1) == 3e-3
    assert curve.time(2) == 1.6e-3 and curve.config(2) == (2, 1)  # fastest profiled config at n=2
    assert curve.points[2].source == "profiled"
    for n in (4, 8):  # not profiled: the analytic model fills in
        assert curve.points[n].source == "analytic"
        assert curve.time(n) == analytic.time(n) and curve.config(n) == analytic.config(n)
    assert curves["vision_text/vision"].source == "analytic"  # other MetaOps untouched


def test_analytic_fill_is_calibrated_to_the_profile(tiny_clip, cluster8):
    workload, graph = tiny_clip
    analytic = estimate_curves(graph, workload, cluster8)["vision_depth/vision"]
    ratio_1, ratio_2 = 4.0, 9.0
    measured = [
        CurvePoint(1, 1, 1, analytic.time(1) * ratio_1),
        CurvePoint(2, *analytic.config(2), analytic.time(2) * ratio_2),
    ]
    curve = estimate_curves(graph, workload, cluster8, profile={"vision_depth/vision": measured})[
        "vision_depth/vision"
    ]
    scale = math.sqrt(ratio_1 * ratio_2)  # geometric mean of measured / modelled
    assert curve.time(4) == pytest.approx(analytic.time(4) * scale)
    assert curve.time(1) == measured[0].seconds


def test_profile_with_an_invalid_config_is_rejected(tiny_clip, cluster8):
    workload, graph = tiny_clip
    bad = {"vision_depth/vision.head": [CurvePoint(2, 2, 1, 1e-3)]}  # light op: tp must be 1
    with pytest.raises(EstimatorError, match=r"profile of 'vision_depth/vision.head': \(tp=2, dp=1\)"):
        estimate_curves(graph, workload, cluster8, profile=bad)


def test_profile_of_an_unknown_metaop_is_rejected(tiny_clip, cluster8):
    workload, graph = tiny_clip
    with pytest.raises(EstimatorError, match="t9/ghost"):
        estimate_curves(graph, workload, cluster8, profile={"t9/ghost": [CurvePoint(1, 1, 1, 1.0)]})


def test_a_custom_cost_model_is_used(tiny_clip, cluster8):
    workload, graph = tiny_clip
    slow_launches = AnalyticCostModel(workload, cluster8, config=CostModelConfig(launch_seconds=1e-3))
    custom = estimate_curves(graph, workload, cluster8, cost_model=slow_launches)
    frontend = graph.metaops["text_audio/audio.frontend"]
    assert custom["text_audio/audio.frontend"].time(1) == slow_launches.layer_cost(frontend, 1, 1).total
    assert custom["text_audio/audio.frontend"].time(1) >= 9e-3  # 9 kernels of 1 ms


def test_cached_curves_equal_fresh_ones_per_allowed_set(tiny_vlm, cluster8):
    """The memory search's curve cache: a curve comes back from the cache only for the same MetaOp shape and the
    same allowed configurations; every curve equals the one fitted without the cache."""
    workload, graph = tiny_vlm
    model, cache = AnalyticCostModel(workload, cluster8), {}
    no_tp = lambda m, tp, dp: tp == 1  # noqa: E731
    for allowed in (None, no_tp, None, no_tp):
        cached = estimate_curves(graph, workload, cluster8, cost_model=model, allowed=allowed, cache=cache)
        fresh = estimate_curves(graph, workload, cluster8, cost_model=AnalyticCostModel(workload, cluster8),
                                allowed=allowed)
        assert {m: c.points for m, c in cached.items()} == {m: c.points for m, c in fresh.items()}
    restricted = {m for m, op in graph.metaops.items()
                  if any(tp > 1 for tp, _ in valid_configs(op, workload, cluster8))}
    assert restricted  # some MetaOp has a TP config for the restriction to drop
    assert len(cache) == len(graph.metaops) + len(restricted)
    again = estimate_curves(graph, workload, cluster8, cost_model=model, allowed=no_tp, cache=cache)
    assert all(again[m] is cached[m] for m in graph.metaops)  # the second time, fitted nothing


class _SyncStub:
    """A cost model with a fixed gradient sync and backward per operator."""

    def __init__(self, sync: float, backward: float, cluster=None):
        self.sync, self.backward = sync, backward
        self.comm = CommModel(cluster or make_cluster(8))

    def dp_sync_seconds(self, metaop, tp, dp):
        return self.sync

    def phase_seconds(self, metaop, tp, dp):
        return 1.0, self.backward


def test_exposed_sync_is_the_overlap_beyond_one_backward():
    slow = OVERLAP_SLOWDOWN
    # sync 3 s against a 2 s backward: both run slowed until the backward ends (2 * slow); the sync has 1 s left
    assert exposed_sync_seconds(_SyncStub(3.0, 2.0), None, 1, 2, 1) == pytest.approx(2 * slow + 1 - 2)
    # three MetaOps hold the weights: 1 s of it, done while the backward runs slowed; the backward's rest alone
    assert exposed_sync_seconds(_SyncStub(3.0, 2.0), None, 1, 2, 3) == pytest.approx(slow + 1 - 2)
    assert exposed_sync_seconds(_SyncStub(0.0, 2.0), None, 1, 1, 1) == 0.0
    # a measured slowdown (a CPU's: 2, no overlap at all) replaces C10's: the sync and the backward add up
    serial = make_cluster(8, overlap_slowdown=2.0)
    assert exposed_sync_seconds(_SyncStub(3.0, 2.0, serial), None, 1, 2, 1) == pytest.approx(3.0)


def test_sync_aware_curves_trade_compute_for_less_sync_across_nodes():
    workload = load_workload("qwen-val")
    cluster = make_cluster(64)
    graph = build_metagraph(workload)
    model = AnalyticCostModel(workload, cluster)
    plain = estimate_curves(graph, workload, cluster, model)
    aware = estimate_curves(graph, workload, cluster, model, sync_sharers="metaop")
    sharers = weight_sharers(graph)
    assert sharers["al/llm"] == 3 and sharers["vl/vision"] == 2 and sharers["al/llm.frontend"] == 3
    # the three LLM MetaOps are one MetaLevel: counted by level, each syncs its own copy
    by_level = weight_sharers(graph, "level")
    assert set(by_level.values()) == {1}
    whole = estimate_curves(graph, workload, cluster, model, sync_sharers="level")
    assert all(whole["al/llm"].time(n) >= aware["al/llm"].time(n) for n in whole["al/llm"].valid_ns)
    with pytest.raises(ValueError, match="counted by one of"):
        weight_sharers(graph, "task")
    llm = graph.metaops["al/llm"]
    for n in aware["al/llm"].valid_ns:
        charged = {(tp, dp): model.layer_cost(llm, tp, dp).step + exposed_sync_seconds(model, llm, tp, dp, 3)
                   for tp, dp in valid_configs(llm, workload, cluster) if tp * dp == n}
        assert aware["al/llm"].time(n) == pytest.approx(min(charged.values()))
        assert aware["al/llm"].time(n) >= plain["al/llm"].time(n)
    # on four nodes the 7B LLM's gradients (fp32, a third of them per task) outlast a layer's backward at tp 1;
    # by TP shard (the runtime's layout) a TP rank reduces 1/tp of them, so the sync-aware curve buys TP
    assert plain["al/llm"].config(32) == (1, 32)
    assert aware["al/llm"].config(32)[0] > 1
    assert aware["al/llm"].time(32) > 1.1 * plain["al/llm"].time(32)


def test_exposed_sync_is_a_tp_shard_s_over_its_data_parallel_ranks():
    """The runtime reduces by TP shard (plan/schema.py tp_sharded_grads): a (tp, dp) operator's sync is each TP
    rank's shard over its dp ranks, the cost model's analytic collective."""
    asked = []

    class Recording(_SyncStub):
        def dp_sync_seconds(self, metaop, tp, dp):
            asked.append((tp, dp))
            return super().dp_sync_seconds(metaop, tp, dp)

    exposed_sync_seconds(Recording(3.0, 2.0), None, 4, 8, 1)
    assert asked == [(4, 8)]
    # where tp x dp does not divide the batch (vision at TP 4 x DP 64, batch 64, on 256 GPUs): the collective
    # alone, no layer at TP 1 over 256 ranks
    w, cluster = load_workload("qwen-val"), make_cluster(256)
    graph = build_metagraph(w)
    vision = graph.metaops["vl/vision"]
    assert vision.batch == 64
    assert exposed_sync_seconds(AnalyticCostModel(w, cluster), vision, 4, 64, 2) >= 0.0


def test_weight_sharers_by_level_count_the_levels_that_hold_a_weight():
    """OFASys-7: seven tasks hold the text encoder, whose MetaOps sit at two MetaLevels (after the vision tower
    for the tasks with images, first for the others)."""
    graph = build_metagraph(load_workload("ofasys-7"))
    by_metaop, by_level = weight_sharers(graph), weight_sharers(graph, "level")
    assert by_metaop["caption/lm_encoder"] == 7 and by_level["caption/lm_encoder"] == 2
    levels = {k for k, level in enumerate(graph.levels) for m in level if graph.shares_params(m, "caption/lm_encoder")}
    assert len(levels) == by_level["caption/lm_encoder"]
    assert by_metaop["caption/vision"] == 3 and by_level["caption/vision"] == 1
