"""The paper's workloads (package data in megatron_spindle/graph/workloads/) load by name, validate, and keep the
hyper-parameters of issue 3."""

from __future__ import annotations

import pytest

from megatron_spindle.graph.builtin import builtin_workloads
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import load_workload

PAPER_WORKLOADS = ["clip-4", "clip-7", "clip-10", "clip-20", "ofasys-4", "ofasys-7", "qwen-val", "qwen-val-30b",
                   "qwen-val-70b"]


@pytest.mark.parametrize("name", PAPER_WORKLOADS)
def test_workload_loads_by_name_and_contracts(name):
    assert name in builtin_workloads()
    w = load_workload(name)
    assert w.name == name
    g = build_metagraph(w)
    assert set(m.task for m in g.metaops.values()) == {t.name for t in w.tasks}
    for t in w.tasks:  # batches divide evenly over the paper's data-parallel degrees (up to 64)
        assert t.batch_size % 64 == 0, f"{name}/{t.name}: batch {t.batch_size}"


def _params(name: str) -> float:
    from megatron_spindle.estimator import AnalyticCostModel
    from megatron_spindle.graph.cluster import make_cluster

    w = load_workload(name)
    cm = AnalyticCostModel(w, make_cluster(8))
    units = {p for m in build_metagraph(w).metaops.values() for p in m.param_names()}
    return sum(cm.param_count(u) for u in units)


@pytest.mark.parametrize("name,billions,tol", [("clip-10", 1.2, 0.15), ("ofasys-7", 0.66, 0.25),
                                               ("qwen-val", 9.25, 0.1), ("qwen-val-30b", 30, 0.1),
                                               ("qwen-val-70b", 70, 0.1)])
def test_parameter_counts_match_the_paper(name, billions, tol):
    assert _params(name) == pytest.approx(billions * 1e9, rel=tol)


def test_clip_towers_have_the_imagebind_shapes():
    w = load_workload("clip-10")
    shape = {k: (m.num_layers, m.hidden_size, m.num_heads, m.ffn_hidden_size) for k, m in w.modules.items()}
    assert shape == {"vision": (32, 1280, 16, 5120), "text": (24, 1024, 16, 4096), "audio": (12, 768, 12, 3072),
                     "depth": (12, 384, 8, 1536), "thermal": (12, 768, 12, 3072), "motion": (6, 512, 8, 2048)}
    tokens = {}
    for t in w.tasks:
        tokens.update(t.tokens)
    assert tokens == {"vision": 257, "text": 77, "audio": 229, "depth": 197, "thermal": 197, "motion": 251}


@pytest.mark.parametrize("small,big", [("clip-4", "clip-10"), ("clip-7", "clip-10"), ("ofasys-4", "ofasys-7")])
def test_task_sets_are_subsets_of_the_full_workload(small, big):
    s, b = load_workload(small), load_workload(big)
    sub = b.subset([t.name for t in s.tasks])
    assert sub.to_dict()["tasks"] == s.to_dict()["tasks"]
    assert sub.to_dict()["modules"] == s.to_dict()["modules"]


def test_task_sets_follow_the_paper():
    assert [t.name for t in load_workload("clip-4").tasks] == ["text_audio", "vision_depth", "audio_thermal",
                                                               "motion_thermal"]
    assert [t.name for t in load_workload("clip-7").tasks][4:] == ["vision_text", "text_motion", "vision_audio"]
    assert [t.name for t in load_workload("clip-10").tasks][7:] == ["depth_text", "thermal_vision", "audio_motion"]
    assert {t.name for t in load_workload("ofasys-4").tasks} == {"caption", "asr", "summarization", "grounding"}
    assert len(load_workload("ofasys-7").tasks) == 7
    assert [t.name for t in load_workload("qwen-val").tasks] == ["vl", "al", "val"]
    assert len(load_workload("clip-20").tasks) == 20


def test_ofasys_decoder_cross_attends_to_the_encoder():
    w = load_workload("ofasys-7")
    dec = w.modules["lm_decoder"]
    assert dec.kind == "llm" and dec.cross_attention
    assert (dec.num_layers, dec.hidden_size, dec.num_heads, dec.ffn_hidden_size) == (12, 1024, 16, 4096)
    for t in w.tasks:
        assert ("lm_encoder", "lm_decoder") in t.flows
        assert t.loss.modules == ("lm_decoder",)


def test_qwen_variants_scale_only_the_llm():
    base = load_workload("qwen-val")
    assert base.modules["audio"].num_layers == 32 and base.modules["vision"].num_layers == 40
    for name in ("qwen-val-30b", "qwen-val-70b"):
        w = load_workload(name)
        for mod in ("vision", "audio"):
            assert w.modules[mod] == base.modules[mod]
        assert w.modules["llm"].num_layers > base.modules["llm"].num_layers
        assert [t.tokens for t in w.tasks] == [t.tokens for t in base.tasks]
