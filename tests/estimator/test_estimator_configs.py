import pytest

from megatron_spindle.estimator import LIGHT_KINDS, EstimatorError, valid_configs, valid_ns
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.opgraph import MetaOp


@pytest.mark.parametrize("name", ["tiny_clip", "tiny_vlm"])
def test_every_config_obeys_the_rules(name, request):
    workload, graph = request.getfixturevalue(name)
    cluster = make_cluster(16)
    for metaop in graph.metaops.values():
        configs = valid_configs(metaop, workload, cluster)
        assert configs, metaop.id
        assert configs == sorted(configs, key=lambda c: (c[0] * c[1], c[0]))
        for tp, dp in configs:
            assert metaop.batch % dp == 0
            assert tp * dp <= cluster.num_devices
            assert cluster.gpus_per_node % tp == 0
            if tp > 1:
                module = workload.modules[metaop.module]
                assert module.num_heads % tp == 0 and module.query_groups % tp == 0


def test_every_dp_dividing_the_batch_is_offered(tiny_clip, cluster8):
    workload, graph = tiny_clip
    metaop = graph.metaops["text_audio/text"]  # batch 8, 2 heads
    assert sorted({dp for _, dp in valid_configs(metaop, workload, cluster8)}) == [1, 2, 4, 8]
    assert valid_configs(metaop, workload, cluster8) == [
        (1, 1),
        (1, 2),
        (2, 1),
        (1, 4),
        (2, 2),
        (1, 8),
        (2, 4),
    ]


def test_light_ops_use_tp_1_only(tiny_clip, tiny_vlm, cluster8):
    seen = set()
    for workload, graph in (tiny_clip, tiny_vlm):
        for metaop in graph.metaops.values():
            tps = {tp for tp, _ in valid_configs(metaop, workload, cluster8)}
            if metaop.kind in LIGHT_KINDS:
                seen.add(metaop.kind)
                assert tps == {1}, metaop.id
    assert seen == set(LIGHT_KINDS)


def test_layers_get_tensor_parallelism_up_to_the_head_count(tiny_clip, cluster8):
    workload, graph = tiny_clip
    vision = graph.metaops["vision_depth/vision"]  # 4 heads, batch 4
    assert {tp for tp, _ in valid_configs(vision, workload, cluster8)} == {1, 2, 4}


def test_gqa_query_groups_limit_tp(tiny_vlm, cluster8):
    workload, graph = tiny_vlm
    llm = graph.metaops["caption/llm"]  # 4 heads but 2 query groups
    assert {tp for tp, _ in valid_configs(llm, workload, cluster8)} == {1, 2}


def test_tp_stays_inside_a_node(tiny_clip):
    workload, graph = tiny_clip
    vision = graph.metaops["vision_depth/vision"]
    two_per_node = make_cluster(16, gpus_per_node=2)
    assert {tp for tp, _ in valid_configs(vision, workload, two_per_node)} == {1, 2}


def test_device_count_caps_n(tiny_clip):
    workload, graph = tiny_clip
    text = graph.metaops["text_audio/text"]
    assert valid_ns(text, workload, make_cluster(4)) == [1, 2, 4]
    assert valid_ns(text, workload, make_cluster(16)) == [1, 2, 4, 8, 16]


def test_valid_ns_are_the_products_of_valid_configs(tiny_vlm, cluster8):
    workload, graph = tiny_vlm
    for metaop in graph.metaops.values():
        expected = sorted({tp * dp for tp, dp in valid_configs(metaop, workload, cluster8)})
        assert valid_ns(metaop, workload, cluster8) == expected


def test_unknown_module_is_a_clear_error(tiny_clip, cluster8):
    workload, _ = tiny_clip
    bogus = MetaOp(
        "t/ghost",
        "ghost.layer",
        (4, 8, 32),
        ["t/ghost.layer0"],
        [("ghost.layers.0",)],
        "t",
        "ghost",
        "layer",
        0,
    )
    with pytest.raises(EstimatorError, match="module 'ghost'"):
        valid_configs(bogus, workload, cluster8)
