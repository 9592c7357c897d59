"""Plans the runtime tests control: built from an explicit list of waves of slices with devices.

``build_plan`` is planner/explicit.py's ``plan_from_slices`` (transfers, routed, and parameter device groups
derived from the slices by plan/derive.py) for a ``make_cluster(world_size, gpus_per_node, "CPU")`` cluster: islands of
``gpus_per_node`` devices (default: all in one) make intra- and inter-island routes on CPU. Generators give the plan families
the tests need: Megatron-style sequential (every MetaOp on all devices), and seeded random Spindle-like
plans (concurrent slices on disjoint device subsets, layer chains split across waves, TP=2 slices).
"""

from __future__ import annotations

import dataclasses
import random

from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan.order import early_backward_order
from megatron_spindle.plan.schema import Plan
from megatron_spindle.plan.validate import validate_plan
from megatron_spindle.planner.explicit import SliceSpec, plan_from_slices


def build_plan(workload: Workload, world_size: int, waves: list[list[SliceSpec]], validate: bool = True,
               gpus_per_node: int = 8) -> Plan:
    plan = plan_from_slices(workload, make_cluster(world_size, gpus_per_node, gpu_type_name="CPU"), waves, validate)
    plan.planner = {"planner": "test"}
    return plan


def _tp_options(workload: Workload, m, n: int, max_tp: int) -> list[int]:
    out = [1]
    if m.kind == "layer":
        mod = workload.modules[m.module]
        for tp in (2, 4):
            if tp <= max_tp and n % tp == 0 and mod.num_heads % tp == 0 and mod.query_groups % tp == 0 \
                    and mod.ffn_hidden_size % tp == 0:
                out.append(tp)
    return out


def sequential_plan(workload: Workload, world_size: int, tp: int = 1, gpus_per_node: int = 8) -> Plan:
    """Megatron-style: one wave per MetaOp, each on all devices (layers at TP ``tp`` where valid)."""
    g = build_metagraph(workload)
    waves = []
    for level in g.levels:
        for mid in level:
            m = g.metaops[mid]
            t = tp if tp in _tp_options(workload, m, world_size, tp) else 1
            waves.append([(mid, 0, m.num_layers, list(range(world_size)), t)])
    return build_plan(workload, world_size, waves, gpus_per_node=gpus_per_node)


def single_device_plan(workload: Workload, world_size: int, micro_batches: int = 1) -> Plan:
    """Every slice on one device (TP 1, DP 1), a wave each, the devices taken by turns; each layer chain of two
    layers or more cut in two slices on different devices: what is drawn per data-parallel shard (dropout) is
    the single-process model's."""
    g = build_metagraph(workload)
    waves: list[list[SliceSpec]] = []
    for level in g.levels:
        for mid in level:
            m = g.metaops[mid]
            cuts = [0, m.num_layers // 2, m.num_layers] if m.num_layers >= 2 else [0, m.num_layers]
            for a, b in zip(cuts, cuts[1:]):
                waves.append([(mid, a, b, [len(waves) % world_size], 1)])
    plan = build_plan(workload, world_size, waves)
    return with_settings(plan, micro_batches=micro_batches) if micro_batches > 1 else plan


def random_plan(workload: Workload, world_size: int, seed: int, max_tp: int = 2, split_layers: bool = True,
                gpus_per_node: int = 8, micro_batches: int = 1) -> Plan:
    """Spindle-like: per MetaLevel, MetaOps packed into waves on disjoint random device subsets (1, 2 or 4
    devices, shuffled order), random TP where valid, layer chains cut into two slices in different waves;
    every DP degree divides a micro-batch (``micro_batches``: recorded in the settings)."""
    rng = random.Random(seed)
    g = build_metagraph(workload)
    waves: list[list[SliceSpec]] = []
    for level in g.levels:
        phases: list[list[tuple[str, int, int]]] = [[], []]
        for mid in level:
            m = g.metaops[mid]
            if split_layers and m.num_layers >= 2 and rng.random() < 0.7:
                cut = rng.randint(1, m.num_layers - 1)
                phases[0].append((mid, 0, cut))
                phases[1].append((mid, cut, m.num_layers))
            else:
                phases[0].append((mid, 0, m.num_layers))
        for pending in phases:
            rng.shuffle(pending)
            while pending:
                free = list(range(world_size))
                rng.shuffle(free)
                wave, rest = [], []
                for mid, ls, le in pending:
                    m = g.metaops[mid]
                    opts = [(n, tp) for n in (1, 2, 4) if n <= len(free)
                            for tp in _tp_options(workload, m, n, max_tp)
                            if (m.batch // micro_batches) % (n // tp) == 0]
                    if not opts:
                        rest.append((mid, ls, le))
                        continue
                    n, tp = rng.choice(opts)
                    wave.append((mid, ls, le, free[:n], tp))
                    free = free[n:]
                waves.append(wave)
                pending = rest
    plan = build_plan(workload, world_size, waves, validate=False, gpus_per_node=gpus_per_node)
    return with_settings(plan, micro_batches=micro_batches)


def with_settings(plan: Plan, **changes) -> Plan:
    """The plan under other execution settings (validated)."""
    plan = dataclasses.replace(plan, settings=dataclasses.replace(plan.settings, **changes))
    validate_plan(plan, check_memory=False)
    return plan


def layer_slices(plan: Plan) -> list:
    return [s for s in plan.slices() if s.kind == "layer"]


def module_kinds(plan: Plan, workload) -> dict[str, str]:
    """MetaOp id -> the kind of its module (encoder, llm, ...), for the MetaOps that run a module."""
    return {m.id: workload.modules[m.module].kind for m in plan.metaops if m.module in workload.modules}


def recomputing(plan: Plan, choose) -> Plan:
    """The plan with ``choose(index, slice) -> Recompute`` for its i-th layer slice."""
    return with_settings(plan, slice_recompute={s.id: choose(i, s) for i, s in enumerate(layer_slices(plan))})


def early_backward(plan: Plan) -> Plan:
    """The plan with each task's backward right after its last forward (plan/order.py)."""
    return with_settings(plan, order=early_backward_order([[s.task for s in w.slices] for w in plan.waves]))


def task_segments(plan: Plan) -> Plan:
    """A temporally decoupled baseline's order: each task's waves forward then backward, task after task."""
    tasks = list(dict.fromkeys(s.task for s in plan.slices()))
    segments = [[wi for wi, w in enumerate(plan.waves) if any(s.task == t for s in w.slices)] for t in tasks]
    if any(len({s.task for s in w.slices}) > 1 for w in plan.waves):
        raise ValueError("task_segments needs waves of one task each")
    return with_settings(plan, segments=segments)


def planner_task_segments(workload, world: int) -> Plan:
    """The planner's task segments (planner/task_segments.py): the tasks in two segments of balanced work, each
    segment's tasks planned together by the greedy wavefront planner on ``world`` CPU devices."""
    from megatron_spindle.graph.cluster import make_cluster
    from megatron_spindle.planner.pipeline import PlannerConfig
    from megatron_spindle.planner.task_segments import plan_task_segments, segment_partitions

    cluster = make_cluster(world, gpu_type_name="CPU")
    two = segment_partitions(workload, cluster)[0]
    return plan_task_segments(workload, cluster, two, PlannerConfig(planner="wavefront")).plan


def unit_device_sets(plan: Plan, unit_prefix: str) -> set[tuple[int, ...]]:
    """Distinct device sets of the slices whose MetaOp's parameters include a unit starting with the prefix."""
    out = set()
    for s in plan.slices():
        m = plan.metaop(s.metaop)
        if any(p.startswith(unit_prefix) for p in m.params):
            out.add(tuple(s.devices))
    return out


def unit_tp_degrees(plan: Plan, unit_prefix: str) -> set[int]:
    """TP degrees of the slices whose MetaOp's parameters include a unit starting with the prefix."""
    return {s.tp for s in plan.slices() if any(p.startswith(unit_prefix) for p in plan.metaop(s.metaop).params)}
