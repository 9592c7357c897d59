"""Memory use: --log-memory-to-tensorboard's scalars, the largest over the ranks (Spindle's ranks hold different
slices), and Megatron-LM's report after the first logged interval on CUDA, a line per rank.

On CUDA the scalars are Megatron's (``torch.cuda.memory_stats``: mem-reserved-bytes, mem-allocated-bytes,
mem-max-allocated-bytes, mem-allocated-count); on the CPU the process's resident set (mem-rss-bytes) and its
peak (mem-max-rss-bytes). Collective: every rank calls ``memory_scalars`` and ``memory_report`` at the same
iterations.
"""

from __future__ import annotations

import os
import re
import resource

import torch
import torch.distributed as dist

from megatron_spindle.training.engine_state import over_ranks

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
    return dict(zip(local, over_ranks(torch.tensor(list(local.values()), dtype=torch.float64)).tolist()))


MB = 2**20  # Megatron-LM's report is in MiB, written "MB"
# (what the report calls it, torch.cuda.memory_stats' key)
REPORT_KEYS = (("allocated", "allocated_bytes.all.current"), ("max allocated", "allocated_bytes.all.peak"),
               ("reserved", "reserved_bytes.all.current"), ("max reserved", "reserved_bytes.all.peak"))


def report_lines(iteration: int, per_rank: list[list[float]]) -> list[str]:
    """Megatron-LM's lines, ``[Rank r] (after N iterations) memory (MB) | allocated: ... | max reserved: ...``,
    from each rank's bytes in ``REPORT_KEYS``' order."""
    return [f"[Rank {rank}] (after {iteration} iterations) memory (MB) | "
            + " | ".join(f"{name}: {value / MB:.1f}" for (name, _), value in zip(REPORT_KEYS, values))
            for rank, values in enumerate(per_rank)]


def memory_report(iteration: int) -> list[str]:
    """Every rank's CUDA memory (the peaks since the start: the planner's per-device prediction is a peak), as
    ``report_lines``; gathered to every rank. Collective."""
    from megatron_spindle.training.multinode import all_gather_objects

    stats = torch.cuda.memory_stats()
    local = [float(stats.get(key, 0)) for _, key in REPORT_KEYS]
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return report_lines(iteration, [local])
    return report_lines(iteration, all_gather_objects(local))


REPORT_LINE = re.compile(r"^\[Rank (\d+)\] \(after \d+ iterations\) memory \(MB\) \|.*\| max allocated: ([0-9.]+) \|")


def parse_report_line(line: str) -> tuple[int, float] | None:
    """(rank, peak bytes allocated) of a ``report_lines`` line; None for any other line."""
    m = REPORT_LINE.search(line)
    return (int(m.group(1)), float(m.group(2)) * MB) if m else None
