"""Scalability estimator (paper section 3.2): valid (tp, dp) configs, an analytic cost model built on a per-kernel
GPU model (kernels.py, op_kernels.py) and a communication model (comm_model.py), piecewise alpha-beta scaling
curves, a memory model, and profiles (reading them and correcting the cost model by them). Pure Python +
numpy; never imports torch (measuring is ``megatron_spindle.profiler``)."""

from megatron_spindle.estimator.comm_model import (
    OVERLAP_SLOWDOWN,
    CommModel,
    GroupPlacement,
    OverlapTimes,
    grad_buckets,
    overlapped_backward_seconds,
)
from megatron_spindle.estimator.configs import LIGHT_KINDS, valid_configs, valid_ns, valid_tp_degrees
from megatron_spindle.estimator.cost_model import (
    AnalyticCostModel,
    CostModelConfig,
    LayerCost,
    OptimizerCost,
    execution_cost_config,
    layer_seconds,
)
from megatron_spindle.estimator.curve import (
    CURVE_SOURCES,
    CurvePiece,
    CurvePoint,
    ScalingCurve,
    choose_breakpoints,
)
from megatron_spindle.estimator.errors import EstimatorError
from megatron_spindle.estimator.estimate import analytic_points, estimate_curve, estimate_curves
from megatron_spindle.estimator.kernels import KernelModel
from megatron_spindle.estimator.memory import MemoryModel
from megatron_spindle.estimator.op_kernels import LayerShape, LayerTime, layer_time
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
    "CommModel",
    "GroupPlacement",
    "KernelModel",
    "LayerShape",
    "LayerTime",
    "OVERLAP_SLOWDOWN",
    "OverlapTimes",
    "grad_buckets",
    "layer_seconds",
    "layer_time",
    "overlapped_backward_seconds",
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
    "execution_cost_config",
    "load_profile",
    "load_profile_points",
    "optimizer_cost_from_dict",
    "profile_scale",
    "save_profile_points",
    "valid_configs",
    "valid_ns",
    "valid_tp_degrees",
]
