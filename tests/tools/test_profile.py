"""tools/profile_metaops.py and megatron_spindle/profiler: profiling on CPU with 1 rank (in-process) and 2 gloo ranks
(torchrun), fitted curves against the measured points, planning from a profile, the cache, and the GPU
script's CPU dry run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from script_loader import load_script

from megatron_spindle.estimator import estimate_curves
from megatron_spindle.estimator.profile import load_profile_points
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.plan.validate import validate_plan
from megatron_spindle.planner.pipeline import PlannerConfig, make_plan
from megatron_spindle.planner.report import plan_summary

ROOT = Path(__file__).resolve().parents[2]
TASKS = "text_audio"  # one task of tiny-clip: 7 MetaOps, keeps every run small
FAST = ["--profile-layers", "1", "--profile-warmup", "1", "--profile-repeats", "2"]


def _workload():
    return load_workload("tiny-clip").subset([TASKS])


def _check_curves_and_plan(path: Path, cluster) -> dict:
    """The fit reproduces every measured point within the reported error; the planner makes a valid plan
    whose MetaOps report the curve source and fit error of these curves."""
    workload = _workload()
    points = load_profile_points(path, workload, cluster)
    graph = build_metagraph(workload)
    assert set(points) == set(graph.metaops)  # every MetaOp measured (same-shape ones share points)
    curves = estimate_curves(graph, workload, cluster, profile=points)
    for mid, curve in curves.items():
        assert curve.source == "profiled"
        measured = {(p.tp, p.dp): p.seconds for p in points[mid]}
        for n, p in curve.points.items():
            if p.source == "profiled":
                assert measured[(p.tp, p.dp)] == p.seconds
                assert abs(curve.fitted(n) - p.seconds) / p.seconds <= curve.fit_error + 1e-9
        assert curve.fit_error >= 0
    plan = make_plan(workload, cluster, PlannerConfig(planner="wavefront"), profile=points)
    validate_plan(plan, workload, cluster, graph)
    for m in plan.metaops:
        assert m.curve_source == "profiled"
        assert m.curve_fit_error == pytest.approx(curves[m.id].fit_error)
    assert "profiled (" in plan_summary(plan)
    return curves


def _check_planning_on_the_whole_profile(path: Path, cluster) -> None:
    """Planned with the whole profile (``--spindle-profile``), the planner times its candidates on the measured
    operators and AdamW step: its estimate is the profiled model's, and the selected plan's predicted time is
    the simulator's on that model."""
    from megatron_spindle.autoplan import autoplan
    from megatron_spindle.estimator import AnalyticCostModel, ProfiledCostModel
    from megatron_spindle.estimator.profiled import load_planning_profile, profile_summary
    from megatron_spindle.planner.objective import estimate_iteration
    from megatron_spindle.planner.pipeline import plan_workload
    from megatron_spindle.simulator import simulate

    workload, graph = _workload(), build_metagraph(_workload())
    profile, measured = load_planning_profile(path, workload, cluster)
    summary = profile_summary(profile, measured)  # what tools/plan.py prints
    assert (f"{len(profile.measurements)} measured configurations (with the sharded runtime's copies); the AdamW "
            f"step") in summary
    assert ("links:" in summary) == any(profile.bandwidth.values())
    result = plan_workload(workload, measured, PlannerConfig(planner="wavefront"), profile)
    assert isinstance(result.cost_model, ProfiledCostModel)
    timed = ProfiledCostModel(workload, measured, profile.measurements, optimizer=profile.optimizer)
    estimate = estimate_iteration(result.plan, graph, measured, timed).total
    assert result.plan.predicted["planner_estimate"] == pytest.approx(estimate)
    assert estimate != pytest.approx(estimate_iteration(result.plan, graph, measured,
                                                        AnalyticCostModel(workload, measured)).total)
    plan = autoplan(workload, measured, PlannerConfig(planner="wavefront"), profile=profile).plan
    assert plan.predicted["iteration_time"] == pytest.approx(simulate(plan, workload, measured, timed).iteration_time)


def _check_no_placeholder_note(path: Path, capsys) -> None:
    """pretrain_multitask.py planning on the profile for the CPU type: measured numbers, so no note that the CPU
    type's are placeholders."""
    from megatron_spindle.training.trainer import CPU_PLACEHOLDER_NOTE, build_pretrain_parser, get_plan

    capsys.readouterr()
    args = build_pretrain_parser("test").parse_args([
        "--workload", "tiny-clip", "--tasks", TASKS, "--train-iters", "2", "--mock-data", "--gpu-type", "CPU",
        "--num-gpus", "4", "--gpus-per-node", "4", "--spindle-planner", "wavefront", "--spindle-profile", str(path)])
    get_plan(args, _workload(), 1, 0)
    out = capsys.readouterr().out
    assert "[plan] done" in out and CPU_PLACEHOLDER_NOTE not in out


def test_one_rank_profile_plans_and_is_cached(tmp_path, capsys, monkeypatch, one_thread):
    tool = load_script("tools/profile_metaops.py")
    out, cache = tmp_path / "tiny.profile.json", tmp_path / "cache"
    argv = ["--workload", "tiny-clip", "--tasks", TASKS, "--num-gpus", "4", "--gpus-per-node", "4",
            "--out", str(out), "--profile-cache-dir", str(cache), *FAST]
    assert tool.main(argv) == 0
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["format"] == "megatron-spindle-profile" and doc["version"] == 1 and doc["gpu"] == "CPU"
    assert doc["versions"]["torch"] and doc["versions"]["megatron-core"] == "0.16.1"
    assert doc["hardware"]["world_size"] == 1 and doc["hardware"]["device"]["type"] == "cpu"
    assert doc["settings"]["attention_backend"] == "local"  # auto on a CPU: what was measured
    assert doc["bandwidth"] == {"intra_node": None, "inter_node": None}  # one rank: nothing to measure
    opt = doc["optimizer"]  # the measured AdamW step, and apart its gradient norm (fp32 here: no weights' write)
    assert opt["source"] == "measured" and opt["seconds_per_element"] > 0 and opt["seconds_per_tensor"] > 0
    assert opt["norm_seconds_per_element"] > 0 and opt["weight_seconds_per_element"] == 0.0
    # one progress line per measured MetaOp group and config: 7 MetaOps, none share a shape, dp in {1, 2, 4}
    assert printed.count("[profile] [") == len(doc["measurements"]) == 7 * 3
    assert all(m["tp"] == 1 for m in doc["measurements"])
    # the forward is timed alone too (the phases' split): part of the compute
    assert all(0 < m["forward_seconds"] <= m["compute_seconds"] for m in doc["measurements"])
    # the sharded runtime's host copies of every operator with weights (the contrastive loss has none)
    copies = {m["metaop"]: m["shard_load_seconds"] > 0 and m["shard_grad_seconds"] > 0 for m in doc["measurements"]}
    assert [mid for mid, copied in copies.items() if not copied] == ["text_audio/loss"], copies
    sources = {(m["dp"], m["dp_comm_source"]) for m in doc["measurements"] if m["metaop"] == "text_audio/audio"}
    assert sources == {(1, "none"), (2, "nominal"), (4, "nominal")}  # no second rank: the cluster's links
    # TP > 1 needs ranks: left to the analytic model, and said so
    assert doc["unmeasured"]["text_audio/audio"] == [[2, 1], [2, 2], [4, 1]]
    assert "left to the analytic model" in printed
    cluster = make_cluster(4, 4, "CPU")
    curves = _check_curves_and_plan(out, cluster)
    assert {p.source for p in curves["text_audio/audio"].points.values()} == {"profiled"}  # tp=1 wins per n
    cached = list((cache / "profiles").glob("*.json"))
    assert len(cached) == 1 and cached[0].name.endswith(f"-{doc['profile_key']}.json")  # keyed by what it measured
    _check_planning_on_the_whole_profile(out, cluster)
    _check_no_placeholder_note(out, capsys)

    # second run with the same key: read from the cache, nothing measured
    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again despite the cache")

    from megatron_spindle import profiler

    monkeypatch.setattr(profiler, "run_profile", no_measuring)
    out2 = tmp_path / "again.json"
    assert tool.main([*argv[:-len(FAST) - 4], "--out", str(out2), "--profile-cache-dir", str(cache), *FAST]) == 0
    assert "cache hit" in capsys.readouterr().out
    assert json.loads(out2.read_text()) == doc
    # other settings are another key, and --force measures again
    with pytest.raises(AssertionError, match="measured again"):
        tool.main([*argv, "--force"])
    with pytest.raises(AssertionError, match="measured again"):
        tool.main([*argv[:-1], "3"])  # --profile-repeats 3


@pytest.mark.multiproc
def test_two_gloo_ranks_under_torchrun(tmp_path):
    out = tmp_path / "two.profile.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tools" / "profile_metaops.py"), "--workload", "tiny-clip", "--tasks", TASKS, "--num-gpus", "2",
           "--out", str(out), "--no-profile-cache", *FAST]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["hardware"]["world_size"] == 2 and doc["hardware"]["backend"] == "gloo"
    link = doc["bandwidth"]["intra_node"]
    assert link["p2p_bytes_per_s"] > 0 and link["allreduce_bus_bytes_per_s"] > 0
    assert link["allreduce_ranks"] == [0, 1] and doc["bandwidth"]["inter_node"] is None
    # what a message costs the ranks' compute, and compute beside an all-reduce: measured (about 2 on one core each)
    assert link["message_host_s"] >= 0 and link["overlap_slowdown"] >= 1 and link["p2p_latency_s"] > 0
    assert link["overlap_latency_s"] >= 0
    # the message probe computed with the workload's lightest layer between its messages
    assert link["message_probe_compute"] == "text_audio/text (one layer, forward and backward)"
    configs = {(m["metaop"], m["tp"], m["dp"]): m for m in doc["measurements"]}
    # tp=2 runs on a real 2-rank TP group; the DP all-reduce of dp=2 is timed on a real dp group
    assert ("text_audio/audio", 2, 1) in configs and ("text_audio/text", 2, 1) in configs
    assert configs[("text_audio/audio", 1, 2)]["dp_comm_source"] == "measured"
    assert configs[("text_audio/audio", 1, 2)]["dp_comm_seconds"] > 0
    assert configs[("text_audio/loss", 1, 2)]["dp_comm_source"] == "bandwidth"  # no weights: all-gather model
    assert not doc["unmeasured"]  # every valid config of a 2-device cluster fits 2 ranks
    _check_curves_and_plan(out, make_cluster(2, 2, "CPU"))
    _check_planning_on_the_whole_profile(out, make_cluster(2, 2, "CPU"))


def test_operator_phases_are_timed_in_the_same_repeats():
    """The forward is timed inside the forward + backward repeats (each forward after the previous repeat's
    backward, as in training), not in a separate forward-alone loop: every forward has its backward, and the
    forward's median is part of the step's."""
    import torch

    from megatron_spindle.profiler import ProfileWorld
    from megatron_spindle.profiler.operators import time_operator

    calls = []

    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))

        def forward(self, inputs, batch):
            calls.append("forward")
            out = inputs[0] * self.w
            out.register_hook(lambda g: calls.append("backward"))
            return out

    total, forward = time_operator(Counting(), [torch.ones(2, 4)], None, ProfileWorld(), warmup=2, repeats=3)
    assert calls == ["forward", "backward"] * 5
    assert 0 < forward <= total


def test_a_gpu_is_busied_before_each_config_is_timed(monkeypatch):
    """On a GPU, a fixed burst of matmuls runs (and is waited for) after the config is built and before its
    warm-up and timed repeats; on a CPU none."""
    import torch

    from megatron_spindle.graph.opgraph import build_metagraph
    from megatron_spindle.models.operator import metaop_infos
    from megatron_spindle.profiler import ProfileWorld, operators, world
    from megatron_spindle.profiler.settings import ProfilerSettings

    events = []
    monkeypatch.setattr(world.torch, "mm", lambda a, b: events.append("mm"))
    monkeypatch.setattr(world.torch, "randn", lambda *a, **k: torch.zeros(1))
    monkeypatch.setattr(ProfileWorld, "sync", lambda self: events.append("sync"))
    monkeypatch.setattr(operators, "time_operator", lambda *a, **k: events.append("timed") or (1.0, 0.5))
    w = load_workload("tiny-clip")
    info = next(i for i in metaop_infos(w).values() if i.kind == "layer")
    metaop = build_metagraph(w).metaops[info.id]
    gpu = ProfileWorld(device=torch.device("cuda", 0))
    monkeypatch.setattr(operators, "_build", lambda *a, **k: (torch.nn.Linear(2, 2), [], None))
    monkeypatch.setattr(operators, "time_sharded_copies", lambda *a, **k: (0.0, 0.0))
    operators.measure_config(w, info, metaop, 1, 1, gpu, ProfilerSettings())
    assert events == ["mm"] * world.DEVICE_WARMUP_MATMULS + ["sync", "timed"]
    events.clear()
    operators.measure_config(w, info, metaop, 1, 1, ProfileWorld(), ProfilerSettings())
    assert events == ["timed"]


def test_optimizer_probe_steps_tensors_of_the_workloads_units():
    """AdamW's cost per element is timed on tensors of the workload's unit sizes (the runtime's flat masters), the
    largest first within the probe's budget; a unit above the budget is timed at the budget."""
    from megatron_spindle.estimator.cost_model import AnalyticCostModel
    from megatron_spindle.graph.task_sets import workload_units
    from megatron_spindle.profiler.operators import (
        OPTIMIZER_PROBE_ELEMENTS,
        OPTIMIZER_PROBE_MAX_ELEMENTS,
        probe_sizes,
    )

    assert probe_sizes([]) == [OPTIMIZER_PROBE_ELEMENTS]
    assert probe_sizes([0, 300, 5000, 300]) == [5000, 300, 300]
    big = OPTIMIZER_PROBE_MAX_ELEMENTS
    assert probe_sizes([big // 2, big // 2, big // 4]) == [big // 2, big // 2]
    assert probe_sizes([3 * big, 10]) == [big]
    w = load_workload("tiny-clip")
    counts = [AnalyticCostModel(w, make_cluster(1, 1, "CPU")).param_count(u) for u in workload_units(w)]
    assert sorted(probe_sizes(counts)) == sorted(counts)  # tiny-clip's 18 units fit the budget whole


def test_message_probe_computes_with_the_lightest_layer(one_thread):
    """On two or more CPU ranks the message-cost probe runs the workload's lightest layer MetaOp (fewest analytic
    FLOPs), one layer forward and backward, between its messages; nothing on one rank or on a GPU."""
    import torch

    from megatron_spindle.compat.cpu import apply_cpu_shim
    from megatron_spindle.estimator.cost_model import AnalyticCostModel
    from megatron_spindle.models.operator import metaop_infos
    from megatron_spindle.profiler import ProfilerSettings, ProfileWorld
    from megatron_spindle.profiler.run import _message_probe_chunk

    apply_cpu_shim()
    w = load_workload("tiny-clip")
    g, infos = build_metagraph(w), metaop_infos(w)
    flops = AnalyticCostModel(w, make_cluster(2, 2, "CPU"))
    layer_flops = {mid: flops.flops(m) for mid, m in g.metaops.items() if m.kind == "layer"}
    lightest = min(layer_flops, key=lambda mid: (layer_flops[mid], mid))
    assert layer_flops[lightest] < max(layer_flops.values())  # a real choice: the towers differ
    settings = ProfilerSettings(layers=1, warmup=0, repeats=1)
    chunk = _message_probe_chunk(w, g, infos, ProfileWorld(0, 2, 2), settings, flops)
    assert chunk.name == f"{lightest} (one layer, forward and backward)"
    chunk.run()
    chunk.run()  # the probe runs it again and again
    assert _message_probe_chunk(w, g, infos, ProfileWorld(0, 1, 1), settings, flops) is None
    assert _message_probe_chunk(w, g, infos, ProfileWorld(0, 2, 2, torch.device("cuda")), settings, flops) is None


def test_grouping_configs_and_cost_model():
    from megatron_spindle.estimator import Measurement, ProfiledCostModel, cluster_with_bandwidth
    from megatron_spindle.profiler import (
        ProfilerSettings,
        ProfileWorld,
        group_metaops,
        profile_configs,
        profile_key,
    )

    workload = load_workload("tiny-clip")
    groups = group_metaops(workload)
    assert ["vision_depth/vision", "vision_text/vision"] in groups  # same module, kind, input shape
    assert ["text_audio/text"] in groups and ["vision_text/text"] in groups  # other batch: other shape
    assert group_metaops(workload, ["*/vision"]) == [["vision_depth/vision", "vision_text/vision"]]
    graph, cluster = build_metagraph(workload), make_cluster(8, 8, "CPU")
    audio = graph.metaops["text_audio/audio"]
    two = ProfileWorld(0, 2, 2)
    measured, left = profile_configs(audio, workload, cluster, two, ProfilerSettings())
    assert measured == [(1, 1), (1, 2), (2, 1), (1, 4), (2, 2), (1, 8), (2, 4)]
    assert left == [(4, 1), (4, 2)]
    measured, left = profile_configs(audio, workload, cluster, two, ProfilerSettings(max_n=2))
    assert max(tp * dp for tp, dp in measured) == 2 and (1, 4) in left
    hw = {"device": "x"}
    key = profile_key(workload, cluster, hw, {"torch": "1"}, ProfilerSettings())
    assert key == profile_key(workload, cluster, hw, {"torch": "1"}, ProfilerSettings())
    assert key != profile_key(workload, cluster, hw, {"torch": "2"}, ProfilerSettings())
    assert key != profile_key(workload, cluster, {"device": "y"}, {"torch": "1"}, ProfilerSettings())
    assert key != profile_key(workload.subset(["text_audio"]), cluster, hw, {"torch": "1"}, ProfilerSettings())
    link = {"allreduce_bus_bytes_per_s": 2e9, "allreduce_latency_s": 1e-4}
    fast = cluster_with_bandwidth(cluster, {"intra_node": link, "inter_node": None})
    assert fast.intra_node_bw == 2e9 and fast.intra_node_latency == 1e-4
    assert fast.inter_node_bw == cluster.inter_node_bw
    # the comm model's constants from the measured links: small all-reduce = one collective's latency
    full = {"allreduce_bus_bytes_per_s": 2e9, "allreduce_latency_s": 1e-4, "p2p_bytes_per_s": 3e9,
            "allreduce_seconds": {"1024": 5e-4, "1048576": 2e-3}, "p2p_latency_s": 7e-5, "message_host_s": 4e-5,
            "overlap_slowdown": 2.0}
    across = dict(full, p2p_bytes_per_s=1e9, p2p_latency_s=9e-5, message_host_s=6e-5, overlap_slowdown=1.5,
                  overlap_latency_s=3e-3)
    measured = cluster_with_bandwidth(cluster, {"intra_node": full, "inter_node": across})
    assert (measured.collective_latency, measured.intra_node_p2p_bw) == (5e-4, 3e9)
    assert (measured.network_latency, measured.network_rail_bw, measured.inter_node_bw) == (5e-4, 1e9, 2e9)
    # a small message's latency inside the node; per message and overlap, the costlier link's
    assert (measured.p2p_latency, measured.message_host_seconds, measured.overlap_slowdown) == (7e-5, 6e-5, 2.0)
    assert measured.overlap_latency == 3e-3
    assert fast.message_host_seconds == 0.0 and fast.overlap_slowdown == 0.0  # older profiles: not measured
    assert fast.overlap_latency == 0.0
    meas = Measurement("text_audio/audio", ["text_audio/audio", "audio_depth/audio"], 1, 2, 1, 0.01, 0.002,
                       "measured", 1e6)
    model = ProfiledCostModel(workload, cluster, [meas])
    lc = model.layer_cost(graph.metaops["audio_depth/audio"], 1, 2)
    assert (lc.compute, lc.dp_sync, lc.total) == (0.01, 0.002, 0.012)
    # the optimizer step: analytic from the memory bandwidth unless the profile measured it (older ones did not)
    from megatron_spindle.estimator import AnalyticCostModel, OptimizerCost, optimizer_cost_from_dict

    assert model.optimizer_cost() == AnalyticCostModel(workload, cluster).optimizer_cost()
    assert optimizer_cost_from_dict({"format": "megatron-spindle-profile", "points": {}}) is None
    measured_opt = optimizer_cost_from_dict({"optimizer": {"seconds_per_element": 2e-9, "seconds_per_tensor": 1e-5}})
    assert measured_opt == OptimizerCost(2e-9, 1e-5, "measured")
    timed = ProfiledCostModel(workload, cluster, [meas], optimizer=measured_opt)
    assert timed.optimizer_seconds(1_000_000, 10) == pytest.approx(2e-3 + 1e-4)
    assert timed.optimizer_seconds(0, 10) == 0.0
    # the step's other passes, measured apart: the bf16 weights' write always, the gradient norm where the step
    # computes one (CostModelConfig.grad_norm: clipping or loss scaling)
    from megatron_spindle.estimator import CostModelConfig

    parts = {"seconds_per_element": 2e-9, "seconds_per_tensor": 1e-5, "norm_seconds_per_element": 5e-10,
             "weight_seconds_per_element": 3e-10}
    whole = optimizer_cost_from_dict({"optimizer": parts})
    assert optimizer_cost_from_dict({"optimizer": whole.to_dict()}) == whole
    clipping = ProfiledCostModel(workload, cluster, [meas], optimizer=whole)
    unclipped = ProfiledCostModel(workload, cluster, [meas], optimizer=whole, config=CostModelConfig(grad_norm=False))
    assert clipping.optimizer_seconds(1_000_000, 10) == pytest.approx(2.8e-3 + 1e-4)
    assert unclipped.optimizer_seconds(1_000_000, 10) == pytest.approx(2.3e-3 + 1e-4)
    # unmeasured configs: the analytic model scaled to the measured level of the MetaOp

    base = AnalyticCostModel(workload, cluster)
    scale = 0.01 / base.layer_cost(audio, 1, 2).step  # measured / modelled forward + backward (T(n): no grad sync)
    assert model.layer_cost(audio, 1, 4).step == pytest.approx(scale * base.layer_cost(audio, 1, 4).step)
    fwd, bwd = model.phase_seconds(audio, 1, 2)  # measured compute, split like the analytic model
    afwd, abwd = base.phase_seconds(audio, 1, 2)
    assert fwd + bwd == pytest.approx(0.01) and fwd / bwd == pytest.approx(afwd / abwd)
    # extra sections of a profile file may not replace the format's own keys
    from megatron_spindle.estimator import EstimatorError
    from megatron_spindle.estimator.profile import profile_to_dict

    with pytest.raises(EstimatorError, match="may not replace"):
        profile_to_dict(workload, cluster, {}, extra={"points": {}})


def test_gpu_script_dry_run_on_cpu(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               MEGATRON_SPINDLE_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_profile.sh"), "--device", "cpu",
                           "--out-dir", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "TFLOP/s" in proc.stdout
    doc = json.loads((tmp_path / "gpu_profile.json").read_text())
    kinds = {m["metaop"] for m in doc["measurements"]}
    assert len(kinds) == 2  # one encoder MetaOp and the LLM MetaOp
    assert all(m["flops"] > 0 and m["compute_seconds"] > 0 for m in doc["measurements"])


def test_overlap_fit_is_each_trials_fit_and_leaves_out_trials_the_model_cannot_hold():
    """overlap_constants' numbers: compute beside the collective runs ``slowdown`` times slower, so a trial where
    the collective ends first (Tx < Tc) progressed Tx + C - Tc seconds of compute in Tx. A trial whose compute
    lost more than the whole window (a noisy neighbour) is left out instead of making an unbounded factor."""
    from megatron_spindle.profiler.comm import overlap_fit

    ms = 1e-3
    # C 20, X 2, Tc 21, Tx 5: progressed 4 in 5 -> x1.25, latency 5 - 1.25 * 2 = 2.5
    assert overlap_fit([(20 * ms, 2 * ms, 21 * ms, 5 * ms)]) == pytest.approx((1.25, 2.5 * ms))
    noisy = (20 * ms, 2 * ms, 26 * ms, 5 * ms)  # lost 6 ms in a 5 ms window
    fits = [(20 * ms, 2 * ms, 21 * ms, 5 * ms), (20 * ms, 2 * ms, 20.5 * ms, 5 * ms), noisy]
    slowdown, latency = overlap_fit(fits)
    assert slowdown == pytest.approx((1.25 + 5 / 4.5) / 2) and latency < 5 * ms  # the median of the two that fit
    assert overlap_fit([noisy]) == (0.0, 0.0)  # nothing fits: not measured (C10's factor applies)
    # the compute ends first (Tc 22 < Tx 30): slowed x1.1 throughout
    slowdown, latency = overlap_fit([(20 * ms, 10 * ms, 22 * ms, 30 * ms)])
    assert slowdown == pytest.approx(1.1) and 0 <= latency <= 30 * ms


def test_the_latency_probe_times_the_smallest_message_more_often(monkeypatch):
    """A small message's time is heavy-tailed on a shared CPU: the smallest size (the latency) gets a median of
    LATENCY_PROBE_REPEATS runs, the others the profile's repeats; the latencies come from the smallest size."""
    from types import SimpleNamespace

    from megatron_spindle.profiler import comm

    calls = []
    monkeypatch.setattr(comm, "_p2p_seconds", lambda w, a, b, n, r: calls.append(("p2p", n, r)) or n * 1e-9 + 1e-5)
    monkeypatch.setattr(comm, "_allreduce_seconds",
                        lambda w, ranks, n, r, g: calls.append(("ar", n, r)) or n * 2e-9 + 2e-5)
    monkeypatch.setattr(comm, "overlap_constants", lambda w, ranks: (1.1, 0.0))
    monkeypatch.setattr(comm, "message_host_seconds", lambda *a, **k: 0.0)
    world = SimpleNamespace(group=lambda ranks: None)
    link = comm._measure_link(world, 1, [0, 1], [1 << 20, 4], 5, None)
    assert sorted(calls) == [("ar", 4, comm.LATENCY_PROBE_REPEATS), ("ar", 1 << 20, 5),
                             ("p2p", 4, comm.LATENCY_PROBE_REPEATS), ("p2p", 1 << 20, 5)]
    assert comm.LATENCY_PROBE_REPEATS >= 21
    assert link["p2p_latency_s"] == pytest.approx(4e-9 + 1e-5)
    assert link["allreduce_latency_s"] == pytest.approx((8e-9 + 2e-5) / 2)
