"""Megatron-style argparse groups shared by tools/plan.py, tools/profile.py and pretrain_multitask.py.

Each ``add_*_args(parser)`` adds one group of kebab-case flags; ``*_from_args(args)`` turns them into the
dataclass configs the library uses. Entry points compose them and accept an ``extra_args_provider``.
"""

from __future__ import annotations

import argparse
from typing import Callable

from megatron_spindle.graph.cluster import NODE_TYPES, ClusterSpec, load_cluster, make_cluster
from megatron_spindle.graph.workload import Workload, load_workload


def add_workload_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("workload")
    g.add_argument("--workload", required=True,
                   help="Workload YAML file, or a built-in name (tiny-clip, tiny-vlm, clip-10, qwen-val, ...).")
    g.add_argument("--tasks", default=None,
                   help="Comma-separated subset of the workload's tasks to train/plan (default: all).")
    return parser


def add_cluster_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("cluster")
    g.add_argument("--num-gpus", type=int, default=None, help="Total number of devices.")
    g.add_argument("--gpus-per-node", type=int, default=8, help="Devices per node (one NVLink island).")
    g.add_argument("--gpu-type", default="A800-80GB", choices=sorted(NODE_TYPES),
                   help="Built-in node type: peak FLOP/s, memory and link bandwidths.")
    g.add_argument("--cluster", default=None, help="Cluster YAML file (instead of --num-gpus/--gpu-type).")
    return parser


def add_spindle_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("spindle planner")
    g.add_argument("--spindle-planner", choices=["wavefront", "cpsat"], default="cpsat",
                   help="wavefront: the paper's greedy planner; cpsat: refined by an OR-Tools CP-SAT model "
                        "warm-started from the greedy plan.")
    g.add_argument("--spindle-inverse", choices=["rate", "time"], default="rate",
                   help="Interpolation of T^-1 in the allocator: linear in rate 1/T (consistent with sum n* = N) "
                        "or linear in T (the paper's eq. 11).")
    g.add_argument("--spindle-placement", choices=["spindle", "sequential"], default="spindle",
                   help="Device placement: island/flow/memory-aware heuristics, or consecutive devices (ablation).")
    g.add_argument("--spindle-solver-time-limit", type=float, default=10.0, help="CP-SAT time limit in seconds.")
    g.add_argument("--spindle-solver-workers", type=int, default=2, help="CP-SAT search workers.")
    g.add_argument("--spindle-cross-level-overlap", action="store_true",
                   help="CP-SAT: let a MetaOp start when its own producers end instead of at the level barrier.")
    g.add_argument("--spindle-recompute", choices=["auto", "none", "full"], default="auto",
                   help="Full activation recomputation of transformer layers: auto plans without it and switches "
                        "it on only when the plan does not fit device memory otherwise.")
    g.add_argument("--spindle-distributed-optimizer", choices=["auto", "off", "on"], default="auto",
                   help="Shard each unit's optimizer state over the data-parallel ranks that run it (ZeRO-1, "
                        "like --use-distributed-optimizer): auto switches it on only when memory requires it.")
    g.add_argument("--spindle-profile", default=None,
                   help="Profile JSON from tools/profile.py; its measured points replace the analytic cost model.")
    return parser


def workload_from_args(args: argparse.Namespace) -> Workload:
    w = load_workload(args.workload)
    if getattr(args, "tasks", None):
        w = w.subset([t.strip() for t in args.tasks.split(",") if t.strip()])
    return w


def cluster_from_args(args: argparse.Namespace, default_num_gpus: int | None = None) -> ClusterSpec:
    if args.cluster:
        return load_cluster(args.cluster)
    n = args.num_gpus or default_num_gpus
    if n is None:
        raise SystemExit("error: give --num-gpus N (with --gpus-per-node/--gpu-type) or --cluster FILE")
    return make_cluster(n, args.gpus_per_node, args.gpu_type)


def planner_config_from_args(args: argparse.Namespace):
    from megatron_spindle.planner.pipeline import PlannerConfig

    return PlannerConfig(planner=args.spindle_planner, inverse=args.spindle_inverse,
                         placement=args.spindle_placement, solver_time_limit=args.spindle_solver_time_limit,
                         solver_workers=args.spindle_solver_workers,
                         cross_level_overlap=args.spindle_cross_level_overlap,
                         recompute=args.spindle_recompute,
                         distributed_optimizer=args.spindle_distributed_optimizer)


def build_parser(description: str, groups: list[Callable], extra_args_provider: Callable | None = None):
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for add in groups:
        add(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    return parser
