"""Learning-rate schedule: linear warmup, then constant, linear or cosine decay to ``min_lr`` (Megatron's)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    min_lr: float = 0.0
    warmup_iters: int = 0
    decay_iters: int = 1
    style: str = "linear"

    def __post_init__(self):
        if self.style not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown lr decay style '{self.style}'")

    def __call__(self, iteration: int) -> float:
        """Learning rate used by the optimizer step of ``iteration`` (0-based)."""
        if self.warmup_iters > 0 and iteration < self.warmup_iters:
            return self.lr * (iteration + 1) / self.warmup_iters
        if self.style == "constant":
            return self.lr
        span = max(self.decay_iters - self.warmup_iters, 1)
        frac = min(max(iteration - self.warmup_iters, 0) / span, 1.0)
        if self.style == "linear":
            coeff = 1.0 - frac
        else:
            coeff = 0.5 * (math.cos(math.pi * frac) + 1.0)
        return self.min_lr + coeff * (self.lr - self.min_lr)
