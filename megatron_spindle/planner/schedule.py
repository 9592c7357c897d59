"""The wavefront schedule before placement: which MetaOp layers run in which wave, on how many devices.

Produced by the wavefront scheduler (or a baseline / the CP-SAT model), consumed by placement, which picks
the concrete devices and turns it into a ``Plan``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_spindle.plan.schema import Slice


@dataclass
class ScheduledSlice:
    metaop: str
    n: int  # devices
    tp: int
    dp: int
    layer_start: int  # relative to the MetaOp's chain
    layer_end: int
    time: float  # seconds: T_m(n) * (layer_end - layer_start)
    devices: list[int] | None = None  # filled by placement (or pinned by a planner that places itself)


def scheduled_slice(s: Slice, device_offset: int = 0) -> ScheduledSlice:
    """A plan's slice back as a placed schedule slice (its devices shifted by ``device_offset``)."""
    return ScheduledSlice(s.metaop, len(s.devices), s.tp, s.dp, s.layer_start, s.layer_end, s.predicted_time,
                          [d + device_offset for d in s.devices])


@dataclass
class ScheduledWave:
    level: int
    start: float
    duration: float
    slices: list[ScheduledSlice] = field(default_factory=list)

    @property
    def end(self) -> float:
        return self.start + self.duration

    @property
    def devices_used(self) -> int:
        return sum(s.n for s in self.slices)


@dataclass
class LevelAllocation:
    """The allocator's answer for one MetaLevel: C~*, the continuous n*, and the rounded bi-point tuples."""

    level: int
    c_star: float
    n_star: dict[str, float]
    tuples: dict[str, list[tuple[int, int]]]  # metaop -> [(n, l), ...], larger n first, l summing to L


def back_to_back(waves: list[ScheduledWave]) -> list[ScheduledWave]:
    """``waves`` in their order, re-timed from 0, each starting when the previous one ends (level barriers)."""
    out, t = [], 0.0
    for w in waves:
        out.append(ScheduledWave(w.level, t, w.duration, list(w.slices)))
        t += w.duration
    return out
