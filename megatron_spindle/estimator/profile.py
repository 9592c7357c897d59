"""Profile files: measured per-operator times of MetaOps, read by the planner and the simulator.

A profile is a JSON document (written by tools/profile_metaops.py through ``save_profile_points``)::

    {"format": "megatron-spindle-profile", "version": 1,
     "workload": "tiny-clip", "workload_digest": "<Workload.digest()>", "gpu": "A800-80GB",
     "points": {"t1/vision": [{"n": 2, "tp": 1, "dp": 2, "seconds": 0.0012}, ...], ...}}

Seconds are per operator (one layer), forward + backward without the gradient all-reduce (T(n); the
measurements keep compute and DP communication apart, and a loaded profile's points are rebuilt from them).
``extra`` top-level sections (the profiler writes
"hardware", "versions", "bandwidth", "settings", "measurements", "optimizer") are kept as given. ``load_profile``
reads a file once into a ``Profile``: the points (the ``profile`` argument of ``estimate_curves``), the
measurements with compute and DP communication apart (``ProfiledCostModel``), the measured links
("bandwidth", ``cluster_with_bandwidth``) and the measured optimizer step ("optimizer": AdamW's
``seconds_per_element`` and ``seconds_per_tensor``, and the step's other passes per element, ``OptimizerCost``;
None in profiles written before it existed: the cost model's analytic optimizer cost applies) and the attention
backend measured ("settings", ``attention_backend``; plans on the profile run it: planner/pipeline.py
``for_cluster``). Profiles are keyed by the workload digest:
input shapes decide MetaOp identity and times, so a profile of another workload is refused. Times also depend on
the GPU, so its type must match; the cluster may differ in size: points for more devices than the cluster has are
dropped, the rest keep their meaning.

Pure Python: the measuring side (torch) is ``megatron_spindle.profiler``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_spindle.estimator.configs import valid_configs
from megatron_spindle.estimator.cost_model import OptimizerCost
from megatron_spindle.estimator.curve import CurvePoint
from megatron_spindle.estimator.errors import EstimatorError
from megatron_spindle.fileio import write_text_atomic
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan.schema import DROPOUTS

PROFILE_FORMAT = "megatron-spindle-profile"
PROFILE_VERSION = 1
# bytes per element of the gradient all-reduces a profile times (``dp_comm_seconds``): fp32 main gradients
PROFILED_GRAD_BYTES = 4


RESERVED_KEYS = ("format", "version", "workload", "workload_digest", "gpu", "points")


def profile_to_dict(
    workload: Workload,
    cluster: ClusterSpec,
    points: Mapping[str, Sequence[CurvePoint]],
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    clash = sorted(set(extra or {}) & set(RESERVED_KEYS))
    if clash:
        raise EstimatorError(f"profile: extra sections may not replace {clash}")
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "workload": workload.name,
        "workload_digest": workload.digest(),
        "gpu": cluster.gpu.name,
        "points": {
            metaop: [
                {"n": p.n, "tp": p.tp, "dp": p.dp, "seconds": p.seconds} for p in sorted(pts, key=_order)
            ]
            for metaop, pts in sorted(points.items())
        },
        **dict(extra or {}),
    }


def _order(p: CurvePoint) -> tuple[int, int]:
    return p.n, p.tp


def save_profile_points(
    path: str | Path,
    workload: Workload,
    cluster: ClusterSpec,
    points: Mapping[str, Sequence[CurvePoint]],
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Write a profile atomically (a temporary file renamed into place); ``extra``: more top-level sections."""
    write_text_atomic(path, json.dumps(profile_to_dict(workload, cluster, points, extra), indent=1))


def _header_problem(d: Any, workload: Workload, cluster: ClusterSpec) -> str | None:
    if not isinstance(d, dict) or d.get("format") != PROFILE_FORMAT:
        return f"not a {PROFILE_FORMAT} document"
    if d.get("version") != PROFILE_VERSION:
        return f"version {d.get('version')!r} is not supported (expected {PROFILE_VERSION})"
    if d.get("workload_digest") != workload.digest():
        return (
            f"profiled workload '{d.get('workload')}' (digest {d.get('workload_digest')}) is not workload "
            f"'{workload.name}' (digest {workload.digest()}): its modules, tasks, batches or frozen modules differ; "
            f"profile it again (with the same --tasks, --global-batch-size and --freeze)"
        )
    if d.get("gpu") != cluster.gpu.name:
        return f"profiled on GPU '{d.get('gpu')}' but the cluster has '{cluster.gpu.name}'"
    if not isinstance(d.get("points"), dict):
        return "'points' must map MetaOp ids to lists of points"
    return None


def _point(where: str, raw: Any) -> CurvePoint:
    if not isinstance(raw, dict) or set(raw) != {"n", "tp", "dp", "seconds"}:
        raise EstimatorError(f"{where}: a point is {{n, tp, dp, seconds}}, got {raw!r}")
    try:
        return CurvePoint(raw["n"], raw["tp"], raw["dp"], raw["seconds"], "profiled")
    except EstimatorError as e:
        raise EstimatorError(f"{where}: {e}") from None


def profile_from_dict(
    d: Any, workload: Workload, cluster: ClusterSpec, where: str = "profile"
) -> dict[str, list[CurvePoint]]:
    """metaop id -> measured points usable on ``cluster`` (see the module docstring for what is checked)."""
    problem = _header_problem(d, workload, cluster)
    if problem:
        raise EstimatorError(f"{where}: {problem}")
    metaops = build_metagraph(workload).metaops
    out: dict[str, list[CurvePoint]] = {}
    for metaop_id, raw_points in d["points"].items():
        if metaop_id not in metaops:
            raise EstimatorError(f"{where}: MetaOp '{metaop_id}' is not in workload '{workload.name}'")
        if not isinstance(raw_points, list):
            raise EstimatorError(f"{where}: points of '{metaop_id}' must be a list")
        configs = set(valid_configs(metaops[metaop_id], workload, cluster))
        kept = []
        for i, raw in enumerate(raw_points):
            point = _point(f"{where}: '{metaop_id}' point {i}", raw)
            if point.n > cluster.num_devices:
                continue  # measured on a larger cluster: not usable here
            if (point.tp, point.dp) not in configs:
                raise EstimatorError(
                    f"{where}: '{metaop_id}' point {i}: (tp={point.tp}, dp={point.dp}) is not a valid config"
                )
            kept.append(point)
        if kept:
            out[metaop_id] = kept
    return out


def _read_json(path: Path) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise EstimatorError(f"{path}: not valid JSON: {e}") from None


def load_profile_points(
    path: str | Path, workload: Workload, cluster: ClusterSpec
) -> dict[str, list[CurvePoint]]:
    """Read a profile file written by ``save_profile_points`` for use with ``estimate_curves(profile=...)``."""
    return load_profile(path, workload, cluster).points


def optimizer_cost_from_dict(d: Any) -> OptimizerCost | None:
    """The measured AdamW cost of a profile document (its "optimizer" section), or None when it has none."""
    section = d.get("optimizer") if isinstance(d, dict) else None
    if not section:
        return None
    try:
        return OptimizerCost(float(section["seconds_per_element"]), float(section.get("seconds_per_tensor", 0.0)),
                             str(section.get("source", "measured")),
                             float(section.get("norm_seconds_per_element", 0.0)),
                             float(section.get("weight_seconds_per_element", 0.0)))
    except (KeyError, TypeError, ValueError) as e:
        raise EstimatorError(f"profile: malformed 'optimizer' section {section!r}: {e}") from None


@dataclass
class Measurement:
    """One (MetaOp group, tp, dp) measurement of the profiler; ``members`` (same-shape MetaOps) share it."""

    metaop: str  # the group's representative (first) MetaOp
    members: list[str]
    tp: int
    dp: int
    layers: int  # operators timed together
    compute_seconds: float  # per operator, forward + backward, TP communication included
    dp_comm_seconds: float  # per operator: DP gradient all-reduce in fp32 (+ contrastive all-gather)
    dp_comm_source: str
    flops: float  # analytic forward + backward FLOPs of one operator, whole batch
    wall_seconds: float = 0.0  # time this measurement took (build + runs)
    # per operator, the forward alone (part of compute_seconds); 0: not measured (profiles written before it)
    forward_seconds: float = 0.0
    # per operator, the sharded runtime's host copies (ZeRO 1 and 2; cost_model.py ``sharded_phases``): loading
    # the gathered weights, and staging the gradients; 0: not measured
    shard_load_seconds: float = 0.0
    shard_grad_seconds: float = 0.0

    @property
    def n(self) -> int:
        return self.tp * self.dp

    @property
    def seconds(self) -> float:
        return self.compute_seconds + self.dp_comm_seconds

    def step_seconds(self, weightless: bool = False) -> float:
        """Forward + backward on the critical path (T(n), ``LayerCost.step``): compute, and the DP communication
        only for an operator without weights (a contrastive loss's all-gather); a gradient all-reduce is not
        part of it (the simulator and the planner charge it per parameter device group)."""
        return self.compute_seconds + (self.dp_comm_seconds if weightless else 0.0)

    @property
    def tflops_per_device(self) -> float:
        """Achieved TFLOP/s of one device during compute (FLOPs / n / compute seconds)."""
        return self.flops / self.n / self.compute_seconds / 1e12 if self.compute_seconds > 0 else 0.0

    def point(self, weightless: bool = False) -> CurvePoint:
        """The measurement as a point of the MetaOp's scaling curve (``step_seconds``)."""
        return CurvePoint(self.n, self.tp, self.dp, self.step_seconds(weightless), "profiled")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Measurement:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


def weightless_metaops(workload: Workload) -> set[str]:
    """MetaOps without parameters (contrastive losses): their DP communication is on the critical path."""
    return {mid for mid, m in build_metagraph(workload).metaops.items() if not any(m.params)}


def points_of(measurements: Sequence[Measurement], weightless: Collection[str] = ()) -> dict[str, list[CurvePoint]]:
    """metaop id -> measured points (every member of a group gets the group's points); ``weightless``: the
    MetaOps whose DP communication belongs to their step (``weightless_metaops``)."""
    out: dict[str, list[CurvePoint]] = {}
    for m in measurements:
        for mid in m.members:
            out.setdefault(mid, []).append(m.point(mid in weightless))
    return out


@dataclass
class Profile:
    """What a profile holds for a cluster: read once (``load_profile``) or just measured (the profiler's
    ``ProfileResult.profile()``); the planner takes ``points``, ``ProfiledCostModel`` the rest."""

    points: dict[str, list[CurvePoint]]
    measurements: list[Measurement] = field(default_factory=list)
    bandwidth: dict[str, Any] = field(default_factory=dict)  # "intra_node" / "inter_node" links, None: not measured
    optimizer: OptimizerCost | None = None  # the measured optimizer step and its parts (None: not measured)
    # the attention core measured (plan/schema.py ATTENTION_BACKENDS, resolved: local where TE was missing); None:
    # profiles written before the profiler recorded it
    attention_backend: str | None = None
    # the layers' dropout measured (plan/schema.py DROPOUTS); profiles written before the profiler took it: none
    dropout: dict[str, float] = field(default_factory=lambda: dict.fromkeys(DROPOUTS, 0.0))


def load_profile(path: str | Path, workload: Workload, cluster: ClusterSpec) -> Profile:
    """Read and check a profile file (see the module docstring) for ``workload`` on ``cluster``."""
    path = Path(path)
    doc = _read_json(path)
    points = profile_from_dict(doc, workload, cluster, where=str(path))
    raw = doc.get("measurements") or []
    try:
        measurements = [Measurement.from_dict(m) for m in raw]
    except TypeError as e:
        raise EstimatorError(f"{path}: malformed 'measurements' section: {e}") from None
    measurements = [m for m in measurements if m.n <= cluster.num_devices]
    if measurements:  # the curves' points from the measurements: compute apart from the gradient all-reduce
        points = _step_points(points, measurements, weightless_metaops(workload))
    settings = doc.get("settings") or {}
    return Profile(points, measurements, doc.get("bandwidth") or {}, optimizer_cost_from_dict(doc),
                   settings.get("attention_backend"), {name: settings.get(name, 0.0) for name in DROPOUTS})


def _step_points(points: dict[str, list[CurvePoint]], measurements: Sequence[Measurement],
                 weightless: set[str]) -> dict[str, list[CurvePoint]]:
    """Points at measured configs timed by ``Measurement.step_seconds`` (files written before the curves left
    the gradient all-reduce out hold compute + communication in their points)."""
    measured = {(mid, m.tp, m.dp): m for m in measurements for mid in m.members}
    out = {}
    for mid, pts in points.items():
        out[mid] = [measured[(mid, p.tp, p.dp)].point(mid in weightless) if (mid, p.tp, p.dp) in measured else p
                    for p in pts]
    return out
