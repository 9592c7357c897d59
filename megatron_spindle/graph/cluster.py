"""Cluster specification: nodes of identical GPUs, NVLink inside a node (an island), a network between nodes."""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, asdict, dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from megatron_spindle.graph.yaml_loader import load_yaml_file, yaml_error_text

GB = 1e9
GiB = 2**30


class ClusterError(ValueError):
    pass


@dataclass(frozen=True)
class GPUSpec:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    memory_bytes: float
    memory_bandwidth: float  # HBM bytes/s


# Vendor datasheet numbers (dense bf16, no sparsity).
GPU_TYPES: dict[str, GPUSpec] = {
    "A800-80GB": GPUSpec("A800-80GB", 312e12, 80 * GiB, 2.039e12),
    "A100-80GB": GPUSpec("A100-80GB", 312e12, 80 * GiB, 2.039e12),
    "H100": GPUSpec("H100", 989e12, 80 * GiB, 3.35e12),
    "H200": GPUSpec("H200", 989e12, 141 * GiB, 4.8e12),
    # A CPU "device" for the gloo runtime and tests: small numbers so that plans stay meaningful.
    "CPU": GPUSpec("CPU", 50e9, 8 * GiB, 20e9),
}

# Per-GPU link bandwidths in bytes/s (unidirectional): NVLink inside a node, the NIC share between nodes.
NODE_TYPES: dict[str, dict[str, Any]] = {
    "A800-80GB": {"gpu": "A800-80GB", "gpus_per_node": 8, "intra_node_bw": 200 * GB, "inter_node_bw": 50 * GB},
    "A100-80GB": {"gpu": "A100-80GB", "gpus_per_node": 8, "intra_node_bw": 300 * GB, "inter_node_bw": 25 * GB},
    "H100": {"gpu": "H100", "gpus_per_node": 8, "intra_node_bw": 450 * GB, "inter_node_bw": 50 * GB},
    "H200": {"gpu": "H200", "gpus_per_node": 8, "intra_node_bw": 450 * GB, "inter_node_bw": 50 * GB},
    "CPU": {"gpu": "CPU", "gpus_per_node": 8, "intra_node_bw": 5 * GB, "inter_node_bw": 1 * GB},
}


@dataclass(frozen=True)
class ClusterSpec:
    """``num_nodes`` x ``gpus_per_node`` devices; device d lives on node (island) d // gpus_per_node."""

    num_nodes: int
    gpus_per_node: int
    gpu: GPUSpec
    intra_node_bw: float  # bytes/s per GPU over NVLink
    inter_node_bw: float  # bytes/s per GPU across nodes
    intra_node_latency: float = 5e-6
    inter_node_latency: float = 10e-6

    def __post_init__(self):
        for what in ("num_nodes", "gpus_per_node"):
            v = getattr(self, what)
            if not isinstance(v, int) or v <= 0:
                raise ClusterError(f"cluster: {what} must be a positive integer, got {v!r}")
        for what in ("intra_node_bw", "inter_node_bw"):
            if getattr(self, what) <= 0:
                raise ClusterError(f"cluster: {what} must be positive")

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def island(self, device: int) -> int:
        return device // self.gpus_per_node

    def same_island(self, devices) -> bool:
        return len({self.island(d) for d in devices}) <= 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def digest(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ClusterSpec:
        d = dict(d)
        gpu = d.pop("gpu")
        gpu = _gpu_from_dict(gpu) if isinstance(gpu, dict) else gpu_type(gpu)
        _check_fields("cluster", d, cls, {"gpu"})
        return cls(gpu=gpu, **d)


def _check_fields(where: str, d: dict[str, Any], cls: type, skip: set[str]) -> None:
    """Unknown, missing or non-numeric fields of a cluster or GPU mapping, by name."""
    fields = cls.__dataclass_fields__
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ClusterError(f"{where}: unknown field(s) {unknown} (known: {sorted(set(fields) - skip)})")
    missing = sorted(k for k, f in fields.items() if k not in skip and k not in d and f.default is MISSING)
    if missing:
        raise ClusterError(f"{where}: missing field(s) {missing}")
    for k, v in d.items():
        if k != "name" and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v == v):
            raise ClusterError(f"{where}: {k} must be a number, got {v!r}")


def _gpu_from_dict(d: dict[str, Any]) -> GPUSpec:
    _check_fields("cluster gpu", d, GPUSpec, set())
    for k in ("peak_flops", "memory_bytes", "memory_bandwidth"):
        if d[k] <= 0:
            raise ClusterError(f"cluster gpu: {k} must be positive, got {d[k]!r}")
    return GPUSpec(**d)


def gpu_type(name: str) -> GPUSpec:
    if not isinstance(name, str):
        raise ClusterError(f"cluster: gpu must be a GPU type name or a mapping, got {name!r}")
    try:
        return GPU_TYPES[name]
    except KeyError:
        raise ClusterError(f"unknown GPU type '{name}' (built-in: {', '.join(GPU_TYPES)})") from None


def make_cluster(num_gpus: int, gpus_per_node: int = 8, gpu_type_name: str = "A800-80GB", **overrides) -> ClusterSpec:
    """A cluster of ``num_gpus`` devices of a built-in node type (fewer than a node: one partial node)."""
    if num_gpus <= 0:
        raise ClusterError(f"cluster: number of GPUs must be positive, got {num_gpus}")
    node = NODE_TYPES.get(gpu_type_name)
    if node is None:
        raise ClusterError(f"unknown GPU type '{gpu_type_name}' (built-in: {', '.join(NODE_TYPES)})")
    if gpus_per_node <= 0:
        raise ClusterError(f"cluster: GPUs per node must be positive, got {gpus_per_node}")
    per_node = min(gpus_per_node, num_gpus)
    if num_gpus % per_node:
        raise ClusterError(f"cluster: {num_gpus} GPUs is not a whole number of {per_node}-GPU nodes")
    spec = ClusterSpec(
        num_nodes=num_gpus // per_node,
        gpus_per_node=per_node,
        gpu=GPU_TYPES[node["gpu"]],
        intra_node_bw=node["intra_node_bw"],
        inter_node_bw=node["inter_node_bw"],
    )
    return replace(spec, **overrides) if overrides else spec


def load_cluster(path: str | Path) -> ClusterSpec:
    """YAML: {num_nodes, gpus_per_node, gpu: A800-80GB | {name, peak_flops, ...}, intra_node_bw, inter_node_bw}
    (bandwidths in bytes/s; omitted ones come from the built-in node type of the GPU)."""
    try:
        d = load_yaml_file(path)
    except yaml.YAMLError as e:
        raise ClusterError(f"cluster {path}: {yaml_error_text(e)}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ClusterError(f"cluster {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if not isinstance(d, dict) or "gpu" not in d:
        raise ClusterError(f"cluster {path}: a cluster needs at least 'gpu', 'num_nodes' and 'gpus_per_node'")
    if isinstance(d["gpu"], str) and d["gpu"] in NODE_TYPES:
        node = NODE_TYPES[d["gpu"]]
        d.setdefault("intra_node_bw", node["intra_node_bw"])
        d.setdefault("inter_node_bw", node["inter_node_bw"])
        d.setdefault("gpus_per_node", node["gpus_per_node"])
    try:
        return ClusterSpec.from_dict(d)
    except ClusterError as e:
        raise ClusterError(f"cluster {path}: {e}") from None
