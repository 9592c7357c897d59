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


def test_a_wait_for_rank0s_own_work_has_no_timeout_while_rank0_lives():
    """Ranks waiting for rank 0 to plan (a point with ``awaits=0``) exit only once rank 0 is gone or silent,
    however long the wait; a collective's wait past ``stall_s`` is diagnosed as before; rank 0 itself, at the
    point, never is."""
    wd = Watchdog(1, 2, 1.0, dist.HashStore(), prog="t", interval_s=0.05, job="test")  # stall_s 0.75 s
    _identity(wd, 0, os.getpid())
    beats = [0]

    def beat():
        beats[0] += 1
        wd.store.set(f"{wd.prefix}hb/0", f'{{"n": {beats[0]}, "where": "planning", "stalled_s": 0}}')

    progress.set_iteration(None)
    progress.point("planning (rank 0) and sharing the plan", awaits=0)
    assert progress.current().awaits == 0
    for _ in range(12):  # 1.2 s, past stall_s: rank 0 beats, no line
        beat()
        assert wd.stall_line(progress.current()) is None
        last_seen = time.monotonic()  # the last beat this watchdog saw change
        time.sleep(0.1)
    rank0 = Watchdog(0, 2, 1.0, wd.store, prog="t", interval_s=0.05, job="test")
    assert rank0.stall_line(progress.current()) is None  # its own work
    while (line := wd.stall_line(progress.current())) is None:  # rank 0 stops beating: named stall_s later
        assert time.monotonic() - last_seen < 3
        time.sleep(0.05)
    assert time.monotonic() - last_seen >= wd.stall_s
    assert line.startswith("rank 1 waited ") and " at planning (rank 0) and sharing the plan: rank 0 is not " \
                                                "responding (no heartbeat for " in line, line
    assert line.endswith("its last heartbeat says it was at planning")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    fresh = Watchdog(1, 2, 1.0, dist.HashStore(), prog="t", interval_s=0.05, job="test")
    _identity(fresh, 0, dead.pid)
    assert f"rank 0 is dead (pid {dead.pid} on " in fresh.stall_line(progress.current())  # at once
    fresh._store_ok = False  # a store that failed once: named only after stall_s, like any wait
    progress.point("planning (rank 0) and sharing the plan", awaits=0)
    assert fresh.stall_line(progress.current()) is None
    time.sleep(0.8)
    assert fresh.stall_line(progress.current()).endswith(": the job's c10d store is unreachable (has the launcher "
                                                         "died?)")
    progress.point("the loss all-reduce")  # a collective: bounded, diagnosed after stall_s
    assert progress.current().awaits is None and wd.stall_line(progress.current()) is None
    progress.point("the loss all-reduce")
    time.sleep(0.8)
    _identity(wd, 0, os.getpid())
    line = wd.stall_line(progress.current())
    assert line is not None and line.startswith("rank 1 waited 1 s (--distributed-timeout-minutes ")


def test_wait_for_rank0_returns_when_rank0_is_done_and_not_before():
    """The other ranks poll the store, outside any collective (so no timeout), until rank 0 says it is done."""
    import threading

    from megatron_spindle.runtime.distributed import wait_for_rank0

    store = dist.HashStore()
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (wait_for_rank0(1, "plan/x", store, poll_s=0.01), done.set()))
    waiter.start()
    assert not done.wait(0.5)
    wait_for_rank0(0, "plan/x", store)
    assert done.wait(5)
    waiter.join()
    wait_for_rank0(1, "plan/x", store)  # a key rank 0 has already set: no wait
