"""Dynamic task sets (paper App. D, Fig. 13) in the simulator: the total wall time of a training run whose task set
changes, for Spindle and every baseline, beside the paper's numbers.

Each scenario is a schedule of task sets over the paper's iteration count (Multitask-CLIP: 8 changes over 200K
iterations; OFASys: 6 changes over 105K). The paper does not list its task sets; ours follow one rule, in the
spirit of App. D (a new modality's tasks join once their towers are warm, converged tasks leave):
grow along the paper's own subsets (clip-4 -> clip-7 -> clip-10; ofasys-4 -> +vqa -> ofasys-7), then retire the
oldest tasks, bring retired tasks back, and end with a joint phase (all tasks for OFASys, the newest four for
CLIP). A set that comes back is planned once (the trainer caches plans by set, and so do we here).

    total(system) = sum over phases of iterations x simulated iteration time of the phase's set
                  + planning time of every distinct set (measured here, for every system)
                  + changes x the cost of one change, MEASURED on this CPU: a tiny-clip run with --task-schedule
                    saving a checkpoint at each change (save + in-process replan-free rebuild: teardown, engine and
                    process groups, units moved, state loaded; the tiny-clip planning itself is left out, the
                    real workload's planning is counted above). Every system pays it (each must reload).

The cluster: 16 A800 GPUs (2 nodes) by default. The paper does not say which cluster Fig. 13 used; its totals
divided by the iterations (0.49 s and 0.82 s per iteration) match its Fig. 8 Spindle times on 16 GPUs.

    python benchmarks/dynamic_tasks.py [--workloads clip ofasys] [--num-gpus 16] [--quick] [--with-cpsat]
        [--change-seconds S] [--out-dir DIR | --update-snapshot]

--quick: the first two phases of each scenario on 8 GPUs (a smoke run). --change-seconds: use S instead of
measuring (the measurement starts one CPU training process, about 20 s).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench_output import Recording, add_output_args
from paper_eval import BASELINE_SYSTEMS, CPSAT_SYSTEM, SELECTED, SPINDLE_SYSTEMS, run_cell

from megatron_spindle.graph.task_sets import task_set_workload
from megatron_spindle.graph.workload import load_workload

ROOT = Path(__file__).resolve().parent.parent

# Fig. 13 totals read off the plot (x 10^3 s), spindle-paper.md section 4.6 D
PAPER_FIG13 = {"clip": {"spindle": 98, "distmm": 118, "megatron": 122, "deepspeed": 128, "optimus": 135},
               "ofasys": {"spindle": 86, "distmm": 114, "megatron": 118, "deepspeed": 114, "optimus": 107}}
SYSTEMS = [SELECTED] + [name for name, _ in SPINDLE_SYSTEMS] + BASELINE_SYSTEMS  # --with-cpsat adds CPSAT_SYSTEM's

CLIP = ["text_audio", "vision_depth", "audio_thermal", "motion_thermal", "vision_text", "text_motion", "vision_audio",
        "depth_text", "thermal_vision", "audio_motion"]  # clip-10's order: clip-4 and clip-7 are its prefixes
OFA = ["caption", "asr", "summarization", "grounding", "vqa", "text2sql", "motion_caption"]  # ofasys-4 = first 4


@dataclass(frozen=True)
class Scenario:
    title: str
    workload: str
    iterations: int
    phases: tuple[tuple[int, tuple[str, ...]], ...]  # (first iteration, task set)

    @property
    def changes(self) -> int:
        return len(self.phases) - 1

    def lengths(self) -> list[int]:
        starts = [k for k, _ in self.phases] + [self.iterations]
        return [b - a for a, b in zip(starts, starts[1:])]


def _phases(*items) -> tuple[tuple[int, tuple[str, ...]], ...]:
    return tuple((k, tuple(tasks)) for k, tasks in items)


SCENARIOS = {
    "clip": Scenario("Multitask-CLIP", "clip-10", 200_000, _phases(
        (0, CLIP[:4]),                    # clip-4, the paper's 4-task set
        (20_000, CLIP[:7]),               # clip-7: three vision/text tasks join
        (45_000, CLIP),                   # clip-10: all ten
        (70_000, CLIP[2:]),               # the two oldest tasks converged: retired
        (90_000, CLIP[4:]),               # two more retired
        (110_000, CLIP[:2] + CLIP[4:]),   # the first two come back (their towers kept training elsewhere)
        (135_000, CLIP[:2] + CLIP[7:]),   # the clip-7 joiners retire
        (160_000, CLIP),                  # all ten again (the plan comes from the cache)
        (180_000, CLIP[6:]))),            # the four newest finish alone
    "ofasys": Scenario("OFASys", "ofasys-7", 105_000, _phases(
        (0, OFA[:4]),                     # ofasys-4, the paper's 4-task set
        (15_000, OFA[:5]),                # + vqa
        (30_000, OFA),                    # ofasys-7: + text2sql, motion captioning
        (50_000, OFA[2:]),                # caption and asr converged: retired
        (65_000, OFA[3:]),                # summarization retired
        (80_000, OFA[:2] + OFA[3:]),      # caption and asr come back
        (95_000, OFA))),                  # all seven (cached plan)
}


# ------------------------------------------------------------------------------------------ measured change cost

MEASURE_SCHEDULE = ("--tasks", "text_audio,vision_text", "--task-schedule",
                    "2:text_audio,vision_depth,vision_text,audio_depth;4:vision_depth,audio_depth;6:text_audio,vision_text")


def measure_change_seconds(log) -> dict:
    """One tiny-clip CPU run (1 process) with three task-set changes, a checkpoint saved at each: the mean
    save time and the mean in-process rebuild time of a change, read from the trainer's own log lines."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(ROOT / "pretrain_multitask.py"), "--workload", "tiny-clip", "--mock-data",
               "--spindle-planner", "wavefront", "--train-iters", "8", "--save-interval", "2", "--save", tmp,
               "--log-interval", "2", "--num-workers", "0", *MEASURE_SCHEDULE]
        log("measuring the cost of a task-set change: " + " ".join(cmd[1:]))
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
        if r.returncode != 0:
            raise RuntimeError(f"the measuring run failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    rebuilds = [float(x) for x in re.findall(r"\| rebuild: ([0-9.]+) s", r.stdout)]
    saves = {int(k): float(s) for k, s in re.findall(r"saved checkpoint at iteration\s+(\d+) to .* \(([0-9.]+) s\)",
                                                     r.stdout)}
    at_changes = [saves[k] for k in (2, 4, 6) if k in saves]
    if len(rebuilds) != 3 or len(at_changes) != 3:
        raise RuntimeError(f"expected 3 rebuild and 3 save times in the log, got {rebuilds} and {saves}")
    out = {"rebuild_seconds": rebuilds, "save_seconds": at_changes, "run_seconds": time.perf_counter() - t0}
    out["per_change_seconds"] = sum(rebuilds) / 3 + sum(at_changes) / 3
    return out


# ------------------------------------------------------------------------------------------ scenarios


def run_scenario(key: str, sc: Scenario, num_gpus: int, change_seconds: float, log, with_cpsat: bool = False) -> dict:
    base = load_workload(sc.workload)
    spindle = SPINDLE_SYSTEMS + ([CPSAT_SYSTEM] if with_cpsat else [])
    systems = [SELECTED] + [name for name, _ in spindle] + BASELINE_SYSTEMS
    cells: dict[frozenset, dict] = {}
    phases = []
    for (start, tasks), length in zip(sc.phases, sc.lengths()):
        cached = frozenset(tasks) in cells
        if not cached:
            workload = task_set_workload(base, tasks)
            log(f"{sc.title}: planning and simulating {len(tasks)} tasks ({', '.join(tasks)}) on {num_gpus} GPUs")
            cells[frozenset(tasks)] = run_cell(f"{sc.workload}[{len(tasks)}]", num_gpus, spindle,
                                               BASELINE_SYSTEMS, log, workload=workload, memory_column=False)
        cell = cells[frozenset(tasks)]
        phases.append({"start": start, "iterations": length, "tasks": list(tasks), "cached": cached,
                       "mem_relaxed": cell["mem_relaxed"],
                       "iteration_time": {s: cell["systems"][s]["iteration_time"] for s in systems},
                       "planning_seconds": {s: 0.0 if cached else cell["systems"][s]["planning_seconds"]
                                            for s in systems}})
    totals = {}
    for s in systems:
        compute = sum(p["iterations"] * p["iteration_time"][s] for p in phases)
        planning = sum(p["planning_seconds"][s] for p in phases)
        changes = (len(phases) - 1) * change_seconds
        totals[s] = {"compute_s": compute, "planning_s": planning, "changes_s": changes,
                     "total_s": compute + planning + changes, "paper_total_s": PAPER_FIG13[key].get(s, 0) * 1e3 or None}
    return {"scenario": sc.title, "workload": sc.workload, "gpus": num_gpus, "iterations": sum(sc.lengths()),
            "changes": len(phases) - 1, "systems": systems, "phases": phases, "totals": totals}


def phase_table(r: dict) -> str:
    lines = [f"{r['scenario']} ({r['workload']} tasks) on {r['gpus']} GPUs: {r['iterations']} iterations, "
             f"{r['changes']} task-set changes; simulated iteration time (ms) per phase",
             f"{'from':>8}{'iters':>8}{'n':>3}  " + "".join(f"{s:>14}" for s in r["systems"]) + "  tasks"]
    for p in r["phases"]:
        note = " (cached plan)" if p["cached"] else ""
        note += " (mem-relaxed)" if p["mem_relaxed"] else ""
        lines.append(f"{p['start']:>8}{p['iterations']:>8}{len(p['tasks']):>3}  "
                     + "".join(f"{p['iteration_time'][s] * 1e3:>14.0f}" for s in r["systems"])
                     + f"  {','.join(p['tasks'])}{note}")
    return "\n".join(lines)


def total_table(r: dict, change_seconds: float) -> str:
    sp = r["totals"]["spindle"]["total_s"]
    paper_sp = r["totals"]["spindle"]["paper_total_s"]
    lines = [f"{r['scenario']}: total wall time (10^3 s) = compute + planning + {r['changes']} changes x "
             f"{change_seconds:.2f} s (measured), ours beside Fig. 13",
             f"{'system':<15}{'compute':>10}{'planning':>10}{'changes':>10}{'total':>10}{'x Spindle':>11}"
             f"{'paper':>10}{'x Spindle':>11}"]
    for s in r["systems"]:
        t = r["totals"][s]
        paper = t["paper_total_s"]
        lines.append(f"{s:<15}{t['compute_s'] / 1e3:>10.1f}{t['planning_s'] / 1e3:>10.4f}{t['changes_s'] / 1e3:>10.4f}"
                     f"{t['total_s'] / 1e3:>10.1f}{t['total_s'] / sp:>11.2f}"
                     + (f"{paper / 1e3:>10.0f}{paper / paper_sp:>11.2f}" if paper else f"{'-':>10}{'-':>11}"))
    fastest = min(r["systems"], key=lambda s: r["totals"][s]["total_s"])
    lines.append(f"fastest here: {fastest}" + (" (as in the paper)" if fastest.startswith("spindle") and
                                               fastest != "spindle-seq" else " (the paper has Spindle fastest)"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=sorted(SCENARIOS), default=sorted(SCENARIOS),
                        help="the scenarios to run")
    parser.add_argument("--num-gpus", type=int, default=16, help="cluster size (A800-80GB, 8 per node)")
    parser.add_argument("--quick", action="store_true", help="the first two phases of each scenario on 8 GPUs")
    parser.add_argument("--with-cpsat", action="store_true",
                        help="add the CP-SAT planner as a Spindle column (10 s limit per distinct task set)")
    parser.add_argument("--change-seconds", type=float, default=None,
                        help="cost of one task-set change in seconds (default: measured on this CPU)")
    add_output_args(parser)
    args = parser.parse_args(argv)
    if args.change_seconds is not None and args.change_seconds < 0:
        parser.error(f"--change-seconds must be >= 0, got {args.change_seconds}")
    if args.num_gpus <= 0:
        parser.error(f"--num-gpus must be positive, got {args.num_gpus}")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    rec = Recording(args, "dynamic_tasks")
    measured = None
    if args.change_seconds is None:
        measured = measure_change_seconds(log)
        change = measured["per_change_seconds"]
        print(f"cost of one task-set change, measured on this CPU (tiny-clip, 1 process): save "
              f"{sum(measured['save_seconds']) / 3:.3f} s + rebuild {sum(measured['rebuild_seconds']) / 3:.3f} s "
              f"= {change:.3f} s (rebuilds {', '.join(f'{x:.3f}' for x in measured['rebuild_seconds'])} s)\n")
    else:
        change = args.change_seconds
        print(f"cost of one task-set change: {change:.3f} s (given)\n")
    results = {}
    for key in args.workloads:
        sc = SCENARIOS[key]
        if args.quick:
            sc = Scenario(sc.title, sc.workload, sc.phases[2][0], sc.phases[:2])
        r = run_scenario(key, sc, 8 if args.quick else args.num_gpus, change, log, args.with_cpsat)
        results[key] = r
        print(phase_table(r) + "\n")
        print(total_table(r, change) + "\n")
    rec.save({"change_cost": measured or {"per_change_seconds": change}, "scenarios": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
