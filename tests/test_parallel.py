"""Plan selection's parallel pieces (megatron_spindle/parallel.py): the same selection on any number of processes."""

from __future__ import annotations

import json
import pickle
import re

import pytest

from megatron_spindle import autoplan as autoplan_module
from megatron_spindle import parallel
from megatron_spindle.autoplan import autoplan
from megatron_spindle.estimator import AnalyticCostModel, Measurement, ProfiledCostModel
from megatron_spindle.estimator.profile import Profile
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.planner.pipeline import PlannerConfig


def _square(x: int) -> int:
    if x < 0:
        raise ValueError(f"negative: {x}")
    return x * x


def test_pool_size(monkeypatch):
    monkeypatch.setattr(parallel, "available_cpus", lambda: 40)
    assert parallel.pool_size(0, parallel.PARALLEL_MIN_DEVICES - 1) == 1  # small clusters: in this process
    assert parallel.pool_size(5, parallel.PARALLEL_MIN_DEVICES - 1) == 1
    assert parallel.pool_size(5, parallel.PARALLEL_MIN_DEVICES) == 5
    assert parallel.pool_size(0, 1024) == parallel.MAX_AUTO_WORKERS
    monkeypatch.setattr(parallel, "available_cpus", lambda: 3)
    assert parallel.pool_size(0, 1024) == 3
    with pytest.raises(ValueError, match="--spindle-planning-workers must be >= 0, got -1"):
        PlannerConfig(planning_workers=-1)


def test_parallel_map_keeps_the_order_and_raises_a_worker_s_error():
    items = [3, 1, 4, 1, 5, 9, 2, 6]
    assert parallel.parallel_map(_square, items, 2) == [x * x for x in items]
    with pytest.raises(ValueError, match="negative: -2"):
        parallel.parallel_map(_square, [1, -2, 3], 2)


def _square_in_this_process(x: int) -> int:
    import multiprocessing
    import os

    if multiprocessing.parent_process() is not None:  # a worker dies, as one re-running an unguarded script
        os._exit(1)
    return x * x


def test_a_broken_pool_falls_back_to_this_process_with_a_warning():
    with pytest.warns(RuntimeWarning, match="needs `if __name__ == \"__main__\":`"):
        assert parallel.parallel_map(_square_in_this_process, [2, 3], 2) == [4, 9]


def _cluster_and_profile():
    w, c = load_workload("tiny-clip"), make_cluster(parallel.PARALLEL_MIN_DEVICES, 8, "A800-80GB")
    tower = build_metagraph(w).metaops["vision_depth/vision"]
    slow = 10 * AnalyticCostModel(w, c).layer_cost(tower, 1, 1).step
    return w, c, Profile({}, [Measurement(tower.id, [tower.id], 1, 1, 1, slow, 0.0, "none", 0.0)])


def test_cost_models_pickle_with_their_answers():
    """What the workers receive: the analytic model (its GEMM cache dropped and rebuilt) and a profiled one."""
    w, c, profile = _cluster_and_profile()
    tower = build_metagraph(w).metaops["vision_depth/vision"]
    for model in (AnalyticCostModel(w, c), ProfiledCostModel(w, c, profile.measurements)):
        before = model.layer_cost(tower, 2, 4)
        copy = pickle.loads(pickle.dumps(model))
        assert copy.layer_cost(tower, 2, 4) == before == model.layer_cost(tower, 2, 4)


def test_autoplan_selects_the_same_plan_on_any_number_of_processes(monkeypatch):
    """Every candidate's simulated time, the selection and the plan are the same planned in one process and on
    two (node-group partitions planned, light levels pinned and candidates simulated in the workers), on a
    profile's cost model."""
    pools = []

    class CountedPool(parallel.ProcessPoolExecutor):
        def __init__(self, *args, **kwargs):
            pools.append(kwargs["max_workers"])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(parallel, "ProcessPoolExecutor", CountedPool)
    monkeypatch.setattr(autoplan_module, "PROGRESS_MIN_SECONDS", 0.0)  # every kind of candidate is reported
    w, c, profile = _cluster_and_profile()
    lines = {1: [], 2: []}
    runs = [autoplan(w, c, PlannerConfig(planner="wavefront", planning_workers=n), profile, lines[n].append)
            for n in (1, 2)]
    assert pools == [2, 2, 2]  # the node-group partitions, the pinned light levels, the candidates' simulations
    # progress: each kind of candidate as it is added, then the simulations (on the workers: announced)
    kinds = {m.group(1): int(m.group(2)) for m in map(re.compile(r"candidates: (.+): (\d+) in ").match, lines[2])
             if m}
    assert {"node groups", "light levels pinned"} <= set(kinds), lines[2]
    announced = [x for x in lines[2] if x.startswith("simulating ")]
    assert announced == [f"simulating {1 + sum(kinds.values())} candidate plans and their distributed-optimizer "
                         f"variants on 2 processes"], lines[2]
    assert not [x for x in lines[1] if x.startswith("simulating ")]
    names = [[(x.name, x.sim.iteration_time) for x in r.candidates] for r in runs]
    assert names[0] == names[1]
    assert any(name.startswith("node-groups-") for name, _ in names[0])

    def plan_json(r):
        d = r.plan.to_dict()
        d["planner"] = {k: v for k, v in d["planner"].items() if "seconds" not in k and k != "requested"}
        d["planner"]["selection"] = {**d["planner"]["selection"], "candidates": [
            {k: v for k, v in x.items() if "seconds" not in k} for x in d["planner"]["selection"]["candidates"]]}
        return json.dumps(d, sort_keys=True)

    assert plan_json(runs[0]) == plan_json(runs[1])
