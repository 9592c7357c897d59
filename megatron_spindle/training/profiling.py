"""Megatron-LM's profiling flags: ``--profile`` over iterations [``--profile-step-start``, ``--profile-step-end``)
on ``--profile-ranks``.

Alone, ``--profile`` brackets those iterations with ``cudaProfilerStart`` / ``cudaProfilerStop`` for Nsight
Systems (``nsys profile --capture-range=cudaProfilerApi ...``). With ``--use-pytorch-profiler`` the PyTorch
profiler records them (CPU, and CUDA when present) instead: a trace for TensorBoard's profiler plugin in
``--tensorboard-dir`` when given, and on every profiled rank a table of the operators that took the most time, in
the log (host time first: a step made of many small waves is often bound by the host, which a GPU-time table
would hide), then the runtime's slices (each slice's forward and backward runs in a named range while profiling:
runtime/schedule.py ``slice_range``, NVTX ranges for nsys too) by their host time.
"""

from __future__ import annotations

import argparse

import torch

TABLE_ROWS = 25


def add_profiling_args(group) -> None:
    group.add_argument("--profile", action="store_true",
                       help="Profile iterations [--profile-step-start, --profile-step-end) on --profile-ranks: "
                            "cudaProfilerStart/Stop for nsys (--capture-range=cudaProfilerApi), or the PyTorch "
                            "profiler with --use-pytorch-profiler.")
    group.add_argument("--use-pytorch-profiler", action="store_true",
                       help="With --profile: the PyTorch profiler; its table of the costliest operators goes to "
                            "the log, its trace to --tensorboard-dir when given.")
    group.add_argument("--profile-step-start", type=int, default=10,
                       help="With --profile: the first profiled iteration (counted from 0).")
    group.add_argument("--profile-step-end", type=int, default=12,
                       help="With --profile: the iteration profiling stops before.")
    group.add_argument("--profile-ranks", type=int, nargs="+", default=[0],
                       help="With --profile: the global ranks that profile.")


def check_profiling_args(args: argparse.Namespace) -> None:
    if not args.profile:
        return
    if not 0 <= args.profile_step_start < args.profile_step_end:
        raise ValueError(f"--profile-step-start ({args.profile_step_start}) must be >= 0 and below "
                         f"--profile-step-end ({args.profile_step_end})")
    if not args.use_pytorch_profiler and not torch.cuda.is_available():
        raise ValueError("--profile without --use-pytorch-profiler brackets CUDA's profiler (nsys), and there is "
                         "no CUDA device: add --use-pytorch-profiler")


class StepProfiler:
    """The profiled window of one rank. ``before_iteration(it)`` / ``after_iteration(it + 1)`` around each
    training iteration ``it`` (0-based); inactive unless --profile names this rank."""

    def __init__(self, args: argparse.Namespace, rank: int, print_fn=print):
        self.enabled = bool(args.profile) and rank in args.profile_ranks
        self.start, self.end = args.profile_step_start, args.profile_step_end
        self.pytorch = args.use_pytorch_profiler
        self.trace_dir = args.tensorboard_dir
        self.rank, self.print = rank, print_fn
        self._prof = None
        self._running = False

    def before_iteration(self, iteration: int) -> None:
        if not self.enabled or iteration != self.start or self._running:
            return
        if self.pytorch:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.__enter__()
        else:
            torch.cuda.cudart().cudaProfilerStart()
        self._running = True

    @property
    def active(self) -> bool:
        """Inside the profiled window (the engine then runs its slices in named ranges)."""
        return self._running

    def after_iteration(self, done: int) -> None:
        """``done``: how many iterations have run."""
        if self._running and done >= self.end:
            self.stop()

    def stop(self) -> None:
        """End the window (also when training ends inside it)."""
        if not self._running:
            return
        self._running = False
        if not self.pytorch:
            torch.cuda.cudart().cudaProfilerStop()
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        if self.trace_dir:
            torch.profiler.tensorboard_trace_handler(self.trace_dir, worker_name=f"rank{self.rank}")(prof)
        self.print(self.table(prof))

    def table(self, prof) -> str:
        averages = prof.key_averages()
        head = f"[profile] rank {self.rank}, iterations {self.start} to {self.end - 1}"
        parts = [f"{head}, by host time:", averages.table(sort_by="self_cpu_time_total", row_limit=TABLE_ROWS)]
        if torch.cuda.is_available():
            parts += [f"{head}, by device time:",
                      averages.table(sort_by="self_device_time_total", row_limit=TABLE_ROWS)]
        slices = slice_table(averages)
        if slices:
            parts += [f"{head}, by slice (host: the range's time on the thread that ran it, whose backward waits for "
                      f"autograd's; device: the kernels the profiler puts under it):", slices]
        return "\n".join(parts)


def slice_table(averages) -> str:
    """The slices' ranges (runtime/schedule.py ``slice_range``) of ``averages`` (``key_averages()``), the most host
    time first; empty when there are none."""
    from megatron_spindle.runtime.schedule import SLICE_RANGE

    prefix = f"{SLICE_RANGE} "
    rows = sorted((e for e in averages if e.key.startswith(prefix)), key=lambda e: -e.cpu_time_total)
    if not rows:
        return ""
    width = max(len(e.key) for e in rows) - len(prefix) + 2
    lines = [f"{'range':<{width}}{'calls':>6}{'host ms':>10}{'device ms':>11}"]
    for e in rows[:TABLE_ROWS]:
        device = getattr(e, "device_time_total", 0.0)
        lines.append(f"{e.key[len(prefix):]:<{width}}{e.count:>6}{e.cpu_time_total / 1e3:>10.2f}{device / 1e3:>11.2f}")
    if len(rows) > TABLE_ROWS:
        lines.append(f"({len(rows) - TABLE_ROWS} more)")
    return "\n".join(lines)
