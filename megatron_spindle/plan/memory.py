"""Per-device memory of a plan: the one set of rules the planners, the assembler and the simulator apply.

Mixed-precision training with Adam holds, per parameter: a bf16 weight (``WEIGHT_BYTES_PER_PARAM``), a main
gradient (``GRAD_BYTES_PER_PARAM`` in fp32; 2 bytes where gradients are reduced in bf16, the plan's
``grad_reduce_dtype``), and an fp32 master weight with the two Adam moments (``OPTIMIZER_BYTES_PER_PARAM``).
The byte numbers of a unit (its training state on one TP rank) and of a slice's activations come from the
estimator's ``MemoryModel`` (``MemoryNumbers``); the rules are here:

- **Parameter state, once per unit.** A device holds the state of every unit it runs once. A unit run by
  several slices on one device (MetaOps sharing weights, a tower in several waves) counts at its largest
  share: the slice with the smallest TP degree (a TP shard of a unit is part of the whole unit) and, under
  ZeRO, the smallest data-parallel degree.
- **ZeRO** shards over the slice's data-parallel ranks: stage 1 the optimizer state, stage 2 also the
  gradients, stage 3 also the weights (``zero_state_bytes_per_param``).
- **Activations** are held from a slice's forward to its backward: each forward allocates them on every device
  of the slice, each backward frees them, and a device's activation memory is the peak over the plan's
  execution order (``plan/order.py``): with one segment, everything until the first backward; with segments
  or an early backward, the worst point. What a slice holds depends on its recomputation
  (``settings.recompute_of``); a slice that recomputes also needs, during its backward, the activations of
  the layer it is recomputing (``SliceMemory.transient``). With ``micro_batches`` m every slice runs on B/m
  samples at a time, and a micro-batch's activations are freed before the next one starts.
- **ZeRO-3's gathered weights.** While a slice with several DP ranks runs, a device also holds the full weights
  (its TP shard) of ``GATHERED_LAYERS`` layers: the one running and the next one, prefetched
  (runtime/weight_shards.py). They count as transient (``gathered_weight_bytes``); a slice's backward sees the
  same activations live as the end of its forward, so its transient covers both.

- **Staged gradients (ZeRO 2 and 3).** A rank that keeps only gradient shards adds a unit's gradients into a
  full-size staging buffer, released when the unit's collective has run after the backward that completes it
  in its gradient round (runtime/grad_shards.py; a round per segment, plan/buckets.py ``sync_rounds``). Where a
  device's first backward accumulating a unit comes earlier in the order than the round's backward completing
  it (a tower shared by tasks of an early backward and a later one, or by two waves of one segment), that
  buffer (the unit's gradient, the device's TP shard) is held in between, beside the next forwards'
  activations (``staged_gradients``). The staging inside one backward, between a bucket's first gradient and
  its collective, is not counted.
- **bf16 main gradients** are copied into fp32 ones for the optimizer step (``step_cast_bytes``), after the
  backward: they count where they exceed the activation peak.

A device's predicted memory is its parameter state plus its activation peak (or its step's copies).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from megatron_spindle.graph.opgraph import MetaOp
from megatron_spindle.plan.buckets import wave_rounds
from megatron_spindle.plan.layout import (
    SliceGeometry,
    device_programs,
    held_units,
    micro_batch_metaop,
    weight_scope,
    weight_shard_degree,
)
from megatron_spindle.plan.order import FWD, SliceStep, slice_order
from megatron_spindle.plan.schema import ExecutionSettings, Plan, Recompute

WEIGHT_BYTES_PER_PARAM = 2  # bf16 weight
GRAD_BYTES_PER_PARAM = 4  # fp32 main gradient (--grad-reduce-in-bf16: the plan's grad_reduce_bytes, 2)
FP32_BYTES = 4
OPTIMIZER_BYTES_PER_PARAM = 4 + 4 + 4  # fp32 master weight, Adam m and v
STATE_BYTES_PER_PARAM = WEIGHT_BYTES_PER_PARAM + GRAD_BYTES_PER_PARAM + OPTIMIZER_BYTES_PER_PARAM
GATHERED_LAYERS = 2  # ZeRO-3: the layer running and the next one's weights, prefetched (runtime/weight_shards.py)


def grad_bytes_of(numbers) -> int:
    """Main-gradient bytes per parameter that memory numbers count (their ``grad_bytes``; stand-ins without
    one: fp32's)."""
    return getattr(numbers, "grad_bytes", GRAD_BYTES_PER_PARAM)


def is_frozen_unit(numbers, unit: str) -> bool:
    """Whether memory numbers hold ``unit`` frozen (their ``is_frozen_unit``; stand-ins without one: trained)."""
    frozen = getattr(numbers, "is_frozen_unit", None)
    return frozen is not None and frozen(unit)


class MemoryNumbers(Protocol):
    """Byte numbers of the estimator's ``MemoryModel``: a unit's whole training state on one of ``tp`` ranks
    (no ZeRO sharding), and what ``num_layers`` operators of a MetaOp run at (tp, dp) keep for the backward.
    Numbers that know recomputation also have ``activation_memory(metaop, tp, dp, num_layers, recompute) ->
    (held, transient)``; others (test stand-ins) hold ``activation_bytes`` and need nothing more."""

    def param_state_bytes(self, unit: str, tp: int) -> float: ...

    def activation_bytes(self, metaop: MetaOp, tp: int, dp: int, num_layers: int) -> float: ...


def state_bytes_per_param(grad_bytes: int = GRAD_BYTES_PER_PARAM) -> int:
    """A unit's unsharded training-state bytes per parameter with main gradients of ``grad_bytes``."""
    return WEIGHT_BYTES_PER_PARAM + grad_bytes + OPTIMIZER_BYTES_PER_PARAM


def zero_state_bytes_per_param(stage: int, dp: int, tp: int = 1, tp_sharded: bool = True,
                               grad_bytes: int = GRAD_BYTES_PER_PARAM, weight_dp: int | None = None) -> float:
    """Training-state bytes per parameter of a TP shard on one device under ZeRO ``stage`` with ``dp``
    data-parallel ranks, main gradients of ``grad_bytes``. ``tp_sharded`` False (plan/schema.py
    ``ExecutionSettings.tp_sharded_grads``: our runtime's canonical layout): a device holds the whole unit's
    gradient at stages 0 and 1, and its whole optimizer state at stage 0, t times a shard's at TP t; the ZeRO
    shards of the whole unit span the group's members, at least tp x dp, so they weigh no more than a shard's
    over dp. ``weight_dp``: at stage 3, the devices the weights are sharded over where that is not ``dp``
    (plan/layout.py ``weight_shard_degree``: node-local weight shards)."""
    w, g, o = WEIGHT_BYTES_PER_PARAM, grad_bytes, OPTIMIZER_BYTES_PER_PARAM
    whole = 1 if tp_sharded else tp
    if stage == 0:
        return w + (g + o) * whole
    if stage == 1:
        return w + g * whole + o / dp
    if stage == 2:
        return w + (g + o) / dp
    return w / (weight_dp or dp) + (g + o) / dp


def zero_sharded_bytes(state: float, stage: int, dp: int, tp: int = 1, tp_sharded: bool = True,
                       frozen: bool = False, grad_bytes: int = GRAD_BYTES_PER_PARAM,
                       weight_dp: int | None = None) -> float:
    """One device's share of ``state`` (a unit's unsharded training state on a TP rank of ``tp``, main gradients
    of ``grad_bytes``) under ZeRO and the gradients' layout (``zero_state_bytes_per_param``). A ``frozen`` unit's
    state is its weights alone (``unit_state_bytes``), which every slice holding it keeps whole
    (runtime/frozen.py): nothing to shard."""
    if frozen:
        return state
    per_param = zero_state_bytes_per_param(stage, dp, tp, tp_sharded, grad_bytes, weight_dp)
    whole = state_bytes_per_param(grad_bytes)
    if per_param == whole:  # nothing sharded, nothing whole: the state as it is, to the bit
        return state
    return state * per_param / whole


def unit_state_bytes(params: float, frozen: bool = False, grad_bytes: int = GRAD_BYTES_PER_PARAM) -> float:
    """A unit's training state for ``params`` parameters: bf16 weights, main gradient (``grad_bytes``), fp32
    master and Adam moments; a frozen unit's (no gradient, no optimizer state) its bf16 weights."""
    return params * (WEIGHT_BYTES_PER_PARAM if frozen else state_bytes_per_param(grad_bytes))


def grad_reduce_bytes(params: float, settings: ExecutionSettings) -> float:
    """Bytes a gradient all-reduce of ``params`` parameters moves per replica under the plan's settings."""
    return params * settings.grad_reduce_bytes


@dataclass(frozen=True)
class ZeroSharded:
    """``MemoryNumbers`` under a plan's ZeRO stage and gradient layout (``param_state_bytes(unit, tp, dp)`` is one
    device's share) and its sequence-parallel setting (the activations of the slices where it applies; None: the
    numbers' own)."""

    numbers: MemoryNumbers
    zero_stage: int
    sequence_parallel: bool | None = None
    tp_sharded: bool = True  # ExecutionSettings.tp_sharded_grads
    weight_scope: int | None = None  # plan/layout.py ``weight_scope``: node-local ZeRO-3 weight shards

    @classmethod
    def of(cls, numbers: MemoryNumbers, settings: ExecutionSettings, gpus_per_node: int = 0) -> ZeroSharded:
        """``gpus_per_node``: the plan's, where ``settings.node_local_weights`` confines the weights' shards."""
        scope = weight_scope(settings.node_local_weights, gpus_per_node) if gpus_per_node else None
        if settings.node_local_weights and scope is None:
            raise ValueError("node-local weight shards: the plan's gpus_per_node is needed")
        return cls(numbers, settings.zero_stage, settings.sequence_parallel, settings.tp_sharded_grads, scope)

    @property
    def grad_bytes(self) -> int:
        """Main-gradient bytes per parameter: the numbers' (their unsharded state counts them)."""
        return grad_bytes_of(self.numbers)

    def is_frozen_unit(self, unit: str) -> bool:
        return is_frozen_unit(self.numbers, unit)

    def param_state_bytes(self, unit: str, tp: int, dp: int = 1, weight_dp: int | None = None) -> float:
        return zero_sharded_bytes(float(self.numbers.param_state_bytes(unit, tp)), self.zero_stage, dp, tp,
                                  self.tp_sharded, self.is_frozen_unit(unit), self.grad_bytes, weight_dp)

    def activation_bytes(self, metaop: MetaOp, tp: int, dp: int, num_layers: int) -> float:
        return self.numbers.activation_bytes(metaop, tp, dp, num_layers)

    @property
    def activation_memory(self):
        """The numbers' ``activation_memory`` under this sequence-parallel setting (None when they have none)."""
        memory = getattr(self.numbers, "activation_memory", None)
        if memory is None or self.sequence_parallel is None:
            return memory
        return functools.partial(memory, sequence_parallel=self.sequence_parallel)


class ShardedNumbers(Protocol):
    """Numbers with the ZeRO stage applied: the estimator's ``MemoryModel`` (its own stage) or ``ZeroSharded``."""

    def param_state_bytes(self, unit: str, tp: int, dp: int) -> float: ...

    def activation_bytes(self, metaop: MetaOp, tp: int, dp: int, num_layers: int) -> float: ...


class SliceMemory(NamedTuple):
    units: dict[str, float]  # unit -> parameter-state bytes on one device of the slice
    activations: float  # bytes one device holds from the slice's forward to its backward
    transient: float = 0.0  # bytes beyond those its backward needs at once (a layer being recomputed)


def slice_weight_dp(numbers: ShardedNumbers, s: SliceGeometry) -> int:
    """The devices slice ``s`` shards its weights over at ZeRO-3 under ``numbers`` (their ``weight_scope``:
    node-local shards; plan/layout.py ``weight_shard_degree``): its DP degree without a scope."""
    return weight_shard_degree(s, getattr(numbers, "weight_scope", None))


def gathered_weight_bytes(numbers: ShardedNumbers, metaop: MetaOp, tp: int, dp: int, num_layers: int,
                          weight_dp: int | None = None) -> float:
    """Bytes of gathered full weights a device of a slice holds while it runs: at ZeRO-3 with its weights
    sharded over several devices (``weight_dp``, default ``dp``: ``slice_weight_dp``), ``GATHERED_LAYERS`` of
    its layers' (one layer's, for a one-layer slice); 0 otherwise."""
    if getattr(numbers, "zero_stage", 0) != 3 or (weight_dp or dp) == 1 or not metaop.params:
        return 0.0
    layer = sum(float(numbers.param_state_bytes(u, tp, 1)) for u in metaop.params[0])  # dp 1: unsharded
    whole = state_bytes_per_param(grad_bytes_of(numbers))
    return min(GATHERED_LAYERS, num_layers) * layer * WEIGHT_BYTES_PER_PARAM / whole


def activation_memory(numbers: ShardedNumbers, metaop: MetaOp, tp: int, dp: int, num_layers: int,
                      recompute: Recompute | None = None, weight_dp: int | None = None) -> tuple[float, float]:
    """(held, transient) bytes of ``num_layers`` operators of the MetaOp under ``recompute`` (None: the numbers'
    own default); the transient includes ZeRO-3's gathered weights (``gathered_weight_bytes``)."""
    gathered = gathered_weight_bytes(numbers, metaop, tp, dp, num_layers, weight_dp)
    memory = getattr(numbers, "activation_memory", None)
    if memory is None:
        return float(numbers.activation_bytes(metaop, tp, dp, num_layers)), gathered
    held, transient = memory(metaop, tp, dp, num_layers, recompute)
    return float(held), float(transient) + gathered


def slice_memory(metaop: MetaOp, s: SliceGeometry, numbers: ShardedNumbers, recompute: Recompute | None = None,
                 micro_batches: int = 1) -> SliceMemory:
    weight_dp = slice_weight_dp(numbers, s)
    shards = {} if weight_dp == s.dp else {"weight_dp": weight_dp}  # node-local ZeRO-3 weight shards
    units = {u: float(numbers.param_state_bytes(u, s.tp, s.dp, **shards))
             for u in held_units(metaop, s.layer_start, s.layer_end)}
    held, transient = activation_memory(numbers, micro_batch_metaop(metaop, micro_batches), s.tp, s.dp,
                                        s.layer_end - s.layer_start, recompute, weight_dp)
    return SliceMemory(units, held, transient)


def step_cast_bytes(numbers: ShardedNumbers, unit: str, tp: int, dp: int) -> float:
    """Bytes of the fp32 copy of a unit's bf16 main gradients (``--grad-reduce-in-bf16``) that the optimizer step
    makes on a device of a slice at (tp, dp) (runtime/engine.py ``_main_grads``; Megatron-LM copies its bf16
    main grads into fp32 ones too): the TP rank's whole gradient at ZeRO 0, the rank's shard at higher stages;
    none for fp32 gradients or a frozen unit. Made after the backward, freed by the step: never beside the
    activations."""
    grad_bytes = grad_bytes_of(numbers)
    if grad_bytes >= FP32_BYTES or is_frozen_unit(numbers, unit):
        return 0.0
    params = float(numbers.param_state_bytes(unit, tp, 1)) / state_bytes_per_param(grad_bytes)
    return params * FP32_BYTES / (1 if getattr(numbers, "zero_stage", 0) == 0 else dp)


class DeviceMemory:
    """Bytes per device as slices run: each unit's state once (its largest share), activations allocated by a
    forward and freed by its backward (which may need ``transient`` bytes more while it runs), and the
    activation peak."""

    def __init__(self, num_devices: int, capacity: float = float("inf")):
        self.capacity = capacity
        self.held: list[dict[str, float]] = [{} for _ in range(num_devices)]
        self.params = [0.0] * num_devices
        self.live = [0.0] * num_devices
        self.peak = [0.0] * num_devices

    def total(self, device: int) -> float:
        return self.params[device] + self.peak[device]

    def totals(self) -> list[float]:
        return [self.total(d) for d in range(len(self.params))]

    def free(self, device: int) -> float:
        return self.capacity - self.total(device)

    def shared_param_bytes(self, device: int, units: dict[str, float]) -> float:
        """Parameter state of these units the device already holds (weights co-location saves this)."""
        have = self.held[device]
        common = have.keys() & units.keys()
        return sum(min(units[u], have[u]) for u in common) if common else 0.0

    def need(self, device: int, sm: SliceMemory, shared: float | None = None) -> float:
        """How much the device's total grows when it runs the slice's forward next (``shared``: its
        ``shared_param_bytes``, where the caller has them)."""
        if shared is None:
            shared = self.shared_param_bytes(device, sm.units)
        extra = sum(sm.units.values()) - shared
        return extra + max(0.0, self.live[device] + sm.activations - self.peak[device])

    def forward(self, device: int, sm: SliceMemory) -> None:
        have = self.held[device]
        for u, b in sm.units.items():
            old = have.get(u, 0.0)
            if b > old:
                have[u] = b
                self.params[device] += b - old
        self.live[device] += sm.activations
        self.peak[device] = max(self.peak[device], self.live[device])

    def backward(self, device: int, sm: SliceMemory) -> None:
        self.peak[device] = max(self.peak[device], self.live[device] + sm.transient)
        self.live[device] -= sm.activations

    def copy(self) -> DeviceMemory:
        out = DeviceMemory(0, self.capacity)
        out.held = [dict(h) for h in self.held]
        out.params, out.live, out.peak = list(self.params), list(self.live), list(self.peak)
        return out


RecomputeOf = Callable[[int, int], "Recompute | None"]  # (wave, slice) -> the slice's recomputation


class StagedGradient(NamedTuple):
    """A unit's full gradient held on a device from step ``start`` of the order (its first backward there that
    accumulates it in a gradient round, counted from that backward's start) until after step ``end`` (the
    round's backward completing it), ``bytes`` large."""

    unit: str
    start: int
    end: int
    bytes: float


Rounds = Sequence[int]  # the gradient round of each wave (plan/buckets.py ``wave_rounds``)


def completion_steps(waves: Sequence[Sequence[SliceGeometry]], metaops: Mapping[str, MetaOp],
                     order: Sequence[SliceStep], rounds: Rounds | None = None) -> dict[tuple[int, str], int]:
    """(gradient round, unit) -> the index in ``order`` of the round's last backward step accumulating the
    unit's gradient (``rounds``: each wave's round, default one round)."""
    done: dict[tuple[int, str], int] = {}
    for k, (wi, si, phase) in enumerate(order):
        if phase != FWD:
            s = waves[wi][si]
            r = rounds[wi] if rounds else 0
            for u in held_units(metaops[s.metaop], s.layer_start, s.layer_end):
                done[r, u] = k
    return done


def staged_gradients(waves: Sequence[Sequence[SliceGeometry]], metaops: Mapping[str, MetaOp],
                     numbers: ShardedNumbers, order: Sequence[SliceStep], slices: Iterable[tuple[int, int]],
                     done: Mapping[tuple[int, str], int] | None = None,
                     rounds: Rounds | None = None) -> list[StagedGradient]:
    """The gradients a device running ``slices`` ((wave, slice) keys) stages across steps of ``order`` (module
    docstring): at ZeRO 2 and 3, per gradient round (``rounds``: each wave's, default one), each trained unit
    whose first accumulating backward on the device comes before the round's step completing it (``done``:
    ``completion_steps``, computed here when not given)."""
    if getattr(numbers, "zero_stage", 0) < 2:
        return []
    done = completion_steps(waves, metaops, order, rounds) if done is None else done
    mine = set(slices)
    grad_bytes = grad_bytes_of(numbers)
    whole = state_bytes_per_param(grad_bytes)
    out: dict[tuple[int, str], StagedGradient] = {}
    seen: set[tuple[int, str]] = set()
    for k, (wi, si, phase) in enumerate(order):
        if phase == FWD or (wi, si) not in mine:
            continue
        s = waves[wi][si]
        r = rounds[wi] if rounds else 0
        for u in held_units(metaops[s.metaop], s.layer_start, s.layer_end):
            if (r, u) in seen or is_frozen_unit(numbers, u):
                continue
            if (r, u) not in out and done[r, u] <= k:  # its first backward here completes it: staged within it
                seen.add((r, u))
                continue
            size = float(numbers.param_state_bytes(u, s.tp, 1)) / whole * grad_bytes  # dp 1: the whole TP shard
            old = out.get((r, u))
            out[r, u] = StagedGradient(u, k, done[r, u], size) if old is None \
                else old._replace(bytes=max(old.bytes, size))
    return list(out.values())


def default_slice_order(waves: Sequence[Sequence[SliceGeometry]], metaops: Mapping[str, MetaOp],
                        settings: ExecutionSettings | None = None) -> list[SliceStep]:
    """plan/order.py's slice order of placed waves (default: one segment), tasks read from the MetaOps."""
    return slice_order([[metaops[s.metaop].task for s in w] for w in waves], settings or ExecutionSettings())


def memory_breakdown(waves: Sequence[Sequence[SliceGeometry]], metaops: Mapping[str, MetaOp],
                     numbers: ShardedNumbers, num_devices: int, order: Sequence[SliceStep] | None = None,
                     recompute: RecomputeOf | None = None, micro_batches: int = 1,
                     rounds: Rounds | None = None,
                     done: Mapping[tuple[int, str], int] | None = None) -> list[tuple[float, float]]:
    """(parameter state, activation peak) bytes per device of placed waves run in ``order`` ((wave, slice,
    phase); default: one segment), each slice under ``recompute(wave, slice)`` (default: the numbers' own),
    the gradients staged per gradient round (``rounds``: each wave's, default one; ``done``: their
    ``completion_steps``, computed here when not given).
    With bf16 main gradients the optimizer step's fp32 copies of them (``step_cast_bytes``) count in the peak
    where they exceed the activations' (they are made after every backward).

    A device's memory depends only on the slices it runs (the order is global), so devices that run the same
    slices are accounted once (whole-cluster plans: once in all)."""
    if order is None:
        order = default_slice_order(waves, metaops)
    cache: dict[tuple[int, int], SliceMemory] = {}
    out = [(0.0, 0.0)] * num_devices
    if done is None:
        done = completion_steps(waves, metaops, order, rounds) if getattr(numbers, "zero_stage", 0) >= 2 else {}
    for program, devices in device_programs(waves, num_devices).items():
        mine = set(program)
        memory = DeviceMemory(1)
        staged, freed = _staging_changes(staged_gradients(waves, metaops, numbers, order, mine, done, rounds))
        for k, (wi, si, phase) in enumerate(order):
            memory.live[0] += staged.get(k, 0.0)  # from the backward that first adds to it (a backward of mine)
            if (wi, si) in mine:
                sm = cache.get((wi, si))
                if sm is None:
                    s = waves[wi][si]
                    sm = cache[(wi, si)] = slice_memory(metaops[s.metaop], s, numbers,
                                                        recompute(wi, si) if recompute else None, micro_batches)
                (memory.forward if phase == FWD else memory.backward)(0, sm)
            memory.live[0] -= freed.get(k, 0.0)
        cast = device_step_cast_bytes(waves, metaops, numbers, mine)
        for d in devices:
            out[d] = (memory.params[0], max(memory.peak[0], cast))
    return out


def _staging_changes(staged: Iterable[StagedGradient]) -> tuple[dict[int, float], dict[int, float]]:
    """Bytes staged from each step of the order on, and bytes released after each step."""
    start: dict[int, float] = {}
    end: dict[int, float] = {}
    for g in staged:
        start[g.start] = start.get(g.start, 0.0) + g.bytes
        end[g.end] = end.get(g.end, 0.0) + g.bytes
    return start, end


def device_step_cast_bytes(waves: Sequence[Sequence[SliceGeometry]], metaops: Mapping[str, MetaOp],
                           numbers: ShardedNumbers, slices: Iterable[tuple[int, int]]) -> float:
    """The optimizer step's fp32 gradient copies on a device running ``slices`` ((wave, slice) keys): each unit
    once, at its largest copy over them (``step_cast_bytes``)."""
    if grad_bytes_of(numbers) >= FP32_BYTES:  # fp32 gradients are the masters': no copies, nothing to walk
        return 0.0
    cast: dict[str, float] = {}
    for wi, si in slices:
        s = waves[wi][si]
        for u in held_units(metaops[s.metaop], s.layer_start, s.layer_end):
            cast[u] = max(cast.get(u, 0.0), step_cast_bytes(numbers, u, s.tp, s.dp))
    return sum(cast.values())


def peak_memory(waves: Sequence[Sequence[SliceGeometry]], metaops: Mapping[str, MetaOp], numbers: ShardedNumbers,
                num_devices: int, order: Sequence[SliceStep] | None = None, recompute: RecomputeOf | None = None,
                micro_batches: int = 1) -> list[float]:
    """Predicted bytes per device (parameter state + activation peak): ``memory_breakdown`` summed."""
    return [p + a for p, a in memory_breakdown(waves, metaops, numbers, num_devices, order, recompute, micro_batches)]


def plan_breakdown(plan: Plan, metaops: Mapping[str, MetaOp], numbers: MemoryNumbers) -> list[tuple[float, float]]:
    """(parameter state, activation peak) per device of a plan under its settings (ZeRO stage, order,
    recomputation per slice, micro-batches)."""
    settings = plan.settings
    waves = [w.slices for w in plan.waves]
    return memory_breakdown(waves, metaops, ZeroSharded.of(numbers, settings, plan.gpus_per_node),
                            plan.num_devices,
                            slice_order([[s.task for s in w] for w in waves], settings),
                            lambda wi, si: settings.recompute_of(waves[wi][si].id), settings.micro_batches,
                            wave_rounds(len(waves), settings))


def plan_memory(plan: Plan, metaops: Mapping[str, MetaOp], numbers: MemoryNumbers) -> list[float]:
    """Predicted bytes per device of a plan under its settings."""
    return [p + a for p, a in plan_breakdown(plan, metaops, numbers)]


def memory_options(plan: Plan) -> str:
    """A plan's memory options in words: 'zero1+recompute' (full recomputation of every layer), 'zero0',
    'zero1+mb2+recompute[full (3 layers) x2, selective x1]+early-backward', ..."""
    st = plan.settings
    parts = [f"zero{st.zero_stage}" + ("-hpz" if st.node_local_weights else "")] + (
        [f"mb{st.micro_batches}"] if st.micro_batches > 1 else [])
    layers = [s for s in plan.slices() if s.kind == "layer"]
    counts: dict[str, int] = {}
    for s in layers:
        what = st.recompute_of(s.id).for_layers(s.num_layers).describe()
        counts[what] = counts.get(what, 0) + 1
    counts.pop("none", None)
    if counts and counts == {"full": len(layers)}:
        parts.append("recompute")
    elif counts:
        parts.append("recompute[" + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) + "]")
    if st.order is not None:
        parts.append("early-backward")
    return "+".join(parts)
