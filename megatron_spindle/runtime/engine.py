"""The Spindle runtime engine: executes a Plan on torch.distributed (paper section 3.6, Fig. 7).

``RuntimeEngine`` puts together, along megatron-core's lines, one class per job:

1. Localization (slices.py): each rank builds only the slices it runs, and only their parameters.
2. The wave schedule (schedule.py, transfer.py): the plan's execution order (plan/order.py: forward wave by
   wave and the backward in reverse, per segment, or explicit steps such as an early backward), once per
   micro-batch, ``TransferOp`` moving activations between waves and gradients back. Nothing in it is a
   barrier. Slices recompute activations with megatron-core's own recomputation where the plan says so.
3. Gradient buffers (grad_buffers.py) and their synchronisation (grad_sync.py): one flat buffer per
   parameter device group (fp32; bf16 with the plan's grad_reduce_dtype, cast to fp32 for each step), split
   into buckets whose all-reduces run inside the group's process group (groups.py) asynchronously during the
   backward, as soon as each bucket is complete; a unit's gradient is summed over every slice that uses it,
   whatever its device set, wave or TP degree, so every holder gets the exact total d(sum_t w_t loss_t)/dW
   (``grads``: views of the buffers, valid until the next step). At
   zero_stage 1 to 3 (grad_shards.py) the same buckets are reduce-scattered and each rank keeps only its shards.
4. The optimizer (optimizer.py, shards.py): AdamW on fp32 masters, replicated (zero_stage 0) or sharded over
   each parameter device group (zero_stage 1, the distributed optimizer; numerically equal), its gradient
   reduce-scattered into those shards (grad_shards.py): each bucket's full storage is released as soon as
   its sync completed, so ``grads`` is empty there (``gather_grads`` all-gathers the full gradients;
   ``held_grad_bytes`` is what is held). zero_stage 2 also reduce-scatters every micro-batch's gradients
   (plan/buckets.py), never holding them in full across micro-batches; zero_stage 3 also keeps only each slice's
   DP shard of its weights between uses, a layer's weights gathered around its forward and its backward
   (weight_shards.py). With the plan's
   ``overlap_param_gather`` (Megatron's --overlap-param-gather) the all-gather of the updated shards is only
   issued by the step, and each slice waits for its groups' gathers just before its next forward
   (param_gather.py; at ZeRO-3 the redistribution's all-to-alls, each slice's landed before its forward:
   weight_redistribution.py); every reader of weights or masters (``full_state``, ``export_units``,
   ``load_*``, ``close``) finishes them first (``flush_param_gather``).
   With ``settings.tp_sharded_grads`` (the default) a parameter device group held at TP t > 1 keeps, reduces
   and steps each unit's TP-split tensors by TP shard (tp_shards.py, plan/tp_shards.py): shard p of degree t is a
   sub-unit of its own, reduced over the ring of devices holding it, so a device moves and stores 1/t of such a
   unit, as in Megatron-LM; ``sync_groups`` are the sets of units reduced together, ``keys`` translates between
   the runtime's keys and the operators' canonical ones. Checkpoints and ``full_state`` stay canonical.
5. The fast path (direct.py): fp32 TP=1 canonical-layout units alias their masters and gradient buffer, so
   nothing is exported or loaded back for them. Other units are exported after each slice's backward
   (``export_full_state`` on gradients, TP rank 0 contributing) and loaded back after each step.

Operator contract (models/``build_operator``; tests may pass stand-ins with the same interface):
``factory(workload, metaop_info, layer_start, layer_end, pg_collection=..., dp_group=...)`` returns a
``torch.nn.Module`` with ``forward(inputs, batch) -> Tensor`` on the local DP shard, ``inputs`` ordered as the
MetaOp's ``preds`` (a continuation slice gets the previous slice's output as its only input; a front end gets
none), ``export_full_state() -> {"<unit>.<path>": full tensor}`` (TP-unsharded, canonical: independent of the
TP degree; collective over the TP group), and ``load_full_state(dict)``. A terminal operator (loss, lm_head)
returns its task's loss as a scalar whose sum over the slice's DP ranks is the task loss (set the attribute
``dp_loss_reduction = "mean"`` if instead every DP rank returns a loss whose DP-mean is the task loss).

Checkpoints: ``export_units`` / ``load_units`` / ``full_state`` speak full (unsharded) tensors, so they are
layout-independent. With zero_stage 1 or 2, ``export_units`` and ``full_state`` are collective (every rank must call
them, as the trainer does); ``load_units`` and ``load_full_state`` never communicate.

Between the sync and AdamW (clip.py): the global gradient norm over every unit (each counted once), clipping
(``OptimizerConfig.clip_grad``) and, with an fp16 ``EngineConfig.grad_scaler``, unscaling and the overflow
skip; ``last_step`` tells the trainer what the step did. ``evaluate`` runs a forward-only pass through the
same wave schedule (no gradients, no gradient sync, no optimizer).

Trainer hooks: ``set_lr``, ``set_loss_weights``, ``export_units``/``load_units``/``expected_shapes``, and
``on_wave(phase, wave_index, seconds)``, called after the forward ("forward") and backward ("backward") part
of each wave on this rank (its slice and the transfers into that wave; no synchronisation is added unless
``sync_waves`` is set: then CUDA is synchronised before each call, and the seconds are the wave's device time).
``phase_times`` (a dict, None by default): when set, each training step adds the seconds of its phases
(Megatron's timer names; CUDA is synchronised at their boundaries, so only set it when asked for).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_spindle.checkpointing.checkpoint import UnitState
from megatron_spindle.compat.cpu import select_te_attention
from megatron_spindle.graph.opgraph import MetaGraph, build_metagraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan.buckets import (
    overlaps_param_gather,
    regathered_groups,
    synced_rounds,
    unit_first_use,
    wave_rounds,
)
from megatron_spindle.plan.routing import gradient_returns
from megatron_spindle.plan.schema import ParamGroup, Plan
from megatron_spindle.plan.tp_shards import base_unit, runtime_groups, unit_rings
from megatron_spindle.runtime import progress
from megatron_spindle.runtime.activation_meter import SavedTensorMeter
from megatron_spindle.runtime.clip import (
    GradClipper,
    StepStats,
    check_finite,
    global_norm,
    norm_tensors,
    prepare_step,
)
from megatron_spindle.runtime.direct import bind_direct_units
from megatron_spindle.runtime.frozen import FrozenWeights
from megatron_spindle.runtime.grad_buffers import GRAD_DTYPES, Bucket, GradBuffers, backward_order
from megatron_spindle.runtime.grad_shards import ShardedGradBuffers, backend_reduces_scatter
from megatron_spindle.runtime.grad_sync import GradSync
from megatron_spindle.runtime.groups import PlanGroups
from megatron_spindle.runtime.layout import batch_needs, check_runnable
from megatron_spindle.runtime.optimizer import MasterOptimizer, OptimizerConfig
from megatron_spindle.runtime.param_gather import ParamGather, gather_buckets, streamed_gathers
from megatron_spindle.runtime.schedule import WaveSchedule
from megatron_spindle.runtime.slices import (
    build_local_slices,
    in_wave_order,
    initial_weights,
    local_slice_units,
    unit_holders,
)
from megatron_spindle.runtime.tp_shards import KeyLayout
from megatron_spindle.runtime.transfer import SpecFn, default_activation_spec, receives_early
from megatron_spindle.runtime.weight_redistribution import WeightRedistribution, gather_unit_segments, merged
from megatron_spindle.runtime.weight_shards import WeightShards

__all__ = ["EngineConfig", "OptimizerConfig", "RuntimeEngine"]


@dataclass
class EngineConfig:
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data_seed: int = 0
    dtype: torch.dtype = torch.float32
    device: str | None = None  # default: cuda:<local rank> when CUDA is available, else cpu
    # Count the bytes autograd saves for the backward during each step (runtime/activation_meter.py): the
    # engine's ``activation_peak`` is then this rank's peak of activation memory in the last step.
    measure_activations: bool = False
    # fp16 loss scaling: a megatron-core MegatronGradScaler (megatron.core.optimizer.grad_scaler; its tensors
    # live on CUDA). The backward runs on loss * scale; runtime/clip.py unscales and skips overflowing steps.
    grad_scaler: Any = None
    # The operators' initial weights (default operator factory): normal(0, init_std) from a generator seeded by
    # each parameter's name and init_seed (models/state.py ``init_full_tensor``), whatever the plan's layout.
    init_std: float = 0.02
    init_seed: int = 0
    # The seed of the dropout masks (models/dropout.py: drawn per layer, iteration, micro-batch and data-parallel
    # rank), where the plan has dropout.
    dropout_seed: int = 0
    # Stop before the optimizer step when a loss or the gradient norm is not finite (clip.py ``check_finite``;
    # Megatron-LM's --check-for-nan-in-loss-and-grad): the gradient norm is then measured every step.
    check_for_nan: bool = False
    # Count the zeros in the synchronised gradients every step (Megatron-LM's --log-num-zeros-in-grad):
    # ``last_step.num_zeros``, one more all-reduce per step.
    count_zeros: bool = False


def default_factory(workload, info, layer_start, layer_end, pg_collection=None, dp_group=None, recompute=None,
                    sequence_parallel=False, attention_backend="auto", init_std=0.02, init_seed=0,
                    hidden_dropout=0.0, attention_dropout=0.0):
    """megatron-core operators (models/build_operator), recomputing activations as megatron-core does where the
    plan says so (``recompute``: the slice's ``Recompute``), sequence-parallel where it applies, and with the
    plan's attention backend and dropout; initialised with ``EngineConfig.init_std`` and ``init_seed``."""
    from megatron_spindle.models import build_operator
    from megatron_spindle.models.config import ModelConfig

    config = ModelConfig(recompute=recompute or False, sequence_parallel=sequence_parallel,
                         attention_backend=attention_backend, init_std=init_std, init_seed=init_seed,
                         hidden_dropout=hidden_dropout, attention_dropout=attention_dropout)
    return build_operator(workload, info, layer_start, layer_end, pg_collection=pg_collection, dp_group=dp_group,
                          config=config)


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
        settings = plan.settings  # check_runnable refused what the runtime cannot execute
        select_te_attention(settings.attention_backend)
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(f"torch.distributed has rank {dist.get_rank()} of {dist.get_world_size()}, "
                               f"the engine was given rank {rank} of {world_size}")
        self.zero_stage = settings.zero_stage
        self.device = torch.device(self.config.device or (f"cuda:{torch.cuda.current_device()}"
                                                           if torch.cuda.is_available() else "cpu"))
        self.batch_fn = batch_fn or _default_batch_fn()
        # the sets of units reduced together: the plan's groups and, with TP-sharded gradients, each unit's
        # TP shards over their rings (plan/tp_shards.py), in one order on every rank
        plan_groups = [(tuple(sorted(g.devices)), list(g.params)) for g in plan.param_groups]
        rings = unit_rings([w.slices for w in plan.waves], self.metagraph.metaops, [u for _, u in plan_groups],
                           settings)
        self.sync_groups = [ParamGroup(list(d), units) for d, units in runtime_groups(plan_groups, rings)]
        self.keys = KeyLayout(rings, plan_groups, rank)
        self.groups = PlanGroups(plan, rank, cache=groups, extra=[tuple(g.devices) for g in self.sync_groups])
        self._owns_groups = groups is None
        factory = operator_factory or functools.partial(default_factory, init_std=self.config.init_std,
                                                        init_seed=self.config.init_seed)
        self.local = build_local_slices(plan, workload, self.metagraph, rank, self.groups, factory, self.device,
                                        self.config.dtype, self.keys)
        # what this rank reads of each task's batch: a batch function that can, reads no more (the trainer's
        # data loader: data/datasets.py read_batch); an operator that does not say what it reads gets it all
        self.batch_needs = batch_needs(
            [(ls.slice, ls.op.batch_fields() if hasattr(ls.op, "batch_fields") else None) for ls in self.local.values()],
            rank, {t.name: t.batch_size for t in workload.tasks}, settings.micro_batches)
        full, self.key_unit = initial_weights(self.local, rank, self.device)
        self.frozen = FrozenWeights(self.local, self.metagraph, plan, rank)  # outside everything below (runtime/frozen.py)
        self.master_optimizer = MasterOptimizer(full, self.key_unit, self.sync_groups, rank, self.zero_stage,
                                                self.config.optimizer, self.groups, self.device)
        opt = self.master_optimizer
        completion = backward_order(plan, self.metagraph)  # a TP shard completes with its unit
        order = {u: completion[base_unit(u)] for u in opt.shards}
        grad_dtype = GRAD_DTYPES[settings.grad_reduce_dtype]
        if self.zero_stage >= 1:  # reduce-scattered into the optimizer's shards (stage 2: kept as shards only)
            self.grad_buffers = ShardedGradBuffers(opt.unit_groups, opt.shards, order, settings.ddp_bucket_size,
                                                   self.device, backend_reduces_scatter(dist.get_backend()),
                                                   dtype=grad_dtype)
        else:
            self.grad_buffers = GradBuffers(opt.unit_groups, opt.shards, order, settings.ddp_bucket_size,
                                            self.device, dtype=grad_dtype)
        if not self._cast_grads:
            opt.attach_grads(self.grad_buffers.unit_grads)
        self.binding = bind_direct_units(self.local, self.key_unit, opt.shards, opt.masters,
                                         self.grad_buffers.key_grads,
                                         self.zero_stage == 0 and self.config.dtype == grad_dtype == torch.float32,
                                         self.device)
        # --overlap-param-gather (ZeRO-1/2): the weights' all-gather after the step waits for the next forward
        self.param_gather = None
        if overlaps_param_gather(settings) and self.zero_stage < 3:  # ZeRO-3's: _push_weight_shards defers
            self.param_gather = ParamGather(opt, self.local, self.key_unit, self.config.dtype,
                                            gather_buckets(self.grad_buffers.buckets, self._first_use()),
                                            self._timed_gather)
        # ZeRO-3: each slice keeps its DP shard of its weights, a layer gathered around its use (weight_shards.py)
        self.weight_shards, self._regathered = None, set()
        if self.zero_stage == 3:
            again = regathered_groups([w.slices for w in plan.waves], self.metagraph.metaops, plan_groups, 3,
                                      plan.weight_scope)
            self._regathered = {u for (_, units), a in zip(plan_groups, again) if a for u in units}
            aligned = {u for (d, units), a in zip(plan_groups, again) if not a and len(d) > 1 for u in units}
            self.weight_shards = WeightShards(self.local, self.groups, self.key_unit, aligned, opt.masters,
                                              self.device)
        # the buckets whose weights are all-gathered right after the step (plan/buckets.py ``regathered_groups``),
        # in gather order, and the local slices holding each unit
        self._holders = unit_holders(self.local, self.key_unit)
        self._gathered_buckets = []
        if self.param_gather is None and self.zero_stage >= 1:
            self._gathered_buckets = [
                (d, kept) for d, units in gather_buckets(self.grad_buffers.buckets, self._first_use())
                if (kept := tuple(u for u in units if self.zero_stage < 3 or len(d) == 1
                                  or base_unit(u) in self._regathered))]
        gathered = {u for _, units in self._gathered_buckets for u in units}
        whole = self.weight_shards.whole if self.weight_shards is not None else set()
        # ZeRO-3: the keys each gather unit of a slice (a unit, or a slice gathered whole: None) waits for after
        # the step before it is loaded (a unit's TP shards and its replicated tensors come in separate buckets)
        self._gathered_keys: dict[tuple[str, str | None], list[str]] = {}
        if self.weight_shards is not None:
            for sid, ls in self.local.items():
                for k in ls.param_keys:
                    if self.key_unit[k] in gathered:
                        part = None if sid in whole else base_unit(self.key_unit[k])
                        self._gathered_keys.setdefault((sid, part), []).append(k)
        # ZeRO-3: the regathered weights redistributed after the step, not all-gathered (weight_redistribution.py)
        self._redistribution = self._weight_redistribution(gathered) if self.weight_shards is not None else None
        self._defer_redistribution = self.weight_shards is not None and overlaps_param_gather(settings)
        # the runtime units whose buckets each local slice's forward waits for (only where they are deferred)
        self._slice_runtime_units = local_slice_units(self.local, self.key_unit) if self._defer_redistribution else {}
        self._waiting: dict[tuple[str, str | None], dict[str, torch.Tensor]] = {}  # parts' tensors landed so far
        self.grad_sync = GradSync(self.grad_buffers, self.local, self.binding, self.key_unit, self.groups,
                                  overlap=settings.overlap_grad_reduce, micro_batches=settings.micro_batches,
                                  zero_stage=self.zero_stage, rounds=self._sync_rounds(),
                                  wave_rounds=wave_rounds(len(plan.waves), settings))
        weights = {t.name: t.loss.weight if t.loss else 1.0 for t in workload.tasks}
        self.schedule = WaveSchedule(plan, workload, rank, self.local, activation_spec or default_activation_spec,
                                     weights, self.config.dtype, self.device, on_wave,
                                     early_receives=receives_early(dist.get_backend()),
                                     no_grad=frozenset(m.id for m in self.metagraph.metaops.values()
                                                       if not gradient_returns(m.backward)))
        self.clipper = self._clipper(self.grad_buffers.unit_grads, self.grad_buffers.storage())
        self.grads: dict[str, torch.Tensor] = {}
        self.activation_peak: int | None = None  # bytes, with EngineConfig(measure_activations=True)
        self.last_step = StepStats()
        self.phase_times: dict[str, float] | None = None

    def _clipper(self, unit_grads: dict[str, torch.Tensor], storage: list[torch.Tensor]) -> GradClipper:
        """The norm and clipping of the gradients the optimizer steps from (``storage``: all of them, in place)."""
        return GradClipper(storage, norm_tensors(unit_grads, self.sync_groups, self.rank, self.grad_buffers.sharded,
                                                 {u: sh.valid for u, sh in self.master_optimizer.shards.items()}),
                           self.device)

    @property
    def _cast_grads(self) -> bool:
        """fp32 buffers are the masters' gradients; bf16 ones (--grad-reduce-in-bf16) are cast for each step
        (``_main_grads``)."""
        return self.grad_buffers.dtype != torch.float32

    def _main_grads(self) -> tuple[dict[str, torch.Tensor], GradClipper]:
        """The synchronised gradients the step unscales, clips and applies, and their clipper: the fp32 buffers
        themselves, or fp32 copies of the bf16 ones (--grad-reduce-in-bf16), the masters' gradients until the step
        ends (Megatron-LM's copy of the model's gradients into main gradients before its optimizer step)."""
        if not self._cast_grads:
            return self.grad_buffers.unit_grads, self.clipper
        grads = {u: g.float() for u, g in self.grad_buffers.unit_grads.items()}
        self.master_optimizer.attach_grads(grads)
        return grads, self._clipper(grads, list(grads.values()))

    def _first_use(self):
        """unit (a TP shard: its unit's) -> where the forward first uses it (plan/buckets.py)."""
        first = unit_first_use([w.slices for w in self.plan.waves], self.metagraph.metaops, self.plan.settings)
        return {u: first[base_unit(u)] for u in self.master_optimizer.shards}

    # ------------------------------------------------------------------------------------------ views
    @property
    def on_wave(self) -> Callable[[str, int, float], None] | None:
        return self.schedule.on_wave

    @on_wave.setter
    def on_wave(self, fn: Callable[[str, int, float], None] | None) -> None:
        self.schedule.on_wave = fn

    @property
    def sync_waves(self) -> bool:
        return self.schedule.sync_waves

    @sync_waves.setter
    def sync_waves(self, on: bool) -> None:
        self.schedule.sync_waves = on

    @property
    def slice_ranges(self) -> bool:
        """Each slice's forward and backward inside a named profiler / NVTX range (runtime/schedule.py)."""
        return self.schedule.slice_ranges

    @slice_ranges.setter
    def slice_ranges(self, on: bool) -> None:
        self.schedule.slice_ranges = on

    @property
    def units(self) -> list[str]:
        """The parameter units this rank holds (checkpoint names; ``shards`` has the runtime's, TP shards
        included: runtime/tp_shards.py), frozen ones included."""
        return sorted(set(self.keys.canonical_units().values()) | set(self.frozen.units))

    @property
    def shards(self):
        """unit -> its flat layout and this rank's shard of it (runtime/shards.py)."""
        return self.master_optimizer.shards

    @property
    def masters(self) -> dict[str, torch.nn.Parameter]:
        """unit -> fp32 master shard (the whole unit at zero_stage 0)."""
        return self.master_optimizer.masters

    @property
    def optimizer(self) -> torch.optim.AdamW | None:
        return self.master_optimizer.adamw

    @property
    def direct_units(self) -> list[str]:
        return self.binding.units

    @property
    def generic_keys(self) -> dict[str, list[str]]:
        """slice id -> keys of its units that are not direct (exported and loaded back every step)."""
        return self.binding.generic_keys

    def params_norm(self) -> float:
        """The global L2 norm of the fp32 master weights, each element of the model counted once whatever its
        replication, TP split or ZeRO sharding (the rule of the gradient norm: clip.py). Collective over the
        world (--log-params-norm)."""
        with torch.no_grad():
            counted = norm_tensors({u: p.detach() for u, p in self.masters.items()}, self.sync_groups, self.rank,
                                   self.zero_stage >= 1)
            counted += self.frozen.norm_tensors()
            return global_norm(counted, self.device, "the parameter-norm all-reduce (--log-params-norm)")

    # ------------------------------------------------------------------------------------------- step
    def train_step(self, step: int) -> dict[str, float]:
        """Forward, backward, gradient sync, norm and clipping, AdamW. Returns the per-task losses (the same on
        every rank); ``last_step`` says what the step did (grad norm, loss scale, skipped)."""
        scaler = self.config.grad_scaler
        self.schedule.loss_scale = float(scaler.scale) if scaler is not None else 1.0
        losses = self.forward_backward(step)
        t0 = self._clock()
        grads, clipper = self._main_grads()
        try:
            return self._step(step, losses, grads, clipper, t0)
        finally:
            if self._cast_grads:  # the fp32 copies live for the step only
                self.master_optimizer.detach_grads()

    def _step(self, step: int, losses: dict[str, float], grads: dict[str, torch.Tensor], clipper: GradClipper,
              t0: float) -> dict[str, float]:
        """``train_step`` after the forward-backward: unscale, measure and clip ``grads``, AdamW, weights out."""
        scaler = self.config.grad_scaler
        self.last_step = prepare_step(clipper, self.master_optimizer.clip_grad, self.schedule.loss_scale,
                                      scaler, measure=self.config.check_for_nan)  # collective when it measures
        t1 = self._clock()
        self._add_time("optimizer-clip-main-grad", t1 - t0)
        if self.config.check_for_nan:
            check_finite(losses, self.last_step, step, scaled=scaler is not None)
        if self.config.count_zeros and not self.last_step.skipped:  # every rank alike: the norm is global
            self.last_step = dataclasses.replace(self.last_step, num_zeros=clipper.zeros())
        if self.optimizer is None or self.last_step.skipped:
            return losses  # a skipped step issues no all-gather
        overlap = self.param_gather is not None
        progress.point("the optimizer step (issuing the overlapped all-gathers)" if overlap else
                       "the optimizer step (distributed-optimizer all-gathers)" if self.zero_stage >= 1 else
                       "the optimizer step")
        self.flush_param_gather()  # nothing is pending after a forward; kept for direct callers
        self.master_optimizer.step(grads)
        t2 = self._clock()
        if overlap:  # issued now, waited for before each slice's next forward (runtime/param_gather.py)
            self.param_gather.start()
        elif self.weight_shards is not None:
            self._push_weight_shards()
        elif self.zero_stage >= 1:
            self._push_gathered_weights()
        elif any(self.generic_keys.values()):
            self._push_weights(self.master_optimizer.full_weights())
        t3 = self._clock()
        self._add_time("optimizer-inner-step", t2 - t1)
        self._add_time("optimizer-copy-main-to-model-params", t3 - t2)
        self._add_time("optimizer", t3 - t0)
        return losses

    def forward_backward(self, step: int) -> dict[str, float]:
        """One step without the optimizer; afterwards ``grads`` holds the synchronised full gradients (times the
        loss scale until ``train_step`` unscales them); at zero_stage 1 to 3 it is empty and ``grad_buffers.unit_grads``
        are this rank's shards (``gather_grads``)."""
        tasks = sorted({ls.slice.task for ls in self.local.values()})
        t0 = self._clock()
        batches = {t: self.batch_fn(self.workload, t, step, self.config.data_seed) for t in tasks}
        self._add_time("batch-generator", self._clock() - t0)
        from megatron_spindle.models.dropout import draw_position  # models/ imports megatron-core (slow)

        self.grad_sync.start_step()
        cues = (self._slice_done, self._micro_start, self._before_forward, self._segment_start)
        meter = SavedTensorMeter(p for ls in self.local.values() for p in ls.op.parameters()) \
            if self.config.measure_activations else contextlib.nullcontext()
        with draw_position(self.config.dropout_seed, step), meter:  # recomputation in the backward draws alike
            losses = self.schedule.run(batches, *cues)
        if self.config.measure_activations:
            self.activation_peak = meter.peak
        t1 = self._clock()
        self.grad_sync.finish()
        t2 = self._clock()
        self._add_time("forward-backward", t1 - t0)
        self._add_time("all-grads-sync", t2 - t1)
        self.grads = dict(self.grad_buffers.key_grads)
        return losses()

    def evaluate(self, step: int, batch_fn: Callable | None = None) -> dict[str, float]:
        """Per-task losses of one forward-only pass through the wave schedule on the batches of ``step``
        (``batch_fn(workload, task, step, seed)``, default the engine's): no gradients, no gradient sync, no
        optimizer, no ``on_wave``. Collective like a training step (every rank calls it)."""
        fn = batch_fn or self.batch_fn
        tasks = sorted({ls.slice.task for ls in self.local.values()})
        batches = {t: fn(self.workload, t, step, self.config.data_seed) for t in tasks}
        ops = [ls.op for ls in self.local.values()]
        for op in ops:  # megatron-core's dropout (and nothing else of ours) reads the mode
            op.eval()
        try:
            with torch.no_grad():
                return self.schedule.evaluate(batches, self._before_forward)()
        finally:
            for op in ops:
                op.train()

    def gather_grads(self) -> dict[str, torch.Tensor]:
        """The synchronised full gradients of every key this rank holds ("<unit>.<path>" -> tensor), as after
        the last ``forward_backward`` / ``train_step``: ``grads`` itself, or at zero_stage 1 to 3 its shards
        all-gathered (collective over the parameter device groups there; for tests and inspection)."""
        if not self.grad_buffers.sharded:
            full = dict(self.grads)
        else:  # no flush: the gradient shards are not what the pending weight gathers read or write, and these
            # gathers queue behind them on the same process groups, in the same order on every member
            full = self.master_optimizer.gather_full(self.grad_buffers.unit_grads)
        return {k: t.clone() for k, t in self.keys.canonical([full], self.groups)[0].items()}

    def held_grad_bytes(self) -> int:
        """Bytes of gradient storage this rank holds now: the gradient buffers (at zero_stage 1 to 3 the shards and
        any bucket's full storage not yet released) and the gradients left in the operators' parameters."""
        held = self.grad_buffers.held_bytes()
        seen = {t.untyped_storage().data_ptr() for t in self.grad_buffers.storage()}  # counted already
        for ls in self.local.values():
            for p in ls.op.parameters():
                g = p.grad
                if g is not None and g.untyped_storage().data_ptr() not in seen:
                    seen.add(g.untyped_storage().data_ptr())
                    held += g.untyped_storage().nbytes()
        return held

    def _clock(self) -> float:
        if self.phase_times is None:
            return 0.0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _add_time(self, name: str, seconds: float) -> None:
        if self.phase_times is not None:
            self.phase_times[name] = self.phase_times.get(name, 0.0) + seconds

    def _micro_start(self, index: int) -> None:
        """The schedule's cue before each micro-batch: its dropout masks, and the gradient sync's count."""
        from megatron_spindle.models.dropout import set_micro_batch

        set_micro_batch(index)
        self.grad_sync.micro_start(index)

    def _segment_start(self, index: int) -> None:
        """The schedule's cue before each segment of the order: the gradient sync's round (per segment at ZeRO 2
        and 3)."""
        self.grad_sync.segment_start(index)

    def _sync_rounds(self) -> list[list[Bucket]] | None:
        """The gradient rounds of a synced micro-batch (plan/buckets.py ``synced_rounds``), each the buckets it
        reduces in its launch order, with their completion there (a TP shard completes with its unit); None for
        one round (every bucket, in ``launch_order``)."""
        rounds = synced_rounds([w.slices for w in self.plan.waves], self.metagraph.metaops, self.plan.settings,
                               self.grad_buffers.buckets, base_unit)
        if rounds is None:
            return None
        return [[dataclasses.replace(b, done=done) for b, done in r] for r in rounds]

    def _before_forward(self, ls) -> None:
        """The schedule's cue before a local slice's forward: with --overlap-param-gather, load what of it no
        layer hook loads (each layer waits for its own bucket: runtime/param_gather.py); otherwise nothing."""
        if self.param_gather is not None:
            self.param_gather.before_forward(ls)
        elif self._redistribution is not None and self._redistribution.pending:
            self._land_redistributed(self._redistribution.pending_for(self._slice_runtime_units[ls.slice.id]))

    def _slice_done(self, ls) -> None:
        """The schedule's cue after a local slice's backward: at ZeRO-3 its weights are released (what the layers'
        own hooks left), then its gradients go to the gradient sync."""
        if self.weight_shards is not None:
            self.weight_shards.after_backward(ls)
        self.grad_sync.slice_done(ls)

    def _timed_gather(self, wait_and_load) -> None:
        t0 = self._clock()
        wait_and_load()
        self._add_time("params-all-gather", self._clock() - t0)  # Megatron's timer name

    def flush_param_gather(self) -> None:
        """Finish the overlapped weight all-gather now (wait for every pending gather, load every unit):
        afterwards every operator holds the masters' weights. A no-op without --overlap-param-gather or when
        nothing is pending. Never communicates beyond waiting for gathers every member issued at its step."""
        if self.param_gather is not None and self.param_gather.pending:
            self.param_gather.flush()
        if self._redistribution is not None and self._redistribution.pending:
            self._land_redistributed(self._redistribution.pending_buckets)

    def _push_weights(self, full: dict[str, torch.Tensor]) -> None:
        """Load the masters into the operators that hold generic units (direct ones alias their masters)."""
        for ls in in_wave_order(self.local):
            if self.generic_keys[ls.slice.id]:
                with self._loading(ls):
                    ls.keys.load(ls.op, {k: full[k] for k in ls.param_keys})

    def _push_gathered_weights(self) -> None:
        """ZeRO-1/2 without --overlap-param-gather: every bucket's updated weights all-gathered in turn
        (``streamed_gathers``) and loaded into every local operator holding them."""
        for units, full in streamed_gathers(self.master_optimizer, self._gathered_buckets, self.config.dtype):
            for u in units:
                for ls, keys in self._holders.get(u, ()):
                    ls.keys.load(ls.op, {k: full[k] for k in keys}, strict=False)

    def _weight_redistribution(self, gathered: set[str]) -> WeightRedistribution:
        """ZeRO-3: the redistribution of the regathered units after the step (runtime/weight_redistribution.py).
        Gather units whose parameters are master tensors as they are get their shards' pieces (their parts leave
        ``_gathered_keys``); every other part's runtime units are needed whole. Every rank's needs are exchanged
        here: collective over the world, on every rank at ZeRO-3."""
        shards = self.master_optimizer.shards
        fed = []
        for sid, units in self.weight_shards.units.items():
            ls = self.local[sid]
            for g in units:
                if g.unit is not None or g.keys is None or (sid, g.name) not in self._gathered_keys:
                    continue  # aligned (stepped in place), not told apart, or not regathered
                segments = gather_unit_segments(g.keys, g.params, *g.bounds,
                                                functools.partial(self._master_place, ls, gathered))
                if segments is not None:
                    fed.append((g, segments))
                    del self._gathered_keys[sid, g.name]
        shared = [(d, units) for d, units in self._gathered_buckets if len(d) > 1]  # one device: its masters whole
        moved = {u for _, units in shared for u in units}
        whole = {self.key_unit[k] for keys in self._gathered_keys.values() for k in keys} & moved
        needs: dict[str, list[tuple[int, int]]] = {u: [(0, shards[u].numel)] for u in whole}
        for _, segments in fed:
            for seg in segments:
                needs.setdefault(seg.unit, []).append((seg.lo, seg.hi))
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, {u: merged(ranges) for u, ranges in needs.items()})
        return WeightRedistribution(shared, shards, every, self.rank, self.groups.param_group, fed, whole)

    def _master_place(self, ls, gathered: set[str], key: str) -> tuple[str, int, torch.Size] | None:
        """Where a slice's parameter ``key`` (canonical) lies in its runtime unit's flat master vector: (unit,
        offset, shape); None where the operator's tensor is not that master tensor as it is (a TP part of
        another degree than its unit's shards, a whole key of a TP-split tensor) or its unit is not regathered."""
        keys = ls.keys
        rk = keys.runtime_of.get(key, key)
        if (rk in keys.split and key not in keys.own) or key in keys.placed:
            return None
        unit = self.key_unit.get(rk)
        if unit not in gathered:
            return None
        sh = self.master_optimizer.shards[unit]
        i = sh.keys.index(rk)
        return unit, sum(shape.numel() for shape in sh.shapes[:i]), sh.shapes[i]

    def _push_weight_shards(self) -> None:
        """ZeRO-3 after the step: the aligned units' weight shards from their masters (no communication), the
        others' redistributed bucket by bucket (plan/buckets.py ``regathered_groups``;
        runtime/weight_redistribution.py; a one-device group's master is whole, loaded as it is): a fed gather
        unit's shard is written in place, any other part loaded from its units' full weights unit by unit, each
        slice keeping its shard: a rank holds one unit's weights at full size at a time, as in the forward. A
        slice gathered whole (weight_shards.py ``whole``) is loaded once all of its keys are in, and a unit once
        its TP shards and its replicated tensors are. With --overlap-param-gather the all-to-alls are only issued
        here; each local slice's buckets are landed just before its next forward (``_before_forward``)."""
        self.weight_shards.update_from_masters(self.master_optimizer.masters)
        redistribution = self._redistribution
        redistribution.prepare()
        self._waiting = {}
        own = [(d, units) for d, units in self._gathered_buckets if len(d) == 1]  # views of the masters, no copy
        for units, full in streamed_gathers(self.master_optimizer, own, self.config.dtype):
            self._load_regathered(units, full)
        if self._defer_redistribution:  # --overlap-param-gather: each slice's buckets landed before its forward
            redistribution.start(self.master_optimizer.masters, self.config.dtype)
            return
        for units, full in redistribution.stream(self.master_optimizer.masters, self.config.dtype):
            self._load_regathered(units, full)

    def _land_redistributed(self, buckets: list[int]) -> None:
        """ZeRO-3 with --overlap-param-gather: wait for these pending buckets of the redistribution and load what
        they bring (``_load_regathered``), under the engine's params-all-gather timer."""
        def land() -> None:
            for i in buckets:
                self._load_regathered(*self._redistribution.land(i))
        self._timed_gather(land)

    def _load_regathered(self, units, full: dict[str, torch.Tensor]) -> None:
        """ZeRO-3: one bucket's regathered weights into the parts that load them whole (``full``; a fed gather
        unit's shard is written already), each part once all of its keys are in."""
        ws = self.weight_shards
        for u in units:
            for ls, keys in self._holders.get(u, ()):
                part = (ls.slice.id, None if ls.slice.id in ws.whole else base_unit(u))
                if part not in self._gathered_keys:
                    continue  # fed: its shard is written
                tensors = self._waiting.setdefault(part, {})
                tensors.update({k: full[k] for k in keys})
                if len(tensors) == len(self._gathered_keys[part]):
                    with ws.loading(ls, aligned_too=False, unit=part[1]):
                        ls.keys.load(ls.op, self._waiting.pop(part), strict=False)

    def _loading(self, ls):
        """Around writing full weights into a slice's operator: at ZeRO-3 it keeps its shards of them."""
        return self.weight_shards.loading(ls) if self.weight_shards is not None else contextlib.nullcontext()

    def close(self) -> None:
        """Tear the engine down so that another can be built in this process (a task-set change): destroy the
        process groups it created (not a cache passed in as ``groups``) after a world barrier, so that no rank
        is still in one of their collectives. Collective; the engine is unusable afterwards. megatron-core keeps
        no state of ours: the operators took their groups explicitly; its global memory buffer (reused by name)
        and ``model-parallel-rng`` tracker stay, as they would over a run."""
        if getattr(self, "_closed", False):
            return
        self.flush_param_gather()  # no gather may still be in flight on a group about to be destroyed
        if self.param_gather is not None:
            self.param_gather.close()
        if self.weight_shards is not None:
            self.weight_shards.close()
        dist.barrier()
        if self._owns_groups:
            self.groups.cache.destroy()
        self.local, self.grads = {}, {}
        self._closed = True

    # ------------------------------------------------------------------------------------------ state
    def set_lr(self, lr: float) -> None:
        """Learning rate of the next optimizer steps."""
        self.master_optimizer.set_lr(lr)

    def set_weight_decay(self, weight_decay: float) -> None:
        """AdamW's weight decay of the next optimizer steps (biases and 1-D parameters stay spared where the
        optimizer spares them)."""
        self.master_optimizer.set_weight_decay(weight_decay)

    def set_loss_weights(self, weights: dict[str, float]) -> None:
        """Loss weight w_t of each named task for the next steps (0: the task sits out); others keep theirs."""
        unknown = sorted(set(weights) - {t.name for t in self.workload.tasks})
        if unknown:
            raise KeyError(f"set_loss_weights: unknown tasks {unknown}")
        self.schedule.loss_weights.update({t: float(w) for t, w in weights.items()})

    def optimizer_numel(self) -> dict[str, tuple[int, int]]:
        """unit -> (fp32 elements of its master shard on this rank, elements of the full unit). Each of the
        master, exp_avg and exp_avg_sq has the shard's size."""
        return self.master_optimizer.numel()

    def expected_shapes(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """unit -> {"<unit>.<path>": full shape} for every unit this rank holds."""
        return {**self.keys.expected_shapes(), **self.frozen.expected_shapes()}

    def full_state(self) -> dict[str, torch.Tensor]:
        """Full master weights this rank holds ("<unit>.<path>" -> tensor). Collective at zero_stage 1 to 3 and
        with TP-sharded gradients."""
        self.flush_param_gather()
        full = self.keys.canonical([self.master_optimizer.full_weights()], self.groups)[0]
        return {**{k: v.clone() for k, v in full.items()}, **self.frozen.export()}

    def load_full_state(self, state: dict[str, torch.Tensor]) -> None:
        """Overwrite the weights this rank holds (keys it does not hold are ignored; missing keys raise)."""
        keys = self.keys.canonical_keys()
        missing = sorted((set(keys) | set(self.frozen.unit_of)) - set(state))
        if missing:
            raise KeyError(f"load_full_state: missing {missing[:5]}")
        self.frozen.load(state)
        self.flush_param_gather()  # a gather finishing later would overwrite what is loaded here
        full = self.keys.to_runtime({k: state[k].detach().to(self.device, torch.float32) for k in keys})
        self.master_optimizer.load_weights(full)
        self._push_weights(full)

    def export_units(self) -> dict[str, UnitState]:
        """Every unit this rank holds in full form: fp32 weights and AdamW state (``optim`` empty before the
        first step), whatever the zero stage and gradient layout. Collective over the parameter device groups at
        zero_stage 1-3 and with TP-sharded gradients."""
        self.flush_param_gather()
        units = self.keys.canonical_unit_states(self.master_optimizer.export_units(), self.groups)
        frozen = self.frozen.export()
        for k, unit in self.frozen.unit_of.items():  # weights alone: a frozen unit has no optimizer state
            units.setdefault(unit, UnitState({})).model[k] = frozen[k]
        return units

    def load_units(self, units: dict[str, UnitState], load_optim: bool = True) -> None:
        """Load the weights (and AdamW state) of every unit this rank holds from their full forms; each rank
        keeps its own shard. A unit without optimizer state starts AdamW afresh. Never communicates."""
        missing = sorted(set(self.units) - set(units))
        if missing:
            raise KeyError(f"load_units: missing units {missing[:5]}")
        self.load_full_state({k: v for u in self.units for k, v in units[u].model.items()})
        if load_optim:
            held = {u: units[u] for u in self.units}
            self.master_optimizer.load_optimizer_state(self.keys.runtime_unit_states(held, self.key_unit))
