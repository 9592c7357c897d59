"""The execution plan: a versioned JSON document that every planner emits and the simulator and runtime read.

Layout conventions (the runtime depends on them):
- A slice runs layers ``[layer_start, layer_end)`` of its MetaOp's chain (0-based, relative to the MetaOp;
  the module layer is ``metaop.layer_offset + i``) on ``devices`` with ``tp * dp == len(devices)``.
  Device ``devices[r]`` has tensor-parallel rank ``r % tp`` and data-parallel rank ``r // tp``;
  data-parallel rank k holds samples ``[k*B/dp, (k+1)*B/dp)`` of the MetaOp's batch B.
- Waves run one after another; within a wave the slices' device sets are disjoint. Forward runs wave by
  wave, backward in reverse wave order.
- A transfer moves a producer slice's output to a consumer slice (activations forward, their gradients
  backward): between consecutive slices of one MetaOp, and from the slice holding a producer MetaOp's last
  layer to the slice holding the consumer MetaOp's first layer.
- ``param_groups`` lists, per distinct device set, the weights held by exactly those devices (the paper's
  parameter device group pool); gradients of those weights are synchronised inside that set.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_spindle.fileio import write_text_atomic

SCHEMA_VERSION = 1
PLAN_FORMAT = "megatron-spindle-plan"
TRANSFER_KINDS = ("local", "intra_island", "inter_island")


class PlanError(ValueError):
    """A plan that is malformed or does not match the workload/cluster it is used with."""


@dataclass
class Slice:
    id: str  # unique in the plan, e.g. "w3:t1/vision"
    metaop: str
    module: str
    task: str
    kind: str
    layer_start: int
    layer_end: int
    devices: list[int]
    tp: int
    dp: int
    predicted_time: float  # seconds for this slice (per-layer T(n) times its layer count)

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start


@dataclass
class Wave:
    index: int
    level: int
    start: float
    duration: float
    slices: list[Slice] = field(default_factory=list)

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclass
class Transfer:
    producer: str  # slice id
    consumer: str  # slice id
    bytes: float  # forward activation bytes (the gradient going back has the same size)
    kind: str  # local | intra_island | inter_island
    src_devices: list[int] = field(default_factory=list)
    dst_devices: list[int] = field(default_factory=list)
    # bytes received per route, summed over consumer devices (a consumer with tp > 1 receives its rows on every
    # TP rank): {"local": .., "intra_island": .., "inter_island": ..}
    bytes_by_kind: dict[str, float] = field(default_factory=dict)


@dataclass
class ParamGroup:
    devices: list[int]
    params: list[str]
    bytes: float = 0.0  # bf16 weight bytes in the group (gradient all-reduce volume)


@dataclass
class MetaOpInfo:
    id: str
    task: str
    module: str
    kind: str
    num_layers: int
    layer_offset: int
    input_shape: list[int]
    level: int
    preds: list[str]
    params: list[str]
    curve_source: str = "analytic"  # analytic | profiled
    curve_fit_error: float = 0.0
    allocation: list[list[float]] = field(default_factory=list)  # bi-point tuples [[n, l], ...] after rounding
    n_star: float = 0.0  # continuous optimum allocation


@dataclass
class LevelInfo:
    index: int
    metaops: list[str]
    c_star: float  # relaxed optimum C~* of this level (Theorem 1)
    start: float
    end: float


@dataclass
class Plan:
    workload_name: str
    workload_digest: str
    cluster: dict[str, Any]
    cluster_digest: str
    planner: dict[str, Any]  # settings: planner, inverse, placement, cost source, solver status...
    metaops: list[MetaOpInfo]
    levels: list[LevelInfo]
    waves: list[Wave]
    transfers: list[Transfer]
    param_groups: list[ParamGroup]
    memory_per_device: list[float]  # predicted peak bytes
    predicted: dict[str, float]  # iteration_time, c_star, gap, utilisation, inter_island_bytes, ...
    schema_version: int = SCHEMA_VERSION

    # ------------------------------------------------------------------------------- convenience
    @property
    def num_devices(self) -> int:
        return int(self.cluster["num_nodes"]) * int(self.cluster["gpus_per_node"])

    @property
    def iteration_time(self) -> float:
        return max((w.end for w in self.waves), default=0.0)

    def slices(self) -> list[Slice]:
        return [s for w in self.waves for s in w.slices]

    def slice(self, slice_id: str) -> Slice:
        for s in self.slices():
            if s.id == slice_id:
                return s
        raise KeyError(slice_id)

    def metaop(self, mid: str) -> MetaOpInfo:
        for m in self.metaops:
            if m.id == mid:
                return m
        raise KeyError(mid)

    # ------------------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d = {"format": PLAN_FORMAT, "schema_version": d.pop("schema_version"), **d}
        return d

    def save(self, path: str | Path) -> None:
        """Atomic write: a temporary file in the same folder, then rename."""
        write_json_atomic(path, self.to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        if d.get("format") != PLAN_FORMAT:
            raise PlanError(f"not a megatron-spindle plan (format={d.get('format')!r})")
        if d.get("schema_version") != SCHEMA_VERSION:
            raise PlanError(f"plan schema version {d.get('schema_version')} is not supported (expected {SCHEMA_VERSION})")
        d = dict(d)
        d.pop("format")
        try:
            waves = [Wave(**{**w, "slices": [Slice(**s) for s in w["slices"]]}) for w in d.pop("waves")]
            return cls(
                waves=waves,
                metaops=[MetaOpInfo(**m) for m in d.pop("metaops")],
                levels=[LevelInfo(**lv) for lv in d.pop("levels")],
                transfers=[Transfer(**t) for t in d.pop("transfers")],
                param_groups=[ParamGroup(**g) for g in d.pop("param_groups")],
                **d,
            )
        except (TypeError, KeyError) as e:
            raise PlanError(f"malformed plan: {e}") from e

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            with open(path) as f:
                d = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanError(f"{path}: not valid JSON: {e}") from e
        if not isinstance(d, dict):
            raise PlanError(f"{path}: not a megatron-spindle plan (a JSON {type(d).__name__}, not an object)")
        try:
            return cls.from_dict(d)
        except PlanError as e:
            raise PlanError(f"{path}: {e}") from None


def write_json_atomic(path: str | Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1))
