"""Scalability estimator (paper section 3.2): valid (tp, dp) configs, an analytic cost model, piecewise
alpha-beta scaling curves, a memory model, and profiles (reading them and correcting the cost model by them).
Pure Python + numpy; never imports torch (measuring is ``megatron_spindle.profiler``)."""

from megatron_spindle.estimator.configs import LIGHT_KINDS, valid_configs, valid_ns, valid_tp_degrees
from megatron_spindle.estimator.cost_model import AnalyticCostModel, CostModelConfig, LayerCost, OptimizerCost
from megatron_spindle.estimator.curve import (
    CURVE_SOURCES,
    CurvePiece,
    CurvePoint,
    ScalingCurve,
    choose_breakpoints,
)
from megatron_spindle.estimator.errors import EstimatorError
from megatron_spindle.estimator.estimate import analytic_points, estimate_curve, estimate_curves
from megatron_spindle.estimator.memory import MemoryModel
from megatron_spindle.estimator.profile import (
    Measurement,
    Profile,
    load_profile,
    load_profile_points,
    optimizer_cost_from_dict,
    save_profile_points,
)
from megatron_spindle.estimator.profiled import ProfiledCostModel, cluster_with_bandwidth, profile_scale

__all__ = [
    "AnalyticCostModel",
    "CURVE_SOURCES",
    "CostModelConfig",
    "CurvePiece",
    "CurvePoint",
    "EstimatorError",
    "LIGHT_KINDS",
    "LayerCost",
    "Measurement",
    "MemoryModel",
    "OptimizerCost",
    "Profile",
    "ProfiledCostModel",
    "ScalingCurve",
    "analytic_points",
    "choose_breakpoints",
    "cluster_with_bandwidth",
    "estimate_curve",
    "estimate_curves",
    "load_profile",
    "load_profile_points",
    "optimizer_cost_from_dict",
    "profile_scale",
    "save_profile_points",
    "valid_configs",
    "valid_ns",
    "valid_tp_degrees",
]
