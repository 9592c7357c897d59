"""The wave schedule of one step (paper section 3.6, steps 2 and 4): the plan's execution order
(plan/order.py: by default forward wave by wave, then the backward in reverse wave order; or segments, or
explicit steps such as an early backward), once per micro-batch. A forward step waits for the transfers into
the wave (of the step's task), runs this rank's slice of it and posts the transfers out of it; a backward step
waits for the gradients of the transfers out of the wave, runs this rank's slice and posts the gradients of
the transfers into the wave back to their producers (runtime/transfer.py: a transfer leaves when its data
exists and holds up only the slice that needs it). Every rank walks the same steps, so the transfers and
collectives of two ranks meet in the same order.

With ``micro_batches`` m the whole order runs m times on micro-batch j's rows (``TaskBatch.micro``; each
slice's DP rank then takes its share of the micro-batch), gradients accumulating; a micro-batch's tensors are
dropped before the next starts. The per-task losses are the sum of every micro-batch's shares.

Nothing in it is a barrier: the loss all-reduce is issued after the last forward step and runs during the
remaining backward, and a rank that only sends in a transfer does not wait for the receiver (its requests are
waited on at the end; runtime/transfer.py). Before each micro-batch the schedule calls ``micro_start(j)``, before
the first step of each segment of the order (plan/order.py; one without segments) ``segment_start(k)``, before
each local slice's forward ``before_forward(slice)`` (the overlapped weight all-gather's cue), after each local
slice's backward ``slice_done(slice)`` (the gradient sync's cues), and after each step
``on_wave(phase, wave_index, seconds)``. ``evaluate`` runs the forward steps alone (validation: no autograd
graph, no backward, no ``on_wave``). Before each step that may wait for another rank, and before posting a
micro-batch's receives on gloo, it records ``progress.point`` (what the watchdog names when a peer is missing).
With ``slice_ranges`` set (the profiled iterations of ``--profile``) each local slice's forward and backward run
inside a named range, "spindle forward <slice>" / "spindle backward <slice>": a ``record_function`` for the PyTorch
profiler and, on CUDA, an NVTX range for Nsight Systems, so a profile says which slice the host's and the
device's time went to.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan.order import FWD, execution_steps, segments_of
from megatron_spindle.plan.schema import Plan
from megatron_spindle.runtime import progress
from megatron_spindle.runtime.layout import dp_rank, transfer_input_index
from megatron_spindle.runtime.slices import LocalSlice
from megatron_spindle.runtime.transfer import PendingTransfer, SpecFn, TransferOp

# The first word of the slices' profiler ranges (training/profiling.py tabulates the ranges that begin with it)
SLICE_RANGE = "spindle"


def slice_range(phase: str, slice_id: str, device: torch.device) -> ExitStack:
    """The named range of one slice's ``phase`` (forward / backward): a PyTorch profiler ``record_function`` and,
    on CUDA, an NVTX range (``nsys profile`` shows it on the timeline)."""
    name = f"{SLICE_RANGE} {phase} {slice_id}"
    stack = ExitStack()
    stack.enter_context(torch.profiler.record_function(name))
    if device.type == "cuda" and nvtx_available():
        stack.enter_context(torch.cuda.nvtx.range(name))
    return stack


@functools.cache
def nvtx_available() -> bool:
    """Whether this torch can mark NVTX ranges (a build without them raises on the first call: profiling must
    not end a training run over a missing marker)."""
    try:
        torch.cuda.nvtx.range_push("spindle probe")
        torch.cuda.nvtx.range_pop()
        return True
    except Exception:
        return False


def build_transfers(plan: Plan, workload: Workload, spec_fn: SpecFn, wave_index: dict[str, int],
                    no_grad: frozenset[str] = frozenset()) -> list[TransferOp]:
    """Plan transfers by consumer wave, then plan order (the same on every rank), each moving one micro-batch.
    A transfer out of a MetaOp in ``no_grad`` (a frozen module with nothing trainable upstream: graph/opgraph.py
    ``MetaOp.backward`` "none") carries no gradient back."""
    order = sorted(range(len(plan.transfers)), key=lambda i: (wave_index[plan.transfers[i].consumer], i))
    micro = plan.settings.micro_batches
    ops = []
    for i in order:
        t = plan.transfers[i]
        p, c = plan.slice(t.producer), plan.slice(t.consumer)
        info = plan.metaop(p.metaop)
        batch = info.input_shape[0] // micro
        op = TransferOp(i, p, c, spec_fn(workload, info, batch), batch, plan.gpus_per_node,
                        tag_stride=len(plan.transfers))
        op.input_index = transfer_input_index(plan, t)
        op.grad = p.metaop not in no_grad
        ops.append(op)
    return ops


@dataclass
class _SliceTensors:
    """A local slice's tensors during one step."""

    inputs: list[torch.Tensor | None]
    output: torch.Tensor | None = None
    out_grad: torch.Tensor | None = None


class WaveSchedule:
    """One step's forward and backward on this rank. ``loss_weights`` (task -> w_t), ``loss_scale`` (the fp16
    loss scale the backward starts from; 1 otherwise), ``on_wave`` and ``sync_waves`` (CUDA synchronised before
    each ``on_wave`` call, so that it times the wave's device work rather than its launches) may be changed
    between steps."""

    def __init__(self, plan: Plan, workload: Workload, rank: int, local: dict[str, LocalSlice], spec_fn: SpecFn,
                 loss_weights: dict[str, float], dtype: torch.dtype, device: torch.device,
                 on_wave: Callable[[str, int, float], None] | None = None, early_receives: bool = False,
                 no_grad: frozenset[str] = frozenset()):
        self.plan, self.workload, self.rank, self.local = plan, workload, rank, local
        self.early_receives = early_receives  # every receive posted when a micro-batch begins (gloo)
        self.loss_weights, self.dtype, self.device, self.on_wave = loss_weights, dtype, device, on_wave
        self.sync_waves = False
        self.slice_ranges = False
        wave_index = {s.id: wi for wi, w in enumerate(plan.waves) for s in w.slices}
        self.transfers = build_transfers(plan, workload, spec_fn, wave_index, no_grad)
        self._into_wave: dict[int, list[TransferOp]] = {}  # by consumer wave
        self._out_of_wave: dict[int, list[TransferOp]] = {}  # by producer wave
        for t in self.transfers:
            if t.involves(rank):
                self._into_wave.setdefault(wave_index[t.consumer.id], []).append(t)
                self._out_of_wave.setdefault(wave_index[t.producer.id], []).append(t)
        self._slice_of_wave = {ls.wave: ls for ls in local.values()}
        # (transfer, direction) where this rank receives from another rank: what early_receives posts
        self._remote_receives = [(t, d) for t in self.transfers if t.involves(rank) for d in (0, 1)
                                 if (d == 0 or t.grad) and t.remote_incoming(d, rank)]
        self._receive_peers = sorted({m.src for t, d in self._remote_receives for m in t.remote_incoming(d, rank)})
        self._pending_sends: list = []
        self.steps = execution_steps(len(plan.waves), plan.settings)
        segment = {w: k for k, seg in enumerate(segments_of(len(plan.waves), plan.settings)) for w in seg}
        self._segment_starts = {i: segment[w] for i, (w, _, _) in enumerate(self.steps)
                                if i == 0 or segment[w] != segment[self.steps[i - 1][0]]}  # step -> segment
        self.micro_batches = plan.settings.micro_batches
        self.loss_scale = 1.0

    def run(self, batches: dict[str, Any], slice_done: Callable[[LocalSlice], None],
            micro_start: Callable[[int], None] | None = None,
            before_forward: Callable[[LocalSlice], None] | None = None,
            segment_start: Callable[[int], None] | None = None) -> Callable[[], dict[str, float]]:
        """Forward and backward of one step; returns a function that waits for and reads the task losses."""
        return self._run(batches, slice_done, micro_start, before_forward, backward=True, segment_start=segment_start)

    def evaluate(self, batches: dict[str, Any],
                 before_forward: Callable[[LocalSlice], None] | None = None) -> Callable[[], dict[str, float]]:
        """The forward steps alone (call under ``torch.no_grad()``); returns the task-loss reader like ``run``."""
        return self._run(batches, None, None, before_forward, backward=False)

    def _run(self, batches: dict[str, Any], slice_done: Callable[[LocalSlice], None] | None,
             micro_start: Callable[[int], None] | None, before_forward: Callable[[LocalSlice], None] | None,
             backward: bool, segment_start: Callable[[int], None] | None = None) -> Callable[[], dict[str, float]]:
        mine = self._slice_of_wave
        names = [t.name for t in self.workload.tasks]
        losses = torch.zeros(len(names), dtype=torch.float64, device=self.device)
        steps = self.steps if backward else [st for st in self.steps if st[1] == FWD]
        last_forward = max(i for i, st in enumerate(steps) if st[1] == FWD)
        work = None
        for j in range(self.micro_batches):
            if micro_start is not None:
                micro_start(j)
            micro = {t: micro_batch(b, j, self.micro_batches) for t, b in batches.items()}
            placed: dict[tuple[str, int, int], Any] = {}  # (task, dp rank, dp) -> that shard on the device
            tensors = {sid: _SliceTensors([None] * ls.num_inputs) for sid, ls in self.local.items()}
            early = self._post_receives(j, backward) if self.early_receives else {}
            posted: dict[tuple[int, int], PendingTransfer | None] = {}  # (transfer, direction) -> its receive
            for i, (wave, phase, task) in enumerate(steps):
                if segment_start is not None and i in self._segment_starts:
                    segment_start(self._segment_starts[i])
                t0 = time.perf_counter()
                ls = mine.get(wave)
                if ls is not None and task is not None and ls.slice.task != task:
                    ls = None
                into = [t for t in self._into_wave.get(wave, []) if task is None or t.consumer.task == task]
                out_of = [t for t in self._out_of_wave.get(wave, []) if task is None or t.producer.task == task]
                if phase == FWD:
                    where = "forward" if backward else "validation forward"
                    for t in into:
                        progress.point(where, wave, t)
                        self._receive_forward(t, tensors, posted.pop((t.index, 0)))
                    if ls is not None:
                        if before_forward is not None:
                            before_forward(ls)  # the overlapped weight all-gather (its own progress point)
                        progress.point(where, wave, ls)
                        with self._range("forward", ls):
                            self._forward_slice(ls, tensors[ls.slice.id], micro, placed)
                        if ls.terminal and ls.tp_leader:
                            v = tensors[ls.slice.id].output.detach().to(torch.float64)
                            losses[names.index(ls.slice.task)] += v / ls.slice.dp if ls.dp_loss_mean else v
                    for t in out_of:
                        posted[(t.index, 0)] = self._post_forward(t, tensors, j, early.pop((t.index, 0), None))
                    if j == self.micro_batches - 1 and i == last_forward:
                        work = dist.all_reduce(losses, async_op=True)  # in flight during the backward
                    if backward:
                        self._wave_done("forward", wave, t0)
                else:
                    for t in out_of:
                        progress.point("backward", wave, t)
                        self._receive_backward(t, tensors, posted.pop((t.index, 1)))
                    if ls is not None:
                        progress.point("backward", wave, ls)
                        with self._range("backward", ls):
                            self._backward_slice(ls, tensors[ls.slice.id])
                        slice_done(ls)
                    for t in into:
                        posted[(t.index, 1)] = self._post_backward(t, tensors, j, early.pop((t.index, 1), None))
                    self._wave_done("backward", wave, t0)
            if posted or early:
                raise RuntimeError(f"transfers {sorted(set(posted) | set(early))} were posted but never received")
            del tensors
        self._wait_sends()

        def result() -> dict[str, float]:
            progress.point("the per-task loss all-reduce (all ranks)")
            work.wait()
            return {n: float(losses[i]) for i, n in enumerate(names)}

        return result

    def _post_receives(self, micro: int, backward: bool) -> dict[tuple[int, int], PendingTransfer]:
        """(transfer, direction) -> this rank's receives from other ranks, posted now (``early_receives``)."""
        if self._remote_receives:
            progress.point("the receives posted when the micro-batch begins (from rank(s) "
                           f"{', '.join(map(str, self._receive_peers))})")
        return {(t.index, d): t.post_receives(d, self.rank, self.dtype, self.device, micro)
                for t, d in self._remote_receives if backward or d == 0}

    def _wait_sends(self) -> None:
        progress.point("the receivers of this step's activation and gradient sends")
        for w in self._pending_sends:  # sends this rank did not wait for (runtime/transfer.py)
            w.wait()
        self._pending_sends.clear()

    def _range(self, phase: str, ls: LocalSlice) -> AbstractContextManager:
        return slice_range(phase, ls.slice.id, self.device) if self.slice_ranges else nullcontext()

    def _wave_done(self, phase: str, wave: int, t0: float) -> None:
        if self.on_wave is not None:
            if self.sync_waves and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.on_wave(phase, wave, time.perf_counter() - t0)

    def _post_forward(self, t: TransferOp, tensors: dict[str, _SliceTensors], micro: int,
                      early: PendingTransfer | None) -> PendingTransfer | None:
        src = tensors.get(t.producer.id)
        return t.post_forward(self.rank, src.output.detach() if src is not None else None, self.dtype, self.device,
                              self._pending_sends, micro, early)

    def _receive_forward(self, t: TransferOp, tensors: dict[str, _SliceTensors],
                         pending: PendingTransfer | None) -> None:
        dst = tensors.get(t.consumer.id)
        if pending is not None:
            x = pending.result()
            if dst is not None:
                dst.inputs[t.input_index] = x.requires_grad_(torch.is_grad_enabled() and t.grad)

    def _forward_slice(self, ls: LocalSlice, st: _SliceTensors, batches: dict[str, Any],
                       placed: dict[tuple[str, int, int], Any]) -> None:
        s = ls.slice
        if any(x is None for x in st.inputs):
            raise RuntimeError(f"slice '{s.id}': inputs {[i for i, x in enumerate(st.inputs) if x is None]} "
                               f"were never received")
        key = (s.task, dp_rank(s, self.rank), s.dp)
        if key not in placed:  # once per micro-batch, not once per slice (each copy was the task's whole input)
            placed[key] = _to_device(batches[s.task].shard(key[1], s.dp), self.device)
        st.output = ls.op(list(st.inputs), placed[key])

    def _backward_slice(self, ls: LocalSlice, st: _SliceTensors) -> None:
        if ls.terminal:
            weight = self.loss_weights[ls.slice.task] * self.loss_scale
            grad = torch.full_like(st.output, weight / ls.slice.dp if ls.dp_loss_mean else weight)
        else:
            grad = st.out_grad
        if grad is not None and st.output.requires_grad:
            torch.autograd.backward([st.output], [grad])

    def _post_backward(self, t: TransferOp, tensors: dict[str, _SliceTensors], micro: int,
                       early: PendingTransfer | None) -> PendingTransfer | None:
        if not t.grad:
            return None
        dst = tensors.get(t.consumer.id)
        g = None
        if dst is not None:
            x = dst.inputs[t.input_index]
            g = x.grad if x.grad is not None else torch.zeros_like(x)
        return t.post_backward(self.rank, g, self.dtype, self.device, self._pending_sends, micro, early)

    def _receive_backward(self, t: TransferOp, tensors: dict[str, _SliceTensors],
                          pending: PendingTransfer | None) -> None:
        src = tensors.get(t.producer.id)
        if pending is not None:
            out = pending.result()
            if src is not None:
                src.out_grad = out if src.out_grad is None else src.out_grad + out


def micro_batch(batch: Any, index: int, micro_batches: int) -> Any:
    """Micro-batch ``index`` of a task's global batch (its ``micro(index, micro_batches)``; the batch itself when
    there is one)."""
    if micro_batches == 1:
        return batch
    split = getattr(batch, "micro", None)
    if split is None:
        raise TypeError(f"{type(batch).__name__} has no micro(index, micro_batches): the plan runs {micro_batches} "
                        f"micro-batches")
    return split(index, micro_batches)


def _to_device(batch: Any, device: torch.device) -> Any:
    """Move a batch's tensors (fields, or dicts of tensors) to the compute device; a no-op on the CPU.
    Non-blocking: asynchronous where the batch is in pinned memory (the data loader's ``pin_memory``)."""
    if device.type == "cpu":
        return batch
    if hasattr(batch, "to"):
        return batch.to(device, non_blocking=True)
    if dataclasses.is_dataclass(batch):
        changes = {}
        for f in dataclasses.fields(batch):
            v = getattr(batch, f.name)
            if isinstance(v, torch.Tensor):
                changes[f.name] = v.to(device, non_blocking=True)
            elif isinstance(v, dict) and any(isinstance(x, torch.Tensor) for x in v.values()):
                changes[f.name] = {k: x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x
                                   for k, x in v.items()}
        return dataclasses.replace(batch, **changes)
    return batch
