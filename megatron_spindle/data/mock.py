"""Deterministic mock batches for every task of a workload (the CPU runs and the equivalence tests use them).

A ``TaskBatch`` holds the raw inputs of a task's front ends, keyed by module name:

- ``patch`` front end: images ``[B, in_channels, S, S]`` (float), S = image_size, or the smaller side of the
  task's tokens (``FrontendSpec.image_side``)
- ``audio`` front end: spectrograms ``[B, in_channels (mel bins), tokens * patch_size (frames)]`` (float)
- ``imu`` front end: sensor windows ``[B, in_channels, tokens * patch_size (samples)]`` (float)
- ``text`` front end: token ids ``[B, T]`` (int64), T = the module's own text tokens

and, for an LM loss, ``labels`` ``[B, T]``: the next text token of every text position of the loss module
(``ignore_index`` = -100 marks positions without a label). ``num_label_tokens`` counts the labelled tokens of the
whole global batch and is kept by ``shard``, so a shard can normalise its LM loss by the global count.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from collections.abc import Collection
from dataclasses import dataclass, field, replace

import torch

from megatron_spindle.graph.workload import Workload, output_tokens
from megatron_spindle.plan.layout import dp_rows

IGNORE_INDEX = -100


@dataclass
class TaskBatch:
    task: str
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # module -> raw front-end input, batch first
    labels: torch.Tensor | None = None  # [B, T] next-token ids of the LM loss module's text, or None
    global_batch_size: int = 0
    num_label_tokens: int = 0  # labelled tokens in the GLOBAL batch (LM loss normaliser); -1: not known here
    dp_rank: int = 0
    dp: int = 1
    micro_batches: int = 1  # the iteration's batch was split into this many micro-batches (see micro())
    # a rank reads only the rows its slices process (data/datasets.py read_batch): the global rows, ascending,
    # an input (by module) or the labels hold where they hold fewer than the batch's; absent: every row
    rows: dict[str, tuple[int, ...]] = field(default_factory=dict)
    label_rows: tuple[int, ...] | None = None

    @property
    def batch_size(self) -> int:
        """Rows held by this (possibly sharded) batch."""
        return self.global_batch_size // self.dp

    def to(self, device, non_blocking: bool = False) -> TaskBatch:
        """The same batch with its tensors on ``device`` (``non_blocking``: asynchronous from pinned memory)."""
        return self._with_tensors(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> TaskBatch:
        """The same batch in page-locked host memory: its copies to a GPU (and its shards' and micro-batches',
        which are views) can then run asynchronously."""
        return self._with_tensors(torch.Tensor.pin_memory)

    def _with_tensors(self, fn) -> TaskBatch:
        """The same batch with ``fn`` applied to each of its tensors (inputs and labels)."""
        return replace(self, inputs={m: fn(t) for m, t in self.inputs.items()},
                       labels=None if self.labels is None else fn(self.labels))

    def micro(self, index: int, micro_batches: int) -> TaskBatch:
        """Micro-batch ``index`` of ``micro_batches``: rows ``[j*B/m, (j+1)*B/m)`` of the global batch, itself a
        global batch of B/m rows (``shard`` splits it over DP ranks). It keeps the global ``num_label_tokens``
        (an LM loss share stays a share of the whole iteration's token mean) and records ``micro_batches``
        (a contrastive loss over the micro-batch counts 1/m). Of a field held in part it keeps the rows held."""
        if self.dp != 1 or self.micro_batches != 1:
            raise ValueError(f"task '{self.task}': micro() takes the whole global batch")
        if micro_batches <= 0 or self.global_batch_size % micro_batches:
            raise ValueError(f"task '{self.task}': {micro_batches} micro-batches do not divide the batch of "
                             f"{self.global_batch_size}")
        if not 0 <= index < micro_batches:
            raise ValueError(f"task '{self.task}': micro-batch {index} out of range for {micro_batches}")
        lo, hi = dp_rows(index, micro_batches, self.global_batch_size)
        inputs, rows = {}, {}
        for m, t in self.inputs.items():
            inputs[m], held = _rows_of(t, self.rows.get(m), lo, hi)
            if held is not None:
                rows[m] = held
        labels, label_rows = (None, None) if self.labels is None else _rows_of(self.labels, self.label_rows, lo, hi)
        return replace(self, inputs=inputs, labels=labels, global_batch_size=hi - lo, micro_batches=micro_batches,
                       rows=rows, label_rows=label_rows)

    def shard(self, dp_rank: int, dp: int) -> TaskBatch:
        """Rows ``[k*B/dp, (k+1)*B/dp)`` of the global batch for data-parallel rank k (of a full batch). A field
        held in part is in the shard only where it holds all of the shard's rows."""
        if self.dp != 1:
            raise ValueError(f"task '{self.task}': shard() takes the full global batch, this is shard {self.dp_rank}/{self.dp}")
        if dp <= 0 or self.global_batch_size % dp:
            raise ValueError(f"task '{self.task}': dp={dp} does not divide the batch of {self.global_batch_size}")
        if not 0 <= dp_rank < dp:
            raise ValueError(f"task '{self.task}': dp_rank {dp_rank} out of range for dp={dp}")
        lo, hi = dp_rows(dp_rank, dp, self.global_batch_size)
        inputs = {}
        for m, t in self.inputs.items():
            x, held = _rows_of(t, self.rows.get(m), lo, hi)
            if held is None:
                inputs[m] = x
        labels = None
        if self.labels is not None:
            x, held = _rows_of(self.labels, self.label_rows, lo, hi)
            labels = x if held is None else None
        return replace(self, inputs=inputs, labels=labels, dp_rank=dp_rank, dp=dp, rows={}, label_rows=None)


def _rows_of(t: torch.Tensor, held: tuple[int, ...] | None, lo: int, hi: int) -> tuple[torch.Tensor, tuple | None]:
    """(the part of ``t`` that is rows ``[lo, hi)`` of the batch, the rows it holds relative to ``lo``: None when
    all of them). ``held``: the batch rows ``t`` holds (ascending), None for every row."""
    if held is None:
        return t[lo:hi], None
    a, b = bisect_left(held, lo), bisect_left(held, hi)
    return t[a:b], (None if b - a == hi - lo else tuple(r - lo for r in held[a:b]))


def own_text_tokens(workload: Workload, task: str, module: str) -> int:
    """Tokens per sample that ``module``'s own front end makes in ``task`` (its input minus incoming flows)."""
    t = workload.task(task)
    return t.tokens[module] - sum(output_tokens(workload, t, p) for p in t.predecessors(module))


def _generator(task: str, step: int, seed: int, module: str) -> torch.Generator:
    digest = hashlib.sha256(f"mock/{seed}/{task}/{step}/{module}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _frontend_input(workload: Workload, task: str, module: str, batch: int, gen: torch.Generator) -> torch.Tensor:
    fe = workload.modules[module].frontend
    own = own_text_tokens(workload, task, module)
    if fe.type == "patch":
        side = fe.image_side(own)  # the task's resolution (workload.py checks that one exists)
        return torch.randn(batch, fe.in_channels, side, side, generator=gen)
    if fe.type in ("audio", "imu"):
        return torch.randn(batch, fe.in_channels, own * fe.patch_size, generator=gen)
    return torch.randint(0, fe.vocab_size, (batch, own), generator=gen)


def mock_batch(workload: Workload, task_name: str, step: int, seed: int = 0,
               modules: Collection[str] | None = None) -> TaskBatch:
    """The full global batch of ``task_name`` at ``step``: a deterministic function of (task, step, seed); of
    ``modules`` alone when given (each module's data is its own random stream, so the same as in the full
    batch)."""
    task = workload.task(task_name)
    B = task.batch_size
    batch = TaskBatch(task=task_name, global_batch_size=B)
    lm_module = task.loss.modules[0] if task.loss is not None and task.loss.kind == "lm" else None
    for module in task.topo_modules():
        spec = workload.modules[module]
        if spec.frontend is None or own_text_tokens(workload, task_name, module) <= 0:
            continue
        if modules is not None and module not in modules:
            continue
        gen = _generator(task_name, step, seed, module)
        if module == lm_module and spec.frontend.type == "text":
            own = own_text_tokens(workload, task_name, module)
            text = torch.randint(0, spec.frontend.vocab_size, (B, own + 1), generator=gen)
            batch.inputs[module] = text[:, :own].contiguous()
            batch.labels = text[:, 1:].contiguous()
            batch.num_label_tokens = int((batch.labels != IGNORE_INDEX).sum())
        else:
            batch.inputs[module] = _frontend_input(workload, task_name, module, B, gen)
    return batch
