"""Plan invariants, checked on every plan we write or load (and by the property tests)."""

from __future__ import annotations

from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaGraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan.layout import transfer_pairs
from megatron_spindle.plan.order import check_dataflow, slice_order
from megatron_spindle.plan.routing import Router, gradient_returns
from megatron_spindle.plan.schema import MLP_RECOMPUTE_KINDS, TRANSFER_KINDS, Plan, PlanError, recompute_fits

TIME_EPS = 1e-9


def check_plan_workload(plan: Plan, workload) -> None:
    """PlanError unless ``plan`` was made for ``workload`` (its digest: modules, tasks, batches, frozen modules)."""
    if plan.workload_digest != workload.digest():
        raise PlanError(f"plan was made for workload '{plan.workload_name}' ({plan.workload_digest}), "
                        f"not for '{workload.name}' ({workload.digest()}): give the --tasks, --global-batch-size "
                        f"and --freeze it was made with, or plan again")


def validate_plan(plan: Plan, workload: Workload | None = None, cluster: ClusterSpec | None = None,
                  metagraph: MetaGraph | None = None, check_memory: bool = True) -> None:
    """Raise PlanError naming the first violated invariant.

    - the plan belongs to this workload and cluster (digests);
    - wave i has index i, and waves start in index order without overlapping in time;
    - every slice: devices exist, are distinct, and tp * dp == len(devices); within a wave, device sets are
      disjoint;
    - every layer of every MetaOp runs exactly once, in order; no slice starts before its producers end;
    - the settings fit the plan (segments and backward order list every wave once; a backward never runs
      before the backward of a slice that reads the wave's output; per-slice recomputation names slices);
    - every transfer's bytes by route are the routing of its bytes (plan/routing.py), forward and backward;
    - predicted memory fits every device.
    """
    if workload is not None:
        check_plan_workload(plan, workload)
    if cluster is not None and plan.cluster_digest != cluster.digest():
        raise PlanError(f"plan was made for a cluster of {plan.num_devices} devices ({plan.cluster_digest}), "
                        f"not for this one of {cluster.num_devices} ({cluster.digest()})")
    metaops = {m.id: m for m in plan.metaops}
    validate_slices(plan, metaops)
    if workload is not None:
        _check_recompute_modules(plan, workload)
    for i, w in enumerate(plan.waves):
        if w.index != i:
            raise PlanError(f"wave at position {i} has index {w.index}: wave i must have index i")
    for a, b in zip(plan.waves, plan.waves[1:]):
        if b.start < a.end - TIME_EPS * max(1.0, a.end):
            raise PlanError(f"wave {b.index} starts at {b.start:.6g} before wave {a.index} ends at {a.end:.6g}")
    _check_coverage_and_order(plan, metaops)
    check_settings(plan)
    _check_transfers(plan, metaops)
    if check_memory and cluster is not None and plan.memory_per_device:
        cap = cluster.gpu.memory_bytes
        for d, b in enumerate(plan.memory_per_device):
            if b > cap:
                raise PlanError(f"device {d}: predicted memory {b / 2**30:.1f} GiB exceeds capacity {cap / 2**30:.1f} GiB")
    if metagraph is not None:
        missing = set(metagraph.metaops) - set(metaops)
        if missing:
            raise PlanError(f"plan does not run MetaOps {sorted(missing)[:5]} of the workload")


def check_settings(plan: Plan) -> None:
    """The execution settings against the plan's waves: the execution order (segments, backward order or an
    explicit order) runs every slice forward then backward once, producers before consumers forward and after
    them backward; per-slice recomputation names layer slices; micro-batches divide every batch, and every
    slice's dp divides a micro-batch."""
    settings = plan.settings
    order = slice_order([[s.task for s in w.slices] for w in plan.waves], settings)
    check_dataflow(order, _pairs(plan))
    ids = {s.id: s for w in plan.waves for s in w.slices}
    for sid, rc in settings.slice_recompute.items():
        if sid not in ids:
            raise PlanError(f"settings.slice_recompute names slice '{sid}' that is not in the plan")
        if rc.mode != "none" and ids[sid].kind != "layer":
            raise PlanError(f"settings.slice_recompute['{sid}']: a {ids[sid].kind} slice has no transformer layers "
                            f"to recompute")
        if rc.layers is not None and rc.method == "block" and rc.layers > ids[sid].num_layers:
            raise PlanError(f"settings.slice_recompute['{sid}']: {rc.layers} layers, the slice has "
                            f"{ids[sid].num_layers}")
    m = settings.micro_batches
    batch = {info.id: int(info.input_shape[0]) for info in plan.metaops}
    for s in ids.values():
        b = batch.get(s.metaop)
        if b is not None and (b % m or (b // m) % s.dp):
            raise PlanError(f"settings.micro_batches {m}: slice '{s.id}' has dp {s.dp}, which must divide its "
                            f"micro-batch (batch {b} / {m} micro-batches)")


def _pairs(plan: Plan):
    return transfer_pairs([w.slices for w in plan.waves], {m.id: m.preds for m in plan.metaops},
                          {m.id: m.num_layers for m in plan.metaops})


def _check_recompute_modules(plan: Plan, workload: Workload) -> None:
    for w in plan.waves:
        for s in w.slices:
            if s.kind != "layer":
                continue
            rc, module = plan.settings.recompute_of(s.id), workload.modules[plan.metaop(s.metaop).module]
            if not recompute_fits(rc, module.kind):
                raise PlanError(f"slice '{s.id}': recompute modules {list(rc.recompute_modules)} include mlp, which "
                                f"only {', '.join(MLP_RECOMPUTE_KINDS)} modules can recompute (module "
                                f"'{module.name}' is an {module.kind} with linear biases)")


def validate_slices(plan: Plan, metaops) -> None:
    """The slices alone (ids, MetaOps, devices, tp x dp, layer ranges, dp dividing the batch, one slice per
    device and wave): what deriving a plan's transfers and parameter groups relies on (``plan_from_slices``
    checks it first)."""
    n = plan.num_devices
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


def _check_transfers(plan: Plan, metaops) -> None:
    slices = {s.id: s for s in plan.slices()}
    router = Router(plan.gpus_per_node)
    for t in plan.transfers:
        where = f"transfer {t.producer} -> {t.consumer}"
        if t.kind not in TRANSFER_KINDS:
            raise PlanError(f"{where}: unknown kind '{t.kind}'")
        p, c = slices.get(t.producer), slices.get(t.consumer)
        if p is None or c is None:
            raise PlanError(f"{where}: no such slice")
        routed = router.transfer(t.producer, t.consumer, p, c, metaops[p.metaop].input_shape[0], t.bytes,
                                 gradient_returns(metaops[p.metaop].backward))
        if (t.bytes_by_kind, t.backward_bytes_by_kind, t.kind) != (
                routed.bytes_by_kind, routed.backward_bytes_by_kind, routed.kind):
            raise PlanError(f"{where}: bytes by route {t.bytes_by_kind} / backward {t.backward_bytes_by_kind} "
                            f"are not the routing of its {t.bytes:.0f} bytes ({routed.bytes_by_kind} / "
                            f"{routed.backward_bytes_by_kind})")


def _check_coverage_and_order(plan: Plan, metaops) -> None:
    by_metaop: dict[str, list] = {m: [] for m in metaops}
    for w in plan.waves:
        for s in w.slices:
            by_metaop[s.metaop].append((w, s))
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
