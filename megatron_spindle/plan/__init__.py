"""The plan core: the Plan schema and every rule that interprets it, written once.

A leaf package (it imports only ``megatron_spindle.graph``, ``megatron_spindle.fileio`` and the standard
library); the planners, the baselines, the simulator and the runtime all call it:

- ``schema``: ``Plan`` (schema version 2) and its parts, ``ExecutionSettings`` (what the runtime and the
  simulator obey: recomputation, ZeRO stage, segments, micro-batches, backward order, gradient reduce dtype);
- ``io``: save (atomic) / load, version-1 files converted on load;  ``validate``: ``validate_plan``;
- ``layout``: a DP rank's rows, a slice's parameter units, the transfers a plan needs, parameter device groups;
- ``routing``: who sends which rows to whom by which route, and the bytes by route;
- ``order``: the forward/backward order of the waves;  ``memory``: per-device memory accounting.
"""

from megatron_spindle.plan.io import load_plan, save_plan
from megatron_spindle.plan.schema import TRANSFER_KINDS, ExecutionSettings, Plan, PlanError, Recompute
from megatron_spindle.plan.validate import validate_plan

__all__ = ["TRANSFER_KINDS", "ExecutionSettings", "Plan", "PlanError", "Recompute", "load_plan", "save_plan",
           "validate_plan"]
