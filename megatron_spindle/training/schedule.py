"""Learning-rate schedule: linear warmup, then constant, linear, cosine or inverse-square-root decay to
``min_lr``, or warmup-stable-decay (WSD: the peak held until the last --lr-wsd-decay-iters of the decay, then an
anneal of its own shape); Megatron-LM's styles and flags."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_spindle.flags import flag

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


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
    wsd_decay_iters: int | None = field(default=None, metadata=flag(
        "WSD: the anneal's length, the last iterations of the decay (needed with --lr-decay-style WSD).",
        name="--lr-wsd-decay-iters"))
    wsd_style: str = field(default="exponential", metadata=flag(
        "WSD: the anneal's shape.", name="--lr-wsd-decay-style", choices=WSD_DECAY_STYLES))

    def __post_init__(self):
        if self.style not in LR_DECAY_STYLES:
            raise ValueError(f"unknown lr decay style '{self.style}'")
        if self.wsd_style not in WSD_DECAY_STYLES:
            raise ValueError(f"unknown WSD decay style '{self.wsd_style}'")
        if self.decay_iters is None and self.style not in ("constant", "inverse-square-root"):
            raise ValueError(f"a {self.style} decay needs decay_iters")
        if self.style == "WSD":
            room = self.decay_iters - self.warmup_iters
            if self.wsd_decay_iters is None or not 0 < self.wsd_decay_iters <= room:
                raise ValueError(f"--lr-decay-style WSD needs --lr-wsd-decay-iters in [1, {room}] (the decay's "
                                 f"iterations after warmup), got {self.wsd_decay_iters}")

    def __call__(self, iteration: int) -> float:
        """Learning rate used by the optimizer step of ``iteration`` (0-based)."""
        if self.warmup_iters > 0 and iteration < self.warmup_iters:
            return self.lr * (iteration + 1) / self.warmup_iters
        if self.style == "constant":
            return self.lr
        if self.style == "inverse-square-root":  # lr at the end of warmup, then 1 / sqrt(steps taken)
            return max(self.min_lr, self.lr * math.sqrt(max(self.warmup_iters, 1) / (iteration + 1)))
        if self.style == "WSD":
            anneal = self.decay_iters - self.wsd_decay_iters
            frac = min(max(iteration - anneal, 0) / self.wsd_decay_iters, 1.0)
            return self.min_lr + _anneal(self.wsd_style, frac) * (self.lr - self.min_lr)
        span = max(self.decay_iters - self.warmup_iters, 1)
        frac = min(max(iteration - self.warmup_iters, 0) / span, 1.0)
        return self.min_lr + _anneal(self.style, frac) * (self.lr - self.min_lr)


def _anneal(shape: str, frac: float) -> float:
    """The share of (lr - min_lr) left a fraction ``frac`` into a decay of ``shape``: 1 at its start, 0 at its end."""
    if shape == "linear":
        return 1.0 - frac
    if shape == "cosine":
        return 0.5 * (math.cos(math.pi * frac) + 1.0)
    if shape == "exponential":  # 2 * 0.5^frac - 1: steepest at the start
        return 2.0 * 0.5 ** frac - 1.0
    return 1.0 - math.sqrt(frac)  # minus_sqrt


WD_INCR_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class WeightDecaySchedule:
    """Megatron-LM's weight-decay schedule: from --start-weight-decay to --end-weight-decay over the run
    (--weight-decay-incr-style linear or cosine); constant: --weight-decay throughout."""

    start: float
    end: float
    style: str
    iters: int

    def __post_init__(self):
        if self.style not in WD_INCR_STYLES:
            raise ValueError(f"unknown weight-decay increment style '{self.style}'")
        if self.start < 0 or self.end < 0:
            raise ValueError(f"--start-weight-decay and --end-weight-decay must be >= 0, got {self.start}, "
                             f"{self.end}")

    def __call__(self, iteration: int) -> float:
        """The decay of the optimizer step of ``iteration`` (0-based)."""
        if self.style == "constant":
            return self.end
        frac = min(iteration / max(self.iters, 1), 1.0)
        rise = frac if self.style == "linear" else 0.5 * (math.cos(math.pi * (1.0 - frac)) + 1.0)
        return self.start + rise * (self.end - self.start)
