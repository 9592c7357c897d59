"""Pure layout logic of the runtime (no processes): message routes, derived transfers and parameter device
groups, and the plan checks that run before any communication."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from plans import build_plan, random_plan, sequential_plan

from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.plan.layout import dp_rows, input_rows, unit_holders
from megatron_spindle.plan.routing import backward_messages, forward_messages
from megatron_spindle.plan.schema import PlanError, Slice
from megatron_spindle.runtime.layout import batch_needs, check_runnable, dp_rank


def _slice(devices, tp):
    return Slice(id="s", metaop="m", module="x", task="t", kind="layer", layer_start=0, layer_end=1,
                 devices=list(devices), tp=tp, dp=len(devices) // tp, predicted_time=0.0)


LAYOUTS = [([0], 1), ([1], 1), ([0, 1], 1), ([0, 1], 2), ([1, 0], 2), ([2, 3, 0, 1], 1), ([2, 3, 0, 1], 2),
           ([3, 1, 2, 0], 4), ([0, 1, 2, 3], 2)]


@pytest.mark.parametrize("gpus_per_node", [1, 2, 8])
@pytest.mark.parametrize("prod,cons", list(itertools.product(LAYOUTS, LAYOUTS)))
def test_routes_deliver_every_row_once_from_a_holder(prod, cons, gpus_per_node):
    B = 8
    p, c = _slice(*prod), _slice(*cons)
    for msgs, holders, needers in ((forward_messages(p, c, B, gpus_per_node), p, c),
                                   (backward_messages(p, c, B, gpus_per_node), c, p)):
        pairs = [(m.src, m.dst) for m in msgs]
        assert len(pairs) == len(set(pairs)), "one message per (src, dst) pair and direction"
        for d in needers.devices:
            j = dp_rank(needers, d)
            lo, hi = dp_rows(j, needers.dp, B)
            got = []
            for m in msgs:
                if m.dst != d:
                    continue
                k = dp_rank(holders, m.src)
                h0, _ = dp_rows(k, holders.dp, B)
                # the source holds these global rows, and they land where the receiver keeps them
                assert h0 + m.src_start == lo + m.dst_start
                got += range(lo + m.dst_start, lo + m.dst_start + m.n)
                if d in holders.devices and dp_rank(holders, d) == k:
                    assert m.src == d, "rows a device already holds are copied locally"
            assert sorted(got) == list(range(lo, hi))


def test_param_groups_follow_shared_weights():
    w = load_workload("tiny-clip")
    plan = random_plan(w, 4, 1)
    groups = unit_holders([wv.slices for wv in plan.waves], build_metagraph(w).metaops)
    for unit, devs in groups.items():
        users = {d for s in plan.slices() for d in s.devices if unit in plan.metaop(s.metaop).params[
            s.layer_start:s.layer_end] or (s.kind != "layer" and unit in plan.metaop(s.metaop).params)}
        assert set(devs) == users, unit
    assert len(groups["vision.layers.0"]) > 1


def test_checks_name_the_problem():
    w = load_workload("tiny-vlm")
    g = build_metagraph(w)
    plan = sequential_plan(w, 2)
    check_runnable(plan, w, g, 2)
    with pytest.raises(PlanError, match="the plan is for 2 devices, the world size is 1"):
        check_runnable(plan, w, g, 1)
    dropped = sequential_plan(w, 2)
    dropped.transfers.pop(0)
    with pytest.raises(PlanError, match="lacks the transfers"):
        check_runnable(dropped, w, g, 2)
    moved = sequential_plan(w, 2)
    moved.param_groups[0].devices = [0]
    with pytest.raises(PlanError, match="param_groups"):
        check_runnable(moved, w, g, 2)
    other = sequential_plan(load_workload("tiny-clip"), 2)
    with pytest.raises(PlanError, match="was made for workload"):
        check_runnable(other, w, g, 2)
    te = sequential_plan(w, 2)
    te.settings = dataclasses.replace(te.settings, attention_backend="flash")  # planned for a GPU with TE
    with pytest.raises(PlanError, match="'flash' is Transformer Engine's, which is not available on this machine"):
        check_runnable(te, w, g, 2)


def test_build_plan_rejects_overlapping_devices_in_a_wave():
    w = load_workload("tiny-vlm")
    g = build_metagraph(w)
    lv0 = g.levels[0]
    with pytest.raises(PlanError, match="used by both"):
        build_plan(w, 2, [[(lv0[0], 0, 1, [0], 1), (lv0[1], 0, 1, [0, 1], 1)]])


def test_cli_refuses_a_wrong_plan_with_a_clear_message(tmp_path):
    import os
    import subprocess
    import sys

    w = load_workload("tiny-vlm")
    plan = sequential_plan(w, 2)  # two devices, but the command runs as one process
    path = tmp_path / "plan.json"
    plan.save(path)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([sys.executable, "-m", "megatron_spindle.runtime", "--plan", str(path), "--workload",
                        "tiny-vlm", "--steps", "1"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "the plan is for 2 devices, the world size is 1" in r.stderr


def test_a_device_reads_its_dp_rows_of_every_micro_batch():
    """plan/layout.py ``input_rows``, by hand: batch 16, 2 micro-batches of 8, (tp 2, dp 2) on 4 devices: positions
    0-1 are DP rank 0 (rows 0-3 of each micro-batch), 2-3 DP rank 1 (rows 4-7)."""
    assert input_rows(0, 2, 2, 16, 2) == input_rows(1, 2, 2, 16, 2) == [(0, 4), (8, 12)]
    assert input_rows(3, 2, 2, 16, 2) == [(4, 8), (12, 16)]
    assert input_rows(2, 1, 4, 16) == [(8, 12)]


def test_batch_needs_merge_a_ranks_slices():
    """runtime/layout.py ``batch_needs``: per task, each field's rows over the rank's slices that read it, merged;
    every row where a slice reads them all; nothing for slices that read nothing; the whole batch where an
    operator does not say what it reads."""
    def sl(task, devices, tp):
        return dataclasses.replace(_slice(devices, tp), task=task)

    reads = [(sl("a", [0, 1, 2, 3], 1), {"img": False}),  # DP 4: rows [0, 2) and [8, 10) of 16 in 2 micro-batches
             (sl("a", [2, 0], 1), {"img": False, "txt": False}),  # DP 2, position 1: [4, 8) and [12, 16)
             (sl("a", [0], 1), {"txt": True}),  # an LM head: every row of the text
             (sl("b", [1, 0], 2), {}),  # layers: nothing
             (sl("c", [0, 1], 1), None)]  # a stand-in operator: the whole batch
    needs = batch_needs(reads, 0, {"a": 16, "b": 8, "c": 8}, micro_batches=2)
    assert needs == {"a": {"img": [(0, 2), (4, 10), (12, 16)], "txt": None}, "b": {}, "c": None}
