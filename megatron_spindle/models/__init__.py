"""megatron-core operators for every MetaOp kind, and the single-process reference model.

Imports megatron-core (slow, ~5 s): the planner side never imports this package.
"""

from megatron_spindle.models.config import ModelConfig
from megatron_spindle.models.operator import SliceOperator, build_operator, metaop_infos

__all__ = ["ModelConfig", "SliceOperator", "build_operator", "metaop_infos"]
