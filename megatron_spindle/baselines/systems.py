"""Baseline planners of the paper's evaluation (section 4.1), each emitting a ``Plan`` via ``assemble_plan``.

All of them run on the same runtime model as Spindle (``simulator/``), so one simulator times them all:

- ``deepspeed_plan``: temporal decoupling, each task on the whole cluster in turn, every MetaOp ZeRO data
  parallel (tp = 1, dp = the largest divisor of its batch that fits); the ZeRO stage (0-3) is the one the
  simulator finds fastest among those that fit memory (ties: the least memory).
- ``megatron_plan``: temporal decoupling; per task one TP degree for its layers (light ops tp = 1), the rest
  data parallel, chosen per task by simulating the whole plan (coordinate descent over tasks, the paper's
  hand tuning); the distributed optimizer (ZeRO-1) only when plain DP does not fit.
- ``distmm_plan``: tasks in sequence; inside a task the MetaOps of one level (the towers) split the cluster,
  each with its own best (tp, dp), devices split to balance their times (DistMM).
- ``optimus_plan``: task-level marginal-gain allocation (summary section 3): tasks run side by side on
  disjoint device groups, each task's MetaOps one after another on its group; with more tasks than devices,
  tasks are packed longest-first onto single devices.
- ``spindle_seq_plan``: Spindle's runtime with each task given the whole cluster in turn (paper appendix H):
  every MetaOp on the largest valid n with its fastest (tp, dp) by Spindle's T(n) (no amortised sync).

Memory options are tuned like the paper's hand tuning ("tuned by hand for the best result"), the way a user
tuning the system would (``memory_tuned``): every ZeRO stage the system offers (DeepSpeed 0-3; Spindle-Seq 0-3,
what Spindle's runtime implements; the others 0 and 1, the distributed optimizer) is simulated, without
activation recomputation first and with it only when nothing fits without, and the fastest plan that fits 80 GiB
is kept.

Execution settings of the plans (``Plan.settings``, obeyed by the simulator): ``segments`` lists the waves of
each segment that runs forward then backward before the next one (a task of a temporally decoupled system);
``zero_stage`` is the ZeRO stage of the whole plan, ``recompute`` whether layers recompute their activations
(the cost and memory models must match it), ``overlap_param_gather`` on for every system but DeepSpeed (those
built on Megatron-LM run with --overlap-param-gather), ``tp_sharded_grads`` for every system (Megatron-LM and
DeepSpeed keep gradients by TP shard, and so does our runtime, which Spindle-Seq is).
Wave start times are a serialisation that ``validate_plan`` accepts; the simulator runs device-disjoint work concurrently (Spindle-Optimus tasks). Each plan's memory is
plan/memory.py's accounting under its settings, which the simulator applies too.

This package sits above the planner and the simulator (it uses both); neither imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_spindle.estimator import AnalyticCostModel, MemoryModel, execution_cost_config, valid_configs
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaGraph, MetaOp, build_metagraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan.memory import GRAD_BYTES_PER_PARAM, memory_options, plan_memory
from megatron_spindle.plan.schema import (
    RUNTIME_ZERO_STAGES,
    ExecutionSettings,
    Plan,
    Recompute,
    execution_choices,
    reduce_dtype_of_bytes,
)
from megatron_spindle.plan.validate import validate_plan
from megatron_spindle.planner.assemble import assemble_plan
from megatron_spindle.planner.schedule import ScheduledSlice, ScheduledWave
from megatron_spindle.simulator import simulate

ZERO_STAGES = (0, 1, 2, 3)
TIE = 1e-3  # relative time difference under which two configurations count as equally fast


@dataclass
class BaselineContext:
    """What every baseline needs: the MetaGraph and the cost and memory models of (workload, cluster)."""

    workload: Workload
    cluster: ClusterSpec
    metagraph: MetaGraph
    cost_model: Any
    memory_model: Any
    # --attention-backend, which the baselines' plans record (the cost model charges its attention kernels)
    attention_backend: str = "auto"
    # the gradient sync's runtime flags (--overlap-grad-reduce, --ddp-bucket-size): the baselines run on our
    # runtime, so their plans record the user's, as Spindle's do
    overlap_grad_reduce: bool = True
    ddp_bucket_size: int | None = None
    _best: dict = field(default_factory=dict)

    @classmethod
    def build(cls, workload: Workload, cluster: ClusterSpec, cost_model=None, memory_model=None,
              metagraph: MetaGraph | None = None, choices=None) -> BaselineContext:
        """``choices``: what the runtime runs (plan/schema.py ``EXECUTION_CHOICES``, e.g. a ``PlannerConfig``;
        None: the defaults), which the analytic cost model charges (``execution_cost_config``) when no cost model
        is given and the baselines' plans record."""
        cost_model = cost_model or AnalyticCostModel(workload, cluster, config=execution_cost_config(choices))
        memory_model = memory_model or MemoryModel(workload, cluster, cost_model)
        chosen = execution_choices(choices if choices is not None else ExecutionSettings())
        return cls(workload, cluster, metagraph or build_metagraph(workload), cost_model, memory_model,
                   chosen["attention_backend"], chosen["overlap_grad_reduce"], chosen["ddp_bucket_size"])

    @property
    def recompute(self) -> bool:
        return bool(getattr(getattr(self.cost_model, "config", None), "recompute", False))

    @property
    def sequence_parallel(self) -> bool:
        """The cost model's --sequence-parallel: the baselines' plans record it, as Megatron-LM runs it."""
        return bool(getattr(getattr(self.cost_model, "config", None), "sequence_parallel", False))

    @property
    def grad_reduce_dtype(self) -> str:
        """The dtype the cost model reduces gradients in (--grad-reduce-in-bf16): the baselines' plans record it."""
        return reduce_dtype_of_bytes(getattr(getattr(self.cost_model, "config", None), "grad_bytes",
                                             GRAD_BYTES_PER_PARAM))

    @property
    def grad_norm(self) -> bool:
        """Whether the cost model charges the optimizer's gradient norm: the baselines' plans record it."""
        return bool(getattr(getattr(self.cost_model, "config", None), "grad_norm", True))

    @property
    def hidden_dropout(self) -> float:
        """The cost model's dropout: the baselines' plans record it (their runtime runs it)."""
        return float(getattr(getattr(self.cost_model, "config", None), "hidden_dropout", 0.0))

    @property
    def attention_dropout(self) -> float:
        return float(getattr(getattr(self.cost_model, "config", None), "attention_dropout", 0.0))

    def recomputing(self, flag: bool) -> BaselineContext:
        """The same context with full activation recomputation on or off (cost and memory models rebuilt)."""
        if flag == self.recompute:
            return self
        key = ("recompute", flag)
        if key not in self._best:
            config = dataclasses.replace(self.cost_model.config, recompute=flag)
            cost_model = AnalyticCostModel(self.workload, self.cluster, dtype_bytes=self.cost_model.dtype_bytes,
                                           config=config)
            variant = BaselineContext(self.workload, self.cluster, self.metagraph, cost_model,
                                      MemoryModel(self.workload, self.cluster, cost_model), self.attention_backend,
                                      self.overlap_grad_reduce, self.ddp_bucket_size)
            variant._best[("recompute", self.recompute)] = self
            self._best[key] = variant
        return self._best[key]

    def op_time(self, m: MetaOp, tp: int, dp: int, amortised_sync: bool = True) -> float:
        """Seconds of the whole MetaOp for a baseline's own choices: per layer the cost model's forward +
        backward with its DP gradient all-reduce amortised (the per-operator view the baselines' heuristics
        take), or without it (``amortised_sync=False``: Spindle's T(n), for Spindle-Seq), times its layers."""
        lc = self.cost_model.layer_cost(m, tp, dp)
        return (lc.total if amortised_sync else lc.step) * m.num_layers

    def best_config(self, m: MetaOp, max_n: int, align: int = 0, exact_n: bool = False,
                    amortised_sync: bool = True) -> tuple[int, int, float]:
        """Fastest (tp, dp, seconds) with tp * dp <= max_n (== the largest feasible n when ``exact_n``) and, if
        ``align`` > 0, tp dividing ``align`` (so TP groups of a block starting at that offset stay in a node)."""
        key = (m.id, max_n, align, exact_n, amortised_sync)
        if key not in self._best:
            configs = [(tp, dp) for tp, dp in valid_configs(m, self.workload, self.cluster)
                       if tp * dp <= max_n and (align == 0 or align % tp == 0)]
            if exact_n:
                top = max(tp * dp for tp, dp in configs)
                configs = [c for c in configs if c[0] * c[1] == top]
            self._best[key] = min(((tp, dp, self.op_time(m, tp, dp, amortised_sync)) for tp, dp in configs),
                                  key=lambda c: (c[2], c[0] * c[1]))
        return self._best[key]


# ------------------------------------------------------------------------------------------ helpers


def task_metaops(metagraph: MetaGraph, task: str) -> list[list[MetaOp]]:
    """The task's MetaOps grouped by MetaLevel, in level order (MetaOps of one level are independent)."""
    out = []
    for level in metagraph.levels:
        ops = [metagraph.metaops[m] for m in level if metagraph.metaops[m].task == task]
        if ops:
            out.append(ops)
    return out


def _slice(ctx: BaselineContext, m: MetaOp, tp: int, dp: int, devices: Sequence[int]) -> ScheduledSlice:
    return ScheduledSlice(metaop=m.id, n=tp * dp, tp=tp, dp=dp, layer_start=0, layer_end=m.num_layers,
                          time=ctx.op_time(m, tp, dp), devices=list(devices))


def _serialise(groups: Sequence[Sequence[ScheduledSlice]], metagraph: MetaGraph) -> list[ScheduledWave]:
    """One wave per group of slices, back to back (each wave as long as its slowest slice)."""
    waves, t = [], 0.0
    for slices in groups:
        duration = max(s.time for s in slices)
        level = max(metagraph.metaops[s.metaop].level for s in slices)
        waves.append(ScheduledWave(level=level, start=t, duration=duration, slices=list(slices)))
        t += duration
    return waves


def _assemble(ctx: BaselineContext, waves: list[ScheduledWave], segments: list[list[int]],
              info: dict[str, Any], zero_stages: Sequence[int] = (0,), overlap_param_gather: bool = True) -> list[Plan]:
    """Assemble once, then one validated plan per ZeRO stage (the stage changes only the settings and the
    memory), each timed by the simulator. ``overlap_param_gather``: Megatron's --overlap-param-gather, which
    the systems built on Megatron-LM run with (a tuned launch passes it); DeepSpeed's ZeRO-1/2 gathers the
    weights inside its optimizer step. Gradients are kept and reduced by TP shard (the settings' default), as
    Megatron-LM, DeepSpeed and our runtime do."""
    recompute = Recompute("full" if ctx.recompute else "none")
    settings = ExecutionSettings(recompute=recompute, segments=segments, overlap_param_gather=overlap_param_gather,
                                 **execution_choices(ctx))
    base = assemble_plan(ctx.workload, ctx.cluster, ctx.metagraph, waves, ctx.cost_model, ctx.memory_model, info,
                         validate=False, settings=settings)
    plans = []
    for stage in zero_stages:
        plan = dataclasses.replace(base, planner=dict(base.planner),
                                   settings=dataclasses.replace(base.settings, zero_stage=stage))
        plan.memory_per_device = plan_memory(plan, ctx.metagraph.metaops, ctx.memory_model)
        result = simulate(plan, ctx.workload, ctx.cluster, ctx.cost_model, ctx.memory_model, metagraph=ctx.metagraph)
        fits = max(plan.memory_per_device, default=0.0) <= ctx.cluster.gpu.memory_bytes
        plan.planner["memory_ok"] = fits
        plan.planner["simulated_iteration_time"] = result.iteration_time
        validate_plan(plan, ctx.workload, ctx.cluster, ctx.metagraph, check_memory=fits)
        plans.append(plan)
    return plans


def _sim_time(plan: Plan) -> float:
    return float(plan.planner["simulated_iteration_time"])


def _pick(plans: Sequence[Plan]) -> Plan:
    """The fastest plan that fits memory (ties within TIE: the least peak memory); none fits: least memory."""
    fitting = [p for p in plans if p.planner["memory_ok"]]
    if not fitting:
        return min(plans, key=lambda p: max(p.memory_per_device))
    best = min(_sim_time(p) for p in fitting)
    close = [p for p in fitting if _sim_time(p) <= best * (1 + TIE)]
    return min(close, key=lambda p: max(p.memory_per_device))


def memory_tuned(ctx: BaselineContext, build: Callable[[BaselineContext, Sequence[int]], list[Plan]],
                 zero_stages: Sequence[int] = (0, 1)) -> Plan:
    """The memory options a user tuning the system would pick: the fastest plan that fits 80 GiB among its ZeRO
    stages, first without activation recomputation, and only when none of those fits also with it
    (recomputation never makes a plan that fits without it faster); none fits at all: the least memory.
    ``build(ctx, stages)`` gives one plan per ZeRO stage. The options tried are in ``planner["search"]``."""
    plans = build(ctx.recomputing(False), zero_stages)
    if not any(p.planner["memory_ok"] for p in plans):
        plans += build(ctx.recomputing(True), zero_stages)
    best = _pick(plans)
    best.planner["search"] = {memory_options(p): {"time": _sim_time(p), "memory_ok": p.planner["memory_ok"]}
                              for p in plans}
    return best


def _temporal_variants(ctx: BaselineContext, per_task: Callable[[str], list[list[ScheduledSlice]]],
                       settings: dict[str, Any], zero_stages: Sequence[int], overlap_param_gather: bool = True
                       ) -> list[Plan]:
    """Tasks one after another (each a segment); ``per_task`` gives a task's waves as lists of slices."""
    groups, segments = [], []
    for task in ctx.workload.tasks:
        task_groups = per_task(task.name)
        segments.append(list(range(len(groups), len(groups) + len(task_groups))))
        groups += task_groups
    return _assemble(ctx, _serialise(groups, ctx.metagraph), segments, settings, zero_stages, overlap_param_gather)


def _temporal(ctx: BaselineContext, per_task: Callable[[str], list[list[ScheduledSlice]]], settings: dict[str, Any],
              zero_stage: int = 0) -> Plan:
    return _temporal_variants(ctx, per_task, settings, (zero_stage,))[0]


def _whole_cluster_waves(ctx: BaselineContext, task: str, config: Callable[[MetaOp], tuple[int, int]]):
    """Every MetaOp of the task in its own wave on devices 0..n-1 with ``config(m) = (tp, dp)``."""
    out = []
    for level in task_metaops(ctx.metagraph, task):
        for m in level:
            tp, dp = config(m)
            out.append([_slice(ctx, m, tp, dp, range(tp * dp))])
    return out


def _largest_dp(batch: int, limit: int) -> int:
    return max(d for d in range(1, min(batch, limit) + 1) if batch % d == 0)


# ------------------------------------------------------------------------------------------ DeepSpeed


def deepspeed_plan(workload: Workload, cluster: ClusterSpec, ctx: BaselineContext | None = None) -> Plan:
    """ZeRO data parallel on the whole cluster, task after task; the ZeRO stage picked by the simulator."""
    ctx = ctx or BaselineContext.build(workload, cluster)
    n = cluster.num_devices

    def build(c: BaselineContext, stages: Sequence[int]) -> list[Plan]:
        def per_task(task: str):
            return _whole_cluster_waves(c, task, lambda m: (1, _largest_dp(m.batch, n)))

        return _temporal_variants(c, per_task, {"planner": "deepspeed"}, stages, overlap_param_gather=False)

    return memory_tuned(ctx, build, ZERO_STAGES)  # the ZeRO stage and activation checkpointing, tuned together


# ------------------------------------------------------------------------------------------ Megatron-LM


def _megatron_config(ctx: BaselineContext, m: MetaOp, tp: int) -> tuple[int, int]:
    """The task's TP degree where the MetaOp allows it (else the largest valid one below), DP over the rest."""
    n = ctx.cluster.num_devices
    tps = sorted({c[0] for c in valid_configs(m, ctx.workload, ctx.cluster)})
    t = max(x for x in tps if x <= tp)
    return t, _largest_dp(m.batch, n // t)


def megatron_plan(workload: Workload, cluster: ClusterSpec, ctx: BaselineContext | None = None) -> Plan:
    """TP x DP per task on the whole cluster, task after task; per-task TP by simulated coordinate descent."""
    ctx = (ctx or BaselineContext.build(workload, cluster)).recomputing(False)
    candidates = [tp for tp in (1, 2, 4, 8, 16) if tp <= cluster.gpus_per_node and cluster.gpus_per_node % tp == 0]
    choice = {t.name: 1 for t in workload.tasks}

    def build(choice: dict[str, int], zero: int, recompute: bool = False) -> Plan:
        c = ctx.recomputing(recompute)

        def per_task(task: str):
            return _whole_cluster_waves(c, task, lambda m: _megatron_config(c, m, choice[task]))

        return _temporal(c, per_task, {"planner": "megatron", "tp_per_task": dict(choice)}, zero_stage=zero)

    best = build(choice, 0)
    for task in workload.tasks:
        trials = [best]
        for tp in candidates:
            if tp != choice[task.name]:
                trials.append(build({**choice, task.name: tp}, 0))
        best = _pick(trials)
        choice = dict(best.planner["tp_per_task"])

    def variants(c: BaselineContext, stages: Sequence[int]) -> list[Plan]:
        return [build(choice, z, c.recompute) for z in stages]

    # memory options: the distributed optimizer (ZeRO-1) and recomputation, the fastest that fits
    return memory_tuned(ctx, variants, (0, 1))


# ------------------------------------------------------------------------------------------ DistMM-MT


def _split_devices(ctx: BaselineContext, ops: list[MetaOp], n: int) -> dict[str, int] | None:
    """Device budgets for concurrent MetaOps minimising the slowest one: exhaustive for two MetaOps, else
    start at the smallest valid n each and grow the slowest. None when they cannot run side by side."""
    if len(ops) > n:
        return None
    ns = {m.id: sorted({tp * dp for tp, dp in valid_configs(m, ctx.workload, ctx.cluster)}) for m in ops}
    if len(ops) == 2:
        a, b = ops
        pairs = [(x, y) for x in ns[a.id] for y in ns[b.id] if x + y <= n]
        if not pairs:
            return None
        x, y = min(pairs, key=lambda p: (max(ctx.best_config(a, p[0])[2], ctx.best_config(b, p[1])[2]), -sum(p)))
        return {a.id: x, b.id: y}
    budget = {m.id: ns[m.id][0] for m in ops}
    if sum(budget.values()) > n:
        return None
    while True:
        times = {m.id: ctx.best_config(m, budget[m.id])[2] for m in ops}
        free = n - sum(budget.values())
        grew = False
        for m in sorted(ops, key=lambda m: -times[m.id]):
            bigger = [x for x in ns[m.id] if budget[m.id] < x <= budget[m.id] + free]
            if bigger:
                budget[m.id] = bigger[0]
                grew = True
                break
        if not grew:
            return budget


def _distmm_level(ctx: BaselineContext, level: list[MetaOp], n: int) -> list[list[ScheduledSlice]]:
    """A level's MetaOps side by side on split devices, or one after another on the whole cluster when
    that is faster (DistMM only splits when it pays)."""
    sequential = []
    for m in level:
        tp, dp, _ = ctx.best_config(m, n)
        sequential.append([_slice(ctx, m, tp, dp, range(tp * dp))])
    budget = _split_devices(ctx, level, n) if len(level) > 1 else None
    if budget is None:
        return sequential
    offset, slices = 0, []
    for m in sorted(level, key=lambda m: -budget[m.id]):
        tp, dp, _ = ctx.best_config(m, budget[m.id], align=offset)
        slices.append(_slice(ctx, m, tp, dp, range(offset, offset + tp * dp)))
        offset += budget[m.id]
    if max(s.time for s in slices) < sum(g[0].time for g in sequential):
        return [slices]
    return sequential


def distmm_plan(workload: Workload, cluster: ClusterSpec, ctx: BaselineContext | None = None) -> Plan:
    """Tasks in sequence; inside a task each level's MetaOps (the towers) split the cluster (DistMM)."""
    ctx = ctx or BaselineContext.build(workload, cluster)
    n = cluster.num_devices

    def build(c: BaselineContext, stages: Sequence[int]) -> list[Plan]:
        def per_task(task: str):
            return [g for level in task_metaops(c.metagraph, task) for g in _distmm_level(c, level, n)]

        return _temporal_variants(c, per_task, {"planner": "distmm"}, stages)

    return memory_tuned(ctx, build)


# ------------------------------------------------------------------------------------------ Spindle-Optimus


def _task_time(ctx: BaselineContext, task: str, n: int, align: int = 0) -> float:
    """Completion time of a task alone on n devices, its MetaOps one after another."""
    return sum(ctx.best_config(m, n, align)[2] for level in task_metaops(ctx.metagraph, task) for m in level)


def optimus_allocation(ctx: BaselineContext) -> list[tuple[list[str], int]]:
    """Task groups and their device counts: marginal-gain allocation (tasks <= devices) or longest-first
    packing of tasks onto single devices (tasks > devices)."""
    n = ctx.cluster.num_devices
    tasks = [t.name for t in ctx.workload.tasks]
    if len(tasks) > n:
        bins: list[tuple[float, list[str]]] = [(0.0, []) for _ in range(n)]
        for t in sorted(tasks, key=lambda t: -_task_time(ctx, t, 1)):
            k = min(range(n), key=lambda i: bins[i][0])
            bins[k] = (bins[k][0] + _task_time(ctx, t, 1), bins[k][1] + [t])
        return [(names, 1) for _, names in bins if names]
    valid = {}
    for t in tasks:
        ns = {tp * dp for level in task_metaops(ctx.metagraph, t) for m in level
              for tp, dp in valid_configs(m, ctx.workload, ctx.cluster)}
        valid[t] = sorted(x for x in ns if x <= n)
    alloc = {t: 1 for t in tasks}
    while True:
        free = n - sum(alloc.values())
        best, best_gain = None, 0.0
        for t in tasks:
            nxt = [x for x in valid[t] if alloc[t] < x <= alloc[t] + free]
            if not nxt:
                continue
            gain = (_task_time(ctx, t, alloc[t]) - _task_time(ctx, t, nxt[0])) / (nxt[0] - alloc[t])
            if gain > best_gain:
                best, best_gain = (t, nxt[0]), gain
        if best is None:
            return [([t], alloc[t]) for t in tasks]
        alloc[best[0]] = best[1]


def optimus_plan(workload: Workload, cluster: ClusterSpec, ctx: BaselineContext | None = None) -> Plan:
    """Tasks concurrently on disjoint device groups sized by marginal gain (Spindle-Optimus)."""
    return memory_tuned(ctx or BaselineContext.build(workload, cluster), _optimus)


def _optimus(ctx: BaselineContext, zero_stages: Sequence[int]) -> list[Plan]:
    groups = sorted(optimus_allocation(ctx), key=lambda g: -g[1])
    all_groups, segments, offset = [], [], 0
    for names, size in groups:
        for task in names:
            first = len(all_groups)
            for level in task_metaops(ctx.metagraph, task):
                for m in level:
                    tp, dp, _ = ctx.best_config(m, size, align=offset)
                    all_groups.append([_slice(ctx, m, tp, dp, range(offset, offset + tp * dp))])
            segments.append(list(range(first, len(all_groups))))
        offset += size
    settings = {"planner": "optimus", "groups": [{"tasks": names, "devices": size} for names, size in groups]}
    return _assemble(ctx, _serialise(all_groups, ctx.metagraph), segments, settings, zero_stages)


# ------------------------------------------------------------------------------------------ Spindle-Seq


def spindle_seq_plan(workload: Workload, cluster: ClusterSpec, ctx: BaselineContext | None = None,
                     zero_stages: Sequence[int] = RUNTIME_ZERO_STAGES) -> Plan:
    """Spindle's runtime, each task on the whole cluster in turn: every MetaOp on the largest valid n; its ZeRO
    stage tuned among ``zero_stages`` (default: all the runtime implements)."""
    ctx = ctx or BaselineContext.build(workload, cluster)
    n = cluster.num_devices

    def build(c: BaselineContext, stages: Sequence[int]) -> list[Plan]:
        def per_task(task: str):
            return _whole_cluster_waves(c, task, lambda m: c.best_config(m, n, exact_n=True,
                                                                         amortised_sync=False)[:2])

        return _temporal_variants(c, per_task, {"planner": "spindle-seq"}, stages)

    return memory_tuned(ctx, build, zero_stages)


BASELINES: dict[str, Callable[..., Plan]] = {
    "deepspeed": deepspeed_plan,
    "megatron": megatron_plan,
    "distmm": distmm_plan,
    "optimus": optimus_plan,
    "spindle-seq": spindle_seq_plan,
}
