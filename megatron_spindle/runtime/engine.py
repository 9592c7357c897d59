"""The Spindle runtime engine: executes a Plan on torch.distributed (paper section 3.6, Fig. 7).

1. Localization: each rank builds only the slices it runs, and only their parameters (selective storage).
2. Intra-task data dependency: ``TransferOp`` moves activations between waves and gradients back.
3. Inter-task model dependency: one process group per parameter device group; a unit's gradient is summed
   over every slice that uses it, whatever its device set, wave or TP degree.
4. Training step: forward wave by wave, backward in reverse wave order, gradient sync, optimizer step.
   Nothing in it is a barrier until the gradient sync: the per-task loss all-reduce runs during the
   backward, and a rank that only sends in a transfer does not wait for the receiver (its requests are
   waited on before the gradient sync; runtime/transfer.py).

Operator contract (models/``build_operator``; tests may pass stand-ins with the same interface):
``factory(workload, metaop_info, layer_start, layer_end, pg_collection=..., dp_group=...)`` returns a
``torch.nn.Module`` with ``forward(inputs, batch) -> Tensor`` on the local DP shard, ``inputs`` ordered as the
MetaOp's ``preds`` (a continuation slice gets the previous slice's output as its only input; a front end gets
none), ``export_full_state() -> {"<unit>.<path>": full tensor}`` (TP-unsharded, canonical: independent of the
TP degree; collective over the TP group), and ``load_full_state(dict)``. A terminal operator (loss, lm_head)
returns its task's loss as a scalar whose sum over the slice's DP ranks is the task loss (set the attribute
``dp_loss_reduction = "mean"`` if instead every DP rank returns a loss whose DP-mean is the task loss).

Gradients and optimizer: every rank keeps fp32 master weights and the AdamW state of each parameter unit it
holds (even when a slice holds only a TP shard of it). After backward (generic path: direct units, below, skip
the export and the load), each slice's gradients are gathered to
full tensors over its TP group (``export_full_state`` on gradients); only TP rank 0 of each slice contributes
them, so each TP group counts once; contributions are summed on the device and all-reduced inside the unit's
parameter device group, so every holder has the exact total gradient d(sum_t w_t loss_t)/dW (``self.grads``).
The AdamW step is elementwise, so it may run on any partition of a unit's elements:

- ``zero_stage`` 0 (default): replicated. Every holder keeps the whole unit's master and moments, steps them,
  and loads the result back into its operators (re-sharded by ``load_full_state``).
- ``zero_stage`` 1 (``plan.settings.zero_stage == 1``, the distributed optimizer): the master and moments of
  a unit are sharded over the members of its parameter device group. The unit is flattened (its tensors sorted
  by name, each row-major) into N elements; the member with index i in the group's sorted device list keeps
  elements [i*S, (i+1)*S), S = ceil(N / group size) (the last shards zero-padded, see runtime/shards.py). Each
  member slices its shard out of the all-reduced gradient, steps it, and the updated shards of all units of the
  group are all-gathered in one collective, so every holder loads identical full weights. Numerically equal
  to zero_stage 0. Master + moments of a unit drop to 1/size of the group (every device holding the unit, so
  at most what estimator/memory.py counts: the slice's TP shard over its DP ranks); the fp32 gradients
  (``self.grads``) stay full, and the gradient is all-reduced then sliced (gloo has no reduce-scatter), so a
  step moves one all-gather of the weights more than zero_stage 0.

Gradient buffers: each parameter device group has one flat fp32 gradient buffer on each member (its units
sorted, each flattened like its master), zeroed at the start of every step and all-reduced as one tensor;
``self.grads`` maps each key to a view of it (valid until the next step). At zero_stage 0 it is also the
masters' ``.grad``, so the optimizer reads it without a copy.

Fast path ("direct units", ``self.direct_units``): a unit is direct on this rank when zero_stage is 0, the
engine's dtype is float32, and every local slice holding it has tp == 1 and an operator whose parameters are
the unit's canonical tensors themselves (checked once at init by a probe: every parameter filled with distinct
random values; each exported key must equal exactly one parameter, not shared with another key, so a permuted
layout such as a QKV reorder stays generic). The parameters of a direct unit are bound to views of its master
(``.data``) and of its gradient buffer (``.grad``); local slices holding the same key share the views (tied
storage). Autograd then accumulates every slice's contribution in place into the buffer (GradMode is off in
backward), AdamW's in-place update of the master is the operators' update, and nothing is exported or pushed
for these units. Units that are not direct (TP shards, ZeRO-1, low precision, other layouts) take the generic
path above: exported, added to the same buffers before the all-reduce, and pushed back after the step.
Directness is decided per rank, but the buffers' layout is not, so ranks may differ.

Whatever the layout, ``export_units`` / ``load_units`` / ``full_state`` speak full (unsharded) tensors, so
checkpoints are layout-independent: save under one plan, zero stage and world size, resume under another.
With zero_stage 1, ``export_units`` and ``full_state`` are collective (every rank must call them, as the
trainer does); ``load_units`` and ``load_full_state`` never communicate.

Trainer hooks: ``set_lr``, ``set_loss_weights``, ``export_units``/``load_units``/``expected_shapes`` and
``on_wave(phase, wave_index, seconds)``, called after the forward ("forward") and backward ("backward") part
of each wave on this rank (its slice and the transfers into that wave; no synchronisation is added).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_spindle.checkpointing.checkpoint import CheckpointError, UnitState
from megatron_spindle.graph.opgraph import MetaGraph, build_metagraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan.schema import Plan, Slice
from megatron_spindle.runtime.groups import PlanGroups
from megatron_spindle.runtime.layout import (
    check_runnable,
    dp_rank,
    is_tp_leader,
    slice_units,
    transfer_input_index,
)
from megatron_spindle.runtime.shards import UnitShard, gather_units
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
    generic_keys: list[str] = field(default_factory=list)  # keys of units that are not direct on this rank
    free_params: list[torch.nn.Parameter] = field(default_factory=list)  # parameters not bound to a direct unit
    inputs: list[torch.Tensor | None] = field(default_factory=list)
    output: torch.Tensor | None = None
    out_grad: torch.Tensor | None = None


def _default_factory(plan: Plan):
    """megatron-core operators, recomputing activations when the plan was made with recomputation."""
    import functools

    from megatron_spindle.models import build_operator
    from megatron_spindle.models.config import ModelConfig

    if plan.settings.recompute_every_layer():
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
                 metagraph: MetaGraph | None = None, groups=None,
                 on_wave: Callable[[str, int, float], None] | None = None):
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
        self._pending_sends: list = []  # requests of sends not waited for yet (see forward_backward)
        self.local = self._build_local()
        self.on_wave = on_wave
        self.zero_stage = plan.settings.zero_stage
        if self.zero_stage not in (0, 1):
            raise ValueError(f"zero_stage {self.zero_stage}: the runtime supports 0 and 1 (distributed optimizer)")
        self.key_unit: dict[str, str] = {}
        self.shards: dict[str, UnitShard] = {}  # unit -> its flat layout and this rank's shard of it
        self.masters: dict[str, torch.nn.Parameter] = {}  # unit -> fp32 master shard (the whole unit at stage 0)
        self._opt_groups: list[tuple[tuple[int, ...], list[str]]] = []  # (sorted devices, units), plan order
        self._init_masters()
        self.grads: dict[str, torch.Tensor] = {}
        self._grad_bufs: list[tuple[tuple[int, ...], torch.Tensor]] = []  # (sorted devices, flat fp32 gradient)
        self._unit_grads: dict[str, torch.Tensor] = {}  # unit -> its flat gradient (a view of its group's buffer)
        self._key_grads: dict[str, torch.Tensor] = {}  # "<unit>.<path>" -> full gradient (a view, as above)
        self._init_grad_buffers()
        self.direct_units: list[str] = self._bind_direct_units()
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
            op = TransferOp(i, p, c, self.spec_fn(self.workload, info, batch), batch, self.plan.gpus_per_node)
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
        """Masters from the operators' own (deterministic) initialisation; collective per TP group."""
        full = self._initial_weights()
        for pg in self.plan.param_groups:
            devices = tuple(sorted(pg.devices))
            units = sorted({self.key_unit[k] for k in full} & set(pg.params))
            if self.rank not in devices or not units:
                continue
            members, index = (len(devices), devices.index(self.rank)) if self.zero_stage == 1 else (1, 0)
            for u in units:
                keys = sorted(k for k in full if self.key_unit[k] == u)
                sh = UnitShard(u, keys, [full[k].shape for k in keys], members, index)
                self.shards[u] = sh
                self.masters[u] = torch.nn.Parameter(sh.shard_of(sh.flatten(full)))
            self._opt_groups.append((devices, units))
        orphans = sorted(set(self.key_unit.values()) - set(self.shards))
        if orphans:
            raise RuntimeError(f"rank {self.rank} holds units {orphans[:5]} that no parameter device group of the "
                               f"plan lists with this rank")

    def _init_grad_buffers(self) -> None:
        """One flat fp32 gradient buffer per parameter device group: its units sorted, each flattened like its
        master (runtime/shards.py), the same layout on every member, so the sync is one all-reduce per group."""
        for devices, units in self._opt_groups:
            buf = torch.zeros(sum(self.shards[u].numel for u in units), dtype=torch.float32, device=self.device)
            off = 0
            for u in units:
                sh = self.shards[u]
                self._unit_grads[u] = buf[off:off + sh.numel]
                self._key_grads.update(sh.unflatten(self._unit_grads[u]))
                off += sh.numel
                if self.zero_stage == 0:  # the whole unit is the shard: AdamW reads the buffer itself
                    self.masters[u].grad = self._unit_grads[u]
            self._grad_bufs.append((devices, buf))

    def _bind_direct_units(self) -> list[str]:
        """The fast path (see the module docstring): bind the parameters of every eligible unit to views of its
        master (data) and of its gradient buffer (grad). Returns the direct units, sorted."""
        direct = set(self.shards) if self.zero_stage == 0 and self.config.dtype == torch.float32 else set()
        bound: dict[str, dict[str, torch.nn.Parameter]] = {}
        for ls in self.local.values():
            bound[ls.slice.id] = _identical_params(ls.op, ls.param_keys, self.device) if ls.slice.tp == 1 else {}
            direct -= {self.key_unit[k] for k in ls.param_keys if k not in bound[ls.slice.id]}
        weights = {k: v for u in direct for k, v in self.shards[u].unflatten(self.masters[u].detach()).items()}
        for ls in self.local.values():
            tied = set()
            for k, p in bound[ls.slice.id].items():
                if self.key_unit[k] in direct:
                    p.data, p.grad = weights[k], self._key_grads[k]
                    tied.add(id(p))
            ls.generic_keys = [k for k in ls.param_keys if self.key_unit[k] not in direct]
            ls.free_params = [p for p in ls.op.parameters() if id(p) not in tied]
        return sorted(direct)

    def _initial_weights(self) -> dict[str, torch.Tensor]:
        full: dict[str, torch.Tensor] = {}
        for ls in self._local_in_order():
            state = ls.op.export_full_state()
            ls.param_keys = _param_keys(ls.op)
            for k in ls.param_keys:
                unit = next((u for u in ls.units if k.startswith(u + ".")), None)
                if unit is None:
                    raise RuntimeError(f"slice '{ls.slice.id}': exported parameter '{k}' belongs to none of its "
                                       f"units {ls.units}")
                v = state[k].detach().to(self.device, torch.float32)
                if k in full:
                    if not torch.equal(full[k], v):
                        raise RuntimeError(f"parameter '{k}' was initialised differently by two slices on rank "
                                           f"{self.rank}: operators must initialise weights from unit names")
                    continue
                full[k] = v.clone()
                self.key_unit[k] = unit
        return full

    def _local_in_order(self) -> list[_LocalSlice]:
        return sorted(self.local.values(), key=lambda ls: ls.wave)

    # -------------------------------------------------------------------------------------------- state
    def full_state(self) -> dict[str, torch.Tensor]:
        """Full master weights this rank holds ("<unit>.<path>" -> tensor). Collective at zero_stage 1."""
        return {k: v.clone() for k, v in self._full_weights().items()}

    def load_full_state(self, state: dict[str, torch.Tensor]) -> None:
        """Overwrite the weights this rank holds (keys it does not hold are ignored; missing keys raise)."""
        missing = sorted(set(self.key_unit) - set(state))
        if missing:
            raise KeyError(f"load_full_state: missing {missing[:5]}")
        full = {k: state[k].detach().to(self.device, torch.float32) for k in self.key_unit}
        with torch.no_grad():
            for u, p in self.masters.items():
                sh = self.shards[u]
                p.copy_(sh.shard_of(sh.flatten(full)))
        self._push_weights(full)

    def expected_shapes(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """unit -> {"<unit>.<path>": full shape} for every unit this rank holds."""
        return {u: {k: tuple(shape) for k, shape in zip(sh.keys, sh.shapes)} for u, sh in self.shards.items()}

    def export_units(self) -> dict[str, UnitState]:
        """Every unit this rank holds in full form: fp32 weights and AdamW state (``optim`` empty before the
        first step), whatever the zero stage. Collective over the parameter device groups at zero_stage 1."""
        out: dict[str, UnitState] = {}
        for devices, units in self._opt_groups:
            states = [self._adam_state(u) for u in units]
            parts = [[self.masters[u].detach()] + ([st["exp_avg"], st["exp_avg_sq"]] if st else [])
                     for u, st in zip(units, states)]
            fulls = gather_units([self.shards[u] for u in units], parts, self.groups.param_group(devices))
            for u, st, vecs in zip(units, states, fulls):
                sh = self.shards[u]
                model = {k: v.clone() for k, v in sh.unflatten(vecs[0]).items()}
                optim = {}
                if st:
                    avg, sq = sh.unflatten(vecs[1]), sh.unflatten(vecs[2])
                    optim = {k: {"exp_avg": avg[k].clone(), "exp_avg_sq": sq[k].clone(), "step": float(st["step"])}
                             for k in sh.keys}
                out[u] = UnitState(model, optim)
        return out

    def load_units(self, units: dict[str, UnitState], load_optim: bool = True) -> None:
        """Load the weights (and AdamW state) of every unit this rank holds from their full forms; each rank
        keeps its own shard. A unit without optimizer state starts AdamW afresh. Never communicates."""
        missing = sorted(set(self.shards) - set(units))
        if missing:
            raise KeyError(f"load_units: missing units {missing[:5]}")
        self.load_full_state({k: v for u in self.shards for k, v in units[u].model.items()})
        if not load_optim or self.optimizer is None:
            return
        for u, p in self.masters.items():
            self._load_adam_state(u, p, units[u].optim)

    def _adam_state(self, unit: str) -> dict[str, Any] | None:
        if self.optimizer is None:
            return None
        return self.optimizer.state.get(self.masters[unit]) or None

    def _load_adam_state(self, unit: str, p: torch.nn.Parameter, optim: dict[str, dict[str, Any]]) -> None:
        sh = self.shards[unit]
        present = [k for k in sh.keys if k in optim]
        if not present:
            self.optimizer.state.pop(p, None)
            return
        steps = {float(optim[k]["step"]) for k in present}
        if len(present) != len(sh.keys) or len(steps) != 1:
            raise CheckpointError(f"unit '{unit}': AdamW state for {len(present)} of its {len(sh.keys)} tensors, "
                                  f"steps {sorted(steps)}: a unit's tensors must share one optimizer state")
        moment = lambda name: sh.shard_of(sh.flatten({k: optim[k][name].to(self.device) for k in sh.keys}))  # noqa: E731
        self.optimizer.state[p] = {"step": torch.tensor(steps.pop(), dtype=torch.float32),
                                   "exp_avg": moment("exp_avg"), "exp_avg_sq": moment("exp_avg_sq")}

    def set_lr(self, lr: float) -> None:
        """Learning rate of the next optimizer steps."""
        if self.optimizer is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = lr

    def set_loss_weights(self, weights: dict[str, float]) -> None:
        """Loss weight w_t of each named task for the next steps (0: the task sits out); others keep theirs."""
        unknown = sorted(set(weights) - {t.name for t in self.workload.tasks})
        if unknown:
            raise KeyError(f"set_loss_weights: unknown tasks {unknown}")
        for ls in self.local.values():
            if ls.terminal and ls.slice.task in weights:
                ls.weight = float(weights[ls.slice.task])

    def optimizer_numel(self) -> dict[str, tuple[int, int]]:
        """unit -> (fp32 elements of its master shard on this rank, elements of the full unit). Each of the
        master, exp_avg and exp_avg_sq has the shard's size."""
        return {u: (self.masters[u].numel(), sh.numel) for u, sh in self.shards.items()}

    def _full_weights(self) -> dict[str, torch.Tensor]:
        """Full fp32 master weights (views; gathered over the parameter device groups at zero_stage 1)."""
        full: dict[str, torch.Tensor] = {}
        for devices, units in self._opt_groups:
            vecs = gather_units([self.shards[u] for u in units], [[self.masters[u].detach()] for u in units],
                                self.groups.param_group(devices))
            for u, (v,) in zip(units, vecs):
                full.update(self.shards[u].unflatten(v))
        return full

    def _push_weights(self, full: dict[str, torch.Tensor]) -> None:
        """Load the masters into the operators that hold non-direct units (direct ones alias their masters)."""
        for ls in self._local_in_order():
            if ls.generic_keys:
                ls.op.load_full_state({k: full[k].to(self.config.dtype) for k in ls.param_keys})

    # --------------------------------------------------------------------------------------------- step
    def train_step(self, step: int) -> dict[str, float]:
        """Forward, backward, gradient sync, AdamW. Returns the per-task losses (the same on every rank)."""
        losses = self.forward_backward(step)
        if self.optimizer is None:
            return losses
        for u, p in self.masters.items():  # stage 0: the unit's gradient buffer itself (set at init)
            if self.zero_stage == 1:
                p.grad = self.shards[u].shard_of(self._unit_grads[u])
            elif p.grad is None:  # someone called zero_grad(set_to_none=True) on the optimizer
                p.grad = self._unit_grads[u]
        self.optimizer.step()
        if self.zero_stage == 1 or any(ls.generic_keys for ls in self.local.values()):
            self._push_weights(self._full_weights())  # collective at zero_stage 1
        return losses

    def forward_backward(self, step: int) -> dict[str, float]:
        """One step without the optimizer; afterwards ``self.grads`` holds the synchronised full gradients."""
        batches = self._batches(step)
        for _, buf in self._grad_bufs:
            buf.zero_()
        for ls in self.local.values():
            for p in ls.free_params:
                p.grad = None
            ls.inputs, ls.output, ls.out_grad = [None] * ls.num_inputs, None, None
        by_wave: dict[int, list[TransferOp]] = {}
        for t in self.transfers:
            by_wave.setdefault(self.wave_index[t.consumer.id], []).append(t)
        mine = {ls.wave: ls for ls in self.local.values()}
        for wi in range(len(self.plan.waves)):
            t0 = time.perf_counter()
            for t in by_wave.get(wi, []):
                self._forward_transfer(t)
            if wi in mine:
                self._forward_slice(mine[wi], batches)
            self._wave_done("forward", wi, t0)
        losses = self._reduce_losses()  # in flight during the backward
        for wi in reversed(range(len(self.plan.waves))):
            t0 = time.perf_counter()
            if wi in mine:
                self._backward_slice(mine[wi])
            for t in by_wave.get(wi, []):
                self._backward_transfer(t)
            self._wave_done("backward", wi, t0)
        for w in self._pending_sends:  # sends this rank did not wait for (runtime/transfer.py)
            w.wait()
        self._pending_sends.clear()
        self._sync_grads()
        for ls in self.local.values():
            ls.inputs, ls.output, ls.out_grad = [], None, None
        return losses()

    def _wave_done(self, phase: str, wave: int, t0: float) -> None:
        if self.on_wave is not None:
            self.on_wave(phase, wave, time.perf_counter() - t0)

    def _batches(self, step: int) -> dict[str, Any]:
        tasks = {ls.slice.task for ls in self.local.values()}
        return {t: self.batch_fn(self.workload, t, step, self.config.data_seed) for t in sorted(tasks)}

    def _forward_transfer(self, t: TransferOp) -> None:
        if not t.involves(self.rank):
            return
        src = self.local.get(t.producer.id)
        x = t.forward(self.rank, src.output.detach() if src is not None else None, self.config.dtype, self.device,
                      self._pending_sends)
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

    def _reduce_losses(self) -> Callable[[], dict[str, float]]:
        """Start the all-reduce of the per-task losses; the returned function waits for it and reads them.
        Asynchronous, so that no rank waits for the slowest one's forward before starting its backward."""
        names = [t.name for t in self.workload.tasks]
        vec = torch.zeros(len(names), dtype=torch.float64, device=self.device)
        for ls in self.local.values():
            if ls.terminal and ls.tp_leader:
                v = ls.output.detach().to(torch.float64)
                if getattr(ls.op, "dp_loss_reduction", "sum") == "mean":
                    v = v / ls.slice.dp
                vec[names.index(ls.slice.task)] += v
        work = dist.all_reduce(vec, async_op=True)

        def result() -> dict[str, float]:
            work.wait()
            return {n: float(vec[i]) for i, n in enumerate(names)}

        return result

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
        out = t.backward(self.rank, g, self.config.dtype, self.device, self._pending_sends)
        src = self.local.get(t.producer.id)
        if src is not None:
            src.out_grad = out if src.out_grad is None else src.out_grad + out

    def _sync_grads(self) -> None:
        """Add the exported gradients of non-direct units to the buffers (direct ones are there already), then
        all-reduce each group's buffer."""
        acc = self._key_grads
        for ls in self._local_in_order():  # TP-group collectives: wave order on every rank
            if not ls.generic_keys:
                continue
            g = _full_grads(ls.op, ls.param_keys)
            if ls.tp_leader:
                for k in ls.generic_keys:
                    acc[k] += g[k].to(acc[k].device, torch.float32)
        for devices, buf in self._grad_bufs:
            if len(devices) > 1:
                dist.all_reduce(buf, group=self.groups.param_group(devices))
        self.grads = dict(acc)


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


def _export_swapped(op: torch.nn.Module, replacement: Callable) -> dict[str, torch.Tensor]:
    """``export_full_state`` with every parameter's data temporarily replaced by ``replacement(p)``."""
    params, saved = _swap_params(op, replacement)
    try:
        with torch.no_grad():
            return op.export_full_state()
    finally:
        for p, d in zip(params, saved):
            p.data = d


def _param_keys(op: torch.nn.Module) -> list[str]:
    """Keys of ``export_full_state`` that come from parameters (not buffers): export once with every
    parameter set to NaN and keep the all-NaN entries."""
    st = _export_swapped(op, lambda p: torch.full_like(p, math.nan))
    return sorted(k for k, v in st.items() if v.is_floating_point() and v.numel() and bool(torch.isnan(v).all()))


def _identical_params(op: torch.nn.Module, keys: list[str], device: torch.device) -> dict[str, torch.nn.Parameter]:
    """key -> the one fp32 parameter on ``device`` that ``export_full_state`` returns unchanged as that key,
    found by a probe: every parameter filled with distinct random values, each key's export compared with
    every probe. Keys that match no parameter, several, or a parameter another key matches are left out (a
    permuted layout, e.g. a QKV reorder, or a TP shard fails the comparison)."""
    gen = torch.Generator().manual_seed(0)
    probes = {id(p): torch.randn(p.shape, generator=gen).to(p.device, p.dtype) for p in op.parameters()}
    state = _export_swapped(op, lambda p: probes[id(p)])
    found: dict[str, torch.nn.Parameter] = {}
    for k in keys:
        hits = [p for p in op.parameters() if p.dtype == torch.float32 and p.device == device
                and p.shape == state[k].shape and torch.equal(probes[id(p)], state[k])]
        if len(hits) == 1:
            found[k] = hits[0]
    owners = [id(p) for p in found.values()]
    return {k: p for k, p in found.items() if owners.count(id(p)) == 1}


def _full_grads(op: torch.nn.Module, keys: list[str]) -> dict[str, torch.Tensor]:
    """Full (TP-gathered, canonical) gradients: the operator's ``export_full_grads`` if it has one, else its
    ``export_full_state`` run on the gradients in place of the weights."""
    if hasattr(op, "export_full_grads"):
        return op.export_full_grads()
    st = _export_swapped(op, lambda p: p.grad if p.grad is not None else torch.zeros_like(p))
    return {k: st[k] for k in keys}
