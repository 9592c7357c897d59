"""Graph contraction into MetaOps and longest-path MetaLevels (paper section 3.1)."""

from megatron_spindle.graph.opgraph import Operator, OperatorGraph, build_metagraph, contract
from megatron_spindle.graph.workload import load_workload


def _chain(g, names, typ, shape, params, task):
    for n, p in zip(names, params):
        g.add(Operator(n, typ, shape, (p,), task=task))
    for a, b in zip(names, names[1:]):
        g.connect(a, b)


def paper_fig3_graph() -> OperatorGraph:
    """Fig. 3: audio-language task (batch 8) and vision-language task (batch 4), operators A..Q, weights W1..W10."""
    g = OperatorGraph()
    _chain(g, "ABC", "audio", (8, 229, 768), ["W1", "W2", "W3"], "AL")
    _chain(g, "DE", "text", (8, 77, 768), ["W4", "W5"], "AL")
    _chain(g, "FGH", "lm", (8, 512, 1024), ["W6", "W7", "W8"], "AL")
    _chain(g, "IJ", "text", (4, 77, 768), ["W4", "W5"], "VL")
    _chain(g, "KL", "vision", (4, 257, 768), ["W9", "W10"], "VL")
    _chain(g, "MN", "vision", (4, 197, 768), ["W9", "W10"], "VL")
    _chain(g, "OPQ", "lm", (4, 512, 1024), ["W6", "W7", "W8"], "VL")
    for src, dst in [("C", "F"), ("E", "F"), ("J", "O"), ("L", "O"), ("N", "O")]:
        g.connect(src, dst)
    return g


def test_paper_fig3_contracts_into_seven_metaops_and_two_levels():
    mg = contract(paper_fig3_graph())
    chains = sorted("".join(m.ops) for m in mg.metaops.values())
    assert chains == ["ABC", "DE", "FGH", "IJ", "KL", "MN", "OPQ"]
    by_chain = {"".join(m.ops): m for m in mg.metaops.values()}
    levels = [sorted("".join(mg.metaops[m].ops) for m in lv) for lv in mg.levels]
    assert levels == [["ABC", "DE", "IJ", "KL", "MN"], ["FGH", "OPQ"]]
    # Same weights with different input sizes are different MetaOps that share parameters.
    assert mg.shares_params(by_chain["DE"].id, by_chain["IJ"].id)
    assert mg.shares_params(by_chain["KL"].id, by_chain["MN"].id)
    assert mg.shares_params(by_chain["FGH"].id, by_chain["OPQ"].id)
    assert not mg.shares_params(by_chain["ABC"].id, by_chain["DE"].id)
    groups = sorted(sorted("".join(mg.metaops[m].ops) for m in grp) for grp in mg.sharing_groups())
    assert groups == [["ABC"], ["DE", "IJ"], ["FGH", "OPQ"], ["KL", "MN"]]
    assert {(mg.metaops[s].ops[-1], mg.metaops[d].ops[0]) for s, d in mg.edges} == {
        ("C", "F"), ("E", "F"), ("J", "O"), ("L", "O"), ("N", "O")}


def test_longest_path_levels_keep_levels_dependency_free():
    # A -> B -> C and A -> C: BFS depth would put B and C together although B feeds C.
    g = OperatorGraph()
    for n, t in [("A", "x"), ("B", "y"), ("C", "z")]:
        g.add(Operator(n, t, (1, 1, 1)))
    for s, d in [("A", "B"), ("B", "C"), ("A", "C")]:
        g.connect(s, d)
    mg = contract(g)
    assert [sorted(mg.metaops[m].ops[0] for m in lv) for lv in mg.levels] == [["A"], ["B"], ["C"]]


def test_chains_break_at_type_and_shape_changes_and_at_fan_in():
    g = OperatorGraph()
    g.add(Operator("a0", "enc", (2, 4, 8)))
    g.add(Operator("a1", "enc", (2, 4, 8)))
    g.add(Operator("a2", "enc", (2, 6, 8)))  # different input shape
    g.add(Operator("b0", "enc", (2, 4, 8)))
    g.add(Operator("j", "enc", (2, 4, 8)))  # fan-in of 2
    for s, d in [("a0", "a1"), ("a1", "a2"), ("a2", "j"), ("b0", "j")]:
        g.connect(s, d)
    mg = contract(g)
    assert sorted(m.ops for m in mg.metaops.values()) == [["a0", "a1"], ["a2"], ["b0"], ["j"]]


def test_workload_graph_shares_tower_weights_across_tasks():
    mg = build_metagraph(load_workload("tiny-clip"))
    vision = [m for m in mg.metaops.values() if m.module == "vision" and m.kind == "layer"]
    assert len(vision) == 2 and mg.shares_params(vision[0].id, vision[1].id)
    assert all(m.num_layers == 4 for m in vision)
    assert vision[0].params[3] == ("vision.layers.3",)
    for k, level in enumerate(mg.levels):  # levels are dependency free
        for m in level:
            assert all(mg.metaops[p].level < k for p in mg.predecessors(m))


def test_generative_workload_joins_projected_tokens_into_the_llm():
    w = load_workload("tiny-vlm")
    mg = build_metagraph(w)
    llm = mg.metaops["caption/llm"]
    assert llm.num_layers == 3 and llm.input_shape == (4, 25, 64)
    assert sorted(mg.predecessors("caption/llm")) == ["caption/llm.frontend", "caption/vis_proj"]
    # The audio projector pools 16 frames to 8 tokens, so the asr task's own text part is 8 tokens.
    assert mg.metaops["asr/llm.frontend"].input_shape == (4, 8, 64)
    assert mg.metaops["asr/llm"].level > mg.metaops["asr/aud_proj"].level > mg.metaops["asr/audio"].level
