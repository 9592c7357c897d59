"""tools/demo.py reads the trainer's own log lines: the losses and the predicted and measured iteration times."""

import pytest
from script_loader import load_script

from megatron_spindle.training.log import LogRecord, StepRecord, format_log_line, parse_log_line

DEMO = load_script("tools/demo.py")


def _record(iteration: int, elapsed_ms: float, predicted_ms: float = 61.7) -> StepRecord:
    return StepRecord(iteration=iteration, train_iters=40, consumed_samples=24 * iteration, lr=5e-3,
                      losses={"vision_text": 1.25, "audio_depth": 0.5}, weights={"vision_text": 1.0, "audio_depth": 1.0},
                      elapsed_ms=elapsed_ms, predicted_ms=predicted_ms, wave_ms=[1.0, 2.0], global_batch_size=24,
                      grad_norm=3.5)


def test_log_line_round_trip():
    line = format_log_line(_record(10, 66.54, 61.7))
    rec = parse_log_line(line)
    assert rec == LogRecord(10, {"vision_text": 1.25, "audio_depth": 0.5}, 1.75, 66.5, 61.7)
    assert parse_log_line("saved checkpoint at iteration 20 to /x (0.1 s)") is None


def test_iteration_time_line_leaves_out_the_first_interval():
    records = [parse_log_line(format_log_line(_record(5 * (i + 1), ms, 10.0)))
               for i, ms in enumerate([100.0, 10.0, 12.0, 11.0])]
    line = DEMO.iteration_time_line(records, profiled=True)
    assert "predicted 10.0 ms (from the profile of this machine), measured 11.0 ms" in line
    assert line.endswith("measured / predicted 1.10")
    assert "placeholder" in DEMO.iteration_time_line(records, profiled=False)


@pytest.mark.parametrize("argv,words", [(["--train-iters", "1"], "--train-iters must be at least 2"),
                                        (["--nproc", "0"], "--nproc must be positive")])
def test_bad_arguments_are_refused_before_any_work(tmp_path, capsys, argv, words):
    out = tmp_path / "demo"
    with pytest.raises(SystemExit) as e:
        DEMO.main([*argv, "--out", str(out)])
    assert e.value.code != 0
    assert words in capsys.readouterr().err
    assert not out.exists()
