"""The ranks taking part in profiling, their process groups, and the timing loop every measurement uses."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_spindle.runtime.distributed import group_timeout


@dataclass
class ProfileWorld:
    """The ranks taking part: ``world_size`` ranks in nodes of ``local_world_size`` (torchrun's
    LOCAL_WORLD_SIZE), one device each. Works without torch.distributed (one rank)."""

    rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _groups: dict[tuple[int, ...], Any] = field(default_factory=dict, repr=False)

    @classmethod
    def current(cls, device: torch.device | str | None = None) -> ProfileWorld:
        if device is None:
            device = torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if not (dist.is_available() and dist.is_initialized()):
            return cls(0, 1, 1, device)
        world = dist.get_world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if local <= 0 or world % local:
            local = world
        return cls(dist.get_rank(), world, local, device)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    def node(self, rank: int) -> int:
        return rank // self.local_world_size

    def group(self, ranks: Sequence[int]):
        """The process group of ``ranks`` (None for one rank). Collective on the first call for a set of ranks:
        every rank must ask for the same groups in the same order."""
        ranks = tuple(sorted(ranks))
        if len(ranks) <= 1:
            return None
        if ranks == tuple(range(self.world_size)):
            return dist.group.WORLD
        if ranks not in self._groups:
            self._groups[ranks] = dist.new_group(list(ranks), timeout=group_timeout())
        return self._groups[ranks]

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_max(self, values: Sequence[float]) -> list[float]:
        """Element-wise max over the ranks (every rank gets the same numbers)."""
        if not self.distributed:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64,
                         device=self.device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(v) for v in t.cpu()]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def tp_group(self, tp: int):
        """(group, is_member) of this rank for TP degree tp: consecutive blocks of tp ranks (whole blocks only;
        leftover ranks idle). Collective (creates every block's group)."""
        blocks = [tuple(range(k * tp, (k + 1) * tp)) for k in range(self.world_size // tp)]
        mine = None
        for block in blocks:
            g = self.group(block)
            if self.rank in block:
                mine = g
        member = any(self.rank in b for b in blocks)
        return mine, member


# A fixed burst of bf16 matmuls (about 0.1 s on an H100, 0.25 s on an A100) that a GPU runs before each measured
# config: host-bound measurements leave it mostly idle, and a few runs of a large operator after them may be timed
# before its clocks are up (the fortieth session's H100: the ViT-H layer measured 15.5 ms per layer in one profile,
# 5.5 in another taken after training runs, 4.3-5.9 in training). The same count on every rank: no rank waits.
DEVICE_WARMUP_MATMULS = 64
DEVICE_WARMUP_SIZE = 8192


def warm_device(world: ProfileWorld) -> None:
    """Busy the GPU with ``DEVICE_WARMUP_MATMULS`` matmuls of ``DEVICE_WARMUP_SIZE``^2 in bf16 and wait for them
    (nothing on a CPU)."""
    if world.device.type != "cuda":
        return
    a = torch.randn(DEVICE_WARMUP_SIZE, DEVICE_WARMUP_SIZE, device=world.device, dtype=torch.bfloat16)
    for _ in range(DEVICE_WARMUP_MATMULS):
        torch.mm(a, a)
    world.sync()
    del a


def median_seconds(fn: Callable[[], None], world: ProfileWorld, warmup: int, repeats: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after ``warmup`` untimed ones (device-synchronised)."""
    for _ in range(warmup):
        fn()
    world.sync()
    times = []
    for _ in range(repeats):
        world.sync()
        t0 = time.perf_counter()
        fn()
        world.sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
