"""Inter-wave data flow: activations forward, their gradients backward (paper section 3.6, step 2).

One ``TransferOp`` per plan transfer. Each direction is posted once its data exists, on every rank the
direction involves, and waited on where the data is needed: the forward is posted right after the producer's
forward step and waited on at the consumer's, the backward posted right after the consumer's backward step and
waited on at the producer's. That is the simulator's transfer: it leaves when its sender finishes and delays
only the slice that needs it; sent at the consumer's step instead, a transfer made the sender reach the
consumer's wave first, and a gradient received there held the producer's rank at a wave where it had nothing
to wait for.

Posting is one ``dist.batch_isend_irecv`` batch holding every message this rank sends or receives for that
direction, in a deterministic order (sorted by (src, dst)), with a tag unique to the transfer, direction and
micro-batch (gloo matches on it); every rank posts at the same step of the schedule, in the same order, so the
two ends of each pair also issue their messages in the same order (NCCL matches on that). Local copies are
made when posting. A rank that only sends hands the batch's requests to the caller (``pending_sends``) and goes
on computing; the requests keep the send buffers alive until the caller waits on them (the engine does before
its gradient synchronisation). A rank that receives gets a ``PendingTransfer`` whose ``result`` waits for the
batch and assembles its shard.

Shapes are not exchanged: both ends derive them from the workload (``ActivationSpec``). The messages are
plan/routing.py's (island-aware: a local copy, else a holder on the receiver's node, else any holder), the same
ones the plan's bytes by route count; every ``TransferOp`` counts the bytes its rank receives per direction and
route (``received``), local copies included.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan.routing import Message, backward_messages, forward_messages
from megatron_spindle.plan.schema import TRANSFER_KINDS, MetaOpInfo, Slice
from megatron_spindle.runtime.layout import local_rows


@dataclass(frozen=True)
class ActivationSpec:
    """Shape of a MetaOp's output for ``batch`` samples; ``batch_dim`` is where samples are."""

    shape: tuple[int, ...]
    batch_dim: int


def default_activation_spec(workload: Workload, m: MetaOpInfo, batch: int) -> ActivationSpec:
    """The operator layout of models/operator.py: token sequences are batch first ``[batch, tokens, hidden]``;
    a contrastive head emits ``[batch, 1, embed_dim]``. Terminal ops (loss, lm_head) emit a loss and are never
    transferred."""
    mod = workload.modules[m.module] if m.module else None
    if m.kind in ("frontend", "layer"):
        return ActivationSpec((batch, m.input_shape[1], mod.hidden_size), 0)
    if m.kind == "projector":
        return ActivationSpec((batch, m.input_shape[1] // mod.pool, mod.hidden_size), 0)
    if m.kind == "head":
        return ActivationSpec((batch, 1, mod.embed_dim or mod.hidden_size), 0)
    raise ValueError(f"MetaOp '{m.id}' ({m.kind}) has no transferable output")


SpecFn = Callable[[Workload, MetaOpInfo, int], ActivationSpec]


def _shard_shape(spec: ActivationSpec, n: int) -> tuple[int, ...]:
    shape = list(spec.shape)
    shape[spec.batch_dim] = n
    return tuple(shape)


class PendingTransfer:
    """One direction of a transfer posted on a rank that receives: ``result`` waits for the batch's requests
    and assembles the rank's shard (local copies are in it already)."""

    def __init__(self, out: torch.Tensor, works: list, received: list[tuple[Message, torch.Tensor]], batch_dim: int):
        self.out, self.works, self.received, self.batch_dim = out, works, received, batch_dim

    def result(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        for m, buf in self.received:
            self.out.narrow(self.batch_dim, m.dst_start, m.n).copy_(buf)
        self.works, self.received = [], []
        return self.out


def post_messages(messages: list[Message], rank: int, src_tensor: torch.Tensor | None, dst_shape: tuple[int, ...],
                  batch_dim: int, tag: int, dtype: torch.dtype, device: torch.device, pending_sends: list,
                  group=None, received: dict[str, int] | None = None) -> PendingTransfer | None:
    """Post one direction of a transfer on this rank: ``src_tensor`` is this rank's local shard when it sends.
    Returns the pending receive when this rank receives (``None`` otherwise, its send requests appended to
    ``pending_sends``); with ``received`` the bytes this rank receives are added to it per route."""
    mine = sorted((m for m in messages if rank in (m.src, m.dst)), key=lambda m: (m.src, m.dst))
    receives = any(m.dst == rank for m in mine)
    out = torch.empty(dst_shape, dtype=dtype, device=device) if receives else None
    ops, incoming = [], []
    for m in mine:
        if m.src == rank and m.dst == rank:
            out.narrow(batch_dim, m.dst_start, m.n).copy_(src_tensor.narrow(batch_dim, m.src_start, m.n))
        elif m.src == rank:
            buf = src_tensor.narrow(batch_dim, m.src_start, m.n).contiguous()
            ops.append(dist.P2POp(dist.isend, buf, peer=m.dst, group=group, tag=tag))
        else:
            shape = list(dst_shape)
            shape[batch_dim] = m.n
            buf = torch.empty(shape, dtype=dtype, device=device)
            ops.append(dist.P2POp(dist.irecv, buf, peer=m.src, group=group, tag=tag))
            incoming.append((m, buf))
    # one batch, so NCCL may hand back a single request for all of it: a receiving rank waits on everything
    works = dist.batch_isend_irecv(ops) if ops else []
    if received is not None and out is not None:
        row_bytes = out.element_size() * out.numel() // max(1, out.shape[batch_dim])
        for m in mine:
            if m.dst == rank:
                received[m.route] += m.n * row_bytes
    if not receives:
        pending_sends.extend(works)
        return None
    return PendingTransfer(out, works, incoming, batch_dim)


class TransferOp:
    """A plan transfer between a producer and a consumer slice of one task, routed over islands of
    ``gpus_per_node`` devices; ``batch`` is what one run of the order moves (a micro-batch, B / m)."""

    def __init__(self, index: int, producer: Slice, consumer: Slice, spec_full: ActivationSpec, batch: int,
                 gpus_per_node: int, tag_stride: int = 0):
        self.index = index
        self.tag_stride = tag_stride  # tags per micro-batch: micro-batch j's messages are tagged apart
        self.producer = producer
        self.consumer = consumer
        self.batch = batch
        self.spec = spec_full
        self.fwd = forward_messages(producer, consumer, batch, gpus_per_node)
        self.bwd = backward_messages(producer, consumer, batch, gpus_per_node)
        # bytes this rank received, per direction and route (local copies included)
        self.received = {d: dict.fromkeys(TRANSFER_KINDS, 0) for d in ("forward", "backward")}

    def involves(self, rank: int) -> bool:
        return rank in self.producer.devices or rank in self.consumer.devices

    def _local_rows(self, s: Slice, rank: int) -> int:
        a, b = local_rows(s, rank, self.batch)
        return b - a

    def _tag(self, direction: int, micro: int) -> int:
        return 2 * (self.index + micro * self.tag_stride) + direction

    def post_forward(self, rank: int, output: torch.Tensor | None, dtype, device, pending_sends: list,
                     micro: int = 0) -> PendingTransfer | None:
        """Post producer output shard -> consumer input shard (received on consumer devices)."""
        if output is not None:
            expect = _shard_shape(self.spec, self._local_rows(self.producer, rank))
            if tuple(output.shape) != expect:
                raise RuntimeError(f"slice '{self.producer.id}' produced shape {tuple(output.shape)} but the "
                                   f"runtime expects {expect} (transfer to '{self.consumer.id}')")
        n = self._local_rows(self.consumer, rank) if rank in self.consumer.devices else 0
        return post_messages(self.fwd, rank, output, _shard_shape(self.spec, n), self.spec.batch_dim,
                             tag=self._tag(0, micro), dtype=dtype, device=device, pending_sends=pending_sends,
                             received=self.received["forward"])

    def post_backward(self, rank: int, input_grad: torch.Tensor | None, dtype, device, pending_sends: list,
                      micro: int = 0) -> PendingTransfer | None:
        """Post consumer input-gradient shard -> producer output-gradient shard (received on producer devices)."""
        n = self._local_rows(self.producer, rank) if rank in self.producer.devices else 0
        return post_messages(self.bwd, rank, input_grad, _shard_shape(self.spec, n), self.spec.batch_dim,
                             tag=self._tag(1, micro), dtype=dtype, device=device, pending_sends=pending_sends,
                             received=self.received["backward"])
