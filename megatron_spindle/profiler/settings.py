"""How to measure: part of the cache key, so profiles taken with other settings are not reused."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron_spindle.estimator.errors import EstimatorError

PROFILER_VERSION = 2  # 2: the "optimizer" section


@dataclass(frozen=True)
class ProfilerSettings:
    layers: int = 2  # operators timed per layer MetaOp: min(L, layers)
    warmup: int = 2
    repeats: int = 5
    max_n: int | None = None  # skip configs with tp * dp above this
    metaops: tuple[str, ...] = ()  # fnmatch patterns of MetaOp ids to profile (empty: all)
    bf16: bool = False  # bf16 parameters (needs CUDA)
    bandwidth_sizes: tuple[int, ...] = (4, 1 << 16, 1 << 20, 1 << 22)  # message bytes; the largest gives bw
    seed: int = 0

    def __post_init__(self):
        if self.layers < 1 or self.repeats < 1 or self.warmup < 0:
            raise EstimatorError("profiler: layers and repeats must be >= 1, warmup >= 0")
        if self.max_n is not None and self.max_n < 1:
            raise EstimatorError("profiler: max_n must be >= 1")
        if not self.bandwidth_sizes or min(self.bandwidth_sizes) <= 0:
            raise EstimatorError("profiler: bandwidth_sizes must be positive byte counts")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def gpu_bandwidth_sizes() -> tuple[int, ...]:
    """Message sizes for NVLink / InfiniBand: large enough to reach the links' bandwidth."""
    return (4, 1 << 20, 1 << 24, 1 << 28)
