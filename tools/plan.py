#!/usr/bin/env python
"""Plan a multi-task multi-modal workload with Spindle's wavefront scheduling.

Example:
    python tools/plan.py --workload clip-10 --num-gpus 16 --out plan.json --gantt plan.png
"""

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
from megatron_spindle.fileio import PICTURE_SUFFIXES, check_output_file, staged_outputs


def add_output_args(parser):
    g = parser.add_argument_group("output")
    g.add_argument("--out", default=None, help="Write the plan JSON here (atomically).")
    g.add_argument("--gantt", default=None, help="Draw the Gantt chart of waves per device to this PNG.")
    g.add_argument("--quiet", action="store_true", help="Print only the headline, not the per-wave table.")
    return parser


@cli_main()
def main(argv=None, extra_args_provider=None):
    parser = build_parser(__doc__.strip().splitlines()[0],
                          [add_workload_args, add_batch_args, add_cluster_args, add_spindle_args, add_output_args],
                          extra_args_provider)
    args = parser.parse_args(argv)
    # every input is checked before anything is planned or written
    if args.out:
        check_output_file(args.out, "--out")
    if args.gantt:
        check_output_file(args.gantt, "--gantt", PICTURE_SUFFIXES)
    from megatron_spindle.autoplan import autoplan
    from megatron_spindle.planner.report import draw_gantt, plan_summary

    workload = workload_from_args(args)
    cluster = cluster_from_args(args)
    profile = None
    if args.spindle_profile:
        from megatron_spindle.estimator.profiled import load_planning_profile, profile_summary

        profile, cluster = load_planning_profile(args.spindle_profile, workload, cluster)
        print(f"[plan] {profile_summary(profile, cluster)}", flush=True)
    t0 = time.perf_counter()
    plan = autoplan(workload, cluster, planner_config_from_args(args), profile=profile,
                    progress=lambda msg: print(f"[plan] {msg}", flush=True)).plan
    print(f"[plan] done in {time.perf_counter() - t0:.3f} s", flush=True)
    summary = plan_summary(plan)
    print(summary.split("\n\n")[0] if args.quiet else summary)
    with staged_outputs() as out:  # both files, or neither
        if args.gantt:
            draw_gantt(plan, out.path(args.gantt))
        if args.out:
            out.write_text(args.out, json.dumps(plan.to_dict(), indent=1))
    if args.out:
        print(f"plan written to {args.out}")
    if args.gantt:
        print(f"Gantt chart written to {args.gantt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
