"""Scaling curves for every MetaOp of a MetaGraph: analytic points, optionally overridden by profiled ones."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from megatron_spindle.estimator.comm_model import overlapped_backward_seconds
from megatron_spindle.estimator.configs import valid_configs
from megatron_spindle.estimator.cost_model import AnalyticCostModel
from megatron_spindle.estimator.curve import CurvePoint, ScalingCurve
from megatron_spindle.estimator.errors import EstimatorError
from megatron_spindle.estimator.profiled import profile_scale
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaGraph, MetaOp
from megatron_spindle.graph.workload import Workload


def analytic_points(
    metaop: MetaOp, workload: Workload, cluster: ClusterSpec, cost_model: AnalyticCostModel
) -> list[CurvePoint]:
    """One point per valid (tp, dp) of the MetaOp, timed by the cost model: forward + backward without the
    gradient sync (``LayerCost.step``)."""
    return [
        CurvePoint(tp * dp, tp, dp, cost_model.layer_cost(metaop, tp, dp).step, "analytic")
        for tp, dp in valid_configs(metaop, workload, cluster)
    ]


def exposed_sync_seconds(cost_model: AnalyticCostModel, metaop: MetaOp, tp: int, dp: int, sharers: int) -> float:
    """What one operator's gradient sync adds to its step in steady state: its share (1 / ``sharers``: the
    MetaOps that hold the same weights sync them once) of the all-reduce, overlapped with one operator's
    backward at the overlap slowdown (the cluster's, else C10) and with its share of the overlap latency (0
    unless measured). Layer i's buckets overlap layer i-1's backward, so a sync longer than a layer's backward
    is exposed layer after layer, and only the curves of sync-aware planning see it. The sync is each TP rank's
    shard over its dp ranks (plan/schema.py ``tp_sharded_grads``, the layout Spindle's plans run in; the
    analytic collective, which needs no measured configuration)."""
    sync = cost_model.dp_sync_seconds(metaop, tp, dp) / max(1, sharers)
    if sync <= 0:
        return 0.0
    _, backward = cost_model.phase_seconds(metaop, tp, dp)
    times = overlapped_backward_seconds(backward, [sync], ready=[0.0], slowdown=cost_model.comm.overlap_slowdown,
                                        latency=cost_model.comm.overlap_latency / max(1, sharers))
    return times.end - backward


SHARER_COUNTS = ("metaop", "level")


def weight_sharers(metagraph: MetaGraph, by: str = "metaop") -> dict[str, int]:
    """MetaOp id -> how many MetaOps (itself included) hold any of its weights (``by="metaop"``), or how many
    MetaLevels hold them (``by="level"``: MetaOps of one level run side by side on disjoint devices, so each
    syncs the copy its devices hold, and only sharers at different levels may sync one copy). Which is nearer
    depends on the placement, which curves do not know; plan selection tries both (autoplan.py)."""
    if by not in SHARER_COUNTS:
        raise ValueError(f"weight sharers are counted by one of {SHARER_COUNTS}, got {by!r}")
    level_of = {mid: k for k, level in enumerate(metagraph.levels) for mid in level}
    key = (lambda o: o) if by == "metaop" else level_of.__getitem__
    return {mid: len({key(o) for o in metagraph.metaops if metagraph.shares_params(o, mid)})
            for mid in metagraph.metaops}


def _with_exposed_sync(points: Sequence[CurvePoint], metaop: MetaOp, cost_model: AnalyticCostModel,
                       sharers: int) -> list[CurvePoint]:
    return [CurvePoint(p.n, p.tp, p.dp, p.seconds + exposed_sync_seconds(cost_model, metaop, p.tp, p.dp, sharers),
                       p.source) for p in points]


def _check_profiled(
    metaop: MetaOp, points: Sequence[CurvePoint], valid: set[tuple[int, int]]
) -> list[CurvePoint]:
    checked = []
    for p in points:
        if not isinstance(p, CurvePoint):
            raise EstimatorError(f"profile of '{metaop.id}': expected CurvePoint, got {type(p).__name__}")
        if (p.tp, p.dp) not in valid:
            raise EstimatorError(
                f"profile of '{metaop.id}': (tp={p.tp}, dp={p.dp}) is not a valid config of this MetaOp on this "
                f"cluster (valid: {sorted(valid, key=lambda c: (c[0] * c[1], c[0]))})"
            )
        checked.append(CurvePoint(p.n, p.tp, p.dp, p.seconds, "profiled"))
    return checked


def _best_per_n(points: Sequence[CurvePoint]) -> dict[int, CurvePoint]:
    best: dict[int, CurvePoint] = {}
    for p in points:
        if p.n not in best or (p.seconds, p.tp) < (best[p.n].seconds, best[p.n].tp):
            best[p.n] = p
    return best


def estimate_curve(
    metaop: MetaOp,
    workload: Workload,
    cluster: ClusterSpec,
    cost_model: AnalyticCostModel,
    profiled: Sequence[CurvePoint] = (),
    calibrate: bool = True,
    allowed: Callable[[MetaOp, int, int], bool] | None = None,
    sync_sharers: int = 0,
) -> ScalingCurve:
    """The curve of one MetaOp: fastest config per valid n; at an n with profiled points the fastest profiled
    one, elsewhere the fastest modelled one scaled to the measured level (``profile_scale``; not when
    ``calibrate`` is False). ``allowed(metaop, tp, dp)`` filters configurations (e.g. those that fit device
    memory). ``sync_sharers`` > 0 (sync-aware planning): every point also carries the gradient sync it cannot
    hide (``exposed_sync_seconds``, its weights held by that many MetaOps), so the fastest config per n and the
    allocation weigh it; by default T(n) is compute alone and the sync is charged per parameter device group
    by the planner's estimate and the simulator."""
    configs = valid_configs(metaop, workload, cluster)
    measured = _check_profiled(metaop, profiled, set(configs))
    modelled = analytic_points(metaop, workload, cluster, cost_model)
    scale = 1.0
    if calibrate:  # from every measured config: the level is the hardware's, whatever memory allows
        scale = profile_scale(measured, lambda tp, dp: cost_model.layer_cost(metaop, tp, dp).step)
    if allowed is not None:
        measured = [p for p in measured if allowed(metaop, p.tp, p.dp)]
        modelled = [p for p in modelled if allowed(metaop, p.tp, p.dp)]
        if not modelled:
            raise EstimatorError(f"MetaOp '{metaop.id}': none of its valid (tp, dp) configurations is allowed")
    if sync_sharers > 0:
        measured = _with_exposed_sync(measured, metaop, cost_model, sync_sharers)
        modelled = _with_exposed_sync([_scaled(p, scale) for p in modelled], metaop, cost_model, sync_sharers)
        scale = 1.0
    measured = _best_per_n(measured)
    modelled = _best_per_n(modelled)
    points = [measured[n] if n in measured else _scaled(modelled[n], scale) for n in modelled]
    return ScalingCurve.from_points(
        metaop.id,
        points,
        c=cost_model.communication_bytes(metaop),
        w=cost_model.flops(metaop),
        hop_bytes=cluster.intra_node_latency * cluster.intra_node_bw,
        source="profiled" if measured else "analytic",
        node_size=cluster.gpus_per_node,
    )


def _scaled(point: CurvePoint, scale: float) -> CurvePoint:
    return (
        point
        if scale == 1.0
        else CurvePoint(point.n, point.tp, point.dp, point.seconds * scale, point.source)
    )


def estimate_curves(
    metagraph: MetaGraph,
    workload: Workload,
    cluster: ClusterSpec,
    cost_model: AnalyticCostModel | None = None,
    profile: Mapping[str, Sequence[CurvePoint]] | None = None,
    calibrate: bool = True,
    allowed: Callable[[MetaOp, int, int], bool] | None = None,
    cache: dict | None = None,
    sync_sharers: str | None = None,
) -> dict[str, ScalingCurve]:
    """metaop id -> ScalingCurve. ``profile``: metaop id -> measured points (any subset of valid configs);
    they take precedence, and the analytic model fills the other n (scaled to the measured level when
    ``calibrate``). ``cache``: a dict kept by the caller for one cost model and cluster (the memory search fits
    the same curves on many rungs): a curve is fitted once per MetaOp shape and set of allowed configurations.
    ``sync_sharers`` (one of SHARER_COUNTS): the curves weigh each MetaOp's exposed gradient sync, its weights'
    sharers counted that way (``weight_sharers``, ``estimate_curve``'s ``sync_sharers``); None: compute alone."""
    cost_model = cost_model or AnalyticCostModel(workload, cluster)
    profile = profile or {}
    unknown = sorted(set(profile) - set(metagraph.metaops))
    if unknown:
        raise EstimatorError(f"profile names MetaOps not in the graph: {unknown}")

    sharers = weight_sharers(metagraph, sync_sharers) if sync_sharers else {}

    def curve(m: MetaOp) -> ScalingCurve:
        profiled = tuple(profile.get(m.id, ()))
        shared = sharers.get(m.id, 0)
        if cache is None:
            return estimate_curve(m, workload, cluster, cost_model, profiled, calibrate, allowed, shared)
        configs = valid_configs(m, workload, cluster)
        fits = frozenset(c for c in configs if allowed is None or allowed(m, *c))
        key = (m.id, m.kind, m.module, tuple(m.input_shape), fits, profiled, calibrate, shared)
        if key not in cache:
            cache[key] = estimate_curve(m, workload, cluster, cost_model, profiled, calibrate, allowed, shared)
        return cache[key]

    return {mid: curve(m) for mid, m in metagraph.metaops.items()}
