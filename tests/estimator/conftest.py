"""Shared fixtures: the built-in tiny workloads and a paper-sized CLIP task for scaling behaviour."""

from __future__ import annotations

import pytest

from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import load_workload, workload_from_dict


def clip_like_spec(**vision_overrides) -> dict:
    """A ViT-L/14-sized vision tower and a small text tower in one contrastive task (batch 256)."""
    vision = {
        "kind": "encoder",
        "num_layers": 2,
        "hidden_size": 1024,
        "num_heads": 16,
        "ffn_hidden_size": 4096,
        "embed_dim": 512,
        "frontend": {"type": "patch", "image_size": 224, "patch_size": 14, "in_channels": 3},
    }
    vision.update(vision_overrides)
    return {
        "name": "clip-like",
        "modules": {
            "vision": vision,
            "text": {
                "kind": "encoder",
                "num_layers": 2,
                "hidden_size": 512,
                "num_heads": 8,
                "ffn_hidden_size": 2048,
                "embed_dim": 512,
                "frontend": {"type": "text", "vocab_size": 49408},
            },
        },
        "tasks": [
            {
                "name": "vt",
                "batch_size": 256,
                "tokens": {"vision": 257, "text": 77},
                "loss": {"kind": "contrastive", "modules": ["vision", "text"]},
            }
        ],
    }


@pytest.fixture
def tiny_clip():
    workload = load_workload("tiny-clip")
    return workload, build_metagraph(workload)


@pytest.fixture
def tiny_vlm():
    workload = load_workload("tiny-vlm")
    return workload, build_metagraph(workload)


@pytest.fixture
def clip_like():
    workload = workload_from_dict(clip_like_spec())
    return workload, build_metagraph(workload)


@pytest.fixture
def cluster8():
    return make_cluster(8)
