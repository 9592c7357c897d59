"""Deterministic multi-task sampler: each iteration's mixed batch, one global batch per task.

Every task walks its own dataset in epochs; epoch ``e`` of task ``t`` visits the samples in the order of a
permutation seeded by ``(seed, t, e)``, so the indices of any iteration depend only on the seed and the
position, never on the world size, the plan or which rank asks. The position (iteration, and per task the
epoch and the offset inside it) is a small JSON-able dict saved in checkpoints and restored exactly.

Per-task sampling weights. A Spindle plan runs every task with its fixed global batch in every iteration (the
batch shapes are part of the plan), so a weight cannot change how many samples a task gets. Instead a task's
weight ``w_t`` sets how often it *takes part*: in each iteration it counts with probability
``w_t / max_u w_u`` (drawn from ``(seed, iteration)``, again layout independent). A task that sits out an
iteration keeps its data position (its batch is the one it will use next time) and the trainer gives its loss
weight 0 for that iteration. With equal weights (the default) every task takes part every time.

Task-set changes (``--task-schedule``, or resuming with another ``--tasks``): the position is kept per task.
``load_state_dict(state, tasks_may_change=True)`` gives a task of the saved position its saved place, a task new
to the run its beginning (or, if it trained before and was dropped, the place it had when it was dropped), and
keeps the positions of the saved tasks this run does not train in ``dropped`` (saved as ``dropped_tasks``), so
they survive any number of later saves and resumes until the task comes back.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

import torch


def _task_seed(seed: int, task: str, epoch: int) -> int:
    return (seed * 1_000_003 + zlib.crc32(task.encode()) * 7919 + epoch * 104_729) % (2**63 - 1)


def epoch_permutation(size: int, seed: int, task: str, epoch: int) -> torch.Tensor:
    """The order of epoch ``epoch`` of a dataset of ``size`` samples, as a tensor (int32 where the indices fit):
    4 bytes per sample, where a Python list of them took about 36 (4 GB per rank and task at 100M samples)."""
    g = torch.Generator().manual_seed(_task_seed(seed, task, epoch))
    perm = torch.randperm(size, generator=g)
    return perm.to(torch.int32) if size <= torch.iinfo(torch.int32).max else perm


@dataclass
class MixedBatch:
    """Sample indices of one iteration: ``indices[task]`` (always filled, ``batch_size`` long) and whether each
    task takes part (``active[task]``; False only with unequal sampling weights)."""

    iteration: int
    indices: dict[str, list[int]]
    active: dict[str, bool]


class MultiTaskSampler:
    def __init__(self, dataset_sizes: dict[str, int], batch_sizes: dict[str, int], seed: int = 0,
                 sampling_weights: dict[str, float] | None = None):
        if set(dataset_sizes) != set(batch_sizes):
            raise ValueError(f"datasets for tasks {sorted(dataset_sizes)} but batch sizes for {sorted(batch_sizes)}")
        for t, n in dataset_sizes.items():
            if n <= 0:
                raise ValueError(f"task '{t}': its dataset is empty")
        for t, b in batch_sizes.items():
            if b <= 0:
                raise ValueError(f"task '{t}': batch size must be positive, got {b}")
        weights = dict(sampling_weights or {})
        unknown = sorted(set(weights) - set(dataset_sizes))
        if unknown:
            raise ValueError(f"sampling weights for unknown task(s) {unknown} (tasks: {sorted(dataset_sizes)})")
        for t, w in weights.items():
            if not w > 0:
                raise ValueError(f"task '{t}': sampling weight must be > 0, got {w}")
        self.tasks = sorted(dataset_sizes)
        self.sizes = dict(dataset_sizes)
        self.batch_sizes = dict(batch_sizes)
        self.seed = seed
        w = {t: float(weights.get(t, 1.0)) for t in self.tasks}
        top = max(w.values())
        self.participation = {t: w[t] / top for t in self.tasks}
        self.iteration = 0
        self.epoch = {t: 0 for t in self.tasks}
        self.offset = {t: 0 for t in self.tasks}
        self.dropped: dict[str, dict] = {}  # saved positions of tasks this sampler does not train
        self._perm: dict[tuple[str, int], torch.Tensor] = {}

    def _permutation(self, task: str, epoch: int) -> torch.Tensor:
        key = (task, epoch)
        if key not in self._perm:
            if len(self._perm) > 4 * len(self.tasks):
                self._perm.clear()
            self._perm[key] = epoch_permutation(self.sizes[task], self.seed, task, epoch)
        return self._perm[key]

    def _take(self, task: str) -> tuple[list[int], int, int]:
        epoch, offset, out = self.epoch[task], self.offset[task], []
        need = self.batch_sizes[task]
        while len(out) < need:
            perm = self._permutation(task, epoch)
            k = min(need - len(out), len(perm) - offset)
            out += perm[offset:offset + k].tolist()
            offset += k
            if offset == len(perm):
                epoch, offset = epoch + 1, 0
        return out, epoch, offset

    def _active(self, iteration: int) -> dict[str, bool]:
        if all(p == 1.0 for p in self.participation.values()):
            return {t: True for t in self.tasks}
        rng = random.Random(self.seed * 1_000_003 + iteration)
        draws = {t: rng.random() for t in self.tasks}
        return {t: draws[t] < self.participation[t] for t in self.tasks}

    def peek(self) -> MixedBatch:
        """The next iteration's batch without moving the position."""
        return MixedBatch(self.iteration, {t: self._take(t)[0] for t in self.tasks}, self._active(self.iteration))

    def next(self) -> MixedBatch:
        active = self._active(self.iteration)
        indices = {}
        for t in self.tasks:
            idx, epoch, offset = self._take(t)
            indices[t] = idx
            if active[t]:
                self.epoch[t], self.offset[t] = epoch, offset
        out = MixedBatch(self.iteration, indices, active)
        self.iteration += 1
        return out

    # ------------------------------------------------------------------------------ position
    def state_dict(self) -> dict:
        state = {"iteration": self.iteration, "seed": self.seed,
                 "tasks": {t: {"epoch": self.epoch[t], "offset": self.offset[t], "size": self.sizes[t],
                               "batch_size": self.batch_sizes[t]} for t in self.tasks}}
        if self.dropped:
            state["dropped_tasks"] = {t: dict(st) for t, st in sorted(self.dropped.items())}
        return state

    def load_state_dict(self, state: dict, tasks_may_change: bool = False) -> None:
        """Restore a saved position. The tasks, dataset sizes and seed must be the ones it was saved with
        (otherwise the same position would name other samples); batch sizes may differ. With
        ``tasks_may_change`` the saved tasks may differ from this sampler's (see the module docstring)."""
        tasks = state.get("tasks", {})
        if sorted(tasks) != self.tasks and not tasks_may_change:
            raise ValueError(f"saved data position is for tasks {sorted(tasks)}, this run has {self.tasks}")
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"saved data position used --seed {state['seed']}, this run uses {self.seed}")
        known = {**state.get("dropped_tasks", {}), **tasks}
        for t in self.tasks:
            st = known.get(t)
            if st is not None and st.get("size", self.sizes[t]) != self.sizes[t]:
                raise ValueError(f"task '{t}': saved data position is for a dataset of {st['size']} samples, "
                                 f"this one has {self.sizes[t]}")
        self.iteration = int(state["iteration"])
        for t in self.tasks:
            st = known.get(t, {"epoch": 0, "offset": 0})
            self.epoch[t], self.offset[t] = int(st["epoch"]), int(st["offset"])
        self.dropped = {t: dict(st) for t, st in known.items() if t not in self.tasks}
