"""The simulator on hand-built plans whose times can be computed by hand (stub cost and memory models)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from megatron_spindle.estimator.comm_model import OVERLAP_SLOWDOWN
from megatron_spindle.graph.cluster import HBM_STREAM_EFFICIENCY, ClusterSpec, GPUSpec
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import ModuleSpec, SpindleTask, Workload
from megatron_spindle.plan.schema import (
    ExecutionSettings,
    MetaOpInfo,
    ParamGroup,
    Plan,
    Recompute,
    Slice,
    Wave,
)
from megatron_spindle.simulator import SimSettings, simulate, zero_state_bytes_per_param

GB = 1e9


@dataclass(frozen=True)
class StubCost:
    compute: float
    tp_comm: float = 0.0
    dp_sync: float = 0.0
    launch: float = 0.0
    data_comm: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.tp_comm + self.dp_sync + self.launch + self.data_comm


class StubCostModel:
    """Per-layer seconds = work / n (no dp_sync charged by the simulator); activations and params fixed."""

    class config:  # noqa: N801 - mimics AnalyticCostModel.config
        grad_bytes = 4

    def __init__(self, work: dict[str, float], activation: float, params_per_unit: int, dp_sync: float = 0.0):
        self.work, self.activation, self.params_per_unit, self.dp_sync = work, activation, params_per_unit, dp_sync

    def layer_cost(self, metaop, tp, dp):
        return StubCost(compute=self.work[metaop.module] / (tp * dp), dp_sync=self.dp_sync)

    def activation_bytes(self, metaop):
        return self.activation

    def param_count(self, name):
        return self.params_per_unit


class StubMemoryModel:
    def __init__(self, cost: StubCostModel, act_per_layer: float):
        self.cost, self.act_per_layer = cost, act_per_layer

    def param_state_bytes(self, name, tp):
        return self.cost.param_count(name) * 18 / tp

    def activation_bytes(self, metaop, tp, dp, num_layers):
        return self.act_per_layer * num_layers / (tp * dp)


# a device-to-device copy reads and writes HBM at the streaming efficiency (estimator CommModel)
COPY_BW = 200 * GB * HBM_STREAM_EFFICIENCY / 2


def after_backward(plan):
    """The plan with its gradient sync after the whole backward (--no-overlap-grad-reduce), as before overlap
    existed (tests of volumes and serialisation)."""
    plan.settings = dataclasses.replace(plan.settings, overlap_grad_reduce=False)
    return plan


def _cluster(nodes: int = 1, per_node: int = 4) -> ClusterSpec:
    # 1 GB/s NVLink, 0.5 GB/s network, 200 GB/s HBM, zero latency: transfer times in round numbers.
    gpu = GPUSpec("stub", peak_flops=1e12, memory_bytes=80 * GB, memory_bandwidth=200 * GB)
    return ClusterSpec(nodes, per_node, gpu, intra_node_bw=1 * GB, inter_node_bw=0.5 * GB,
                       intra_node_latency=0.0, inter_node_latency=0.0, collective_latency=0.0, network_latency=0.0)


def _workload() -> Workload:
    """One task: module a (2 layers) feeds module b (2 layers); no front ends, no loss."""
    mods = {
        "a": ModuleSpec("a", "encoder", hidden_size=8, num_layers=2, num_heads=2, ffn_hidden_size=16),
        "b": ModuleSpec("b", "encoder", hidden_size=8, num_layers=2, num_heads=2, ffn_hidden_size=16),
    }
    task = SpindleTask("t", batch_size=4).add_flow("a", "b", src_tokens=3, dst_tokens=3)
    return Workload("sim-two", mods, [task])


def _plan(w: Workload, cluster: ClusterSpec, waves: list[Wave], groups: list[ParamGroup], planner=None) -> Plan:
    """``planner``: execution settings by name (zero_stage, segments)."""
    g = build_metagraph(w)
    infos = [MetaOpInfo(id=m.id, task=m.task, module=m.module, kind=m.kind, num_layers=m.num_layers,
                        layer_offset=m.layer_offset, input_shape=list(m.input_shape), level=m.level,
                        preds=g.predecessors(m.id), params=[p for ps in m.params for p in ps])
             for m in g.metaops.values()]
    return Plan(workload_name=w.name, workload_digest=w.digest(), cluster=cluster.to_dict(),
                cluster_digest=cluster.digest(), planner={}, metaops=infos, levels=[], waves=waves,
                transfers=[], param_groups=groups, memory_per_device=[], predicted={"iteration_time": 0.0},
                settings=ExecutionSettings(**(planner or {})))


def _slice(wave: int, metaop: str, devices: list[int], tp: int = 1, layers=(0, 2)) -> Slice:
    return Slice(id=f"w{wave}:{metaop}", metaop=metaop, module=metaop.split("/")[1], task="t", kind="layer",
                 layer_start=layers[0], layer_end=layers[1], devices=devices, tp=tp, dp=len(devices) // tp,
                 predicted_time=0.0)


def _two_wave_plan(w, cluster, a_devices, b_devices, groups, planner=None):
    waves = [Wave(0, 0, 0.0, 1.0, [_slice(0, "t/a", a_devices)]),
             Wave(1, 1, 1.0, 1.0, [_slice(1, "t/b", b_devices)])]
    return _plan(w, cluster, waves, groups, planner)


def test_two_waves_local_transfer_and_one_allreduce():
    """a and b on the same 2 devices with the same layout: the transfer is a local copy; one all-reduce."""
    w, cluster = _workload(), _cluster()
    cost = StubCostModel({"a": 6.0, "b": 3.0}, activation=4 * GB, params_per_unit=250_000_000)
    mem = StubMemoryModel(cost, act_per_layer=1 * GB)
    groups = [ParamGroup([0, 1], ["a.layers.0", "a.layers.1", "b.layers.0", "b.layers.1"])]
    plan = _two_wave_plan(w, cluster, [0, 1], [0, 1], groups)
    r = simulate(after_backward(plan), w, cluster, cost, mem)
    # compute: a = 2 layers x 6/2, b = 2 layers x 3/2 -> 6 + 3 = 9 s (fwd 3 s, bwd 6 s)
    assert r.compute_time == pytest.approx(9.0)
    copy = 2.0e9 / COPY_BW
    assert r.forward_end == pytest.approx(3.0 + copy)  # plus the forward local copy of 2 GB/device
    # local copy: each device copies its 2 GB half at the achieved HBM bandwidth / 2, forward and backward
    assert r.transfer_time == pytest.approx(2 * copy)
    assert r.transfer_by_kind["local"] == pytest.approx(2 * copy)
    assert r.transfer_bytes_by_kind == pytest.approx({"local": 4 * GB, "intra_island": 0.0, "inter_island": 0.0})
    # all-reduce of 4 units x 250M params x 4 bytes = 4 GB over 2 ranks: 2*(1/2)*4 GB / 1 GB/s = 4 s (4 buckets)
    assert r.grad_sync_time == pytest.approx(4.0)
    assert r.iteration_time == pytest.approx(9.0 + 2 * copy + 4.0)
    assert r.compute_time + r.transfer_time + r.grad_sync_time == pytest.approx(r.iteration_time)
    assert len(r.grad_sync) == 1 and r.grad_sync[0].ranks == 2 and not r.grad_sync[0].cross_island


def test_two_waves_intra_island_transfer_timed_by_busiest_device():
    """a on device 0, b on devices 1-2: device 0 sends all 4 GB over NVLink (4 s) each way."""
    w, cluster = _workload(), _cluster()
    cost = StubCostModel({"a": 2.0, "b": 2.0}, activation=4 * GB, params_per_unit=0)
    plan = _two_wave_plan(w, cluster, [0], [1, 2], [])
    r = simulate(plan, w, cluster, cost, StubMemoryModel(cost, 0.0))
    assert r.compute_time == pytest.approx(2 * 2.0 + 2 * 1.0)  # a on 1 device, b on 2
    assert r.transfer_time == pytest.approx(8.0)  # 4 s forward + 4 s backward, nothing overlaps
    assert r.transfer_by_kind["intra_island"] == pytest.approx(8.0)
    assert r.transfer_bytes_by_kind["intra_island"] == pytest.approx(4 * GB)
    assert r.grad_sync_time == 0.0
    assert r.iteration_time == pytest.approx(14.0)


def test_message_host_time_lengthens_the_sending_and_the_receiving_phase():
    """As above, on devices that lose 0.5 s of compute per message (a profiled CPU): device 0 sends (forward) and
    receives (backward) two messages per direction, 1 s on a's phase and 1 s on b's each way: 4 s in all, charged
    to the transfers; a measured point-to-point latency of 0.25 s adds to each direction."""
    w = _workload()
    cluster = dataclasses.replace(_cluster(), message_host_seconds=0.5)
    cost = StubCostModel({"a": 2.0, "b": 2.0}, activation=4 * GB, params_per_unit=0)
    plan = _two_wave_plan(w, cluster, [0], [1, 2], [])
    r = simulate(plan, w, cluster, cost, StubMemoryModel(cost, 0.0))
    assert r.compute_time == pytest.approx(6.0)
    assert r.transfer_time == pytest.approx(8.0 + 4.0)
    assert r.iteration_time == pytest.approx(18.0)
    latent = dataclasses.replace(cluster, p2p_latency=0.25)
    assert simulate(plan, w, latent, cost, StubMemoryModel(cost, 0.0)).iteration_time == pytest.approx(18.5)
    # local copies are no messages: the same devices with the same layout cost nothing more
    local = simulate(_two_wave_plan(w, cluster, [0], [0], []), w, cluster, cost, StubMemoryModel(cost, 0.0))
    assert local.iteration_time == pytest.approx(simulate(_two_wave_plan(w, _cluster(), [0], [0], []), w,
                                                          _cluster(), cost, StubMemoryModel(cost, 0.0)).iteration_time)


def test_inter_island_transfer_uses_network_bandwidth():
    """a on devices 0-1 (node 0), b on devices 2-3 (node 1): each receiver gets 2 GB at 0.5 GB/s."""
    w, cluster = _workload(), _cluster(nodes=2, per_node=2)
    cost = StubCostModel({"a": 2.0, "b": 2.0}, activation=4 * GB, params_per_unit=0)
    plan = _two_wave_plan(w, cluster, [0, 1], [2, 3], [])
    r = simulate(plan, w, cluster, cost, StubMemoryModel(cost, 0.0))
    assert r.transfer_time == pytest.approx(2 * 4.0)
    assert r.transfer_by_kind["inter_island"] == pytest.approx(8.0)
    assert r.iteration_time == pytest.approx(2 * 1.0 + 2 * 1.0 + 8.0)


def test_grad_sync_groups_overlap_when_disjoint_and_serialise_when_sharing():
    w, cluster = _workload(), _cluster(nodes=2, per_node=2)
    cost = StubCostModel({"a": 2.0, "b": 2.0}, activation=0.0, params_per_unit=125_000_000)  # 0.5 GB/unit
    mem = StubMemoryModel(cost, 0.0)
    # disjoint: a's units on {0,1}, b's on {2,3}: two 1 GB all-reduces over 2 ranks in parallel, 1 s each
    disjoint = [ParamGroup([0, 1], ["a.layers.0", "a.layers.1"]), ParamGroup([2, 3], ["b.layers.0", "b.layers.1"])]
    waves = [Wave(0, 0, 0.0, 1.0, [_slice(0, "t/a", [0, 1])]), Wave(1, 1, 1.0, 1.0, [_slice(1, "t/b", [2, 3])])]
    after = SimSettings(transfers=False)
    r = simulate(after_backward(_plan(w, cluster, waves, disjoint)), w, cluster, cost, mem, settings=after)
    assert r.grad_sync_time == pytest.approx(1.0)
    assert r.grad_sync[0].start == pytest.approx(r.grad_sync[1].start) or r.grad_sync[0].end <= r.iteration_time
    # sharing device 1: {0,1} and {1,2} must run one after another on device 1
    sharing = [ParamGroup([0, 1], ["a.layers.0", "a.layers.1"]), ParamGroup([1, 2], ["b.layers.0", "b.layers.1"])]
    waves = [Wave(0, 0, 0.0, 1.0, [_slice(0, "t/a", [0, 1])]), Wave(1, 1, 1.0, 1.0, [_slice(1, "t/b", [1, 2])])]
    r = simulate(after_backward(_plan(w, cluster, waves, sharing)), w, cluster, cost, mem, settings=after)
    spans = sorted((g.start, g.end) for g in r.grad_sync)
    assert spans[1][0] >= spans[0][1] - 1e-12
    # {1,2} crosses nodes: 2*(1/2)*1 GB / 0.5 GB/s = 2 s; {0,1} inside node 0: 1 s
    assert r.grad_sync_time == pytest.approx(3.0)


def test_tp_shards_reduce_in_parallel_rings():
    """4 devices with tp=2: by TP shard two rings of 2 ranks, each reducing half the gradients; in whole units
    (a plan written before the flag) over all 4."""
    w, cluster = _workload(), _cluster()
    cost = StubCostModel({"a": 4.0, "b": 4.0}, activation=0.0, params_per_unit=250_000_000)  # 1 GB grads/unit
    groups = [ParamGroup([0, 1, 2, 3], ["a.layers.0", "a.layers.1", "b.layers.0", "b.layers.1"])]
    waves = [Wave(0, 0, 0.0, 1.0, [_slice(0, "t/a", [0, 1, 2, 3], tp=2)]),
             Wave(1, 1, 1.0, 1.0, [_slice(1, "t/b", [0, 1, 2, 3], tp=2)])]
    r = simulate(after_backward(_plan(w, cluster, waves, groups)), w, cluster, cost, StubMemoryModel(cost, 0.0))
    # 4 GB / tp 2 = 2 GB per rank over 2 ranks: 2 x (1/2) x 2 GB at 1 GB/s, 2 s
    assert r.grad_sync[0].ranks == 2
    assert r.grad_sync_time == pytest.approx(2.0)
    plan = _plan(w, cluster, waves, groups, planner={"tp_sharded_grads": False})
    r = simulate(after_backward(plan), w, cluster, cost, StubMemoryModel(cost, 0.0))
    # 4 GB over 4 ranks: 2 x (3/4) x 4 GB, 6 s
    assert r.grad_sync[0].ranks == 4
    assert r.grad_sync_time == pytest.approx(6.0)


def test_dataflow_lets_disjoint_chains_run_concurrently():
    """Two tasks on disjoint devices in separate waves: the simulator overlaps them (no global barrier)."""
    mods = {"a": ModuleSpec("a", "encoder", hidden_size=8, num_layers=2, num_heads=2, ffn_hidden_size=16)}
    tasks = [SpindleTask("t1", batch_size=2).use("a", 3), SpindleTask("t2", batch_size=2).use("a", 5)]
    w, cluster = Workload("two-tasks", mods, tasks), _cluster()
    cost = StubCostModel({"a": 3.0}, activation=0.0, params_per_unit=0)
    waves = [Wave(0, 0, 0.0, 6.0, [Slice("w0:t1/a", "t1/a", "a", "t1", "layer", 0, 2, [0], 1, 1, 0.0)]),
             Wave(1, 0, 6.0, 6.0, [Slice("w1:t2/a", "t2/a", "a", "t2", "layer", 0, 2, [1], 1, 1, 0.0)])]
    plan = _plan(w, cluster, waves, [], planner={"segments": [[0], [1]]})
    r = simulate(plan, w, cluster, cost, StubMemoryModel(cost, 0.0))
    assert r.iteration_time == pytest.approx(6.0)
    assert r.utilisation[0] == pytest.approx(1.0) and r.utilisation[2] == 0.0
    assert r.utilisation_over_time(4) == pytest.approx([0.5] * 4)


def test_segments_free_activations_between_tasks():
    """Per-task segments: the second task's activations are allocated after the first task's are freed."""
    mods = {"a": ModuleSpec("a", "encoder", hidden_size=8, num_layers=2, num_heads=2, ffn_hidden_size=16)}
    tasks = [SpindleTask("t1", batch_size=2).use("a", 3), SpindleTask("t2", batch_size=2).use("a", 5)]
    w, cluster = Workload("two-tasks", mods, tasks), _cluster()
    cost = StubCostModel({"a": 1.0}, activation=0.0, params_per_unit=1_000_000)
    mem = StubMemoryModel(cost, act_per_layer=1 * GB)
    waves = [Wave(0, 0, 0.0, 1.0, [Slice("w0:t1/a", "t1/a", "a", "t1", "layer", 0, 2, [0], 1, 1, 0.0)]),
             Wave(1, 0, 1.0, 1.0, [Slice("w1:t2/a", "t2/a", "a", "t2", "layer", 0, 2, [0], 1, 1, 0.0)])]
    params = 2 * 1_000_000 * 18  # two units, stored once although both tasks use them
    together = simulate(_plan(w, cluster, waves, []), w, cluster, cost, mem)
    apart = simulate(_plan(w, cluster, waves, [], planner={"segments": [[0], [1]]}), w, cluster, cost, mem)
    assert together.peak_memory[0] == pytest.approx(params + 4 * GB)
    assert apart.peak_memory[0] == pytest.approx(params + 2 * GB)
    assert together.iteration_time == pytest.approx(apart.iteration_time)


def test_zero_stages_shard_state_and_stage3_costs_gathers():
    assert zero_state_bytes_per_param(0, 8) == 18
    assert zero_state_bytes_per_param(1, 4) == pytest.approx(2 + 4 + 12 / 4)
    assert zero_state_bytes_per_param(2, 4) == pytest.approx(2 + 16 / 4)
    assert zero_state_bytes_per_param(3, 4) == pytest.approx(18 / 4)
    w, cluster = _workload(), _cluster()
    cost = StubCostModel({"a": 4.0, "b": 4.0}, activation=0.0, params_per_unit=250_000_000)
    mem = StubMemoryModel(cost, 0.0)
    groups = [ParamGroup([0, 1, 2, 3], ["a.layers.0", "a.layers.1", "b.layers.0", "b.layers.1"])]
    results = {}
    for stage in (0, 2, 3):
        plan = _two_wave_plan(w, cluster, [0, 1, 2, 3], [0, 1, 2, 3], groups, planner={"zero_stage": stage})
        results[stage] = simulate(after_backward(plan), w, cluster, cost, mem)
    # stage 0 all-reduces 4 GB over 4 ranks (2 x 3/4 x 4 s = 6 s); stage 2 reduce-scatters it (3 s) and
    # all-gathers the 2 GB of updated bf16 weights after the step (3/4 x 2 s = 1.5 s)
    assert results[0].grad_sync_time == pytest.approx(6.0)
    assert results[2].grad_sync_time == pytest.approx(3.0)
    assert results[2].param_gather_time == pytest.approx(1.5)
    assert results[2].iteration_time == pytest.approx(results[0].iteration_time - 1.5)
    assert max(results[2].peak_memory) < max(results[0].peak_memory)
    assert max(results[3].peak_memory) < max(results[2].peak_memory)
    # stage 3: each phase of the two slices (2 layers of 1/3 s forward, 2/3 s backward on each device) gathers
    # 0.5 GB of bf16 weights per layer over 4 ranks (3/4 x 0.5 s alone): the first gather alone, the second
    # beside the first layer's compute, both slowed by C10 (estimator/slice_time.py). Forward: the gather
    # (s x 0.375 s) outlasts the layer, which then waits for it; backward: the layer outlasts it and takes
    # (s - 1) x 0.375 s more. Half the all-reduce (6 s -> 3 s).
    g, s = 0.75 * 0.5, OVERLAP_SLOWDOWN
    forward, backward = g + s * g - 1 / 3, g + (s - 1) * g
    assert results[3].compute_time == pytest.approx(results[0].compute_time + 2 * (forward + backward))
    assert results[3].grad_sync_time == pytest.approx(results[0].grad_sync_time / 2)
    # both slices hold their units at TP 1 on exactly their group's devices: each weight shard is the master
    # shard, so nothing is gathered after the step (plan/buckets.py regathered_groups)
    assert results[3].param_gather_time == 0.0


def test_bad_segments_and_zero_stage_are_rejected():
    w, cluster = _workload(), _cluster()
    cost = StubCostModel({"a": 1.0, "b": 1.0}, activation=0.0, params_per_unit=0)
    with pytest.raises(ValueError, match="segments"):
        simulate(_two_wave_plan(w, cluster, [0], [0], [], planner={"segments": [[0]]}), w, cluster, cost,
                 StubMemoryModel(cost, 0.0))
    with pytest.raises(ValueError, match="zero_stage"):
        simulate(_two_wave_plan(w, cluster, [0], [0], [], planner={"zero_stage": 5}), w, cluster, cost,
                 StubMemoryModel(cost, 0.0))


def test_recompute_flag_of_the_plan_selects_matching_models():
    """settings.recompute: layers cost 4 forward passes instead of 3 and hold only their inputs; simulate()
    rebuilds a cost model given for the other setting."""
    from megatron_spindle.baselines import BaselineContext, spindle_seq_plan
    from megatron_spindle.estimator import AnalyticCostModel
    from megatron_spindle.graph.cluster import make_cluster
    from megatron_spindle.graph.workload import load_workload

    w, c = load_workload("clip-4"), make_cluster(16)
    plan = spindle_seq_plan(w, c, BaselineContext.build(w, c))
    assert plan.settings.recompute == Recompute("none")  # fits 80 GiB without recomputation
    plain = simulate(plan, w, c, AnalyticCostModel(w, c))
    plan.settings = dataclasses.replace(plan.settings, recompute=Recompute("full"))
    again = simulate(plan, w, c, AnalyticCostModel(w, c))  # the given model does not recompute: rebuilt
    assert again.compute_time > plain.compute_time
    assert max(again.peak_memory) < max(plain.peak_memory)
    assert again.iteration_time == pytest.approx(simulate(plan, w, c).iteration_time)


class TimedOptimizerCost(StubCostModel):
    """The stub plus an AdamW cost: 1 ns per element and 10 ms per stepped tensor (one per unit)."""

    def optimizer_seconds(self, elements, tensors=0):
        from megatron_spindle.estimator import OptimizerCost

        return OptimizerCost(1e-9, 0.01).seconds(elements, tensors)


def test_optimizer_step_follows_the_grad_sync_and_scales_with_held_elements():
    """a on devices 0-1, b on device 1 only: device 1 steps twice the units and elements of device 0, after the
    all-reduce of a's group; the iteration ends with its step."""
    w, cluster = _workload(), _cluster()
    cost = TimedOptimizerCost({"a": 6.0, "b": 3.0}, activation=0.0, params_per_unit=100_000_000)
    groups = [ParamGroup([0, 1], ["a.layers.0", "a.layers.1"]), ParamGroup([1], ["b.layers.0", "b.layers.1"])]
    plan = _two_wave_plan(w, cluster, [0, 1], [1], groups)
    r = simulate(after_backward(plan), w, cluster, cost, StubMemoryModel(cost, 0.0))
    (s0, e0), (s1, e1) = r.optimizer_steps[:2]
    assert e0 - s0 == pytest.approx(2 * 0.1 + 2 * 0.01)  # 2 units of 100 M elements
    assert e1 - s1 == pytest.approx(4 * 0.1 + 4 * 0.01)
    assert r.optimizer_steps[2:] == [(0.0, 0.0), (0.0, 0.0)]  # idle devices hold nothing
    sync = r.grad_sync[0]
    assert s0 == s1 == pytest.approx(sync.end)  # after the all-reduce both devices take part in
    assert r.iteration_time == pytest.approx(e1)
    assert r.optimizer_time == pytest.approx(r.iteration_time - sync.end)
    assert r.breakdown()["optimizer"] == r.optimizer_time
    assert r.compute_time + r.transfer_time + r.grad_sync_time + r.optimizer_time == pytest.approx(r.iteration_time)
    assert simulate(plan, w, cluster, cost, StubMemoryModel(cost, 0.0),
                    SimSettings(optimizer=False)).iteration_time == pytest.approx(sync.end)


def test_optimizer_step_shards_with_zero_and_is_free_without_parameters():
    w, cluster = _workload(), _cluster()
    cost = TimedOptimizerCost({"a": 6.0, "b": 3.0}, activation=0.0, params_per_unit=100_000_000)
    groups = [ParamGroup([0, 1], ["a.layers.0", "a.layers.1", "b.layers.0", "b.layers.1"])]
    steps = {}
    for zero in (0, 1):
        plan = _two_wave_plan(w, cluster, [0, 1], [0, 1], groups, planner={"zero_stage": zero})
        r = simulate(after_backward(plan), w, cluster, cost, StubMemoryModel(cost, 0.0))
        steps[zero] = r.optimizer_steps[0][1] - r.optimizer_steps[0][0]
        assert r.optimizer_time == pytest.approx(steps[zero])
    assert steps[0] == pytest.approx(4 * 0.1 + 4 * 0.01)
    assert steps[1] == pytest.approx(4 * 0.05 + 4 * 0.01)  # each of the 2 DP ranks steps half of the elements
    empty = TimedOptimizerCost({"a": 6.0, "b": 3.0}, activation=0.0, params_per_unit=0)
    r = simulate(_two_wave_plan(w, cluster, [0, 1], [0, 1], []), w, cluster, empty, StubMemoryModel(empty, 0.0))
    assert r.optimizer_time == 0.0 and all(s == e for s, e in r.optimizer_steps)


def test_analytic_optimizer_cost_streams_norm_adamw_and_weights_at_memory_bandwidth():
    """Per fp32 master element: the gradient norm reads the gradient (4 bytes), AdamW reads 4 and writes 3 fp32
    tensors (28), the model's bf16 weight is written from the master (4 + 2); fp32 models and fp32 parameters
    cast per forward have no separate weights, and without clipping there is no norm."""
    import dataclasses

    from megatron_spindle.estimator import AnalyticCostModel

    w, cluster = _workload(), _cluster()
    model = AnalyticCostModel(w, cluster)
    bandwidth = cluster.gpu.memory_bandwidth * model.config.memory_efficiency
    assert model.optimizer_seconds(1e9, 100) == pytest.approx(1e9 * (4 + 28 + 6) / bandwidth)
    assert model.optimizer_seconds(0, 100) == 0.0
    assert AnalyticCostModel(w, cluster, dtype_bytes=4).optimizer_bytes_per_element() == 4 + 28
    no_clip = dataclasses.replace(model.config, grad_norm=False)
    assert AnalyticCostModel(w, cluster, config=no_clip).optimizer_bytes_per_element() == 28 + 6
    amp = dataclasses.replace(model.config, param_cast=True)
    assert AnalyticCostModel(w, cluster, config=amp).optimizer_bytes_per_element() == 4 + 28
