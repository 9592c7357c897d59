"""Hand-made plans (planner/explicit.py): every MetaOp on given devices, checked before deriving."""

from __future__ import annotations

import pytest

from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import load_workload, workload_from_dict
from megatron_spindle.plan.schema import PlanError
from megatron_spindle.planner.explicit import plan_from_slices


def _every_metaop_on(workload, devices: list[int]):
    """Each MetaOp in a wave of its own on ``devices``, its layers at TP 2, the light MetaOps at TP 1."""
    g = build_metagraph(workload)
    return [[(mid, 0, g.metaops[mid].num_layers, devices, 2 if g.metaops[mid].kind == "layer" else 1)]
            for level in g.levels for mid in level]


def test_every_metaop_on_all_devices():
    w = load_workload("tiny-clip")
    plan = plan_from_slices(w, make_cluster(4, 4, "CPU"), _every_metaop_on(w, [0, 1, 2, 3]))
    assert plan.transfers and plan.param_groups and {(s.tp, s.dp) for s in plan.slices()} == {(1, 4), (2, 2)}


def test_a_dp_that_does_not_divide_the_batch_is_named_before_routing():
    """Routing splits a batch into equal DP shares; such a slice was an IndexError deep in the routing."""
    d = load_workload("tiny-clip").to_dict()
    d["tasks"][0]["batch_size"] = 6
    w = workload_from_dict(d)
    with pytest.raises(PlanError, match="dp 4 does not divide the batch 6"):
        plan_from_slices(w, make_cluster(4, 4, "CPU"), _every_metaop_on(w, [0, 1, 2, 3]))
