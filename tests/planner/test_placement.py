"""Device placement: islands, disjointness, the sequential baseline, big flows, weight co-location, memory."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_spindle.estimator import AnalyticCostModel, MemoryModel
from megatron_spindle.estimator.cost_model import CostModelConfig
from megatron_spindle.graph.cluster import ClusterSpec, GiB, GPUSpec, make_cluster
from megatron_spindle.graph.opgraph import MetaGraph, MetaOp
from megatron_spindle.graph.workload import Workload, workload_from_dict
from megatron_spindle.plan.memory import slice_memory
from megatron_spindle.planner.assemble import assemble_plan
from megatron_spindle.planner.placement import PlacementError, place, predicted_memory
from megatron_spindle.planner.schedule import ScheduledSlice, ScheduledWave

HIDDEN = 64


def op(mid: str, task: str, module: str, layers: tuple[int, ...] = (0,), batch: int = 8, tokens: int = 16,
       level: int = 0) -> MetaOp:
    """A MetaOp running ``layers`` of encoder ``module`` (MetaOps naming the same module share weights)."""
    return MetaOp(mid, f"{module}.layer", (batch, tokens, HIDDEN), [f"{mid}#{i}" for i in layers],
                  [(f"{module}.layers.{i}",) for i in layers], task, module, "layer", layers[0], level)


def hand_workload(ops: list[MetaOp]) -> Workload:
    """The workload the hand-made MetaOps come from: one encoder per module name, one task per task name."""
    depth: dict[str, int] = {}
    tasks: dict[str, set[str]] = {}
    for m in ops:
        depth[m.module] = max(depth.get(m.module, 0), m.layer_offset + m.num_layers)
        tasks.setdefault(m.task, set()).add(m.module)
    modules = {name: {"kind": "encoder", "num_layers": n, "hidden_size": HIDDEN, "num_heads": 4,
                      "ffn_hidden_size": 4 * HIDDEN} for name, n in depth.items()}
    return workload_from_dict({"name": "hand", "modules": modules, "tasks": [
        {"name": t, "batch_size": 8, "tokens": {mod: 4 for mod in sorted(mods)}} for t, mods in tasks.items()]})


def graph(ops: list[MetaOp], edges: list[tuple[str, str]] = ()) -> MetaGraph:
    levels: dict[int, list[str]] = {}
    for m in ops:
        levels.setdefault(m.level, []).append(m.id)
    return MetaGraph({m.id: m for m in ops}, list(edges), [levels[k] for k in sorted(levels)])


def sl(metaop: MetaOp, n: int, tp: int = 1, layers: tuple[int, int] | None = None) -> ScheduledSlice:
    a, b = layers or (0, metaop.num_layers)
    return ScheduledSlice(metaop.id, n, tp, n // tp, a, b, float(b - a))


def waves_of(*waves: list[ScheduledSlice]) -> list[ScheduledWave]:
    out, t = [], 0.0
    for slices in waves:
        d = max(s.time for s in slices)
        out.append(ScheduledWave(0, t, d, slices))
        t += d
    return out


def models(w: Workload, cluster: ClusterSpec) -> tuple[AnalyticCostModel, MemoryModel]:
    cost = AnalyticCostModel(w, cluster)
    return cost, MemoryModel(w, cluster, cost)


def placed(waves, g: MetaGraph, cluster: ClusterSpec, strategy: str = "spindle", **kw) -> list[ScheduledWave]:
    w = hand_workload(list(g.metaops.values()))
    return place(waves, g, w, cluster, *models(w, cluster), strategy=strategy, **kw)


def devices_of(waves, metaop: str, wave: int) -> list[int]:
    return next(s.devices for s in waves[wave].slices if s.metaop == metaop)


def slice_bytes(metaop: MetaOp, s: ScheduledSlice, memory_model: MemoryModel) -> float:
    units, act, _ = slice_memory(metaop, s, memory_model)
    return act + sum(units.values())


# --------------------------------------------------------------------------------- islands, disjointness


@st.composite
def packable_wave(draw):
    """A wave whose slices can all sit in one island each: every node's capacity cut into pieces."""
    nodes = draw(st.integers(1, 4))
    per_node = draw(st.sampled_from([2, 4, 8]))
    sizes = []
    for _ in range(nodes):
        left = per_node
        while left:
            piece = draw(st.sampled_from([s for s in (1, 2, 4, 8) if s <= left]))
            sizes.append(piece)
            left -= piece
            if draw(st.booleans()) and left:
                break  # leave some devices idle
    sizes = draw(st.permutations(sizes))
    tokens = draw(st.lists(st.integers(1, 256), min_size=len(sizes), max_size=len(sizes)))
    return nodes, per_node, sizes, tokens


@settings(max_examples=60, deadline=None)
@given(packable_wave())
def test_slices_stay_in_one_island_and_waves_are_disjoint(case):
    nodes, per_node, sizes, tokens = case
    cluster = make_cluster(nodes * per_node, per_node, "CPU")
    # a first wave of one-device producers makes the second wave's incoming flows start anywhere
    producers = [op(f"t{i}/enc", f"t{i}", f"m{i}", (0,), tokens=tk) for i, tk in enumerate(tokens)]
    consumers = [op(f"t{i}/top", f"t{i}", f"m{i}", (1,), tokens=tk, level=1) for i, tk in enumerate(tokens)]
    g = graph(producers + consumers, [(a.id, b.id) for a, b in zip(producers, consumers)])
    schedule = waves_of([sl(m, 1) for m in producers], [sl(m, n, tp=min(n, 2)) for m, n in zip(consumers, sizes)])
    for w in placed(schedule, g, cluster):
        used = [d for s in w.slices for d in s.devices]
        assert len(used) == len(set(used)), "a device runs two slices of one wave"
        assert all(0 <= d < cluster.num_devices for d in used)
        for s in w.slices:
            assert len(s.devices) == s.n
            assert cluster.same_island(s.devices), f"{s.metaop} on {s.devices} spans islands"


def test_big_flows_do_not_take_the_island_a_later_slice_needs():
    """X's rows are on node 0 and Y's on node 1; putting Y on node 1 would leave no node for Z (4 devices)."""
    cluster = make_cluster(8, 4, "CPU")
    xp, yp = op("x/enc", "x", "x", (0,), tokens=2048), op("y/enc", "y", "y", (0,), tokens=1024)
    xc, yc = op("x/top", "x", "x", (1,), tokens=2048, level=1), op("y/top", "y", "y", (1,), tokens=1024, level=1)
    z = op("z/enc", "z", "z", level=1)
    g = graph([xp, yp, xc, yc, z], [("x/enc", "x/top"), ("y/enc", "y/top")])
    out = placed(waves_of([sl(xp, 4), sl(yp, 4)], [sl(z, 4), sl(yc, 2), sl(xc, 2)]), g, cluster)
    assert {cluster.island(d) for d in devices_of(out, "x/enc", 0)} == {0}
    assert {cluster.island(d) for d in devices_of(out, "y/enc", 0)} == {1}
    for s in out[1].slices:
        assert cluster.same_island(s.devices), f"{s.metaop} on {s.devices} spans islands"
    # X's big flow still becomes local copies
    assert set(devices_of(out, "x/top", 1)) <= set(devices_of(out, "x/enc", 0))


def test_flow_stays_in_the_producer_island_when_its_devices_are_taken():
    """A feeds two consumers; the first takes A's devices, the second should stay on A's node although the
    other node is emptier."""
    cluster = make_cluster(8, 4, "CPU")
    a = op("a/enc", "a", "a", (0,), tokens=2048)
    filler = op("f/enc", "f", "f", tokens=4096)
    c1, c2 = op("a/top", "a", "a", (1,), tokens=2048, level=1), op("a/aux", "a", "aux", tokens=2048, level=1)
    g = graph([a, filler, c1, c2], [("a/enc", "a/top"), ("a/enc", "a/aux")])
    out = placed(waves_of([sl(a, 2), sl(filler, 2)], [sl(c1, 2, tp=2), sl(c2, 2)]), g, cluster)
    a_island = cluster.island(devices_of(out, "a/enc", 0)[0])
    assert set(devices_of(out, "a/top", 1)) == set(devices_of(out, "a/enc", 0))
    assert {cluster.island(d) for d in devices_of(out, "a/aux", 1)} == {a_island}


def test_a_slice_without_flows_leaves_the_island_a_later_slice_needs():
    """2 nodes x 2. Wave 0: F (big activations) on one node, Qp on the other. Wave 1: R (no producer, big TP
    traffic, placed first) would pick the emptier node, Qp's, and push Q (Qp's consumer) across nodes."""
    cluster = make_cluster(4, 2, "CPU")
    f = op("f/enc", "f", "f", (0, 1), tokens=1024)  # two layers: more gradient traffic, placed first
    qp, q = op("q/enc", "q", "q", (0,), tokens=256), op("q/top", "q", "q", (1,), tokens=256, level=1)
    r = op("r/enc", "r", "r", tokens=2048, level=1)
    g = graph([f, qp, q, r], [("q/enc", "q/top")])
    out = placed(waves_of([sl(f, 2), sl(qp, 2)], [sl(r, 2, tp=2), sl(q, 2)]), g, cluster)
    f_island, q_island = cluster.island(devices_of(out, "f/enc", 0)[0]), cluster.island(devices_of(out, "q/enc", 0)[0])
    assert f_island != q_island
    assert {cluster.island(d) for d in devices_of(out, "r/enc", 1)} == {f_island}
    assert devices_of(out, "q/top", 1) == devices_of(out, "q/enc", 0)


def test_a_slice_without_flows_leaves_the_devices_a_later_slice_copies_from():
    """1 node x 4. Wave 0: F (big activations) on three devices, Qp on the fourth, the emptiest. Wave 1: R
    (gradient traffic, placed first) would take the emptiest device and force Q to copy Qp's rows over."""
    cluster = make_cluster(4, 4, "CPU")
    f = op("f/enc", "f", "f", batch=6, tokens=1024)
    qp, q = op("q/enc", "q", "q", (0,), tokens=64), op("q/top", "q", "q", (1,), tokens=64, level=1)
    r = op("r/enc", "r", "r", tokens=8, level=1)
    g = graph([f, qp, q, r], [("q/enc", "q/top")])
    out = placed(waves_of([sl(f, 3), sl(qp, 1)], [sl(r, 2), sl(q, 1)]), g, cluster)
    assert devices_of(out, "q/top", 1) == devices_of(out, "q/enc", 0)
    assert set(devices_of(out, "r/enc", 1)) <= set(devices_of(out, "f/enc", 0))


def test_slice_larger_than_a_node_takes_whole_nodes():
    cluster = make_cluster(12, 4, "CPU")
    a, b = op("a/enc", "a", "a"), op("b/enc", "b", "b")
    out = placed(waves_of([sl(b, 4, tp=2), sl(a, 8, tp=2)]), graph([a, b]), cluster)
    big = devices_of(out, "a/enc", 0)
    islands = [cluster.island(d) for d in big]
    assert len(set(islands)) == 2 and all(islands.count(i) == 4 for i in set(islands))
    # each TP group (positions 2k, 2k+1) stays inside one node
    assert all(cluster.island(big[r]) == cluster.island(big[r + 1]) for r in range(0, 8, 2))


def test_unpackable_wave_still_places_every_slice():
    cluster = make_cluster(8, 4, "CPU")
    ms = [op(f"t{i}/enc", f"t{i}", f"m{i}", batch=6) for i in range(3)]
    out = placed(waves_of([sl(ms[0], 3), sl(ms[1], 3), sl(ms[2], 2)]), graph(ms), cluster)
    assert sorted(d for s in out[0].slices for d in s.devices) == list(range(8))


# ------------------------------------------------------------------------------------------- sequential


def test_sequential_takes_consecutive_ranges_in_wave_order():
    cluster = make_cluster(16, 8, "CPU")
    ms = [op(f"t{i}/enc", f"t{i}", f"m{i}", (0, 1)) for i in range(4)]
    first, second = (0, 1), (1, 2)
    schedule = waves_of([sl(ms[0], 2, layers=first), sl(ms[1], 8, tp=2, layers=first), sl(ms[2], 4, layers=first),
                         sl(ms[3], 1, layers=first)],
                        [sl(ms[3], 4, layers=second), sl(ms[0], 1, layers=second), sl(ms[1], 1, layers=second),
                         sl(ms[2], 1, layers=second)])
    out = placed(schedule, graph(ms), cluster, strategy="sequential")
    assert [s.devices for s in out[0].slices] == [[0, 1], list(range(2, 10)), [10, 11, 12, 13], [14]]
    assert [s.devices for s in out[1].slices] == [[0, 1, 2, 3], [4], [5], [6]]


# ----------------------------------------------------------------------------------- big flows, locality


def big_flow_case():
    """2 nodes x 4. Wave 0: A (big output) on 2 devices, B on 4, C on 2. Wave 1: D on 4, E on 2, then A's
    consumer A2 on 2. Sequential puts A on 0-1 and A2 on 6-7 (another node)."""
    a, a2 = op("a/enc", "a", "a", (0,), tokens=2048), op("a/top", "a", "a", (1,), tokens=2048, level=1)
    b, c = op("b/enc", "b", "b"), op("c/enc", "c", "c")
    d, e = op("d/enc", "d", "d", level=1), op("e/enc", "e", "e", level=1)
    g = graph([a, a2, b, c, d, e], [("a/enc", "a/top")])
    schedule = waves_of([sl(a, 2), sl(b, 4), sl(c, 2)], [sl(d, 4), sl(e, 2), sl(a2, 2)])
    schedule[1].level = 1
    return g, schedule, make_cluster(8, 4, "CPU")


def test_spindle_moves_fewer_inter_island_bytes_than_sequential():
    g, schedule, cluster = big_flow_case()
    w = hand_workload(list(g.metaops.values()))
    cost, memory = models(w, cluster)
    plans = {}
    for strategy in ("spindle", "sequential"):
        out = place(schedule, g, w, cluster, cost, memory, strategy=strategy)
        plans[strategy] = assemble_plan(w, cluster, g, out, cost, memory, {"placement": strategy})
    seq, spin = plans["sequential"].predicted, plans["spindle"].predicted
    assert seq["inter_island_bytes"] == pytest.approx(cost.activation_bytes(g.metaops["a/enc"]))
    assert spin["inter_island_bytes"] < seq["inter_island_bytes"]
    t = next(t for t in plans["spindle"].transfers if t.producer == "w0:a/enc")
    assert t.kind == "local" and t.src_devices == t.dst_devices


def test_the_bigger_flow_gets_the_local_device_first():
    """A (big output) and B (small output, sharing A's weights, so on A's device) both feed a one-device
    consumer in the last wave; only one consumer can sit on that device and the big flow should win."""
    cluster = make_cluster(4, 4, "CPU")
    a, b = op("a/enc", "a", "enc", tokens=2048), op("b/enc", "b", "enc", tokens=8, level=1)
    qa, qb = op("a/top", "a", "ha", tokens=2048, level=2), op("b/top", "b", "hb", tokens=8, level=2)
    g = graph([a, b, qa, qb], [("a/enc", "a/top"), ("b/enc", "b/top")])
    out = placed(waves_of([sl(a, 1)], [sl(b, 1)], [sl(qb, 1), sl(qa, 1)]), g, cluster)
    assert devices_of(out, "b/enc", 1) == devices_of(out, "a/enc", 0)
    assert devices_of(out, "a/top", 2) == devices_of(out, "a/enc", 0)


def test_critical_first_gives_the_local_device_to_the_slice_that_sets_the_wave_s_length():
    """As above, but B's consumer runs two layers and A's one: a transfer into B's consumer would lengthen the
    wave, one into A's overlaps its slack. Critical first, B's consumer takes the device holding its rows;
    by flows alone, A's still does."""
    cluster = make_cluster(4, 4, "CPU")
    a, b = op("a/enc", "a", "enc", tokens=2048), op("b/enc", "b", "enc", tokens=8, level=1)
    qa, qb = op("a/top", "a", "ha", tokens=2048, level=2), op("b/top", "b", "hb", (0, 1), tokens=8, level=2)
    g = graph([a, b, qa, qb], [("a/enc", "a/top"), ("b/enc", "b/top")])
    waves = waves_of([sl(a, 1)], [sl(b, 1)], [sl(qa, 1), sl(qb, 1)])
    out = placed(waves, g, cluster, critical_first=True)
    assert devices_of(out, "b/enc", 1) == devices_of(out, "a/enc", 0)
    assert devices_of(out, "b/top", 2) == devices_of(out, "a/enc", 0)
    assert devices_of(out, "a/top", 2) != devices_of(out, "a/enc", 0)
    assert devices_of(placed(waves, g, cluster), "a/top", 2) == devices_of(out, "a/enc", 0)


def test_consumer_with_other_dp_lands_on_the_devices_holding_its_rows():
    cluster = make_cluster(8, 8, "CPU")
    a, b = op("a/enc", "a", "a", (0, 1), tokens=1024), op("b/enc", "b", "b", (0, 1))
    schedule = waves_of([sl(b, 4, layers=(0, 1)), sl(a, 4, layers=(0, 1))],
                        [sl(b, 4, layers=(1, 2)), sl(a, 2, layers=(1, 2))])
    out = placed(schedule, graph([a, b]), cluster)
    first, second = devices_of(out, "a/enc", 0), devices_of(out, "a/enc", 1)
    # dp 4 -> dp 2: rank k of the consumer needs samples of producer ranks 2k and 2k+1
    assert second[0] in first[0:2] and second[1] in first[2:4]


# ------------------------------------------------------------------------------------ weight co-location


def test_metaops_sharing_weights_are_co_located():
    cluster = make_cluster(4, 4, "CPU")
    # x's activations are big: its devices have less free memory than small's even after sharing weights
    x = op("x/enc", "x", "enc", (0, 1), tokens=512)
    y = op("y/enc", "y", "enc", (0, 1), tokens=8, level=1)
    small = op("s/enc", "s", "small", (0,), tokens=1)
    g = graph([x, y, small])
    w = hand_workload([x, y, small])
    cost, memory = models(w, cluster)
    out = place(waves_of([sl(x, 2), sl(small, 2)], [sl(y, 2)]), g, w, cluster, cost, memory)
    x_devices = devices_of(out, "x/enc", 0)
    free = [cluster.gpu.memory_bytes - b for b in predicted_memory(out[:1], g, memory, cluster)]
    assert max(free[d] for d in x_devices) < min(free[d] for d in devices_of(out, "s/enc", 0))
    assert sorted(devices_of(out, "y/enc", 1)) == sorted(x_devices)
    # weights stored once: x's devices hold both units once plus both slices' activations
    expected = memory.param_state_bytes("enc.layers.0", 1) + memory.param_state_bytes("enc.layers.1", 1) + sum(
        memory.activation_bytes(m, 1, 2, 2) for m in (x, y))
    assert predicted_memory(out, g, memory, cluster)[x_devices[0]] == pytest.approx(expected)


# ------------------------------------------------------------------------------------------------ memory


def test_backtracking_moves_an_earlier_slice_when_a_later_wave_overflows():
    """1 node x 2. Wave 0: A on one device; wave 1: its consumer B (local copy: A's device); wave 2: C on both.
    A device fits two of the slices but not all three, so B must move away from A."""
    a, b = op("a/enc", "a", "a", (0,), tokens=256), op("a/top", "a", "a", (1,), tokens=256, level=1)
    c = op("c/enc", "c", "c", batch=2, tokens=256, level=2)
    g = graph([a, b, c], [("a/enc", "a/top")])
    schedule = waves_of([sl(a, 1)], [sl(b, 1)], [sl(c, 2)])
    w = hand_workload([a, b, c])
    _, probe = models(w, make_cluster(2, 2, "CPU"))
    need = {m.id: slice_bytes(m, s, probe) for m, s in zip((a, b, c), (sl(a, 1), sl(b, 1), sl(c, 2)))}
    capacity = need["a/enc"] + need["a/top"] + need["c/enc"] / 2  # A and B fit together, C fits beside one
    assert capacity >= max(need["a/enc"], need["a/top"]) + need["c/enc"]
    cluster = make_cluster(2, 2, "CPU", gpu=GPUSpec("small", 50e9, capacity, 20e9))
    cost, memory = models(w, cluster)
    with pytest.raises(PlacementError, match="c/enc"):
        place(schedule, g, w, cluster, cost, memory, max_backtrack=0)
    out = place(schedule, g, w, cluster, cost, memory)
    assert devices_of(out, "a/top", 1) != devices_of(out, "a/enc", 0)
    assert max(predicted_memory(out, g, memory, cluster)) <= capacity


def test_overflow_names_the_metaop_and_the_bytes():
    cluster = make_cluster(4, 4, "CPU")
    m = op("big/enc", "big", "big", (0, 1), tokens=16384)
    g = graph([m])
    w = hand_workload([m])
    cost = AnalyticCostModel(w, cluster, config=CostModelConfig(attention="unfused"))  # s^2 scores are kept
    memory = MemoryModel(w, cluster, cost)
    need = slice_bytes(m, sl(m, 4), memory)
    assert need > cluster.gpu.memory_bytes
    for strategy in ("spindle", "sequential"):
        with pytest.raises(PlacementError) as err:
            place(waves_of([sl(m, 4)]), g, w, cluster, cost, memory, strategy=strategy)
        msg = str(err.value)
        assert "big/enc" in msg and "wave 0" in msg
        assert f"{need:.0f} bytes" in msg and f"{need / GiB:.2f} GiB" in msg


# ------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("mutate, match", [
    (lambda s: setattr(s, "tp", 3), "tp 3"),
    (lambda s: setattr(s, "metaop", "nope"), "no such MetaOp"),
    (lambda s: setattr(s, "layer_end", 9), r"layer range \[0, 9\)"),
])
def test_malformed_schedule_is_rejected(mutate, match):
    m = op("t/enc", "t", "t", (0, 1))
    schedule = waves_of([sl(m, 2)])
    mutate(schedule[0].slices[0])
    with pytest.raises(PlacementError, match=match):
        placed(schedule, graph([m]), make_cluster(4, 4, "CPU"))


def test_wave_wider_than_the_cluster_and_unknown_strategy_are_rejected():
    ms = [op(f"t{i}/enc", f"t{i}", f"m{i}") for i in range(2)]
    g, cluster = graph(ms), make_cluster(4, 4, "CPU")
    with pytest.raises(PlacementError, match="need 8 devices, the cluster has 4"):
        placed(waves_of([sl(ms[0], 4), sl(ms[1], 4)]), g, cluster)
    with pytest.raises(PlacementError, match="unknown placement strategy 'best'"):
        placed(waves_of([sl(ms[0], 4)]), g, cluster, strategy="best")


def test_placement_is_deterministic_and_leaves_its_input_alone():
    g, schedule, cluster = big_flow_case()
    assert placed(schedule, g, cluster) == placed(schedule, g, cluster)
    assert all(s.devices is None for wv in schedule for s in wv.slices)


def test_shared_tower_stays_on_its_node_when_its_gradients_outweigh_the_rows(monkeypatch):
    """2 nodes x 2. Wave 0: x (tower enc) on one node, p (its own tower) on the other; wave 1: y, tower enc
    again, reads p's small output. The rows pull y to p's node, enc's gradients (much bigger) to x's: placement
    keeps enc's parameter device group inside one node; scoring rows alone it would cross nodes."""
    import megatron_spindle.planner.placement as placement

    cluster = make_cluster(4, 2, "CPU")
    x = op("x/enc", "x", "enc", (0, 1), tokens=2)
    p = op("y/pre", "y", "pre", (0,), batch=8, tokens=2)
    y = op("y/enc", "y", "enc", (0, 1), tokens=2, level=1)
    g = graph([x, p, y], [("y/pre", "y/enc")])
    w = hand_workload([x, p, y])
    cost, memory = models(w, cluster)
    grads = sum(cost.param_count(u) for u in ("enc.layers.0", "enc.layers.1")) * memory.grad_bytes
    assert grads > 10 * cost.activation_bytes(p)  # the gradient sync outweighs the hand-off
    schedule = waves_of([sl(x, 2), sl(p, 2)], [sl(y, 2)])

    def islands(out, mid, wave):
        return {cluster.island(d) for d in devices_of(out, mid, wave)}

    out = place(schedule, g, w, cluster, cost, memory)
    assert islands(out, "x/enc", 0) != islands(out, "y/pre", 0)
    assert islands(out, "y/enc", 1) == islands(out, "x/enc", 0)
    plan = assemble_plan(w, cluster, g, out, cost, memory, {"planner": "test"}, validate=False)
    enc_group = [pg for pg in plan.param_groups if "enc.layers.0" in pg.params]
    assert len(enc_group) == 1 and cluster.same_island(enc_group[0].devices)
    # without the gradient term the rows win and enc's group spans both nodes
    monkeypatch.setattr(placement._Scorer, "sync_penalty", lambda self, island: 0.0)
    rows_only = place(schedule, g, w, cluster, cost, memory)
    assert islands(rows_only, "y/enc", 1) == islands(rows_only, "y/pre", 0)


def test_a_slice_whose_tower_sits_on_a_node_is_placed_before_heavier_slices_fill_it(monkeypatch):
    """2 nodes x 2. Wave 0: x (3 layers of tower enc) and q (big activations, so x's node keeps more free memory);
    wave 1: h (4 layers of its own tower: more gradient traffic than y's 3) and y (tower enc again). Ordered by
    traffic alone h goes first and takes x's node, the one with more free memory, and enc's parameter device
    group crosses nodes; counting the gradient sync y would spread, y goes first, beside x."""
    import megatron_spindle.planner.placement as placement

    cluster = make_cluster(4, 2, "CPU")
    x = op("x/enc", "x", "enc", (0, 1, 2), tokens=2)
    q = op("q/pre", "q", "pre", (0,), tokens=4096)
    h = op("h/big", "h", "big", (0, 1, 2, 3), tokens=2, level=1)
    y = op("y/enc", "y", "enc", (0, 1, 2), tokens=2, level=1)
    g = graph([x, q, h, y])
    w = hand_workload([x, q, h, y])
    cost, memory = models(w, cluster)
    schedule = waves_of([sl(x, 2), sl(q, 2)], [sl(h, 2), sl(y, 2)])

    def islands(out, mid, wave):
        return {cluster.island(d) for d in devices_of(out, mid, wave)}

    out = place(schedule, g, w, cluster, cost, memory)
    assert islands(out, "x/enc", 0) != islands(out, "q/pre", 0)
    assert islands(out, "y/enc", 1) == islands(out, "x/enc", 0)
    # ordered by traffic alone, h takes x's node first
    monkeypatch.setattr(placement._Scorer, "sync_stake", lambda self: 0.0)
    by_traffic = place(schedule, g, w, cluster, cost, memory)
    assert islands(by_traffic, "h/big", 1) == islands(by_traffic, "x/enc", 0)
    assert islands(by_traffic, "y/enc", 1) != islands(by_traffic, "x/enc", 0)
