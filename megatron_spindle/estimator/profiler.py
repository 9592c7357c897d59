"""Profiler: measure the per-operator time of every MetaOp at its (tp, dp) configs on the real devices (issue 7).

The torch side of the estimator. It imports torch, so it is NOT exported from ``megatron_spindle.estimator``
(whose other modules are pure Python). tools/profile.py drives it; the file it writes is
estimator/profile.py's format (``save_profile_points``) plus extra sections that loading ignores.

What one profiled point means (the same as the analytic model's ``LayerCost.total``): seconds of ONE operator of
the MetaOp, forward + backward, on n = tp * dp devices =

- **compute**: the median over repeats of forward + backward of ``min(L, layers)`` operators built with
  ``models.build_operator`` on a real TP group of tp ranks (TP all-reduces included), run on the per-rank
  shard B/dp of the batch (data parallelism is emulated: every DP rank does the same work), divided by the
  number of operators; device-synchronised on GPU;
- **+ dp_comm**: the DP all-reduce of one operator's fp32 gradients (this TP rank's shard) over dp ranks, and
  for a contrastive loss the all-gather of the embeddings. The all-reduce is timed on real dp groups when tp*dp
  ranks exist on links of the right kind (inside a node or across nodes, as the n devices would be on the
  cluster): source "measured"; otherwise the ring model with the all-reduce bandwidth measured here
  ("bandwidth"), or with the cluster's nominal links when there is one rank only ("nominal").

The optimizer step is measured too (``measure_optimizer``): torch.optim.AdamW, as the runtime engine runs it,
over one large fp32 tensor and over many tiny ones, on every rank at once, giving seconds per element and per
stepped tensor (the "optimizer" section of the profile; ``ProfiledCostModel(optimizer=...)``).

MetaOps with the same (module, kind, input shape) are timed once and share the points. Configs the local world
cannot run (tp larger than the ranks of a node, or ``max_n``) are left out: the estimator fills them from the
analytic model (calibrated to the measured level) and ``ProfileResult.unmeasured`` lists them.

Every rank walks the same MetaOps and configs in the same order (process groups are created collectively);
each measurement is max-reduced over the ranks so that all ranks agree on the numbers.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_spindle.estimator.configs import valid_configs
from megatron_spindle.estimator.cost_model import AnalyticCostModel, LayerCost, OptimizerCost
from megatron_spindle.estimator.curve import CurvePoint
from megatron_spindle.estimator.errors import EstimatorError
from megatron_spindle.estimator.profile import (
    load_profile_points,
    optimizer_cost_from_dict,
    save_profile_points,
)
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaOp, build_metagraph
from megatron_spindle.graph.workload import Workload

PROFILER_VERSION = 2  # 2: the "optimizer" section
OPTIMIZER_PROBE_ELEMENTS = 1 << 20  # one fp32 tensor: the per-element cost
OPTIMIZER_PROBE_TENSORS = 64  # tiny tensors: the per-tensor cost
GRAD_BYTES = 4  # fp32 main gradients, as the cost model and the runtime engine reduce them
DP_COMM_SOURCES = ("none", "measured", "bandwidth", "nominal")


# ------------------------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class ProfilerSettings:
    """How to measure. Part of the cache key: profiles taken with other settings are not reused."""

    layers: int = 2  # operators timed per layer MetaOp: min(L, layers)
    warmup: int = 2
    repeats: int = 5
    max_n: int | None = None  # skip configs with tp * dp above this
    metaops: tuple[str, ...] = ()  # fnmatch patterns of MetaOp ids to profile (empty: all)
    bf16: bool = False  # bf16 parameters (needs CUDA)
    bandwidth_sizes: tuple[int, ...] = (4, 1 << 16, 1 << 20, 1 << 22)  # message bytes; the largest gives bw
    seed: int = 0

    def __post_init__(self):
        if self.layers < 1 or self.repeats < 1 or self.warmup < 0:
            raise EstimatorError("profiler: layers and repeats must be >= 1, warmup >= 0")
        if self.max_n is not None and self.max_n < 1:
            raise EstimatorError("profiler: max_n must be >= 1")
        if not self.bandwidth_sizes or min(self.bandwidth_sizes) <= 0:
            raise EstimatorError("profiler: bandwidth_sizes must be positive byte counts")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def gpu_bandwidth_sizes() -> tuple[int, ...]:
    return (4, 1 << 20, 1 << 24, 1 << 28)


# ------------------------------------------------------------------------------------------------ world


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
            self._groups[ranks] = dist.new_group(list(ranks))
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


# ------------------------------------------------------------------------------------------------ keys


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


# ------------------------------------------------------------------------------------------------ grouping


def metaop_key(workload: Workload, m: MetaOp) -> tuple:
    """MetaOps with equal keys run the same computation: same module, kind and input shape (and, for an LM
    head, the same number of labelled text tokens)."""
    extra: tuple = ()
    if m.kind == "lm_head":
        from megatron_spindle.data.mock import own_text_tokens

        extra = (own_text_tokens(workload, m.task, m.module),)
    return (m.module, m.kind, tuple(m.input_shape)) + extra


def group_metaops(workload: Workload, patterns: Sequence[str] = ()) -> list[list[str]]:
    """Groups of MetaOp ids (in MetaLevel order) to time once each; ``patterns`` keep the matching ids only."""
    g = build_metagraph(workload)
    groups: dict[tuple, list[str]] = {}
    for level in g.levels:
        for mid in level:
            if patterns and not any(fnmatch.fnmatchcase(mid, p) for p in patterns):
                continue
            groups.setdefault(metaop_key(workload, g.metaops[mid]), []).append(mid)
    if patterns and not groups:
        raise EstimatorError(f"profiler: no MetaOp of '{workload.name}' matches {list(patterns)} "
                             f"(ids: {sorted(g.metaops)[:8]} ...)")
    return list(groups.values())


def profile_configs(metaop: MetaOp, workload: Workload, cluster: ClusterSpec, world: ProfileWorld,
                    settings: ProfilerSettings) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(measurable, unmeasurable) valid configs: tp needs tp ranks inside one node of this world."""
    measured, left = [], []
    for tp, dp in valid_configs(metaop, workload, cluster):
        fits_tp = tp == 1 or (tp <= world.local_world_size and world.local_world_size % tp == 0)
        fits_n = settings.max_n is None or tp * dp <= settings.max_n
        (measured if fits_tp and fits_n else left).append((tp, dp))
    return measured, left


# ------------------------------------------------------------------------------------------------ bandwidth


def _median_seconds(fn: Callable[[], None], world: ProfileWorld, warmup: int, repeats: int) -> float:
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


def _comm_tensor(world: ProfileWorld, nbytes: int) -> torch.Tensor:
    return torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=world.device)


def _p2p_seconds(world: ProfileWorld, a: int, b: int, nbytes: int, repeats: int) -> float:
    """One-way time of ``nbytes`` from rank a to rank b (half a ping-pong), on every rank (max-reduced)."""
    x = _comm_tensor(world, nbytes)

    def ping():
        if world.rank == a:
            dist.send(x, b)
            dist.recv(x, b)
        elif world.rank == b:
            dist.recv(x, a)
            dist.send(x, a)

    seconds = _median_seconds(ping, world, 1, repeats) / 2 if world.rank in (a, b) else 0.0
    return world.all_max([seconds])[0]


def _allreduce_seconds(world: ProfileWorld, ranks: Sequence[int], nbytes: int, repeats: int,
                       group=None) -> float:
    group = group if group is not None else world.group(ranks)
    x = _comm_tensor(world, nbytes)
    seconds = 0.0
    if world.rank in ranks:
        seconds = _median_seconds(lambda: dist.all_reduce(x, group=group), world, 1, repeats)
    return world.all_max([seconds])[0]


def _measure_link(world: ProfileWorld, peer: int, ranks: Sequence[int], sizes: Sequence[int],
                  repeats: int) -> dict[str, Any]:
    sizes = sorted(sizes)
    p2p = {s: _p2p_seconds(world, 0, peer, s, repeats) for s in sizes}
    group = world.group(ranks)
    ar = {s: _allreduce_seconds(world, ranks, s, repeats, group) for s in sizes}
    k, big, small = len(ranks), sizes[-1], sizes[0]
    return {
        "p2p_ranks": [0, peer],
        "p2p_bytes_per_s": big / p2p[big],
        "p2p_latency_s": p2p[small],
        "allreduce_ranks": list(ranks),
        "allreduce_bus_bytes_per_s": 2 * (k - 1) / k * big / ar[big],
        "allreduce_latency_s": ar[small] / (2 * (k - 1)),
        "p2p_seconds": {str(s): v for s, v in p2p.items()},
        "allreduce_seconds": {str(s): v for s, v in ar.items()},
    }


def measure_bandwidth(world: ProfileWorld, sizes: Sequence[int], repeats: int = 5) -> dict[str, Any]:
    """Point-to-point (rank 0 to a peer) and all-reduce bandwidth inside node 0 and, with several nodes, across
    nodes (one rank per node). A section is None when there are not two ranks for it."""
    out: dict[str, Any] = {"intra_node": None, "inter_node": None}
    local = world.local_world_size
    if local >= 2:
        out["intra_node"] = _measure_link(world, 1, list(range(local)), sizes, repeats)
    if world.num_nodes >= 2:
        out["inter_node"] = _measure_link(world, local, [k * local for k in range(world.num_nodes)], sizes,
                                          repeats)
    world.barrier()
    return out


def cluster_with_bandwidth(cluster: ClusterSpec, bandwidth: dict[str, Any] | None) -> ClusterSpec:
    """The cluster with its link bandwidths and latencies replaced by measured ones (where measured)."""
    changes: dict[str, float] = {}
    for section, bw, lat in (("intra_node", "intra_node_bw", "intra_node_latency"),
                             ("inter_node", "inter_node_bw", "inter_node_latency")):
        link = (bandwidth or {}).get(section)
        if link:
            changes[bw] = float(link["allreduce_bus_bytes_per_s"])
            changes[lat] = float(link["allreduce_latency_s"])
    return dataclasses.replace(cluster, **changes) if changes else cluster


# ------------------------------------------------------------------------------------------------ operators


def _batch_for(workload: Workload, info, dp: int, device: torch.device, dtype: torch.dtype, seed: int):
    """The DP-rank-0 shard (B/dp rows) of the task's mock batch, on the device; float inputs in ``dtype``."""
    from megatron_spindle.data.mock import mock_batch

    batch = mock_batch(workload, info.task, 0, seed).shard(0, dp)

    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)

    return dataclasses.replace(batch, inputs={k: move(v) for k, v in batch.inputs.items()},
                               labels=None if batch.labels is None else move(batch.labels))


def _inputs_for(info, dp: int, device: torch.device, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Producer outputs of the right shapes for the local shard: one [b, S, X] tensor (a layer range given
    one input takes it as the whole sequence), two [b, 1, X] embeddings for a contrastive loss, none for a
    front end."""
    b, s, x = info.input_shape
    rows = b // dp
    gen = torch.Generator().manual_seed(seed)
    if info.kind == "frontend":
        return []
    shapes = [(rows, 1, x), (rows, 1, x)] if info.kind == "loss" else [(rows, s, x)]
    return [torch.randn(*shape, generator=gen).to(device=device, dtype=dtype) for shape in shapes]


def time_operator(op: torch.nn.Module, inputs: list[torch.Tensor], batch, world: ProfileWorld,
                  warmup: int, repeats: int) -> float:
    """Median seconds of forward + backward of ``op`` (device-synchronised). A scalar output (loss) is
    back-propagated directly, a tensor output with a fixed random output gradient."""
    out_grad: list[torch.Tensor | None] = [None]

    def step():
        xs = [x.detach().requires_grad_(True) for x in inputs]
        out = op(xs, batch)
        if out.dim() == 0:
            out.backward()
        else:
            if out_grad[0] is None or out_grad[0].shape != out.shape:
                gen = torch.Generator().manual_seed(1)
                out_grad[0] = torch.randn(out.shape, generator=gen).to(device=out.device, dtype=out.dtype)
            out.backward(out_grad[0])
        op.zero_grad(set_to_none=True)

    return _median_seconds(step, world, warmup, repeats)


def measure_optimizer(world: ProfileWorld, settings: ProfilerSettings) -> OptimizerCost:
    """Seconds of torch.optim.AdamW (default implementation for the device, as the runtime engine steps its
    masters) per element, from one tensor of ``OPTIMIZER_PROBE_ELEMENTS``, and per tensor, from
    ``OPTIMIZER_PROBE_TENSORS`` tensors of 16 elements. Every rank measures at once (as every rank steps at
    once in training); max-reduced over the ranks. Collective."""

    def seconds(tensors: list[torch.Tensor]) -> float:
        params = [torch.nn.Parameter(t) for t in tensors]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
        return _median_seconds(opt.step, world, max(1, settings.warmup), settings.repeats)

    gen = torch.Generator().manual_seed(settings.seed)
    big = seconds([torch.randn(OPTIMIZER_PROBE_ELEMENTS, generator=gen).to(world.device)])
    small = seconds([torch.randn(16, generator=gen).to(world.device) for _ in range(OPTIMIZER_PROBE_TENSORS)])
    big, small = world.all_max([big, small])
    per_tensor = small / OPTIMIZER_PROBE_TENSORS
    per_element = max(0.0, big - per_tensor) / OPTIMIZER_PROBE_ELEMENTS
    return OptimizerCost(per_element, per_tensor, "measured")


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


# ------------------------------------------------------------------------------------------------ results


@dataclass
class Measurement:
    """One (MetaOp group, tp, dp) measurement; ``members`` share it."""

    metaop: str  # the group's representative (first) MetaOp
    members: list[str]
    tp: int
    dp: int
    layers: int  # operators timed together
    compute_seconds: float  # per operator, forward + backward, TP communication included
    dp_comm_seconds: float  # per operator: DP gradient all-reduce (+ contrastive all-gather)
    dp_comm_source: str
    flops: float  # analytic forward + backward FLOPs of one operator, whole batch
    wall_seconds: float = 0.0  # time this measurement took (build + runs)

    @property
    def n(self) -> int:
        return self.tp * self.dp

    @property
    def seconds(self) -> float:
        return self.compute_seconds + self.dp_comm_seconds

    @property
    def tflops_per_device(self) -> float:
        """Achieved TFLOP/s of one device during compute (FLOPs / n / compute seconds)."""
        return self.flops / self.n / self.compute_seconds / 1e12 if self.compute_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"metaop": self.metaop, "members": list(self.members), "tp": self.tp, "dp": self.dp,
                "layers": self.layers, "compute_seconds": self.compute_seconds,
                "dp_comm_seconds": self.dp_comm_seconds, "dp_comm_source": self.dp_comm_source,
                "flops": self.flops, "wall_seconds": self.wall_seconds}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Measurement:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


@dataclass
class ProfileResult:
    workload: Workload
    cluster: ClusterSpec
    measurements: list[Measurement]
    unmeasured: dict[str, list[tuple[int, int]]]  # metaop -> valid configs left to the analytic model
    failed: dict[str, list[tuple[int, int]]]  # metaop -> configs that ran out of memory
    bandwidth: dict[str, Any]
    hardware: dict[str, Any]
    versions: dict[str, str]
    settings: ProfilerSettings
    key: str
    seconds: float = 0.0
    optimizer: OptimizerCost | None = None  # measured AdamW step (None: not measured)

    @property
    def points(self) -> dict[str, list[CurvePoint]]:
        """metaop id -> measured points (every member of a group gets the group's points)."""
        out: dict[str, list[CurvePoint]] = {}
        for m in self.measurements:
            for mid in m.members:
                out.setdefault(mid, []).append(CurvePoint(m.n, m.tp, m.dp, m.seconds, "profiled"))
        return out

    def extra_sections(self) -> dict[str, Any]:
        return {
            "profile_key": self.key,
            "hardware": self.hardware,
            "versions": self.versions,
            "settings": self.settings.to_dict(),
            "cluster": self.cluster.to_dict(),
            "bandwidth": self.bandwidth,
            "measurements": [m.to_dict() for m in self.measurements],
            "unmeasured": {k: [list(c) for c in v] for k, v in sorted(self.unmeasured.items())},
            "failed": {k: [list(c) for c in v] for k, v in sorted(self.failed.items())},
            "profiling_seconds": self.seconds,
            **({"optimizer": self.optimizer.to_dict()} if self.optimizer is not None else {}),
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_profile_points(path, self.workload, self.cluster, self.points, extra=self.extra_sections())
        return path


def read_profile_document(path: str | Path) -> dict[str, Any]:
    """The raw JSON document of a profile file (extra sections included)."""
    with open(path) as f:
        return json.load(f)


def load_measurements(path: str | Path) -> list[Measurement]:
    return [Measurement.from_dict(d) for d in read_profile_document(path).get("measurements", [])]


def load_optimizer_cost(path: str | Path) -> OptimizerCost | None:
    """The measured AdamW cost of a profile file; None for profiles written before it was measured."""
    return optimizer_cost_from_dict(read_profile_document(path))


# ------------------------------------------------------------------------------------------------ profiling


def _dp_comm(world: ProfileWorld, cluster: ClusterSpec, model: AnalyticCostModel, m: MetaOp, tp: int, dp: int,
             grad_numel: int, settings: ProfilerSettings, measured_links: bool) -> tuple[float, str]:
    """Seconds of one operator's DP communication and where the number comes from."""
    data = model.data_comm_seconds(m, tp, dp)
    if dp == 1:
        return 0.0, "none"
    if grad_numel == 0:
        return data, ("bandwidth" if measured_links else "nominal") if data > 0 else "none"
    n = tp * dp
    same_kind = (n <= world.local_world_size) == (n <= cluster.gpus_per_node)
    if n <= world.world_size and same_kind:
        groups = [world.group([t + j * tp for j in range(dp)]) for t in range(tp)]  # collective
        seconds = 0.0
        if world.rank < n:
            group = groups[world.rank % tp]
            x = torch.zeros(grad_numel, dtype=torch.float32, device=world.device)
            seconds = _median_seconds(lambda: dist.all_reduce(x, group=group), world, settings.warmup,
                                      settings.repeats)
        return world.all_max([seconds])[0] + data, "measured"
    ring = model.allreduce_seconds(grad_numel * GRAD_BYTES, dp, n)
    return ring + data, "bandwidth" if measured_links else "nominal"


def measure_config(workload: Workload, info, metaop: MetaOp, tp: int, dp: int, world: ProfileWorld,
                   settings: ProfilerSettings) -> tuple[float, int, int]:
    """(compute seconds per operator, gradient elements per operator on one TP rank, operators timed) of one
    config; seconds is inf when a rank ran out of memory. Collective over the world."""
    from megatron_spindle.compat.groups import make_pg_collection
    from megatron_spindle.models.config import ModelConfig
    from megatron_spindle.models.operator import build_operator

    layers = min(info.num_layers, settings.layers) if info.kind == "layer" else 1
    tp_group, member = world.tp_group(tp) if tp > 1 else (None, True)
    seconds, numel = 0.0, 0
    if member:
        op = None
        try:
            cfg = ModelConfig(bf16=settings.bf16, init_seed=settings.seed)
            pgs = make_pg_collection(tp_group) if tp > 1 else None
            op = build_operator(workload, info, 0, layers, pg_collection=pgs, config=cfg)
            op = op.to(device=world.device, dtype=cfg.params_dtype)
            batch = _batch_for(workload, info, dp, world.device, cfg.params_dtype, settings.seed)
            inputs = _inputs_for(info, dp, world.device, cfg.params_dtype, settings.seed)
            seconds = time_operator(op, inputs, batch, world, settings.warmup, settings.repeats) / layers
            numel = sum(p.numel() for p in op.parameters()) // layers
        except RuntimeError as e:
            if not _is_oom(e):
                raise
            seconds = math.inf
        finally:
            del op
            if world.device.type == "cuda":
                torch.cuda.empty_cache()
    seconds, numel = world.all_max([seconds, numel])
    return seconds, int(numel), layers


def run_profile(workload: Workload, cluster: ClusterSpec, settings: ProfilerSettings | None = None,
                world: ProfileWorld | None = None, progress: Callable[[str], None] | None = None) -> ProfileResult:
    """Measure every MetaOp group at its measurable configs (see the module docstring). Collective."""
    from megatron_spindle.compat.cpu import apply_cpu_shim
    from megatron_spindle.compat.groups import ensure_global_memory_buffer
    from megatron_spindle.models.operator import metaop_infos

    settings = settings or ProfilerSettings()
    world = world or ProfileWorld.current()
    say = progress if (progress is not None and world.rank == 0) else (lambda msg: None)
    apply_cpu_shim()
    ensure_global_memory_buffer()
    t_start = time.perf_counter()
    hardware, versions = describe_hardware(world), software_versions()
    key = profile_key(workload, cluster, hardware, versions, settings)
    g = build_metagraph(workload)
    infos = metaop_infos(workload)

    say(f"bandwidth: {world.world_size} rank(s), {world.num_nodes} node(s) of {world.local_world_size}")
    bandwidth = measure_bandwidth(world, settings.bandwidth_sizes, settings.repeats)
    for section in ("intra_node", "inter_node"):
        link = bandwidth[section]
        if link:
            say(f"  {section}: p2p {link['p2p_bytes_per_s'] / 1e9:.2f} GB/s, all-reduce bus "
                f"{link['allreduce_bus_bytes_per_s'] / 1e9:.2f} GB/s over {len(link['allreduce_ranks'])} ranks, "
                f"latency {link['allreduce_latency_s'] * 1e6:.1f} us")
        else:
            say(f"  {section}: not measured (needs two ranks); nominal cluster links are used")
    link_cluster = cluster_with_bandwidth(cluster, bandwidth)
    measured_links = any(bandwidth.values())
    model = AnalyticCostModel(workload, link_cluster)
    flops_model = AnalyticCostModel(workload, cluster)

    groups = group_metaops(workload, settings.metaops)
    plan: list[tuple[list[str], int, int]] = []
    unmeasured: dict[str, list[tuple[int, int]]] = {}
    for members in groups:
        measurable, left = profile_configs(g.metaops[members[0]], workload, cluster, world, settings)
        plan += [(members, tp, dp) for tp, dp in measurable]
        for mid in members:
            if left:
                unmeasured[mid] = list(left)
    measurements: list[Measurement] = []
    failed: dict[str, list[tuple[int, int]]] = {}
    for i, (members, tp, dp) in enumerate(plan, 1):
        t0 = time.perf_counter()
        rep = members[0]
        m = g.metaops[rep]
        compute, numel, layers = measure_config(workload, infos[rep], m, tp, dp, world, settings)
        if not math.isfinite(compute):
            for mid in members:
                failed.setdefault(mid, []).append((tp, dp))
                unmeasured.setdefault(mid, []).append((tp, dp))
            say(f"[{i}/{len(plan)}] {rep} tp={tp} dp={dp}: out of memory, left to the analytic model")
            continue
        comm, source = _dp_comm(world, cluster, model, m, tp, dp, numel, settings, measured_links)
        meas = Measurement(rep, list(members), tp, dp, layers, compute, comm, source, flops_model.flops(m),
                           time.perf_counter() - t0)
        measurements.append(meas)
        shared = f" (+{len(members) - 1} same-shape)" if len(members) > 1 else ""
        say(f"[{i}/{len(plan)}] {rep}{shared} tp={tp} dp={dp}: {meas.seconds * 1e3:.3f} ms/op = compute "
            f"{compute * 1e3:.3f} + dp comm {comm * 1e3:.3f} ({source}); {layers} op(s) timed, "
            f"{meas.tflops_per_device:.3g} TFLOP/s per device")
    optimizer = measure_optimizer(world, settings)
    say(f"optimizer: AdamW {optimizer.seconds_per_element * 1e9:.3f} ns/element + "
        f"{optimizer.seconds_per_tensor * 1e6:.1f} us/tensor")
    world.barrier()
    for mid in unmeasured:
        unmeasured[mid] = sorted(set(unmeasured[mid]), key=lambda c: (c[0] * c[1], c[0]))
    return ProfileResult(workload, cluster, measurements, unmeasured, failed, bandwidth, hardware, versions,
                         settings, key, time.perf_counter() - t_start, optimizer)


# ------------------------------------------------------------------------------------------------ consumers


class ProfiledCostModel(AnalyticCostModel):
    """The analytic cost model with ``layer_cost`` replaced by measurements where they exist: compute (TP
    communication included) and the DP communication kept apart, as the simulator charges the gradient
    synchronisation itself. Other configs fall back to the analytic model scaled per MetaOp to the measured
    level (geometric mean of measured / modelled totals). ``optimizer``: the measured AdamW cost (profiles
    without one keep the analytic cost of the cluster spec)."""

    def __init__(self, workload: Workload, cluster: ClusterSpec, measurements: Sequence[Measurement],
                 optimizer: OptimizerCost | None = None, **kwargs):
        super().__init__(workload, cluster, **kwargs)
        self.measured_optimizer = optimizer
        self.measured: dict[tuple[str, int, int], Measurement] = {}
        for meas in measurements:
            for mid in meas.members:
                self.measured[(mid, meas.tp, meas.dp)] = meas
        self._scale: dict[str, float] = {}

    def _calibration(self, metaop: MetaOp) -> float:
        if metaop.id not in self._scale:
            logs = [math.log(meas.seconds / super(ProfiledCostModel, self).layer_cost(metaop, tp, dp).total)
                    for (mid, tp, dp), meas in self.measured.items() if mid == metaop.id]
            self._scale[metaop.id] = math.exp(sum(logs) / len(logs)) if logs else 1.0
        return self._scale[metaop.id]

    def optimizer_cost(self) -> OptimizerCost:
        return self.measured_optimizer if self.measured_optimizer is not None else super().optimizer_cost()

    def layer_cost(self, metaop: MetaOp, tp: int, dp: int) -> LayerCost:
        meas = self.measured.get((metaop.id, tp, dp))
        if meas is not None:
            if metaop.kind == "loss":  # no weights: its DP communication is the embeddings' all-gather
                return LayerCost(meas.compute_seconds, 0.0, 0.0, 0.0, data_comm=meas.dp_comm_seconds)
            return LayerCost(compute=meas.compute_seconds, tp_comm=0.0, dp_sync=meas.dp_comm_seconds, launch=0.0)
        base = super().layer_cost(metaop, tp, dp)
        s = self._calibration(metaop)
        return LayerCost(base.compute * s, base.tp_comm * s, base.dp_sync * s, base.launch * s,
                         base.data_comm * s)


def load_profile(path: str | Path, workload: Workload, cluster: ClusterSpec):
    """(points for ``estimate_curves(profile=...)``, measurements, bandwidth section) of a profile file."""
    doc = read_profile_document(path)
    return load_profile_points(path, workload, cluster), load_measurements(path), doc.get("bandwidth") or {}
