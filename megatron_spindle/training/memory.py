"""--log-memory-to-tensorboard: memory use, the largest over the ranks (Spindle's ranks hold different slices).

On CUDA the scalars are Megatron's (``torch.cuda.memory_stats``: mem-reserved-bytes, mem-allocated-bytes,
mem-max-allocated-bytes, mem-allocated-count); on the CPU the process's resident set (mem-rss-bytes) and its
peak (mem-max-rss-bytes). Collective: every rank calls ``memory_scalars`` at the same iterations.
"""

from __future__ import annotations

import os
import resource

import torch
import torch.distributed as dist

CUDA_KEYS = {"mem-reserved-bytes": "reserved_bytes.all.current", "mem-allocated-bytes": "allocated_bytes.all.current",
             "mem-max-allocated-bytes": "allocated_bytes.all.peak", "mem-allocated-count": "allocation.all.current"}


def _local() -> dict[str, float]:
    if torch.cuda.is_available():
        stats = torch.cuda.memory_stats()
        return {tag: float(stats.get(key, 0)) for tag, key in CUDA_KEYS.items()}
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"mem-rss-bytes": float(rss), "mem-max-rss-bytes": float(max(peak, rss))}


def memory_scalars() -> dict[str, float]:
    """Tag -> bytes (or count), the maximum over the ranks."""
    local = _local()
    if dist.is_initialized() and dist.get_world_size() > 1:
        v = torch.tensor(list(local.values()), dtype=torch.float64,
                         device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        local = dict(zip(local, v.tolist()))
    return local
