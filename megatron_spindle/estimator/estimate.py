"""Scaling curves for every MetaOp of a MetaGraph: analytic points, optionally overridden by profiled ones."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

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
) -> ScalingCurve:
    """The curve of one MetaOp: fastest config per valid n; at an n with profiled points the fastest profiled
    one, elsewhere the fastest modelled one scaled to the measured level (``profile_scale``; not when
    ``calibrate`` is False). ``allowed(metaop, tp, dp)`` filters configurations (e.g. those that fit device
    memory)."""
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
) -> dict[str, ScalingCurve]:
    """metaop id -> ScalingCurve. ``profile``: metaop id -> measured points (any subset of valid configs);
    they take precedence, and the analytic model fills the other n (scaled to the measured level when
    ``calibrate``). ``cache``: a dict kept by the caller for one cost model and cluster (the memory search fits
    the same curves on many rungs): a curve is fitted once per MetaOp shape and set of allowed configurations."""
    cost_model = cost_model or AnalyticCostModel(workload, cluster)
    profile = profile or {}
    unknown = sorted(set(profile) - set(metagraph.metaops))
    if unknown:
        raise EstimatorError(f"profile names MetaOps not in the graph: {unknown}")

    def curve(m: MetaOp) -> ScalingCurve:
        profiled = tuple(profile.get(m.id, ()))
        if cache is None:
            return estimate_curve(m, workload, cluster, cost_model, profiled, calibrate, allowed)
        configs = valid_configs(m, workload, cluster)
        fits = frozenset(c for c in configs if allowed is None or allowed(m, *c))
        key = (m.id, m.kind, m.module, tuple(m.input_shape), fits, profiled, calibrate)
        if key not in cache:
            cache[key] = estimate_curve(m, workload, cluster, cost_model, profiled, calibrate, allowed)
        return cache[key]

    return {mid: curve(m) for mid, m in metagraph.metaops.items()}
