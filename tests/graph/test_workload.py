"""Workload spec: YAML and Python API agree, and every validation error names the problem."""

import copy

import pytest
import yaml

from megatron_spindle.graph.workload import (
    LossSpec,
    ModuleSpec,
    SpindleTask,
    Workload,
    WorkloadError,
    load_workload,
    workload_from_dict,
)

BASE = {
    "name": "vl",
    "modules": {
        "vision": {"kind": "encoder", "num_layers": 2, "hidden_size": 32, "num_heads": 4, "ffn_hidden_size": 64,
                   "frontend": {"type": "patch", "image_size": 8, "patch_size": 4, "in_channels": 3}},
        "proj": {"kind": "projector", "input_size": 32, "hidden_size": 48},
        "llm": {"kind": "llm", "num_layers": 2, "hidden_size": 48, "num_heads": 4, "ffn_hidden_size": 96,
                "frontend": {"type": "text", "vocab_size": 100}},
    },
    "tasks": [{"name": "cap", "batch_size": 4, "tokens": {"vision": 5, "proj": 5, "llm": 9},
               "flows": [["vision", "proj"], ["proj", "llm"]], "loss": {"kind": "lm", "module": "llm"}}],
}


def spec(**edits):
    d = copy.deepcopy(BASE)
    for path, value in edits.items():
        node = d
        keys = path.split(".")
        for k in keys[:-1]:
            node = node[int(k)] if k.isdigit() else node[k]
        last = keys[-1]
        if value is None:
            del node[last]
        else:
            node[int(last) if last.isdigit() else last] = value
    return d


def test_yaml_and_python_api_build_the_same_workload(tmp_path):
    p = tmp_path / "w.yaml"
    p.write_text(yaml.safe_dump(BASE))
    from_yaml = load_workload(p)
    mods = {n: m for n, m in workload_from_dict(BASE).modules.items()}
    task = SpindleTask("cap", batch_size=4, loss=LossSpec("lm", ("llm",)))
    task.add_flow("vision", "proj", src_tokens=5, dst_tokens=5).add_flow("proj", "llm", dst_tokens=9)
    from_api = Workload("vl", mods, [task])
    assert from_api.digest() == from_yaml.digest()


def test_builtin_workloads_load_by_name():
    assert load_workload("tiny-clip").name == "tiny-clip"
    assert len(load_workload("tiny-vlm").tasks) == 2


def test_builtin_workloads_are_package_data():
    """Every built-in (the paper's too) lives in the package's workloads/ folder, which pyproject.toml ships as
    package data: they exist after a non-editable install."""
    import tomllib
    from pathlib import Path

    import megatron_spindle.graph
    from megatron_spindle.graph.builtin import builtin_workloads

    folder = Path(megatron_spindle.graph.__file__).parent / "workloads"
    found = builtin_workloads()
    assert {"tiny-clip", "clip-10", "ofasys-7", "qwen-val-70b"} <= set(found)
    assert all(p.parent == folder for p in found.values())
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert "workloads/*.yaml" in pyproject["tool"]["setuptools"]["package-data"]["megatron_spindle.graph"]


@pytest.mark.parametrize("edits, message", [
    ({"tasks.0.flows": [["vision", "proj"], ["proj", "llm"], ["llm", "vision"]]}, "cycle"),
    ({"tasks.0.tokens": {"vision": 5, "proj": 5, "llm": 9, "sonar": 3}}, "unknown module 'sonar'"),
    ({"tasks.0.flows": [["vision", "proj"], ["proj", "decoder"]]}, "unknown module 'decoder'"),
    ({"tasks.0.flows": [["vision", "llm"]], "tasks.0.tokens": {"vision": 5, "llm": 9}},
     "hidden size 32 of 'vision' does not match input size 48 of 'llm' and there is no projector"),
    ({"modules.vision.hidden_size": 0}, "module 'vision': hidden_size must be a positive integer, got 0"),
    ({"modules.llm.num_layers": -2}, "module 'llm': num_layers must be a positive integer, got -2"),
    ({"tasks.0.batch_size": -4}, "task 'cap': batch_size must be a positive integer, got -4"),
    ({"tasks.0.batch_size": 2.5}, "task 'cap': batch_size must be a positive integer, got 2.5"),
    ({"tasks.0.tokens": {"vision": 0, "proj": 5, "llm": 9}}, "tokens of 'vision' must be a positive integer"),
    ({"modules.vision.kind": "transformer"}, "unknown kind 'transformer'"),
    ({"modules.vision.num_heads": 5}, "hidden_size 32 is not divisible by num_heads 5"),
    ({"tasks.0.tokens": {"vision": 5, "proj": 5, "llm": 3}}, "gets 5 tokens from ['proj']"),
    ({"tasks.0.loss": {"kind": "contrastive", "modules": ["vision", "llm"]}}, "need equal embed_dim"),
    ({"tasks.0.loss": {"kind": "mse", "module": "llm"}}, "unknown loss kind 'mse'"),
    ({"modules.vision.frontend": {"type": "lidar", "patch_size": 4, "in_channels": 3}}, "unknown frontend type"),
    ({"modules.vision.depth": 3}, "module 'vision': unknown field(s) ['depth']"),
    ({"modules.vision.frontend.patch_size": 3}, "frontend image_size 8 is not a multiple of patch_size 3"),
    ({"tasks.0.tokens": {"vision": 9, "proj": 9, "llm": 13}},
     "module 'vision' is declared with 9 tokens, which no image makes: its patch front end makes g*g + 1 ("
     "class token) for a g x g grid of patches, g at most 2 (image_size 8 / patch_size 4: 5 tokens)"),
    ({"tasks.0.tokens": {"vision": 10, "proj": 10, "llm": 14}}, "declared with 10 tokens, which no image makes"),
    ({"modules.vision.frontend.class_token_len": 0}, "frontend class_token_len must be a positive integer, got 0"),
    ({"modules.vision.frontend.class_token_len": 2, "modules.vision.frontend.class_token": False},
     "class_token_len is for patch front ends with a class token"),
    ({"modules.vision.frontend.class_token_len": 2},
     "declared with 5 tokens, which no image makes: its patch front end makes g*g + 2 (class tokens)"),
])
def test_validation_errors_name_the_problem(edits, message):
    with pytest.raises(WorkloadError) as e:
        workload_from_dict(spec(**edits))
    assert message in str(e.value)


def test_unknown_builtin_name_is_reported():
    with pytest.raises(WorkloadError, match="no such file and no built-in workload"):
        load_workload("no-such-workload")


def test_unshared_module_gets_per_task_weights():
    w = workload_from_dict(spec(**{"modules.vision.shared": False}))
    assert w.param_owner("vision", "cap") == "vision@cap"
    assert w.param_owner("llm", "cap") == "llm"
    assert isinstance(w.modules["vision"], ModuleSpec)


@pytest.mark.parametrize("edits, message", [
    ({"modules.vision.activation": "relu"}, "module 'vision': unknown activation 'relu'"),
    ({"modules.llm.activation": "swiglu"}, "unknown activation 'swiglu' (expected one of gelu, quick_gelu, silu; "
                                           "an llm module's MLP is gated, so silu there is SwiGLU"),
    ({"modules.proj.activation": "silu"}, "module 'proj': activation applies to encoder/llm layers, not a projector"),
    ({"modules.vision.qkv_bias": True}, "module 'vision': qkv_bias is for llm modules"),
    ({"modules.llm.qkv_bias": "yes"}, "module 'llm': qkv_bias must be true or false, got 'yes'"),
    ({"modules.llm.norm_epsilon": 0}, "module 'llm': norm_epsilon must be a positive number, got 0"),
    ({"modules.llm.rotary_base": "1e6"}, "module 'llm': rotary_base must be a positive number, got '1e6'"),
    ({"modules.vision.rotary_base": 10000}, "module 'vision': rotary_base applies to llm modules (RoPE)"),
    ({"modules.llm.rope_scaling_factor": -8}, "module 'llm': rope_scaling_factor must be a positive number"),
    ({"modules.proj.norm_epsilon": 1e-6}, "module 'proj': norm_epsilon: a projector has no norms"),
    ({"modules.vision.head_pool": "max"}, "module 'vision': unknown head_pool 'max'"),
    ({"modules.proj.head_pool": "mean"}, "module 'proj': head_pool is for modules with a contrastive head"),
    ({"modules.vision.head_pool": "eos"}, "module 'vision': head_pool 'eos' needs a text front end"),
    ({"modules.llm.eos_token_id": 1}, "module 'llm': eos_token_id is only used with head_pool: eos"),
    ({"modules.llm.head_pool": "eos", "modules.llm.eos_token_id": 100},
     "module 'llm': eos_token_id must be a token id in [0, 100), got 100"),
    ({"modules.vision.frontend.pre_norm": "yes"}, "module 'vision': frontend pre_norm must be true or false"),
    ({"modules.llm.frontend.pre_norm": True}, "module 'llm': frontend pre_norm is for patch front ends, not 'text'"),
    ({"modules.vision.frontend.stem": "conv"}, "module 'vision': frontend stem 'conv' is for audio front ends"),
    ({"modules.vision.frontend.stem": "mlp"}, "module 'vision': unknown frontend stem 'mlp'"),
])
def test_module_option_errors_name_the_problem(edits, message):
    with pytest.raises(WorkloadError) as e:
        workload_from_dict(spec(**edits))
    assert message in str(e.value)


def test_module_options_default_to_the_original_model():
    w = workload_from_dict(BASE)
    vision, llm = w.modules["vision"], w.modules["llm"]
    assert (vision.act, llm.act) == ("gelu", "silu")
    assert vision.pooling == "cls" and llm.pooling == "mean"
    assert not llm.qkv_bias and llm.norm_epsilon is None and llm.rotary_base is None
    assert not vision.frontend.pre_norm and vision.frontend.stem == "linear"
    assert "qkv_bias" not in w.to_dict()["modules"]["llm"]
    w2 = workload_from_dict(spec(**{"modules.llm.qkv_bias": True, "modules.llm.rotary_base": 1e6,
                                    "modules.vision.frontend.pre_norm": True}))
    assert w2.digest() != w.digest()
    assert workload_from_dict(w2.to_dict()).modules["llm"].rotary_base == 1e6


def test_a_task_may_feed_a_patch_module_smaller_images():
    """g x g patches (+ the class token) for any g up to the full grid: the data makes g * patch_size images."""
    from megatron_spindle.data.datasets import task_fields
    from megatron_spindle.data.mock import mock_batch

    w = workload_from_dict(spec(**{"modules.vision.frontend.image_size": 12,
                                   "tasks.0.tokens": {"vision": 5, "proj": 5, "llm": 9}}))
    fe = w.modules["vision"].frontend
    assert (fe.patch_grid, fe.patch_tokens) == (3, 10)
    assert [fe.image_side(n) for n in (2, 5, 10, 4, 11)] == [4, 8, 12, None, None]
    assert task_fields(w, "cap")["vision"].shape == (3, 8, 8)
    assert mock_batch(w, "cap", 0).inputs["vision"].shape == (4, 3, 8, 8)
    no_cls = workload_from_dict(spec(**{"modules.vision.frontend.class_token": False,
                                        "tasks.0.tokens": {"vision": 4, "proj": 4, "llm": 9}}))
    assert no_cls.modules["vision"].frontend.image_side(4) == 8
    eight = workload_from_dict(spec(**{"modules.vision.frontend.class_token_len": 8,
                                       "tasks.0.tokens": {"vision": 12, "proj": 12, "llm": 16}}))
    assert eight.modules["vision"].frontend.patch_tokens == 12 and "class_token_len" in eight.to_dict()["modules"][
        "vision"]["frontend"]
    assert "class_token_len" not in workload_from_dict(spec()).to_dict()["modules"]["vision"]["frontend"]


def test_exponent_floats_are_numbers_in_workload_and_cluster_files(tmp_path):
    """YAML 1.2 floats PyYAML (YAML 1.1) reads as strings: ``1e-6``, ``25e9``, ``25.0e9``. Both files take them as
    numbers (both were refused as 'not a number')."""
    from megatron_spindle.graph.cluster import load_cluster

    w = copy.deepcopy(BASE)
    w["modules"]["llm"]["norm_epsilon"] = 1e-6
    text = yaml.safe_dump(w).replace("1.0e-06", "1e-6")
    assert "norm_epsilon: 1e-6" in text
    (tmp_path / "w.yaml").write_text(text)
    assert load_workload(str(tmp_path / "w.yaml")).modules["llm"].norm_epsilon == 1e-6
    (tmp_path / "c.yaml").write_text("num_nodes: 2\ngpus_per_node: 4\ngpu: H100\ninter_node_bw: 25.0e9\n"
                                     "intra_node_bw: 4e11\n")
    cluster = load_cluster(tmp_path / "c.yaml")
    assert (cluster.inter_node_bw, cluster.intra_node_bw) == (25e9, 4e11)
    assert yaml.safe_load("x: 25e9")["x"] == "25e9"  # PyYAML's own loader is left as it is
