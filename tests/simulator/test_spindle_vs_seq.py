"""Spindle's plan (as a user gets it: autoplan's selection) is the fastest of its candidates and never slower
than Spindle-Seq (each task on the whole cluster in turn) in the simulator; the wavefront planner's own plan
against Spindle-Seq; the selected plan's prediction is the simulator's time, and the planner's own estimate
is near it.

The shipped paper workloads use batches calibrated to the paper's DeepSpeed times (examples/workloads/
README.md); at those batches Spindle's plans (which hold every task's activations until the backward) need
memory options (ZeRO, recomputation, micro-batches) to fit 80 GiB, which change the time. The property here is
about the schedules themselves, so these tests lift the memory cap.
"""

from __future__ import annotations

from functools import lru_cache

import pytest

from megatron_spindle.autoplan import autoplan
from megatron_spindle.baselines import BaselineContext, spindle_seq_plan
from megatron_spindle.graph.cluster import ClusterSpec, make_cluster
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.planner.pipeline import PlannerConfig, plan_workload
from megatron_spindle.simulator import simulate

# Cells where the greedy wavefront plan is known to lose to Spindle-Seq (strict xfail: a cell that starts
# passing must leave the set). With the per-kernel model these cells scale almost linearly at their batches, so
# the allocation gains no compute over Spindle-Seq while the plan's transfers and cross-node gradient sync cost
# (benchmarks/results/README.md); autoplan then selects the task-sequential fallback. qwen-val: 0.2 % slower.
KNOWN_SLOWER: set[tuple[str, int]] = {("clip-4", 16), ("ofasys-4", 16), ("qwen-val", 32)}
CELLS = [("tiny-clip", 4), ("tiny-vlm", 4), ("clip-4", 16), ("clip-10", 16), ("ofasys-4", 16), ("qwen-val", 32)]


def relaxed(cluster: ClusterSpec) -> ClusterSpec:
    return cluster.with_memory_factor(16)


@lru_cache(maxsize=None)
def _times(name: str, n: int):
    w = load_workload(name)
    c = make_cluster(n) if name.startswith("tiny") else relaxed(make_cluster(n))
    chosen = autoplan(w, c, PlannerConfig(planner="wavefront"))
    res = chosen.result
    spindle = simulate(res.plan, w, c, res.cost_model, res.memory_model, metagraph=res.metagraph)
    raw = plan_workload(w, c, PlannerConfig(planner="wavefront", select="none"))
    wavefront = simulate(raw.plan, w, c, raw.cost_model, raw.memory_model, metagraph=raw.metagraph)
    ctx = BaselineContext.build(w, c, metagraph=res.metagraph)
    seq = simulate(spindle_seq_plan(w, c, ctx), w, c, ctx.cost_model, ctx.memory_model, metagraph=res.metagraph)
    return res.plan, spindle, seq, wavefront, chosen


@pytest.mark.parametrize("name,n", CELLS)
def test_selected_plan_is_the_fastest_candidate_and_not_slower_than_spindle_seq(name, n):
    plan, spindle, seq, _, chosen = _times(name, n)
    assert spindle.iteration_time == pytest.approx(min(c.sim.iteration_time for c in chosen.candidates), rel=1e-9)
    assert spindle.iteration_time <= seq.iteration_time * (1 + 1e-9), (
        f"{name} on {n} GPUs: Spindle {spindle.iteration_time * 1e3:.1f} ms > Spindle-Seq {seq.iteration_time * 1e3:.1f} ms"
    )


@pytest.mark.parametrize(
    "name,n",
    [pytest.param(w, n, marks=pytest.mark.xfail(strict=True, reason="linear-scaling regime, see KNOWN_SLOWER"))
     if (w, n) in KNOWN_SLOWER else (w, n) for w, n in CELLS],
)
def test_wavefront_plan_not_slower_than_spindle_seq(name, n):
    _, _, seq, wavefront, _ = _times(name, n)
    assert wavefront.iteration_time <= seq.iteration_time * (1 + 1e-9), (
        f"{name} on {n} GPUs: wavefront {wavefront.iteration_time * 1e3:.1f} ms > Spindle-Seq "
        f"{seq.iteration_time * 1e3:.1f} ms"
    )


@pytest.mark.parametrize("name,n", [("tiny-clip", 4), ("clip-4", 16), ("clip-10", 16)])
def test_predicted_is_simulated_and_the_planner_estimate_is_near(name, n):
    """The selected plan's predicted iteration time is the simulator's (its breakdown too); the planner's own
    estimate (waves of T(n) + its estimate of transfers and exposed gradient sync, planner/objective.py) is
    within 25 % of it: it has wave barriers and no link contention. A node-group plan's merged waves share
    barriers its groups do not have: there the estimate is only an upper bound."""
    plan, spindle, *_ = _times(name, n)
    p = plan.predicted
    assert p["iteration_time"] == pytest.approx(spindle.iteration_time, rel=1e-9)
    assert p["simulated_grad_sync"] == pytest.approx(spindle.grad_sync_time, rel=1e-9, abs=1e-12)
    if plan.planner["selection"]["selected"].startswith("node-groups"):
        assert spindle.iteration_time <= p["planner_estimate"] * 1.05
    else:
        assert spindle.iteration_time == pytest.approx(p["planner_estimate"], rel=0.25)
    assert spindle.compute_time <= p["makespan"] * 1.05  # compute alone (no sync, no transfers) fits the waves
