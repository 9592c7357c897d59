"""Baseline planners of the paper's evaluation (DeepSpeed, Megatron-LM, DistMM-MT, Spindle-Optimus,
Spindle-Seq): each emits a ``Plan`` through the planner's assembler and is timed by the simulator (systems.py)."""

from megatron_spindle.baselines.systems import (
    BASELINES,
    BaselineContext,
    deepspeed_plan,
    distmm_plan,
    megatron_plan,
    memory_tuned,
    optimus_allocation,
    optimus_plan,
    spindle_seq_plan,
    task_metaops,
)

__all__ = ["BASELINES", "BaselineContext", "deepspeed_plan", "distmm_plan", "megatron_plan",
           "memory_tuned", "optimus_allocation", "optimus_plan", "spindle_seq_plan", "task_metaops"]
