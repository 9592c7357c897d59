#!/usr/bin/env python
"""`make demo`: profile, plan and train the tiny Multitask-CLIP on CPU, save a checkpoint, show where everything is.

Profiles tiny-clip's MetaOps on this machine (tools/profile_metaops.py), plans it from that profile with
Spindle's wavefront planner, trains it for a few dozen iterations on mock data, checks that the losses fall,
saves a layout-independent checkpoint into demo_output/, and prints the plan's predicted iteration time against
the measured one and where the plan's Gantt chart and the TensorBoard logs are. Runs on 2 gloo processes by
default (--nproc 1: training in this process). --no-profile plans from the analytic model's placeholder CPU
numbers instead, whose prediction is far from the measured time. Runs in about a minute on 2 cores.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import time

from megatron_spindle.errors import CliArgumentParser, cli_main
from megatron_spindle.training.log import LogRecord, parse_log_line, steady_iteration_ms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _entry_point():
    """pretrain_multitask.py (a script at the repository root, not part of the package), loaded by path."""
    spec = importlib.util.spec_from_file_location("pretrain_multitask", os.path.join(ROOT, "pretrain_multitask.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_torchrun(nproc: int, script: str, flags: list[str], port_offset: int = 0):
    """A script of this repository on ``nproc`` gloo processes; its output is shown as it comes and its
    training log lines parsed."""
    # below Linux's ephemeral range (from 32768), where the ranks' own connections could hold the port
    port = int(os.environ.get("MASTER_PORT") or 20000 + os.getpid() % 12000) + port_offset
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(port), os.path.join(ROOT, script), *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    records = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        for line in proc.stdout:
            print(line, end="", flush=True)
            rec = parse_log_line(line)
            if rec:
                records.append(rec)
    return proc.returncode, records


MARKER = ".spindle-demo-output"
DEMO_FILES = {MARKER, "checkpoints", "tensorboard", "plan.png", "profile.json"}  # only a folder of these (or empty) is replaced


def prepare_output(out: str) -> None:
    """Replace ``out`` if the demo made it; refuse any other existing folder (it is the user's)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is a file, not a folder")
    if os.path.isdir(out) and os.listdir(out):
        if not set(os.listdir(out)) <= DEMO_FILES:
            raise ValueError(f"--out {out} is a folder the demo did not make and is not empty: give a new or an "
                             f"empty folder (the demo replaces its output folder)")
        shutil.rmtree(out)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, MARKER), "w") as f:
        f.write("written by tools/demo.py; the next demo run replaces this folder\n")


def iteration_time_line(records: list[LogRecord], profiled: bool) -> str:
    """The plan's predicted iteration time against the measured one (the median of the logged intervals after
    the first, which holds the warm-up)."""
    measured = steady_iteration_ms(records)
    predicted = records[-1].predicted_ms
    source = ("from the profile of this machine" if profiled else
              "from the analytic model's placeholder CPU numbers: run without --no-profile to plan from measurements")
    return (f"iteration time:   predicted {predicted:.1f} ms ({source}), measured {measured:.1f} ms "
            f"(median of the logged intervals after the first): measured / predicted {measured / predicted:.2f}")


@cli_main()
def main(argv=None) -> int:
    p = CliArgumentParser(description=__doc__.strip().splitlines()[0], allow_abbrev=False)
    p.add_argument("--out", default=os.path.join(ROOT, "demo_output"), help="Output folder (replaced).")
    p.add_argument("--train-iters", type=int, default=40)
    p.add_argument("--nproc", type=int, default=2, help="gloo processes (torchrun); 1 trains in this process.")
    p.add_argument("--no-profile", action="store_true",
                   help="Plan from the analytic model's placeholder CPU numbers instead of a profile of this "
                        "machine (faster; the predicted iteration time is then far from the measured one).")
    args = p.parse_args(argv)
    if args.train_iters < 2:
        raise ValueError(f"--train-iters must be at least 2 (the demo compares losses), got {args.train_iters}")
    if args.nproc < 1:
        raise ValueError(f"--nproc must be positive, got {args.nproc}")
    out = os.path.abspath(args.out)
    prepare_output(out)
    ckpt, tb = os.path.join(out, "checkpoints"), os.path.join(out, "tensorboard")
    flags = [
        "--workload", "tiny-clip", "--spindle-planner", "wavefront", "--gpu-type", "CPU",
        "--mock-data", "--mock-data-samples", "16",
        "--train-iters", str(args.train_iters), "--lr", "5e-3", "--min-lr", "5e-4", "--lr-warmup-iters", "3",
        "--lr-decay-style", "cosine", "--weight-decay", "0.0", "--seed", "1234",
        "--save", ckpt, "--save-interval", str(max(1, args.train_iters // 2)), "--log-interval", "5",
        "--tensorboard-dir", tb, "--plan-gantt", os.path.join(out, "plan.png"),
    ]
    t0 = time.perf_counter()
    if not args.no_profile:
        profile = os.path.join(out, "profile.json")
        print(f"demo: profiling tiny-clip's MetaOps on this machine ({args.nproc} process(es))", flush=True)
        rc, _ = run_torchrun(args.nproc, os.path.join("tools", "profile_metaops.py"),
                             ["--workload", "tiny-clip", "--gpu-type", "CPU", "--no-profile-cache", "--out", profile],
                             port_offset=1)
        if rc:
            return rc
        flags += ["--spindle-profile", profile]
    if args.nproc == 1:
        import torch

        torch.set_num_threads(1)  # tiny operators: threads only add contention on a 2-core machine
        history: list = []
        rc = _entry_point().main(flags, history=history)
        records = [LogRecord(r.iteration, r.losses, r.total_loss, r.elapsed_ms, r.predicted_ms) for r in history]
    else:
        rc, records = run_torchrun(args.nproc, "pretrain_multitask.py", flags)
    if rc:
        return rc
    if len(records) < 2:
        print("demo: no training log lines found", file=sys.stderr)
        return 1
    head, tail = records[0], records[-1]
    print()
    done = "trained" if args.no_profile else "profiled, planned and trained"
    print(f"demo: {done} {tail.iteration} iterations on {args.nproc} process(es) in {time.perf_counter() - t0:.1f} s")
    for task in head.losses:
        print(f"  {task:<14} loss {head.losses[task]:.4f} (iteration {head.iteration}) -> "
              f"{tail.losses[task]:.4f} (iteration {tail.iteration})")
    fell = tail.total < head.total
    print(f"  total loss {head.total:.4f} -> {tail.total:.4f}: {'falling' if fell else 'NOT falling'}")
    print("  " + iteration_time_line(records, profiled=not args.no_profile))
    if not args.no_profile:
        print(f"  profile:          {out}/profile.json   (tools/plan.py --spindle-profile {out}/profile.json ...)")
    print(f"  plan picture:     {out}/plan.png")
    print(f"  checkpoint:       {ckpt} (resume with --load {ckpt}, under any plan or world size)")
    print(f"  TensorBoard logs: {tb}   (tensorboard --logdir {tb})")
    return 0 if fell else 1


if __name__ == "__main__":
    sys.exit(main())
