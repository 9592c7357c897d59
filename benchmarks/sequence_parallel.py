"""Issue 14's cost of memory with and without Megatron's sequence parallelism (--sequence-parallel): Spindle's
selected plan (autoplan, as tools/plan.py makes it; CP-SAT as paper_eval.py --with-cpsat, on its limit of 10 units
of deterministic time, so that the rows repeat) simulated with the 80 GiB cap and with memory unlimited, per cell.
Prints a table; writes it to --out-dir.

    python benchmarks/sequence_parallel.py                          # the Table 2 cells (about 13 min here)
    python benchmarks/sequence_parallel.py --cells qwen-val:64 --planner wavefront
"""

from __future__ import annotations

import argparse
import sys

from bench_output import Recording, add_output_args, announced, cell
from paper_eval import SOLVER, UNLIMITED, relaxed, unlimited_reference

from megatron_spindle.autoplan import autoplan
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.plan.memory import memory_options
from megatron_spindle.planner.pipeline import PLANNERS, PlannerConfig

TABLE2_CELLS = (("qwen-val-30b", 256), ("qwen-val-70b", 256))


def cell_row(name: str, gpus: int, planner: str, sequence_parallel: bool) -> dict:
    """The selected plan's simulated time with the cap and with memory unlimited."""
    workload, cluster = load_workload(name), make_cluster(gpus)
    config = PlannerConfig(planner=planner, sequence_parallel=sequence_parallel, **SOLVER)
    capped = autoplan(workload, cluster, config)
    free = unlimited_reference(capped, autoplan(workload, relaxed(cluster, UNLIMITED), config))
    return {"workload": name, "gpus": gpus, "sequence_parallel": sequence_parallel,
            "capped_ms": capped.sim.iteration_time * 1e3, "unlimited_ms": free.sim.iteration_time * 1e3,
            "memory_cost": capped.sim.iteration_time / free.sim.iteration_time,
            "capped_options": memory_options(capped.plan), "unlimited_options": memory_options(free.plan)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", nargs="+", type=cell, default=list(TABLE2_CELLS), help="WORKLOAD:GPUS ...")
    parser.add_argument("--planner", choices=PLANNERS, default="cpsat")
    add_output_args(parser)
    args = parser.parse_args(argv)
    cells = args.cells
    record = Recording(args, "sequence_parallel")
    rows = []
    print(f"Cost of memory: the selected plan ({args.planner}) with the 80 GiB cap / with memory unlimited, simulated")
    print(f"{'workload':<14}{'GPUs':>5}{'SP':>5}{'capped ms':>11}{'unlimited':>11}{'ratio':>7}  options (capped)")
    for name, gpus in cells:
        for sp in (False, True):
            with announced(f"{name} / {gpus}, sequence parallelism {'on' if sp else 'off'}"):
                row = cell_row(name, gpus, args.planner, sp)
                rows.append(row)
                print(f"{name:<14}{gpus:>5}{'on' if sp else 'off':>5}{row['capped_ms']:>11.0f}"
                      f"{row['unlimited_ms']:>11.0f}{row['memory_cost']:>7.3f}  {row['capped_options']}")
    record.save(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
