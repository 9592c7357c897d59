"""Constructive level plans (planner/level_plans.py): valid plans, optimal on instances that pack perfectly,
memory caps respected; and the CP-SAT planner's wave-window search, which turns a poor plan into the optimum."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.opgraph import MetaGraph, MetaOp
from megatron_spindle.planner.cpsat import CpSatOptions, makespan
from megatron_spindle.planner.cpsat.budget import TimeBudget
from megatron_spindle.planner.cpsat.lns import window_search
from megatron_spindle.planner.cpsat.problem import Problem, with_units
from megatron_spindle.planner.level_plans import efficient_waves, few_wave_plans
from megatron_spindle.planner.schedule import ScheduledSlice, ScheduledWave


@dataclass(frozen=True)
class Option:
    n: int
    tp: int
    dp: int
    seconds: float
    units: int = 0


class NoCost:
    """Cost-model stand-in: no bytes move (the window search never reads them)."""

    def activation_bytes(self, metaop) -> float:
        return 0.0

    def param_count(self, name: str) -> int:
        return 0


class NoMemory:
    """Memory-model stand-in: nothing is held, so no memory cap."""

    def param_state_bytes(self, name: str, tp: int, dp: int = 1) -> float:
        return 0.0

    def activation_bytes(self, metaop, tp: int, dp: int, num_layers: int) -> float:
        return 0.0


def level(layers: dict[str, int]) -> dict[str, MetaOp]:
    return {m: MetaOp(m, "t.layer", (4, 8, 16), [f"{m}.op{i}" for i in range(L)],
                      [(f"{m}.layers.{i}",) for i in range(L)], "t", m, "layer", 0, 0) for m, L in layers.items()}


def check_level_plan(waves: list[ScheduledWave], metaops, options, N: int, caps=None) -> None:
    """Every MetaOp's layers once and in order, one slice per MetaOp and wave, devices within N, durations the
    longest slice, slice times from the chosen option, and the memory caps."""
    pos = {m: 0 for m in metaops}
    for w in waves:
        assert sum(s.n for s in w.slices) <= N
        assert len({s.metaop for s in w.slices}) == len(w.slices)
        assert w.duration == max(s.time for s in w.slices)
        for s in w.slices:
            c = next(i for i, o in enumerate(options[s.metaop]) if (o.n, o.tp, o.dp) == (s.n, s.tp, s.dp))
            layers = s.layer_end - s.layer_start
            assert s.layer_start == pos[s.metaop] and layers >= 1
            assert abs(s.time - options[s.metaop][c].seconds * layers) < 1e-12
            assert layers <= (caps or {}).get((s.metaop, c), layers)
            pos[s.metaop] = s.layer_end
    assert pos == {m: mo.num_layers for m, mo in metaops.items()}


def linear_options(t: float, ns=(1, 2, 4), loss: float = 0.1) -> list[Option]:
    """n devices: t / n per layer, slowed by ``loss`` per doubling (data parallel)."""
    return [Option(n, 1, n, t / n * (1 + loss) ** (n.bit_length() - 1)) for n in ns]


def test_efficient_waves_packs_a_perfect_instance_optimally():
    # four chains of 6 layers at 1 s/layer on 4 devices: one wave of four 1-device slices, 6 s = C*
    metaops = level({m: 6 for m in "abcd"})
    options = {m: linear_options(1.0) for m in metaops}
    waves = efficient_waves(metaops, options, 4)
    check_level_plan(waves, metaops, options, 4)
    assert makespan(waves) == 6.0 and len(waves) == 1


def test_efficient_waves_respects_memory_caps():
    metaops = level({"a": 8, "b": 8})
    options = {m: linear_options(1.0, ns=(1, 2)) for m in metaops}
    caps = {("a", 0): 3, ("b", 0): 3, ("a", 1): 5, ("b", 1): 5}
    waves = efficient_waves(metaops, options, 2, caps)
    check_level_plan(waves, metaops, options, 2, caps)


@settings(max_examples=25, deadline=None)
@given(st.dictionaries(st.sampled_from("abcdef"), st.integers(1, 9), min_size=1, max_size=6),
       st.lists(st.floats(0.1, 3.0), min_size=6, max_size=6), st.sampled_from([2, 4, 8]))
def test_constructive_plans_are_valid(layers, times, N):
    metaops = level(layers)
    options = {m: linear_options(t) for m, t in zip(metaops, times)}
    check_level_plan(efficient_waves(metaops, options, N), metaops, options, N)
    for K, waves in few_wave_plans(metaops, options, N, 6).items():
        assert len(waves) <= K
        check_level_plan(waves, metaops, options, N)
    # no plan beats the work bound: every layer at its cheapest device-seconds, spread over N devices
    work = sum(L * min(o.n * o.seconds for o in options[m]) for m, L in layers.items()) / N
    assert makespan(efficient_waves(metaops, options, N)) >= work - 1e-9


def test_wave_window_search_reaches_the_optimum_from_a_sequential_plan():
    # four chains of 4 layers on 4 devices, each alone on 2 devices in its own wave (4 x 2.2 s); the optimum
    # runs all four side by side on one device each (4 s), which needs windows merged twice
    layers = {m: 4 for m in "abcd"}
    metaops = level(layers)
    graph = MetaGraph(metaops, [], [list(metaops)])
    raw = {m: linear_options(1.0, ns=(1, 2)) for m in metaops}
    unit = 1e-3
    options = {m: with_units(o, unit) for m, o in raw.items()}
    poor = []
    for i, m in enumerate(metaops):
        o = options[m][1]
        s = ScheduledSlice(m, o.n, o.tp, o.dp, 0, 4, o.seconds * 4, [0, 1])
        poor.append(ScheduledWave(0, i * s.time, s.time, [s]))
    problem = Problem(graph, make_cluster(4, 4), options, NoCost(), NoMemory(), CpSatOptions(), workers=1)
    best = window_search(problem, graph, poor, TimeBudget.of(30))
    check_level_plan(best, metaops, raw, 4)
    assert makespan(best) == 4.0
