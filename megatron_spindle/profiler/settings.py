"""How to measure: part of the cache key, so profiles taken with other settings are not reused."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatron_spindle.estimator.errors import EstimatorError
from megatron_spindle.flags import finite_float, flag
from megatron_spindle.plan.schema import ATTENTION_BACKENDS, DROPOUTS, dropout_probability

# 2: the "optimizer" section; 3: the message probe computes with the workload's layer, the forward is timed inside
# the forward + backward repeats, and AdamW's cost per element on tensors of the workload's unit sizes; 4: the
# optimizer section also times the gradient norm and the bf16 weights' write, and the attention backend is recorded;
# 5: the sharded runtime's copies are timed as it now makes them (a few operations per unit, not per tensor);
# 6: the CPU overlap constants are fitted per trial (a fit of medians could blow up) and the latency of a link is
# the median of 31 small messages, not 5 (profiler/comm.py): profiles measured before are not reused
PROFILER_VERSION = 6


def _patterns(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


@dataclass(frozen=True)
class ProfilerSettings:
    """How to measure; the flagged fields are tools/profile_metaops.py's ``--profile-*`` flags (and --bf16)."""

    layers: int = field(default=2, metadata=flag("Operators timed together per layer MetaOp: min(L, this)."))
    warmup: int = field(default=2, metadata=flag("Untimed runs before timing."))
    repeats: int = field(default=5, metadata=flag("Timed runs; the median is kept."))
    max_n: int | None = field(default=None, metadata=flag("Skip configs with tp * dp above this."))
    metaops: tuple[str, ...] = field(default=(), metadata=flag(
        "Comma-separated MetaOp ids or fnmatch patterns to profile (default: all).", type=_patterns,
        metavar="PATTERNS"))
    bf16: bool = field(default=False, metadata=flag("bf16 parameters (CUDA only); default fp32.", name="--bf16"))
    attention_backend: str = field(default="auto", metadata=flag(
        "The attention core measured, as pretrain_multitask.py's --attention-backend (auto: Transformer Engine's "
        "choice where TE runs here, else megatron-core's local spec). The profile records it, and plans made on the "
        "profile run it.", name="--attention-backend", choices=ATTENTION_BACKENDS))
    hidden_dropout: float = field(default=0.0, metadata=flag(
        "The layers' dropout measured, as pretrain_multitask.py's --hidden-dropout: the profile records it, and "
        "a plan with other dropout refuses the profile.", name="--hidden-dropout", type=finite_float))
    attention_dropout: float = field(default=0.0, metadata=flag(
        "As --hidden-dropout, for pretrain_multitask.py's --attention-dropout.", name="--attention-dropout",
        type=finite_float))
    bandwidth_sizes: tuple[int, ...] = (4, 1 << 16, 1 << 20, 1 << 22)  # message bytes; the largest gives bw
    seed: int = 0

    def __post_init__(self):
        if self.layers < 1 or self.repeats < 1 or self.warmup < 0:
            raise EstimatorError("profiler: layers and repeats must be >= 1, warmup >= 0")
        if self.max_n is not None and self.max_n < 1:
            raise EstimatorError("profiler: max_n must be >= 1")
        for name in DROPOUTS:
            object.__setattr__(self, name, dropout_probability(getattr(self, name), name, EstimatorError))
        if not self.bandwidth_sizes or min(self.bandwidth_sizes) <= 0:
            raise EstimatorError("profiler: bandwidth_sizes must be positive byte counts")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def gpu_bandwidth_sizes() -> tuple[int, ...]:
    """Message sizes for NVLink / InfiniBand: large enough to reach the links' bandwidth."""
    return (4, 1 << 20, 1 << 24, 1 << 28)
