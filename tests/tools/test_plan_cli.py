"""tools/plan.py: documented flags, a plan + picture on disk, bad input -> one clear line and exit code 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_plan(*args, cwd=ROOT):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "plan.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_help_documents_every_flag():
    out = run_plan("--help")
    assert out.returncode == 0
    for flag in ["--workload", "--num-gpus", "--gpus-per-node", "--gpu-type", "--cluster", "--spindle-planner",
                 "--spindle-inverse", "--spindle-placement", "--spindle-solver-time-limit",
                 "--spindle-solver-workers", "--spindle-cross-level-overlap", "--spindle-recompute",
                 "--spindle-profile", "--out", "--gantt"]:
        assert flag in out.stdout, flag


def test_plans_tiny_clip_and_writes_json_and_gantt(tmp_path):
    out = run_plan("--workload", "tiny-clip", "--num-gpus", "4", "--gpu-type", "CPU", "--spindle-planner",
                   "wavefront", "--out", str(tmp_path / "plan.json"), "--gantt", str(tmp_path / "plan.png"))
    assert out.returncode == 0, out.stderr
    assert "predicted iteration time" in out.stdout and "C*" in out.stdout and "inter-island" in out.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["format"] == "megatron-spindle-plan" and plan["schema_version"] == 2
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_input_is_one_clear_line_and_nothing_is_overwritten(tmp_path):
    target = tmp_path / "plan.json"
    target.write_text("previous plan")
    bad = tmp_path / "cyclic.yaml"
    bad.write_text("""
name: cyclic
modules:
  a: {kind: encoder, num_layers: 1, hidden_size: 8, num_heads: 2, ffn_hidden_size: 16}
  b: {kind: encoder, num_layers: 1, hidden_size: 8, num_heads: 2, ffn_hidden_size: 16}
tasks:
  - {name: t, batch_size: 2, tokens: {a: 4, b: 4}, flows: [[a, b], [b, a]]}
""")
    out = run_plan("--workload", str(bad), "--num-gpus", "2", "--out", str(target))
    assert out.returncode == 2
    assert f"error: workload {bad}: task 't': flows form a cycle" in out.stderr and "Traceback" not in out.stderr
    assert target.read_text() == "previous plan"
    out = run_plan("--workload", "no-such-workload", "--num-gpus", "2")
    assert out.returncode == 2 and "no built-in workload" in out.stderr
    out = run_plan("--workload", "tiny-clip", "--num-gpus", "12", "--gpus-per-node", "8")
    assert out.returncode == 2 and "not a whole number of 8-GPU nodes" in out.stderr


def test_global_batch_size_plans_the_workload_pretrain_trains(tmp_path):
    """Planned offline with tools/plan.py --tasks T --global-batch-size N, the plan is for exactly the workload
    pretrain_multitask.py trains with the same flags (its --spindle-plan check compares these digests)."""
    from megatron_spindle.graph.workload import load_workload
    from megatron_spindle.training.batch_size import batched_task_set
    from megatron_spindle.training.task_schedule import parse_task_schedule
    from megatron_spindle.training.trainer import build_pretrain_parser

    flags = ["--workload", "tiny-clip", "--tasks", "vision_text,audio_depth", "--global-batch-size", "24"]
    out = run_plan(*flags, "--num-gpus", "2", "--gpu-type", "CPU", "--spindle-planner", "wavefront", "--quiet",
                   "--out", str(tmp_path / "plan.json"))
    assert out.returncode == 0, out.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    # what the trainer computes from the same flags (training/trainer.py main)
    args = build_pretrain_parser("test").parse_args([*flags, "--mock-data", "--train-iters", "1"])
    base = load_workload(args.workload)
    schedule = parse_task_schedule(args.task_schedule, base, args.tasks)
    _, trained = batched_task_set(base, args, schedule.all_tasks(base))
    assert plan["workload_digest"] == trained.digest()
    assert {t.name: t.batch_size for t in trained.tasks} == {"vision_text": 8, "audio_depth": 16}  # 4 : 8, doubled
    bad = run_plan("--workload", "tiny-clip", "--num-gpus", "2", "--global-batch-size", "7")
    assert bad.returncode == 2 and "--global-batch-size 7:" in bad.stderr and "Traceback" not in bad.stderr


def test_attention_backend_is_planned_and_refused_where_it_cannot_run(tmp_path):
    """--attention-backend (Megatron-LM's flag) is recorded in the plan and its summary; a Transformer Engine
    backend for CPUs is one line, exit 2, and the file already there stays."""
    target = tmp_path / "plan.json"
    out = run_plan("--workload", "tiny-clip", "--num-gpus", "8", "--gpu-type", "A800-80GB", "--attention-backend",
                   "local", "--spindle-planner", "wavefront", "--out", str(target))
    assert out.returncode == 0, out.stderr
    assert "attention backend local" in out.stdout
    assert json.loads(target.read_text())["settings"]["attention_backend"] == "local"
    target.write_text("previous plan")
    out = run_plan("--workload", "tiny-clip", "--num-gpus", "2", "--gpu-type", "CPU", "--attention-backend", "fused",
                   "--out", str(target))
    assert out.returncode == 2 and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "--attention-backend fused is a Transformer Engine backend and cannot run on a CPU" in out.stderr
    assert target.read_text() == "previous plan"
