"""Fixtures shared by the test packages."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Single-threaded torch for the test: on a shared 2-core machine oversubscribed threads make runs very slow,
    and one thread gives in-process runs the reduction order of the launch scripts' OMP_NUM_THREADS=1 ranks."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def wavefront_plan():
    """``wavefront_plan(name, gpus)`` -> (workload, cluster, result) of the greedy wavefront planner with the default
    PlannerConfig on ``make_cluster(gpus)``, made once per test session: several test files need the same paper
    cells (the capped QWen-VAL-70B / 256 plan alone takes about 20 s here). Callers must not modify the result.
    A cell that does not fit raises PlanError each time it is asked for."""
    from megatron_spindle.graph.cluster import make_cluster
    from megatron_spindle.graph.workload import load_workload
    from megatron_spindle.planner.pipeline import PlannerConfig, plan_workload

    made = {}

    def plan(name: str, gpus: int):
        if (name, gpus) not in made:
            workload, cluster = load_workload(name), make_cluster(gpus)
            made[name, gpus] = workload, cluster, plan_workload(workload, cluster, PlannerConfig(planner="wavefront"))
        return made[name, gpus]

    return plan
