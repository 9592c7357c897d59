"""What the CP-SAT planner returns: the waves, never worse than greedy, and what the solver proved about them.

Never worse than greedy: every answer is re-timed in floating point, and unless it is strictly better
(shorter makespan, or equal makespan and fewer inter-island bytes) the greedy waves come back unchanged with
``used_hint_only=True``. ``best_bound`` is the solver's bound minus the rounding error bound, so it bounds the
real makespan of every plan of the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_spindle.planner.cpsat.waves import REL_EPS
from megatron_spindle.planner.schedule import ScheduledWave


@dataclass
class CpSatResult:
    waves: list[ScheduledWave]
    status: str
    objective: float  # seconds: makespan of the returned waves (re-timed in floating point)
    best_bound: float | None  # seconds: lower bound on any plan of the model (None if not run), rounding included
    time_unit: float
    rounding_error_bound: float
    used_hint_only: bool
    greedy_makespan: float = 0.0
    c_star: float | None = None
    inter_island_bytes: float = 0.0
    greedy_inter_island_bytes: float = 0.0
    cross_level_overlap: bool = False
    barrier_makespan: float | None = None  # best level-barrier plan, when cross_level_overlap ran
    solve_seconds: float = 0.0
    solve_work: float | None = None  # deterministic time spent (--spindle-solver-deterministic), None otherwise
    notes: list[str] = field(default_factory=list)

    def gap_to_bound(self) -> float | None:
        if not self.best_bound:
            return None
        return self.objective / self.best_bound - 1.0

    def gap_to_c_star(self) -> float | None:
        if not self.c_star:
            return None
        return self.objective / self.c_star - 1.0

    def improvement(self) -> float:
        """Relative makespan reduction over the greedy plan (0 when the greedy plan is returned)."""
        return 1.0 - self.objective / self.greedy_makespan if self.greedy_makespan else 0.0

    def overlap_gain(self) -> float | None:
        """Relative makespan reduction of cross-level overlap over the best level-barrier plan."""
        if not self.barrier_makespan:
            return None
        return 1.0 - self.objective / self.barrier_makespan

    def summary(self) -> dict[str, Any]:
        """Flat JSON-able dict for plan.planner['solver'] and the plan summary line."""
        return {
            "status": self.status,
            "used_hint_only": self.used_hint_only,
            "makespan": self.objective,
            "greedy_makespan": self.greedy_makespan,
            "improvement": self.improvement(),
            "best_bound": self.best_bound,
            "gap_to_bound": self.gap_to_bound(),
            "c_star": self.c_star,
            "gap_to_c_star": self.gap_to_c_star(),
            "time_unit": self.time_unit,
            "rounding_error_bound": self.rounding_error_bound,
            "inter_island_bytes": self.inter_island_bytes,
            "greedy_inter_island_bytes": self.greedy_inter_island_bytes,
            "cross_level_overlap": self.cross_level_overlap,
            "barrier_makespan": self.barrier_makespan,
            "overlap_gain": self.overlap_gain(),
            "solve_seconds": self.solve_seconds,
            "solve_work": self.solve_work,
            "notes": "; ".join(dict.fromkeys(self.notes)),
        }


def strictly_better(ms: float, comm: float, ms_ref: float, comm_ref: float) -> bool:
    """Shorter makespan, or the same makespan and fewer inter-island bytes."""
    tol = REL_EPS * max(1.0, ms_ref)
    if ms < ms_ref - tol:
        return True
    return ms <= ms_ref + tol and comm < comm_ref * (1 - 1e-9) - 1e-6
