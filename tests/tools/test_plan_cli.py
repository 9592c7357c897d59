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
