#!/usr/bin/env python
"""Planning wall time per planner, workload and cluster size (issue 2: a 10-task workload on 64 GPUs in < 1 s
with the wavefront planner). Prints a table and writes it (planning_time.txt, .json) to --out-dir; never part of
the tests."""

import argparse
import functools
import sys
import time

from bench_output import Recording, add_output_args

from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.planner.pipeline import PlannerConfig, plan_workload


def best_of(repeats: int, plan):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = plan()
        times.append(time.perf_counter() - t0)
    return min(times), result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="clip-10,ofasys-7,qwen-val")
    parser.add_argument("--gpus", default="8,16,32,64")
    parser.add_argument("--repeats", type=int, default=3, help="best of N for the wavefront planner")
    parser.add_argument("--with-cpsat", action="store_true", help="also time the CP-SAT planner (10 s limit)")
    add_output_args(parser)
    args = parser.parse_args(argv)
    record = Recording(args, "planning_time")
    cells = []
    planners = ["wavefront"] + (["cpsat"] if args.with_cpsat else [])
    print(f"{'workload':<10}{'GPUs':>6}  " + "".join(f"{p + ' s':>14}{'mk/C*':>8}" for p in planners)
          + "   stages (wavefront)")
    for name in args.workloads.split(","):
        workload = load_workload(name)
        for n in (int(g) for g in args.gpus.split(",")):
            cluster = make_cluster(n)
            row = f"{name:<10}{n:>6}  "
            stages = ""
            for planner in planners:
                config = PlannerConfig(planner=planner)
                try:
                    seconds, result = best_of(args.repeats if planner == "wavefront" else 1,
                                              functools.partial(plan_workload, workload, cluster, config))
                except ValueError as e:  # a cell that does not fit memory
                    row += f"{'-':>14}{'-':>8}"
                    stages = f"does not fit: {str(e)[:60]}"
                    cells.append({"workload": name, "gpus": n, "planner": planner, "error": str(e)})
                    continue
                p = result.plan.predicted
                row += f"{seconds:>14.3f}{p['iteration_time'] / p['c_star']:>8.3f}"
                cells.append({"workload": name, "gpus": n, "planner": planner, "seconds": seconds,
                              "makespan_over_c_star": p["iteration_time"] / p["c_star"], "stages": result.timings})
                if planner == "wavefront":
                    stages = " ".join(f"{k}={v:.2f}" for k, v in result.timings.items())
            print(row + "   " + stages, flush=True)
    record.save({"repeats": args.repeats, "cells": cells})
    return 0


if __name__ == "__main__":
    sys.exit(main())
