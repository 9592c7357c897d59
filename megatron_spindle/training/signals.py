"""Leaving a run early without losing work: Megatron-LM's ``--exit-signal-handler``, ``--exit-interval`` and
``--exit-duration-in-mins``.

Each ends the run after a whole iteration, saves a checkpoint of that iteration (with ``--save``) and exits 0:

- ``--exit-signal-handler``: SIGTERM or SIGINT (a scheduler's preemption, Ctrl-C; torchrun forwards both to
  its workers and gives them 30 s before SIGKILL) is only recorded by the handler; the trainer finishes the
  iteration it is in. A signal reaches the ranks at slightly different times, so after every iteration the
  ranks take the maximum of their flags (one small all-reduce) and all stop after the same iteration.
- ``--exit-interval N``: after every iteration whose number is a multiple of N (the same on every rank).
- ``--exit-duration-in-mins M``: once the run has lasted M minutes, measured from the start of the process
  and agreed by the same all-reduce (rank clocks start at slightly different times).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_spindle.flags import flag

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PROCESS_START = time.monotonic()  # Megatron measures --exit-duration-in-mins from the program's start


@dataclass(frozen=True)
class ExitConfig:
    exit_signal_handler: bool = field(default=False, metadata=flag(
        "On SIGTERM or SIGINT, finish the current iteration, save a checkpoint (with --save) and exit 0.",
        name="--exit-signal-handler"))
    exit_interval: int | None = field(default=None, metadata=flag(
        "Exit after every iteration whose number is a multiple of N, saving a checkpoint first (with --save).",
        name="--exit-interval"))
    exit_duration_in_mins: float | None = field(default=None, metadata=flag(
        "Exit after this many minutes of running (checked after every iteration), saving a checkpoint first.",
        name="--exit-duration-in-mins"))

    def __post_init__(self):
        if self.exit_interval is not None and self.exit_interval <= 0:
            raise ValueError(f"--exit-interval must be positive, got {self.exit_interval}")
        if self.exit_duration_in_mins is not None and not self.exit_duration_in_mins > 0:
            raise ValueError(f"--exit-duration-in-mins must be positive, got {self.exit_duration_in_mins}")


class ExitMonitor:
    """``check(iteration)`` after every iteration: the reason to stop after it, or None (the same on every
    rank). Installs the signal handlers for the duration of a ``with`` block."""

    def __init__(self, config: ExitConfig, world_size: int = 1):
        self.config, self.world_size = config, world_size
        self.received: signal.Signals | None = None
        self._previous: dict[int, object] = {}
        self._collective = world_size > 1 and (config.exit_signal_handler or
                                                config.exit_duration_in_mins is not None)

    def __enter__(self) -> ExitMonitor:
        if self.config.exit_signal_handler:
            for sig in EXIT_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _record(self, signum, frame) -> None:  # no printing here: the handler may interrupt a print
        if self.received is None:
            self.received = signal.Signals(signum)

    def check(self, iteration: int) -> str | None:
        c = self.config
        flags = [self.received is not None,
                 c.exit_duration_in_mins is not None and
                 time.monotonic() - _PROCESS_START > c.exit_duration_in_mins * 60]
        if self._collective:
            from megatron_spindle.runtime import progress

            progress.point("the exit-signal check (an all-reduce over all ranks)")
            v = torch.tensor([int(f) for f in flags], dtype=torch.int32)
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
            flags = [bool(x) for x in v.tolist()]
        if flags[0]:
            what = self.received.name if self.received is not None else "a signal (on another rank)"
            return f"received {what}"
        if flags[1]:
            return f"ran longer than --exit-duration-in-mins {c.exit_duration_in_mins}"
        if c.exit_interval is not None and iteration % c.exit_interval == 0:
            return f"iteration {iteration} is a multiple of --exit-interval {c.exit_interval}"
        return None
