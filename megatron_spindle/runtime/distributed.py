"""The default process group: torchrun's world, or a world of one process. Every entry point joins it here
(pretrain_multitask.py, ``python -m megatron_spindle.runtime``, tools/profile_metaops.py).

Every process group gets the timeout of ``--distributed-timeout-minutes`` (``DistributedConfig``; the world
here, and the plan's groups through ``group_timeout()``: ``new_group`` would otherwise use torch's 30 minutes).
Under torchrun a worker also exits when its launcher dies (runtime/launcher.py).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_spindle.flags import flag

DEFAULT_TIMEOUT_MINUTES = 10.0  # as Megatron-LM's --distributed-timeout-minutes


@dataclass(frozen=True)
class DistributedConfig:
    timeout_minutes: float = field(default=DEFAULT_TIMEOUT_MINUTES, metadata=flag(
        "Timeout of every collective and point-to-point transfer, in minutes (fractions allowed); the training "
        "watchdog stops every rank, naming the missing one, when a rank waits longer. Planning on rank 0 is not "
        "bounded by it (the other ranks wait for as long as rank 0 lives).",
        name="--distributed-timeout-minutes"))

    def __post_init__(self):
        if not self.timeout_minutes > 0:
            raise ValueError(f"--distributed-timeout-minutes must be positive, got {self.timeout_minutes}")

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(minutes=self.timeout_minutes)


_group_timeout = DistributedConfig().timeout


def group_timeout() -> datetime.timedelta:
    """The timeout of the world, for the process groups created after it (runtime/groups.py)."""
    return _group_timeout


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    owned: bool  # we initialised the process group (and destroy it at the end)


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the torchrun environment; (0, 1, 0) without one."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def init_distributed(backend: str | None = None, config: DistributedConfig | None = None) -> DistContext:
    """Join torchrun's world (env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or, without torchrun, form a
    one-process world on an in-memory store (no port, nothing written to the environment, where it would leak
    into processes started later). An initialised default group is reused (``owned`` False).
    ``backend``: default nccl with CUDA, else gloo; nccl binds this process to cuda:LOCAL_RANK first.
    ``config``: the timeout of every group (default 10 minutes)."""
    global _group_timeout
    config = config or DistributedConfig()
    _, _, local = env_world()
    reuse = dist.is_initialized()
    backend = dist.get_backend() if reuse else backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(local)
    if reuse:
        return DistContext(dist.get_rank(), dist.get_world_size(), local, backend, owned=False)
    _group_timeout = config.timeout
    if "WORLD_SIZE" in os.environ:
        from megatron_spindle.runtime.launcher import exit_with_launcher

        exit_with_launcher()  # a worker whose torchrun died must not go on training (and writing checkpoints)
        dist.init_process_group(backend, init_method="env://", timeout=config.timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=config.timeout)
    return DistContext(dist.get_rank(), dist.get_world_size(), local, backend, owned=True)


def wait_for_rank0(rank: int, key: str, store=None, poll_s: float = 0.05, max_poll_s: float = 1.0) -> None:
    """Rank 0 says that its own work (planning) is done; the other ranks wait for that with no timeout. They poll
    the default group's store (the TCPStore torchrun hosts) outside any collective: a collective's timeout
    (--distributed-timeout-minutes) would end a wait for a plan that takes longer to make, as a large cluster's
    may. The training watchdog watches rank 0 meanwhile (a progress point with ``awaits=0``). ``key``: unique in
    the job (a repeated one does not wait; the collective that follows still does, within its timeout). The
    poll backs off from ``poll_s`` to ``max_poll_s``: a short plan is seen at once, and a long one costs the store
    one request per rank and second (a thousand ranks waiting minutes)."""
    store = store if store is not None else dist.distributed_c10d._get_default_store()
    key = f"spindle/rank0-done/{key}"
    if rank == 0:
        store.set(key, "1")
        return
    while not store.check([key]):
        time.sleep(poll_s)
        poll_s = min(2 * poll_s, max_poll_s)


def start_together(world_size: int, where: str) -> None:
    """A barrier after rank 0 wrote files (the plan and its chart): the ranks then enter the next step together,
    so that rank 0's writing is no other rank's wait inside a wave (the first wave's time, the watchdog's stall).
    The watchdog only checks meanwhile that rank 0 lives (``awaits=0``)."""
    if world_size > 1:
        from megatron_spindle.runtime import progress

        progress.point(where, awaits=0)
        dist.barrier()


def destroy_distributed(ctx: DistContext) -> None:
    """Tear the default group down if ``init_distributed`` created it. What the run left in reference cycles (an
    engine, through its hooks) is collected first, while the process groups and the interpreter live: freed during
    the interpreter's finalization instead, gloo objects can abort the process at exit (benchmarks/runtime_cpu.py's
    workers did, in 3 of 4 runs on a 2-core machine)."""
    if ctx.owned and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


@contextlib.contextmanager
def distributed(backend: str | None = None) -> Iterator[DistContext]:
    """``init_distributed`` for the duration of a ``with`` block."""
    ctx = init_distributed(backend)
    try:
        yield ctx
    finally:
        destroy_distributed(ctx)
