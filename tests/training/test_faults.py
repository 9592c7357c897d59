"""Faults on 2-3 gloo ranks under torchrun, as a user meets them: a killed rank, a stopped rank, a preemption
signal, a killed launcher (during a save), and a second job on a folder in use.

Five launches in all (each costs ~10 s of imports); every wait is bounded, and every process group a test
starts is killed when it ends, whatever happened.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from checkpoint_params import checkpoint_params

from megatron_spindle.checkpointing import iteration_dir, load_checkpoint, read_latest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import pretrain_multitask  # noqa: E402

# tp = dp = 1 slices on A800 "devices": the 2-rank plan sums every gradient as the 1-rank plan does, so a resumed
# run can be compared with a straight one at 1e-6 (tests/training/test_train_resume.py)
COMMON = ["--workload", "tiny-clip", "--mock-data", "--mock-data-samples", "8", "--seed", "3", "--lr", "2e-3",
          "--lr-warmup-iters", "1", "--lr-decay-iters", "1000", "--spindle-planner", "wavefront", "--gpu-type",
          "A800-80GB", "--log-interval", "1"]
LOG = re.compile(r" iteration\s+(\d+)/")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    """Any of its threads still runs (a process gone, or a zombie whose threads have all exited, is not). The
    main thread alone is not enough: killed, it turns zombie while others still hold the process's files, the
    ``--save`` lock among them."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    return True
        except FileNotFoundError:
            continue
    return False


class Job:
    """``torchrun --nproc-per-node N pretrain_multitask.py FLAGS`` in its own session; output collected."""

    def __init__(self, nproc: int, flags: list[str], cwd: Path, script: Path = ROOT / "pretrain_multitask.py"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
               "127.0.0.1", "--master-port", str(_free_port()), str(script), *flags]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=cwd, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._workers: dict[int, int] = {}

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for_iteration(self, n: int, timeout: float = 240) -> int:
        """Block until iteration >= n is logged; returns the last logged iteration."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            its = [int(m.group(1)) for m in map(LOG.search, list(self.lines)) if m]
            if its and its[-1] >= n:
                return its[-1]
            assert self.proc.poll() is None, self.output[-3000:]
            time.sleep(0.05)
        raise AssertionError(f"no iteration {n} within {timeout} s:\n{self.output[-3000:]}")

    def workers(self) -> dict[int, int]:
        """rank -> pid of torchrun's children."""
        if not self._workers:
            for d in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{d}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                    if ppid != self.proc.pid:
                        continue
                    env = Path(f"/proc/{d}/environ").read_bytes().split(b"\0")
                    rank = next(int(e[5:]) for e in env if e.startswith(b"RANK="))
                    self._workers[rank] = int(d)
                except (OSError, StopIteration, ValueError, IndexError):
                    continue
        return self._workers

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return rc

    def kill(self) -> None:
        for pid in self._workers.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)


@pytest.fixture
def jobs():
    started: list[Job] = []
    yield started
    for job in started:
        job.kill()


def _gone_within(pids, seconds: float) -> float:
    """Seconds until every pid is gone (fails after ``seconds``)."""
    t0 = time.monotonic()
    while any(_alive(p) for p in pids):
        assert time.monotonic() - t0 < seconds, [p for p in pids if _alive(p)]
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.mark.multiproc
def test_killed_rank_is_named_by_every_survivor(tmp_path, jobs):
    job = Job(3, COMMON + ["--train-iters", "500"], tmp_path)
    jobs.append(job)
    job.wait_for_iteration(2)
    pids = job.workers()
    assert sorted(pids) == [0, 1, 2]
    os.kill(pids[1], signal.SIGKILL)
    took = _gone_within([pids[0], pids[2]], 20)
    assert job.wait(60) != 0
    lines = [line for line in job.lines if "pretrain_multitask.py: error: rank " in line]
    for r in (0, 2):
        mine = [line for line in lines if line.startswith(f"pretrain_multitask.py: error: rank {r} ")]
        assert len(mine) == 1 and "rank 1 is dead" in mine[0], job.output[-4000:]
        # where it was: a wave step, a collective ("the ...") or the logging all-reduces, whichever the kill hit
        assert re.search(r"at iteration \d+, ((forward|backward) wave \d+: |the |logging \()", mine[0]), mine
    assert took < 10, took
    assert "Traceback" not in "".join(lines)


@pytest.mark.multiproc
def test_planning_outlasts_the_timeout_and_a_stopped_rank_is_named_within_it(tmp_path, jobs):
    """Rank 0 plans for longer than --distributed-timeout-minutes (slow_planning.py holds it back): the others
    wait for it and training starts. The ranks start the first iteration together: rank 0's slow writing of the
    plan files is in no rank's wave times. Then a rank stopped mid-training is named within the timeout."""
    from slow_planning import PLAN_DELAY_S, WRITE_DELAY_S

    timeout_min = 0.3
    assert PLAN_DELAY_S > timeout_min * 60
    job = Job(2, COMMON + ["--train-iters", "500", "--distributed-timeout-minutes", str(timeout_min)], tmp_path,
              script=Path(__file__).with_name("slow_planning.py"))
    jobs.append(job)
    job.wait_for_iteration(2, timeout=240 + PLAN_DELAY_S)
    planned = re.search(r"\[plan\] done in ([0-9.]+) s", job.output)
    assert planned and float(planned.group(1)) >= PLAN_DELAY_S, job.output[-3000:]
    assert ": error: " not in job.output, job.output[-3000:]
    first = re.search(r"busiest rank in all waves ([0-9.]+)", job.output)
    assert first and float(first.group(1)) < WRITE_DELAY_S * 1e3 / 2, job.output[-3000:]
    pids = job.workers()
    os.kill(pids[1], signal.SIGSTOP)
    t0 = time.monotonic()
    _gone_within([pids[0]], timeout_min * 60 + 20)
    took = time.monotonic() - t0
    os.kill(pids[1], signal.SIGKILL)  # torchrun would wait 30 s for a stopped worker to take its SIGTERM
    assert job.wait(60) != 0
    line = next((x for x in job.lines if x.startswith("pretrain_multitask.py: error: rank 0 ")), None)
    assert line is not None, job.output[-4000:]
    assert f"(--distributed-timeout-minutes {timeout_min:g})" in line and "rank 1 is stopped" in line, line
    assert re.search(r"rank 0 waited \d+ s \(.*\) at iteration \d+, ", line), line
    assert took <= timeout_min * 60 + 5, took  # within the timeout (plus the last iteration and the diagnosis)



@pytest.mark.multiproc
def test_sigterm_saves_the_current_iteration_and_resumes_exactly_and_the_folder_is_locked(tmp_path, jobs, capsys):
    save = tmp_path / "run"
    job = Job(2, COMMON + ["--train-iters", "500", "--save", str(save), "--save-interval", "1000",
                           "--exit-signal-handler"], tmp_path)
    jobs.append(job)
    job.wait_for_iteration(3)
    # a second job on the same --save is refused, naming the first; the first is unharmed
    with pytest.raises(SystemExit) as e:
        pretrain_multitask.main(COMMON + ["--train-iters", "5", "--save", str(save), "--load", str(save)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--save {save} is in use by another job (host {socket.gethostname()}, pid {job.workers()[0]}, " \
           f"started " in err, err[-2000:]
    os.kill(job.proc.pid, signal.SIGTERM)  # the launcher forwards it to the workers
    job.wait(120)
    done = [int(m.group(1)) for m in map(LOG.search, job.lines) if m][-1]
    assert f"exiting at iteration {done}: received SIGTERM (checkpoint saved in {save})" in job.output, \
        job.output[-3000:]
    assert read_latest(save) == done and done < 500
    assert not (save / ".spindle.lock").exists()
    # resume on one rank to done + 2; a straight run of done + 2 iterations gives the same weights
    torch.set_num_threads(1)
    resumed, straight = tmp_path / "resumed", tmp_path / "straight"
    assert pretrain_multitask.main(COMMON + ["--train-iters", str(done + 2), "--load", str(save), "--save",
                                             str(resumed)]) == 0
    assert pretrain_multitask.main(COMMON + ["--train-iters", str(done + 2), "--save", str(straight)]) == 0
    ck_a, a = checkpoint_params(straight)
    ck_b, b = checkpoint_params(resumed)
    assert sorted(a) == sorted(b) and len(a) > 20
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    assert ck_a.data_position == ck_b.data_position


@pytest.mark.multiproc
def test_killed_launcher_during_a_save_takes_its_workers_and_the_next_save_cleans_up(tmp_path, jobs):
    save = tmp_path / "run"
    job = Job(2, COMMON + ["--train-iters", "500", "--save", str(save), "--save-interval", "1"], tmp_path)
    jobs.append(job)
    job.wait_for_iteration(2)
    pids = list(job.workers().values())
    deadline = time.monotonic() + 120
    while True:  # freeze the workers in the middle of a save, then kill their launcher
        assert time.monotonic() < deadline, "never caught a save in progress"
        if any(p.name.endswith(".tmp") for p in save.iterdir()):
            for p in pids:
                os.kill(p, signal.SIGSTOP)
            stale = [p.name for p in save.iterdir() if p.name.endswith(".tmp") and p.is_dir()]
            if stale:
                break
            for p in pids:
                os.kill(p, signal.SIGCONT)
        time.sleep(0.002)
    previous = read_latest(save)
    os.kill(job.proc.pid, signal.SIGKILL)
    job.proc.wait(timeout=30)
    for p in pids:
        os.kill(p, signal.SIGCONT)  # SIGKILL (parent death) ends stopped workers too; the watch thread needs them running
    assert _gone_within(pids, 10) < 10
    assert read_latest(save) == previous and (save / stale[0]).is_dir()
    assert load_checkpoint(save).iteration == previous  # the previous checkpoint loads
    # the next run resumes it; its first save (of another iteration) removes the interrupted one's folder
    assert stale == [f"iter_{previous + 1:07d}.tmp"]
    assert pretrain_multitask.main(COMMON + ["--train-iters", str(previous + 2), "--save-interval", "1000", "--load",
                                             str(save), "--save", str(save)]) == 0
    assert read_latest(save) == previous + 2
    assert not [p.name for p in save.iterdir() if p.name.endswith(".tmp") or p.name.startswith(".")]
    assert iteration_dir(save, previous).is_dir()


@pytest.mark.multiproc
def test_an_error_of_every_rank_is_printed_once(tmp_path, jobs):
    """A --load without a checkpoint: rank 0 finds it out and every rank stops with its error (rank0_outcome),
    but only the node's first worker prints it."""
    job = Job(2, COMMON + ["--train-iters", "3", "--load", str(tmp_path / "nothing")], tmp_path)
    jobs.append(job)
    assert job.wait(120) != 0
    lines = [line for line in job.lines if "pretrain_multitask.py: error: " in line]
    assert len(lines) == 1 and f"--load {tmp_path / 'nothing'}" in lines[0], job.output[-3000:]
