"""The simulator's bucketed gradient sync overlapped with the backward, on cases timed by hand (stub cost
model, round bandwidths, zero latency), and its buckets against the runtime's."""

from __future__ import annotations

import dataclasses

import pytest
from test_simulator import GB, StubCostModel, StubMemoryModel, _cluster, _plan, _slice, _workload

from megatron_spindle.estimator import OVERLAP_SLOWDOWN, overlapped_backward_seconds
from megatron_spindle.estimator.comm_model import CommModel, GroupPlacement
from megatron_spindle.graph.cluster import ClusterSpec, GPUSpec
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import ModuleSpec, SpindleTask, Workload
from megatron_spindle.plan.schema import ParamGroup, Slice, Wave
from megatron_spindle.simulator import SimSettings, simulate


def with_run(plan, **changes):
    """A copy of the plan under other gradient-sync settings (--overlap-grad-reduce, --ddp-bucket-size)."""
    return dataclasses.replace(plan, settings=dataclasses.replace(plan.settings, **changes))


def _one_wave(w, cluster, devices, groups):
    return _plan(w, cluster, [Wave(0, 0, 0.0, 1.0, [_slice(0, "t/a", devices)])], groups)


@pytest.mark.parametrize("slowdown", [1.5, None])
def test_one_group_two_buckets_overlap_the_rest_of_the_backward(slowdown):
    """a (2 layers) on devices 0-1: forward 2 s, backward 4 s; each layer's 1 GB of gradients is a bucket of
    1 s. Layer 1's bucket is ready halfway through the backward and overlaps layer 0's backward, both running
    ``slowdown`` times slower; layer 0's bucket follows the backward. The estimator's single-device overlap
    model gives the same."""
    w, cluster = _workload(), _cluster()
    cost = StubCostModel({"a": 6.0, "b": 1.0}, activation=0.0, params_per_unit=250_000_000)
    plan = _one_wave(w, cluster, [0, 1], [ParamGroup([0, 1], ["a.layers.0", "a.layers.1"])])
    r = simulate(plan, w, cluster, cost, StubMemoryModel(cost, 0.0), SimSettings(overlap_slowdown=slowdown))
    s = slowdown or OVERLAP_SLOWDOWN
    # t=4: layer 1 done, its bucket starts; both progress at 1/s: the bucket ends at 4+s, when layer 0 has 1 s
    # of work left (done at 5+s); layer 0's bucket then takes 1 s
    assert r.iteration_time == pytest.approx(6.0 + s)
    assert r.iteration_time == pytest.approx(2.0 + overlapped_backward_seconds(4.0, [1.0, 1.0], [0.5, 1.0], s).end)
    assert r.compute_time == pytest.approx(6.0)
    assert r.grad_sync_time == pytest.approx(s)
    assert r.grad_sync[0].buckets == 2 and r.grad_sync[0].start == pytest.approx(4.0)
    assert r.grad_sync[0].comm_seconds == pytest.approx(s + 1.0)
    after = simulate(with_run(plan, overlap_grad_reduce=False), w, cluster, cost, StubMemoryModel(cost, 0.0))
    assert after.iteration_time == pytest.approx(6.0 + 2.0)  # both buckets after the backward
    one = simulate(with_run(plan, ddp_bucket_size=10**12), w, cluster, cost, StubMemoryModel(cost, 0.0),
                   SimSettings(overlap_slowdown=slowdown))
    assert one.grad_sync[0].buckets == 1 and one.iteration_time == pytest.approx(6.0 + 2.0)  # one 2 s bucket


def test_the_planners_estimate_follows_the_plans_bucket_size_and_overlap():
    """The case above at C10's slowdown: the planner's estimate (planner/objective.py) charges the buckets the
    plan records as the simulator does: overlapped (6 + s), after the backward (8), one bucket of both (8)."""
    from megatron_spindle.planner.objective import estimate_iteration

    w, cluster = _workload(), _cluster()
    cost = StubCostModel({"a": 6.0, "b": 1.0}, activation=0.0, params_per_unit=250_000_000)
    plan = _one_wave(w, cluster, [0, 1], [ParamGroup([0, 1], ["a.layers.0", "a.layers.1"])])
    for variant, want in ((plan, 6.0 + OVERLAP_SLOWDOWN), (with_run(plan, overlap_grad_reduce=False), 8.0),
                          (with_run(plan, ddp_bucket_size=10**12), 8.0)):
        assert simulate(variant, w, cluster, cost, StubMemoryModel(cost, 0.0)).iteration_time == pytest.approx(want)
        assert estimate_iteration(variant, build_metagraph(w), cluster, cost).total == pytest.approx(want)


def test_a_bucket_beside_compute_takes_the_measured_overlap_latency_more():
    """The same bucket of 1 s beside layer 0's backward, slowdown 1.5 and a measured overlap latency of 0.5 s (a
    CPU rank's): the bucket runs at 1 / (1.5 + 0.5) and ends 2 s after it starts (t=6), when the compute has
    done 4/3 s of its 2; the rest alone ends it at 6 + 2/3; layer 0's bucket follows it alone, with no latency."""
    import dataclasses

    w = _workload()
    cluster = dataclasses.replace(_cluster(), overlap_latency=0.5)
    cost = StubCostModel({"a": 6.0, "b": 1.0}, activation=0.0, params_per_unit=250_000_000)
    plan = _one_wave(w, cluster, [0, 1], [ParamGroup([0, 1], ["a.layers.0", "a.layers.1"])])
    r = simulate(plan, w, cluster, cost, StubMemoryModel(cost, 0.0), SimSettings(overlap_slowdown=1.5))
    assert r.iteration_time == pytest.approx(6.0 + 2.0 / 3.0 + 1.0)
    assert r.iteration_time == pytest.approx(
        2.0 + overlapped_backward_seconds(4.0, [1.0, 1.0], [0.5, 1.0], 1.5, 0.5).end)


class _CopyingCost(StubCostModel):
    """The stub with the sharded runtime's host copies measured: per layer 0.25 s loading weights, 0.5 s
    staging gradients."""

    def sharded_copy_seconds(self, metaop, tp, dp):
        return 0.25, 0.5


def test_the_sharded_runtime_s_copies_lengthen_the_phases():
    """At ZeRO-1 every layer's forward takes the weight loads longer and its backward the gradient staging
    (cost_model.py ``sharded_phases``): a (2 layers, 2 s forward, 4 s backward) gains 0.5 + 1 s, and the
    planner's estimate as much; at ZeRO-0 nothing changes."""
    from megatron_spindle.planner.objective import estimate_iteration

    w, cluster = _workload(), _cluster()
    group = [ParamGroup([0, 1], ["a.layers.0", "a.layers.1"])]
    wave = [Wave(0, 0, 0.0, 1.0, [_slice(0, "t/a", [0, 1])])]
    plain = StubCostModel({"a": 6.0, "b": 1.0}, activation=0.0, params_per_unit=250_000_000)
    copying = _CopyingCost({"a": 6.0, "b": 1.0}, activation=0.0, params_per_unit=250_000_000)
    settings = SimSettings(overlap_slowdown=1.0)
    for stage, added in ((0, 0.0), (1, 1.5)):
        plan = _plan(w, cluster, wave, group, {"zero_stage": stage})
        runs = [simulate(plan, w, cluster, cost, StubMemoryModel(cost, 0.0), settings) for cost in (plain, copying)]
        assert runs[1].compute_time == pytest.approx(runs[0].compute_time + added)
        assert runs[1].iteration_time == pytest.approx(runs[0].iteration_time + added)
        estimates = [estimate_iteration(plan, build_metagraph(w), cluster, cost).total for cost in (plain, copying)]
        assert estimates[1] == pytest.approx(estimates[0] + added)


def _two_tasks() -> Workload:
    mods = {m: ModuleSpec(m, "encoder", hidden_size=8, num_layers=2, num_heads=2, ffn_hidden_size=16) for m in "ab"}
    tasks = [SpindleTask("t1", batch_size=2).use("a", 3), SpindleTask("t2", batch_size=2).use("b", 3)]
    return Workload("two-towers", mods, tasks)


def _network_cluster() -> ClusterSpec:
    """2 nodes x 2 GPUs; across nodes 0.5 GB/s per GPU and per ring, 0.5 GB/s for the whole node."""
    gpu = GPUSpec("stub", peak_flops=1e12, memory_bytes=80 * GB, memory_bandwidth=200 * GB)
    return ClusterSpec(2, 2, gpu, intra_node_bw=1 * GB, inter_node_bw=0.5 * GB, node_network_bw=0.5 * GB,
                       network_rail_bw=0.5 * GB, collective_latency=0.0, network_latency=0.0)


def test_concurrent_cross_node_groups_share_the_node_network():
    """Group {0, 2} and group {1, 3} each all-reduce 0.5 GB across the two nodes: alone 1 s at 0.5 GB/s; at
    the same time they share each node's 0.5 GB/s and take 2 s each."""
    w, cluster = _two_tasks(), _network_cluster()
    cost = StubCostModel({"a": 2.0, "b": 2.0}, activation=0.0, params_per_unit=62_500_000)  # 0.25 GB per unit
    mem = StubMemoryModel(cost, 0.0)
    a = Slice("w0:t1/a", "t1/a", "a", "t1", "layer", 0, 2, [0, 2], 1, 2, 0.0)
    b = Slice("w0:t2/b", "t2/b", "b", "t2", "layer", 0, 2, [1, 3], 1, 2, 0.0)
    groups = [ParamGroup([0, 2], ["a.layers.0", "a.layers.1"]), ParamGroup([1, 3], ["b.layers.0", "b.layers.1"])]
    after = dict(overlap_grad_reduce=False, ddp_bucket_size=10**12)
    both = simulate(with_run(_plan(w, cluster, [Wave(0, 0, 0.0, 1.0, [a, b])], groups), **after), w, cluster, cost, mem)
    assert [g.cross_island for g in both.grad_sync] == [True, True]
    assert [g.seconds for g in both.grad_sync] == pytest.approx([2.0, 2.0])
    alone = simulate(with_run(_plan(w, cluster, [Wave(0, 0, 0.0, 1.0, [a])], groups[:1]), **after), w, cluster, cost,
                     mem)
    assert alone.grad_sync[0].seconds == pytest.approx(1.0)
    assert both.iteration_time - alone.iteration_time == pytest.approx(1.0)


def _shared_tower():
    """Tower a shared by t1 (wave 0) and t2 (wave 1), t2's own tower b in wave 2, each slice two layers on
    devices 0-1, 2 s forward and 4 s backward; a bucket per layer all-reduces in 1 s."""
    mods = {m: ModuleSpec(m, "encoder", hidden_size=8, num_layers=2, num_heads=2, ffn_hidden_size=16) for m in "ab"}
    tasks = [SpindleTask("t1", batch_size=2).use("a", 3), SpindleTask("t2", batch_size=2).use("a", 3).use("b", 3)]
    cost = StubCostModel({"a": 6.0, "b": 6.0}, activation=0.0, params_per_unit=250_000_000)
    sl = lambda wi, mid: Slice(f"w{wi}:{mid}", mid, mid[-1], mid[:2], "layer", 0, 2, [0, 1], 1, 2, 0.0)  # noqa: E731
    waves = [Wave(i, 0, float(i), 1.0, [sl(i, mid)]) for i, mid in enumerate(["t1/a", "t2/a", "t2/b"])]
    return Workload("shared", mods, tasks), _cluster(), cost, waves


def test_a_shared_unit_is_reduced_after_its_last_accumulation():
    """Tower a is shared by t1 (wave 0) and t2 (wave 1); t2's own tower b runs in wave 2. Backward: wave 2
    (b), wave 1 (a), wave 0 (a): a's buckets wait for wave 0's backward, its last accumulation, although wave
    1 already accumulated into them; b's overlap the backward."""
    w, cluster, cost, waves = _shared_tower()
    units = ["a.layers.0", "a.layers.1", "b.layers.0", "b.layers.1"]
    plan = _plan(w, cluster, waves, [ParamGroup([0, 1], units)])
    r = simulate(plan, w, cluster, cost, StubMemoryModel(cost, 0.0), SimSettings(overlap_slowdown=1.0))
    # forward 6 s; backward: b 6..10 (b1 done at 8, b0 at 10), t2/a 10..14, t1/a 14..18 (a1 at 16, a0 at 18);
    # buckets b1 8..9, b0 10..11, a1 16..17, a0 18..19
    assert r.compute_time == pytest.approx(18.0)
    assert r.grad_sync[0].buckets == 4 and r.grad_sync[0].start == pytest.approx(8.0)
    assert r.iteration_time == pytest.approx(19.0)


def test_simulator_buckets_are_the_runtimes():
    """The simulator cuts and orders the buckets of every group like runtime/grad_buffers.py."""
    import torch

    from megatron_spindle.estimator import AnalyticCostModel
    from megatron_spindle.graph.cluster import make_cluster
    from megatron_spindle.graph.workload import load_workload
    from megatron_spindle.planner.pipeline import PlannerConfig, make_plan
    from megatron_spindle.runtime.grad_buffers import GradBuffers, backward_order
    from megatron_spindle.runtime.shards import UnitShard
    from megatron_spindle.simulator.grad_sync import group_infos, plan_buckets

    w, cluster = load_workload("tiny-clip"), make_cluster(4, 4, "CPU")
    plan = make_plan(w, cluster, PlannerConfig(planner="wavefront"))
    g = build_metagraph(w)
    cost = AnalyticCostModel(w, cluster)
    multi = [pg for pg in plan.param_groups if len(pg.devices) > 1]
    assert multi, "tiny-clip on 4 devices should have a group with several devices"
    limit = 2 * max(cost.param_count(u) for pg in multi for u in pg.params)
    groups = group_infos(plan, g.metaops, cost.param_count, cluster)
    sim = plan_buckets(with_run(plan, ddp_bucket_size=limit), g.metaops, cost.param_count, groups)
    shards = {u: UnitShard(u, [f"{u}.w"], [torch.Size([cost.param_count(u)])], 1, 0)
              for pg in plan.param_groups for u in pg.params}
    unit_groups = [(tuple(sorted(pg.devices)), sorted(pg.params)) for pg in multi]
    runtime = GradBuffers(unit_groups, shards, backward_order(plan, g), limit, torch.device("cpu")).buckets
    assert len(sim) > len(multi)  # some group has several buckets
    assert [(b.devices, b.units) for b in sim] == [(b.devices, b.units) for b in runtime]


def test_zero_2_reduces_every_micro_batch_s_gradients_zero_1_only_the_last():
    """Two micro-batches: ZeRO-1 accumulates the full gradient over both and reduces it once, overlapped with
    the second micro-batch's backward; ZeRO-2 keeps only shards, so the first micro-batch's buckets are
    reduce-scattered too (during the second micro-batch) and twice the bytes move (plan/buckets.py)."""
    w, cluster = _workload(), _cluster()
    cost = StubCostModel({"a": 6.0, "b": 1.0}, activation=0.0, params_per_unit=250_000_000)
    group = [ParamGroup([0, 1], ["a.layers.0", "a.layers.1"])]
    wave = [Wave(0, 0, 0.0, 1.0, [_slice(0, "t/a", [0, 1])])]
    runs = {stage: simulate(_plan(w, cluster, wave, group, {"zero_stage": stage, "micro_batches": 2}), w, cluster,
                            cost, StubMemoryModel(cost, 0.0), SimSettings(overlap_slowdown=1.0))
            for stage in (1, 2)}  # no slowdown while overlapping: each bucket takes its own time
    one, two = runs[1].grad_sync[0], runs[2].grad_sync[0]
    assert two.buckets == 2 * one.buckets == 4
    assert two.grad_bytes == pytest.approx(2 * one.grad_bytes)
    assert two.comm_seconds == pytest.approx(2 * one.comm_seconds)
    assert two.start < one.start  # the first micro-batch's buckets, during the second micro-batch
    assert runs[2].iteration_time >= runs[1].iteration_time - 1e-9


def test_zero_2_reduces_after_each_segment_and_the_planner_charges_it_alike():
    """Tower a shared by t1 (wave 0, segment 0) and t2 (wave 1, segment 1), t2's b in wave 2 (segment 1); one
    group, a bucket per layer. ZeRO-1 reduces once, in the second segment's backward; ZeRO-2 keeps shards and
    reduce-scatters after each segment (plan/buckets.py sync_rounds): a's buckets in both rounds, the first
    during segment 0's backward (a1 done at 4 s: forward 0-2, backward 2-6), 6 buckets in all. The planner's
    estimate charges the same, with and without overlap (without: the first round once segment 0 has ended)."""
    from megatron_spindle.planner.objective import estimate_iteration

    w, cluster, cost, waves = _shared_tower()  # a reduce-scatter of a bucket: 0.5 s
    groups = [ParamGroup([0, 1], ["a.layers.0", "a.layers.1", "b.layers.0", "b.layers.1"])]
    runs = {}
    for stage in (1, 2):
        for overlap in (True, False):
            plan = _plan(w, cluster, waves, groups, {"zero_stage": stage, "segments": [[0], [1, 2]],
                                                     "overlap_grad_reduce": overlap})
            r = runs[stage, overlap] = simulate(plan, w, cluster, cost, StubMemoryModel(cost, 0.0))
            assert estimate_iteration(plan, build_metagraph(w), cluster, cost).total == pytest.approx(r.iteration_time)
    one, two = runs[1, True].grad_sync[0], runs[2, True].grad_sync[0]
    assert (one.buckets, two.buckets) == (4, 6)
    assert two.grad_bytes == pytest.approx(1.5 * one.grad_bytes)
    assert one.start == pytest.approx(12.0) and two.start == pytest.approx(4.0)
    assert runs[2, False].grad_sync[0].start == pytest.approx(6.0)  # without overlap: at segment 1's start
    assert runs[1, False].grad_sync[0].start == pytest.approx(18.0)


def test_an_overlapped_weight_gather_waits_only_for_its_own_bucket():
    """ZeRO-1, a (wave 0) then b (wave 1) on devices 0-1, one parameter group per tower, one bucket per layer
    (each layer 1 GB of fp32 gradient, 0.5 GB of bf16 weights). After the step (no overlap) the two groups'
    gathers run one after the other, fully exposed. With --overlap-param-gather every bucket's gather is issued
    as the iteration starts, in the order the forward uses them (a0 a1 b0 b1, g seconds each): a layer waits
    for its own bucket only. With layers of f < g seconds forward: a starts at g, pauses after its first layer
    until 2g; b starts at 3g and pauses until 4g: the forward ends at 4g + f."""
    w, cluster = _workload(), _cluster()
    groups = [ParamGroup([0, 1], ["a.layers.0", "a.layers.1"]), ParamGroup([0, 1], ["b.layers.0", "b.layers.1"])]
    waves = [Wave(0, 0, 0.0, 1.0, [_slice(0, "t/a", [0, 1])]), Wave(1, 1, 1.0, 1.0, [_slice(1, "t/b", [0, 1])])]
    settings = SimSettings(overlap_slowdown=1.0)

    def runs(work):
        cost = StubCostModel({"a": work, "b": work}, activation=0.0, params_per_unit=250_000_000)
        return {on: simulate(_plan(w, cluster, waves, groups, {"zero_stage": 1, "overlap_param_gather": on}), w,
                             cluster, cost, StubMemoryModel(cost, 0.0), settings) for on in (False, True)}

    off, on = runs(6.0).values()  # a layer's forward: 1 s
    (ga, a0, a1), (gb, b0, b1) = off.extras["param_gathers"]
    assert (ga, gb) == (0, 1) and b0 == pytest.approx(a1)  # after the step, one group after the other
    g = (a1 - a0) / 2
    assert g == pytest.approx((b1 - b0) / 2) and 0 < g < 1.0
    assert off.param_gather_time == pytest.approx(4 * g)
    assert [gi for gi, _, _ in on.extras["param_gathers"]] == [0, 0, 1, 1]
    assert [x for _, s, e in on.extras["param_gathers"] for x in (s, e)] == pytest.approx(
        [i * g for i in (0, 1, 1, 2, 2, 3, 3, 4)])
    assert on.param_gather_time == pytest.approx(g)  # only the first bucket is waited for
    assert on.iteration_time == pytest.approx(off.iteration_time - 3 * g)
    parts = (on.compute_time, on.transfer_time, on.grad_sync_time, on.optimizer_time, on.param_gather_time)
    assert sum(parts) == pytest.approx(on.iteration_time)
    assert on.busy[0][0].start == pytest.approx(g)  # a's forward starts when its first layer's weights are there
    short_off, short = runs(0.6).values()  # a layer's forward: 0.1 s, shorter than a bucket's gather
    f = 0.1
    assert f < g and short.forward_end == pytest.approx(4 * g + f)
    assert short_off.forward_end == pytest.approx(4 * f)
    # stage 0 has no gather: the setting changes nothing
    cost = StubCostModel({"a": 6.0, "b": 6.0}, activation=0.0, params_per_unit=250_000_000)
    plain = [simulate(_plan(w, cluster, waves, groups, {"zero_stage": 0, "overlap_param_gather": x}), w, cluster,
                      cost, StubMemoryModel(cost, 0.0), settings).iteration_time for x in (False, True)]
    assert plain[0] == pytest.approx(plain[1])


def test_an_overlapped_zero3_redistribution_is_waited_for_before_the_slice():
    """ZeRO-3, the same towers at TP 2 x DP 2 on devices 0-3 (TP shards: their groups are redistributed after the
    step, an all-to-all per bucket of r seconds). Without --overlap-param-gather the four run after the step. With it
    they are issued as the iteration starts, in the forward's order (a0 a1 b0 b1), and a slice waits for every
    bucket of its units before its first layer (the runtime lands them before the layer ahead issues a layer's
    gather: plan/buckets.py ``weights_wanted_at``): a starts at 2r, not r as at ZeRO-1; b's are in by then."""
    w, cluster = _workload(), _cluster()
    devices = [0, 1, 2, 3]
    groups = [ParamGroup(devices, ["a.layers.0", "a.layers.1"]), ParamGroup(devices, ["b.layers.0", "b.layers.1"])]
    waves = [Wave(0, 0, 0.0, 1.0, [_slice(0, "t/a", devices, tp=2)]),
             Wave(1, 1, 1.0, 1.0, [_slice(1, "t/b", devices, tp=2)])]
    cost = StubCostModel({"a": 6.0, "b": 6.0}, activation=0.0, params_per_unit=250_000_000)
    off, on = (simulate(_plan(w, cluster, waves, groups, {"zero_stage": 3, "overlap_param_gather": x}), w, cluster,
                        cost, StubMemoryModel(cost, 0.0), SimSettings(overlap_slowdown=1.0)) for x in (False, True))
    r = (off.extras["param_gathers"][0][2] - off.extras["param_gathers"][0][1]) / 2  # a group: two buckets
    assert 0 < r < 1.0 and off.param_gather_time == pytest.approx(4 * r)
    assert [x for _, s, e in on.extras["param_gathers"] for x in (s, e)] == pytest.approx(
        [i * r for i in (0, 1, 1, 2, 2, 3, 3, 4)])
    assert on.busy[0][0].start == pytest.approx(2 * r)  # both of a's buckets, before its first layer
    assert on.param_gather_time == pytest.approx(2 * r)
    assert on.iteration_time == pytest.approx(off.iteration_time - 2 * r)


def test_the_gather_after_the_step_is_charged_bucket_by_bucket():
    """Without --overlap-param-gather a group's updated weights are all-gathered one bucket after another (as
    the runtime streams them, plan/buckets.py): each bucket's collective, its latency included, and not one
    collective of the whole group."""
    w = _workload()
    cluster = dataclasses.replace(_cluster(), collective_latency=0.01)
    groups = [ParamGroup([0, 1], ["a.layers.0", "a.layers.1"]), ParamGroup([0, 1], ["b.layers.0", "b.layers.1"])]
    waves = [Wave(0, 0, 0.0, 1.0, [_slice(0, "t/a", [0, 1])]), Wave(1, 1, 1.0, 1.0, [_slice(1, "t/b", [0, 1])])]
    cost = StubCostModel({"a": 6.0, "b": 6.0}, activation=0.0, params_per_unit=250_000_000)
    run = simulate(_plan(w, cluster, waves, groups, {"zero_stage": 1, "overlap_param_gather": False}), w, cluster,
                   cost, StubMemoryModel(cost, 0.0), SimSettings(overlap_slowdown=1.0))
    comm, ring = CommModel(cluster), GroupPlacement.dp_ring([0, 1], 1, cluster)
    bucket = comm.all_gather(250_000_000 * 2, ring)  # one layer's bf16 weights: one bucket per layer here
    assert [e - s for _, s, e in run.extras["param_gathers"]] == pytest.approx([2 * bucket, 2 * bucket])
    assert 2 * bucket > comm.all_gather(2 * 250_000_000 * 2, ring)  # one more latency than a group's gather
