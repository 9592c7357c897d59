"""The Spindle runtime engine: executes a Plan on torch.distributed (paper section 3.6, Fig. 7).

1. Localization: each rank builds only the slices it runs, and only their parameters (selective storage).
2. Intra-task data dependency: ``TransferOp`` moves activations between waves and gradients back.
3. Inter-task model dependency: one process group per parameter device group; a unit's gradient is summed
   over every slice that uses it, whatever its device set, wave or TP degree.
4. Training step: forward wave by wave, backward in reverse wave order, gradient sync, optimizer step.

Operator contract (models/``build_operator``; tests may pass stand-ins with the same interface):
``factory(workload, metaop_info, layer_start, layer_end, pg_collection=..., dp_group=...)`` returns a
``torch.nn.Module`` with ``forward(inputs, batch) -> Tensor`` on the local DP shard, ``inputs`` ordered as the
MetaOp's ``preds`` (a continuation slice gets the previous slice's output as its only input; a front end gets
none), ``export_full_state() -> {"<unit>.<path>": full tensor}`` (TP-unsharded, canonical: independent of the
TP degree; collective over the TP group), and ``load_full_state(dict)``. A terminal operator (loss, lm_head)
returns its task's loss as a scalar whose sum over the slice's DP ranks is the task loss (set the attribute
``dp_loss_reduction = "mean"`` if instead every DP rank returns a loss whose DP-mean is the task loss).

Gradients and optimizer (the "full master" scheme): every rank keeps one full fp32 master copy of each
parameter unit it holds (even when a slice holds only a TP shard of it) and the AdamW state for it. After
backward, each slice's gradients are gathered to full tensors over its TP group (``export_full_state`` on
gradients); only TP rank 0 of each slice contributes them, so each TP group counts once; contributions are
summed on the device and all-reduced inside the unit's parameter device group. Every holder then has the
exact total gradient d(sum_t w_t loss_t)/dW, runs the same elementwise AdamW step on its master, and loads the
result back into its operators (re-sharded by ``load_full_state``). This is exact whatever TP degrees, waves
or device sets the uses of a weight have, at the price of full-size optimizer state on TP ranks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_spindle.graph.opgraph import MetaGraph, build_metagraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.planner.plan import Plan, Slice
from megatron_spindle.runtime.groups import PlanGroups
from megatron_spindle.runtime.layout import (
    check_runnable,
    dp_rank,
    is_tp_leader,
    slice_units,
    transfer_input_index,
)
from megatron_spindle.runtime.transfer import SpecFn, TransferOp, default_activation_spec

TERMINAL_KINDS = ("loss", "lm_head")


@dataclass
class OptimizerConfig:
    """torch.optim.AdamW over the full master weights (no gradient clipping)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass
class EngineConfig:
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data_seed: int = 0
    dtype: torch.dtype = torch.float32
    device: str | None = None  # default: cuda:<local rank> when CUDA is available, else cpu


@dataclass
class _LocalSlice:
    """A slice this rank runs, with its operator and the tensors of the current step."""

    slice: Slice
    wave: int
    op: torch.nn.Module
    pgs: Any
    units: list[str]
    terminal: bool
    weight: float  # loss weight w_t (terminal slices)
    tp_leader: bool
    num_inputs: int
    param_keys: list[str] = field(default_factory=list)
    inputs: list[torch.Tensor | None] = field(default_factory=list)
    output: torch.Tensor | None = None
    out_grad: torch.Tensor | None = None


def _default_factory(plan: Plan):
    """megatron-core operators, recomputing activations when the plan was made with recomputation."""
    import functools

    from megatron_spindle.models import build_operator
    from megatron_spindle.models.config import ModelConfig

    if plan.planner.get("recompute"):
        return functools.partial(build_operator, config=ModelConfig(recompute=True))
    return build_operator


def _default_batch_fn():
    from megatron_spindle.data.mock import mock_batch

    return mock_batch


class RuntimeEngine:
    """Runs one plan on this rank. ``torch.distributed`` must be initialised with ``world_size`` ranks
    (the plan is checked against the world size and the workload before any communication)."""

    def __init__(self, plan: Plan, workload: Workload, rank: int, world_size: int,
                 config: EngineConfig | None = None, *, operator_factory: Callable | None = None,
                 batch_fn: Callable | None = None, activation_spec: SpecFn | None = None,
                 metagraph: MetaGraph | None = None, groups=None):
        self.plan, self.workload, self.rank, self.world_size = plan, workload, rank, world_size
        self.config = config or EngineConfig()
        self.metagraph = metagraph or build_metagraph(workload)
        check_runnable(plan, workload, self.metagraph, world_size)  # before any communication
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(f"torch.distributed has rank {dist.get_rank()} of {dist.get_world_size()}, "
                               f"the engine was given rank {rank} of {world_size}")
        self.device = torch.device(self.config.device or (f"cuda:{torch.cuda.current_device()}"
                                                           if torch.cuda.is_available() else "cpu"))
        self.factory = operator_factory or _default_factory(plan)
        self.batch_fn = batch_fn or _default_batch_fn()
        self.spec_fn = activation_spec or default_activation_spec
        self.groups = PlanGroups(plan, rank, cache=groups)
        self.wave_index = {s.id: wi for wi, w in enumerate(plan.waves) for s in w.slices}
        self.transfers = self._build_transfers()
        self.local = self._build_local()
        self.key_unit: dict[str, str] = {}
        self.masters: dict[str, torch.nn.Parameter] = {}
        self._init_masters()
        self.grads: dict[str, torch.Tensor] = {}
        opt = self.config.optimizer
        self.optimizer = torch.optim.AdamW(list(self.masters.values()), lr=opt.lr, betas=opt.betas,
                                           eps=opt.eps, weight_decay=opt.weight_decay) if self.masters else None

    # ---------------------------------------------------------------------------------------------- build
    def _build_transfers(self) -> list[TransferOp]:
        """Plan transfers in execution order: by consumer wave, then plan order (same on every rank)."""
        order = sorted(range(len(self.plan.transfers)),
                       key=lambda i: (self.wave_index[self.plan.transfers[i].consumer], i))
        ops = []
        for i in order:
            t = self.plan.transfers[i]
            p, c = self.plan.slice(t.producer), self.plan.slice(t.consumer)
            info = self.plan.metaop(p.metaop)
            batch = info.input_shape[0]
            op = TransferOp(i, p, c, self.spec_fn(self.workload, info, batch), batch)
            op.input_index = transfer_input_index(self.plan, t)
            ops.append(op)
        return ops

    def _is_terminal(self, s: Slice) -> bool:
        m = self.metagraph.metaops[s.metaop]
        return m.kind in TERMINAL_KINDS and s.layer_end == m.num_layers and not self.metagraph.successors(m.id)

    def _build_local(self) -> dict[str, _LocalSlice]:
        local = {}
        for wi, w in enumerate(self.plan.waves):
            for s in w.slices:
                if self.rank not in s.devices:
                    continue
                info = self.plan.metaop(s.metaop)
                pgs = self.groups.slice_pgs(s.id)
                op = self.factory(self.workload, info, s.layer_start, s.layer_end, pg_collection=pgs, dp_group=pgs.dp)
                op = op.to(device=self.device, dtype=self.config.dtype)
                task = self.workload.task(s.task)
                n_in = 1 if s.layer_start > 0 else len(info.preds)
                local[s.id] = _LocalSlice(s, wi, op, pgs, slice_units(self.metagraph, s), self._is_terminal(s),
                                          task.loss.weight if task.loss else 1.0, is_tp_leader(s, self.rank), n_in)
        return local

    def _init_masters(self) -> None:
        """Full masters from the operators' own (deterministic) initialisation; collective per TP group."""
        for ls in self._local_in_order():
            state = ls.op.export_full_state()
            ls.param_keys = _param_keys(ls.op)
            for k in ls.param_keys:
                unit = next((u for u in ls.units if k.startswith(u + ".")), None)
                if unit is None:
                    raise RuntimeError(f"slice '{ls.slice.id}': exported parameter '{k}' belongs to none of its "
                                       f"units {ls.units}")
                v = state[k].detach().to(self.device, torch.float32)
                if k in self.masters:
                    if not torch.equal(self.masters[k].data, v):
                        raise RuntimeError(f"parameter '{k}' was initialised differently by two slices on rank "
                                           f"{self.rank}: operators must initialise weights from unit names")
                    continue
                self.masters[k] = torch.nn.Parameter(v.clone())
                self.key_unit[k] = unit

    def _local_in_order(self) -> list[_LocalSlice]:
        return sorted(self.local.values(), key=lambda ls: ls.wave)

    # -------------------------------------------------------------------------------------------- state
    def full_state(self) -> dict[str, torch.Tensor]:
        """Full master weights this rank holds ("<unit>.<path>" -> tensor)."""
        return {k: v.detach().clone() for k, v in self.masters.items()}

    def load_full_state(self, state: dict[str, torch.Tensor]) -> None:
        """Overwrite the weights this rank holds (keys it does not hold are ignored; missing keys raise)."""
        missing = sorted(set(self.masters) - set(state))
        if missing:
            raise KeyError(f"load_full_state: missing {missing[:5]}")
        with torch.no_grad():
            for k, p in self.masters.items():
                p.copy_(state[k].to(p.device, p.dtype))
        self._push_masters()

    def _push_masters(self) -> None:
        for ls in self._local_in_order():
            ls.op.load_full_state({k: self.masters[k].detach().to(self.config.dtype) for k in ls.param_keys})

    # --------------------------------------------------------------------------------------------- step
    def train_step(self, step: int) -> dict[str, float]:
        """Forward, backward, gradient sync, AdamW. Returns the per-task losses (the same on every rank)."""
        losses = self.forward_backward(step)
        if self.optimizer is not None:
            for k, p in self.masters.items():
                p.grad = self.grads[k]
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self._push_masters()
        return losses

    def forward_backward(self, step: int) -> dict[str, float]:
        """One step without the optimizer; afterwards ``self.grads`` holds the synchronised full gradients."""
        batches = self._batches(step)
        for ls in self.local.values():
            ls.op.zero_grad(set_to_none=True)
            ls.inputs, ls.output, ls.out_grad = [None] * ls.num_inputs, None, None
        by_wave: dict[int, list[TransferOp]] = {}
        for t in self.transfers:
            by_wave.setdefault(self.wave_index[t.consumer.id], []).append(t)
        mine = {ls.wave: ls for ls in self.local.values()}
        for wi in range(len(self.plan.waves)):
            for t in by_wave.get(wi, []):
                self._forward_transfer(t)
            if wi in mine:
                self._forward_slice(mine[wi], batches)
        losses = self._reduce_losses()
        for wi in reversed(range(len(self.plan.waves))):
            if wi in mine:
                self._backward_slice(mine[wi])
            for t in by_wave.get(wi, []):
                self._backward_transfer(t)
        self._sync_grads()
        for ls in self.local.values():
            ls.inputs, ls.output, ls.out_grad = [], None, None
        return losses

    def _batches(self, step: int) -> dict[str, Any]:
        tasks = {ls.slice.task for ls in self.local.values()}
        return {t: self.batch_fn(self.workload, t, step, self.config.data_seed) for t in sorted(tasks)}

    def _forward_transfer(self, t: TransferOp) -> None:
        if not t.involves(self.rank):
            return
        src = self.local.get(t.producer.id)
        x = t.forward(self.rank, src.output.detach() if src is not None else None, self.config.dtype, self.device)
        dst = self.local.get(t.consumer.id)
        if dst is not None:
            dst.inputs[t.input_index] = x.requires_grad_(True)

    def _forward_slice(self, ls: _LocalSlice, batches: dict[str, Any]) -> None:
        s = ls.slice
        if any(x is None for x in ls.inputs):
            raise RuntimeError(f"slice '{s.id}': inputs {[i for i, x in enumerate(ls.inputs) if x is None]} "
                               f"were never received")
        batch = _to_device(batches[s.task].shard(dp_rank(s, self.rank), s.dp), self.device)
        ls.output = ls.op(list(ls.inputs), batch)

    def _reduce_losses(self) -> dict[str, float]:
        names = [t.name for t in self.workload.tasks]
        vec = torch.zeros(len(names), dtype=torch.float64, device=self.device)
        for ls in self.local.values():
            if ls.terminal and ls.tp_leader:
                v = ls.output.detach().to(torch.float64)
                if getattr(ls.op, "dp_loss_reduction", "sum") == "mean":
                    v = v / ls.slice.dp
                vec[names.index(ls.slice.task)] += v
        dist.all_reduce(vec)
        return {n: float(vec[i]) for i, n in enumerate(names)}

    def _backward_slice(self, ls: _LocalSlice) -> None:
        if ls.terminal:
            scale = ls.weight / (ls.slice.dp if getattr(ls.op, "dp_loss_reduction", "sum") == "mean" else 1)
            grad = torch.full_like(ls.output, scale)
        else:
            grad = ls.out_grad
        if grad is not None and ls.output.requires_grad:
            torch.autograd.backward([ls.output], [grad])

    def _backward_transfer(self, t: TransferOp) -> None:
        if not t.involves(self.rank):
            return
        dst = self.local.get(t.consumer.id)
        g = None
        if dst is not None:
            x = dst.inputs[t.input_index]
            g = x.grad if x.grad is not None else torch.zeros_like(x)
        out = t.backward(self.rank, g, self.config.dtype, self.device)
        src = self.local.get(t.producer.id)
        if src is not None:
            src.out_grad = out if src.out_grad is None else src.out_grad + out

    def _sync_grads(self) -> None:
        acc = {k: torch.zeros_like(p, dtype=torch.float32) for k, p in self.masters.items()}
        for ls in self._local_in_order():  # TP-group collectives: wave order on every rank
            g = _full_grads(ls.op, ls.param_keys)
            if ls.tp_leader:
                for k in ls.param_keys:
                    acc[k] += g[k].to(acc[k].device, torch.float32)
        for pg in self.plan.param_groups:
            if self.rank not in pg.devices:
                continue
            units = set(pg.params)
            keys = sorted(k for k in acc if self.key_unit[k] in units)
            if not keys:
                continue
            flat = torch.cat([acc[k].reshape(-1) for k in keys])
            if len(pg.devices) > 1:
                dist.all_reduce(flat, group=self.groups.param_group(pg.devices))
            off = 0
            for k in keys:
                n = acc[k].numel()
                acc[k] = flat[off:off + n].view_as(acc[k])
                off += n
        self.grads = acc


# ---------------------------------------------------------------------------------------- full-state helpers


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


def _swap_params(op: torch.nn.Module, make: Callable[[torch.nn.Parameter], torch.Tensor]):
    params = list(op.parameters())
    saved = [p.data for p in params]
    for p in params:
        p.data = make(p)
    return params, saved


def _param_keys(op: torch.nn.Module) -> list[str]:
    """Keys of ``export_full_state`` that come from parameters (not buffers): export once with every
    parameter set to NaN and keep the all-NaN entries."""
    params, saved = _swap_params(op, lambda p: torch.full_like(p, math.nan))
    try:
        with torch.no_grad():
            st = op.export_full_state()
    finally:
        for p, d in zip(params, saved):
            p.data = d
    return sorted(k for k, v in st.items() if v.is_floating_point() and v.numel() and bool(torch.isnan(v).all()))


def _full_grads(op: torch.nn.Module, keys: list[str]) -> dict[str, torch.Tensor]:
    """Full (TP-gathered, canonical) gradients: the operator's ``export_full_grads`` if it has one, else its
    ``export_full_state`` run on the gradients in place of the weights."""
    if hasattr(op, "export_full_grads"):
        return op.export_full_grads()
    params, saved = _swap_params(op, lambda p: p.grad if p.grad is not None else torch.zeros_like(p))
    try:
        with torch.no_grad():
            st = op.export_full_state()
    finally:
        for p, d in zip(params, saved):
            p.data = d
    return {k: st[k] for k in keys}
