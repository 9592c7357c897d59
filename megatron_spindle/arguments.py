"""Megatron-style argparse groups shared by tools/plan.py, tools/profile_metaops.py and pretrain_multitask.py.

Each ``add_*_args(parser)`` adds one group of kebab-case flags; ``*_from_args(args)`` turns them into the
dataclass configs the library uses. Where a group is a config dataclass, its flags are declared on the
dataclass's fields (megatron_spindle/flags.py). Entry points compose them and accept an ``extra_args_provider``.
"""

from __future__ import annotations

import argparse
from typing import Callable

from megatron_spindle.errors import CliArgumentParser
from megatron_spindle.flags import add_flags, config_from_args
from megatron_spindle.graph.cluster import NODE_TYPES, ClusterError, ClusterSpec, load_cluster, make_cluster
from megatron_spindle.graph.task_sets import select_tasks
from megatron_spindle.graph.workload import Workload, load_workload

SPINDLE_PREFIX = "spindle-"  # PlannerConfig's flags: --spindle-planner, --spindle-solver-time-limit, ...


def add_workload_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("workload")
    g.add_argument("--workload", required=True,
                   help="Workload YAML file, or a built-in name (tiny-clip, tiny-vlm, clip-10, qwen-val, ...).")
    g.add_argument("--tasks", default=None, metavar="TASK,TASK,...",
                   help="The set of the workload's tasks to train/plan (default: all; the order does not matter). "
                        "Resuming a checkpoint with another set keeps what the two share: see --task-schedule.")
    g.add_argument("--freeze", nargs="+", default=None, metavar="MODULE",
                   help="Modules whose weights are frozen (Megatron-LM's --freeze-ViT / --freeze-LM, by the "
                        "workload's module names; or `frozen: true` in the YAML): no gradients, optimizer state or "
                        "gradient sync; their backward computes only the input gradients a trainable module "
                        "upstream needs. The planner plans for it. Weights come from --load (a checkpoint of the "
                        "whole model) or their initialisation.")
    return parser


def load_workload_arg(args: argparse.Namespace) -> Workload:
    """--workload, with the modules of --freeze frozen (an unknown module is a WorkloadError)."""
    w = load_workload(args.workload)
    freeze = getattr(args, "freeze", None)
    return w.frozen(freeze) if freeze else w


def add_batch_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--global-batch-size (and Megatron's --micro-batch-size, refused with the reason) for the tools that plan or
    profile a workload, so that they see the batches pretrain_multitask.py trains with the same flag
    (training/batch_size.py; ``workload_from_args`` applies it)."""
    from megatron_spindle.training.batch_size import add_batch_size_args

    add_batch_size_args(parser.add_argument_group("batch"))
    return parser


def add_cluster_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("cluster")
    g.add_argument("--num-gpus", type=int, default=None, help="Total number of devices.")
    g.add_argument("--gpus-per-node", type=int, default=None, help="Devices per node (one NVLink island). Default: "
                   "torchrun's LOCAL_WORLD_SIZE under pretrain_multitask.py, else the node type's (8).")
    g.add_argument("--gpu-type", default="A800-80GB", choices=sorted(NODE_TYPES),
                   help="Built-in node type: peak FLOP/s, memory and link bandwidths.")
    g.add_argument("--cluster", default=None, help="Cluster YAML file (instead of --num-gpus/--gpu-type).")
    return parser


def add_spindle_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--spindle-*``: every field of PlannerConfig (declared there), and the profile to plan from."""
    from megatron_spindle.planner.pipeline import PlannerConfig

    g = add_flags(parser.add_argument_group("spindle planner"), PlannerConfig, prefix=SPINDLE_PREFIX)
    g.add_argument("--use-distributed-optimizer", dest="spindle_distributed_optimizer", action="store_const",
                   const="on", help="Megatron's name for --spindle-distributed-optimizer on.")
    g.add_argument("--spindle-profile", default=None,
                   help="Profile JSON from tools/profile_metaops.py; its measured points replace the analytic "
                        "cost model.")
    return parser


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The workload, restricted to the --tasks set when given (an unknown task name is a WorkloadError), at the
    batches of --global-batch-size where the parser has it (``add_batch_args``): the set's tasks share it, as
    pretrain_multitask.py shares it among the tasks that train."""
    from megatron_spindle.training.batch_size import batched_task_set

    w = load_workload_arg(args)
    tasks = None
    if getattr(args, "tasks", None) is not None:
        tasks = select_tasks(w, args.tasks.split(","), "--tasks")
    return batched_task_set(w, args, tasks)[1]


def cluster_from_args(args: argparse.Namespace, default_num_gpus: int | None = None) -> ClusterSpec:
    if args.gpus_per_node is not None and args.gpus_per_node <= 0:
        raise ClusterError(f"--gpus-per-node must be positive, got {args.gpus_per_node}")
    if args.num_gpus is not None and args.num_gpus <= 0:
        raise ClusterError(f"--num-gpus must be positive, got {args.num_gpus}")
    if args.cluster:
        if args.num_gpus is not None:
            raise ClusterError("give either --cluster FILE or --num-gpus N, not both")
        return load_cluster(args.cluster)
    n = args.num_gpus if args.num_gpus is not None else default_num_gpus
    if n is None:
        raise ClusterError("give --num-gpus N (with --gpus-per-node/--gpu-type) or --cluster FILE")
    per_node = args.gpus_per_node if args.gpus_per_node is not None else NODE_TYPES[args.gpu_type]["gpus_per_node"]
    return make_cluster(n, per_node, args.gpu_type)


def planner_config_from_args(args: argparse.Namespace):
    from megatron_spindle.planner.pipeline import PlannerConfig

    return config_from_args(PlannerConfig, args, prefix=SPINDLE_PREFIX)


def build_parser(description: str, groups: list[Callable], extra_args_provider: Callable | None = None):
    parser = CliArgumentParser(description=description, allow_abbrev=False, megatron_flags=True,
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for add in groups:
        add(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    return parser
