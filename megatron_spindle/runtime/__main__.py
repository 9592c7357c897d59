"""Run a plan: ``python -m megatron_spindle.runtime --plan plan.json --workload tiny-clip --steps 3``.

Under torchrun (env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) or as one process (world size 1).
Backend: nccl when CUDA is available, else gloo. Data: deterministic mock batches (data/mock.py). Rank 0 prints
the per-task losses of every step (``--json``: one JSON object per line).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch.distributed as dist

from megatron_spindle.errors import CliArgumentParser, cli_main
from megatron_spindle.flags import finite_float
from megatron_spindle.runtime.distributed import destroy_distributed, env_world, init_distributed

PROG = "python -m megatron_spindle.runtime"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = CliArgumentParser(prog=PROG, description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--plan", required=True, help="plan JSON written by the planner")
    p.add_argument("--workload", required=True, help="built-in workload name or workload YAML path")
    p.add_argument("--freeze", nargs="+", default=None, metavar="MODULE",
                   help="modules frozen, as the plan was made (tools/plan.py --freeze)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=finite_float, default=1e-3)
    p.add_argument("--weight-decay", type=finite_float, default=0.0)
    p.add_argument("--data-seed", type=int, default=0, help="Seed of the mock batches and the dropout masks.")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl with CUDA, else gloo")
    p.add_argument("--json", action="store_true", help="print one JSON object per step")
    return p.parse_args(argv)


@cli_main(PROG)
def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    """Returns the per-step losses (on every rank)."""
    from megatron_spindle.arguments import load_workload_arg
    from megatron_spindle.graph.opgraph import build_metagraph
    from megatron_spindle.plan.schema import Plan
    from megatron_spindle.runtime.engine import EngineConfig, OptimizerConfig, RuntimeEngine
    from megatron_spindle.runtime.layout import check_runnable

    args = parse_args(argv)
    if args.steps < 0:
        raise ValueError(f"--steps must be >= 0, got {args.steps}")
    if not args.lr > 0 or args.weight_decay < 0:
        raise ValueError(f"--lr must be positive and --weight-decay >= 0, got {args.lr} and {args.weight_decay}")
    if not Path(args.plan).is_file():
        raise FileNotFoundError(f"--plan {args.plan}: no such file")
    plan = Plan.load(args.plan)
    workload = load_workload_arg(args)
    metagraph = build_metagraph(workload)
    world = dist.get_world_size() if dist.is_initialized() else env_world()[1]
    check_runnable(plan, workload, metagraph, world)  # a wrong plan fails before the process group forms
    ctx = init_distributed(args.backend)
    history = []
    try:
        cfg = EngineConfig(optimizer=OptimizerConfig(lr=args.lr, weight_decay=args.weight_decay, no_weight_decay_1d=True),
                           data_seed=args.data_seed, dropout_seed=args.data_seed)
        engine = RuntimeEngine(plan, workload, ctx.rank, ctx.world_size, cfg, metagraph=metagraph)
        for step in range(args.steps):
            losses = engine.train_step(step)
            history.append(losses)
            if ctx.rank == 0:
                if args.json:
                    print(json.dumps({"step": step, "losses": losses}), flush=True)
                else:
                    print(f"step {step} | " + " | ".join(f"{t} {v:.6f}" for t, v in losses.items()), flush=True)
    finally:
        destroy_distributed(ctx)
    return history


if __name__ == "__main__":
    main()
    sys.exit(0)
