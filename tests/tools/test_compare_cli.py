"""tools/compare.py: every system planned and simulated side by side (--json on tiny-clip), bad input refused."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import compare  # noqa: E402


def test_json_on_tiny_clip_reports_every_system(capsys):
    assert compare.main(["--workload", "tiny-clip", "--num-gpus", "4", "--gpus-per-node", "4", "--gpu-type", "CPU",
                         "--spindle-solver-time-limit", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"] == "tiny-clip" and doc["num_devices"] == 4
    systems = doc["systems"]
    assert list(systems) == list(compare.ALL_SYSTEMS)
    for name, d in systems.items():
        b = d["breakdown"]
        assert d["iteration_time"] > 0 and d["peak_memory_bytes"] > 0 and d["fits"], name
        parts = b["compute"] + b["transfer"] + b["grad_sync"] + b["optimizer"] + b["param_gather"]
        assert parts == pytest.approx(d["iteration_time"]) == pytest.approx(b["iteration_time"]), name
        assert d["memory_options"].startswith(f"zero{d['zero_stage']}"), name
        assert d["attention_backend"] == "local", name  # a CPU runs the local spec, every system alike
    ds = systems["deepspeed"]["iteration_time"]
    assert systems["deepspeed"]["speedup_vs_deepspeed"] == 1.0
    assert systems["optimus"]["speedup_vs_deepspeed"] == pytest.approx(ds / systems["optimus"]["iteration_time"])
    # Spindle as tools/plan.py gives it: the fastest of its candidates, never slower than its sequential fallback
    assert systems["spindle"]["selected"] is not None
    assert systems["spindle"]["iteration_time"] <= systems["spindle-seq"]["iteration_time"] * (1 + 1e-9)
    # C*, the waves' relaxed optimum with memory unlimited: no Spindle plan computes faster
    assert 0 < doc["c_star"] <= min(systems[s]["breakdown"]["compute"] for s in compare.SPINDLE_SYSTEMS)


def test_memory_options_name_the_micro_batches_once():
    from megatron_spindle.graph.cluster import make_cluster
    from megatron_spindle.graph.workload import load_workload
    from megatron_spindle.planner.pipeline import PlannerConfig, plan_workload
    from megatron_spindle.simulator import simulate

    w, c = load_workload("tiny-clip"), make_cluster(2, 2, "CPU")
    res = plan_workload(w, c, PlannerConfig(planner="wavefront", micro_batches="2"))
    sim = simulate(res.plan, w, c, res.cost_model, res.memory_model, metagraph=res.metagraph)
    d = compare.describe(res.plan, sim, 0.0)
    assert d["micro_batches"] == 2 and d["memory_options"] == f"zero{d['zero_stage']}+mb2", d["memory_options"]


@pytest.mark.parametrize("argv, message", [
    (["--workload", "tiny-clip", "--num-gpus", "4", "--systems", "spindle,bogus"], "unknown system(s) bogus"),
    (["--workload", "no-such-workload", "--num-gpus", "4"], "no-such-workload"),
    (["--workload", "tiny-clip"], "--num-gpus"),
    (["--workload", "tiny-clip", "--num-gpus", "4", "--gpu-type", "CPU", "--attention-backend", "flash"],
     "--attention-backend flash is a Transformer Engine backend and cannot run on a CPU"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        compare.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_table_columns_stay_aligned_with_long_memory_options():
    """Per-slice recomputation makes long memory options: the columns after it move right for every row."""
    breakdown = {"compute": 1.0, "transfer": 0.0, "grad_sync": 0.0, "optimizer": 0.0, "param_gather": 0.0}
    row = {"iteration_time": 1.0, "speedup_vs_deepspeed": 1.0, "peak_memory_bytes": 2**31, "fits": True,
           "breakdown": breakdown, "selected": None}
    results = {"spindle": {**row, "memory_options": "zero2+recompute[full (29 layers) x1, full (4 layers) x1]"},
               "deepspeed": {**row, "memory_options": "zero3"}}
    header, *rows, _ = compare.table(results).splitlines()
    end = header.index("compute") + len("compute")
    assert all(r[end - len("1000.0"):end] == "1000.0" for r in rows), rows


def test_the_table_names_the_attention_backend(capsys):
    assert compare.main(["--workload", "tiny-clip", "--num-gpus", "8", "--systems", "spindle,deepspeed",
                         "--spindle-planner", "wavefront", "--attention-backend", "unfused"]) == 0
    out = capsys.readouterr().out
    assert "8 x A800-80GB (1 node(s)), simulated, attention backend unfused" in out
    assert re.search(r"^C\* [0-9.]+ ms, [0-9.]+x DeepSpeed: the waves' relaxed optimum", out, re.M)


def test_frozen_modules_are_compared_as_frozen(capsys):
    """--freeze: every system is planned and simulated with those modules frozen, and the header says so."""
    argv = ["--workload", "tiny-vlm", "--num-gpus", "4", "--systems", "spindle,deepspeed", "--spindle-planner",
            "wavefront", "--gpu-type", "CPU", "--json"]
    assert compare.main(argv) == 0
    full = json.loads(capsys.readouterr().out)
    assert compare.main(argv + ["--freeze", "vision", "llm"]) == 0
    frozen = json.loads(capsys.readouterr().out)
    assert (full["frozen"], frozen["frozen"]) == ([], ["vision", "llm"])
    for name in ("spindle", "deepspeed"):
        assert frozen["systems"][name]["iteration_time"] < full["systems"][name]["iteration_time"], name
        assert frozen["systems"][name]["peak_memory_bytes"] < full["systems"][name]["peak_memory_bytes"], name
    assert compare.main(argv[:-1] + ["--freeze", "llm"]) == 0
    assert "simulated, attention backend local, frozen: llm" in capsys.readouterr().out


def test_dropout_is_charged_to_every_system(capsys):
    """--hidden-dropout / --attention-dropout: every system is planned and simulated with the masks' kernels and
    memory, and the header and the JSON say so."""
    argv = ["--workload", "tiny-vlm", "--num-gpus", "4", "--systems", "spindle,deepspeed,megatron",
            "--spindle-planner", "wavefront", "--gpu-type", "CPU", "--json"]
    assert compare.main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert compare.main(argv + ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]) == 0
    dropping = json.loads(capsys.readouterr().out)
    assert (plain["hidden_dropout"], dropping["hidden_dropout"], dropping["attention_dropout"]) == (0, 0.1, 0.1)
    for name in ("spindle", "deepspeed", "megatron"):
        assert dropping["systems"][name]["iteration_time"] > plain["systems"][name]["iteration_time"], name
    # the baselines keep their layout, so the masks show in their peak; Spindle may plan another layout once
    # dropout costs time and memory (here one with less memory), so its peaks are not comparable: the masks' bytes
    # in Spindle's plans are held against what the runtime saves in tests/runtime/test_memory_measured.py
    for name in ("deepspeed", "megatron"):
        assert dropping["systems"][name]["peak_memory_bytes"] > plain["systems"][name]["peak_memory_bytes"], name
    assert compare.main(argv[:-1] + ["--hidden-dropout", "0.1"]) == 0
    assert "simulated, attention backend local, dropout hidden 0.1 attention 0" in capsys.readouterr().out


def test_a_spindle_that_cannot_plan_is_a_row_and_no_bound(capsys):
    """Spindle refused (a micro-batch count that divides no task's batch): its row says why, the baselines are
    still compared, and C* (which the same planner would make) is left out."""
    argv = ["--workload", "tiny-clip", "--num-gpus", "4", "--gpus-per-node", "4", "--gpu-type", "CPU",
            "--systems", "spindle,deepspeed", "--spindle-micro-batches", "5"]
    assert compare.main(argv) == 0
    out = capsys.readouterr().out
    assert "spindle         does not fit: --spindle-micro-batches 5 does not divide" in out and "C* " not in out
    assert compare.main(argv + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["c_star"] is None and "error" in doc["systems"]["spindle"]
    assert doc["systems"]["deepspeed"]["iteration_time"] > 0
