"""benchmarks/train_log_summary.py: a training run's measured iteration time against the plan's, from its log."""

import json

from script_loader import load_script

from megatron_spindle.training.log import StepRecord, format_log_line
from megatron_spindle.training.throughput import Throughput

SUMMARY = load_script("benchmarks/train_log_summary.py")


def _line(iteration: int, elapsed_ms: float, loss: float) -> str:
    r = StepRecord(iteration=iteration, train_iters=8, consumed_samples=128 * iteration, lr=1e-4,
                   losses={"a": loss}, weights={"a": 1.0}, elapsed_ms=elapsed_ms, predicted_ms=200.0, wave_ms=[],
                   global_batch_size=128, throughput=Throughput(128e3 / elapsed_ms, 250.0 + iteration))
    return format_log_line(r)


def test_the_first_interval_is_left_out_and_the_run_added_to_the_json(tmp_path, capsys):
    log = tmp_path / "run.log"
    log.write_text("\n".join(["[plan] graph: 12 MetaOps", _line(2, 900.0, 8.0), _line(4, 230.0, 7.0),
                              _line(6, 210.0, 6.5), _line(8, 250.0, 6.0), "done"]) + "\n")
    out = tmp_path / "runs.json"
    out.write_text(json.dumps({"smoke": {"measured_ms": 1.0}}))
    assert SUMMARY.main([str(log), "--name", "clip4", "--json", str(out)]) == 0
    line = capsys.readouterr().out
    assert "clip4: measured 230.0 ms per iteration (median of 3 logged interval(s) after the first)" in line
    assert "predicted 200.0 ms, measured / predicted 1.15, 258.0 TFLOP/s per GPU (model FLOPs)" in line
    assert "total loss 8.0000 (iteration 2) -> 6.0000 (iteration 8)" in line
    runs = json.loads(out.read_text())
    assert set(runs) == {"smoke", "clip4"} and runs["clip4"]["iterations"] == 8


def test_a_log_without_training_lines_is_one_line_and_a_failure(tmp_path, capsys):
    log = tmp_path / "crash.log"
    log.write_text("Traceback (most recent call last):\n  ...\nRuntimeError: CUDA error\n")
    out = tmp_path / "runs.json"
    assert SUMMARY.main([str(log), "--json", str(out)]) == 1
    assert capsys.readouterr().err == f"crash: no training log line in {log}\n"
    assert not out.exists()


def test_the_peak_memory_is_the_largest_rank_against_the_plans_largest_device(tmp_path, capsys):
    from megatron_spindle.training.memory import report_lines

    ranks = report_lines(2, [[1.0e9, 30e9, 31e9, 32e9], [1.0e9, 36e9, 37e9, 38e9]])
    log = tmp_path / "run.log"
    log.write_text("\n".join(["  memory per device: max 40.61 GB  min 12.00 GB  capacity 85.90 GB",
                              _line(2, 900.0, 8.0), *ranks, _line(4, 230.0, 7.0)]) + "\n")
    assert SUMMARY.main([str(log), "--name", "clip4"]) == 0
    s = SUMMARY.summarize(log.read_text().splitlines())
    assert abs(s["max_allocated_gb"] - 36.0) < 0.01 and s["predicted_memory_gb"] == 40.61
    assert capsys.readouterr().out.rstrip().endswith("; peak memory 36.00 GB allocated against 40.61 GB predicted (0.89)")
    # a CPU run has no report: nothing is said of memory
    assert SUMMARY.summarize([_line(2, 900.0, 8.0)])["max_allocated_gb"] is None
