"""The watchdog's diagnosis (which rank is missing, and what this one waited for), progress points, and the exit
conditions, in one process: a HashStore stands in for torchrun's store, real processes for the peers (one that
exited, one stopped with SIGSTOP). The multi-process behaviour is in test_faults.py."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from megatron_spindle.checkpointing import read_latest
from megatron_spindle.runtime import progress
from megatron_spindle.training import signals as signals_mod
from megatron_spindle.training import watchdog as watchdog_mod
from megatron_spindle.training.signals import ExitConfig, ExitMonitor
from megatron_spindle.training.watchdog import Watchdog, _pid_namespace


def _watchdog(world=3, timeout_s=60.0):
    return Watchdog(0, world, timeout_s, dist.HashStore(), prog="t", interval_s=0.05, job="test")


def _identity(wd, rank, pid, host=None):
    wd.store.set(f"{wd.prefix}id/{rank}", f'{{"host": "{host or socket.gethostname()}", "pid": {pid}, '
                                          f'"pidns": {_pid_namespace() or "null"}}}')


def _transfer(index=3):
    m = SimpleNamespace
    return m(index=index, producer=m(id="w1:a", devices=[1]), consumer=m(id="w2:b", devices=[0]),
             fwd=[m(src=1, dst=0)], bwd=[m(src=0, dst=1)])


def test_progress_points_in_words():
    progress.set_iteration(4)
    progress.point("forward", 2, _transfer())
    p = progress.current()
    assert progress.describe(p, 0) == "iteration 4, forward wave 2: transfer 3 (w1:a -> w2:b) from rank(s) 1"
    progress.point("backward", 2, _transfer())
    assert progress.describe(progress.current(), 0).endswith("transfer 3 (w1:a -> w2:b) to rank(s) 1")
    progress.point("backward", 5, SimpleNamespace(slice=SimpleNamespace(id="w5:t/llm", devices=[0, 1])))
    assert progress.describe(progress.current(), 0) == ("iteration 4, backward wave 5: slice w5:t/llm with its "
                                                        "TP/DP group, ranks [0, 1]")
    progress.point("validation forward", 2, _transfer())  # WaveSchedule.evaluate's waves say they validate
    assert progress.describe(progress.current(), 0) == ("iteration 4, validation forward wave 2: transfer 3 "
                                                        "(w1:a -> w2:b) from rank(s) 1")
    progress.point("the gradient all-reduces of", [(0, 1), (0, 2)])
    assert progress.current().seq > p.seq
    assert progress.describe(progress.current(), 0).endswith("the gradient all-reduces of groups ranks [0, 1]; "
                                                             "ranks [0, 2]")
    progress.set_iteration(None)


def test_dead_stopped_silent_and_exited_ranks_are_named():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        time.sleep(0.2)
        wd = _watchdog()
        _identity(wd, 1, dead.pid)
        _identity(wd, 2, stopped.pid)
        wd.store.set(f"{wd.prefix}hb/2", '{"n": 7, "where": "iteration 3, forward wave 1: slice s", "stalled_s": 2}')
        progress.set_iteration(4)
        progress.point("forward", 2, _transfer())
        line, found = wd.diagnose(progress.current(), "waited 50 s", window=False)
        assert found
        assert line.startswith("rank 0 waited 50 s at iteration 4, forward wave 2: transfer 3 (w1:a -> w2:b) "
                               f"from rank(s) 1: rank 1 is dead (pid {dead.pid} on ")
        assert f"also rank 2 is stopped (pid {stopped.pid}" in line
    finally:
        stopped.kill()
        stopped.wait()
        progress.set_iteration(None)
    # a rank on another host whose heartbeat stops changing; then one that left an exit record
    wd = _watchdog(world=2)
    _identity(wd, 1, 12345, host="elsewhere")
    wd.store.set(f"{wd.prefix}hb/1", '{"n": 3, "where": "iteration 2, backward wave 0: slice s", "stalled_s": 0}')
    line, found = wd.diagnose(progress.current(), "waited 50 s", window=True)
    assert found and "rank 1 is not responding (no heartbeat for" in line
    assert "its last heartbeat says it was at iteration 2, backward wave 0: slice s" in line
    wd.store.set(f"{wd.prefix}exit/1", "RuntimeError: boom")
    line, _ = wd.diagnose(progress.current(), "failed", window=False)
    assert line.endswith("rank 1 exited (RuntimeError: boom)")


def test_all_alive_names_where_the_others_are_and_fail_records_a_bug(monkeypatch):
    wd = _watchdog(world=2)
    _identity(wd, 1, os.getpid())  # alive, and beating
    wd.store.set(f"{wd.prefix}hb/1", '{"n": 1, "where": "planning", "stalled_s": 40}')
    bump = SimpleNamespace(n=1)

    def beat():
        bump.n += 1
        wd.store.set(f"{wd.prefix}hb/1", f'{{"n": {bump.n}, "where": "planning", "stalled_s": 40}}')

    real_sleep = time.sleep
    monkeypatch.setattr(watchdog_mod.time, "sleep", lambda s: (beat(), real_sleep(s))[1])  # rank 1 keeps beating
    line, found = wd.diagnose(progress.current(), "waited 50 s", window=True)
    monkeypatch.undo()
    assert not found and "no rank is missing, every heartbeat is fresh; rank 1 has been at planning for 40 s" in line
    wd.fail(AssertionError("a bug"))  # not a communication error: recorded, and the caller re-raises it
    assert wd.store.get(f"{wd.prefix}exit/0") == b"AssertionError: a bug"


def test_exit_conditions(monkeypatch):
    with ExitMonitor(ExitConfig(exit_signal_handler=True)) as m:
        assert m.check(1) is None
        os.kill(os.getpid(), signal.SIGTERM)  # recorded, not fatal
        time.sleep(0.05)
        assert m.check(2) == "received SIGTERM"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    m = ExitMonitor(ExitConfig(exit_interval=5))
    assert [m.check(i) for i in (4, 5)] == [None, "iteration 5 is a multiple of --exit-interval 5"]
    monkeypatch.setattr(signals_mod, "_PROCESS_START", time.monotonic() - 120)
    assert ExitMonitor(ExitConfig(exit_duration_in_mins=1.5)).check(1) == "ran longer than --exit-duration-in-mins 1.5"
    assert ExitMonitor(ExitConfig(exit_duration_in_mins=3)).check(1) is None
    for bad, match in (({"exit_interval": 0}, "--exit-interval"), ({"exit_duration_in_mins": -1}, "--exit-duration")):
        with pytest.raises(ValueError, match=match):
            ExitConfig(**bad)


def test_exit_interval_saves_that_iteration_and_exits_zero(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import pretrain_multitask

    save = tmp_path / "run"
    assert pretrain_multitask.main(["--workload", "tiny-clip", "--mock-data", "--mock-data-samples", "8",
                                    "--spindle-planner", "wavefront", "--train-iters", "10", "--exit-interval", "2",
                                    "--save", str(save), "--save-interval", "5"]) == 0
    assert f"exiting at iteration 2: iteration 2 is a multiple of --exit-interval 2 (checkpoint saved in {save})" \
        in capsys.readouterr().out
    assert read_latest(save) == 2
