"""Deterministic pieces of plan selection on several processes: simulating the candidate plans and planning the
node-group partitions (megatron_spindle/autoplan.py). Each piece depends on its inputs alone, so the selected plan
is the same whatever the number of processes. On 1024 GPUs those pieces took most of autoplan's two minutes on one
core; a GPU node's host has tens of cores, idle while rank 0 plans.

The workers are spawned (not forked: the planning process may hold process groups, a watchdog and data threads),
so the function and its arguments must pickle; the CP-SAT runs, limited by wall time, stay in the calling process.
"""

from __future__ import annotations

import multiprocessing
import os
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

# below this many devices a candidate simulates in tens of milliseconds: the workers' start would cost more
PARALLEL_MIN_DEVICES = 128
MAX_AUTO_WORKERS = 16


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity, which a launcher may have narrowed)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def pool_size(requested: int, num_devices: int) -> int:
    """Processes for the parallel pieces: 1 below ``PARALLEL_MIN_DEVICES`` devices, else ``requested``
    (--spindle-planning-workers), 0 meaning the available CPUs, at most ``MAX_AUTO_WORKERS``."""
    if num_devices < PARALLEL_MIN_DEVICES:
        return 1
    return requested if requested > 0 else min(available_cpus(), MAX_AUTO_WORKERS)


def parallel_map(fn: Callable[[Any], Any], items: Sequence[Any], workers: int) -> list[Any]:
    """``[fn(x) for x in items]``, in order, on up to ``workers`` spawned processes (in this one when
    ``workers`` <= 1 or there is at most one item). An exception in ``fn`` is raised here."""
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    context = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(max_workers=min(workers, len(items)), mp_context=context) as pool:
            return list(pool.map(fn, items))
    except BrokenProcessPool:  # a worker died: most often a calling script without the __main__ guard
        warnings.warn(f"the planning workers stopped (a script that plans on {PARALLEL_MIN_DEVICES} devices or "
                      "more needs `if __name__ == \"__main__\":` around its work, as for multiprocessing, or "
                      "--spindle-planning-workers 1); doing their work in this process", RuntimeWarning,
                      stacklevel=2)
        return [fn(x) for x in items]
