"""Issue 14's memory benchmark: a workload whose tasks' activations exceed device memory (built-in ``vla-mem``:
about 2.6x the memory of 16 A800-80GB devices), Spindle against every baseline, each with and without the
memory options of issue 14, all timed by the same simulator.

- **without**: what the planners had before: no recomputation or full recomputation of every layer (the
  cheaper that fits), the ZeRO stages each system tunes, one micro-batch, the plain order (Spindle: autoplan with
  ``--spindle-recompute none`` or else ``full``, ``--spindle-micro-batches 1``, ``--spindle-early-backward off``;
  baselines: as built in megatron_spindle/baselines);
- **with**: Spindle as a user gets it (autoplan, every option auto: per-slice recomputation, micro-batches,
  the early backward and the tasks in segments where simulation prefers them); the baselines with the same
  options applied to their own plans (baselines/memory_options.py): for m in 1, 2, 4 micro-batches the
  baseline is planned at the micro-batch's batch, then every layer slice gets the cheapest recomputation that
  fits (in the baseline's own order), and the fastest simulated that fits is kept. On a workload with a
  contrastive loss (vla-mem has two such tasks) m stays 1 for every system, as --spindle-micro-batches auto keeps
  it: more would shrink the loss's negatives. A baseline that fits in no way gets its plan without the options (marked * as over memory).

    python benchmarks/memory_options.py [--workload vla-mem] [--num-gpus 16] [--out-dir DIR | --update-snapshot]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from bench_output import Recording, add_output_args

from megatron_spindle.autoplan import autoplan
from megatron_spindle.baselines import BASELINES, BaselineContext
from megatron_spindle.baselines.memory_options import with_memory_options
from megatron_spindle.estimator import AnalyticCostModel, MemoryModel
from megatron_spindle.graph.cluster import ClusterSpec, make_cluster
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import Workload, load_workload
from megatron_spindle.plan.memory import memory_options
from megatron_spindle.plan.order import segment_tasks
from megatron_spindle.plan.schema import Plan, PlanError
from megatron_spindle.planner.pipeline import PlannerConfig
from megatron_spindle.simulator import simulate

GiB = 2**30
SYSTEMS = ["spindle", "deepspeed", "megatron", "distmm", "optimus", "spindle-seq"]


def activation_pressure(workload: Workload, cluster: ClusterSpec) -> dict[str, float]:
    """The tasks' activations (whole batches, no recomputation, one micro-batch) and the parameter state, as
    multiples of the cluster's device memory."""
    g = build_metagraph(workload)
    mm = MemoryModel(workload, cluster, AnalyticCostModel(workload, cluster))
    cap = cluster.num_devices * cluster.gpu.memory_bytes
    per_task: dict[str, float] = {}
    for m in g.metaops.values():
        per_task[m.task] = per_task.get(m.task, 0.0) + mm.activation_bytes(m, 1, 1, m.num_layers)
    params = sum(mm.param_state_bytes(u, 1) for u in {u for m in g.metaops.values() for u in m.param_names()})
    return {"activations": sum(per_task.values()) / cap, "largest_task": max(per_task.values()) / cap,
            "parameter_state": params / cap}


def entry(plan: Plan, sim, seconds: float) -> dict[str, Any]:
    return {"iteration_time": sim.iteration_time, "peak_memory_gib": max(sim.peak_memory) / GiB,
            "memory_options": memory_options(plan), "planning_seconds": seconds, "breakdown": sim.breakdown(),
            "selected": plan.planner.get("selection", {}).get("selected") or plan.planner.get("planner"),
            "segments": [sorted(tasks) for tasks in segment_tasks(plan)]}


def spindle_plans(row: dict[str, Any]) -> str:
    """Which candidate plan selection kept for Spindle, without and with the options, and its segments."""
    def plan(e: dict) -> str:
        segs = e.get("segments") or []
        return (e.get("selected") or "-") + (f" ({len(segs)} segments: " + " | ".join("+".join(t) for t in segs) + ")"
                                             if segs else "")
    return f"spindle's plans: without {plan(row['without'])}; with {plan(row['with'])}"


def spindle(workload: Workload, cluster: ClusterSpec, options: bool) -> tuple[Plan, Any, float]:
    """Spindle as tools/plan.py gives it (autoplan: the fastest simulated candidate, the task-sequential
    fallback among them); without the options: the old all-or-nothing recomputation, one micro-batch, the plain
    order, and the fallback without options."""
    t0 = time.perf_counter()
    if options:
        out = autoplan(workload, cluster, PlannerConfig(planner="wavefront"))
        return out.plan, out.sim, time.perf_counter() - t0
    base = dict(planner="wavefront", micro_batches="1", early_backward="off")
    try:
        out = autoplan(workload, cluster, PlannerConfig(recompute="none", **base))
    except PlanError:
        out = autoplan(workload, cluster, PlannerConfig(recompute="full", **base))
    plan, sim = out.plan, out.sim
    seq, seq_sim, _ = baseline("spindle-seq", workload, cluster, False)  # the fallback, as before issue 14
    if max(seq_sim.peak_memory) <= cluster.gpu.memory_bytes and seq_sim.iteration_time < sim.iteration_time:
        plan, sim = seq, seq_sim
    return plan, sim, time.perf_counter() - t0


def baseline(name: str, workload: Workload, cluster: ClusterSpec, options: bool) -> tuple[Plan, Any, float]:
    t0 = time.perf_counter()
    if options:
        try:
            plan, sim, _, _ = with_memory_options(BASELINES[name], workload, cluster)
            return plan, sim, time.perf_counter() - t0
        except PlanError:  # nothing fits (a contrastive loss keeps one micro-batch): its plan without them, marked
            pass
    g = build_metagraph(workload)
    cost = AnalyticCostModel(workload, cluster)
    memory = MemoryModel(workload, cluster, cost)
    plan = BASELINES[name](workload, cluster, BaselineContext.build(workload, cluster, cost, memory, g))
    return plan, simulate(plan, workload, cluster, cost, memory, metagraph=g), time.perf_counter() - t0


def table(rows: dict[str, dict[str, Any]], cap_gib: float) -> str:
    """One row per system; a time marked * is of a plan that does not fit device memory (the system's least
    memory plan: nothing it tries fits)."""
    ds = rows["deepspeed"]["without"]["iteration_time"]

    def ms(e: dict) -> str:
        return f"{e['iteration_time'] * 1e3:.0f}" + ("*" if e["peak_memory_gib"] > cap_gib * (1 + 1e-9) else " ")

    lines = [f"{'system':<13}{'without ms':>12}{'with ms':>10}{'gain':>7}{'vs DS':>7}{'peak GiB':>15}  "
             f"memory options (without | with)"]
    for s, r in rows.items():
        wo, wi = r["without"], r["with"]
        lines.append(f"{s:<13}{ms(wo):>12}{ms(wi):>10}{wo['iteration_time'] / wi['iteration_time']:>7.2f}"
                     f"{ds / wi['iteration_time']:>7.2f}{wo['peak_memory_gib']:>8.1f}{wi['peak_memory_gib']:>7.1f}  "
                     f"{wo['memory_options']} | {wi['memory_options']}")
    lines.append(f"(* over the {cap_gib:.0f} GiB of a device; vs DS: the time with the options against DeepSpeed's "
                 f"without them)")
    if "spindle" in rows:
        lines.append(spindle_plans(rows["spindle"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="vla-mem")
    parser.add_argument("--num-gpus", type=int, default=16)
    add_output_args(parser)
    args = parser.parse_args(argv)
    record = Recording(args, "memory_options")
    workload, cluster = load_workload(args.workload), make_cluster(args.num_gpus)
    pressure = activation_pressure(workload, cluster)
    print(f"{args.workload} on {args.num_gpus} x {cluster.gpu.name}: activations {pressure['activations']:.2f}x the "
          f"devices' memory (largest task {pressure['largest_task']:.2f}x), parameter state "
          f"{pressure['parameter_state']:.2f}x")
    rows: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    for name in SYSTEMS:
        rows[name] = {}
        for options in (False, True):
            run = spindle if name == "spindle" else (lambda w, c, o, n=name: baseline(n, w, c, o))
            plan, sim, secs = run(workload, cluster, options)
            rows[name]["with" if options else "without"] = entry(plan, sim, secs)
            print(f"  {name} {'with' if options else 'without'} the options: {sim.iteration_time * 1e3:.0f} ms "
                  f"({memory_options(plan)}, {secs:.1f} s)", file=sys.stderr, flush=True)
    print("\nSimulated iteration time without and with the memory options (issue 14), speedup over DeepSpeed "
          "(DeepSpeed without them = 1), peak memory with them")
    print(table(rows, cluster.gpu.memory_bytes / GiB))
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    record.save({"workload": args.workload, "gpus": args.num_gpus, "pressure": pressure, "systems": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
