"""Activation recomputation per slice: the cheapest choice for every layer slice of placed waves whose memory
fits every device.

Each layer slice has a ladder of options (``slice_options``): none, selective (every subset of megatron-core's
recompute modules the layer can rerun: the attention core, the pre-norms, the MLP), and full recomputation of
its first k layers (k = 1..L, megatron-core's block method) with the others rerunning nothing or a module set
on selective's own ladder (two TransformerBlocks), each with the seconds its backward spends
recomputing (the cost model's ``recompute_seconds``) and the bytes it holds and needs while recomputing (the
memory model's ``activation_memory``); options that cost more without holding less are
dropped. A device's memory is plan/memory.py's: its parameter state plus the peak, over the execution order,
of the activations held (``_Program`` keeps that peak per group of devices running the same slices).

``choose_recompute`` starts from no recomputation and, while a device is over its capacity, moves one slice
live at that device's peak down its ladder: the move that frees the most of the overflow per second of
recomputation. Given the waves' durations, a second costs what it lengthens its wave (a slice shorter than
its wave's longest recomputes in the slack; ``SLACK_WEIGHT`` of the seconds still counts, the devices are
busy): the waves run one after another, so that is what it adds to the iteration. Then every slice is moved
back up as far as the devices still fit (a later move may have made
an earlier one unnecessary). ``RecomputePolicy`` restricts the options: the user's Megatron-style choice
(``--recompute-granularity`` ...) is used as given for every layer slice.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from megatron_spindle.graph.opgraph import MetaOp
from megatron_spindle.plan.layout import SliceGeometry, device_programs
from megatron_spindle.plan.memory import (
    ShardedNumbers,
    activation_memory,
    completion_steps,
    device_step_cast_bytes,
    memory_breakdown,
    slice_weight_dp,
    staged_gradients,
)
from megatron_spindle.plan.order import FWD, SliceStep
from megatron_spindle.plan.schema import RECOMPUTE_MODULES, Recompute, fitted_recompute, recompute_fits

SliceKey = tuple[int, int]  # (wave, slice)
SLACK_WEIGHT = 0.1  # share of recomputation seconds counted where the slice's wave absorbs them


class RecomputeError(ValueError):
    """No recomputation choice fits: names the device, its bytes and the largest MetaOp it runs."""


@dataclass(frozen=True)
class RecomputePolicy:
    """Which recomputation the planner may choose per layer slice: ``search`` over none / selective /
    full-block-k (``allow_selective``), or ``fixed`` (the same choice for every layer slice)."""

    fixed: Recompute | None = None
    allow_selective: bool = True

    @property
    def search(self) -> bool:
        return self.fixed is None

    def lean(self) -> Recompute:
        """The choice that holds the least: what placement plans with when memory is short."""
        return self.fixed if self.fixed is not None else Recompute("full")


@dataclass(frozen=True)
class Option:
    recompute: Recompute
    seconds: float  # extra backward seconds of the slice
    held: float  # bytes held from forward to backward on one device
    transient: float  # bytes more while its backward recomputes


def slice_options(metaop: MetaOp, s: SliceGeometry, numbers: ShardedNumbers, cost_model,
                  policy: RecomputePolicy) -> list[Option]:
    """The slice's ladder, cheapest first, each option holding less from forward to backward, or needing less
    at its most (held + transient), than every cheaper one."""
    layers = s.layer_end - s.layer_start
    weight_dp = slice_weight_dp(numbers, s)  # the slice's, whatever its recomputation

    def option(rc: Recompute) -> Option:
        return _option(metaop, s, numbers, cost_model, rc, weight_dp)

    if metaop.kind != "layer":
        return [option(Recompute())]
    if policy.fixed is not None:
        return [option(fitted_recompute(policy.fixed.for_layers(layers), _module_kind(metaop, cost_model)))]
    selective = selective_choices(_module_kind(metaop, cost_model)) if policy.allow_selective else []
    plain = [option(rc) for rc in [Recompute(), *selective]]
    # beside full recomputation of k layers, the others rerun nothing or a module set on selective's own ladder
    rests = [None] + [o.recompute.recompute_modules for o in _ladder(plain) if o.recompute.mode == "selective"]
    full = dict.fromkeys(Recompute("full", k, modules=m).for_layers(layers)
                         for m in rests for k in range(1, layers + 1))
    return _ladder(plain + [option(rc) for rc in full])


def _option(metaop: MetaOp, s: SliceGeometry, numbers: ShardedNumbers, cost_model, rc: Recompute,
            weight_dp: int) -> Option:
    layers = s.layer_end - s.layer_start
    held, transient = activation_memory(numbers, metaop, s.tp, s.dp, layers, rc, weight_dp)
    seconds = cost_model.recompute_seconds(metaop, s.tp, s.dp, rc, layers) if rc.mode != "none" else 0.0
    return Option(rc, seconds, held, transient)


def _ladder(options: list[Option]) -> list[Option]:
    """The options cheapest first, each holding less, or needing less at its most, than every cheaper one."""
    options = sorted(options, key=lambda o: (o.seconds, o.held + o.transient))
    ladder: list[Option] = []
    least_held = least_most = math.inf  # over the ladder so far
    for o in options:
        if o.held < least_held or o.held + o.transient < least_most:
            ladder.append(o)
            least_held, least_most = min(least_held, o.held), min(least_most, o.held + o.transient)
    return ladder


def _module_kind(metaop: MetaOp, cost_model) -> str:
    return cost_model.workload.modules[metaop.module].kind


def selective_choices(module_kind: str) -> list[Recompute]:
    """Selective recomputation of every subset of megatron-core's modules a layer of ``module_kind`` can rerun
    (plan/schema.py ``recompute_fits``)."""
    subsets = [tuple(m for i, m in enumerate(RECOMPUTE_MODULES) if bits >> i & 1)
               for bits in range(1, 1 << len(RECOMPUTE_MODULES))]
    choices = [Recompute("selective", modules=m) for m in subsets]
    return [rc for rc in choices if recompute_fits(rc, module_kind)]


class _Program:
    """The devices running one set of slices: their parameter bytes and the activation bytes at every event of
    the order (``values[e]``: what is held after event e, a backward event counting its slice's transient)."""

    def __init__(self, devices: list[int], events: list[tuple[SliceKey, str]], params: float):
        self.devices, self.params = devices, params
        self.span: dict[SliceKey, tuple[int, int]] = {}
        for e, (key, phase) in enumerate(events):
            lo, hi = self.span.get(key, (e, e))
            self.span[key] = (lo, e) if phase != FWD else (e, hi)
        self.values = np.zeros(len(events))

    def add(self, key: SliceKey, held: float, transient: float) -> None:
        lo, hi = self.span[key]
        self.values[lo:hi + 1] += held
        self.values[hi] += transient

    def peak(self) -> float:
        return float(self.values.max()) if len(self.values) else 0.0

    def peak_after(self, key: SliceKey, held: float, transient: float) -> float:
        """The activation peak if the slice held ``held`` more and needed ``transient`` more."""
        lo, hi = self.span[key]
        inside = self.values[lo:hi + 1] + held
        inside[-1] += transient
        outside = max(float(self.values[:lo].max()) if lo else 0.0,
                      float(self.values[hi + 1:].max()) if hi + 1 < len(self.values) else 0.0)
        return max(float(inside.max()), outside)

    def total(self) -> float:
        return self.params + self.peak()

    def peaks_after(self) -> Callable[[SliceKey, float, float], float]:
        """``peak_after`` for many questions about the values as they are now: the maxima before and after each
        slice's span come from prefix and suffix maxima computed once (the same floats: adding a constant
        keeps the order)."""
        v = self.values
        if not len(v):
            return self.peak_after
        before = np.maximum.accumulate(v)
        after = np.maximum.accumulate(v[::-1])[::-1]
        spans: dict[SliceKey, tuple[float, float, float]] = {}

        def peak_after(key: SliceKey, held: float, transient: float) -> float:
            if key not in spans:
                lo, hi = self.span[key]
                inner = float(v[lo:hi].max()) if hi > lo else -np.inf
                outside = max(float(before[lo - 1]) if lo else 0.0, float(after[hi + 1]) if hi + 1 < len(v) else 0.0)
                spans[key] = (inner, float(v[hi]), outside)
            inner, last, outside = spans[key]
            return max(inner + held, (last + held) + transient, outside)

        return peak_after


def choose_recompute(waves: Sequence[Sequence[SliceGeometry]], metaops: Mapping[str, MetaOp],
                     numbers: ShardedNumbers, cost_model, capacity: float, order: Sequence[SliceStep],
                     policy: RecomputePolicy, num_devices: int, device_name: str = "device",
                     durations: Sequence[float] | None = None,
                     ladder_cache: dict | None = None,
                     rounds: Sequence[int] | None = None) -> dict[SliceKey, Recompute]:
    """(wave, slice) -> Recompute for every layer slice of placed waves (``metaops``: as each micro-batch runs
    them) so that every device fits ``capacity``, as cheap in recomputation seconds as the greedy finds
    (``durations``: the waves' seconds, the slices' own in their ``time``; then as cheap in wave lengthening).
    Raises RecomputeError naming the device that cannot fit even with every slice at its leanest option.
    ``ladder_cache``: the slices' ladders, kept across calls that share the cost model, the memory numbers (but
    for the ZeRO stage) and the policy, as the memory search's candidates do. ``rounds``: each wave's gradient
    round (plan/buckets.py ``wave_rounds``; default one), by which ZeRO 2 and 3 stage gradients."""
    ladders: dict[SliceKey, list[Option]] = {}
    # slices of one MetaOp, batch, configuration and layer count share a ladder
    alike: dict[tuple, list[Option]] = {} if ladder_cache is None else ladder_cache
    stage = getattr(numbers, "zero_stage", None)
    for wi, slices in enumerate(waves):
        for si, s in enumerate(slices):
            m = metaops[s.metaop]
            shape = (s.metaop, m.input_shape, s.tp, s.dp, s.layer_end - s.layer_start, stage,
                     slice_weight_dp(numbers, s))
            if shape not in alike:
                alike[shape] = slice_options(m, s, numbers, cost_model, policy)
            ladders[(wi, si)] = alike[shape]
    level = {key: 0 for key in ladders}
    done = completion_steps(waves, metaops, order, rounds) if stage is not None and stage >= 2 else {}
    params = memory_breakdown(waves, metaops, numbers, num_devices, order,
                              lambda wi, si: ladders[(wi, si)][0].recompute, rounds=rounds, done=done)
    programs: list[_Program] = []
    of_slice: dict[SliceKey, list[_Program]] = {key: [] for key in ladders}
    for program, devices in device_programs(waves, num_devices).items():
        mine = set(program)
        steps = [k for k, (wi, si, _) in enumerate(order) if (wi, si) in mine]
        p = _Program(devices, [((order[k][0], order[k][1]), order[k][2]) for k in steps], params[devices[0]][0])
        for g in staged_gradients(waves, metaops, numbers, order, mine, done, rounds):  # recomputation changes none
            p.values[bisect.bisect_left(steps, g.start):bisect.bisect_right(steps, g.end)] += g.bytes
        cast = device_step_cast_bytes(waves, metaops, numbers, mine)  # after the backward: no recomputation helps
        if p.params + cast > capacity:
            gib = 2**30
            raise RecomputeError(
                f"device {devices[0]} ({device_name}, {capacity / gib:.1f} GiB) does not fit the optimizer step: "
                f"parameter state {p.params / gib:.2f} GiB and the fp32 copies of its bf16 gradients "
                f"{cast / gib:.2f} GiB (--grad-reduce-in-bf16; a ZeRO stage >= 1 copies only the rank's shard)")
        for key in mine:
            p.add(key, ladders[key][0].held, ladders[key][0].transient)
            of_slice[key].append(p)
        programs.append(p)

    def coster(key: SliceKey) -> Callable[[float], float]:
        """What ``seconds`` more recomputation of the slice costs the iteration, at the slices' levels now."""
        if durations is None:
            return lambda seconds: seconds
        wi, si = key
        ends = [s.time + ladders[(wi, sj)][level[(wi, sj)]].seconds for sj, s in enumerate(waves[wi])]
        end, longest = ends[si], max([durations[wi]] + ends)
        return lambda seconds: max(0.0, end + seconds - longest) + SLACK_WEIGHT * seconds

    def move(key: SliceKey, to: int) -> None:
        old, new = ladders[key][level[key]], ladders[key][to]
        for p in of_slice[key]:
            p.add(key, new.held - old.held, new.transient - old.transient)
        level[key] = to

    while True:
        worst = max(programs, key=lambda p: p.total() - capacity, default=None)
        if worst is None or worst.total() <= capacity:
            break
        overflow, peak = worst.total() - capacity, worst.peak()
        at_peak = int(worst.values.argmax())
        peak_after = worst.peaks_after()
        best, best_score = None, None
        for key, (lo, hi) in worst.span.items():
            ladder, at, cost = ladders[key], level[key], coster(key)
            for j in range(at + 1, len(ladder)):
                dh, dt = ladder[j].held - ladder[at].held, ladder[j].transient - ladder[at].transient
                gain = peak - peak_after(key, dh, dt)
                # the peak may be reached at several events: then lowering the first of them is progress too
                local = -(dh + (dt if at_peak == hi else 0.0)) if lo <= at_peak <= hi else 0.0
                if gain <= 0 and local <= 0:
                    continue
                seconds = cost(ladder[j].seconds - ladder[at].seconds)
                score = (gain > 0, min(max(gain, local), overflow) / max(seconds, 1e-12), -seconds)
                if best_score is None or score > best_score:
                    best, best_score = (key, j), score
        if best is None:
            raise _does_not_fit(worst, waves, metaops, ladders, capacity, device_name)
        move(*best)
    # moves taken early may have been made unnecessary by later ones: undo what still fits, costliest first
    for key in sorted(ladders, key=lambda k: -ladders[k][level[k]].seconds):
        for j in range(level[key]):
            old, new = ladders[key][level[key]], ladders[key][j]
            dh, dt = new.held - old.held, new.transient - old.transient
            if all(p.params + p.peak_after(key, dh, dt) <= capacity for p in of_slice[key]):
                move(key, j)
                break
    return {key: ladders[key][level[key]].recompute for key in ladders
            if metaops[waves[key[0]][key[1]].metaop].kind == "layer"}


def recompute_seconds(waves: Sequence[Sequence[SliceGeometry]], metaops: Mapping[str, MetaOp], cost_model,
                      choices: Mapping[SliceKey, Recompute]) -> dict[SliceKey, float]:
    """Backward seconds each slice spends recomputing under ``choices``."""
    out = {}
    for (wi, si), rc in choices.items():
        s = waves[wi][si]
        if rc.mode != "none":
            out[(wi, si)] = cost_model.recompute_seconds(metaops[s.metaop], s.tp, s.dp, rc, s.layer_end - s.layer_start)
    return out


def _does_not_fit(p: _Program, waves, metaops, ladders, capacity: float, device_name: str) -> RecomputeError:
    keys = sorted(p.span, key=lambda k: -ladders[k][-1].held)
    biggest = waves[keys[0][0]][keys[0][1]] if keys else None
    what = (f"; its largest: MetaOp '{biggest.metaop}' layers [{biggest.layer_start}, {biggest.layer_end}) "
            f"holds {ladders[keys[0]][-1].held:.0f} bytes at its leanest") if biggest is not None else ""
    gib = 2**30
    return RecomputeError(
        f"device {p.devices[0]} ({device_name}, {capacity / gib:.1f} GiB) does not fit even with every slice at its "
        f"leanest recomputation: it needs {p.total():.0f} bytes ({p.total() / gib:.2f} GiB: parameter state "
        f"{p.params / gib:.2f} GiB, activations at the peak {p.peak() / gib:.2f} GiB){what}")
