"""Flag and data-path errors of pretrain_multitask.py: one clear line, non-zero exit, before any training."""

import dataclasses
import math
import os
import subprocess
import sys

import pytest

from megatron_spindle.training.log import StepRecord, format_log_line, format_wave_line
from megatron_spindle.training.schedule import LRSchedule, WeightDecaySchedule

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from script_loader import load_script  # noqa: E402

import pretrain_multitask  # noqa: E402

BASE = ["--workload", "tiny-clip", "--train-iters", "2"]


def _fails(capsys, argv, match):
    with pytest.raises(SystemExit) as e:
        pretrain_multitask.main(argv)
    assert e.value.code not in (0, None)
    err = capsys.readouterr().err
    assert match in err, err
    return err


def test_bad_flags_and_values(capsys, tmp_path):
    _fails(capsys, BASE + ["--mock-data", "--no-such-flag"], "unrecognized arguments: --no-such-flag")
    _fails(capsys, BASE + ["--mock-data", "--train-samples", "64"], "--train-samples is Megatron-LM's, not "
           "Spindle's: give --train-iters")
    _fails(capsys, BASE + ["--mock-data", "--lr-decay-style", "exp"], "invalid choice: 'exp'")
    _fails(capsys, BASE + ["--mock-data", "--lr-decay-style", "WSD"], "WSD needs --lr-wsd-decay-iters in [1, 2]")
    _fails(capsys, BASE + ["--mock-data", "--start-weight-decay", "0"], "need --weight-decay-incr-style linear or "
                                                                       "cosine")
    _fails(capsys, BASE + ["--mock-data", "--weight-decay-incr-style", "linear", "--end-weight-decay", "0.1"],
           "needs --start-weight-decay and --end-weight-decay")
    _fails(capsys, BASE + ["--mock-data", "--weight-decay-incr-style", "cosine", "--start-weight-decay", "0",
                           "--end-weight-decay", "2000"], "--lr x the weight decay = 2 >= 1")
    _fails(capsys, ["--workload", "tiny-clip", "--mock-data"], "--train-iters")
    _fails(capsys, BASE + ["--mock-data", "--bf16"], "--bf16 needs a GPU")
    _fails(capsys, BASE, "no training data: give --data-path TASK=PATH")
    _fails(capsys, BASE + ["--mock-data", "--lr", "-1"], "--lr must be positive")
    _fails(capsys, BASE + ["--mock-data", "--min-lr", "1"], "--min-lr must lie in")
    _fails(capsys, BASE + ["--mock-data", "--ddp-bucket-size", "0"], "--ddp-bucket-size must be positive")
    _fails(capsys, BASE + ["--mock-data", "--num-gpus", "4"], "--num-gpus 4 does not match the world size 1")
    _fails(capsys, BASE + ["--mock-data", "--save-interval", "2"], "--save-interval needs --save")
    _fails(capsys, BASE + ["--mock-data", "--task-loss-weights", "vision_text=1,nope=2"],
           "--task-loss-weights: unknown task 'nope'")
    _fails(capsys, BASE + ["--mock-data", "--task-sampling-weights", "vision_text=0"],
           "--task-sampling-weights: value of 'vision_text' must be > 0")
    _fails(capsys, BASE + ["--mock-data", "--task-loss-weights", "vision_text"], "is not TASK=VALUE")
    _fails(capsys, ["--workload", "no-such-workload", "--train-iters", "2", "--mock-data"],
           "no such file and no built-in workload")
    _fails(capsys, BASE + ["--mock-data", "--load", str(tmp_path / "missing")], "--load")
    (tmp_path / "afile").write_text("x")
    _fails(capsys, BASE + ["--mock-data", "--save", str(tmp_path / "afile")], "is a file, not a folder")
    _fails(capsys, BASE + ["--mock-data", "--spindle-plan", str(tmp_path / "plan.json")],
           "--spindle-plan")


def test_bad_data_paths(capsys, tmp_path):
    _fails(capsys, BASE + ["--data-path", f"vision_text={tmp_path / 'nope'}"], "does not exist")
    _fails(capsys, BASE + ["--data-path", "vision_text"], "is not TASK=PATH")
    _fails(capsys, BASE + ["--data-path", f"nope={tmp_path}"], "unknown task 'nope'")
    _fails(capsys, BASE + ["--mock-data", "--data-path", f"vision_text={tmp_path}"], "not both")
    paths = [f"{t}={tmp_path}" for t in ("text_audio", "vision_depth", "vision_text", "audio_depth")]
    _fails(capsys, BASE + sum((["--data-path", p] for p in paths[:2]), []),
           "no --data-path for task(s) ['vision_text', 'audio_depth']")
    _fails(capsys, BASE + sum((["--data-path", p] for p in paths), []), "has no index.json")
    # several after one flag, as Megatron-LM takes them (the same check of every path), and its blend weights
    _fails(capsys, BASE + ["--data-path", *paths[:3], "--data-path", paths[3]], "has no index.json")
    _fails(capsys, BASE + ["--data-path", *paths[:2]], "no --data-path for task(s) ['vision_text', 'audio_depth']")
    _fails(capsys, BASE + ["--data-path", *paths, paths[0]], f"{tmp_path} given twice for task 'text_audio'")
    _fails(capsys, BASE + ["--data-path", "0.5", paths[0]], "'0.5' is not TASK=PATH (a blend of a task's datasets: "
                                                           "TASK=WEIGHT:PATH for each; between tasks: "
                                                           "--task-sampling-weights)")
    # blends: every part weighted, at least two, positive weights
    other = tmp_path / "other"
    other.mkdir()
    _fails(capsys, BASE + ["--data-path", f"text_audio=0.7:{tmp_path}", f"text_audio={other}"],
           "task 'text_audio' has 1 weighted part(s) of 2: a blend gives every part a weight")
    _fails(capsys, BASE + ["--data-path", f"text_audio=0.7:{tmp_path}"], "1 weighted part(s) of 1")
    _fails(capsys, BASE + ["--data-path", f"text_audio=0:{tmp_path}", f"text_audio=1:{other}"],
           f"'text_audio=0:{tmp_path}': a blend weight must be a positive number")
    _fails(capsys, BASE + ["--data-path", f"text_audio=0.5:{tmp_path}", f"text_audio=0.5:{tmp_path}"],
           f"{tmp_path} given twice for task 'text_audio'")


def test_saved_plan_for_another_workload_or_world_size(capsys, tmp_path):
    plan_tool = load_script("tools/plan.py")
    for workload, n in (("tiny-vlm", 1), ("tiny-clip", 2)):
        out = tmp_path / f"{workload}-{n}.json"
        assert plan_tool.main(["--workload", workload, "--num-gpus", str(n), "--spindle-planner", "wavefront",
                               "--out", str(out), "--quiet"]) == 0
    _fails(capsys, BASE + ["--mock-data", "--spindle-plan", str(tmp_path / "tiny-vlm-1.json")],
           "plan was made for workload 'tiny-vlm'")
    _fails(capsys, BASE + ["--mock-data", "--spindle-plan", str(tmp_path / "tiny-clip-2.json")],
           "is for 2 devices, the world size is 1")
    (tmp_path / "bad.json").write_text("{oops")
    _fails(capsys, BASE + ["--mock-data", "--spindle-plan", str(tmp_path / "bad.json")], "not valid JSON")


def test_entry_point_exit_code_in_a_real_process(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_multitask.py"), *BASE, "--data-path",
                        f"vision_text={tmp_path / 'missing'}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "pretrain_multitask.py: error: --data-path:" in r.stderr and "Traceback" not in r.stderr


def test_lr_schedules():
    s = LRSchedule(1.0, 0.1, warmup_iters=2, decay_iters=12, style="cosine")
    assert [s(0), s(1)] == [0.5, 1.0]
    assert s(2) == 1.0 and s(7) == pytest.approx(0.1 + 0.9 * 0.5) and s(12) == pytest.approx(0.1)
    assert s(100) == pytest.approx(0.1)
    lin = LRSchedule(1.0, 0.0, decay_iters=10, style="linear")
    assert lin(5) == pytest.approx(0.5) and lin(10) == 0.0
    assert LRSchedule(0.3, style="constant")(99) == 0.3
    assert all(math.isfinite(LRSchedule(1.0, 0.0, 3, 3, "cosine")(i)) for i in range(6))
    # Megatron-LM's other styles: inverse square root after warmup; WSD holds the peak, then anneals
    inv = LRSchedule(1.0, 0.2, warmup_iters=4, style="inverse-square-root")
    assert [inv(3), inv(15), inv(99), inv(10 ** 6)] == pytest.approx([1.0, 0.5, 0.2, 0.2])
    for shape, half in (("linear", 0.5), ("cosine", 0.5), ("exponential", math.sqrt(2) - 1),
                        ("minus_sqrt", 1 - math.sqrt(0.5))):
        wsd = LRSchedule(1.0, 0.0, warmup_iters=2, decay_iters=20, style="WSD", wsd_decay_iters=8, wsd_style=shape)
        assert [wsd(1), wsd(2), wsd(12)] == [1.0, 1.0, 1.0], shape  # warmup done, stable to iteration 12
        assert wsd(16) == pytest.approx(half) and wsd(20) == pytest.approx(0.0) and wsd(50) == pytest.approx(0.0)
    with pytest.raises(ValueError, match=r"WSD needs --lr-wsd-decay-iters in \[1, 18\]"):
        LRSchedule(1.0, 0.0, warmup_iters=2, decay_iters=20, style="WSD")
    # Megatron-LM's weight-decay increment over the run
    lin = WeightDecaySchedule(0.0, 0.1, "linear", 10)
    assert [lin(0), lin(5), lin(10), lin(40)] == pytest.approx([0.0, 0.05, 0.1, 0.1])
    cos = WeightDecaySchedule(0.02, 0.1, "cosine", 8)
    assert [cos(0), cos(4), cos(8)] == pytest.approx([0.02, 0.06, 0.1]) and cos(2) < 0.04  # slow start


def test_megatron_log_format():
    r = StepRecord(10, 100, 240, 1e-3, {"a": 2.0, "b": 1.0}, {"a": 1.0, "b": 0.5}, 12.5, 2.8, [1.0, 2.25], 24)
    line = format_log_line(r)
    assert " iteration       10/     100 |" in line
    assert "consumed samples:          240 |" in line and "learning rate: 1.000000E-03 |" in line
    assert "total loss: 2.500000E+00 |" in line and "a loss: 2.000000E+00 | b loss: 1.000000E+00 |" in line
    assert "elapsed time per iteration (ms): 12.5 | predicted iteration time (ms): 2.80" in line
    assert format_wave_line(r) == "  measured wave time (ms): w0=1.0 w1=2.2 | busiest rank in all waves 3.2"
    r.busiest_waves_ms = 3.0  # two ranks: each wave's time is the slower rank's, the total is one rank's
    assert format_wave_line(r) == "  measured wave time (ms): w0=1.0 w1=2.2 | busiest rank in all waves 3.0"


def test_saved_plan_runs_at_zero_stage_2(capsys, tmp_path):
    """A plan whose settings say zero_stage 2 (gradients sharded like the optimizer state) trains through
    pretrain_multitask.py as its zero_stage 0 copy does: same losses and gradient norms (--clip-grad's default
    1.0 measures them), the same weights, and the checkpoint records the plan it ran."""
    from megatron_spindle.checkpointing import load_checkpoint
    from megatron_spindle.plan.schema import Plan

    path = tmp_path / "plan0.json"
    assert load_script("tools/plan.py").main(["--workload", "tiny-clip", "--num-gpus", "1", "--spindle-planner",
                                              "wavefront", "--out", str(path), "--quiet"]) == 0
    plan = Plan.load(path)
    assert plan.settings.zero_stage == 0
    plan.settings = dataclasses.replace(plan.settings, zero_stage=2)
    plan.save(tmp_path / "plan2.json")
    runs = {}
    for stage in (0, 2):
        hist = []
        assert pretrain_multitask.main(BASE + ["--mock-data", "--log-interval", "1", "--spindle-plan",
                                               str(tmp_path / f"plan{stage}.json"), "--save",
                                               str(tmp_path / f"ck{stage}")], history=hist) == 0
        runs[stage] = (hist, load_checkpoint(tmp_path / f"ck{stage}"))
    capsys.readouterr()
    (h0, ck0), (h2, ck2) = runs[0], runs[2]
    assert ck2.plan["settings"]["zero_stage"] == 2 and ck0.plan["settings"]["zero_stage"] == 0
    for a, b in zip(h0, h2, strict=True):
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5) and b.grad_norm is not None
        assert all(a.losses[t] == pytest.approx(b.losses[t], rel=1e-5) for t in a.losses)
    w0 = {k: v for st in ck0.units.values() for k, v in st.model.items()}
    w2 = {k: v for st in ck2.units.values() for k, v in st.model.items()}
    assert sorted(w0) == sorted(w2)
    assert max(float((w0[k] - w2[k]).abs().max()) for k in w0) <= 1e-6


def test_an_analytic_gpu_plan_without_transformer_engine_says_what_the_runtime_runs(capsys):
    """Planned for a GPU type on the analytic model where TE is missing (the runtime then runs megatron-core's
    local spec, which the model does not describe), the plan log says so and points to --spindle-profile; the
    CPU type's plans say instead that their numbers are placeholders, unless planned on a profile."""
    from megatron_spindle.compat.cpu import te_available
    from megatron_spindle.graph.workload import load_workload
    from megatron_spindle.training.trainer import (
        CPU_PLACEHOLDER_NOTE,
        LOCAL_SPEC_NOTE,
        build_pretrain_parser,
        get_plan,
    )

    assert not te_available()  # CI has no GPU
    workload = load_workload("tiny-clip")
    for gpu_type, noted in (("A800-80GB", True), ("CPU", False)):
        args = build_pretrain_parser("test").parse_args(BASE + ["--mock-data", "--gpu-type", gpu_type,
                                                                "--spindle-planner", "wavefront"])
        plan = get_plan(args, workload, 1, 0)
        out = capsys.readouterr().out
        assert (LOCAL_SPEC_NOTE in out) == noted, gpu_type
        assert (CPU_PLACEHOLDER_NOTE in out) == (not noted), gpu_type
        assert plan.settings.attention_backend == "local", gpu_type  # what runs here, charged as such


def test_the_plan_charges_the_gradient_norm_only_where_the_step_computes_it():
    """--clip-grad 0 (no fp16 loss scaling): the runtime's optimizer step computes no gradient norm, and the plan
    charges none (4 of the analytic step's 38 bytes per master element in bf16) and records it."""
    from megatron_spindle.estimator.cost_model import CostModelConfig, optimizer_step_bytes
    from megatron_spindle.graph.workload import load_workload
    from megatron_spindle.training.trainer import build_pretrain_parser, get_plan

    workload = load_workload("tiny-clip")
    optimizer = {}
    for clip in ("1.0", "0"):
        args = build_pretrain_parser("test").parse_args(BASE + ["--mock-data", "--gpu-type", "A800-80GB",
                                                                "--spindle-planner", "wavefront", "--clip-grad", clip])
        plan = get_plan(args, workload, 1, 0)
        assert plan.settings.grad_norm == (clip != "0")  # recorded: the simulator charges what was planned
        optimizer[clip] = plan.predicted["simulated_optimizer"]
    clipped, unclipped = optimizer_step_bytes(CostModelConfig(), 2), optimizer_step_bytes(
        CostModelConfig(grad_norm=False), 2)
    assert (clipped, unclipped) == (38, 34)
    assert optimizer["0"] == pytest.approx(optimizer["1.0"] * unclipped / clipped)


def test_a_saved_plan_charged_for_te_attention_says_what_runs_here(tmp_path, capsys, monkeypatch):
    """--spindle-plan of a plan made for a GPU type with TE assumed (attention backend auto), loaded on a GPU where
    TE is missing: one note says that the local spec runs, slower than planned; a plan recording local says
    nothing, and neither does a CPU run (the local spec is all a CPU runs)."""
    import torch

    from megatron_spindle.graph.cluster import make_cluster
    from megatron_spindle.graph.workload import load_workload
    from megatron_spindle.planner.pipeline import PlannerConfig, make_plan
    from megatron_spindle.training.trainer import SAVED_PLAN_LOCAL_SPEC_NOTE, build_pretrain_parser, get_plan

    workload = load_workload("tiny-clip")
    for gpu, backend, noted in ((True, "auto", True), (True, "local", False), (False, "auto", False)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda gpu=gpu: gpu)  # te_available() stays False here
        plan = make_plan(workload, make_cluster(1, 1, "A800-80GB"),
                         PlannerConfig(planner="wavefront", select="none", attention_backend=backend))
        assert plan.settings.attention_backend == backend
        plan.save(tmp_path / f"{backend}.json")
        args = build_pretrain_parser("test").parse_args(BASE + ["--mock-data",
                                                                "--spindle-plan", str(tmp_path / f"{backend}.json")])
        capsys.readouterr()
        get_plan(args, workload, 1, 0)
        assert (SAVED_PLAN_LOCAL_SPEC_NOTE in capsys.readouterr().out) == noted, (gpu, backend)


def test_a_saved_plan_charged_for_another_gradient_norm_says_so(tmp_path, capsys):
    """--spindle-plan of a plan made with the norm charged (the default --clip-grad 1.0) run with --clip-grad 0, and
    the reverse: one note each; the same setting on both sides says nothing."""
    from megatron_spindle.graph.cluster import make_cluster
    from megatron_spindle.graph.workload import load_workload
    from megatron_spindle.planner.pipeline import PlannerConfig, make_plan
    from megatron_spindle.training.trainer import build_pretrain_parser, get_plan

    workload = load_workload("tiny-clip")
    for planned in (True, False):
        plan = make_plan(workload, make_cluster(1, 1, "A800-80GB"),
                         PlannerConfig(planner="wavefront", select="none", grad_norm=planned))
        plan.save(tmp_path / "plan.json")
        for clip, noted in (("1.0", not planned), ("0", planned)):
            args = build_pretrain_parser("test").parse_args(BASE + ["--mock-data", "--clip-grad", clip,
                                                                    "--spindle-plan", str(tmp_path / "plan.json")])
            capsys.readouterr()
            get_plan(args, workload, 1, 0)
            out = capsys.readouterr().out
            assert ("gradient norm" in out) == noted, (planned, clip, out)
            if noted:
                assert f"charged {'with' if planned else 'without'} the optimizer step's gradient norm" in out
                assert f"--clip-grad {float(clip):g}" in out


def test_a_transformer_engine_attention_backend_without_te_is_refused_before_planning():
    """pretrain_multitask.py --attention-backend flash where Transformer Engine is missing: the plan would charge
    kernels this machine cannot run, so it stops with one line naming the flag."""
    from megatron_spindle.graph.workload import load_workload
    from megatron_spindle.plan.schema import PlanError
    from megatron_spindle.training.trainer import build_pretrain_parser, get_plan

    for gpu_type, where in (("A800-80GB", "this machine, where Transformer Engine is not available"),
                            ("CPU", "a CPU")):
        args = build_pretrain_parser("test").parse_args(BASE + ["--mock-data", "--gpu-type", gpu_type,
                                                                "--attention-backend", "flash"])
        with pytest.raises(PlanError, match=f"--attention-backend flash is a Transformer Engine backend and cannot "
                                            f"run on {where}"):
            get_plan(args, load_workload("tiny-clip"), 1, 0)


def test_wave_timer_gives_the_busiest_rank_not_the_sum_of_per_wave_maxima(monkeypatch):
    """Rank a is slow in wave 0, rank b in wave 1: each wave's time is the slower rank's (3.0, 2.5), but no rank
    spent their sum 5.5 in the waves; the busiest spent 4.0."""
    from types import SimpleNamespace

    import torch

    from megatron_spindle.training import engine_state

    engine = SimpleNamespace(plan=SimpleNamespace(waves=[0, 1]), on_wave=None)
    a, b = engine_state.WaveTimer(engine), engine_state.WaveTimer(engine)
    a.record("forward", 0, 2.0)
    a.record("backward", 0, 1.0)
    a.record("backward", 1, 1.0)
    b.record("forward", 1, 2.5)
    b.record("backward", 0, 0.5)
    assert b.collect() == [0.5, 2.5] and b.busiest == 3.0  # one process: its own
    theirs = torch.tensor([0.5, 2.5, 0.0, 2.5, 0.5, 0.0, 3.0], dtype=torch.float64)  # b's vector
    monkeypatch.setattr(engine_state, "over_ranks", lambda v, op="max": torch.maximum(v, theirs))
    assert a.collect() == [3.0, 2.5] and a.busiest == 4.0
    assert a.phases == ([2.0, 2.5], [1.0, 1.0])
