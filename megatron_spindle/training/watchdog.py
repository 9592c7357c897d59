"""The training watchdog: after a dead or hung rank, every rank exits non-zero within the distributed timeout
with one line naming the missing rank and what this rank was waiting for.

gloo's own errors name neither ("Connection reset by peer" from a pair deep in the transport, or a timeout
after the process group's full timeout), so every rank keeps a small record in the job's c10d store (the
TCPStore torchrun hosts, reached over a connection of its own so that a main thread blocked inside the store
cannot block it):

- ``id/<rank>``: host, pid and pid namespace, written once;
- ``hb/<rank>``: a heartbeat a daemon thread writes every ``interval`` seconds: a counter and this rank's
  progress point (runtime/progress.py: "iteration 4, forward wave 2: transfer 3 (a -> b) from rank(s) 1");
- ``exit/<rank>``: why a rank is leaving, written before it goes (a failure it diagnosed, or its exception);
- ``abort``: the first diagnosis, which the other ranks' threads repeat and exit on.

When this rank's current point has lasted longer than the timeout less a margin (a quarter of it, at most
15 s, so that the exit comes within the timeout: a hang), or a collective raised (a dead peer), the rank looks
for the missing one: a rank that left an exit record, a process on this host that is gone,
a zombie or stopped (``/proc/<pid>/stat``), or a rank whose heartbeat stopped changing. It then prints one
line, records it for the others, and ends the process (``os._exit(1)``: with a peer gone, a clean shutdown of
the process groups can itself hang). An exception no missing rank explains is left to propagate (a bug keeps
its traceback; a user error, which every rank reports alike, its one line: the trainer does not pass those).

A point that awaits one rank's own work (rank 0 planning, which may take longer than the timeout on a large
cluster; the others wait outside any collective, runtime/distributed.py ``wait_for_rank0``) has no time limit:
the waiting ranks exit only when the awaited rank is gone, stopped, or its heartbeat stops.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from typing import Any

from megatron_spindle.errors import stderr_line
from megatron_spindle.runtime import progress

EXIT_STATUS = 1
_KEY_ROOT = "spindle-watchdog"


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _local_state(pid: int) -> str | None:
    """'gone', 'zombie' or 'stopped' for a process of this host and pid namespace; None while it runs."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return "gone"
    except OSError:
        return None
    state = stat.rsplit(")", 1)[-1].split()[0] if ")" in stat else ""
    return {"Z": "zombie", "X": "gone", "T": "stopped", "t": "stopped"}.get(state)


def _is_comm_error(e: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(w in text for w in (
        "gloo", "Gloo", "NCCL", "Connection reset", "Connection closed", "Connection refused", "Broken pipe",
        "Timed out", "timed out", "Socket", "socket"))


def _short(exc: BaseException) -> str:
    """The exception's text on one line, without gloo's source locations ("[../gloo/pair.cc:534] ")."""
    text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", " ".join(str(exc).split()))
    return text.split(". ")[0].rstrip(".")[:160]


_EXITED = " exited ("  # in a rank's state: it left an exit record (it left on its own, often after another)
_SEVERITY = ("is dead", "is stopped", "is not responding", _EXITED)
STORE_UNREACHABLE = "the job's c10d store is unreachable (has the launcher died?)"


def _rank_first(states: list[str]) -> list[str]:
    """Dead, stopped and silent ranks before ranks that left on their own (often because of the first)."""
    return sorted(states, key=lambda s: next((i for i, w in enumerate(_SEVERITY) if w in s), len(_SEVERITY)))


class Watchdog:
    """One per rank, from ``start()`` to ``stop()``; ``fail(exc)`` from the main thread's error path."""

    def __init__(self, rank: int, world_size: int, timeout_s: float, store: Any, prog: str = "",
                 interval_s: float | None = None, job: str = "", report_sigterm: bool = False):
        self.rank, self.world_size, self.timeout_s, self.store = rank, world_size, timeout_s, store
        self.prog = prog or os.path.basename(sys.argv[0] or "python")
        self.interval_s = interval_s or min(5.0, max(0.25, timeout_s / 20))
        # a stall is diagnosed before the process groups' own timeout fires, leaving time to name the rank
        self.stall_s = timeout_s - min(0.25 * timeout_s, 15.0)
        self.prefix = f"{_KEY_ROOT}/{job}/"
        self._ids: dict[int, dict[str, Any]] = {}
        self._beats = 0
        self._stop = threading.Event()
        self._once = threading.Lock()
        self._thread: threading.Thread | None = None
        self._store_ok = True
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "pidns": _pid_namespace(), "ppid": os.getppid()}
        self.report_sigterm = report_sigterm
        self._wakeup: tuple[int, int] | None = None  # (read end, the wakeup fd it replaced)
        self._awaited_beat: tuple[int, Any, float] | None = None  # (rank, its heartbeat count, when it changed)
        self._old_sigterm: Any = None

    # ------------------------------------------------------------------------------------------ set-up
    @classmethod
    def for_world(cls, rank: int, world_size: int, timeout_s: float, prog: str = "",
                  report_sigterm: bool = True) -> Watchdog | None:
        """A watchdog on a store connection of its own; None for a world of one or without a TCP store.
        ``report_sigterm``: SIGTERM ends the process with a line (False when --exit-signal-handler owns it)."""
        if world_size <= 1:
            return None
        import torch.distributed as dist

        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            return None
        store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=max(5.0, min(60.0, timeout_s))))
        job = f"{os.environ.get('TORCHELASTIC_RUN_ID', port)}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        return cls(rank, world_size, timeout_s, store, prog, job=job, report_sigterm=report_sigterm)

    def start(self) -> Watchdog:
        self._set(f"id/{self.rank}", json.dumps(self.me))
        self._beat()
        if self.report_sigterm and threading.current_thread() is threading.main_thread():
            self._catch_sigterm()
        self._thread = threading.Thread(target=self._run, name="spindle-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 1)
            self._thread = None
        if self._wakeup is not None:
            read_end, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            signal.signal(signal.SIGTERM, self._old_sigterm)
            os.close(read_end)
            self._wakeup = None

    def _catch_sigterm(self) -> None:
        """SIGTERM (the launcher stopping the job after another rank failed) reaches this thread through the
        signal wakeup fd even while the main thread is blocked inside a collective, so the rank can say what it
        was waiting for, and who was missing, before it goes."""
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        self._old_sigterm = signal.signal(signal.SIGTERM, lambda *_: None)  # ended by the thread, not here
        self._wakeup = (read_end, previous)

    def _orphaned(self) -> bool:
        """The launcher (and with it the store) is gone: no store look-ups, they could only time out."""
        return os.getppid() != self.me.get("ppid", os.getppid())

    def _wait(self) -> bool:
        """Sleep one interval; True when SIGTERM arrived meanwhile."""
        if self._wakeup is None:
            self._stop.wait(self.interval_s)
            return False
        import select

        ready, _, _ = select.select([self._wakeup[0]], [], [], self.interval_s)
        return bool(ready) and signal.SIGTERM in os.read(self._wakeup[0], 64)

    def _terminated(self) -> None:
        where = progress.describe(progress.current(), self.rank)
        found, missing = self.missing_ranks(window=False) if self._store_ok and not self._orphaned() else ("", False)
        self._once.acquire()
        stderr_line(f"{self.prog}: error: rank {self.rank} got SIGTERM (from the launcher) at {where}"
             + (f": {found}" if missing else ""))
        os._exit(128 + signal.SIGTERM)

    # ------------------------------------------------------------------------------------------ store
    def _set(self, key: str, value: str) -> None:
        try:
            self.store.set(self.prefix + key, value)
        except Exception:  # the store's host (torchrun) is gone: local checks go on
            self._store_ok = False

    def _get(self, key: str) -> str | None:
        try:
            if not self.store.check([self.prefix + key]):
                return None
            return self.store.get(self.prefix + key).decode("utf-8", "replace")
        except Exception:
            self._store_ok = False
            return None

    def _get_json(self, key: str) -> dict[str, Any] | None:
        text = self._get(key)
        try:
            return json.loads(text) if text else None
        except ValueError:
            return None

    def _beat(self) -> None:
        p = progress.current()
        self._beats += 1
        self._set(f"hb/{self.rank}", json.dumps({"n": self._beats, "where": progress.describe(p, self.rank),
                                                 "stalled_s": round(time.monotonic() - p.since, 1)}))

    # ------------------------------------------------------------------------------------------ thread
    def _run(self) -> None:
        while not self._stop.is_set():
            if self._wait():
                self._terminated()
            if self._stop.is_set():
                return
            self._beat()
            abort = self._get("abort")
            if abort and not self._stop.is_set():
                where = progress.describe(progress.current(), self.rank)
                self._announce(f"rank {self.rank} stops (it was at {where}): {abort}", publish=False)
            line = self.stall_line(progress.current())
            if line and not self._stop.is_set():
                self._announce(line)

    def stall_line(self, p: progress.Point) -> str | None:
        """The line to exit with when this rank has been at ``p`` too long, else None. A collective's wait
        (``p.awaits`` None) is too long after ``stall_s``; a wait for one rank's own work (rank 0 planning)
        lasts as long as that rank lives: too long only once it is dead, stopped or silent for ``stall_s``."""
        stalled = time.monotonic() - p.since
        if p.awaits is None:
            if stalled <= self.stall_s:
                return None
            cause = f"waited {stalled:.0f} s (--distributed-timeout-minutes {self.timeout_s / 60:g})"
            return self.diagnose(p, cause, window=True)[0]
        if p.awaits == self.rank:
            return None
        missing = self._awaited_missing(p.awaits, stalled)
        if missing is None:
            return None
        return f"rank {self.rank} waited {stalled:.0f} s at {progress.describe(p, self.rank)}: {missing}"

    def _awaited_missing(self, r: int, stalled: float) -> str | None:
        """What is wrong with rank ``r``, which this rank has waited ``stalled`` seconds for: an exit record, a
        dead or stopped process on this host, or a heartbeat that has not changed for ``stall_s`` (a rank on
        another host); None while it lives. Reads one key per interval (no window: the awaited rank's own
        watchdog beats meanwhile). A store that failed once is named only after ``stall_s``, as for any wait."""
        state = self._quick_state(r) if self._store_ok else None
        if state:
            return self._with_last_seen(r, state)
        if not self._store_ok:
            return STORE_UNREACHABLE if stalled > self.stall_s else None
        n, now = (self._get_json(f"hb/{r}") or {}).get("n"), time.monotonic()
        seen = self._awaited_beat
        if seen is None or seen[:2] != (r, n):
            self._awaited_beat = (r, n, now)
            return None
        if now - seen[2] > self.stall_s:
            return f"rank {r} is not responding (no heartbeat for {now - seen[2]:.0f} s){self._last_seen(r)}"
        return None

    # ------------------------------------------------------------------------------------------ diagnosis
    def _identity(self, r: int) -> dict[str, Any] | None:
        if r not in self._ids:
            ident = self._get_json(f"id/{r}")
            if ident is None:
                return None
            self._ids[r] = ident
        return self._ids[r]

    def _quick_state(self, r: int) -> str | None:
        """What is known of rank ``r`` at once: its exit record, or its process state on this host."""
        reason = self._get(f"exit/{r}")
        if reason:
            return f"rank {r} exited ({reason})"
        ident = self._identity(r)
        if ident and ident.get("host") == self.me["host"] and ident.get("pidns") == self.me["pidns"]:
            state = _local_state(int(ident["pid"]))
            if state in ("gone", "zombie"):
                return f"rank {r} is dead (pid {ident['pid']} on {ident['host']} has exited)"
            if state == "stopped":
                return f"rank {r} is stopped (pid {ident['pid']} on {ident['host']} is suspended, e.g. SIGSTOP)"
        return None

    def _last_seen(self, r: int) -> str:
        hb = self._get_json(f"hb/{r}")
        return f"; its last heartbeat says it was at {hb['where']}" if hb and hb.get("where") else ""

    def _with_last_seen(self, r: int, state: str) -> str:
        """Rank ``r``'s state and where its last heartbeat was, unless it left an exit record (which says)."""
        return state if _EXITED in state else state + self._last_seen(r)

    def _others_points(self, others: list[int]) -> str:
        """Where the other ranks are, longest-stalled first (a slow rank, a deadlock, or collectives called
        in a different order)."""
        beats = [(r, self._get_json(f"hb/{r}")) for r in others]
        beats = sorted(((r, hb) for r, hb in beats if hb), key=lambda x: -x[1].get("stalled_s", 0))
        return "".join(f"; rank {r} has been at {hb.get('where')} for {hb.get('stalled_s', 0):.0f} s"
                       for r, hb in beats[:3])

    def diagnose(self, p: progress.Point, cause: str, window: bool) -> tuple[str, bool]:
        """(the one line, whether a missing rank was found). ``window``: also watch the heartbeats for a few
        intervals (finds stopped or dead ranks on other hosts)."""
        found_text, found = self.missing_ranks(window)
        return f"rank {self.rank} {cause} at {progress.describe(p, self.rank)}: {found_text}", found

    def missing_ranks(self, window: bool) -> tuple[str, bool]:
        """(what is known of the missing rank(s), whether one was found)."""
        others = [r for r in range(self.world_size) if r != self.rank]
        found = [s for s in (self._quick_state(r) for r in others) if s]
        if not found and window and self._store_ok:
            before = {r: (self._get_json(f"hb/{r}") or {}).get("n") for r in others}
            span = min(3 * self.interval_s + 0.5, 10.0)
            deadline = time.monotonic() + span
            while time.monotonic() < deadline and not found:
                time.sleep(min(self.interval_s, 0.5))
                found = [s for s in (self._quick_state(r) for r in others) if s]
            if not found:
                after = {r: (self._get_json(f"hb/{r}") or {}).get("n") for r in others}
                found = [f"rank {r} is not responding (no heartbeat for {span:.0f} s)"
                         for r in others if after[r] is None or after[r] == before[r]]
        if not self._store_ok and not found:
            found_text = STORE_UNREACHABLE
        elif found:
            found = _rank_first(found)
            first = found[0]
            rest = [f for f in found[1:] if _EXITED not in f or _EXITED in first]
            more = f"; also {'; '.join(rest[:2])}" if rest else ""
            found_text = f"{self._with_last_seen(int(first.split()[1]), first)}{more}"
        else:
            found_text = "no rank is missing, every heartbeat is fresh" + self._others_points(others)
        return found_text, bool(found)

    # ------------------------------------------------------------------------------------------ exits
    def _announce(self, line: str, publish: bool = True) -> None:
        if not self._once.acquire(blocking=False):
            while True:  # another thread is ending the process
                time.sleep(1)
        self._set(f"exit/{self.rank}", line[:300])
        if publish and not self._get("abort"):
            self._set("abort", line[:600])
        stderr_line(f"{self.prog}: error: {line}")
        if publish:  # let the other ranks' threads read the diagnosis before the launcher stops them
            time.sleep(min(2 * self.interval_s, 2.0))
        os._exit(EXIT_STATUS)

    def fail(self, exc: BaseException) -> None:
        """From the main thread, with the exception that stopped training. A communication error: find the
        missing rank, print the line and end the process (never returns). Anything else: record this rank's
        exit for the others and return, so that the caller re-raises it (a bug keeps its traceback)."""
        text = _short(exc)
        if not _is_comm_error(exc):
            self._set(f"exit/{self.rank}", f"{type(exc).__name__}: {text}")
            return
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):  # the launcher stops the others: finish the line first
                signal.signal(sig, lambda *_: None)
        line, _ = self.diagnose(progress.current(), f"failed ({text})", window=True)
        self._announce(line)
