"""benchmarks/dynamic_tasks.py (Fig. 13): the scenarios are the paper's shape, and a tiny scenario adds up
(iterations x simulated time per phase + planning of each distinct set once + changes x the change cost)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import dynamic_tasks as bench  # noqa: E402

from megatron_spindle.graph.task_sets import select_tasks  # noqa: E402
from megatron_spindle.graph.workload import load_workload  # noqa: E402


def test_scenarios_have_the_papers_shape():
    clip, ofasys = bench.SCENARIOS["clip"], bench.SCENARIOS["ofasys"]
    assert clip.changes == 8 and clip.iterations == sum(clip.lengths()) == 200_000
    assert ofasys.changes == 6 and ofasys.iterations == sum(ofasys.lengths()) == 105_000
    for sc in bench.SCENARIOS.values():
        w = load_workload(sc.workload)
        sets = [tasks for _, tasks in sc.phases]
        assert all(select_tasks(w, tasks) == tasks for tasks in sets)  # real task names, in workload order
        assert all(a != b for a, b in zip(sets, sets[1:]))  # every boundary changes the set
        assert len(set(sets)) < len(sets)  # a set comes back (its plan is cached)
        assert all(n > 0 for n in sc.lengths())


def test_a_tiny_scenario_adds_up():
    tiny = bench.Scenario("tiny", "tiny-clip", 30, bench._phases((0, ["text_audio"]), (10, ["text_audio", "vision_text"]),
                                                                 (25, ["text_audio"])))
    r = bench.run_scenario("clip", tiny, 2, 1.5, lambda m: None)
    first, second, third = r["phases"]
    assert [p["iterations"] for p in r["phases"]] == [10, 15, 5] and third["cached"] and not second["cached"]
    assert third["iteration_time"] == first["iteration_time"] and all(v == 0 for v in third["planning_seconds"].values())
    assert r["systems"] == bench.SYSTEMS
    for s in bench.SYSTEMS:
        t = r["totals"][s]
        compute = sum(p["iterations"] * p["iteration_time"][s] for p in r["phases"])
        assert t["compute_s"] == pytest.approx(compute) and t["changes_s"] == 3.0
        assert t["total_s"] == pytest.approx(compute + t["planning_s"] + 3.0) and t["planning_s"] > 0
    assert "total wall time" in bench.total_table(r, 1.5) and "(cached plan)" in bench.phase_table(r)
