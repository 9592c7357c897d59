"""``--task-schedule``: the task set of every iteration of a run (paper App. D, dynamic task sets).

``"K1:a,b;K2:a,b,c"`` says: iterations ``0 .. K1-1`` train the ``--tasks`` set (default: all tasks), iterations
``K1 .. K2-1`` train ``{a, b}``, iterations from ``K2`` on train ``{a, b, c}``. Iteration numbers are absolute and
count completed iterations, as checkpoints do: "the set changes at iteration K" means the checkpoint
``iter_000000K`` (saved after K iterations) was trained with the old set and everything after it runs with the
new one, which is exactly what stopping at K and resuming with ``--tasks <new set>`` does. So a resumed run
continues the same schedule, whatever iteration it resumes at. ``0:...`` gives the first set (instead of
``--tasks``); an entry that repeats the set before it changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_spindle.flags import flag
from megatron_spindle.graph.task_sets import select_tasks
from megatron_spindle.graph.workload import Workload

TASK_SCHEDULE_HELP = (
    "Change the task set during the run without a restart: 'ITER:TASK,TASK;ITER:TASK,...'. Iterations < ITER train "
    "the previous set (the first: --tasks, default all), iterations >= ITER the new one; ITER counts completed "
    "iterations like checkpoints do, so the change at ITER equals stopping at iteration ITER and resuming with "
    "--tasks <new set>, and a resumed run continues the same (absolute) schedule. At each change the run replans "
    "(once per distinct set), rebuilds the engine and carries weights, AdamW state and per-task data positions "
    "over; units new to the model start as a fresh run would start them. '0:...' sets the first set instead of "
    "--tasks.")


@dataclass(frozen=True)
class TaskScheduleConfig:
    """The flags of dynamic task sets (the first set is the workload group's --tasks)."""

    task_schedule: str | None = field(default=None, metadata=flag(TASK_SCHEDULE_HELP,
                                                                  metavar="ITER:TASK,...;ITER:TASK,..."))


@dataclass(frozen=True)
class TaskSchedule:
    """``initial`` trains from iteration 0; ``changes`` ((iteration, task set), ...) take over in order."""

    initial: tuple[str, ...]
    changes: tuple[tuple[int, tuple[str, ...]], ...] = ()

    def tasks_at(self, iteration: int) -> tuple[str, ...]:
        """The set that trains iteration ``iteration`` (0-based: the one logged as ``iteration + 1``)."""
        tasks = self.initial
        for k, s in self.changes:
            if k <= iteration:
                tasks = s
        return tasks

    def boundaries(self, start: int, end: int) -> list[int]:
        """Iterations in ``(start, end)`` at which the set changes (the run's first set is built at ``start``)."""
        return [k for k, _ in self.changes if start < k < end]

    def task_sets(self) -> list[tuple[str, ...]]:
        """Every distinct set, in the order they first train."""
        out: list[tuple[str, ...]] = []
        for s in [self.initial] + [s for _, s in self.changes]:
            if s not in out:
                out.append(s)
        return out

    def all_tasks(self, workload: Workload) -> tuple[str, ...]:
        """Every task some iteration trains, in the workload's order."""
        used = {t for s in self.task_sets() for t in s}
        return tuple(t.name for t in workload.tasks if t.name in used)


def parse_task_schedule(text: str | None, workload: Workload, tasks: str | None) -> TaskSchedule:
    """The schedule of ``--task-schedule text`` over ``--tasks tasks``; ValueError naming the problem."""
    initial = select_tasks(workload, tasks.split(","), "--tasks") if tasks is not None else \
        tuple(t.name for t in workload.tasks)
    if not text or not text.strip():
        if text is not None:
            raise ValueError("--task-schedule is empty (give 'ITER:TASK,TASK;ITER:TASK,...')")
        return TaskSchedule(initial)
    changes: list[tuple[int, tuple[str, ...]]] = []
    for entry in text.split(";"):
        entry = entry.strip()
        if not entry:
            continue
        it_text, sep, names = entry.partition(":")
        if not sep:
            raise ValueError(f"--task-schedule: '{entry}' is not ITER:TASK,TASK,...")
        try:
            k = int(it_text.strip())
        except ValueError:
            raise ValueError(f"--task-schedule: iteration '{it_text.strip()}' of '{entry}' is not an integer") from None
        if k < 0:
            raise ValueError(f"--task-schedule: iteration {k} of '{entry}' is negative")
        if changes and k <= changes[-1][0]:
            raise ValueError(f"--task-schedule: iterations must increase, {k} comes after {changes[-1][0]}")
        if k == 0 and tasks is not None:
            raise ValueError("--task-schedule starts with '0:...' and --tasks is given too: name the first task "
                             "set once")
        changes.append((k, select_tasks(workload, names.split(","), f"--task-schedule (at iteration {k})")))
    if changes and changes[0][0] == 0:
        initial = changes.pop(0)[1]
    kept: list[tuple[int, tuple[str, ...]]] = []
    for k, s in changes:  # an entry that repeats the set in force changes nothing
        if s != (kept[-1][1] if kept else initial):
            kept.append((k, s))
    return TaskSchedule(initial, tuple(kept))
