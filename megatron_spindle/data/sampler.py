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

Blends inside a task (``--data-path TASK=WEIGHT:PATH`` for each part). A task whose dataset is several parts
with weights (``blends``; the dataset is their concatenation, part k's sample j at index ``start_k + j``) walks
each part in its own epochs (permutations seeded by the task, the part and the epoch), and fills each batch
slot from the part furthest behind its share: slot s (the task's s-th sample overall) goes to the part k
maximising ``w_k * (s + 1) - taken_k`` (Megatron-LM's blended-dataset rule), so every prefix of the stream
holds each part within one sample of its weight. The position is the parts' epochs and offsets; no index over
the blend is built, whatever its size.

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


def weighted_path(item: str) -> tuple[float | None, str]:
    """A blend part ``WEIGHT:PATH`` -> (weight, path); anything else -> (None, item)."""
    head, sep, rest = str(item).partition(":")
    if sep:
        try:
            return float(head), rest
        except ValueError:
            pass
    return None, str(item)


def blend_weights(weights: list[float | None]) -> list[float] | None:
    """The weights of a task's datasets (None for an unweighted one): None where none is weighted (they are read
    in order as one), ValueError unless every one is weighted and there are at least two (a blend)."""
    given = [w for w in weights if w is not None]
    if not given:
        return None
    if len(given) != len(weights) or len(weights) < 2:
        raise ValueError(f"{len(given)} weighted part(s) of {len(weights)}: a blend gives every part a weight "
                         f"(TASK=WEIGHT:PATH), at least two of them")
    return given


@dataclass(frozen=True)
class Blend:
    """A task's dataset as weighted parts: their sizes (in dataset order) and weights (summing to 1)."""

    sizes: tuple[int, ...]
    weights: tuple[float, ...]

    @classmethod
    def of(cls, sizes, weights) -> Blend:
        if len(sizes) != len(weights) or len(sizes) < 2:
            raise ValueError(f"a blend needs a weight for each of at least two parts, got {len(weights)} "
                             f"weight(s) for {len(sizes)} part(s)")
        if any(not w > 0 for w in weights):
            raise ValueError(f"blend weights must be > 0, got {list(weights)}")
        if any(n <= 0 for n in sizes):
            raise ValueError(f"every part of a blend needs samples, got sizes {list(sizes)}")
        total = float(sum(weights))
        return cls(tuple(int(n) for n in sizes), tuple(w / total for w in weights))

    def parts_of(self, taken: list[int], count: int) -> list[int]:
        """The parts of the next ``count`` samples, given how many each part gave so far: each the one furthest
        behind its share (Megatron-LM's blended-dataset rule; ties to the first). A plain loop: a batch of 4096
        from 3 parts in about 3 ms."""
        taken, w, s, out = list(taken), self.weights, sum(taken), []
        for _ in range(count):
            s += 1
            best_k, best = 0, w[0] * s - taken[0]
            for k in range(1, len(w)):
                d = w[k] * s - taken[k]
                if d > best:
                    best_k, best = k, d
            taken[best_k] += 1
            out.append(best_k)
        return out

    @property
    def starts(self) -> list[int]:
        out, at = [], 0
        for n in self.sizes:
            out.append(at)
            at += n
        return out


class MultiTaskSampler:
    def __init__(self, dataset_sizes: dict[str, int], batch_sizes: dict[str, int], seed: int = 0,
                 sampling_weights: dict[str, float] | None = None, blends: dict[str, Blend] | None = None):
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
        self.blends = dict(blends or {})
        for t, b in self.blends.items():
            if t not in self.sizes:
                raise ValueError(f"a blend for unknown task '{t}' (tasks: {self.tasks})")
            if sum(b.sizes) != self.sizes[t]:
                raise ValueError(f"task '{t}': its blend's parts hold {sum(b.sizes)} samples, its dataset "
                                 f"{self.sizes[t]}")
        self.iteration = 0
        # a task's position: its epoch and offset, or for a blend each part's, as lists
        self.epoch = {t: [0] * len(self.blends[t].sizes) if t in self.blends else 0 for t in self.tasks}
        self.offset = {t: [0] * len(self.blends[t].sizes) if t in self.blends else 0 for t in self.tasks}
        self.dropped: dict[str, dict] = {}  # saved positions of tasks this sampler does not train
        self._perm: dict[tuple[str, int], torch.Tensor] = {}
        self._last_take: dict[str, tuple] = {}  # task -> (position, its next batch)

    def _permutation(self, stream: str, size: int, epoch: int) -> torch.Tensor:
        key = (stream, epoch)
        if key not in self._perm:
            if len(self._perm) > 4 * (len(self.tasks) + sum(len(b.sizes) for b in self.blends.values())):
                self._perm.clear()
            self._perm[key] = epoch_permutation(size, self.seed, stream, epoch)
        return self._perm[key]

    def _take(self, task: str) -> tuple[list[int], int | list[int], int | list[int]]:
        """The task's next batch from its position (kept once: the loader peeks at a batch, then takes it)."""
        key = (str(self.epoch[task]), str(self.offset[task]))
        last = self._last_take.get(task)
        if last is None or last[0] != key:
            last = self._last_take[task] = (key, self._take_blend(task) if task in self.blends
                                            else self._take_one(task))
        out, epoch, offset = last[1]
        return list(out), epoch, offset

    def _take_one(self, task: str) -> tuple[list[int], int, int]:
        return self._walk(task, self.sizes[task], self.epoch[task], self.offset[task], self.batch_sizes[task])

    def _walk(self, stream: str, size: int, epoch: int, offset: int, count: int) -> tuple[list[int], int, int]:
        """The next ``count`` samples of a stream of ``size`` walked in epochs, and the position after them."""
        out: list[int] = []
        while len(out) < count:
            perm = self._permutation(stream, size, epoch)
            k = min(count - len(out), len(perm) - offset)
            out += perm[offset:offset + k].tolist()
            offset += k
            if offset == len(perm):
                epoch, offset = epoch + 1, 0
        return out, epoch, offset

    def _take_blend(self, task: str) -> tuple[list[int], list[int], list[int]]:
        blend = self.blends[task]
        epochs, offsets = list(self.epoch[task]), list(self.offset[task])
        taken = [e * n + o for e, n, o in zip(epochs, blend.sizes, offsets)]
        parts = blend.parts_of(taken, self.batch_sizes[task])
        out = [0] * len(parts)
        for k, (start, size) in enumerate(zip(blend.starts, blend.sizes)):
            slots = [i for i, part in enumerate(parts) if part == k]
            if slots:
                idx, epochs[k], offsets[k] = self._walk(f"{task}#{k}", size, epochs[k], offsets[k], len(slots))
                for i, j in zip(slots, idx):
                    out[i] = start + j
        return out, epochs, offsets

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
    def _task_state(self, t: str) -> dict:
        st = {"size": self.sizes[t], "batch_size": self.batch_sizes[t]}
        if t not in self.blends:
            return {"epoch": self.epoch[t], "offset": self.offset[t], **st}
        b = self.blends[t]
        return {"parts": [{"epoch": e, "offset": o, "size": n, "weight": w}
                          for e, o, n, w in zip(self.epoch[t], self.offset[t], b.sizes, b.weights)], **st}

    def state_dict(self) -> dict:
        state = {"iteration": self.iteration, "seed": self.seed,
                 "tasks": {t: self._task_state(t) for t in self.tasks}}
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
            if st is not None:
                self._check_task_state(t, st)
        self.iteration = int(state["iteration"])
        for t in self.tasks:
            st = known.get(t)
            if st is None or _at_start(st):  # new to the run, or a converted checkpoint's: its beginning
                parts = len(self.blends[t].sizes) if t in self.blends else None
                self.epoch[t], self.offset[t] = ([0] * parts, [0] * parts) if parts else (0, 0)
            elif t in self.blends:  # the parts' places; their weights may have changed
                self.epoch[t] = [int(p["epoch"]) for p in st["parts"]]
                self.offset[t] = [int(p["offset"]) for p in st["parts"]]
            else:
                self.epoch[t], self.offset[t] = int(st["epoch"]), int(st["offset"])
        self.dropped = {t: dict(st) for t, st in known.items() if t not in self.tasks}

    def _check_task_state(self, t: str, st: dict) -> None:
        if _at_start(st):
            return
        if st.get("size", self.sizes[t]) != self.sizes[t]:
            raise ValueError(f"task '{t}': saved data position is for a dataset of {st['size']} samples, "
                             f"this one has {self.sizes[t]}")
        saved = [p["size"] for p in st["parts"]] if "parts" in st else None
        mine = list(self.blends[t].sizes) if t in self.blends else None
        if saved != mine:
            def what(sizes):
                return "one dataset" if sizes is None else f"a blend of parts of {sizes} samples"

            raise ValueError(f"task '{t}': saved data position is for {what(saved)}, this run reads {what(mine)}")


def _at_start(st: dict) -> bool:
    """A position of no particular dataset at its beginning (tools/checkpoint's converted checkpoints)."""
    return "size" not in st and "parts" not in st and not st.get("epoch") and not st.get("offset")
