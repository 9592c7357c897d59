"""Adapters between the runtime engine and the trainer: full-state export/import per parameter unit (model
and AdamW state), per-task loss weights, data feeding and per-wave timing.

The engine (runtime/engine.py) keeps one fp32 master per parameter it holds (``masters``: "<unit>.<path>" ->
Parameter, ``key_unit``: name -> unit) and one ``torch.optim.AdamW`` over them; its local slices carry the
loss weight of their task. These helpers read and write exactly those, so a checkpoint holds every unit in
full form whatever plan wrote it.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.distributed as dist

from megatron_spindle.checkpointing import UnitState


def engine_units(engine) -> dict[str, UnitState]:
    """Every unit this rank holds: full fp32 weights and AdamW state (empty before the first step)."""
    out: dict[str, UnitState] = {}
    opt = engine.optimizer
    for k, p in engine.masters.items():
        unit = engine.key_unit[k]
        st = out.setdefault(unit, UnitState({}, {}))
        st.model[k] = p.detach().clone()
        s = opt.state.get(p) if opt is not None else None
        if s:
            st.optim[k] = {"exp_avg": s["exp_avg"].detach().clone(), "exp_avg_sq": s["exp_avg_sq"].detach().clone(),
                           "step": float(s["step"])}
    return out


def engine_expected_shapes(engine) -> dict[str, dict[str, tuple[int, ...]]]:
    out: dict[str, dict[str, tuple[int, ...]]] = defaultdict(dict)
    for k, p in engine.masters.items():
        out[engine.key_unit[k]][k] = tuple(p.shape)
    return dict(out)


def load_engine_units(engine, units: dict[str, UnitState], load_optim: bool = True) -> None:
    """Load weights (and AdamW state) of every unit this rank holds from their full forms."""
    model = {k: v for s in units.values() for k, v in s.model.items()}
    engine.load_full_state(model)
    if not load_optim or engine.optimizer is None:
        return
    for k, p in engine.masters.items():
        st = units[engine.key_unit[k]].optim.get(k)
        if st is None:
            engine.optimizer.state.pop(p, None)
            continue
        engine.optimizer.state[p] = {
            "step": torch.tensor(float(st["step"]), dtype=torch.float32),
            "exp_avg": st["exp_avg"].to(p.device, p.dtype).clone(),
            "exp_avg_sq": st["exp_avg_sq"].to(p.device, p.dtype).clone(),
        }


def set_learning_rate(engine, lr: float) -> None:
    if engine.optimizer is not None:
        for g in engine.optimizer.param_groups:
            g["lr"] = lr


def set_loss_weights(engine, weights: dict[str, float]) -> None:
    """Loss weight of each task's terminal slices on this rank for the next step (0 = the task sits out)."""
    for ls in engine.local.values():
        if ls.terminal and ls.slice.task in weights:
            ls.weight = weights[ls.slice.task]


class WaveTimer:
    """Measures per-wave time on this rank (forward + backward of its slices and the transfers into that
    wave), by wrapping the engine's per-wave hooks; ``collect`` takes the max over ranks (a wave lasts as long
    as its slowest device). Adds no synchronisation inside the step."""

    def __init__(self, engine):
        self.engine = engine
        self.num_waves = len(engine.plan.waves)
        self.times = [0.0] * self.num_waves
        wave_of = engine.wave_index
        for name, key in (("_forward_slice", lambda a: a[0].wave), ("_backward_slice", lambda a: a[0].wave),
                          ("_forward_transfer", lambda a: wave_of[a[0].consumer.id]),
                          ("_backward_transfer", lambda a: wave_of[a[0].consumer.id])):
            self._wrap(name, key)

    def _wrap(self, name, key):
        inner = getattr(self.engine, name, None)
        if inner is None:  # an engine without this hook: its share is simply not measured
            return

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.times[key(args)] += time.perf_counter() - t0

        setattr(self.engine, name, timed)

    def reset(self) -> None:
        self.times = [0.0] * self.num_waves

    def collect(self) -> list[float]:
        v = torch.tensor(self.times, dtype=torch.float64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
        return v.tolist()
