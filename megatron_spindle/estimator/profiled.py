"""Measured times over the analytic model: the one rule by which a profile turns into costs.

Where a (MetaOp, tp, dp) was measured, the measurement is the cost. Elsewhere the analytic cost is scaled by
``profile_scale``: the geometric mean, over the MetaOp's measured configs, of measured / modelled time at the
same config. The fill keeps the model's shape and takes the measured level, so a curve that mixes both has no
artificial jump where the measurements end. ``estimate_curve`` (the planner's scaling curves) and
``ProfiledCostModel`` (the simulator's layer costs) both scale with it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from megatron_spindle.estimator.cost_model import (
    AnalyticCostModel,
    LayerCost,
    OptimizerCost,
    execution_cost_config,
)
from megatron_spindle.estimator.curve import CurvePoint
from megatron_spindle.estimator.errors import EstimatorError
from megatron_spindle.estimator.profile import PROFILED_GRAD_BYTES, Measurement, Profile, load_profile
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaOp
from megatron_spindle.graph.workload import Workload


def profile_scale(measured: Iterable[CurvePoint], modelled: Callable[[int, int], float]) -> float:
    """Geometric mean of ``p.seconds / modelled(p.tp, p.dp)`` over the measured points (1.0 without any)."""
    logs = [math.log(p.seconds / modelled(p.tp, p.dp)) for p in measured]
    return math.exp(sum(logs) / len(logs)) if logs else 1.0


def cluster_with_bandwidth(cluster: ClusterSpec, bandwidth: Mapping[str, Any] | None) -> ClusterSpec:
    """The cluster with its links replaced by a profile's measured ones, where measured (the "intra_node" and
    "inter_node" sections of tools/profile_metaops.py, profiler/comm.py): per link the all-reduce bus bandwidth
    (``intra_node_bw``; ``inter_node_bw``: one group's ring across nodes), the point-to-point bandwidth
    (``intra_node_p2p_bw``; ``network_rail_bw``: one device's path to the network), the latency of one small
    all-reduce (``collective_latency`` inside a node; across nodes, one rank per node, ``network_latency``:
    what crossing adds; estimator/comm_model.py), and the older per-hop latencies. Inside a node also one small
    point-to-point message's time (``p2p_latency``), and from either link the compute time a device loses per
    message (``message_host_seconds``), the slowdown of compute and a collective that overlap
    (``overlap_slowdown``) and what a collective beside compute takes beyond that (``overlap_latency``), the
    larger of the two links' (profiler/comm.py)."""
    changes: dict[str, float] = {}
    for section, bw, p2p, small, hop in (
            ("intra_node", "intra_node_bw", "intra_node_p2p_bw", "collective_latency", "intra_node_latency"),
            ("inter_node", "inter_node_bw", "network_rail_bw", "network_latency", "inter_node_latency")):
        link = (bandwidth or {}).get(section)
        if not link:
            continue
        changes[bw] = float(link["allreduce_bus_bytes_per_s"])
        changes[hop] = float(link["allreduce_latency_s"])
        if link.get("p2p_bytes_per_s"):
            changes[p2p] = float(link["p2p_bytes_per_s"])
        timed = link.get("allreduce_seconds") or {}
        if timed:  # the smallest message measured: one collective's latency
            changes[small] = float(timed[min(timed, key=lambda size: int(size))])
        if section == "intra_node" and link.get("p2p_latency_s"):
            changes["p2p_latency"] = float(link["p2p_latency_s"])
        for key, field in (("overlap_slowdown", "overlap_slowdown"), ("message_host_s", "message_host_seconds"),
                           ("overlap_latency_s", "overlap_latency")):
            if link.get(key):  # the costlier of the two links
                changes[field] = max(changes.get(field, 0.0), float(link[key]))
    return dataclasses.replace(cluster, **changes) if changes else cluster


def load_planning_profile(path, workload: Workload, cluster: ClusterSpec) -> tuple[Profile, ClusterSpec]:
    """A profile file read for planning (``--spindle-profile``): the profile, and the cluster with the links it
    measured (``cluster_with_bandwidth``), so that the plan records and is timed on what was measured."""
    try:
        profile = load_profile(path, workload, cluster)
    except OSError as e:  # the flag named, as for every other input file
        raise EstimatorError(f"--spindle-profile {path}: {(e.strerror or str(e)).lower()}") from None
    return profile, cluster_with_bandwidth(cluster, profile.bandwidth)


def profile_summary(profile: Profile, cluster: ClusterSpec) -> str:
    """One line on what planning takes from a profile: its measurements and the links it measured
    (``cluster``: the cluster with them, ``load_planning_profile``'s)."""
    if profile.measurements:
        copies = any(m.shard_load_seconds or m.shard_grad_seconds for m in profile.measurements)
        parts = [f"{len(profile.measurements)} measured configurations"
                 + (" (with the sharded runtime's copies)" if copies else "")]
    else:
        parts = [f"curve points of {len(profile.points)} MetaOps"]
    if profile.optimizer is not None:
        parts.append("the AdamW step")
    bandwidth = profile.bandwidth or {}
    measured = [f"{where} all-reduce bus {bw / 1e9:.3g} GB/s" for section, where, bw in (
        ("intra_node", "in a node", cluster.intra_node_bw), ("inter_node", "across nodes", cluster.inter_node_bw))
        if bandwidth.get(section)]
    if measured:
        if cluster.p2p_latency:
            measured.append(f"a message {cluster.p2p_latency * 1e6:.0f} us")
        if cluster.message_host_seconds:
            measured.append(f"{cluster.message_host_seconds * 1e6:.0f} us of compute per message")
        if cluster.overlap_slowdown:
            measured.append(f"compute beside a collective x{cluster.overlap_slowdown:.2f}")
        if cluster.overlap_latency:
            measured.append(f"a collective beside compute +{cluster.overlap_latency * 1e3:.2f} ms")
        parts.append("links: " + ", ".join(measured))
    return "profile: " + "; ".join(parts)


def planning_cost_model(workload: Workload, cluster: ClusterSpec, profile=None, choices=None) -> AnalyticCostModel:
    """The planner's cost model: a ``Profile`` with measurements gives a ``ProfiledCostModel`` (its operators
    and AdamW step as measured), so the planner's estimate and plan selection time what the curves were made
    of; anything else (no profile, or its curve points alone) the analytic model. ``choices``: what the runtime
    runs (``execution_cost_config``'s; measured operators keep their measured times)."""
    config = execution_cost_config(choices)
    if isinstance(profile, Profile) and profile.measurements:
        return ProfiledCostModel(workload, cluster, profile.measurements, optimizer=profile.optimizer, config=config)
    return AnalyticCostModel(workload, cluster, config=config)


def profile_points(profile) -> dict | None:
    """The curve points of a profile given to the planner: a ``Profile``'s, or the points themselves."""
    return profile.points if isinstance(profile, Profile) else profile


def profile_for(profile, metaops: Iterable[str], num_devices: int):
    """A profile given to the planner, for a part of the workload (``metaops``: a subset's) on a part of the
    cluster (``num_devices``), e.g. one node group's: ``estimate_curves`` refuses points of other MetaOps and
    of configs that do not fit, as ``load_profile`` drops what was measured on more devices."""
    if profile is None:
        return None
    keep = set(metaops)
    points = {m: [p for p in pts if p.n <= num_devices] for m, pts in profile_points(profile).items() if m in keep}
    points = {m: pts for m, pts in points.items() if pts}
    if not isinstance(profile, Profile):
        return points
    return dataclasses.replace(profile, points=points,
                               measurements=[m for m in profile.measurements if m.n <= num_devices])


class ProfiledCostModel(AnalyticCostModel):
    """The analytic cost model with ``layer_cost`` replaced by measurements where they exist: compute (TP
    communication included) and the DP communication kept apart, as the simulator charges the gradient
    synchronisation itself. Other configs: the analytic cost scaled by ``profile_scale`` (``calibrate=False``:
    unscaled). ``optimizer``: the measured AdamW cost (None keeps the analytic cost of the cluster spec)."""

    def __init__(self, workload: Workload, cluster: ClusterSpec, measurements: Sequence[Measurement],
                 optimizer: OptimizerCost | None = None, calibrate: bool = True, **kwargs):
        super().__init__(workload, cluster, **kwargs)
        self.measured_optimizer = optimizer
        self.calibrate = calibrate
        self.measured: dict[tuple[str, int, int], Measurement] = {}
        self.copies_measured: dict[str, list[Measurement]] = {}  # MetaOp -> its measurements with sharded copies
        for meas in measurements:
            for mid in meas.members:
                self.measured[(mid, meas.tp, meas.dp)] = meas
                if meas.shard_load_seconds or meas.shard_grad_seconds:
                    self.copies_measured.setdefault(mid, []).append(meas)
        self._scale: dict[str, float] = {}

    def scale(self, metaop: MetaOp) -> float:
        """The factor on the analytic cost of ``metaop``'s unmeasured configs."""
        if not self.calibrate:
            return 1.0
        if metaop.id not in self._scale:
            weightless = not any(metaop.params)
            points = [meas.point(weightless) for (mid, _, _), meas in self.measured.items() if mid == metaop.id]
            self._scale[metaop.id] = profile_scale(
                points, lambda tp, dp: AnalyticCostModel.layer_cost(self, metaop, tp, dp).step)
        return self._scale[metaop.id]

    def optimizer_cost(self) -> OptimizerCost:
        """The measured step (AdamW, the bf16 weights' write, and the gradient norm where the step computes one:
        ``config.grad_norm``), else the analytic one."""
        if self.measured_optimizer is None:
            return super().optimizer_cost()
        return self.measured_optimizer.step_cost(self.config.grad_norm)

    def phase_seconds(self, metaop: MetaOp, tp: int, dp: int) -> tuple[float, float]:
        """(forward, backward) of ONE operator without gradient sync: a measured compute split as measured
        (``Measurement.forward_seconds``) or, in profiles without it, like the analytic model splits it at the
        same config; else the analytic phases scaled like ``layer_cost``."""
        fwd, bwd = self._analytic_phases(metaop, tp, dp)
        meas = self.measured.get((metaop.id, tp, dp))
        if meas is not None:
            share = fwd / (fwd + bwd) if fwd + bwd > 0 else 1.0 / 3.0
            if 0.0 < meas.forward_seconds <= meas.compute_seconds:
                share = meas.forward_seconds / meas.compute_seconds
            return meas.compute_seconds * share, meas.compute_seconds * (1.0 - share)
        s = self.scale(metaop)
        return fwd * s, bwd * s

    def sharded_copy_seconds(self, metaop: MetaOp, tp: int, dp: int) -> tuple[float, float]:
        """The measured host copies of the sharded runtime (``Measurement.shard_load_seconds`` and
        ``shard_grad_seconds``): at this config, else of the measured config of the MetaOp with the nearest
        tp (they copy one TP rank's tensors; dp hardly matters), else none."""
        measured = self.copies_measured.get(metaop.id)
        if not measured:
            return 0.0, 0.0
        meas = min(measured, key=lambda m: (abs(m.tp - tp), abs(m.dp - dp)))  # the exact config first
        return meas.shard_load_seconds, meas.shard_grad_seconds

    def recompute_seconds(self, metaop: MetaOp, tp: int, dp: int, recompute, num_layers: int) -> float:
        """The analytic recomputation time at the MetaOp's measured level (``scale``)."""
        return super().recompute_seconds(metaop, tp, dp, recompute, num_layers) * self.scale(metaop)

    def layer_cost(self, metaop: MetaOp, tp: int, dp: int) -> LayerCost:
        meas = self.measured.get((metaop.id, tp, dp))
        if meas is not None and metaop.batch != self.workload.task(metaop.task).batch_size:
            meas = None  # a micro-batch (plan settings.micro_batches): the measurement was of the whole batch
        if meas is not None:
            if metaop.kind == "loss":  # no weights: its DP communication is the embeddings' all-gather
                return LayerCost(meas.compute_seconds, 0.0, 0.0, 0.0, data_comm=meas.dp_comm_seconds)
            sync = meas.dp_comm_seconds
            if self.config.grad_bytes != PROFILED_GRAD_BYTES:  # timed in fp32: the plan reduces in bf16
                sync = super().layer_cost(metaop, tp, dp).dp_sync  # the comm model, on the profile's links
            return LayerCost(compute=meas.compute_seconds, tp_comm=0.0, dp_sync=sync, launch=0.0)
        base = super().layer_cost(metaop, tp, dp)
        s = self.scale(metaop)
        return LayerCost(base.compute * s, base.tp_comm * s, base.dp_sync * s, base.launch * s,
                         base.data_comm * s)
