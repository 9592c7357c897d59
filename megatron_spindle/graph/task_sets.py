"""Task sets: which of a workload's tasks a run trains, as a set (``--tasks``, ``--task-schedule``).

A task set is a set: its workload lists the tasks in the workload's own order whatever order the user wrote,
so one set always has one workload digest, one plan (cached by the set) and one checkpoint key.
"""

from __future__ import annotations

from collections.abc import Iterable

from megatron_spindle.graph.workload import Workload, WorkloadError, check_trains


def select_tasks(workload: Workload, names: Iterable[str], flag: str = "--tasks") -> tuple[str, ...]:
    """The named tasks in the workload's order; WorkloadError naming an unknown or repeated task (and listing
    the workload's tasks), or an empty set."""
    known = [t.name for t in workload.tasks]
    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise WorkloadError(f"{flag}: no task named (workload '{workload.name}' has tasks: {', '.join(known)})")
    for n in names:
        if n not in known:
            raise WorkloadError(f"{flag}: unknown task '{n}' (workload '{workload.name}' has tasks: "
                                f"{', '.join(known)})")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise WorkloadError(f"{flag}: task(s) {', '.join(repeated)} named twice")
    return tuple(n for n in known if n in names)


def task_set_workload(workload: Workload, tasks: Iterable[str]) -> Workload:
    """``workload`` restricted to ``tasks`` (the workload itself when that is all of them); WorkloadError when one
    of them trains nothing (``check_trains``)."""
    tasks = select_tasks(workload, tasks)
    out = workload if list(tasks) == [t.name for t in workload.tasks] else workload.subset(list(tasks))
    check_trains(out)
    return out


def workload_units(workload: Workload) -> set[str]:
    """The parameter units the workload's model holds (``"vision.layers.3"``, ``"depth.head"``, ...)."""
    from megatron_spindle.graph.opgraph import build_operator_graph

    return {p for op in build_operator_graph(workload).ops.values() for p in op.params}


def describe_change(old: Iterable[str], new: Iterable[str]) -> tuple[list[str], list[str]]:
    """(added, dropped) tasks going from ``old`` to ``new``, each in the order given."""
    old, new = list(old), list(new)
    return [t for t in new if t not in old], [t for t in old if t not in new]


__all__ = ["WorkloadError", "describe_change", "select_tasks", "task_set_workload", "workload_units"]
