"""A torchrun worker exits when its launcher dies.

Killing torchrun (SIGKILL, an OOM kill, a lost node agent) otherwise leaves its workers running as orphans that
keep training and writing checkpoints, so a relaunch onto the same ``--save`` would have two jobs writing it.

Two guards, both only under torchrun (``TORCHELASTIC_RUN_ID`` is set for its workers):

- Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``): the kernel ends the worker the moment
  the launcher exits, whatever it is doing. Not SIGTERM: the watchdog and ``--exit-signal-handler`` handle
  SIGTERM, and in the moment before a handled SIGTERM ends the process its main thread ran on, long enough to
  commit a checkpoint save the launcher's death had interrupted (seen once in CI);
- a daemon thread that polls the parent pid twice a second and, when the launcher is gone, prints one line and
  ends the process (``os._exit``: no clean-up can be trusted to finish without the launcher's store), which
  covers other systems and a refused ``prctl``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

from megatron_spindle.errors import stderr_line

PR_SET_PDEATHSIG = 1
POLL_SECONDS = 0.5
EXIT_STATUS = 1

_started = False


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def _set_parent_death_signal(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _launcher_gone(parent: int) -> None:
    rank = os.environ.get("RANK", "?")
    stderr_line(f"rank {rank}: the launcher (pid {parent}) exited; stopping this worker (pid {os.getpid()})")
    os._exit(EXIT_STATUS)


def _watch(parent: int) -> None:
    while True:
        time.sleep(POLL_SECONDS)
        if os.getppid() != parent:
            _launcher_gone(parent)


def exit_with_launcher(force: bool = False) -> None:
    """Under torchrun (or with ``force``): end this process when its parent, the launcher, exits. Idempotent."""
    global _started
    if _started or not (force or under_torchrun()):
        return
    parent = os.getppid()
    _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # it died while the signal was being armed
        _launcher_gone(parent)
    threading.Thread(target=_watch, args=(parent,), name="spindle-launcher-watch", daemon=True).start()
    _started = True
