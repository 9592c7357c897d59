"""Device placement: islands, disjointness, the sequential baseline, big flows, weight co-location, memory."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_spindle.graph.cluster import GiB, make_cluster
from megatron_spindle.graph.opgraph import MetaGraph, MetaOp
from megatron_spindle.graph.workload import workload_from_dict
from megatron_spindle.planner.assemble import assemble_plan
from megatron_spindle.planner.placement import PlacementError, place, predicted_memory
from megatron_spindle.planner.schedule import ScheduledSlice, ScheduledWave

BF16 = 2


class FakeCost:
    """Activation bytes = bf16 output of the op's input shape; every unit has ``params`` parameters."""

    def __init__(self, params: int = 1000):
        self.params = params

    def activation_bytes(self, m: MetaOp) -> float:
        return float(BF16 * m.batch * m.tokens * m.hidden)

    def param_count(self, name: str) -> int:
        return self.params


class FakeMemory:
    """18 bytes per parameter split over tp; activations per layer scaled by ``act_factor``, split over n."""

    def __init__(self, params: int = 1000, act_factor: float = 1.0):
        self.params = params
        self.act_factor = act_factor

    def param_state_bytes(self, name: str, tp: int) -> float:
        return 18.0 * self.params / tp

    def activation_bytes(self, m: MetaOp, tp: int, dp: int, num_layers: int) -> float:
        return self.act_factor * BF16 * m.batch * m.tokens * m.hidden * num_layers / (tp * dp)


def workload(tasks: list[str]):
    mods = {"enc": {"kind": "encoder", "num_layers": 2, "hidden_size": 8, "num_heads": 2, "ffn_hidden_size": 16}}
    return workload_from_dict({"name": "hand", "modules": mods,
                               "tasks": [{"name": t, "batch_size": 8, "tokens": {"enc": 4}} for t in tasks]})


def op(mid: str, task: str, units: list[str], batch: int = 8, tokens: int = 4, hidden: int = 8,
       level: int = 0) -> MetaOp:
    return MetaOp(mid, "layer", (batch, tokens, hidden), [f"{mid}#{i}" for i in range(len(units))],
                  [(u,) for u in units], task, "enc", "layer", 0, level)


def graph(ops: list[MetaOp], edges: list[tuple[str, str]] = ()) -> MetaGraph:
    levels: dict[int, list[str]] = {}
    for m in ops:
        levels.setdefault(m.level, []).append(m.id)
    return MetaGraph({m.id: m for m in ops}, list(edges), [levels[k] for k in sorted(levels)])


def sl(metaop: MetaOp, n: int, tp: int = 1, layers: tuple[int, int] | None = None, devices=None) -> ScheduledSlice:
    a, b = layers or (0, metaop.num_layers)
    return ScheduledSlice(metaop.id, n, tp, n // tp, a, b, float(b - a), devices)


def waves_of(*waves: list[ScheduledSlice], level: int = 0) -> list[ScheduledWave]:
    out, t = [], 0.0
    for slices in waves:
        d = max(s.time for s in slices)
        out.append(ScheduledWave(level, t, d, slices))
        t += d
    return out


def placed(waves, g, w, cluster, strategy="spindle", **kw):
    return place(waves, g, w, cluster, FakeCost(), FakeMemory(**kw), strategy=strategy)


def devices_of(waves, metaop: str, wave: int) -> list[int]:
    return next(s.devices for s in waves[wave].slices if s.metaop == metaop)


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
    tokens = draw(st.lists(st.integers(1, 64), min_size=len(sizes), max_size=len(sizes)))
    return nodes, per_node, sizes, tokens


@settings(max_examples=60, deadline=None)
@given(packable_wave())
def test_slices_stay_in_one_island_and_waves_are_disjoint(case):
    nodes, per_node, sizes, tokens = case
    cluster = make_cluster(nodes * per_node, per_node, "CPU")
    ops = [op(f"t{i}/enc", f"t{i}", ["u"], tokens=tk) for i, tk in enumerate(tokens)]
    # a first wave on all devices makes the second wave's incoming flows land anywhere
    first = [sl(m, 1) for m in ops]
    consumers = [op(f"t{i}/head", f"t{i}", [f"h{i}"], tokens=tk, level=1) for i, tk in enumerate(tokens)]
    second = [sl(m, n, tp=min(n, 2)) for m, n in zip(consumers, sizes)]
    g = graph(ops + consumers, [(a.id, b.id) for a, b in zip(ops, consumers)])
    schedule = waves_of(first, second)
    out = placed(schedule, g, workload([f"t{i}" for i in range(len(sizes))]), cluster)
    for w in out:
        used = [d for s in w.slices for d in s.devices]
        assert len(used) == len(set(used)), "a device runs two slices of one wave"
        assert all(0 <= d < cluster.num_devices for d in used)
        for s in w.slices:
            assert len(s.devices) == s.n
            assert cluster.same_island(s.devices), f"{s.metaop} on {s.devices} spans islands"


def test_big_flows_do_not_take_the_island_a_later_slice_needs():
    """X's rows are on node 0 and Y's on node 1; putting Y on node 1 would leave no node for Z (4 devices)."""
    cluster = make_cluster(8, 4, "CPU")
    xp, yp = op("x/enc", "x", ["x0"], tokens=512, hidden=64), op("y/enc", "y", ["y0"], tokens=256, hidden=64)
    xc = op("x/head", "x", ["x1"], tokens=512, hidden=64, level=1)
    yc = op("y/head", "y", ["y1"], tokens=256, hidden=64, level=1)
    z = op("z/enc", "z", ["z0"], level=1)
    g = graph([xp, yp, xc, yc, z], [("x/enc", "x/head"), ("y/enc", "y/head")])
    w = workload(["x", "y", "z"])
    schedule = waves_of([sl(xp, 4), sl(yp, 4)], [sl(z, 4), sl(yc, 2), sl(xc, 2)])
    out = placed(schedule, g, w, cluster)
    assert {cluster.island(d) for d in devices_of(out, "x/enc", 0)} == {0}
    assert {cluster.island(d) for d in devices_of(out, "y/enc", 0)} == {1}
    for s in out[1].slices:
        assert cluster.same_island(s.devices), f"{s.metaop} on {s.devices} spans islands"
    # X's big flow still becomes local copies
    assert set(devices_of(out, "x/head", 1)) <= set(devices_of(out, "x/enc", 0))


def test_flow_stays_in_the_producer_island_when_its_devices_are_taken():
    """A feeds two consumers; the first takes A's devices, the second should stay on A's node although the
    other node is emptier."""
    cluster = make_cluster(8, 4, "CPU")
    a = op("a/enc", "a", ["a0"], tokens=512, hidden=64)
    filler = op("f/enc", "f", ["f0"], tokens=2048, hidden=64)
    c1 = op("a/head", "a", ["a1"], tokens=512, hidden=64, level=1)
    c2 = op("a/aux", "a", ["a2"], tokens=512, hidden=64, level=1)
    g = graph([a, filler, c1, c2], [("a/enc", "a/head"), ("a/enc", "a/aux")])
    schedule = waves_of([sl(a, 2), sl(filler, 2)], [sl(c1, 2, tp=2), sl(c2, 2)])
    out = placed(schedule, g, workload(["a", "f"]), cluster)
    a_island = cluster.island(devices_of(out, "a/enc", 0)[0])
    assert set(devices_of(out, "a/head", 1)) == set(devices_of(out, "a/enc", 0))
    assert {cluster.island(d) for d in devices_of(out, "a/aux", 1)} == {a_island}


def test_slice_larger_than_a_node_takes_whole_nodes():
    cluster = make_cluster(12, 4, "CPU")
    a, b = op("a/enc", "a", ["u"]), op("b/enc", "b", ["v"])
    g = graph([a, b])
    out = placed(waves_of([sl(b, 4, tp=2), sl(a, 8, tp=2)]), g, workload(["a", "b"]), cluster)
    big = devices_of(out, "a/enc", 0)
    islands = [cluster.island(d) for d in big]
    assert len(set(islands)) == 2 and all(islands.count(i) == 4 for i in set(islands))
    # each TP group (positions 2k, 2k+1) stays inside one node
    assert all(cluster.island(big[r]) == cluster.island(big[r + 1]) for r in range(0, 8, 2))


def test_unpackable_wave_still_places_every_slice():
    cluster = make_cluster(8, 4, "CPU")
    ms = [op(f"t{i}/enc", f"t{i}", [f"u{i}"], batch=6) for i in range(3)]
    out = placed(waves_of([sl(ms[0], 3), sl(ms[1], 3), sl(ms[2], 2)]), graph(ms), workload(["t0", "t1", "t2"]),
                 cluster)
    used = [d for s in out[0].slices for d in s.devices]
    assert sorted(used) == list(range(8))


# ------------------------------------------------------------------------------------------- sequential


def test_sequential_takes_consecutive_ranges_in_wave_order():
    cluster = make_cluster(16, 8, "CPU")
    ms = [op(f"t{i}/enc", f"t{i}", [f"u{i}", f"v{i}"]) for i in range(4)]
    first, second = (0, 1), (1, 2)
    w = waves_of([sl(ms[0], 2, layers=first), sl(ms[1], 8, tp=2, layers=first), sl(ms[2], 4, layers=first),
                  sl(ms[3], 1, layers=first)],
                 [sl(ms[3], 4, layers=second), sl(ms[0], 1, layers=second), sl(ms[1], 1, layers=second),
                  sl(ms[2], 1, layers=second)])
    out = placed(w, graph(ms), workload([f"t{i}" for i in range(4)]), cluster, strategy="sequential")
    assert [s.devices for s in out[0].slices] == [[0, 1], list(range(2, 10)), [10, 11, 12, 13], [14]]
    assert [s.devices for s in out[1].slices] == [[0, 1, 2, 3], [4], [5], [6]]


# ----------------------------------------------------------------------------------- big flows, locality


def big_flow_case():
    """2 nodes x 4. Wave 0: A (big output) on 2 devices, B on 4, C on 2. Wave 1: D on 4, E on 2, then A's
    consumer A2 on 2. Sequential puts A on 0-1 and A2 on 6-7 (another node)."""
    a = op("a/enc", "a", ["a0"], tokens=512, hidden=64)
    a2 = op("a/head", "a", ["a1"], tokens=512, hidden=64, level=1)
    b, c = op("b/enc", "b", ["b0"]), op("c/enc", "c", ["c0"])
    d, e = op("d/enc", "d", ["d0"], level=1), op("e/enc", "e", ["e0"], level=1)
    g = graph([a, a2, b, c, d, e], [("a/enc", "a/head")])
    schedule = waves_of([sl(a, 2), sl(b, 4), sl(c, 2)], [sl(d, 4), sl(e, 2), sl(a2, 2)])
    schedule[1].level = 1
    return g, schedule, workload(["a", "b", "c", "d", "e"]), make_cluster(8, 4, "CPU")


def test_spindle_moves_fewer_inter_island_bytes_than_sequential():
    g, schedule, w, cluster = big_flow_case()
    plans = {}
    for strategy in ("spindle", "sequential"):
        out = placed(schedule, g, w, cluster, strategy=strategy)
        plans[strategy] = assemble_plan(w, cluster, g, out, FakeCost(), FakeMemory(), {"placement": strategy})
    seq, spin = plans["sequential"].predicted, plans["spindle"].predicted
    flow = FakeCost().activation_bytes(g.metaops["a/enc"])
    assert seq["inter_island_bytes"] == pytest.approx(flow)
    assert spin["inter_island_bytes"] < seq["inter_island_bytes"]
    t = next(t for t in plans["spindle"].transfers if t.producer == "w0:a/enc")
    assert t.kind == "local" and t.src_devices == t.dst_devices


def test_the_bigger_flow_gets_the_local_device_first():
    """A (big output) and B (small output, sharing A's weights, so on A's device) both feed a one-device
    consumer in the last wave; only one consumer can sit on that device and the big flow should win."""
    cluster = make_cluster(4, 4, "CPU")
    a = op("a/enc", "a", ["enc.layers.0"], tokens=512, hidden=64)
    b = op("b/enc", "b", ["enc.layers.0"], tokens=8, hidden=64, level=1)
    qa = op("a/head", "a", ["ha"], tokens=512, hidden=64, level=2)
    qb = op("b/head", "b", ["hb"], tokens=8, hidden=64, level=2)
    g = graph([a, b, qa, qb], [("a/enc", "a/head"), ("b/enc", "b/head")])
    schedule = waves_of([sl(a, 1)], [sl(b, 1)], [sl(qb, 1), sl(qa, 1)])
    out = placed(schedule, g, workload(["a", "b"]), cluster)
    assert devices_of(out, "b/enc", 1) == devices_of(out, "a/enc", 0)
    assert devices_of(out, "a/head", 2) == devices_of(out, "a/enc", 0)


def test_consumer_with_other_dp_lands_on_the_devices_holding_its_rows():
    cluster = make_cluster(8, 8, "CPU")
    a = op("a/enc", "a", ["a0", "a1"], tokens=256, hidden=64)
    b = op("b/enc", "b", ["b0", "b1"])
    g = graph([a, b])
    schedule = waves_of([sl(b, 4, layers=(0, 1)), sl(a, 4, layers=(0, 1))],
                        [sl(b, 4, layers=(1, 2)), sl(a, 2, layers=(1, 2))])
    out = placed(schedule, g, workload(["a", "b"]), cluster)
    first, second = devices_of(out, "a/enc", 0), devices_of(out, "a/enc", 1)
    # dp 4 -> dp 2: rank k of the consumer needs samples of producer ranks 2k and 2k+1
    assert second[0] in first[0:2] and second[1] in first[2:4]


# ------------------------------------------------------------------------------------ weight co-location


def test_metaops_sharing_weights_are_co_located():
    cluster = make_cluster(4, 4, "CPU")
    # x's activations are big: its devices have less free memory than small's even after sharing weights
    x = op("x/enc", "x", ["enc.layers.0", "enc.layers.1"], tokens=4096)
    y = op("y/enc", "y", ["enc.layers.0", "enc.layers.1"], tokens=2, level=1)
    small = op("s/enc", "s", ["s.layers.0"], tokens=1)
    g = graph([x, y, small])
    schedule = waves_of([sl(x, 2), sl(small, 2)], [sl(y, 2)])
    w = workload(["x", "y", "s"])
    memory_model = FakeMemory(params=10_000)
    out = place(schedule, g, w, cluster, FakeCost(10_000), memory_model)
    x_devices = devices_of(out, "x/enc", 0)
    free = [cluster.gpu.memory_bytes - b for b in predicted_memory(out[:1], g, memory_model, cluster)]
    assert max(free[d] for d in x_devices) < min(free[d] for d in devices_of(out, "s/enc", 0))
    assert sorted(devices_of(out, "y/enc", 1)) == sorted(x_devices)
    # weights stored once: x's devices hold both units once plus both slices' activations
    mem = predicted_memory(out, g, memory_model, cluster)
    dev = devices_of(out, "x/enc", 0)[0]
    expected = 2 * memory_model.param_state_bytes("enc.layers.0", 1) + sum(
        memory_model.activation_bytes(m, 1, 2, 2) for m in (x, y))
    assert mem[dev] == pytest.approx(expected)


# ------------------------------------------------------------------------------------------------ memory


def memory_case():
    """1 node x 2. Wave 0: A on one device; wave 1: its consumer B on one device; wave 2: C on both."""
    a = op("a/enc", "a", ["a0"])
    b = op("a/head", "a", ["b0"], level=1)
    c = op("c/enc", "c", ["c0"], batch=2)
    g = graph([a, b, c], [("a/enc", "a/head")])
    schedule = waves_of([sl(a, 1)], [sl(b, 1)], [sl(c, 2)])
    return g, schedule, workload(["a", "c"])


class BlockMemory(FakeMemory):
    """Every slice needs ``per_slice`` bytes per device; no parameter state."""

    def __init__(self, per_slice: float):
        super().__init__()
        self.per_slice = per_slice

    def param_state_bytes(self, name: str, tp: int) -> float:
        return 0.0

    def activation_bytes(self, m, tp, dp, num_layers) -> float:
        return self.per_slice


def test_backtracking_moves_an_earlier_slice_when_a_later_wave_overflows():
    g, schedule, w = memory_case()
    cluster = make_cluster(2, 2, "CPU")
    per_slice = cluster.gpu.memory_bytes * 0.4  # a device holds two slices, not three
    memory_model = BlockMemory(per_slice)
    with pytest.raises(PlacementError, match="c/enc"):
        place(schedule, g, w, cluster, FakeCost(), memory_model, max_backtrack=0)
    out = place(schedule, g, w, cluster, FakeCost(), memory_model)
    assert devices_of(out, "a/head", 1) != devices_of(out, "a/enc", 0)
    assert max(predicted_memory(out, g, memory_model, cluster)) <= cluster.gpu.memory_bytes


def test_overflow_names_the_metaop_and_the_bytes():
    cluster = make_cluster(4, 4, "CPU")
    m = op("big/enc", "big", ["u0", "u1"], tokens=4096, hidden=4096)
    g = graph([m])
    memory_model = FakeMemory(params=3 * 10**8)
    need = 2 * memory_model.param_state_bytes("u0", 1) + memory_model.activation_bytes(m, 1, 4, 2)
    assert need > cluster.gpu.memory_bytes
    for strategy in ("spindle", "sequential"):
        with pytest.raises(PlacementError) as err:
            place(waves_of([sl(m, 4)]), g, workload(["big"]), cluster, FakeCost(), memory_model, strategy=strategy)
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
    m = op("t/enc", "t", ["u0", "u1"])
    schedule = waves_of([sl(m, 2)])
    mutate(schedule[0].slices[0])
    with pytest.raises(PlacementError, match=match):
        placed(schedule, graph([m]), workload(["t"]), make_cluster(4, 4, "CPU"))


def test_wave_wider_than_the_cluster_and_unknown_strategy_are_rejected():
    ms = [op(f"t{i}/enc", f"t{i}", ["u"]) for i in range(2)]
    g, w, cluster = graph(ms), workload(["t0", "t1"]), make_cluster(4, 4, "CPU")
    with pytest.raises(PlacementError, match="need 8 devices, the cluster has 4"):
        placed(waves_of([sl(ms[0], 4), sl(ms[1], 4)]), g, w, cluster)
    with pytest.raises(PlacementError, match="unknown placement strategy 'best'"):
        placed(waves_of([sl(ms[0], 4)]), g, w, cluster, strategy="best")


def test_placement_is_deterministic_and_leaves_its_input_alone():
    g, schedule, w, cluster = big_flow_case()
    first = placed(schedule, g, w, cluster)
    second = placed(schedule, g, w, cluster)
    assert first == second
    assert all(s.devices is None for wv in schedule for s in wv.slices)
