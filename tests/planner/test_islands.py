"""Islands chosen for the whole schedule at once (planner/islands.py), and placement inside them."""

from __future__ import annotations

import itertools
import random

import pytest
from test_placement import devices_of, graph, hand_workload, models, op, sl, waves_of

from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.planner.assemble import assemble_plan
from megatron_spindle.planner.islands import assign_islands, slice_blocks
from megatron_spindle.planner.placement import PlacementError, place, place_on_islands


def test_blocks_are_whole_nodes_and_carry_their_rows():
    assert slice_blocks(3, 1, 3, 8) == [(0, 3, 0.0, 1.0)]
    assert slice_blocks(12, 1, 12, 8) == [(0, 8, 0.0, 8 / 12), (8, 4, 8 / 12, 1.0)]
    # TP 2: positions 8-11 are DP ranks 4 and 5 of 6
    assert slice_blocks(12, 2, 6, 8) == [(0, 8, 0.0, 4 / 6), (8, 4, 4 / 6, 1.0)]


def reference_cost(assignment, slices, producers, flow_bytes, grads, gpn):
    """Crossing bytes and spread gradients of one assignment, counted directly (the module's objective)."""
    blocks = {k: slice_blocks(*slices[k], gpn) for k in slices}
    cost = 0.0
    for c, prods in producers.items():
        for p in prods:
            for bp, (_, _, plo, phi) in enumerate(blocks[p]):
                for bc, (_, _, clo, chi) in enumerate(blocks[c]):
                    if assignment[(p, bp)] != assignment[(c, bc)]:
                        cost += flow_bytes[c][p] * max(0.0, min(phi, chi) - max(plo, clo))
    holders: dict[str, set[int]] = {}
    weight: dict[str, float] = {}
    for k, units in grads.items():
        for u, g in units.items():
            holders.setdefault(u, set()).update(assignment[(k, b)] for b in range(len(blocks[k])))
            weight[u] = max(weight.get(u, 0.0), g)
    return cost + sum(weight[u] * (len(isl) - 1) for u, isl in holders.items())


@pytest.mark.parametrize("seed", range(12))
def test_the_assignment_is_optimal_on_small_schedules(seed):
    """Every assignment of a few waves' blocks to 2-3 islands enumerated: none that fits the islands costs less
    than the solver's, and the solver's fits."""
    rng = random.Random(seed)
    gpn, islands = rng.choice([(2, 2), (2, 3), (4, 2)])
    waves, slices, producers, flows, grads = [], {}, {}, {}, {}
    previous: list = []
    for wi in range(rng.randint(2, 4)):
        left, keys = gpn * islands, []
        while left and len(keys) < 3:
            n = rng.choice([d for d in (1, 2, 4, 6) if d <= left])
            key = (wi, len(keys))
            keys.append(key)
            left -= n
            slices[key] = (n, 1, n)
            producers[key] = rng.sample(previous, min(len(previous), rng.randint(0, 2)))
            flows[key] = {p: float(rng.randint(1, 9) * 10**6) for p in producers[key]}
            grads[key] = {f"u{rng.randint(0, 3)}": float(rng.randint(0, 3) * 10**6)}
        waves.append(keys)
        previous = keys
    chosen = assign_islands(slices, producers, flows, grads, waves, islands, gpn, time_limit=30.0)
    assert chosen is not None
    block_keys = sorted(chosen)
    sizes = {(k, b): size for k in slices for b, (_, size, _, _) in enumerate(slice_blocks(*slices[k], gpn))}

    def fits(a):
        return all(sum(sizes[(k, b)] for (k, b) in block_keys if k in keys and a[(k, b)] == i) <= gpn
                   for keys in waves for i in range(islands))

    assert fits(chosen)
    best = min(reference_cost(a, slices, producers, flows, grads, gpn)
               for combo in itertools.product(range(islands), repeat=len(block_keys))
               for a in [dict(zip(block_keys, combo))] if fits(a))
    assert reference_cost(chosen, slices, producers, flows, grads, gpn) == pytest.approx(best, abs=2e5)


def shared_tower_case():
    """2 nodes x 2. Wave 0: P; wave 1: Q, which shares P's weights; wave 2: R (Q's consumer, 2 devices) and P2
    (P's consumer). Greedy puts P on node 0, Q beside it (their shared gradients), then R with Q's rows, and P2
    has only node 1 left: P's activations cross. Seen whole, Q and R go to node 1 and P2 stays on P's node (the
    shared weights' sync crosses instead, a small fraction of those bytes)."""
    p, p2 = op("p/enc", "p", "p", (0,), tokens=2048), op("p/top", "p", "ptop", (0,), tokens=2048, level=2)
    q = op("q/enc", "q", "p", (0,), tokens=2048, level=1)
    r = op("q/top", "q", "qtop", (0,), tokens=2048, level=2)
    g = graph([p, q, r, p2], [("p/enc", "p/top"), ("q/enc", "q/top")])
    schedule = waves_of([sl(p, 1)], [sl(q, 2)], [sl(r, 2), sl(p2, 1)])
    for k, w in enumerate(schedule):
        w.level = k
    return g, schedule, make_cluster(4, 2, "CPU")


def test_whole_schedule_islands_keep_the_flows_a_greedy_wave_cuts():
    g, schedule, cluster = shared_tower_case()
    w = hand_workload(list(g.metaops.values()))
    cost, memory = models(w, cluster)
    plans = {}
    greedy = place(schedule, g, w, cluster, cost, memory)
    for whole in (False, True):
        out = place_on_islands(greedy, g, w, cluster, cost, memory)[0] if whole else greedy
        for wave in out:
            used = [d for s in wave.slices for d in s.devices]
            assert len(used) == len(set(used))
            assert all(cluster.same_island(s.devices) for s in wave.slices)
        plans[whole] = (out, assemble_plan(w, cluster, g, out, cost, memory, {}))
    greedy, whole = plans[False][1].predicted, plans[True][1].predicted
    assert greedy["inter_island_bytes"] == pytest.approx(cost.activation_bytes(g.metaops["p/enc"]))
    assert whole["inter_island_bytes"] == 0
    out = plans[True][0]
    assert cluster.island(devices_of(out, "p/top", 2)[0]) == cluster.island(devices_of(out, "p/enc", 0)[0])
    assert cluster.island(devices_of(out, "q/top", 2)[0]) == cluster.island(devices_of(out, "q/enc", 1)[0])


def test_one_node_or_islands_already_the_best_are_not_placed_again():
    g, schedule, _ = shared_tower_case()
    w = hand_workload(list(g.metaops.values()))
    one_node = make_cluster(4, 4, "CPU")
    cost, memory = models(w, one_node)
    assert place_on_islands(place(schedule, g, w, one_node, cost, memory), g, w, one_node, cost, memory) == []
    # without the third wave nothing forces a flow across nodes: the greedy islands are already the best
    two_nodes = make_cluster(4, 2, "CPU")
    cost, memory = models(w, two_nodes)
    assert place_on_islands(place(schedule[:2], g, w, two_nodes, cost, memory), g, w, two_nodes, cost,
                            memory) == []
    # the hint is the placement given, not a fresh greedy one: islands already chosen whole are not chosen again
    whole = place_on_islands(place(schedule, g, w, two_nodes, cost, memory), g, w, two_nodes, cost, memory)
    assert len(whole) == 1 and place_on_islands(whole[0], g, w, two_nodes, cost, memory) == []
    with pytest.raises(PlacementError, match="placed schedule"):
        place_on_islands(schedule, g, w, two_nodes, cost, memory)
