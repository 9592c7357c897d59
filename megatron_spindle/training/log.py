"""Megatron-format training log lines and the scalars written to TensorBoard (and wandb).

The line keeps Megatron-LM's fields and order (``training.py:training_log``): iteration, consumed samples,
elapsed time per iteration, [throughput], learning rate, global batch size, the losses, loss scale, grad norm,
[params norm], number of skipped / nan iterations; Spindle adds the predicted iteration time, samples per second and the
per-task losses.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from megatron_spindle.training.throughput import Throughput


@dataclass
class StepRecord:
    iteration: int  # 1-based, after the step
    train_iters: int
    consumed_samples: int
    lr: float
    losses: dict[str, float]  # per task, mean over the log interval
    weights: dict[str, float]  # per task loss weight of the logged iteration (0 = the task sat out)
    elapsed_ms: float  # measured wall time per iteration (mean over the log interval)
    predicted_ms: float  # the plan's predicted iteration time
    wave_ms: list[float]  # measured per-wave time, the slowest rank's (mean over the log interval)
    global_batch_size: int
    grad_norm: float | None = None  # before clipping, of the logged iteration (None: not measured)
    loss_scale: float = 1.0
    skipped_iters: int = 0  # fp16 overflow: steps skipped during the log interval
    nan_iters: int = 0  # iterations of the interval whose loss was not finite
    throughput: Throughput | None = None  # --log-throughput
    memory: dict[str, float] = field(default_factory=dict)  # --log-memory-to-tensorboard: tag -> value
    busiest_waves_ms: float | None = None  # the largest rank's own time in all waves (None: one rank, the sum)
    params_norm: float | None = None  # --log-params-norm: the weights' global L2 norm after the logged step
    num_zeros: int | None = None  # --log-num-zeros-in-grad: zeros in the logged iteration's gradients

    @property
    def total_loss(self) -> float:
        return sum(self.weights[t] * v for t, v in self.losses.items())


def format_log_line(r: StepRecord) -> str:
    """`` iteration       10/     100 | consumed samples: ... | ... | total loss: ... | <task> loss: ... |``"""
    parts = [
        f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {r.iteration:8d}/{r.train_iters:8d}",
        f"consumed samples: {r.consumed_samples:12d}",
        f"elapsed time per iteration (ms): {r.elapsed_ms:.1f}",
        f"predicted iteration time (ms): {r.predicted_ms:.2f}",
    ]
    if r.throughput is not None:
        tflops = r.throughput.tflops_per_gpu  # Megatron prints .1f; small (CPU) rates keep their digits
        parts += [f"throughput per GPU (TFLOP/s/GPU): {tflops:.1f}" if tflops >= 1 else
                  f"throughput per GPU (TFLOP/s/GPU): {tflops:.6f}",
                  f"samples per second: {r.throughput.samples_per_second:.1f}"]
    parts += [
        f"learning rate: {r.lr:.6E}",
        f"global batch size: {r.global_batch_size:5d}",
        f"total loss: {r.total_loss:.6E}",
    ]
    parts += [f"{t} loss: {v:.6E}" for t, v in r.losses.items()]
    parts.append(f"loss scale: {r.loss_scale:.1f}")
    if r.grad_norm is not None:
        parts.append(f"grad norm: {r.grad_norm:.3f}")
    if r.num_zeros is not None:
        parts.append(f"num zeros: {float(r.num_zeros):.1f}")
    if r.params_norm is not None:
        parts.append(f"params norm: {r.params_norm:.3f}")
    parts += [f"number of skipped iterations: {r.skipped_iters:3d}", f"number of nan iterations: {r.nan_iters:3d}"]
    return " | ".join(parts) + " |"


# What ``format_log_line`` writes, read back (tools/demo.py, benchmarks/train_log_summary.py).
LOG_LINE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): (\S+) \|"
                      r".*?predicted iteration time \(ms\): (\S+) \|.*?total loss: (\S+) \|(.*)$")
TASK_LOSS = re.compile(r"\s*(\S+) loss: (\S+)\s*")
THROUGHPUT = re.compile(r"\| throughput per GPU \(TFLOP/s/GPU\): (\S+) \|")


class LogRecord(NamedTuple):
    """A training log line as read back."""

    iteration: int
    losses: dict[str, float]
    total: float
    elapsed_ms: float
    predicted_ms: float
    tflops_per_gpu: float | None = None  # with --log-throughput


def parse_log_line(line: str) -> LogRecord | None:
    """A log line's iteration, losses and times (``format_log_line``'s), or None for any other line."""
    m = LOG_LINE.search(line)
    if not m:
        return None
    losses = {}
    for part in m.group(5).split("|"):
        t = TASK_LOSS.fullmatch(part)
        if t:
            losses[t.group(1)] = float(t.group(2))
    tput = THROUGHPUT.search(line)
    return LogRecord(int(m.group(1)), losses, float(m.group(4)), float(m.group(2)), float(m.group(3)),
                     float(tput.group(1)) if tput else None)


def steady_iteration_ms(records: list[LogRecord]) -> float:
    """The measured iteration time of a run: the median of the logged intervals after the first, which holds
    the warm-up (the only one if there is one)."""
    steady = records[1:] or records
    return statistics.median(r.elapsed_ms for r in steady)


def step_scalars(r: StepRecord) -> dict[str, float]:
    """Tag -> value of a logged iteration (Megatron's tags where Megatron has the scalar)."""
    out = {"learning-rate": r.lr, "batch-size": float(r.global_batch_size), "total loss": r.total_loss}
    out.update({f"task loss/{t}": v for t, v in r.losses.items()})
    out["iteration-time/measured (ms)"] = r.elapsed_ms
    out["iteration-time/predicted (ms)"] = r.predicted_ms
    out.update({f"wave-time (ms)/w{i}": ms for i, ms in enumerate(r.wave_ms)})
    if r.busiest_waves_ms is not None:
        out["wave-time (ms)/busiest rank"] = r.busiest_waves_ms
    out["loss-scale"] = r.loss_scale
    if r.grad_norm is not None and math.isfinite(r.grad_norm):
        out["grad-norm"] = r.grad_norm
    if r.params_norm is not None:
        out["params-norm"] = r.params_norm
    if r.num_zeros is not None:
        out["num-zeros"] = float(r.num_zeros)
    if r.throughput is not None:
        out["throughput"] = r.throughput.tflops_per_gpu  # TFLOP/s/GPU, Megatron's tag
        out["samples-per-second"] = r.throughput.samples_per_second
    out.update(r.memory)
    return out


def format_wave_line(r: StepRecord) -> str:
    waves = " ".join(f"w{i}={ms:.1f}" for i, ms in enumerate(r.wave_ms))
    busiest = sum(r.wave_ms) if r.busiest_waves_ms is None else r.busiest_waves_ms
    return f"  measured wave time (ms): {waves} | busiest rank in all waves {busiest:.1f}"


class TensorBoardLogger:
    """Scalars under Megatron-like tags; a no-op when no folder is given."""

    def __init__(self, log_dir: str | None, queue_size: int = 1000):
        self.writer = None
        if log_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir, max_queue=queue_size)

    def log(self, r: StepRecord) -> None:
        self.log_scalars(step_scalars(r), r.iteration)

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        if self.writer is None:
            return
        for tag, v in scalars.items():
            self.writer.add_scalar(tag, v, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
