"""Gradient clipping, the forward-only validation pass and fp16 loss scaling on one rank, in this process
(the multi-rank cases run inside test_runtime_engine's spawned workers).

- megatron-core operators: with ``clip_grad`` below the gradient norm, the losses, clipped gradients, norms and
  weights after 3 AdamW steps equal ``torch.nn.utils.clip_grad_norm_`` + AdamW on the single-process
  ``ReferenceModel``; ``evaluate`` gives the reference's losses and changes nothing.
- loss scaling (stand-in operators, a CPU stand-in with megatron-core's MegatronGradScaler interface: the real
  one keeps its scale on CUDA): a power-of-two scale changes nothing in the update; an overflow skips the step
  and backs the scale off.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from harness import RTOL, check_engine_against, reference_trajectory
from plans import random_plan, sequential_plan
from standin import StandinBatch, standin_batch, standin_factory

from megatron_spindle.data.mock import mock_batch
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.runtime.distributed import distributed
from megatron_spindle.runtime.engine import EngineConfig, OptimizerConfig, RuntimeEngine

OPT = OptimizerConfig(lr=1e-3, eps=1e-6, weight_decay=0.01)
STEPS = 2  # megatron-core operators cost seconds per step on 2 shared cores


@pytest.fixture
def world():
    with distributed("gloo") as ctx:
        yield ctx


def test_clipping_and_evaluate_match_the_reference_on_one_rank(world):
    from megatron_spindle.models.reference import ReferenceModel

    w = load_workload("tiny-clip")
    ref = ReferenceModel(w)
    run = lambda step: ref({t.name: mock_batch(w, t.name, step, 0) for t in w.tasks})  # noqa: E731
    weights = {t.name: t.loss.weight for t in w.tasks}
    with torch.no_grad():
        eval_want = {t: float(v) for t, v in run(5).items()}
    sum(weights[t] * v for t, v in run(0).items()).backward()  # the first step's norm, to clip below it
    params = ref.full_named_parameters()
    norm0 = float(torch.cat([p.grad.double().reshape(-1) for p in params.values()]).norm())
    opt = dataclasses.replace(OPT, clip_grad=0.3 * norm0)
    clipped = reference_trajectory(run, params, weights, opt, steps=STEPS)
    assert all(n > opt.clip_grad for n in clipped.norms)

    engine = RuntimeEngine(sequential_plan(w, 1), w, 0, 1, EngineConfig(optimizer=opt))
    got = engine.evaluate(5)  # before any step: the reference's initial weights
    for t, v in eval_want.items():
        assert abs(got[t] - v) <= RTOL * max(1.0, abs(v)), (t, got[t], v)
    assert not engine.optimizer.state and all(not bool(b.any()) for _, b in engine.grad_buffers.buffers)
    check_engine_against(engine, clipped, "1 rank, megatron-core operators, clipped", steps=STEPS)
    assert engine.last_step.grad_norm == pytest.approx(clipped.norms[-1], rel=1e-4)
    assert engine.last_step.loss_scale == 1.0 and not engine.last_step.skipped


class CpuGradScaler:
    """megatron.core.optimizer.grad_scaler.DynamicGradScaler's interface (scale tensor, update(found_inf)),
    on the CPU, halving the scale on every overflow."""

    def __init__(self, scale: float):
        self._scale = torch.tensor([scale])
        self.updates: list[bool] = []

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    def update(self, found_inf: bool) -> None:
        self.updates.append(found_inf)
        if found_inf:
            self._scale = self._scale / 2


def _nan_at(step_with_nan: int):
    def batch(workload, task, step, seed):
        b = standin_batch(workload, task, step, seed)
        if step != step_with_nan:
            return b
        feats = {m: (v * float("nan") if v.is_floating_point() else v) for m, v in b.feats.items()}
        return StandinBatch(feats, b.labels)
    return batch


@pytest.mark.parametrize("stage,overlap", [(0, False), (2, False), (2, True)])
def test_loss_scaling_unscales_exactly_and_skips_overflowing_steps(world, stage, overlap):
    """The scaled engine at zero_stage ``stage`` (2: unscaling and the norm on the gradient shards; ``overlap``:
    the weights' all-gather deferred to the next forward, none issued by a skipped step) against a plain
    zero_stage 0 one."""
    w = load_workload("tiny-vlm")
    plain_plan = random_plan(w, 1, 2)
    plan = dataclasses.replace(plain_plan, settings=dataclasses.replace(plain_plan.settings, zero_stage=stage,
                                                                        overlap_param_gather=overlap))
    opt = dataclasses.replace(OPT, clip_grad=1.0)
    kw = dict(operator_factory=standin_factory)

    plain = RuntimeEngine(plain_plan, w, 0, 1, EngineConfig(optimizer=opt), batch_fn=standin_batch, **kw)
    scaler = CpuGradScaler(2.0 ** 12)
    scaled = RuntimeEngine(plan, w, 0, 1, EngineConfig(optimizer=opt, grad_scaler=scaler), batch_fn=standin_batch,
                           **kw)
    for step in range(2):
        a, b = plain.train_step(step), scaled.train_step(step)
        assert a == b  # the losses are never scaled
        assert scaled.last_step.loss_scale == 2.0 ** 12 and not scaled.last_step.skipped
        assert scaled.last_step.grad_norm == pytest.approx(plain.last_step.grad_norm, rel=1e-6)
    for k, v in plain.full_state().items():
        assert torch.allclose(scaled.full_state()[k], v, rtol=1e-6, atol=1e-9), k
    assert scaler.updates == [False, False]

    scaler = CpuGradScaler(2.0 ** 12)
    engine = RuntimeEngine(plan, w, 0, 1, EngineConfig(optimizer=opt, grad_scaler=scaler), batch_fn=_nan_at(1),
                           **kw)
    engine.train_step(0)
    before = engine.full_state()
    steps = {id(p): float(st["step"]) for p, st in engine.optimizer.state.items()}
    losses = engine.train_step(1)  # NaN inputs: the gradients overflow
    assert any(math.isnan(v) for v in losses.values())
    assert engine.last_step.skipped and not math.isfinite(engine.last_step.grad_norm)
    if overlap:  # the forward loaded the previous step's weights, the skipped step issued nothing
        assert not engine.param_gather.pending
    assert scaler.updates == [False, True] and float(scaler.scale) == 2.0 ** 11
    assert all(torch.equal(v, before[k]) for k, v in engine.full_state().items())  # no step
    assert {id(p): float(st["step"]) for p, st in engine.optimizer.state.items()} == steps
    engine.train_step(2)
    assert not engine.last_step.skipped and engine.last_step.loss_scale == 2.0 ** 11
    assert (engine.param_gather is not None and engine.param_gather.pending) == overlap
