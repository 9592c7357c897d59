"""--global-batch-size and --micro-batch-size: how Megatron's batch flags map onto a multi-task workload.

Spindle's batch unit is the task: task t contributes ``batch_size`` samples (its global batch) to every
iteration it takes part in, and the plan splits that batch over the data-parallel ranks of each slice, a
degree it chooses per slice.

- ``--global-batch-size N`` (samples per iteration over the tasks that train) overrides the workload's batches
  and keeps their proportions: task t gets ``N * b_t / sum(b)`` samples, which must come out whole (the valid N
  are the multiples of ``sum(b) / gcd(b)``). The plan is then made for these batches. With --task-schedule the
  sum runs over every task some set trains (each set's iterations then hold its own tasks' share).
- ``--micro-batch-size`` (Megatron: samples per forward on one data-parallel rank) has no single value here:
  slice s of task t runs ``b_t / dp_s`` samples per rank, with ``dp_s`` chosen by the planner, in one forward
  per iteration (plan micro-batches: ``--spindle-micro-batches`` when available). It is refused with this
  explanation rather than ignored.
"""

from __future__ import annotations

import argparse
import copy
import math
from functools import reduce

from megatron_spindle.graph.task_sets import task_set_workload
from megatron_spindle.graph.workload import Workload

GLOBAL_BATCH_HELP = ("Samples per iteration over all tasks: scales every task's batch by the same factor "
                     "(task t gets N * b_t / sum b; N must be a multiple of sum(b) / gcd(b)). "
                     "Default: the workload's per-task batches.")
MICRO_BATCH_HELP = ("Megatron's per-rank micro batch has no single value under Spindle: each slice of task t "
                    "runs b_t / dp samples per rank, dp chosen per slice by the planner, in one forward per "
                    "iteration. Set the batches with --global-batch-size (or the workload); giving this flag is "
                    "an error that says so.")


def add_batch_size_args(group) -> None:
    group.add_argument("--global-batch-size", type=int, default=None, help=GLOBAL_BATCH_HELP)
    group.add_argument("--micro-batch-size", type=int, default=None, help=MICRO_BATCH_HELP)


def apply_batch_size_args(workload: Workload, args: argparse.Namespace, tasks=None) -> Workload:
    """The workload with the per-task batches the flags ask for (a copy; the same object when none): the tasks
    named in ``tasks`` (default: all) share --global-batch-size; the others keep theirs."""
    if getattr(args, "micro_batch_size", None) is not None:
        raise ValueError(f"--micro-batch-size {args.micro_batch_size}: Spindle has no per-rank micro batch to "
                         f"set (each slice of task t runs b_t / dp samples per rank, dp chosen per slice by the "
                         f"planner); set the samples per iteration with --global-batch-size instead")
    n = getattr(args, "global_batch_size", None)  # a parser without the flags: the workload's batches
    if n is None:
        return workload
    names = set(tasks) if tasks is not None else {t.name for t in workload.tasks}
    batches = {t.name: t.batch_size for t in workload.tasks if t.name in names}
    total = sum(batches.values())
    step = total // reduce(math.gcd, batches.values())
    if n <= 0 or n % step:
        now = ", ".join(f"{t}={b}" for t, b in batches.items())
        raise ValueError(f"--global-batch-size {n}: the workload's per-task batches ({now}; {total} in all) scale "
                         f"to whole samples only for multiples of {step}")
    out = copy.deepcopy(workload)
    for t in out.tasks:
        if t.name in names:
            t.batch_size = t.batch_size * n // total
    return out


def batched_task_set(workload: Workload, args: argparse.Namespace, tasks=None) -> tuple[Workload, Workload]:
    """The workload at the batches the flags ask for, shared by ``tasks`` (default: all), and that workload
    restricted to ``tasks``: what pretrain_multitask.py trains and what the planning tools plan (``--tasks``,
    ``--global-batch-size``), by one rule."""
    base = apply_batch_size_args(workload, args, tasks)
    return base, task_set_workload(base, tasks if tasks is not None else [t.name for t in base.tasks])
