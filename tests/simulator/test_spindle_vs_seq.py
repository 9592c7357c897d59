"""Spindle's plan is never slower than Spindle-Seq (each task on the whole cluster in turn) in the simulator,
and the simulator agrees with the planner's prediction on Spindle plans.

The shipped paper workloads use batches calibrated to the paper's DeepSpeed times (examples/workloads/
README.md); our memory model has no activation checkpointing, so at those batches Spindle's plan (which holds
every task's activations until the backward) does not fit 80 GiB. The property here is about time, so these
tests lift the memory cap (as benchmarks/paper_eval.py does for such cells, marked "mem-relaxed").
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import pytest

from megatron_spindle.baselines import BaselineContext, spindle_seq_plan
from megatron_spindle.graph.cluster import ClusterSpec, make_cluster
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.planner.pipeline import PlannerConfig, plan_workload
from megatron_spindle.simulator import simulate

# Cells where the greedy wavefront planner is known to lose to Spindle-Seq (strict xfail: a cell that starts
# passing must leave the set). ofasys-4 on 16 GPUs left it with the per-kernel cost model (issue 13).
KNOWN_SLOWER: set[tuple[str, int]] = set()
CELLS = [("tiny-clip", 4), ("tiny-vlm", 4), ("clip-4", 16), ("clip-10", 16), ("ofasys-4", 16), ("qwen-val", 32)]


def relaxed(cluster: ClusterSpec) -> ClusterSpec:
    return dataclasses.replace(cluster, gpu=dataclasses.replace(cluster.gpu, memory_bytes=16 * cluster.gpu.memory_bytes))


@lru_cache(maxsize=None)
def _times(name: str, n: int):
    w = load_workload(name)
    c = make_cluster(n) if name.startswith("tiny") else relaxed(make_cluster(n))
    res = plan_workload(w, c, PlannerConfig(planner="wavefront"))
    spindle = simulate(res.plan, w, c, res.cost_model, res.memory_model, metagraph=res.metagraph)
    ctx = BaselineContext(w, c, res.metagraph, res.cost_model, res.memory_model)
    seq = simulate(spindle_seq_plan(w, c, ctx), w, c, res.cost_model, res.memory_model, metagraph=res.metagraph)
    return res.plan, spindle, seq


@pytest.mark.parametrize(
    "name,n",
    [pytest.param(w, n, marks=pytest.mark.xfail(strict=True, reason="greedy wavefront gap, see KNOWN_SLOWER"))
     if (w, n) in KNOWN_SLOWER else (w, n) for w, n in CELLS],
)
def test_spindle_not_slower_than_spindle_seq(name, n):
    plan, spindle, seq = _times(name, n)
    assert spindle.iteration_time <= seq.iteration_time * (1 + 1e-9), (
        f"{name} on {n} GPUs: Spindle {spindle.iteration_time * 1e3:.1f} ms > Spindle-Seq {seq.iteration_time * 1e3:.1f} ms"
    )


@pytest.mark.parametrize("name,n", [("tiny-clip", 4), ("clip-4", 16), ("clip-10", 16)])
def test_simulator_agrees_with_planner_on_spindle_plans(name, n):
    """Within 25 %: the planner amortises each MetaOp's DP all-reduce into T(n) and ignores transfers, the
    simulator runs grouped all-reduces after the backward and times every transfer."""
    plan, spindle, _ = _times(name, n)
    predicted = plan.predicted["iteration_time"]
    assert spindle.iteration_time == pytest.approx(predicted, rel=0.25)
    assert spindle.compute_time <= predicted * 1.05  # compute alone (no sync, no transfers) fits the prediction
