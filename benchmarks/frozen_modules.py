"""What freezing modules does to Spindle against the baselines: per cell and set of frozen modules (Megatron-LM's
--freeze-ViT / --freeze-LM recipes), every system planned and simulated as tools/compare.py does it (CP-SAT for
Spindle, on its limit of deterministic time so that the rows repeat). Prints a table; writes it to --out-dir.

    python benchmarks/frozen_modules.py                     # QWen-VAL / 32 and CLIP-4 / 16 (about 8 min here)
    python benchmarks/frozen_modules.py --cells qwen-val:32 --freeze "" llm "vision audio llm"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench_output import Recording, add_output_args, announced, cell
from paper_eval import SOLVER

from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.planner.pipeline import PlannerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from compare import compare  # noqa: E402  (tools/compare.py: the side-by-side this benchmark tabulates)

SYSTEMS = ["spindle-cpsat", "deepspeed", "megatron"]
# cell -> the sets of frozen modules: nothing; the LLM (Qwen-VL's first stage); everything but the projectors
# (LLaVA's first stage); a locked image tower (LiT) for CLIP
DEFAULT_RUNS = {("qwen-val", 32): ["", "llm", "vision audio llm"], ("clip-4", 16): ["", "vision"]}


def run_row(name: str, gpus: int, frozen: list[str]) -> dict:
    workload = load_workload(name)
    workload = workload.frozen(frozen) if frozen else workload
    results = compare(workload, make_cluster(gpus), SYSTEMS, PlannerConfig(**SOLVER))
    row = {"workload": name, "gpus": gpus, "frozen": frozen}
    for system, r in results.items():
        row[system] = {k: r.get(k) for k in ("iteration_time", "peak_memory_bytes", "memory_options", "error")}
    spindle, ds = results["spindle-cpsat"].get("iteration_time"), results["deepspeed"]["iteration_time"]
    row["spindle_vs_deepspeed"] = ds / spindle if spindle else None
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", nargs="+", type=cell, default=None, help="WORKLOAD:GPUS ... (default: "
                        + ", ".join(f"{n}:{g}" for n, g in DEFAULT_RUNS) + ")")
    parser.add_argument("--freeze", nargs="+", default=None, metavar="'MODULE MODULE'",
                        help="sets of frozen modules, each a quoted space-separated list ('' for none); with --cells")
    add_output_args(parser)
    args = parser.parse_args(argv)
    if args.cells:
        runs = {c: args.freeze if args.freeze is not None else [""] for c in args.cells}
    else:
        runs = DEFAULT_RUNS
    record = Recording(args, "frozen_modules")
    print("Frozen modules, simulated (A800-80GB nodes of 8): Spindle (CP-SAT, selected by simulation) against "
          "DeepSpeed and Megatron-LM")
    print(f"{'workload':<10}{'GPUs':>5}  {'frozen':<18}{'Spindle ms':>11}{'DeepSpeed':>11}{'Megatron':>10}"
          f"{'Sp/DS':>7}{'Sp GiB':>8}{'DS GiB':>8}")
    rows = []
    for (name, gpus), sets in runs.items():
        for spec in sets:
            frozen = spec.split()
            with announced(f"{name} / {gpus}, frozen: {', '.join(frozen) or 'nothing'}"):
                row = run_row(name, gpus, frozen)
                rows.append(row)
                sp, ds, mg = (row[s] for s in SYSTEMS)
                ratio = f"{row['spindle_vs_deepspeed']:>7.2f}" if row["spindle_vs_deepspeed"] else f"{'-':>7}"
                sp_ms = f"{sp['iteration_time'] * 1e3:>11.1f}" if sp["iteration_time"] else f"{'(no fit)':>11}"
                sp_gib = f"{sp['peak_memory_bytes'] / 2**30:>8.1f}" if sp["peak_memory_bytes"] else f"{'-':>8}"
                print(f"{name:<10}{gpus:>5}  {', '.join(frozen) or '-':<18}{sp_ms}"
                      f"{ds['iteration_time'] * 1e3:>11.1f}{mg['iteration_time'] * 1e3:>10.1f}{ratio}{sp_gib}"
                      f"{ds['peak_memory_bytes'] / 2**30:>8.1f}")
    record.save(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
