"""When the wave schedule moves data: each transfer is posted as soon as its data exists and waited on where it
is needed (runtime/transfer.py), as the simulator times it. In-process on one rank, where every transfer is a
local copy through the same post / wait path as a message between ranks."""

from __future__ import annotations

import torch
from plans import sequential_plan

from megatron_spindle.compat.groups import ensure_torch_distributed
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.runtime.engine import RuntimeEngine


def _logged_step(engine: RuntimeEngine) -> list[tuple]:
    """The order of one forward_backward's slice steps and transfer posts / waits on this rank."""
    log: list[tuple] = []
    schedule = engine.schedule

    def wrap(name: str, event):
        inner = getattr(schedule, name)

        def logged(first, *args, **kwargs):
            log.append(event(first))
            return inner(first, *args, **kwargs)
        setattr(schedule, name, logged)

    wrap("_forward_slice", lambda ls: ("slice", "fwd", ls.slice.id))
    wrap("_backward_slice", lambda ls: ("slice", "bwd", ls.slice.id))
    wrap("_post_forward", lambda t: ("post", "fwd", t.index))
    wrap("_receive_forward", lambda t: ("wait", "fwd", t.index))
    wrap("_post_backward", lambda t: ("post", "bwd", t.index))
    wrap("_receive_backward", lambda t: ("wait", "bwd", t.index))
    engine.forward_backward(0)
    return log


def test_transfers_leave_when_their_data_exists_and_wait_where_it_is_needed():
    torch.set_num_threads(1)
    ensure_torch_distributed()
    w = load_workload("tiny-clip")
    plan = sequential_plan(w, 1)  # one MetaOp per wave: every task's frontends run before any tower
    log = _logged_step(RuntimeEngine(plan, w, 0, 1))
    slice_steps = [e for e in log if e[0] == "slice"]
    at = {e: i for i, e in enumerate(log)}
    early = 0
    for t in plan.transfers:
        index = plan.transfers.index(t)
        post_f, wait_f = at[("post", "fwd", index)], at[("wait", "fwd", index)]
        post_b, wait_b = at[("post", "bwd", index)], at[("wait", "bwd", index)]
        producer_f, consumer_f = at[("slice", "fwd", t.producer)], at[("slice", "fwd", t.consumer)]
        consumer_b, producer_b = at[("slice", "bwd", t.consumer)], at[("slice", "bwd", t.producer)]
        # forward: posted right after the producer's forward, waited on right before the consumer's
        assert not [e for e in log[producer_f + 1:post_f] if e[0] == "slice"], (t, log[producer_f:post_f + 1])
        assert post_f < wait_f < consumer_f
        assert not [e for e in log[wait_f + 1:consumer_f] if e[0] == "slice"]
        # backward: posted right after the consumer's backward, waited on right before the producer's
        assert not [e for e in log[consumer_b + 1:post_b] if e[0] == "slice"]
        assert post_b < wait_b < producer_b
        assert not [e for e in log[wait_b + 1:producer_b] if e[0] == "slice"]
        early += any(e[0] == "slice" for e in log[post_f:wait_f])
    # most transfers skip waves here (a task's frontend feeds its tower after the other tasks' frontends)
    assert early >= len(w.tasks), (early, len(plan.transfers))
    assert len(slice_steps) == 2 * sum(len(wave.slices) for wave in plan.waves)


def test_a_whole_local_shard_is_handed_over_without_a_copy():
    from megatron_spindle.plan.routing import ROUTE_LOCAL, Message
    from megatron_spindle.runtime.transfer import post_messages

    src = torch.arange(12.0).reshape(4, 3)
    received = {ROUTE_LOCAL: 0}
    whole = post_messages([Message(0, 0, 0, 0, 4, ROUTE_LOCAL)], 0, src, (4, 3), 0, tag=0, dtype=torch.float32,
                          device=torch.device("cpu"), pending_sends=[], received=received).result()
    assert whole.data_ptr() == src.data_ptr() and received[ROUTE_LOCAL] == src.numel() * 4
    # rows moved within the rank (two messages, swapped halves) and a type change are copies
    halves = [Message(0, 0, 0, 2, 2, ROUTE_LOCAL), Message(0, 0, 2, 0, 2, ROUTE_LOCAL)]
    swapped = post_messages(halves, 0, src, (4, 3), 0, tag=0, dtype=torch.float32, device=torch.device("cpu"),
                            pending_sends=[]).result()
    assert swapped.data_ptr() != src.data_ptr() and torch.equal(swapped, torch.cat([src[2:], src[:2]]))
    double = post_messages([Message(0, 0, 0, 0, 4, ROUTE_LOCAL)], 0, src, (4, 3), 0, tag=0, dtype=torch.float64,
                           device=torch.device("cpu"), pending_sends=[]).result()
    assert double.dtype == torch.float64 and torch.equal(double, src.double())


def test_a_task_batch_goes_to_the_device_once_per_micro_batch_not_once_per_slice():
    """Every slice of a task used to move the task's whole input to the GPU again (measured on an H200: 56 pageable
    copies per clip-4 iteration, 156 ms of 800); the slices of a task with the same data-parallel shard now share one
    copy per micro-batch."""
    from dataclasses import dataclass, fields

    from megatron_spindle.data.mock import TaskBatch

    shards: list[str] = []

    @dataclass
    class CountedBatch(TaskBatch):
        def shard(self, dp_rank: int, dp: int) -> TaskBatch:
            shards.append(self.task)
            return super().shard(dp_rank, dp)

    torch.set_num_threads(1)
    ensure_torch_distributed()
    w = load_workload("tiny-clip")
    plan = sequential_plan(w, 1)
    engine = RuntimeEngine(plan, w, 0, 1)
    inner, forward, seen = engine.batch_fn, engine.schedule._forward_slice, []

    def counted_batch(*args):
        b = inner(*args)
        return CountedBatch(**{f.name: getattr(b, f.name) for f in fields(b)})

    def counted_forward(ls, *args):
        seen.append(ls.slice.task)
        return forward(ls, *args)

    engine.batch_fn, engine.schedule._forward_slice = counted_batch, counted_forward
    engine.forward_backward(0)
    assert sorted(shards) == sorted(t.name for t in w.tasks)  # one shard (and device copy) per task
    assert len(seen) == sum(len(wave.slices) for wave in plan.waves) > len(w.tasks)


def test_a_batch_moves_to_a_device_without_blocking_and_stays_on_the_cpu_there():
    from megatron_spindle.data.mock import mock_batch
    from megatron_spindle.runtime.schedule import _to_device

    w = load_workload("tiny-clip")
    batch = mock_batch(w, "vision_text", 0)
    assert _to_device(batch, torch.device("cpu")) is batch
    moved = _to_device(batch, torch.device("meta"))  # any non-CPU device takes the same path as CUDA
    assert type(moved) is type(batch) and moved.inputs.keys() == batch.inputs.keys()
    assert all(t.device.type == "meta" and t.shape == batch.inputs[m].shape for m, t in moved.inputs.items())
