"""Scalability estimator (paper section 3.2): valid (tp, dp) configs, an analytic cost model built on a per-kernel
GPU model (kernels.py, op_kernels.py) and a communication model (comm_model.py), piecewise alpha-beta scaling
curves and a memory model. Pure Python + numpy; never imports torch."""

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
from megatron_spindle.estimator.memory import BYTES_PER_PARAM, MemoryModel
from megatron_spindle.estimator.op_kernels import LayerShape, LayerTime, layer_time
from megatron_spindle.estimator.profile import (
    load_profile_points,
    optimizer_cost_from_dict,
    save_profile_points,
)

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
    "BYTES_PER_PARAM",
    "CURVE_SOURCES",
    "CostModelConfig",
    "CurvePiece",
    "CurvePoint",
    "EstimatorError",
    "LIGHT_KINDS",
    "LayerCost",
    "MemoryModel",
    "OptimizerCost",
    "ScalingCurve",
    "analytic_points",
    "choose_breakpoints",
    "estimate_curve",
    "estimate_curves",
    "load_profile_points",
    "optimizer_cost_from_dict",
    "save_profile_points",
    "valid_configs",
    "valid_ns",
    "valid_tp_degrees",
]
