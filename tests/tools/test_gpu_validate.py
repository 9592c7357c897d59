"""benchmarks/gpu_validate.sh: the CPU dry run goes through every step the GPU run takes (no timing asserted)."""

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_validate_dry_run_measures_and_estimates_every_point(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path / "out")}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_validate.sh"), "--dry-run"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "out" / "gpu_validate.json").read_text())  # $OUT wins over the default
    assert doc["meta"]["dry_run"] and doc["meta"]["gpu_type"] == "CPU" and not doc["skipped"]
    names = [p["point"] for p in doc["points"]]
    assert any(n.startswith("gemm") for n in names) and any(n.startswith("copy") for n in names)
    for model in ("encoder", "llm"):
        assert {f"{model} layer mb{b} {phase}" for b in ((2,) if model == "encoder" else (1,))
                for phase in ("forward", "backward")} <= set(names)
    assert all(p["measured"] > 0 and p["model"] > 0 for p in doc["points"])
    assert "model/meas" in proc.stdout
