"""Argument groups of pretrain_multitask.py beyond the shared ones in megatron_spindle/arguments.py:
training, per-task, checkpointing, logging and data (Megatron-LM flag names where Megatron has the flag)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from megatron_spindle.arguments import planner_config_from_args
from megatron_spindle.fileio import PICTURE_SUFFIXES, check_output_file, check_output_folder
from megatron_spindle.flags import add_flags, config_from_args, finite_float
from megatron_spindle.graph.workload import Workload
from megatron_spindle.training.batch_size import add_batch_size_args
from megatron_spindle.training.engine_state import TIMING_LOG_LEVELS
from megatron_spindle.training.manual_gc import add_manual_gc_args, check_manual_gc_args
from megatron_spindle.training.profiling import add_profiling_args, check_profiling_args
from megatron_spindle.training.schedule import WD_INCR_STYLES, LRSchedule, WeightDecaySchedule
from megatron_spindle.training.task_schedule import TaskScheduleConfig
from megatron_spindle.training.wandb_writer import add_wandb_args


def add_training_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("training")
    g.add_argument("--train-iters", type=int, required=True, help="Total iterations to train for.")
    add_flags(g, LRSchedule)  # --lr, --min-lr, --lr-warmup-iters, --lr-decay-iters, --lr-decay-style
    g.add_argument("--weight-decay", type=finite_float, default=0.01, help="AdamW decoupled weight decay, as "
                   "Megatron-LM applies it: not to biases and 1-D parameters (norms, class tokens).")
    g.add_argument("--start-weight-decay", type=finite_float, default=None, help="Weight decay at the first "
                   "iteration, rising to --end-weight-decay at the last (--weight-decay-incr-style linear or cosine; "
                   "Megatron-LM's).")
    g.add_argument("--end-weight-decay", type=finite_float, default=None, help="Weight decay at the last iteration.")
    g.add_argument("--weight-decay-incr-style", choices=WD_INCR_STYLES, default="constant", help="constant: "
                   "--weight-decay throughout; linear or cosine: from --start-weight-decay to --end-weight-decay.")
    g.add_argument("--adam-beta1", type=finite_float, default=0.9)
    g.add_argument("--adam-beta2", type=finite_float, default=0.999)
    g.add_argument("--adam-eps", type=finite_float, default=1e-8)
    g.add_argument("--seed", type=int, default=1234, help="Seed of the initial weights, the data order and the "
                   "RNGs.")
    g.add_argument("--init-method-std", type=finite_float, default=0.02, help="Standard deviation of the initial "
                   "weights (normal, zero mean; norms start at 1 and 0).")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false", help="Train on when a loss or the gradient norm is not finite (by default "
                   "the run stops before that step's optimizer step, as Megatron-LM's does; fp16 overflows are "
                   "skipped either way).")
    g.add_argument("--calculate-per-token-loss", action="store_true", help="Accepted for Megatron-LM launch "
                   "scripts: an LM task's loss is always the mean over the labelled tokens of its global batch.")
    g.add_argument("--use-cpu-initialization", action="store_true", help="Accepted for Megatron-LM launch "
                   "scripts: the initial weights are always made on the CPU, from each parameter's name, the same "
                   "under any plan.")
    g.add_argument("--use-mcore-models", action="store_true", help="Accepted for Megatron-LM launch scripts: the "
                   "models are always megatron-core's (as in Megatron-LM, where the flag is ignored).")
    g.add_argument("--bf16", action="store_true", help="Run the operators in bfloat16 (GPU only; masters and "
                   "optimizer state stay fp32).")
    g.add_argument("--clip-grad", type=finite_float, default=1.0, help="Clip the global L2 norm of the gradients "
                   "(every parameter unit counted once, over all ranks) to this value before each step; 0: no "
                   "clipping.")
    add_batch_size_args(g)  # --global-batch-size, --micro-batch-size
    add_manual_gc_args(g)  # --manual-gc, --manual-gc-interval, --no-manual-gc-eval
    return parser


def add_task_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("tasks")
    g.add_argument("--task-loss-weights", default=None, metavar="TASK=W,...",
                   help="Loss weight per task (default: the workload's loss weights); the total loss is "
                        "sum_t w_t * loss_t.")
    g.add_argument("--task-sampling-weights", default=None, metavar="TASK=W,...",
                   help="Relative sampling weight per task: a task takes part in an iteration with probability "
                        "w_t / max w (default: every task every iteration). See data/sampler.py.")
    add_flags(g, TaskScheduleConfig)  # --task-schedule
    return parser


def add_plan_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("spindle plan")
    g.add_argument("--spindle-plan", default=None, help="Run this saved plan JSON (tools/plan.py --out) instead of "
                   "planning at start; it must be for this workload and world size.")
    return parser


def add_checkpointing_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="Folder to save checkpoints (and the plan and its Gantt chart) in.")
    g.add_argument("--load", default=None, help="Checkpoint to resume from: a --save folder (its latest checkpoint) "
                   "or one of its iter_* folders (exactly that one); the plan and world size may differ from the "
                   "run that saved it. A folder with no checkpoint is an error, except --load equal to --save "
                   "before the first save (training starts from scratch).")
    g.add_argument("--save-interval", type=int, default=None, help="Save every N iterations (and at the end).")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true", help="Stop when --load holds no checkpoint, "
                   "also where --load is --save (which otherwise starts from scratch: the auto-resume pattern).")
    g.add_argument("--no-load-optim", action="store_true", help="Do not restore the optimizer state (without it, "
                   "a checkpoint that lacks it is an error).")
    g.add_argument("--no-load-rng", action="store_true", help="Do not restore the RNG states (without it, a "
                   "checkpoint that lacks them is an error).")
    g.add_argument("--no-save-rng", action="store_true", help="Save no RNG states (a resume then needs "
                   "--no-load-rng).")
    g.add_argument("--no-save-optim", action="store_true", help="Save the weights without the optimizer state "
                   "(a resume then starts AdamW afresh and needs --no-load-optim).")
    g.add_argument("--finetune", action="store_true", help="Load only the weights from --load: no optimizer, RNG or "
                   "data position, and start at iteration 0.")
    g.add_argument("--pretrained-checkpoint", default=None, metavar="FOLDER",
                   help="As in Megatron-LM: while --load holds no checkpoint (or is not given), start from this "
                        "checkpoint's weights as --finetune does (iteration 0, no optimizer, RNG or data position); "
                        "once the run has saved into --load, it resumes from there.")
    return parser


def add_logging_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=10, help="Print a log line every N iterations.")
    g.add_argument("--tensorboard-dir", default=None, help="Write TensorBoard scalars here.")
    g.add_argument("--plan-gantt", default=None, help="Gantt chart PNG of the plan (default: <save>/plan.png).")
    g.add_argument("--log-throughput", action="store_true", help="Log samples per second and model TFLOP/s per GPU "
                   "(the cost model's FLOP count of the tasks that ran) in the log line and to TensorBoard.")
    g.add_argument("--log-memory-to-tensorboard", action="store_true", help="Write memory use (the largest over "
                   "the ranks; CUDA allocator statistics, or the resident set on CPU) to TensorBoard.")
    g.add_argument("--log-params-norm", action="store_true", help="Log the global L2 norm of the weights (fp32 "
                   "masters, each element once) in the log line and to TensorBoard; an all-reduce per log line.")
    g.add_argument("--log-num-zeros-in-grad", action="store_true", help="Log the number of zeros in the "
                   "gradients (each element of the model once) in the log line and to TensorBoard; an all-reduce "
                   "per step.")
    g.add_argument("--log-timers-to-tensorboard", action="store_true", help="Write the --timing-log-level timers "
                   "to TensorBoard and W&B too.")
    g.add_argument("--no-log-loss-scale-to-tensorboard", dest="log_loss_scale_to_tensorboard",
                   action="store_false", help="Do not write the loss scale to TensorBoard and W&B.")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true", help="Write the validation and "
                   "test perplexity of each LM task to TensorBoard and W&B too.")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true", help="Write the number of ranks to "
                   "TensorBoard and W&B.")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000, help="Scalars TensorBoard's writer holds "
                   "before it writes them to disk.")
    g.add_argument("--timing-log-level", type=int, default=0, choices=TIMING_LOG_LEVELS, help="0: iteration and "
                   "per-wave times; 1: also the step's phases (min, max over ranks; synchronises CUDA at their "
                   "boundaries); 2: also the batch generator and the forward/backward part of every wave "
                   "(synchronises CUDA after each wave).")
    add_wandb_args(g)
    add_profiling_args(g)  # --profile, --use-pytorch-profiler, --profile-step-start/-end, --profile-ranks
    return parser


def add_data_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", action="extend", nargs="+", default=[], metavar="TASK=PATH",
                   help="Tar-shard dataset of a task (tools/build_multitask_dataset.py): TASK=PATH, several after "
                        "one flag, as Megatron-LM takes them, or the flag repeated; a task given several folders "
                        "(parts built separately) reads them in order as one dataset, or blends them with "
                        "TASK=WEIGHT:PATH for each (every batch drawn from the parts in those proportions, each "
                        "part in its own epochs; --split splits each part). A text-only LM task also reads a "
                        "Megatron-LM indexed corpus: TASK=PREFIX of PREFIX.bin / PREFIX.idx (tools/preprocess_data.py's), "
                        "as windows of its token stream.")
    g.add_argument("--mock-data", action="store_true", help="Deterministic mock samples for every task.")
    g.add_argument("--mock-data-samples", type=int, default=256, help="Mock samples per task (they repeat).")
    g.add_argument("--num-workers", type=int, default=2, help="Data threads: decode a batch's samples in parallel "
                   "and prepare the next iteration's batches during the step (0: decode inline).")
    return parser


def weight_decay_schedule_from_args(args: argparse.Namespace) -> WeightDecaySchedule | None:
    """The --start/--end-weight-decay schedule over --train-iters; None for a constant --weight-decay."""
    ends = (args.start_weight_decay, args.end_weight_decay)
    if args.weight_decay_incr_style == "constant":
        if any(v is not None for v in ends):
            raise ValueError("--start-weight-decay / --end-weight-decay need --weight-decay-incr-style linear or "
                             "cosine (constant: --weight-decay)")
        return None
    if any(v is None for v in ends):
        raise ValueError(f"--weight-decay-incr-style {args.weight_decay_incr_style} needs --start-weight-decay and "
                         f"--end-weight-decay")
    return WeightDecaySchedule(*ends, args.weight_decay_incr_style, args.train_iters)


def lr_schedule_from_args(args: argparse.Namespace) -> LRSchedule:
    """The schedule of the LR flags; the decay spans --train-iters unless --lr-decay-iters says otherwise."""
    return config_from_args(LRSchedule, args, decay_iters=args.lr_decay_iters or args.train_iters)


def parse_task_values(text: str | None, flag: str, workload: Workload, positive: bool) -> dict[str, float]:
    """``"a=1,b=0.5"`` -> {"a": 1.0, "b": 0.5}, tasks checked against the workload."""
    if not text:
        return {}
    tasks = [t.name for t in workload.tasks]
    out = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"{flag}: '{part}' is not TASK=VALUE")
        name = name.strip()
        if name not in tasks:
            raise ValueError(f"{flag}: unknown task '{name}' (tasks: {', '.join(tasks)})")
        try:
            v = float(value)
        except ValueError:
            raise ValueError(f"{flag}: value of '{name}' is not a number: {value!r}") from None
        if not math.isfinite(v) or v < 0 or (positive and v == 0):
            raise ValueError(f"{flag}: value of '{name}' must be {'> 0' if positive else '>= 0'}, got {value}")
        out[name] = v
    return out


def parse_data_paths(items: list[str], workload: Workload, flag: str = "--data-path") -> dict[str, list[str]]:
    """TASK=PATH items -> each task's folders, in order: a task given several reads them as one dataset, one
    after the other, or as a blend of them with TASK=WEIGHT:PATH for each (data/sampler.py ``Blend``). The items
    keep their WEIGHT: prefix."""
    from megatron_spindle.data.indexed import is_indexed_prefix
    from megatron_spindle.data.sampler import blend_weights, weighted_path

    tasks = [t.name for t in workload.tasks]
    out: dict[str, list[str]] = {}
    for item in items:
        name, sep, part = item.partition("=")
        if not sep or not name or not part:
            hint = (" (a blend of a task's datasets: TASK=WEIGHT:PATH for each; between tasks: "
                    "--task-sampling-weights)") if _is_number(item) else ""
            raise ValueError(f"{flag}: '{item}' is not TASK=PATH{hint}")
        if name not in tasks:
            raise ValueError(f"{flag}: unknown task '{name}' (tasks: {', '.join(tasks)})")
        weight, path = weighted_path(part)
        if weight is not None and not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"{flag}: '{item}': a blend weight must be a positive number")
        if path in [weighted_path(p)[1] for p in out.get(name, ())]:
            raise ValueError(f"{flag}: {path} given twice for task '{name}'")
        if not Path(path).exists() and not is_indexed_prefix(path):
            raise FileNotFoundError(f"{flag}: {path} (task '{name}') does not exist (a folder of tar shards, or a "
                                    f"Megatron-LM indexed corpus's PREFIX of PREFIX.bin and PREFIX.idx)")
        out.setdefault(name, []).append(part)
    for name, parts in out.items():
        try:
            blend_weights([weighted_path(p)[0] for p in parts])
        except ValueError as e:
            raise ValueError(f"{flag}: task '{name}' has {e}") from None
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def validate_args(args: argparse.Namespace, world_size: int, cuda: bool) -> None:
    """Checks argparse cannot express; raises ValueError naming the flag."""
    if args.bf16 and not cuda:
        raise ValueError("--bf16 needs a GPU: torch.cuda.is_available() is False on this machine (drop --bf16 "
                         "to train in fp32 on CPU)")
    if args.train_iters <= 0:
        raise ValueError(f"--train-iters must be positive, got {args.train_iters}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be positive, got {args.lr}")
    if args.min_lr < 0 or args.min_lr > args.lr:
        raise ValueError(f"--min-lr must lie in [0, --lr={args.lr}], got {args.min_lr}")
    if args.lr_warmup_iters < 0:
        raise ValueError(f"--lr-warmup-iters must be >= 0, got {args.lr_warmup_iters}")
    if args.lr_decay_iters is not None and args.lr_decay_iters <= 0:
        raise ValueError(f"--lr-decay-iters must be positive, got {args.lr_decay_iters}")
    lr_schedule_from_args(args)  # WSD's --lr-wsd-decay-iters, checked before planning
    planner_config_from_args(args)  # the planner's flags (dropout, recomputation, ...) before anything is written
    if args.weight_decay < 0:
        raise ValueError(f"--weight-decay must be >= 0, got {args.weight_decay}")
    wd_schedule = weight_decay_schedule_from_args(args)
    most = args.weight_decay if wd_schedule is None else max(wd_schedule.start, wd_schedule.end)
    if args.lr * most >= 1:
        raise ValueError(f"--lr x the weight decay = {args.lr * most:g} >= 1: AdamW's decoupled decay would zero the "
                         f"weights or flip their sign")
    if args.init_method_std <= 0:
        raise ValueError(f"--init-method-std must be positive, got {args.init_method_std}")
    if args.log_interval <= 0:
        raise ValueError(f"--log-interval must be positive, got {args.log_interval}")
    if args.tensorboard_queue_size <= 0:
        raise ValueError(f"--tensorboard-queue-size must be positive, got {args.tensorboard_queue_size}")
    check_manual_gc_args(args)
    check_profiling_args(args)
    if args.save_interval is not None and args.save_interval <= 0:
        raise ValueError(f"--save-interval must be positive, got {args.save_interval}")
    if args.save_interval is not None and not args.save:
        raise ValueError("--save-interval needs --save FOLDER")
    if args.finetune and not args.load:
        raise ValueError("--finetune needs --load FOLDER (the checkpoint whose weights to start from)")
    if args.num_workers < 0:
        raise ValueError(f"--num-workers must be >= 0, got {args.num_workers}")
    if args.mock_data_samples <= 0:
        raise ValueError(f"--mock-data-samples must be positive, got {args.mock_data_samples}")
    if args.mock_data and args.data_path:
        raise ValueError("give either --mock-data or --data-path TASK=PATH, not both")
    if not args.mock_data and not args.data_path:
        raise ValueError("no training data: give --data-path TASK=PATH for each task, or --mock-data")
    if args.num_gpus is not None and args.num_gpus != world_size:
        raise ValueError(f"--num-gpus {args.num_gpus} does not match the world size {world_size} (the runtime "
                         f"runs one rank per device; leave --num-gpus out to plan for the world size)")
    if not (0 <= args.adam_beta1 < 1 and 0 <= args.adam_beta2 < 1):
        raise ValueError(f"--adam-beta1 and --adam-beta2 must lie in [0, 1), got {args.adam_beta1} and "
                         f"{args.adam_beta2}")
    if not args.adam_eps > 0:
        raise ValueError(f"--adam-eps must be positive, got {args.adam_eps}")
    for flag, path in (("--save", args.save), ("--tensorboard-dir", args.tensorboard_dir)):
        if path is not None:
            check_output_folder(path, flag)
    if args.plan_gantt is not None:
        check_output_file(args.plan_gantt, "--plan-gantt", PICTURE_SUFFIXES)
    if args.load is not None and not args.load:
        raise ValueError("--load: empty path")
    if args.spindle_plan and not Path(args.spindle_plan).is_file():
        raise FileNotFoundError(f"--spindle-plan {args.spindle_plan}: no such file")
