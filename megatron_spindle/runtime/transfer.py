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
made when posting; where a rank hands its whole shard to itself (a transfer between slices on the same devices
with the same layout) the consumer reads the producer's tensor instead, detached, with no copy. A rank that
only sends hands the batch's requests to the caller (``pending_sends``) and goes on computing; the requests keep
the send buffers alive until the caller waits on them (the engine does before its gradient synchronisation). A
rank that receives gets a ``PendingTransfer`` whose ``result`` waits for the batch and assembles its shard; it
holds the receive buffers from the post on, so an activation that skips waves occupies its consumer's devices
from the producer's step (plan/memory.py counts it from the consumer's forward).

On gloo every receive of a step is posted when the step (micro-batch) begins (``receives_early``), before
any of its data is sent: a gloo message whose receive is posted after the data has arrived costs both ranks
about 0.2 ms more (measured with 16 small messages between chunks of compute: 8.3-9.2 ms against 5.5 ms posted
first), on the same core as their compute. Sends and local copies still happen when the data exists; the receive
buffers are held from the micro-batch's start (host memory, which plan/memory.py does not count). NCCL
receives are posted with the sends, as above: a receive posted early would hold NCCL's stream for the pair.

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


def _whole_shard(m: Message, rank: int, src: torch.Tensor | None, dst_shape: tuple[int, ...], batch_dim: int,
                 dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``m`` is a local copy of this rank's whole shard into a shard of the same shape and type."""
    return (src is not None and m.src == rank == m.dst and m.src_start == 0 and m.dst_start == 0
            and tuple(src.shape) == tuple(dst_shape) and m.n == dst_shape[batch_dim]
            and src.dtype == dtype and src.device == torch.device(device))


def receives_early(backend: str) -> bool:
    """Whether a backend's receives are posted when the step begins (gloo; module docstring)."""
    return backend == "gloo"


def _remote_incoming(messages: list[Message], rank: int) -> list[Message]:
    return [m for m in messages if m.dst == rank and m.src != rank]


def _receive(m: Message, dst_shape: tuple[int, ...], batch_dim: int, tag: int, dtype: torch.dtype,
             device: torch.device, group) -> tuple[dist.P2POp, torch.Tensor]:
    """The receive of one message from another rank into a buffer of its rows."""
    shape = list(dst_shape)
    shape[batch_dim] = m.n
    buf = torch.empty(shape, dtype=dtype, device=device)
    return dist.P2POp(dist.irecv, buf, peer=m.src, group=group, tag=tag), buf


def post_receives(messages: list[Message], rank: int, dst_shape: tuple[int, ...], batch_dim: int, tag: int,
                  dtype: torch.dtype, device: torch.device, group=None) -> PendingTransfer | None:
    """Post only the receives from other ranks of one direction (``messages`` as for ``post_messages``, which
    then takes the result as ``early``); ``None`` when this rank receives nothing from another rank."""
    remote = _remote_incoming(messages, rank)
    if not remote:
        return None
    received = [_receive(m, dst_shape, batch_dim, tag, dtype, device, group) for m in remote]
    return PendingTransfer(torch.empty(dst_shape, dtype=dtype, device=device),
                           dist.batch_isend_irecv([op for op, _ in received]),
                           [(m, buf) for m, (_, buf) in zip(remote, received)], batch_dim)


def post_messages(messages: list[Message], rank: int, src_tensor: torch.Tensor | None, dst_shape: tuple[int, ...],
                  batch_dim: int, tag: int, dtype: torch.dtype, device: torch.device, pending_sends: list,
                  group=None, received: dict[str, int] | None = None,
                  early: PendingTransfer | None = None) -> PendingTransfer | None:
    """Post one direction of a transfer on this rank: ``messages`` are this rank's (those it sends or receives),
    in the same order on every rank; ``src_tensor`` is this rank's local shard when it sends; ``early``: its
    receives from other ranks, posted already (``post_receives``).
    Returns the pending receive when this rank receives (``None`` otherwise, its send requests appended to
    ``pending_sends``); with ``received`` the bytes this rank receives are added to it per route."""
    receives = any(m.dst == rank for m in messages)
    if early is None and len(messages) == 1 and \
            _whole_shard(messages[0], rank, src_tensor, dst_shape, batch_dim, dtype, device):
        # this rank hands its whole shard to itself: the consumer reads the producer's tensor (a detached view;
        # autograd keeps the two sides apart), no copy
        if received is not None:
            received[messages[0].route] += src_tensor.numel() * src_tensor.element_size()
        return PendingTransfer(src_tensor, [], [], batch_dim)
    if early is not None:
        out = early.out
    else:
        out = torch.empty(dst_shape, dtype=dtype, device=device) if receives else None
    ops, incoming = [], []
    for m in messages:
        if m.src == rank and m.dst == rank:
            out.narrow(batch_dim, m.dst_start, m.n).copy_(src_tensor.narrow(batch_dim, m.src_start, m.n))
        elif early is not None and m.dst == rank:
            continue  # posted when the step began
        elif m.src == rank:
            buf = src_tensor.narrow(batch_dim, m.src_start, m.n).contiguous()
            ops.append(dist.P2POp(dist.isend, buf, peer=m.dst, group=group, tag=tag))
        else:
            op, buf = _receive(m, dst_shape, batch_dim, tag, dtype, device, group)
            ops.append(op)
            incoming.append((m, buf))
    # one batch, so NCCL may hand back a single request for all of it: a receiving rank waits on everything
    works = dist.batch_isend_irecv(ops) if ops else []
    if received is not None and out is not None:
        row_bytes = out.element_size() * out.numel() // max(1, out.shape[batch_dim])
        for m in messages:
            if m.dst == rank:
                received[m.route] += m.n * row_bytes
    if not receives:
        pending_sends.extend(works)
        return None
    if early is not None:
        early.works.extend(works)
        return early
    return PendingTransfer(out, works, incoming, batch_dim)


class TransferOp:
    """A plan transfer between a producer and a consumer slice of one task, routed over islands of
    ``gpus_per_node`` devices; ``batch`` is what one run of the order moves (a micro-batch, B / m)."""

    def __init__(self, index: int, producer: Slice, consumer: Slice, spec_full: ActivationSpec, batch: int,
                 gpus_per_node: int, tag_stride: int = 0):
        self.index = index
        self.tag_stride = tag_stride  # tags per micro-batch: micro-batch j's messages are tagged apart
        self.grad = True  # a gradient goes back (False: the producer's output needs none; runtime/schedule.py)
        self.producer = producer
        self.consumer = consumer
        self.batch = batch
        self.spec = spec_full
        self.fwd = forward_messages(producer, consumer, batch, gpus_per_node)
        self.bwd = backward_messages(producer, consumer, batch, gpus_per_node)
        # bytes this rank received, per direction and route (local copies included)
        self.received = {d: dict.fromkeys(TRANSFER_KINDS, 0) for d in ("forward", "backward")}
        self._shards: dict[tuple[str, int], tuple[int, ...]] = {}
        self._messages_of: dict[tuple[int, int], list[Message]] = {}

    def involves(self, rank: int) -> bool:
        return rank in self.producer.devices or rank in self.consumer.devices

    def _shard(self, s: Slice, rank: int) -> tuple[int, ...]:
        """This rank's shard shape of the slice's side of the transfer (no rows where it is not a member)."""
        key = (s.id, rank)
        shape = self._shards.get(key)
        if shape is None:
            n = 0
            if rank in s.devices:
                a, b = local_rows(s, rank, self.batch)
                n = b - a
            shape = self._shards[key] = _shard_shape(self.spec, n)
        return shape

    def _mine(self, direction: int, rank: int) -> list[Message]:
        """This rank's messages of one direction, in posting order (sorted by (src, dst))."""
        key = (direction, rank)
        if key not in self._messages_of:
            messages = self.bwd if direction else self.fwd
            self._messages_of[key] = sorted((m for m in messages if rank in (m.src, m.dst)),
                                            key=lambda m: (m.src, m.dst))
        return self._messages_of[key]

    def _tag(self, direction: int, micro: int) -> int:
        return 2 * (self.index + micro * self.tag_stride) + direction

    def _receiver(self, direction: int) -> Slice:
        return self.producer if direction else self.consumer

    def remote_incoming(self, direction: int, rank: int) -> list[Message]:
        """The messages this rank receives from other ranks in one direction (0: forward, 1: backward)."""
        return _remote_incoming(self._mine(direction, rank), rank)

    def post_receives(self, direction: int, rank: int, dtype, device, micro: int = 0) -> PendingTransfer | None:
        """Post this rank's receives from other ranks of one direction (0: forward, 1: backward) ahead of its
        ``post_forward`` / ``post_backward``, which then take the result as ``early``."""
        return post_receives(self._mine(direction, rank), rank, self._shard(self._receiver(direction), rank),
                             self.spec.batch_dim, tag=self._tag(direction, micro), dtype=dtype, device=device)

    def post_forward(self, rank: int, output: torch.Tensor | None, dtype, device, pending_sends: list,
                     micro: int = 0, early: PendingTransfer | None = None) -> PendingTransfer | None:
        """Post producer output shard -> consumer input shard (received on consumer devices)."""
        if output is not None and tuple(output.shape) != self._shard(self.producer, rank):
            raise RuntimeError(f"slice '{self.producer.id}' produced shape {tuple(output.shape)} but the runtime "
                               f"expects {self._shard(self.producer, rank)} (transfer to '{self.consumer.id}')")
        return post_messages(self._mine(0, rank), rank, output, self._shard(self.consumer, rank), self.spec.batch_dim,
                             tag=self._tag(0, micro), dtype=dtype, device=device, pending_sends=pending_sends,
                             received=self.received["forward"], early=early)

    def post_backward(self, rank: int, input_grad: torch.Tensor | None, dtype, device, pending_sends: list,
                      micro: int = 0, early: PendingTransfer | None = None) -> PendingTransfer | None:
        """Post consumer input-gradient shard -> producer output-gradient shard (received on producer devices)."""
        return post_messages(self._mine(1, rank), rank, input_grad, self._shard(self.producer, rank),
                             self.spec.batch_dim, tag=self._tag(1, micro), dtype=dtype, device=device,
                             pending_sends=pending_sends, received=self.received["backward"], early=early)
