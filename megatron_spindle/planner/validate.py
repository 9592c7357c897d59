"""Plan invariants, checked on every plan we write or load (and by the property tests)."""

from __future__ import annotations

from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaGraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.planner.plan import TRANSFER_KINDS, Plan, PlanError

TIME_EPS = 1e-9


def validate_plan(plan: Plan, workload: Workload | None = None, cluster: ClusterSpec | None = None,
                  metagraph: MetaGraph | None = None, check_memory: bool = True) -> None:
    """Raise PlanError naming the first violated invariant.

    - the plan belongs to this workload and cluster (digests);
    - every slice: devices exist, are distinct, and tp * dp == len(devices);
    - within a wave, device sets are disjoint, and waves do not overlap in time;
    - every layer of every MetaOp runs exactly once, in order;
    - no slice starts before its producers (previous layers, producer MetaOps) have ended;
    - predicted memory fits every device.
    """
    if workload is not None and plan.workload_digest != workload.digest():
        raise PlanError(f"plan was made for workload '{plan.workload_name}' ({plan.workload_digest}), "
                        f"not for '{workload.name}' ({workload.digest()})")
    if cluster is not None and plan.cluster_digest != cluster.digest():
        raise PlanError(f"plan was made for a cluster of {plan.num_devices} devices ({plan.cluster_digest}), "
                        f"not for this one of {cluster.num_devices} ({cluster.digest()})")
    n = plan.num_devices
    metaops = {m.id: m for m in plan.metaops}
    seen_ids = set()
    for w in plan.waves:
        used: dict[int, str] = {}
        for s in w.slices:
            where = f"wave {w.index} slice '{s.id}'"
            if s.id in seen_ids:
                raise PlanError(f"{where}: duplicate slice id")
            seen_ids.add(s.id)
            if s.metaop not in metaops:
                raise PlanError(f"{where}: unknown MetaOp '{s.metaop}'")
            bad = [d for d in s.devices if not 0 <= d < n]
            if bad:
                raise PlanError(f"{where}: devices {bad} do not exist (the cluster has {n})")
            if len(set(s.devices)) != len(s.devices) or not s.devices:
                raise PlanError(f"{where}: device list {s.devices} is empty or repeats a device")
            if s.tp * s.dp != len(s.devices):
                raise PlanError(f"{where}: tp {s.tp} x dp {s.dp} != {len(s.devices)} devices")
            m = metaops[s.metaop]
            if not 0 <= s.layer_start < s.layer_end <= m.num_layers:
                raise PlanError(f"{where}: layer range [{s.layer_start}, {s.layer_end}) does not exist in "
                                f"MetaOp '{m.id}' of {m.num_layers} layers")
            if m.input_shape[0] % s.dp:
                raise PlanError(f"{where}: dp {s.dp} does not divide the batch {m.input_shape[0]}")
            for d in s.devices:
                if d in used:
                    raise PlanError(f"wave {w.index}: device {d} is used by both '{used[d]}' and '{s.id}'")
                used[d] = s.id
    waves = sorted(plan.waves, key=lambda w: w.start)
    for a, b in zip(waves, waves[1:]):
        if b.start < a.end - TIME_EPS * max(1.0, a.end):
            raise PlanError(f"wave {b.index} starts at {b.start:.6g} before wave {a.index} ends at {a.end:.6g}")
    _check_coverage_and_order(plan, metaops)
    for t in plan.transfers:
        if t.kind not in TRANSFER_KINDS:
            raise PlanError(f"transfer {t.producer} -> {t.consumer}: unknown kind '{t.kind}'")
    if check_memory and cluster is not None and plan.memory_per_device:
        cap = cluster.gpu.memory_bytes
        for d, b in enumerate(plan.memory_per_device):
            if b > cap:
                raise PlanError(f"device {d}: predicted memory {b / 2**30:.1f} GiB exceeds capacity {cap / 2**30:.1f} GiB")
    if metagraph is not None:
        missing = set(metagraph.metaops) - set(metaops)
        if missing:
            raise PlanError(f"plan does not run MetaOps {sorted(missing)[:5]} of the workload")


def _check_coverage_and_order(plan: Plan, metaops) -> None:
    wave_of = {}
    by_metaop: dict[str, list] = {m: [] for m in metaops}
    for w in plan.waves:
        for s in w.slices:
            by_metaop[s.metaop].append((w, s))
            wave_of[s.id] = w
    end_of_metaop = {}
    start_of_metaop = {}
    for mid, items in by_metaop.items():
        m = metaops[mid]
        items.sort(key=lambda ws: ws[1].layer_start)
        pos = 0
        prev_end = None
        for w, s in items:
            if s.layer_start != pos:
                raise PlanError(f"MetaOp '{mid}': layers [{pos}, {s.layer_start}) never run or run twice "
                                f"(next slice '{s.id}' starts at layer {s.layer_start})")
            if prev_end is not None and w.start < prev_end - TIME_EPS * max(1.0, prev_end):
                raise PlanError(f"MetaOp '{mid}': slice '{s.id}' starts before its previous layers end")
            pos = s.layer_end
            prev_end = w.end
        if pos != m.num_layers:
            raise PlanError(f"MetaOp '{mid}': runs {pos} of its {m.num_layers} layers")
        start_of_metaop[mid] = min(w.start for w, _ in items)
        end_of_metaop[mid] = max(w.end for w, _ in items)
    for mid, m in metaops.items():
        for p in m.preds:
            if start_of_metaop[mid] < end_of_metaop[p] - TIME_EPS * max(1.0, end_of_metaop[p]):
                raise PlanError(f"MetaOp '{mid}' starts at {start_of_metaop[mid]:.6g} before its producer '{p}' "
                                f"ends at {end_of_metaop[p]:.6g}")
