"""The simulator's event engine (simulator/timeline.py) on hand-made tasks."""

from __future__ import annotations

import pytest

from megatron_spindle.simulator.timeline import Task, run_timeline


def test_a_task_without_work_runs_once_and_its_devices_go_on():
    """A task of no work (the backward of a frozen front end) ends where it starts; its devices then run the next
    tasks in order. It used to be started again for every device that reached it, skipping later tasks."""
    devices = (0, 1, 2)
    tasks = [Task(devices, 1.0), Task(devices, 0.0), Task(devices, 2.0), Task((0,), 0.0), Task(devices, 0.5)]
    run = run_timeline(3, tasks)
    assert run.task_end == pytest.approx([1.0, 1.0, 3.0, 3.0, 3.5])
    assert run.task_start == pytest.approx([0.0, 1.0, 1.0, 3.0, 3.0])
    assert run.device_end == pytest.approx([3.5, 3.5, 3.5])
