"""Timing one operator (forward and backward, on a real TP group) and the AdamW step."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from megatron_spindle.estimator.cost_model import OptimizerCost
from megatron_spindle.graph.opgraph import MetaOp
from megatron_spindle.graph.workload import Workload
from megatron_spindle.profiler.settings import ProfilerSettings
from megatron_spindle.profiler.world import ProfileWorld, median_seconds, warm_device
from megatron_spindle.runtime.optimizer import adamw_fused

OPTIMIZER_PROBE_ELEMENTS = 1 << 20  # one fp32 tensor: the per-element cost, where no units are given
OPTIMIZER_PROBE_MAX_ELEMENTS = 1 << 24  # the units' tensors timed for the per-element cost, in all
OPTIMIZER_PROBE_TENSORS = 64  # tiny tensors: the per-tensor cost


def _batch_for(workload: Workload, info, dp: int, device: torch.device, dtype: torch.dtype, seed: int):
    """The DP-rank-0 shard (B/dp rows) of the task's mock batch, on the device; float inputs in ``dtype``."""
    from megatron_spindle.data.mock import mock_batch

    batch = mock_batch(workload, info.task, 0, seed).shard(0, dp)

    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)

    return dataclasses.replace(batch, inputs={k: move(v) for k, v in batch.inputs.items()},
                               labels=None if batch.labels is None else move(batch.labels))


def _inputs_for(info, dp: int, device: torch.device, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Producer outputs of the right shapes for the local shard: one [b, S, X] tensor (a layer range given
    one input takes it as the whole sequence), two [b, 1, X] embeddings for a contrastive loss, none for a
    front end."""
    b, s, x = info.input_shape
    rows = b // dp
    gen = torch.Generator().manual_seed(seed)
    if info.kind == "frontend":
        return []
    shapes = [(rows, 1, x), (rows, 1, x)] if info.kind == "loss" else [(rows, s, x)]
    return [torch.randn(*shape, generator=gen).to(device=device, dtype=dtype) for shape in shapes]


class _Repeat:
    """One forward + backward of ``op`` as a training step runs it (``run``: the forward's and the whole repeat's
    seconds, device-synchronised). A scalar output (loss) is back-propagated directly, a tensor output with a fixed
    random output gradient; the gradients are dropped after each repeat."""

    def __init__(self, op: torch.nn.Module, inputs: list[torch.Tensor], batch, world: ProfileWorld,
                 grad: bool = True):
        self.op, self.inputs, self.batch, self.world = op, inputs, batch, world
        self.grad = grad  # the inputs need a gradient (False: a frozen module with nothing trainable upstream)
        self.out_grad: torch.Tensor | None = None

    def run(self) -> tuple[float, float]:
        self.world.sync()
        t0 = time.perf_counter()
        out = self.op([x.detach().requires_grad_(self.grad) for x in self.inputs], self.batch)
        self.world.sync()
        forward = time.perf_counter() - t0
        if out.requires_grad:  # else frozen weights and no input gradient: no backward, as in training
            self._backward(out)
        self.op.zero_grad(set_to_none=True)
        self.world.sync()
        return forward, time.perf_counter() - t0

    def _backward(self, out: torch.Tensor) -> None:
        if out.dim() == 0:
            out.backward()
            return
        if self.out_grad is None or self.out_grad.shape != out.shape:
            gen = torch.Generator().manual_seed(1)
            self.out_grad = torch.randn(out.shape, generator=gen).to(device=out.device, dtype=out.dtype)
        out.backward(self.out_grad)


def time_operator(op: torch.nn.Module, inputs: list[torch.Tensor], batch, world: ProfileWorld,
                  warmup: int, repeats: int, grad: bool = True) -> tuple[float, float]:
    """(median seconds of forward + backward, median seconds of the forward) of ``op`` over ``_Repeat``s. Both
    are timed in the same repeats, as a training step runs the phases: each forward records its autograd graph and
    follows the previous repeat's backward. How a step splits between the phases differs by device (on a CPU the
    forward's Python takes about half). A forward timed alone, repeated back to back, runs warmer than that: on
    tiny-clip's towers on a CPU it took 39-44 % of their time, where the runtime's steps and these repeats
    measure 50-56 %."""
    repeat = _Repeat(op, inputs, batch, world, grad)
    for _ in range(warmup):
        repeat.run()
    runs = [repeat.run() for _ in range(repeats)]
    return statistics.median(t for _, t in runs), statistics.median(f for f, _ in runs)


def _build(workload: Workload, info, layers: int, dp: int, world: ProfileWorld, settings: ProfilerSettings,
           pg_collection=None) -> tuple[torch.nn.Module, list[torch.Tensor], object]:
    """``layers`` layers of ``info``'s MetaOp on the device, its inputs and the task's batch for one DP rank of
    ``dp`` (``pg_collection``: its TP groups, None at TP 1)."""
    from megatron_spindle.compat.cpu import select_te_attention
    from megatron_spindle.models.config import ModelConfig
    from megatron_spindle.models.operator import build_operator

    select_te_attention(settings.attention_backend)
    cfg = ModelConfig(bf16=settings.bf16, init_seed=settings.seed, attention_backend=settings.attention_backend,
                      hidden_dropout=settings.hidden_dropout, attention_dropout=settings.attention_dropout)
    op = build_operator(workload, info, 0, layers, pg_collection=pg_collection, config=cfg)
    op = op.to(device=world.device, dtype=cfg.params_dtype)
    return (op, _inputs_for(info, dp, world.device, cfg.params_dtype, settings.seed),
            _batch_for(workload, info, dp, world.device, cfg.params_dtype, settings.seed))


def layer_chunk(workload: Workload, info, world: ProfileWorld, settings: ProfilerSettings) -> Callable[[], object]:
    """One layer of ``info``'s MetaOp at TP 1 on the whole batch, as a function that runs its forward and backward
    (the message-cost probe's chunk of compute: profiler/comm.py ``message_host_seconds``)."""
    return _Repeat(*_build(workload, info, 1, 1, world, settings), world).run


def time_sharded_copies(op: torch.nn.Module, dp: int, world: ProfileWorld, warmup: int,
                        repeats: int) -> tuple[float, float]:
    """(weights loaded, gradients staged): median seconds of ``op``'s host copies under ZeRO 1 and 2, done with the
    runtime's own code. Weights: per unit, the gathered flat vector unflattened and loaded into the operator
    (runtime/param_gather.py). Gradients: each unit's part on this TP rank (``export_grad_contributions``),
    flattened and added into member-major staging rows of ``dp`` members (runtime/grad_shards.py). Collective
    over the operator's TP group (the state's export gathers TP shards)."""
    from megatron_spindle.runtime.shards import UnitShard, add_to_rows

    state = op.export_full_state()
    dtype = next(op.parameters()).dtype
    shards = []
    for unit, module in op.unit_modules().items():
        keys = sorted(f"{unit}.{path}" for path, _ in module.named_parameters())
        shards.append(UnitShard(unit, keys, [state[k].shape for k in keys], dp, 0))
    flats = [sh.flatten(state).to(dtype) for sh in shards]  # gathered in the weights' dtype, as the runtime does
    rows = [torch.zeros(sh.members, sh.size, dtype=torch.float32, device=world.device) for sh in shards]
    for p in op.parameters():
        p.grad = torch.ones_like(p)

    def load():
        for sh, flat in zip(shards, flats):
            full = sh.unflatten(flat)
            op.load_full_state({k: full[k] for k in sh.keys}, strict=False)

    def stage():  # as runtime/grad_sync.py: each unit's part of this TP rank, added in turn
        for sh, row in zip(shards, rows):
            add_to_rows(row, 0, sh, op.export_grad_contributions([sh.unit]))

    seconds = (median_seconds(load, world, warmup, repeats), median_seconds(stage, world, warmup, repeats))
    op.zero_grad(set_to_none=True)
    return seconds


def measure_optimizer(world: ProfileWorld, settings: ProfilerSettings,
                      unit_numels: Sequence[int] = ()) -> OptimizerCost:
    """Seconds of torch.optim.AdamW (the implementation the runtime engine steps its masters with on the device,
    runtime/optimizer.py ``adamw_fused``) per element and per tensor, and per element the step's other passes as the
    runtime makes them: the gradient norm (runtime/clip.py: one multi-tensor norm accumulating in fp64) and, with
    ``settings.bf16``, the bf16 weights written from the masters (one multi-tensor copy). Per tensor from
    ``OPTIMIZER_PROBE_TENSORS`` tensors of 16 elements; per element from tensors of ``unit_numels`` elements, the
    workload's parameter units (the runtime steps one flat fp32 master per unit), the largest first up to
    ``OPTIMIZER_PROBE_MAX_ELEMENTS`` in all, or one tensor of ``OPTIMIZER_PROBE_ELEMENTS`` without them. The CPU's
    (unfused) AdamW makes about ten passes over each tensor, so its cost per element depends on whether a tensor
    stays in cache between them: on a CPU core 5 ns per element over one tensor of 1M elements, against an engine
    step of tiny-clip's 18 units (328K elements) in 0.64 ms, which that rate put at 1.9 ms. Every rank measures at
    once (as every rank steps at once in training); max-reduced over the ranks. Collective."""

    def timed(fn: Callable[[], object]) -> float:
        return median_seconds(fn, world, max(1, settings.warmup), settings.repeats)

    def seconds(tensors: list[torch.Tensor]) -> float:
        params = [torch.nn.Parameter(t) for t in tensors]
        for p in params:
            p.grad = torch.randn_like(p)
        return timed(torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=adamw_fused(world.device)).step)

    def weight_seconds(masters: list[torch.Tensor]) -> float:
        weights = [m.to(torch.bfloat16) for m in masters]
        return timed(lambda: torch._foreach_copy_(weights, masters))

    gen = torch.Generator().manual_seed(settings.seed)
    sizes = probe_sizes(unit_numels)
    tensors = [torch.randn(n, generator=gen).to(world.device) for n in sizes]
    big = seconds(tensors)
    small = seconds([torch.randn(16, generator=gen).to(world.device) for _ in range(OPTIMIZER_PROBE_TENSORS)])
    norm = timed(lambda: torch._foreach_norm(tensors, 2, dtype=torch.float64))
    weights = weight_seconds(tensors) if settings.bf16 else 0.0
    big, small, norm, weights = world.all_max([big, small, norm, weights])
    per_tensor = small / OPTIMIZER_PROBE_TENSORS
    per_element = max(0.0, big - len(sizes) * per_tensor) / sum(sizes)
    return OptimizerCost(per_element, per_tensor, "measured", norm / sum(sizes), weights / sum(sizes))


def probe_sizes(unit_numels: Sequence[int]) -> list[int]:
    """The tensor sizes ``measure_optimizer`` times per element: the units' sizes, largest first, while their sum
    stays within ``OPTIMIZER_PROBE_MAX_ELEMENTS`` (at least one, capped to it); one tensor of
    ``OPTIMIZER_PROBE_ELEMENTS`` without units."""
    sizes = sorted((n for n in unit_numels if n > 0), reverse=True)
    if not sizes:
        return [OPTIMIZER_PROBE_ELEMENTS]
    out = [min(sizes[0], OPTIMIZER_PROBE_MAX_ELEMENTS)]
    for n in sizes[1:]:
        if sum(out) + n > OPTIMIZER_PROBE_MAX_ELEMENTS:
            break
        out.append(n)
    return out


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def measure_config(workload: Workload, info, metaop: MetaOp, tp: int, dp: int, world: ProfileWorld,
                   settings: ProfilerSettings) -> tuple[float, float, int, int, float, float]:
    """(compute seconds per operator, its forward's seconds, gradient elements per operator on one TP rank,
    operators timed, and per operator the sharded runtime's weight loads and gradient staging,
    ``time_sharded_copies``) of one config; seconds is inf when a rank ran out of memory. Collective over the
    world."""
    from megatron_spindle.compat.groups import make_pg_collection

    layers = min(info.num_layers, settings.layers) if info.kind == "layer" else 1
    tp_group, member = world.tp_group(tp) if tp > 1 else (None, True)
    seconds, forward, numel, load, stage = 0.0, 0.0, 0, 0.0, 0.0
    if member:
        op = None
        try:
            pgs = make_pg_collection(tp_group) if tp > 1 else None
            op, inputs, batch = _build(workload, info, layers, dp, world, settings, pgs)
            warm_device(world)
            seconds, forward = (t / layers for t in time_operator(op, inputs, batch, world, settings.warmup,
                                                                   settings.repeats, metaop.backward != "none"))
            numel = sum(p.numel() for p in op.parameters() if p.requires_grad) // layers
            if numel:  # an operator with weights
                load, stage = (t / layers for t in time_sharded_copies(op, dp, world, settings.warmup,
                                                                       settings.repeats))
        except RuntimeError as e:
            if not _is_oom(e):
                raise
            seconds = math.inf
        finally:
            del op
            if world.device.type == "cuda":
                torch.cuda.empty_cache()
    seconds, forward, numel, load, stage = world.all_max([seconds, forward, numel, load, stage])
    return seconds, forward, int(numel), layers, load, stage
