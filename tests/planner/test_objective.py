"""The planner's estimate (planner/objective.py): a transfer costs only where it is on the span's path, as the
simulator times it: it leaves when its sender's phase ends and delays the phase that needs it."""

from __future__ import annotations

import pytest

from megatron_spindle.estimator import AnalyticCostModel
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.plan.derive import plan_slice_pairs
from megatron_spindle.planner.objective import Flow, _unit_ready, slice_phases
from megatron_spindle.planner.pipeline import PlannerConfig, make_plan


@pytest.fixture(scope="module")
def one_device():
    """tiny-clip on one device: its waves run one after another, the order is every forward, then every backward
    in reverse."""
    w = load_workload("tiny-clip")
    cluster = make_cluster(1, 1, "CPU")
    plan = make_plan(w, cluster, PlannerConfig(planner="wavefront"))
    metaops = build_metagraph(w).metaops
    return plan, metaops, AnalyticCostModel(w, cluster)


def _gap(plan, phases, producer: str, consumer: str, phase: int) -> float:
    """Compute of ``phase`` (0 forward, 1 backward) between the producer's and the consumer's on the one device:
    the forward runs the waves in order, the backward in reverse."""
    wave_of = {s.id: w.index for w in plan.waves for s in w.slices}
    between = [s.id for w in plan.waves[wave_of[producer] + 1:wave_of[consumer]] for s in w.slices]
    return sum(phases[sid][phase] for sid in between)


def test_a_transfer_costs_only_what_the_compute_in_between_does_not_hide(one_device):
    plan, metaops, cost = one_device
    phases = slice_phases(plan, metaops, cost)
    span, same, _, _ = _unit_ready(plan, metaops, cost)
    assert same == span  # no hand-offs: nothing to wait for
    assert span == pytest.approx(sum(f + b for f, b in phases.values()))  # one device: phases back to back
    pairs = plan_slice_pairs(plan)
    gaps = {pair: _gap(plan, phases, *pair, 0) for pair in pairs}
    hidden = max(pairs, key=lambda pair: gaps[pair])  # a hand-off with waves in between
    assert gaps[hidden] > 0
    for seconds, added in ((0.5 * gaps[hidden], 0.0), (gaps[hidden] + 1e-3, 1e-3)):
        compute, with_transfer, _, _ = _unit_ready(plan, metaops, cost, {hidden: (Flow(seconds, ()), Flow(0.0, ()))})
        assert compute == span and with_transfer - span == pytest.approx(added, abs=1e-12)
    # a gradient going back is waited for by the producer's backward in the same way
    _, back, _, _ = _unit_ready(plan, metaops, cost, {hidden: (Flow(0.0, ()), Flow(1.0, ()))})
    assert back - span == pytest.approx(1.0 - _gap(plan, phases, *hidden, 1), abs=1e-12)


def test_transfers_on_one_link_go_one_after_another(one_device):
    """Two forward transfers whose senders end one after the other: on separate links each arrives its own time
    after its sender; on one link the later one starts when the earlier one is through."""
    plan, metaops, cost = one_device
    phases = slice_phases(plan, metaops, cost)
    wave_of = {s.id: w.index for w in plan.waves for s in w.slices}
    first, second = sorted(plan_slice_pairs(plan), key=lambda pair: wave_of[pair[0]])[:2]
    assert wave_of[first[0]] < wave_of[second[0]]
    long = 10.0  # far longer than the compute: both consumers wait for their transfers
    def on_links(a, b):
        return {first: (Flow(long, a), Flow(0.0, ())), second: (Flow(long, b), Flow(0.0, ()))}

    _, apart, _, _ = _unit_ready(plan, metaops, cost, on_links((0,), (1,)))
    _, shared, _, _ = _unit_ready(plan, metaops, cost, on_links((0,), (0,)))
    # on its own link the second transfer would overlap the first almost wholly; on the same link it waits for it
    gap = sum(phases[s.id][0] for w in plan.waves[wave_of[first[0]] + 1:wave_of[second[0]] + 1] for s in w.slices)
    assert shared - apart == pytest.approx(long - gap, rel=1e-9)



def test_message_host_time_lengthens_the_sending_and_the_receiving_phase(one_device):
    """A flow's host seconds are compute its sender and its receiver lose: on one device both phases run back to
    back, so a transfer with h host seconds each way adds 2h forward and 2h backward, none of it to the
    transfer-free span."""
    plan, metaops, cost = one_device
    span, _, _, _ = _unit_ready(plan, metaops, cost)
    pair = plan_slice_pairs(plan)[0]
    compute, with_host, _, _ = _unit_ready(plan, metaops, cost, {pair: (Flow(0.0, (), 0.25), Flow(0.0, (), 0.5))})
    assert compute == span and with_host - span == pytest.approx(2 * 0.25 + 2 * 0.5)


def test_phases_run_as_dataflow_on_their_own_devices():
    """A slice's phase starts when its own devices are done (not at a barrier after the wave's slowest slice):
    the transfer-free span is the per-device dataflow by hand, below the barriers' sum where a wave's slices
    differ in length."""
    from megatron_spindle.plan.order import BWD, slice_order

    w = load_workload("clip-4")
    cluster = make_cluster(16)
    plan = make_plan(w, cluster, PlannerConfig(planner="wavefront", select="none"))
    metaops = build_metagraph(w).metaops
    cost = AnalyticCostModel(w, cluster)
    phases = slice_phases(plan, metaops, cost)
    clock: dict[int, float] = {}
    steps: dict[tuple[int, str], float] = {}
    tasks = [[s.task for s in wv.slices] for wv in plan.waves]
    for wi, si, phase in slice_order(tasks, plan.settings):
        s = plan.waves[wi].slices[si]
        own = phases[s.id][1 if phase == BWD else 0]
        end = max(clock.get(d, 0.0) for d in s.devices) + own
        clock.update({d: end for d in s.devices})
        steps[(wi, phase)] = max(steps.get((wi, phase), 0.0), own)
    compute = _unit_ready(plan, metaops, cost).compute
    assert compute == pytest.approx(max(clock.values()) * plan.settings.micro_batches, rel=1e-12)
    assert compute < sum(steps.values()) * plan.settings.micro_batches


def test_a_forward_waits_for_its_own_layers_weights_at_their_place_in_the_slice(one_device):
    """--overlap-param-gather: each unit is first used where its operator starts in the first forward of the
    slice holding it (a slice's later layers later), not at the slice's start."""
    plan, metaops, cost = one_device
    times = _unit_ready(plan, metaops, cost)
    phases = slice_phases(plan, metaops, cost)
    s = max(plan.slices(), key=lambda x: x.num_layers)
    assert s.num_layers > 1
    units = metaops[s.metaop].params[s.layer_start:s.layer_end]
    first, last = times.first_use[units[0][0]], times.first_use[units[-1][-1]]
    assert last - first == pytest.approx(phases[s.id][0] * (s.num_layers - 1) / s.num_layers, rel=1e-9)


def test_weight_gathers_beside_compute_cost_what_the_comm_model_charges():
    """A device's gathers (needed by, seconds): run within the step they add their seconds; beside compute that
    needs them late they add the overlap slowdown, as ``overlapped_backward_seconds`` charges a backward beside
    its bucket; needed at once, the compute waits for them."""
    from megatron_spindle.estimator.comm_model import overlapped_backward_seconds
    from megatron_spindle.planner.objective import _gathers_added

    assert _gathers_added([(0.0, 1.0), (0.0, 2.0)], 0.0, 1.2, 0.0) == pytest.approx(3.0)
    late = _gathers_added([(10.0, 2.0)], 10.0, 1.2, 0.0)
    assert late == pytest.approx(overlapped_backward_seconds(10.0, [2.0], [0.0], 1.2).backward_end - 10.0)
    assert late == pytest.approx(2.0 * 0.2)
    assert _gathers_added([(0.0, 2.0)], 10.0, 1.2, 0.0) == pytest.approx(2.0)  # the compute waits, then runs alone
    # needed halfway: beside compute until the compute reaches it, then the rest alone
    assert _gathers_added([(1.0, 2.0)], 10.0, 1.2, 0.0) == pytest.approx(1.2 + (2.0 - 1.0) - 1.0)
    # a measured latency (a CPU profile's) makes a gather beside compute take longer, as in the comm model:
    # 2 s of compute move 2 / (1 + 0.5 / 2) = 1.6 s of it, the rest (0.4 s) is waited for alone
    assert _gathers_added([(2.0, 2.0)], 10.0, 1.0, 0.5) == pytest.approx(0.4)
