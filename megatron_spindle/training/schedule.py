"""Learning-rate schedule: linear warmup, then constant, linear or cosine decay to ``min_lr`` (Megatron's)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_spindle.flags import flag

LR_DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    """Megatron's schedule; every field is one of its flags (--lr, --min-lr, --lr-warmup-iters, ...)."""

    lr: float = field(default=1e-3, metadata=flag("Peak learning rate (AdamW)."))
    min_lr: float = field(default=0.0, metadata=flag("Learning rate at the end of the decay."))
    warmup_iters: int = field(default=0, metadata=flag("Linear warmup from 0 over these iterations.",
                                                         name="--lr-warmup-iters"))
    decay_iters: int | None = field(default=None, metadata=flag(
        "Iterations to decay over (default: --train-iters).", name="--lr-decay-iters"))
    style: str = field(default="linear", metadata=flag("Decay from --lr to --min-lr after warmup.",
                                                        name="--lr-decay-style", choices=LR_DECAY_STYLES))

    def __post_init__(self):
        if self.style not in LR_DECAY_STYLES:
            raise ValueError(f"unknown lr decay style '{self.style}'")
        if self.decay_iters is None and self.style != "constant":
            raise ValueError(f"a {self.style} decay needs decay_iters")

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
