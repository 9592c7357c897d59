"""What a checkpoint records about the task set it was trained with, and the units it keeps for tasks that left.

A run's checkpoint holds every unit of its model, and also the units of tasks that were dropped earlier
(``RetainedUnits``): a task that comes back later resumes with its trained weights and AdamW state, the same way
its data position is kept (data/sampler.py ``dropped_tasks``). ``extra["task_set"]`` in the metadata names the
base workload and the tasks the run trained; checkpoints from before it have the tasks in their data position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_spindle.checkpointing.checkpoint import UnitState

TASK_SET_KEY = "task_set"
CONSUMED_KEY = "consumed_train_samples"


def task_set_record(workload_name: str, workload_digest: str, tasks: tuple[str, ...]) -> dict[str, Any]:
    """``extra["task_set"]`` of a checkpoint: the base workload and the set of its tasks that was training."""
    return {"workload": workload_name, "workload_digest": workload_digest, "tasks": list(tasks)}


def saved_tasks(metadata: dict[str, Any]) -> tuple[str, ...]:
    """The tasks a checkpoint was trained with (its task-set record, else the tasks of its data position)."""
    record = metadata.get("extra", {}).get(TASK_SET_KEY)
    if record and record.get("tasks"):
        return tuple(record["tasks"])
    return tuple(metadata.get("data_position", {}).get("tasks", {}))


@dataclass
class RetainedUnits:
    """Units of no task in the current set: ``holder[u]`` (the same on every rank) is the rank that keeps unit
    ``u`` in CPU memory (``states``, filled on that rank only) and writes it into every checkpoint."""

    holder: dict[str, int] = field(default_factory=dict)
    states: dict[str, UnitState] = field(default_factory=dict)

    def keep(self, unit: str, rank: int, my_rank: int, state: UnitState | None) -> None:
        self.holder[unit] = rank
        if rank == my_rank:
            if state is None:
                raise ValueError(f"rank {my_rank} keeps unit '{unit}' but has no state for it")
            self.states[unit] = _to_cpu(state)

    def release(self, unit: str) -> UnitState | None:
        """Stop keeping ``unit`` (it is back in the model); its state on the holder, else None."""
        self.holder.pop(unit, None)
        return self.states.pop(unit, None)

    def mine(self) -> dict[str, UnitState]:
        return dict(self.states)


def _to_cpu(state: UnitState) -> UnitState:
    cpu = lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t  # noqa: E731
    return UnitState({k: cpu(v) for k, v in state.model.items()},
                     {k: {kk: cpu(vv) for kk, vv in st.items()} for k, st in state.optim.items()})


def spread(units: list[str], world_size: int) -> dict[str, int]:
    """Which rank keeps each unit read back from a checkpoint: round robin over the ranks, in name order."""
    return {u: i % world_size for i, u in enumerate(sorted(units))}
