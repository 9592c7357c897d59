"""CP-SAT planner: per-slice (n, tp, dp), layer split, wave order and devices chosen by OR-Tools, starting
from the greedy wavefront plan and never returning a worse one.

Modules, in the order a call goes through them:

- ``solve``: ``solve_cpsat``, the entry point: builds the Problem, runs the Search, returns the CpSatResult.
- ``problem``: the inputs as the models read them (Problem), slice options in integer time units, CpSatOptions.
- ``accounting``: every byte counted: per-device memory (``device_memory``) and inter-island bytes
  (``inter_island_bytes``) of placed waves, and the per-layer and per-MetaOp coefficients of the models.
- ``budget``: TimeBudget, the one clock every stage, level and model takes its share of.
- ``search``: the stages (barrier plan, memory, cross-level overlap, communication) and the placement of
  their plans.
- ``levels``: the per-level search of the barrier plan (constructive plans, slot deepening, growth).
- ``lns``: the wave-window search inside a level.
- ``model``: SlotModel, the wave-slot CP-SAT model (why wave slots, and how it is linearised).
- ``ranges``: contiguous tp-aligned device ranges for the slices of a wave.
- ``waves``: small rules on lists of waves (makespan, re-timing).
- ``result``: CpSatResult and the never-worse-than-greedy rule.
"""

from megatron_spindle.planner.cpsat.accounting import MemoryModel, device_memory, inter_island_bytes
from megatron_spindle.planner.cpsat.problem import CpSatMemoryError, CpSatOptions, SliceOption
from megatron_spindle.planner.cpsat.ranges import pack_ranges
from megatron_spindle.planner.cpsat.result import CpSatResult
from megatron_spindle.planner.cpsat.solve import solve_cpsat
from megatron_spindle.planner.cpsat.waves import makespan

__all__ = [
    "CpSatMemoryError",
    "CpSatOptions",
    "CpSatResult",
    "MemoryModel",
    "SliceOption",
    "device_memory",
    "inter_island_bytes",
    "makespan",
    "pack_ranges",
    "solve_cpsat",
]
