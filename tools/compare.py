#!/usr/bin/env python
"""Compare Spindle with the baselines on a workload: every system planned, all timed by the same simulator.

Per system: the simulated iteration time, the speedup over DeepSpeed, the peak memory per device, the memory
options it uses (ZeRO stage, recomputation, micro-batches) and the breakdown (compute, inter-wave transfers,
exposed gradient sync, optimizer step, weight all-gather). This is the side-by-side that
benchmarks/paper_eval.py prints for the paper's workloads, for any workload.

Example:
    python tools/compare.py --workload clip-4 --num-gpus 16
    python tools/compare.py --workload my_workload.yaml --cluster cluster.yaml --systems spindle,deepspeed --json

Systems: spindle (the greedy wavefront planner with plan selection, megatron_spindle/autoplan.py),
spindle-cpsat (the same with the CP-SAT planner; --spindle-solver-time-limit applies), deepspeed, megatron,
distmm, optimus, spindle-seq (megatron_spindle/baselines). The other --spindle-* flags apply to both Spindle
systems.
"""

import dataclasses
import json
import sys
import time

from megatron_spindle.arguments import (
    add_batch_args,
    add_cluster_args,
    add_spindle_args,
    add_workload_args,
    build_parser,
    cluster_from_args,
    planner_config_from_args,
    workload_from_args,
)
from megatron_spindle.errors import cli_main

SPINDLE_SYSTEMS = {"spindle": "wavefront", "spindle-cpsat": "cpsat"}
BASELINE_SYSTEMS = ("deepspeed", "megatron", "distmm", "optimus", "spindle-seq")
ALL_SYSTEMS = tuple(SPINDLE_SYSTEMS) + BASELINE_SYSTEMS


def add_compare_args(parser):
    g = parser.add_argument_group("compare")
    g.add_argument("--systems", default=",".join(ALL_SYSTEMS), metavar="SYSTEM,SYSTEM,...",
                   help=f"Systems to plan and simulate, of: {', '.join(ALL_SYSTEMS)}.")
    g.add_argument("--json", action="store_true", help="Print one JSON object instead of the table.")
    return parser


def parse_systems(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in ALL_SYSTEMS]
    if unknown or not names:
        raise ValueError(f"--systems: unknown system(s) {', '.join(unknown) or '(none given)'}; choose from "
                         f"{', '.join(ALL_SYSTEMS)}")
    return list(dict.fromkeys(names))


def describe(plan, sim, planning_seconds: float) -> dict:
    """What the table and the JSON report for one system."""
    from megatron_spindle.plan.memory import memory_options

    st = plan.settings
    options = memory_options(plan)  # the ZeRO stage, micro-batches, recomputation, early backward, in words
    breakdown = {k: v for k, v in sim.breakdown().items() if not k.startswith("transfer_")}
    return {"iteration_time": sim.iteration_time, "peak_memory_bytes": max(sim.peak_memory, default=0.0),
            "fits": max(plan.memory_per_device, default=0.0) <= plan.cluster["gpu"]["memory_bytes"],
            "memory_options": options, "zero_stage": st.zero_stage, "micro_batches": st.micro_batches,
            "breakdown": breakdown, "planning_seconds": planning_seconds,
            "selected": plan.planner.get("selection", {}).get("selected"), "attention_backend": st.attention_backend}


def compare(workload, cluster, systems: list[str], config, progress=None) -> dict:
    """Plan and simulate ``systems``; a Spindle system that cannot fit device memory is reported with its
    error instead of a time."""
    from megatron_spindle.autoplan import autoplan
    from megatron_spindle.baselines import BASELINES, BaselineContext
    from megatron_spindle.plan.schema import PlanError
    from megatron_spindle.planner.pipeline import for_cluster
    from megatron_spindle.simulator import simulate

    config = for_cluster(config, cluster)  # the baselines run the attention backend Spindle's plans record
    say = progress or (lambda msg: None)
    out: dict[str, dict] = {}
    ctx = None
    for name in systems:
        t0 = time.perf_counter()
        if name in SPINDLE_SYSTEMS:
            try:
                chosen = autoplan(workload, cluster, dataclasses.replace(config, planner=SPINDLE_SYSTEMS[name]),
                                  progress=lambda msg, system=name: say(f"{system}: {msg}"))
            except PlanError as e:
                out[name] = {"error": str(e)}
                continue
            out[name] = describe(chosen.plan, chosen.sim, time.perf_counter() - t0)
        else:
            ctx = ctx or BaselineContext.build(workload, cluster, choices=config)
            plan = BASELINES[name](workload, cluster, ctx)
            secs = time.perf_counter() - t0
            sim = simulate(plan, workload, cluster, ctx.cost_model, ctx.memory_model, metagraph=ctx.metagraph)
            out[name] = describe(plan, sim, secs)
        say(f"{name}: {out[name]['iteration_time'] * 1e3:.1f} ms")
    ds = out.get("deepspeed", {}).get("iteration_time")
    for d in out.values():
        if "iteration_time" in d:
            d["speedup_vs_deepspeed"] = ds / d["iteration_time"] if ds else None
    return out


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f}GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f}MiB"


def _memory_options(d: dict) -> str:
    return d["memory_options"] + ("" if d["fits"] else " (OOM)")


def table(results: dict) -> str:
    # the memory options column as wide as its longest entry (per-slice recomputation can be long)
    width = max([22] + [len(_memory_options(d)) + 1 for d in results.values() if "error" not in d])
    lines = [f"{'system':<14}{'iteration':>11}{'vs DS':>7}{'peak mem':>10}  {'memory options':<{width}}"
             f"{'compute':>9}{'transfer':>9}{'sync':>8}{'optim':>8}{'gather':>8}  selected"]
    for name, d in results.items():
        if "error" in d:
            lines.append(f"{name:<14}  does not fit: {d['error']}")
            continue
        b = d["breakdown"]
        speedup = d["speedup_vs_deepspeed"]
        lines.append(f"{name:<14}{d['iteration_time'] * 1e3:>9.1f}ms{speedup if speedup else float('nan'):>7.2f}"
                     f"{_gib(d['peak_memory_bytes']):>10}  {_memory_options(d):<{width}}"
                     + "".join(f"{b[k] * 1e3:>{w}.1f}" for k, w in (("compute", 9), ("transfer", 9), ("grad_sync", 8),
                                                                   ("optimizer", 8), ("param_gather", 8)))
                     + f"  {d['selected'] or ''}")
    lines.append("(ms; sync: gradient sync beyond the backward; gather: the ZeRO-1/2 weight all-gather (ZeRO-3: the "
                 "redistribution of shared weights) after the step, or with --overlap-param-gather what the next "
                 "forward waits for it)")
    return "\n".join(lines)


def bound_line(c_star: float, results: dict) -> str:
    """What the cost model allows Spindle at all: C*, and the speedup over DeepSpeed a plan at C* would have."""
    ds = results.get("deepspeed", {}).get("iteration_time")
    speedup = f", {ds / c_star:.2f}x DeepSpeed" if ds else ""
    return (f"C* {c_star * 1e3:.1f} ms{speedup}: the waves' relaxed optimum with memory unlimited, below which no "
            f"level-barrier wavefront plan computes on this cost model; transfers, gradient sync and the optimizer "
            f"come on top")


@cli_main()
def main(argv=None, extra_args_provider=None):
    parser = build_parser(__doc__.strip().splitlines()[0],
                          [add_workload_args, add_batch_args, add_cluster_args, add_spindle_args, add_compare_args],
                          extra_args_provider)
    args = parser.parse_args(argv)
    systems = parse_systems(args.systems)  # every input is checked before anything is planned
    workload = workload_from_args(args)
    cluster = cluster_from_args(args)
    config = planner_config_from_args(args)
    log = (lambda msg: print(f"[compare] {msg}", file=sys.stderr, flush=True)) if args.json else \
        (lambda msg: print(f"[compare] {msg}", flush=True))
    from megatron_spindle.autoplan import relaxed_optimum
    from megatron_spindle.plan.schema import PlanError

    results = compare(workload, cluster, systems, config, log)
    try:
        c_star = relaxed_optimum(workload, cluster, config)
    except PlanError:  # what keeps Spindle from planning is in its row already
        c_star = None
    frozen = workload.frozen_modules
    if args.json:
        print(json.dumps({"workload": workload.name, "num_devices": cluster.num_devices, "c_star": c_star,
                          "gpus_per_node": cluster.gpus_per_node, "gpu": cluster.gpu.name, "frozen": frozen,
                          "hidden_dropout": config.hidden_dropout, "attention_dropout": config.attention_dropout,
                          "systems": results}, indent=1))
    else:
        backends = sorted({d["attention_backend"] for d in results.values() if "attention_backend" in d})
        print(f"{workload.name} on {cluster.num_devices} x {cluster.gpu.name} ({cluster.num_nodes} node(s)), "
              f"simulated, attention backend {'/'.join(backends) or config.attention_backend}"
              + (f", dropout hidden {config.hidden_dropout:g} attention {config.attention_dropout:g}"
                 if config.hidden_dropout or config.attention_dropout else "")
              + (f", frozen: {', '.join(frozen)}" if frozen else ""))
        print(table(results))
        if c_star is not None:
            print(bound_line(c_star, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
