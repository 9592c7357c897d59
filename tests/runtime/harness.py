"""Shared machinery of the runtime tests: spawning gloo workers, a single-process reference trajectory and
the comparison of an engine run against it."""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_spindle.plan.tp_shards import base_unit

RTOL = 1e-5
LOOSE = 1e-3  # per tensor after optimizer steps
LATER = 1e-4  # all gradients of steps after the first (their weights went through fp32 AdamW noise)
STEPS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, port, *args)`` on ``world_size`` spawned gloo processes; re-raises failures."""
    mp.start_processes(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True,
                       start_method="spawn")


def _entry(rank, fn, world_size, port, args):
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(b.double().norm())
    num = float((a.double() - b.double()).norm())
    return num / den if den > 0 else num


@dataclass
class Trajectory:
    """Reference losses and gradients for steps 0..STEPS-1 and the weights after STEPS AdamW steps; with
    clipping, ``grads`` are the clipped gradients and ``norms`` the global norms before clipping."""

    losses: list[dict[str, float]]
    grads: list[dict[str, torch.Tensor]]
    initial: dict[str, torch.Tensor]
    final: dict[str, torch.Tensor]
    norms: list[float]


def adamw_groups(params: dict[str, torch.nn.Parameter], optim_cfg) -> list[dict]:
    """AdamW's parameter groups: every parameter decayed, or with ``no_weight_decay_1d`` Megatron-LM's rule (no
    decay on biases and 1-D parameters), as torch users write it."""
    if not getattr(optim_cfg, "no_weight_decay_1d", False):
        return [{"params": list(params.values()), "weight_decay": optim_cfg.weight_decay}]
    plain = [p for k, p in params.items() if k.endswith(".bias") or p.dim() == 1]
    decayed = [p for k, p in params.items() if not (k.endswith(".bias") or p.dim() == 1)]
    return [{"params": decayed, "weight_decay": optim_cfg.weight_decay}, {"params": plain, "weight_decay": 0.0}]


def reference_trajectory(model, params: dict[str, torch.nn.Parameter], loss_weights: dict[str, float],
                         optim_cfg, steps: int = STEPS) -> Trajectory:
    """``model(step) -> {task: loss}``; ``params`` full-name -> the shared Parameter the model uses. With
    ``optim_cfg.clip_grad > 0`` the gradients go through ``torch.nn.utils.clip_grad_norm_`` before the step."""
    opt = torch.optim.AdamW(adamw_groups(params, optim_cfg), lr=optim_cfg.lr, betas=optim_cfg.betas,
                            eps=optim_cfg.eps)
    initial = {k: p.detach().clone() for k, p in params.items()}
    losses, grads, norms = [], [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        out = model(step)
        total = sum(loss_weights[t] * v for t, v in out.items())
        total.backward()
        if optim_cfg.clip_grad > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(list(params.values()), optim_cfg.clip_grad)))
        losses.append({t: float(v) for t, v in out.items()})
        grads.append({k: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                      for k, p in params.items()})
        opt.step()
    return Trajectory(losses, grads, initial, {k: p.detach().clone() for k, p in params.items()}, norms)


def global_rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    keys = sorted(a)
    return rel_err(torch.cat([a[k].reshape(-1) for k in keys]), torch.cat([b[k].reshape(-1) for k in keys]))


def check_engine_against(engine, ref: Trajectory, label: str, steps: int = STEPS,
                         tensor_rtol: float = RTOL) -> dict[str, float]:
    """Train ``steps`` steps against the reference trajectory. Returns the worst errors seen.

    - losses, every step: relative error <= RTOL;
    - step 0 gradients (same weights, same data): every parameter tensor's relative error <= RTOL;
    - the weights after the last step: relative error over all parameters this rank holds <= RTOL, and per
      tensor <= LOOSE; gradients of later steps: over all parameters <= LATER, per tensor <= LOOSE. Adam divides each element's gradient by its own magnitude, so
      elements whose true gradient is ~0 (e.g. the attention key bias, exactly 0 by softmax shift
      invariance) turn fp32 summation-order noise into +-lr updates; per-tensor 1e-5 is meaningful only
      before the first optimizer step.
    """
    worst = {"loss": 0.0, "grad0": 0.0, "grad_global": 0.0, "weights_global": 0.0, "tensor": 0.0}
    for step in range(steps):
        losses = engine.train_step(step)
        for t, v in ref.losses[step].items():
            e = abs(losses[t] - v) / max(1.0, abs(v))
            worst["loss"] = max(worst["loss"], e)
            assert e <= RTOL, f"{label} step {step} loss[{t}] {losses[t]} != {v}"
        if ref.norms:  # the global norm over all units, each counted once, on every rank
            e = abs(engine.last_step.grad_norm - ref.norms[step]) / ref.norms[step]
            assert e <= (RTOL if step == 0 else LATER), f"{label} step {step} grad norm " \
                f"{engine.last_step.grad_norm} != {ref.norms[step]}"
        grads = engine.gather_grads()  # zero_stage 2 keeps shards: all-gathered (collective)
        if not grads:
            continue
        assert set(grads) <= set(ref.grads[step]), f"{label}: unknown parameters"
        for k, g in grads.items():
            e = rel_err(g, ref.grads[step][k])
            worst["tensor"] = max(worst["tensor"], e)
            if step == 0:
                worst["grad0"] = max(worst["grad0"], e)
            assert e <= (tensor_rtol if step == 0 else LOOSE), f"{label} step {step}: grad of '{k}' rel err {e:.2e}"
        e = global_rel_err(grads, ref.grads[step])
        worst["grad_global"] = max(worst["grad_global"], e)
        assert e <= (RTOL if step == 0 else LATER), f"{label} step {step}: gradients rel err {e:.2e}"
    state = engine.full_state()
    if state:
        for k, w in state.items():
            e = rel_err(w, ref.final[k])
            worst["tensor"] = max(worst["tensor"], e)
            assert e <= LOOSE, f"{label}: weight '{k}' after {steps} steps rel err {e:.2e}"
        e = global_rel_err(state, ref.final)
        worst["weights_global"] = e
        assert e <= RTOL, f"{label}: weights after {steps} steps rel err {e:.2e}"
    # the masters' global norm (--log-params-norm) counts every element of the model once, on every rank
    want = math.sqrt(sum(float(w.double().square().sum()) for w in ref.final.values()))
    got = engine.params_norm()
    assert abs(got - want) <= RTOL * want, f"{label}: params norm {got} != {want}"
    return worst


def operator_weights(engine) -> dict[str, torch.Tensor]:
    """What the local operators hold now ("<unit>.<path>" -> full tensor, a copy; not the masters). Collective
    per TP group, in wave order, like the engine's own initialisation."""
    from megatron_spindle.runtime.slices import in_wave_order

    out = {}
    for ls in in_wave_order(engine.local):
        out.update({k: v.detach().clone() for k, v in ls.op.export_full_state().items() if k in ls.param_keys})
    return out


class LaunchLog:
    """The engine's bucket launches, micro-batch starts and step ends, in the order they happen on this rank
    (``("launch", bucket)``, ``("micro", j)``, ``("forward" | "backward", wave)`` after every step of the
    plan's order, local or not)."""

    def __init__(self, engine):
        self.engine = engine
        self.events: list[tuple] = []
        engine.on_wave = lambda phase, wave, seconds: self.events.append((phase, wave))
        sync = engine.grad_sync
        sync.on_launch = lambda bucket: self.events.append(("launch", bucket))
        start = sync.micro_start

        def micro(j: int) -> None:
            self.events.append(("micro", j))
            start(j)

        sync.micro_start = micro

    def steps(self) -> list[list[tuple]]:
        """The events of each training step (from its first micro-batch's start)."""
        out: list[list[tuple]] = []
        for e in self.events:
            if e == ("micro", 0):
                out.append([])
            out[-1].append(e)
        return out


def check_launches(log: LaunchLog, label: str, overlap: bool = True) -> None:
    """Every step issues, for each synced micro-batch (the last, or under ZeRO-2 every one: plan/buckets.py
    ``synced_micro_batches``), each gradient round's buckets of this rank once, in the round's launch order (one
    round, or under ZeRO-2 one per segment: ``sync_rounds``). With overlap, a bucket is issued once the backward
    has done every step before the one of its last local accumulation in the round (a unit shared by several
    local slices waits for the last of them; one with none there, once the rank has reached the round), and
    before the round's step completing it plan-wide has ended; without overlap, after the round's last step
    and before the next round's (or micro-batch's) first step has ended."""
    from megatron_spindle.plan.buckets import synced_micro_batches, wave_rounds
    from megatron_spindle.plan.order import BWD

    engine = log.engine
    rounds = engine.grad_sync.rounds
    order = engine.schedule.steps
    settings = engine.plan.settings
    m = settings.micro_batches
    synced = list(synced_micro_batches(settings.zero_stage, m))
    wave_round = wave_rounds(len(engine.plan.waves), settings)
    step_round = [wave_round[w] for w, _, _ in order]
    backward_step = {}  # local slice id -> index of its backward step
    for k, (wave, phase, task) in enumerate(order):
        for ls in engine.local.values():
            if phase == BWD and ls.wave == wave and task in (None, ls.slice.task):
                backward_step[ls.slice.id] = k
    steps = log.steps()
    assert steps, f"{label}: no step recorded"
    for events in steps:
        launches = [(i, e[1]) for i, e in enumerate(events) if e[0] == "launch"]
        expected = [(j, r, b) for j in synced for r, buckets in enumerate(rounds) for b in buckets]
        assert [b for _, b in launches] == [b for _, _, b in expected], \
            f"{label}: buckets issued out of order or not once per round"
        ends: dict[tuple[int, int], int] = {}  # (micro-batch, step of the order) -> its end's event index
        j = k = 0
        for i, e in enumerate(events):
            if e[0] == "micro":
                j, k = e[1], 0
            elif e[0] in ("forward", "backward"):
                ends[j, k] = i
                k += 1
        for mb in range(m):
            assert (mb, len(order) - 1) in ends and (mb, len(order)) not in ends, \
                f"{label}: micro-batch {mb} does not end every step of the order once"
        for (i, b), (mb, r, _) in zip(launches, expected):
            _check_launch(engine, i, b, ends, (mb, r), order, step_round, backward_step, overlap,
                          f"{label} micro-batch {mb} round {r}: bucket {b}")


def _check_launch(engine, i, b, ends, at, order, step_round, backward_step, overlap, label) -> None:
    from megatron_spindle.plan.order import BWD

    mb, r = at
    mine = [k for k in range(len(order)) if step_round[k] == r]
    if not overlap:
        assert i > ends[mb, mine[-1]], f"{label}: issued during the round's backward"
        after = mine[-1] + 1
        following = ends.get((mb, after)) if after < len(order) else ends.get((mb + 1, 0))
        assert following is None or i < following, f"{label}: issued after the next round's first step"
        return
    units = {base_unit(u) for u in b.units}  # a unit's TP shard (runtime/tp_shards.py) with its unit
    done_wave = engine.plan.waves[b.done[0]]
    tasks = {s.task for s in done_wave.slices if units & set(slice_units_of(engine, s))}
    done = max(k for k in mine if order[k][1] == BWD and order[k][0] == b.done[0]
               and (order[k][2] is None or order[k][2] in tasks))
    assert i < ends[mb, done], f"{label}: issued after the step completing it"
    local = [backward_step[ls.slice.id] for ls in engine.local.values()
             if step_round[backward_step[ls.slice.id]] == r
             and {engine.key_unit[k] for k in ls.param_keys} & set(b.units)]
    first = max(local) if local else mine[0]  # none here: issued when the rank reaches the round
    if first > 0:
        assert i > ends[mb, first - 1], f"{label}: issued before its last accumulation"


def slice_units_of(engine, s) -> list[str]:
    from megatron_spindle.runtime.layout import slice_units

    return slice_units(engine.metagraph, s)


def runtime_memory_model(plan, workload):
    """The memory model of the CPU runtime: fp32 activations, megatron-core's unfused attention, the plan's
    dropout."""
    from megatron_spindle.estimator import AnalyticCostModel, MemoryModel
    from megatron_spindle.estimator.cost_model import CostModelConfig
    from megatron_spindle.graph.cluster import ClusterSpec

    cluster = ClusterSpec.from_dict(plan.cluster)
    config = CostModelConfig(attention="unfused", hidden_dropout=plan.settings.hidden_dropout,
                             attention_dropout=plan.settings.attention_dropout)
    cost = AnalyticCostModel(workload, cluster, dtype_bytes=4, config=config)
    return MemoryModel(workload, cluster, cost)
