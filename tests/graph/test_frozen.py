"""Frozen modules in the workload (``frozen: true``, ``--freeze``): what each MetaOp's backward computes."""

from __future__ import annotations

import pytest

from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.task_sets import task_set_workload
from megatron_spindle.graph.workload import WorkloadError, load_workload, workload_from_dict


def backwards(workload) -> dict[str, tuple[str, bool]]:
    return {mid: (m.backward, m.frozen) for mid, m in build_metagraph(workload).metaops.items()}


def test_llava_first_stage_backwards():
    """Vision tower and LLM frozen, projectors trained: nothing before the vision tower trains, so it runs no
    backward; the LLM sits between trained projectors and the loss, so it computes input gradients only; its
    own text embedding has nothing to pass a gradient to."""
    got = backwards(load_workload("tiny-vlm").frozen(["vision", "llm"]))
    assert got["caption/vision.frontend"] == ("none", True)
    assert got["caption/vision"] == ("none", True)
    assert got["caption/vis_proj"] == ("full", False)
    assert got["caption/llm.frontend"] == ("none", True)
    assert got["caption/llm"] == ("input", True)
    assert got["caption/llm.lm_head"] == ("input", True)
    assert got["asr/audio"] == ("full", False)  # the other task's tower trains
    assert got["asr/llm"] == ("input", True)


def test_unfrozen_workload_is_all_full_and_keeps_its_digest():
    w = load_workload("tiny-vlm")
    assert {b for b, _ in backwards(w).values()} == {"full"}
    assert "frozen" not in w.to_dict()["modules"]["llm"]  # left out at its default: plans keep their keys
    frozen = w.frozen(["llm"])
    assert frozen.digest() != w.digest() and frozen.to_dict()["modules"]["llm"]["frozen"] is True
    assert workload_from_dict(frozen.to_dict()).digest() == frozen.digest()
    assert not w.modules["llm"].frozen  # frozen() returns a copy
    assert frozen.model_digest() == w.model_digest() == w.digest()  # checkpoints: the same model


def test_locked_tower_of_a_contrastive_task_has_no_backward():
    got = backwards(load_workload("tiny-clip").frozen(["text"]))
    assert got["text_audio/text"] == ("none", True)
    assert got["text_audio/audio"] == ("full", False)
    assert got["text_audio/loss"][0] == "full"


def test_bad_freezes_are_named():
    w = load_workload("tiny-clip")
    with pytest.raises(WorkloadError, match="--freeze: workload 'tiny-clip' has no module 'llm'"):
        w.frozen(["llm"])
    locked = w.frozen(["text", "audio"])  # a workload may hold a task that trains nothing...
    with pytest.raises(WorkloadError, match=r"task 'text_audio' trains nothing: every module it runs is frozen "
                                            r"\(text, audio\); leave it out \(--tasks\) or freeze less"):
        task_set_workload(locked, [t.name for t in w.tasks])  # ...but not the task set a run trains
    assert [t.name for t in task_set_workload(locked, ["vision_depth", "audio_depth"]).tasks] == [
        "vision_depth", "audio_depth"]
    d = w.to_dict()
    d["modules"]["text"]["frozen"] = "yes"
    with pytest.raises(WorkloadError, match="module 'text': frozen must be true or false"):
        workload_from_dict(d)
