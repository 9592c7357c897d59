"""Simulator: time any Plan (Spindle's or a baseline's) with the cost model, without GPUs.

``simulate(plan, workload, cluster, cost_model=None) -> SimResult``: iteration time and its breakdown
(compute, inter-wave transfers by route, gradient synchronisation per parameter device group), per-device
busy intervals and utilisation, and peak memory per device. See ``engine.py`` for the execution model.
"""

from megatron_spindle.plan.memory import zero_state_bytes_per_param
from megatron_spindle.simulator.engine import SimSettings, simulate
from megatron_spindle.simulator.result import GroupSync, Interval, SimResult

__all__ = ["GroupSync", "Interval", "SimResult", "SimSettings", "simulate", "zero_state_bytes_per_param"]
