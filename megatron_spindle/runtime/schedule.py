"""The wave schedule of one step (paper section 3.6, steps 2 and 4): forward wave by wave (transfers into a
wave, then this rank's slice of it), the per-task loss all-reduce, then the backward in reverse wave order
(this rank's slice, then the gradients of the transfers into that wave back to their producers).

Nothing in it is a barrier: the loss all-reduce runs during the backward, and a rank that only sends in a
transfer does not wait for the receiver (its requests are waited on at the end; runtime/transfer.py). After
each local slice's backward the schedule calls ``slice_done(slice)`` (the gradient sync's cue), and after the
forward and the backward part of each wave ``on_wave(phase, wave_index, seconds)``. ``evaluate`` runs the
forward waves alone (validation: no autograd graph, no backward, no ``on_wave``). Before each step that may
wait for another rank it records ``progress.point`` (what the watchdog names when a peer is missing).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan.schema import Plan
from megatron_spindle.runtime import progress
from megatron_spindle.runtime.layout import dp_rank, transfer_input_index
from megatron_spindle.runtime.slices import LocalSlice
from megatron_spindle.runtime.transfer import SpecFn, TransferOp


def build_transfers(plan: Plan, workload: Workload, spec_fn: SpecFn, wave_index: dict[str, int]) -> list[TransferOp]:
    """Plan transfers in execution order: by consumer wave, then plan order (the same on every rank)."""
    order = sorted(range(len(plan.transfers)), key=lambda i: (wave_index[plan.transfers[i].consumer], i))
    ops = []
    for i in order:
        t = plan.transfers[i]
        p, c = plan.slice(t.producer), plan.slice(t.consumer)
        info = plan.metaop(p.metaop)
        batch = info.input_shape[0]
        op = TransferOp(i, p, c, spec_fn(workload, info, batch), batch, plan.gpus_per_node)
        op.input_index = transfer_input_index(plan, t)
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
    loss scale the backward starts from; 1 otherwise) and ``on_wave`` may be changed between steps."""

    def __init__(self, plan: Plan, workload: Workload, rank: int, local: dict[str, LocalSlice], spec_fn: SpecFn,
                 loss_weights: dict[str, float], dtype: torch.dtype, device: torch.device,
                 on_wave: Callable[[str, int, float], None] | None = None):
        self.plan, self.workload, self.rank, self.local = plan, workload, rank, local
        self.loss_weights, self.dtype, self.device, self.on_wave = loss_weights, dtype, device, on_wave
        wave_index = {s.id: wi for wi, w in enumerate(plan.waves) for s in w.slices}
        self.transfers = build_transfers(plan, workload, spec_fn, wave_index)
        self._into_wave: dict[int, list[TransferOp]] = {}
        for t in self.transfers:
            self._into_wave.setdefault(wave_index[t.consumer.id], []).append(t)
        self._slice_of_wave = {ls.wave: ls for ls in local.values()}
        self._pending_sends: list = []
        self.loss_scale = 1.0

    def run(self, batches: dict[str, Any], slice_done: Callable[[LocalSlice], None]) -> Callable[[], dict[str, float]]:
        """Forward and backward of one step; returns a function that waits for and reads the task losses."""
        mine = self._slice_of_wave
        tensors = self._forward(batches, timed=True)
        losses = self._reduce_losses(tensors)  # in flight during the backward
        for wi in reversed(range(len(self.plan.waves))):
            t0 = time.perf_counter()
            if wi in mine:
                progress.point("backward", wi, mine[wi])
                self._backward_slice(mine[wi], tensors[mine[wi].slice.id])
                slice_done(mine[wi])
            for t in self._into_wave.get(wi, []):
                progress.point("backward", wi, t)
                self._backward_transfer(t, tensors)
            self._wave_done("backward", wi, t0)
        self._wait_sends()
        return losses

    def evaluate(self, batches: dict[str, Any]) -> Callable[[], dict[str, float]]:
        """The forward waves alone (call under ``torch.no_grad()``); returns the task-loss reader like ``run``."""
        tensors = self._forward(batches, timed=False)
        losses = self._reduce_losses(tensors)
        self._wait_sends()
        return losses

    def _forward(self, batches: dict[str, Any], timed: bool) -> dict[str, _SliceTensors]:
        """The forward waves; ``timed``: a training step (reports ``on_wave``), else validation (the progress
        points say so)."""
        mine = self._slice_of_wave
        phase = "forward" if timed else "validation forward"
        tensors = {sid: _SliceTensors([None] * ls.num_inputs) for sid, ls in self.local.items()}
        for wi in range(len(self.plan.waves)):
            t0 = time.perf_counter()
            for t in self._into_wave.get(wi, []):
                progress.point(phase, wi, t)
                self._forward_transfer(t, tensors)
            if wi in mine:
                progress.point(phase, wi, mine[wi])
                self._forward_slice(mine[wi], tensors[mine[wi].slice.id], batches)
            if timed:
                self._wave_done("forward", wi, t0)
        return tensors

    def _wait_sends(self) -> None:
        progress.point("the receivers of this step's activation and gradient sends")
        for w in self._pending_sends:  # sends this rank did not wait for (runtime/transfer.py)
            w.wait()
        self._pending_sends.clear()

    def _wave_done(self, phase: str, wave: int, t0: float) -> None:
        if self.on_wave is not None:
            self.on_wave(phase, wave, time.perf_counter() - t0)

    def _forward_transfer(self, t: TransferOp, tensors: dict[str, _SliceTensors]) -> None:
        if not t.involves(self.rank):
            return
        src = tensors.get(t.producer.id)
        x = t.forward(self.rank, src.output.detach() if src is not None else None, self.dtype, self.device,
                      self._pending_sends)
        dst = tensors.get(t.consumer.id)
        if dst is not None:
            dst.inputs[t.input_index] = x.requires_grad_(torch.is_grad_enabled())

    def _forward_slice(self, ls: LocalSlice, st: _SliceTensors, batches: dict[str, Any]) -> None:
        s = ls.slice
        if any(x is None for x in st.inputs):
            raise RuntimeError(f"slice '{s.id}': inputs {[i for i, x in enumerate(st.inputs) if x is None]} "
                               f"were never received")
        batch = _to_device(batches[s.task].shard(dp_rank(s, self.rank), s.dp), self.device)
        st.output = ls.op(list(st.inputs), batch)

    def _reduce_losses(self, tensors: dict[str, _SliceTensors]) -> Callable[[], dict[str, float]]:
        """Start the all-reduce of the per-task losses; the returned function waits for it and reads them.
        Asynchronous, so that no rank waits for the slowest one's forward before starting its backward."""
        names = [t.name for t in self.workload.tasks]
        vec = torch.zeros(len(names), dtype=torch.float64, device=self.device)
        for sid, ls in self.local.items():
            if ls.terminal and ls.tp_leader:
                v = tensors[sid].output.detach().to(torch.float64)
                vec[names.index(ls.slice.task)] += v / ls.slice.dp if ls.dp_loss_mean else v
        work = dist.all_reduce(vec, async_op=True)

        def result() -> dict[str, float]:
            progress.point("the per-task loss all-reduce (all ranks)")
            work.wait()
            return {n: float(vec[i]) for i, n in enumerate(names)}

        return result

    def _backward_slice(self, ls: LocalSlice, st: _SliceTensors) -> None:
        if ls.terminal:
            weight = self.loss_weights[ls.slice.task] * self.loss_scale
            grad = torch.full_like(st.output, weight / ls.slice.dp if ls.dp_loss_mean else weight)
        else:
            grad = st.out_grad
        if grad is not None and st.output.requires_grad:
            torch.autograd.backward([st.output], [grad])

    def _backward_transfer(self, t: TransferOp, tensors: dict[str, _SliceTensors]) -> None:
        if not t.involves(self.rank):
            return
        dst = tensors.get(t.consumer.id)
        g = None
        if dst is not None:
            x = dst.inputs[t.input_index]
            g = x.grad if x.grad is not None else torch.zeros_like(x)
        out = t.backward(self.rank, g, self.dtype, self.device, self._pending_sends)
        src = tensors.get(t.producer.id)
        if src is not None:
            src.out_grad = out if src.out_grad is None else src.out_grad + out


def _to_device(batch: Any, device: torch.device) -> Any:
    """Move a batch's tensors (fields, or dicts of tensors) to the compute device; a no-op on the CPU."""
    if device.type == "cpu":
        return batch
    if hasattr(batch, "to"):
        return batch.to(device)
    if dataclasses.is_dataclass(batch):
        changes = {}
        for f in dataclasses.fields(batch):
            v = getattr(batch, f.name)
            if isinstance(v, torch.Tensor):
                changes[f.name] = v.to(device)
            elif isinstance(v, dict) and any(isinstance(x, torch.Tensor) for x in v.values()):
                changes[f.name] = {k: x.to(device) if isinstance(x, torch.Tensor) else x for k, x in v.items()}
        return dataclasses.replace(batch, **changes)
    return batch
