#!/usr/bin/env python
"""`make demo`: plan and train the tiny Multitask-CLIP on CPU, save a checkpoint, show where everything is.

Plans tiny-clip with Spindle's wavefront planner, trains it for a few dozen iterations on mock data in one
process (gloo), checks that the losses fall, saves a layout-independent checkpoint into demo_output/, and
prints where the plan's Gantt chart and the TensorBoard logs are. Runs in about a minute on 2 cores.
"""

import argparse
import os
import shutil
import sys
import time

# run as a script, tools/ is sys.path[0] and tools/profile.py would shadow the standard library's profile
sys.path[:] = [q for q in sys.path if os.path.abspath(q or os.curdir) != os.path.dirname(os.path.abspath(__file__))]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def runtime_available() -> str | None:
    """None when the runtime engine and the operators import, else why not."""
    try:
        from megatron_spindle.models import build_operator  # noqa: F401
        from megatron_spindle.runtime.engine import RuntimeEngine  # noqa: F401
    except Exception as e:  # a missing or half-landed package
        return f"{type(e).__name__}: {e}"
    return None


def plan_only(out: str) -> int:
    import importlib.util

    # by file path: putting tools/ on sys.path would let tools/profile.py shadow the standard library's profile
    spec = importlib.util.spec_from_file_location("spindle_plan_tool", os.path.join(ROOT, "tools", "plan.py"))
    plan_tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_tool)

    return plan_tool.main(["--workload", "tiny-clip", "--num-gpus", "2", "--spindle-planner", "wavefront",
                           "--out", os.path.join(out, "plan.json"), "--gantt", os.path.join(out, "plan.png")])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--out", default=os.path.join(ROOT, "demo_output"), help="Output folder (replaced).")
    p.add_argument("--train-iters", type=int, default=40)
    args = p.parse_args(argv)
    out = os.path.abspath(args.out)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    why = runtime_available()
    if why is not None:
        print(f"training is not available yet ({why}); planning only")
        rc = plan_only(out)
        print(f"plan: {out}/plan.json, Gantt chart: {out}/plan.png")
        return rc
    import torch

    torch.set_num_threads(1)  # tiny operators: threads only add contention on a 2-core machine
    import pretrain_multitask

    ckpt, tb = os.path.join(out, "checkpoints"), os.path.join(out, "tensorboard")
    history: list = []
    t0 = time.perf_counter()
    rc = pretrain_multitask.main([
        "--workload", "tiny-clip", "--spindle-planner", "wavefront",
        "--mock-data", "--mock-data-samples", "32",
        "--train-iters", str(args.train_iters), "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "3",
        "--lr-decay-style", "cosine", "--weight-decay", "0.0", "--seed", "1234",
        "--save", ckpt, "--save-interval", str(max(1, args.train_iters // 2)), "--log-interval", "5",
        "--tensorboard-dir", tb, "--plan-gantt", os.path.join(out, "plan.png"),
    ], history=history)
    if rc:
        return rc
    first, last = history[0], history[-1]
    print()
    print(f"demo: trained {last.iteration} iterations in {time.perf_counter() - t0:.1f} s")
    for task in first.losses:
        print(f"  {task:<14} loss {first.losses[task]:.4f} (iteration {first.iteration}) -> "
              f"{last.losses[task]:.4f} (iteration {last.iteration})")
    fell = last.total_loss < first.total_loss
    print(f"  total loss {first.total_loss:.4f} -> {last.total_loss:.4f}: {'falling' if fell else 'NOT falling'}")
    print(f"  plan picture:     {out}/plan.png")
    print(f"  checkpoint:       {ckpt} (resume with --load {ckpt}, under any plan or world size)")
    print(f"  TensorBoard logs: {tb}   (tensorboard --logdir {tb})")
    return 0 if fell else 1


if __name__ == "__main__":
    sys.exit(main())
