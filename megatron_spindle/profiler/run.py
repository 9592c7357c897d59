"""``run_profile``: which MetaOps and configs to measure, then bandwidth, every config, and the optimizer."""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_spindle.estimator.configs import valid_configs
from megatron_spindle.estimator.cost_model import AnalyticCostModel, OptimizerCost
from megatron_spindle.estimator.curve import CurvePoint
from megatron_spindle.estimator.errors import EstimatorError
from megatron_spindle.estimator.profile import (
    Measurement,
    Profile,
    points_of,
    save_profile_points,
    weightless_metaops,
)
from megatron_spindle.estimator.profiled import cluster_with_bandwidth
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaGraph, MetaOp, build_metagraph
from megatron_spindle.graph.task_sets import workload_units
from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan.schema import dropouts, resolve_attention_backend
from megatron_spindle.profiler.comm import ProbeChunk, dp_comm_seconds, measure_bandwidth
from megatron_spindle.profiler.fingerprint import describe_hardware, profile_key, software_versions
from megatron_spindle.profiler.operators import layer_chunk, measure_config, measure_optimizer
from megatron_spindle.profiler.settings import ProfilerSettings
from megatron_spindle.profiler.world import ProfileWorld


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


@dataclass
class ProfileResult:
    """Everything one profiling run measured, and how (saved as a profile file with extra sections)."""

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
        return points_of(self.measurements, weightless_metaops(self.workload))

    def profile(self) -> Profile:
        """The measurements as ``load_profile`` would read them back from the saved file."""
        return Profile(self.points, list(self.measurements), dict(self.bandwidth), self.optimizer,
                       self.settings.attention_backend,
                       dropouts(self.settings))

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


def _message_probe_chunk(workload: Workload, g: MetaGraph, infos: dict, world: ProfileWorld,
                         settings: ProfilerSettings, flops_model: AnalyticCostModel) -> ProbeChunk | None:
    """The compute the message-cost probe runs between messages on CPU ranks: the workload's lightest layer
    MetaOp, one layer forward and backward (None on GPUs, where the probe measures nothing, with one rank, and
    without layers)."""
    if world.device.type != "cpu" or world.world_size < 2:
        return None
    layers = [m for m in g.metaops.values() if m.kind == "layer"]
    if not layers:
        return None
    lightest = min(layers, key=lambda m: (flops_model.flops(m), m.id))
    return ProbeChunk(f"{lightest.id} (one layer, forward and backward)",
                      layer_chunk(workload, infos[lightest.id], world, settings))


def measured_attention(settings: ProfilerSettings, world: ProfileWorld) -> ProfilerSettings:
    """``settings`` with the attention backend that runs on ``world``'s device (plan/schema.py
    ``resolve_attention_backend``: auto is the local spec on a CPU or without Transformer Engine), which the
    profile records and plans on it run."""
    from megatron_spindle.compat.cpu import te_available

    backend = resolve_attention_backend(settings.attention_backend, world.device.type, te_available())
    return dataclasses.replace(settings, attention_backend=backend)


def run_profile(workload: Workload, cluster: ClusterSpec, settings: ProfilerSettings | None = None,
                world: ProfileWorld | None = None, progress: Callable[[str], None] | None = None) -> ProfileResult:
    """Measure every MetaOp group at its measurable configs (see ``megatron_spindle.profiler``). Collective."""
    from megatron_spindle.compat.cpu import apply_cpu_shim
    from megatron_spindle.compat.groups import ensure_global_memory_buffer
    from megatron_spindle.models.operator import metaop_infos

    world = world or ProfileWorld.current()
    settings = measured_attention(settings or ProfilerSettings(), world)
    say = progress if (progress is not None and world.rank == 0) else (lambda msg: None)
    apply_cpu_shim()
    ensure_global_memory_buffer()
    t_start = time.perf_counter()
    hardware, versions = describe_hardware(world), software_versions()
    key = profile_key(workload, cluster, hardware, versions, settings)
    g = build_metagraph(workload)
    infos = metaop_infos(workload)

    flops_model = AnalyticCostModel(workload, cluster)
    say(f"bandwidth: {world.world_size} rank(s), {world.num_nodes} node(s) of {world.local_world_size}")
    bandwidth = measure_bandwidth(world, settings.bandwidth_sizes, settings.repeats,
                                  _message_probe_chunk(workload, g, infos, world, settings, flops_model))
    for section in ("intra_node", "inter_node"):
        link = bandwidth[section]
        if link:
            say(f"  {section}: p2p {link['p2p_bytes_per_s'] / 1e9:.2f} GB/s, all-reduce bus "
                f"{link['allreduce_bus_bytes_per_s'] / 1e9:.2f} GB/s over {len(link['allreduce_ranks'])} ranks, "
                f"latency {link['allreduce_latency_s'] * 1e6:.1f} us")
            if link["message_host_s"]:
                say(f"  a message costs a rank {link['message_host_s'] * 1e6:.0f} us of compute (measured between "
                    f"runs of {link['message_probe_compute']})")
        else:
            say(f"  {section}: not measured (needs two ranks); nominal cluster links are used")
    link_cluster = cluster_with_bandwidth(cluster, bandwidth)
    measured_links = any(bandwidth.values())
    model = AnalyticCostModel(workload, link_cluster)

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
        compute, forward, numel, layers, load, stage = measure_config(workload, infos[rep], m, tp, dp, world,
                                                                      settings)
        if not math.isfinite(compute):
            for mid in members:
                failed.setdefault(mid, []).append((tp, dp))
                unmeasured.setdefault(mid, []).append((tp, dp))
            say(f"[{i}/{len(plan)}] {rep} tp={tp} dp={dp}: out of memory, left to the analytic model")
            continue
        comm, source = dp_comm_seconds(world, cluster, model, m, tp, dp, numel, settings, measured_links)
        meas = Measurement(rep, list(members), tp, dp, layers, compute, comm, source, flops_model.flops(m),
                           time.perf_counter() - t0, forward_seconds=min(forward, compute),
                           shard_load_seconds=load, shard_grad_seconds=stage)
        measurements.append(meas)
        shared = f" (+{len(members) - 1} same-shape)" if len(members) > 1 else ""
        say(f"[{i}/{len(plan)}] {rep}{shared} tp={tp} dp={dp}: {meas.seconds * 1e3:.3f} ms/op = compute "
            f"{compute * 1e3:.3f} + dp comm {comm * 1e3:.3f} ({source}); {layers} op(s) timed, "
            f"{meas.tflops_per_device:.3g} TFLOP/s per device; ZeRO-1/2 copies {(load + stage) * 1e3:.3f} ms/op")
    optimizer = measure_optimizer(world, settings, [flops_model.param_count(u) for u in workload_units(workload)])
    say(f"optimizer: AdamW {optimizer.seconds_per_element * 1e9:.3f} ns/element + "
        f"{optimizer.seconds_per_tensor * 1e6:.1f} us/tensor; gradient norm "
        f"{optimizer.norm_seconds_per_element * 1e9:.3f} ns/element"
        + (f", bf16 weights {optimizer.weight_seconds_per_element * 1e9:.3f} ns/element" if settings.bf16 else ""))
    world.barrier()
    for mid in unmeasured:
        unmeasured[mid] = sorted(set(unmeasured[mid]), key=lambda c: (c[0] * c[1], c[0]))
    return ProfileResult(workload, cluster, measurements, unmeasured, failed, bandwidth, hardware, versions,
                         settings, key, time.perf_counter() - t_start, optimizer)
