"""What profiled times depend on (device, links, software, settings) and the profile cache keyed by it."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.workload import Workload
from megatron_spindle.profiler.settings import PROFILER_VERSION, ProfilerSettings
from megatron_spindle.profiler.world import ProfileWorld


def software_versions() -> dict[str, str]:
    def version(dist_name: str) -> str:
        try:
            return importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            return "unknown"

    return {
        "torch": torch.__version__,
        "megatron-core": version("megatron-core"),
        "python": platform.python_version(),
        "cuda": str(torch.version.cuda),
        "profiler": str(PROFILER_VERSION),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_hardware(world: ProfileWorld) -> dict[str, Any]:
    """What the times depend on: device model, devices per node, nodes (and CPU threads on CPU)."""
    if world.device.type == "cuda":
        props = torch.cuda.get_device_properties(world.device)
        device = {"type": "cuda", "name": props.name, "memory_bytes": int(props.total_memory),
                  "capability": f"{props.major}.{props.minor}"}
    else:
        device = {"type": "cpu", "name": _cpu_model(), "threads": torch.get_num_threads()}
    return {
        "device": device,
        "devices_per_node": world.local_world_size,
        "nodes": world.num_nodes,
        "world_size": world.world_size,
        "backend": dist.get_backend() if world.distributed else "none",
    }


def profile_key(workload: Workload, cluster: ClusterSpec, hardware: dict, versions: dict,
                settings: ProfilerSettings) -> str:
    """Cache key: (workload digest, target cluster, hardware, versions, settings)."""
    blob = json.dumps({"workload": workload.digest(), "cluster": cluster.digest(), "hardware": hardware,
                       "versions": versions, "settings": settings.to_dict()}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path(os.environ.get("MEGATRON_SPINDLE_CACHE", Path.home() / ".cache" / "megatron-spindle"))


def cache_path(cache_dir: str | Path, workload: Workload, key: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in workload.name)
    return Path(cache_dir) / "profiles" / f"{safe}-{key}.json"
