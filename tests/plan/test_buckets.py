"""plan/buckets.py's rule for the weights' all-gather after the optimizer step (``regathered_groups``), which the
simulator, the planner's estimate and the runtime (runtime/weight_shards.py) all follow."""

from __future__ import annotations

from types import SimpleNamespace

from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.plan.buckets import overlaps_param_gather, regathered_groups
from megatron_spindle.plan.layout import slice_units
from megatron_spindle.plan.schema import ExecutionSettings


def _layer_slice(metaops, metaop_id, devices, tp=1):
    m = metaops[metaop_id]
    return SimpleNamespace(metaop=metaop_id, layer_start=0, layer_end=m.num_layers, tp=tp, dp=len(devices) // tp,
                           devices=devices)


def test_regathered_groups_by_stage_and_layout():
    g = build_metagraph(load_workload("tiny-vlm"))
    vision = next(m for m in g.metaops.values() if m.kind == "layer" and m.module == "vision")
    audio = next(m for m in g.metaops.values() if m.kind == "layer" and m.module == "audio")
    units = lambda m: slice_units(m, 0, m.num_layers)  # noqa: E731
    groups = [((0, 1), units(vision)), ((2, 3), units(audio))]

    def rule(vision_slices, audio_slices, stage=3):
        waves = [[_layer_slice(g.metaops, vision.id, d, tp) for d, tp in vision_slices],
                 [_layer_slice(g.metaops, audio.id, d, tp) for d, tp in audio_slices]]
        return regathered_groups(waves, g.metaops, groups, stage)

    aligned = ([([0, 1], 1)], [([2, 3], 1)])
    assert rule(*aligned, stage=0) == [False, False]  # replicated masters: every holder steps the whole unit
    assert rule(*aligned, stage=1) == rule(*aligned, stage=2) == [True, True]
    assert rule(*aligned) == [False, False]  # ZeRO-3: each weight shard is the master shard
    assert rule([([0, 1], 2)], [([2, 3], 1)]) == [True, False]  # a TP shard is not a master shard
    assert rule([([1, 0], 1)], [([2, 3], 1)]) == [True, False]  # DP ranks in another order than the members
    # the vision tower also run on device 0 alone (its group would then be (0, 1) still): shared elsewhere
    assert rule([([0, 1], 1), ([0], 1)], [([2, 3], 1)]) == [True, False]


def test_overlapped_param_gather_only_at_zero_1_and_2():
    for stage, expected in ((0, False), (1, True), (2, True), (3, False)):
        assert overlaps_param_gather(ExecutionSettings(zero_stage=stage, overlap_param_gather=True)) is expected
    assert not overlaps_param_gather(ExecutionSettings(zero_stage=1, overlap_param_gather=False))
