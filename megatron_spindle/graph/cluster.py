"""Cluster specification: nodes of identical GPUs, NVLink inside a node (an island), a network between nodes.

Every hardware constant below is named and cites where it comes from: a point of ``../shared/cost-model-data.md``
(C1..C12), a public measurement, or a datasheet; "estimate" marks the ones no measurement pins down. The per-kernel
and communication models that use them live in ``estimator/kernels.py`` and ``estimator/comm_model.py``.

Units: FLOP/s, bytes, bytes/s with GB = 1e9 (the nccl-tests convention). Bus bandwidths follow nccl-tests: for an
all-reduce over n ranks busbw = algbw * 2(n-1)/n, for all-gather / reduce-scatter busbw = algbw * (n-1)/n.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, asdict, dataclass, replace
from pathlib import Path
from typing import Any

from megatron_spindle.graph.yaml_loader import load_yaml_as

GB = 1e9
GiB = 2**30
# Galvatron's hardware profiles (AFDWang/Hetu-Galvatron, profile_hardware/profile_allreduce.py, profile_p2p.py)
# divide MiB (2**20 bytes) by milliseconds: one of their "GB/s" is 2**20 / 1e-3 bytes/s.
MIB_PER_MS = 2**20 / 1e-3


class ClusterError(ValueError):
    pass


# ------------------------------------------------------------------------------------------- compute constants

# Dense bf16 tensor-core peaks (datasheets: NVIDIA A100 datasheet 312 TF/s; H100 SXM / H200 SXM 989 TF/s).
A100_PEAK_BF16 = 312e12
H100_PEAK_BF16 = 989e12
# SM counts (A100 whitepaper: 108 SMs on A100 SXM, the A800 is the same die; H100 SXM5 / H200: 132 SMs).
A100_SM_COUNT = 108
H100_SM_COUNT = 132
# Maximum achievable matmul FLOP/s (MAMF), measured by stas00/ml-engineering (compute/accelerator/README.md, "Maximum
# Achievable Matmul FLOPS comparison table"): A100 SXM 267.9 TF/s (C1; commit 970d8bc of that file, best shape
# 6912x16384x2048); H100 SXM 794.5 TF/s (torch 2.7, "H200 is the same").
A100_MAMF_BF16 = 267.9e12
H100_MAMF_BF16 = 794.5e12
# HBM datasheet bandwidths: A100 80GB 2.039 TB/s, H100 SXM 3.35 TB/s, H200 4.8 TB/s (NVIDIA datasheets).
A100_HBM_BW = 2.039e12
H100_HBM_BW = 3.35e12
H200_HBM_BW = 4.8e12
# Streaming element-wise kernels reach about 85 % of the HBM datasheet bandwidth (estimate: large copies on A100 /
# H100 typically measure 80-90 %; benchmarks/gpu_validate.sh measures it on the device at hand). The cost model's
# CostModelConfig.memory_efficiency defaults to it.
HBM_STREAM_EFFICIENCY = 0.85


@dataclass(frozen=True)
class GPUSpec:
    name: str
    peak_flops: float  # dense bf16 FLOP/s (datasheet)
    memory_bytes: float
    memory_bandwidth: float  # HBM bytes/s (datasheet)
    sm_count: int = A100_SM_COUNT
    # measured maximum achievable bf16 matmul FLOP/s; 0: peak_flops * DEFAULT_MAMF_FRACTION
    matmul_flops: float = 0.0
    # kernel family: GEMM tile set and FlashAttention curve of estimator/kernels.py (ampere | hopper | cpu)
    arch: str = "ampere"

    @property
    def achievable_matmul_flops(self) -> float:
        return self.matmul_flops or self.peak_flops * DEFAULT_MAMF_FRACTION


# A GPU spec without a measured MAMF (a user's YAML) gets A100's measured fraction of peak (C1: 267.9 / 312).
DEFAULT_MAMF_FRACTION = A100_MAMF_BF16 / A100_PEAK_BF16

GPU_TYPES: dict[str, GPUSpec] = {
    "A800-80GB": GPUSpec("A800-80GB", A100_PEAK_BF16, 80 * GiB, A100_HBM_BW, A100_SM_COUNT, A100_MAMF_BF16),
    "A100-80GB": GPUSpec("A100-80GB", A100_PEAK_BF16, 80 * GiB, A100_HBM_BW, A100_SM_COUNT, A100_MAMF_BF16),
    "H100": GPUSpec("H100", H100_PEAK_BF16, 80 * GiB, H100_HBM_BW, H100_SM_COUNT, H100_MAMF_BF16, arch="hopper"),
    "H200": GPUSpec("H200", H100_PEAK_BF16, 141 * GiB, H200_HBM_BW, H100_SM_COUNT, H100_MAMF_BF16, arch="hopper"),
    # A CPU "device" for the gloo runtime and tests: placeholder numbers so that plans stay meaningful (no tiles,
    # no GPU kernel curves: see the "cpu" family in estimator/kernels.py).
    "CPU": GPUSpec("CPU", 50e9, 8 * GiB, 20e9, sm_count=1, matmul_flops=50e9, arch="cpu"),
}

# ------------------------------------------------------------------------------------- communication constants

# All-reduce bus bandwidth inside one node, large messages:
# - A800 (NVLink limited to 400 GB/s): C8, Galvatron allreduce_bandwidth_2nodes_8gpus_per_node.json, 153.45 /
#   152.38 / 151.23 "GB/s" (MiB/ms) for 8 / 4 / 2 GPUs at 64 MiB messages = 160.9 / 159.8 / 158.6 GB/s; we take 8.
# - A100 (NVLink 3, 600 GB/s): stas00/ml-engineering network/README.md, nccl-tests all_reduce_perf on 8 A100s:
#   234.89 GB/s at 16 GiB.
# - H100 / H200 (NVLink 4, 900 GB/s): same file, 8x H200 with NCCL's ring (NCCL_NVLS_ENABLE=0): 367.61 GB/s; the
#   ring is also what all-gather / reduce-scatter get (361.4 / 362.9 GB/s).
A800_NVLINK_BUS_BW = 153.454 * MIB_PER_MS
A100_NVLINK_BUS_BW = 234.89 * GB
H100_NVLINK_BUS_BW = 367.61 * GB
# NVLink SHARP (NVLS) all-reduce on 8x H200 by GPU count, 8 GiB (same file; NCCL picks it above 4 GPUs, from 2 MiB
# messages): 414.2 / 435.6 / 460.0 / 473.1 GB/s for 5 / 6 / 7 / 8 GPUs.
H100_NVLS_BUS_BW = {5: 414.2 * GB, 6: 435.6 * GB, 7: 460.0 * GB, 8: 473.1 * GB}
NVLS_MIN_BYTES = 2 * 2**20
# Across nodes (C9, the same Galvatron file, 2 nodes of 8 A800s, 400 Gbps InfiniBand per the paper):
# - one 16-GPU group (consecutive ranks) reaches 45.69 MiB/ms = 47.9 GB/s: the ring of one group;
# - strided groups (consec_0), several at once: 9.28 / 19.25 / 32.11 MiB/ms for groups of 2 / 4 / 8 (8 / 4 / 2
#   groups at once, 1 / 2 / 4 GPUs per node). Together they move 8 x 9.73, 4 x 20.19, 2 x 33.67 = 77.9 / 80.7 /
#   67.3 GB/s per node: the node's network, 75.3 GB/s on average, is shared by the groups that cross it;
# - point to point (Galvatron p2p_bandwidth_2nodes_8gpus_per_node.json, send/recv across the node boundary):
#   8.82 / 8.90 / 8.81 MiB/ms for pp 4 / 8 / 16 = 9.27 GB/s: one GPU's own path to the network.
A800_CROSS_NODE_RING_BW = 45.6885 * MIB_PER_MS
A800_NODE_NETWORK_BW = (8 * 9.28218 + 4 * 19.2516 + 2 * 32.111) / 3 * MIB_PER_MS
A800_NETWORK_RAIL_BW = (8.8167 + 8.90184 + 8.81364) / 3 * MIB_PER_MS
# DGX A100 (8x HDR 200 Gbps per node): one HCA reaches its 24 GB/s (NVIDIA/nccl issue 1048); a node of 4 HCAs
# all-reduced at 86 of 96 GB/s (same issue, 90 %), so 8 HCAs give about 0.9 x 8 x 25 = 180 GB/s (estimate).
A100_NETWORK_RAIL_BW = 24 * GB
A100_NODE_NETWORK_BW = 0.9 * 8 * 25 * GB
# DGX H100 / H200 (8x NDR 400 Gbps): "For NDR @ 400Gbps you should see 46-48GB/s per NIC" (NVIDIA/nccl-tests
# issue 290, a maintainer); the node: 8 NICs at 47 GB/s (estimate, as for A100).
H100_NETWORK_RAIL_BW = 47 * GB
H100_NODE_NETWORK_BW = 8 * 47 * GB
# Latency of one collective (small message):
# - in a node: nccl-tests all_reduce_perf on 8 A100s takes 43.83 us at 32 KiB (stas00/ml-engineering
#   network/README.md); 8x H200 with torch all_reduce_bench: algbw 0.82 GB/s at 32 KiB = 40 us (same file);
# - crossing the network adds 19.9 us: nccl-tests 8-byte all-reduce between two A100 nodes over HDR InfiniBand,
#   one GPU each (NVIDIA/nccl-tests issue 150).
A100_COLLECTIVE_LATENCY = 43.83e-6
H100_COLLECTIVE_LATENCY = 32 * 2**10 / (0.82 * GB)
NETWORK_COLLECTIVE_LATENCY = 19.9e-6

# Per node type: the GPU, its node size and the links above (bus bandwidths in bytes/s).
NODE_TYPES: dict[str, dict[str, Any]] = {
    "A800-80GB": {"gpu": "A800-80GB", "gpus_per_node": 8, "intra_node_bw": A800_NVLINK_BUS_BW,
                  "inter_node_bw": A800_CROSS_NODE_RING_BW, "node_network_bw": A800_NODE_NETWORK_BW,
                  "network_rail_bw": A800_NETWORK_RAIL_BW, "collective_latency": A100_COLLECTIVE_LATENCY},
    "A100-80GB": {"gpu": "A100-80GB", "gpus_per_node": 8, "intra_node_bw": A100_NVLINK_BUS_BW,
                  "inter_node_bw": A100_NODE_NETWORK_BW, "node_network_bw": A100_NODE_NETWORK_BW,
                  "network_rail_bw": A100_NETWORK_RAIL_BW, "collective_latency": A100_COLLECTIVE_LATENCY},
    "H100": {"gpu": "H100", "gpus_per_node": 8, "intra_node_bw": H100_NVLINK_BUS_BW,
             "inter_node_bw": H100_NODE_NETWORK_BW, "node_network_bw": H100_NODE_NETWORK_BW,
             "network_rail_bw": H100_NETWORK_RAIL_BW, "collective_latency": H100_COLLECTIVE_LATENCY,
             "nvls_bus_bw": tuple(H100_NVLS_BUS_BW.items())},
    "H200": {"gpu": "H200", "gpus_per_node": 8, "intra_node_bw": H100_NVLINK_BUS_BW,
             "inter_node_bw": H100_NODE_NETWORK_BW, "node_network_bw": H100_NODE_NETWORK_BW,
             "network_rail_bw": H100_NETWORK_RAIL_BW, "collective_latency": H100_COLLECTIVE_LATENCY,
             "nvls_bus_bw": tuple(H100_NVLS_BUS_BW.items())},
    # placeholders for the gloo runtime on CPUs
    "CPU": {"gpu": "CPU", "gpus_per_node": 8, "intra_node_bw": 5 * GB, "inter_node_bw": 1 * GB,
            "collective_latency": 20e-6},
}
# ClusterSpec fields only a profile sets; left out of to_dict (and so of the digest) while 0
MEASURED_ONLY_KEYS = ("p2p_latency", "message_host_seconds", "overlap_slowdown", "overlap_latency")
LINK_KEYS = ("intra_node_bw", "inter_node_bw", "node_network_bw", "network_rail_bw", "intra_node_p2p_bw",
             "collective_latency", "network_latency", "nvls_bus_bw")


@dataclass(frozen=True)
class ClusterSpec:
    """``num_nodes`` x ``gpus_per_node`` devices; device d lives on node (island) d // gpus_per_node.

    Links (bytes/s, nccl-tests bus bandwidths): ``intra_node_bw`` an all-reduce inside a node; ``inter_node_bw`` one
    group's ring across nodes when it has the network to itself; ``node_network_bw`` what all groups crossing a
    node's network get together (0: = inter_node_bw); ``network_rail_bw`` one GPU's own path to the network, what a
    point-to-point transfer across nodes gets (0: = inter_node_bw); ``intra_node_p2p_bw`` a transfer over NVLink
    (0: = intra_node_bw); ``nvls_bus_bw`` ((gpus, bus bandwidth), ...) of NVLink SHARP all-reduces, if any.
    ``collective_latency`` is the time of one small collective inside a node, ``network_latency`` what crossing
    nodes adds to it. ``intra_node_latency`` / ``inter_node_latency`` are per ring hop (the simulator's and the
    profiler's older alpha-beta rings use them).

    Measured by a profile where set (0: not measured; ``estimator/profiled.py cluster_with_bandwidth``):
    ``p2p_latency`` is one small point-to-point message inside a node (0: ``collective_latency``);
    ``message_host_seconds`` is the compute time a device loses per point-to-point message it sends or receives
    (0: none, as on a GPU, whose host runs ahead and whose copies run beside its kernels; on a CPU device the
    transport's thread runs on the rank's own core); ``overlap_slowdown`` is the factor by which compute and a
    collective both slow while they overlap (0: C10's GPU measurement, ``estimator/comm_model.py``
    ``OVERLAP_SLOWDOWN``); ``overlap_latency`` is what a collective issued beside compute takes beyond its
    slowed time (0: nothing, as on a GPU; on a CPU device the transport's thread waits for the scheduler to give
    it the compute's core, a few milliseconds, while the collective alone takes tenths of one). They are left
    out of ``to_dict`` at 0, so clusters that do not set them keep their digest.
    """

    num_nodes: int
    gpus_per_node: int
    gpu: GPUSpec
    intra_node_bw: float
    inter_node_bw: float
    intra_node_latency: float = 5e-6
    inter_node_latency: float = 10e-6
    node_network_bw: float = 0.0
    network_rail_bw: float = 0.0
    intra_node_p2p_bw: float = 0.0
    collective_latency: float = A100_COLLECTIVE_LATENCY
    network_latency: float = NETWORK_COLLECTIVE_LATENCY
    nvls_bus_bw: tuple = ()
    p2p_latency: float = 0.0
    message_host_seconds: float = 0.0
    overlap_slowdown: float = 0.0
    overlap_latency: float = 0.0

    def __post_init__(self):
        for what in ("num_nodes", "gpus_per_node"):
            v = getattr(self, what)
            if not isinstance(v, int) or v <= 0:
                raise ClusterError(f"cluster: {what} must be a positive integer, got {v!r}")
        for what in ("intra_node_bw", "inter_node_bw"):
            if getattr(self, what) <= 0:
                raise ClusterError(f"cluster: {what} must be positive")
        for what in ("node_network_bw", "network_rail_bw", "intra_node_p2p_bw", "collective_latency",
                     "network_latency", "intra_node_latency", "inter_node_latency", "p2p_latency",
                     "message_host_seconds", "overlap_latency"):
            if getattr(self, what) < 0:
                raise ClusterError(f"cluster: {what} must be >= 0")
        if self.overlap_slowdown and self.overlap_slowdown < 1:
            raise ClusterError(f"cluster: overlap_slowdown must be 0 (not measured) or >= 1, "
                               f"got {self.overlap_slowdown}")
        nvls = tuple((int(g), float(bw)) for g, bw in self.nvls_bus_bw)  # JSON gives lists
        if any(g < 2 or bw <= 0 for g, bw in nvls):
            raise ClusterError("cluster: nvls_bus_bw must be (gpus >= 2, bandwidth > 0) pairs")
        object.__setattr__(self, "nvls_bus_bw", nvls)

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def node_network_bandwidth(self) -> float:
        return self.node_network_bw or self.inter_node_bw

    @property
    def network_rail_bandwidth(self) -> float:
        return self.network_rail_bw or self.inter_node_bw

    @property
    def intra_node_p2p_bandwidth(self) -> float:
        return self.intra_node_p2p_bw or self.intra_node_bw

    def with_memory_factor(self, factor: float) -> ClusterSpec:
        """The same cluster with ``factor`` times each device's memory (memory-relaxed planning)."""
        return replace(self, gpu=replace(self.gpu, memory_bytes=self.gpu.memory_bytes * factor))

    def island(self, device: int) -> int:
        return device // self.gpus_per_node

    def same_island(self, devices) -> bool:
        return len({self.island(d) for d in devices}) <= 1

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["nvls_bus_bw"] = [list(pair) for pair in self.nvls_bus_bw]  # JSON-stable (lists, not tuples)
        for key in MEASURED_ONLY_KEYS:
            if not d[key]:
                del d[key]
        return d

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
        numeric = fields[k].type in ("int", "float", int, float)
        if numeric and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v == v):
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


def node_type(name: str) -> dict[str, Any]:
    node = NODE_TYPES.get(name)
    if node is None:
        raise ClusterError(f"unknown GPU type '{name}' (built-in: {', '.join(NODE_TYPES)})")
    return node


def make_cluster(num_gpus: int, gpus_per_node: int = 8, gpu_type_name: str = "A800-80GB", **overrides) -> ClusterSpec:
    """A cluster of ``num_gpus`` devices of a built-in node type (fewer than a node: one partial node)."""
    if num_gpus <= 0:
        raise ClusterError(f"cluster: number of GPUs must be positive, got {num_gpus}")
    if gpus_per_node <= 0:
        raise ClusterError(f"cluster: GPUs per node must be positive, got {gpus_per_node}")
    node = node_type(gpu_type_name)
    per_node = min(gpus_per_node, num_gpus)
    if num_gpus % per_node:
        raise ClusterError(f"cluster: {num_gpus} GPUs is not a whole number of {per_node}-GPU nodes")
    links = {k: node[k] for k in LINK_KEYS if k in node}
    spec = ClusterSpec(num_nodes=num_gpus // per_node, gpus_per_node=per_node, gpu=GPU_TYPES[node["gpu"]], **links)
    return replace(spec, **overrides) if overrides else spec


def load_cluster(path: str | Path) -> ClusterSpec:
    """YAML: {num_nodes, gpus_per_node, gpu: A800-80GB | {name, peak_flops, ...}, intra_node_bw, inter_node_bw, ...}
    (bandwidths in bytes/s; omitted ones come from the built-in node type of the GPU)."""
    d = load_yaml_as(path, "cluster", ClusterError)
    if not isinstance(d, dict) or "gpu" not in d:
        raise ClusterError(f"cluster {path}: a cluster needs at least 'gpu', 'num_nodes' and 'gpus_per_node'")
    if isinstance(d["gpu"], str) and d["gpu"] in NODE_TYPES:
        node = NODE_TYPES[d["gpu"]]
        for key in LINK_KEYS + ("gpus_per_node",):
            if key in node:
                d.setdefault(key, node[key])
    try:
        return ClusterSpec.from_dict(d)
    except ClusterError as e:
        raise ClusterError(f"cluster {path}: {e}") from None
