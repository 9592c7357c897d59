"""benchmarks/host_ops.py: a training step's own operations beside its model's. The runtime dispatches nothing per
parameter tensor (every one costs a GPU's host 5-60 us in a host-bound wave): fewer operations that launch work
than the model has parameter tensors, in fp32 (units alias their masters) and in bf16 (units copy from and to
fp32 masters, where a clone per gradient and two views per weight were found), and in the sharded runtime of ZeRO 1
to 3 (where a cast per gradient into the staging rows and per weight before its load were found)."""

import pytest
import torch
from script_loader import load_script

from megatron_spindle.graph.workload import load_workload
from megatron_spindle.models.reference import ReferenceModel

bench = load_script("benchmarks/host_ops.py")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_runtime_dispatches_nothing_per_parameter_tensor(dtype):
    workload = load_workload("tiny-clip")
    tensors = len(dict.fromkeys(ReferenceModel(workload).full_named_parameters().values()))
    totals = bench.count_engine(workload, dtype, warmup=1).counter.totals()
    assert totals["model"] > 5 * tensors  # the forward and backward were counted, and attributed to the model
    assert totals["optimizer"] > 0
    assert 0 < totals["runtime"] < tensors, totals
    assert totals.get("runtime views", 0) < tensors, totals  # not even a view per tensor (the weights' unflatten)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_sharded_runtime_launches_nothing_per_parameter_tensor(stage):
    """ZeRO 1-3 in bf16: the gradients are flattened per unit into the staging rows (their views are torch's C++
    flattening's: views, but no launches) and the weights loaded without a cast each."""
    workload = load_workload("tiny-clip")
    tensors = len(dict.fromkeys(ReferenceModel(workload).full_named_parameters().values()))
    totals = bench.count_engine(workload, torch.bfloat16, warmup=1, zero_stage=stage).counter.totals()
    assert totals["model"] > 5 * tensors and totals["optimizer"] > 0
    assert 0 < totals["runtime"] < tensors, totals


def test_operations_are_attributed_to_the_innermost_caller_that_says():
    import traceback

    def frame(path, name):
        return traceback.FrameSummary(path, 1, name)

    runtime, models = "/x/megatron_spindle/runtime/", "/x/megatron_spindle/models/"
    stack = [frame(runtime + "engine.py", "train_step"), frame(runtime + "grad_sync.py", "slice_done"),
             frame(models + "operator.py", "export_grad_contributions")]
    assert bench.who(stack) == "runtime runtime/grad_sync.py:slice_done"
    forward = [frame(runtime + "schedule.py", "_forward_slice"), frame(models + "operator.py", "forward")]
    assert bench.who(forward) == "model"
    assert bench.who([*forward, frame("/y/megatron/core/transformer/mlp.py", "forward")]) == "model"
    assert bench.who([*stack, frame("/y/torch/optim/adamw.py", "step")]) == "optimizer"


def test_the_two_rank_layouts_are_what_their_rows_say():
    """``--two-ranks``' plans: the towers at TP 2 reduced by TP shard (their groups' degree 2) or in whole units
    (degree 1: their groups also hold TP-1 slices), and everything at TP 1 on both ranks."""
    from megatron_spindle.graph.opgraph import build_metagraph
    from megatron_spindle.plan.buckets import group_tp

    workload = load_workload("tiny-clip")
    metaops = build_metagraph(workload).metaops
    degrees = {}
    for layout, plan in bench.two_rank_layouts(workload).items():
        groups = [list(g.params) for g in plan.param_groups]
        degrees[layout] = set(group_tp([w.slices for w in plan.waves], metaops, groups, plan.settings))
        tps = {s.tp for s in plan.slices()}
        assert tps == ({1} if "TP 1" in layout else {1, 2}), layout
    shard, whole, tp1 = (bench.TWO_RANK_ROWS[i][0] for i in (0, 2, 4))
    assert 2 in degrees[shard] and degrees[whole] == {1} and degrees[tp1] == {1}, degrees
