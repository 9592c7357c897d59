"""Megatron-format training log lines and optional TensorBoard scalars."""

from __future__ import annotations

import time
from dataclasses import dataclass


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
    wave_ms: list[float]  # measured per-wave time (mean over the log interval)
    global_batch_size: int

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
        f"learning rate: {r.lr:.6E}",
        f"global batch size: {r.global_batch_size:5d}",
        f"total loss: {r.total_loss:.6E}",
    ]
    parts += [f"{t} loss: {v:.6E}" for t, v in r.losses.items()]
    return " | ".join(parts) + " |"


def format_wave_line(r: StepRecord) -> str:
    waves = " ".join(f"w{i}={ms:.1f}" for i, ms in enumerate(r.wave_ms))
    return f"  measured wave time (ms): {waves} | sum {sum(r.wave_ms):.1f}"


class TensorBoardLogger:
    """Scalars under Megatron-like tags; a no-op when no folder is given."""

    def __init__(self, log_dir: str | None):
        self.writer = None
        if log_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir, max_queue=100)

    def log(self, r: StepRecord) -> None:
        if self.writer is None:
            return
        w, it = self.writer, r.iteration
        w.add_scalar("learning-rate", r.lr, it)
        w.add_scalar("total loss", r.total_loss, it)
        for t, v in r.losses.items():
            w.add_scalar(f"task loss/{t}", v, it)
        w.add_scalar("iteration-time/measured (ms)", r.elapsed_ms, it)
        w.add_scalar("iteration-time/predicted (ms)", r.predicted_ms, it)
        for i, ms in enumerate(r.wave_ms):
            w.add_scalar(f"wave-time (ms)/w{i}", ms, it)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
