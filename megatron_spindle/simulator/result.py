"""What the simulator reports for one plan: iteration time, its breakdown, device timelines and memory."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from megatron_spindle.plan.schema import TRANSFER_KINDS


class Interval(NamedTuple):
    """A device busy from ``start`` to ``end`` running ``phase`` ("fwd" | "bwd") of slice ``slice_id``."""

    start: float
    end: float
    slice_id: str
    phase: str


@dataclass
class GroupSync:
    """Gradient synchronisation of one parameter device group (the plan's ``param_groups`` entry): its
    buckets' collectives, from the first one's start to the last one's end."""

    devices: list[int]
    num_units: int
    grad_bytes: float  # per rank, after TP sharding (every synced micro-batch's)
    ranks: int  # data-parallel replicas in the ring
    cross_island: bool
    start: float
    end: float
    buckets: int = 1  # bucket collectives (once per synced micro-batch)
    comm_seconds: float = 0.0  # the buckets' collectives, summed

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class SimResult:
    """Simulated iteration of a plan.

    The breakdown is additive: ``compute + transfer + grad_sync + optimizer + param_gather == iteration_time``,
    where

    - ``compute`` is the makespan with free transfers and no gradient synchronisation (forward + backward
      compute, TP all-reduces, ZeRO-3 gathers not hidden by compute, kernel-launch floor);
    - ``transfer`` is what inter-wave transfers (activations forward, their gradients backward) add to it;
      ``transfer_by_kind`` splits it in proportion to the seconds each route (local copy, NVLink inside an
      island, network across islands) spends moving data;
    - ``grad_sync`` is what the gradient synchronisation of the parameter device groups adds: the buckets
      not hidden behind the backward, and the backward's slowdown while they overlap it;
    - ``optimizer`` is what the devices' AdamW steps (``optimizer_steps``: per device (start, end)) add after
      that;
    - ``param_gather`` is what the all-gathers of the updated weights add after the step (ZeRO 1 and 2; at
      ZeRO-3 the redistribution of the regathered groups' weights, plan/buckets.py ``regather_collective``).
    """

    iteration_time: float
    compute_time: float
    transfer_time: float
    grad_sync_time: float
    transfer_by_kind: dict[str, float]
    transfer_bytes_by_kind: dict[str, float]  # forward activation bytes received, by route
    transfer_seconds_by_kind: dict[str, float]  # summed durations of all transfers (forward + backward)
    grad_sync: list[GroupSync]
    busy: list[list[Interval]]  # per device, in time order
    peak_memory: list[float]  # bytes per device
    forward_end: float = 0.0
    num_devices: int = 0
    extras: dict[str, Any] = field(default_factory=dict)
    optimizer_time: float = 0.0
    optimizer_steps: list[tuple[float, float]] = field(default_factory=list)  # per device: AdamW (start, end)
    transfer_backward_bytes_by_kind: dict[str, float] = field(default_factory=dict)  # input gradients, by route
    param_gather_time: float = 0.0

    # --------------------------------------------------------------------------------- derived
    @property
    def utilisation(self) -> list[float]:
        """Per device: fraction of the iteration spent computing."""
        if self.iteration_time <= 0:
            return [0.0] * len(self.busy)
        return [sum(i.end - i.start for i in ivs) / self.iteration_time for ivs in self.busy]

    @property
    def mean_utilisation(self) -> float:
        u = self.utilisation
        return sum(u) / len(u) if u else 0.0

    @property
    def transfer_share(self) -> float:
        return self.transfer_time / self.iteration_time if self.iteration_time > 0 else 0.0

    @property
    def grad_sync_share(self) -> float:
        return self.grad_sync_time / self.iteration_time if self.iteration_time > 0 else 0.0

    def utilisation_over_time(self, num_bins: int = 50) -> list[float]:
        """Fraction of devices computing in each of ``num_bins`` equal slices of the iteration."""
        if self.iteration_time <= 0 or num_bins <= 0:
            return [0.0] * max(num_bins, 0)
        width = self.iteration_time / num_bins
        bins = [0.0] * num_bins
        for ivs in self.busy:
            for iv in ivs:
                first = min(int(iv.start / width), num_bins - 1)
                last = min(int(iv.end / width), num_bins - 1)
                for b in range(first, last + 1):
                    lo, hi = b * width, (b + 1) * width
                    bins[b] += max(0.0, min(hi, iv.end) - max(lo, iv.start))
        n = max(len(self.busy), 1)
        return [x / (width * n) for x in bins]

    def breakdown(self) -> dict[str, float]:
        out = {"iteration_time": self.iteration_time, "compute": self.compute_time,
               "transfer": self.transfer_time, "grad_sync": self.grad_sync_time, "optimizer": self.optimizer_time,
               "param_gather": self.param_gather_time}
        for k in TRANSFER_KINDS:
            out[f"transfer_{k}"] = self.transfer_by_kind.get(k, 0.0)
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["utilisation"] = self.utilisation
        d["mean_utilisation"] = self.mean_utilisation
        return d
