"""Run a plan: ``python -m megatron_spindle.runtime --plan plan.json --workload tiny-clip --steps 3``.

Under torchrun (env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) or as one process (world size 1).
Backend: nccl when CUDA is available, else gloo. Data: deterministic mock batches (data/mock.py). Rank 0 prints
the per-task losses of every step (``--json``: one JSON object per line).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    owned: bool  # we initialised the process group (and destroy it at the end)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the torchrun environment; (0, 1, 0) without one."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def init_distributed(backend: str | None = None) -> DistContext:
    """Join (or create) the default process group. Reuses an existing one (e.g. in tests)."""
    if dist.is_initialized():
        return DistContext(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)),
                           dist.get_backend(), owned=False)
    rank, world, local = env_world()
    if "RANK" not in os.environ:  # single process without torchrun
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(local)
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world)
    return DistContext(rank, world, local, backend, owned=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_spindle.runtime", description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True, help="plan JSON written by the planner")
    p.add_argument("--workload", required=True, help="built-in workload name or workload YAML path")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl with CUDA, else gloo")
    p.add_argument("--json", action="store_true", help="print one JSON object per step")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    """Returns the per-step losses (on every rank)."""
    from megatron_spindle.graph.opgraph import build_metagraph
    from megatron_spindle.graph.workload import load_workload
    from megatron_spindle.plan.schema import Plan
    from megatron_spindle.runtime.engine import EngineConfig, OptimizerConfig, RuntimeEngine
    from megatron_spindle.runtime.layout import check_runnable

    args = parse_args(argv)
    plan = Plan.load(args.plan)
    workload = load_workload(args.workload)
    metagraph = build_metagraph(workload)
    world = dist.get_world_size() if dist.is_initialized() else env_world()[1]
    check_runnable(plan, workload, metagraph, world)  # a wrong plan fails before the process group forms
    ctx = init_distributed(args.backend)
    history = []
    try:
        cfg = EngineConfig(optimizer=OptimizerConfig(lr=args.lr, weight_decay=args.weight_decay),
                           data_seed=args.data_seed)
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
        if ctx.owned:
            dist.destroy_process_group()
    return history


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # a clear one-line error for plan/workload problems, full traceback otherwise
        from megatron_spindle.graph.workload import WorkloadError
        from megatron_spindle.plan.schema import PlanError

        if isinstance(e, (PlanError, WorkloadError)):
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        raise
