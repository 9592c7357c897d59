"""The validation loop: --eval-interval, --eval-iters, --valid-data-path TASK=PATH, --test-data-path TASK=PATH,
--split, --skip-train (Megatron's flags).

Every --eval-interval iterations and after the last one, the engine runs --eval-iters forward-only passes through
the plan's wave schedule (``RuntimeEngine.evaluate``: no gradients, no gradient sync, no optimizer), each on one
global batch of every task, and the per-task losses are averaged over them. The overall validation loss is
``sum_t w_t * loss_t`` with the tasks' loss weights (every task takes part, whatever its sampling weight). The
time it takes is not part of the logged iteration time or throughput.

Validation data per task: --valid-data-path TASK=PATH (tar shards, as --data-path), else the validation share of
the task's training data given by --split TRAIN,VALID[,TEST] (Megatron's proportions; the first samples train,
the next ones validate, the last ones test), else, with --mock-data, mock samples the training set never sees.
Validation batch k of a task holds samples [k*B, (k+1)*B) (mod the set's size), so every evaluation sees the same
--eval-iters batches and the losses are comparable across evaluations.

Test data (--test-data-path TASK=PATH, else --split's test share) is evaluated the same way once, after the last
iteration, as Megatron-LM evaluates its test set at the end of training (not after an early exit: a signal,
--exit-interval, --exit-duration-in-mins). --skip-train loads --load (or starts from fresh weights without it),
evaluates the validation and the test data, and exits: nothing is trained or saved, nothing is written to
TensorBoard or W&B.
"""

from __future__ import annotations

import argparse
import functools
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable

from megatron_spindle.data.datasets import MockTaskDataset, TaskDataset, read_batch
from megatron_spindle.flags import add_flags, config_from_args, flag
from megatron_spindle.graph.workload import Workload


@dataclass(frozen=True)
class ValidationConfig:
    eval_interval: int | None = field(default=None, metadata=flag(
        "Evaluate on the validation data every N iterations and after the last one (default: Megatron-LM's 1000 "
        "where validation data is given, by --valid-data-path or --split's validation share; mock data validates "
        "only with this flag)."))
    eval_iters: int = field(default=100, metadata=flag(
        "Forward-only passes (one global batch of every task each) per evaluation; 0: no validation or test."))
    skip_train: bool = field(default=False, metadata=flag(
        "Bypass the training loop: load --load, evaluate the validation and test data given, and exit (nothing is "
        "saved: --save is ignored)."))

    @property
    def enabled(self) -> bool:
        return self.eval_interval is not None and self.eval_iters > 0


def add_validation_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = add_flags(parser.add_argument_group("validation"), ValidationConfig)
    g.add_argument("--valid-data-path", action="extend", nargs="+", default=[], metavar="TASK=PATH",
                   help="Validation tar shards of a task, TASK=PATH as --data-path takes them (several folders of a "
                        "task read as one). Tasks without one "
                        "validate on the --split share of their training data (mock data: unseen mock samples).")
    g.add_argument("--test-data-path", action="extend", nargs="+", default=[], metavar="TASK=PATH",
                   help="Test tar shards of a task, as --valid-data-path; evaluated once after the last iteration "
                        "(--eval-iters passes). Tasks without one test on the --split test share.")
    g.add_argument("--split", default=None, metavar="TRAIN,VALID[,TEST]",
                   help="Proportions of each task's training data used for training, validation and test, e.g. "
                        "98,2,0. None: all of it trains.")
    return parser


DEFAULT_EVAL_INTERVAL = 1000  # Megatron-LM's --eval-interval


def validation_config(args: argparse.Namespace) -> ValidationConfig:
    """The flags' config, --eval-interval resolved: Megatron-LM's default where validation data is given."""
    cfg = config_from_args(ValidationConfig, args)
    split = parse_split(args.split)
    given = bool(args.valid_data_path) or (split is not None and split[1] > 0)
    return replace(cfg, eval_interval=DEFAULT_EVAL_INTERVAL) if cfg.eval_interval is None and given else cfg


def parse_split(text: str | None) -> tuple[float, float, float] | None:
    if text is None:
        return None
    try:
        parts = [float(x) for x in text.replace("/", ",").split(",")]
    except ValueError:
        raise ValueError(f"--split {text!r}: expected comma-separated numbers, e.g. 98,2,0") from None
    if not 2 <= len(parts) <= 3 or any(not math.isfinite(p) or p < 0 for p in parts) or parts[0] <= 0:
        raise ValueError(f"--split {text!r}: expected 2 or 3 proportions >= 0 with a positive training share")
    return (parts + [0.0])[:3] if len(parts) == 2 else tuple(parts)


def check_validation_args(args: argparse.Namespace) -> None:
    cfg = validation_config(args)
    if cfg.eval_interval is not None and cfg.eval_interval <= 0:
        raise ValueError(f"--eval-interval must be positive, got {cfg.eval_interval}")
    if cfg.eval_iters < 0:
        raise ValueError(f"--eval-iters must be >= 0, got {cfg.eval_iters}")
    for name, given in (("--valid-data-path", args.valid_data_path), ("--test-data-path", args.test_data_path)):
        if given and cfg.eval_iters == 0:
            raise ValueError(f"{name} needs --eval-iters > 0 to be used")


class DatasetRange:
    """Samples [lo, hi) of a dataset, as a dataset."""

    def __init__(self, dataset: TaskDataset, lo: int, hi: int):
        self.dataset, self.lo, self.hi, self.task = dataset, lo, hi, dataset.task

    def __len__(self) -> int:
        return self.hi - self.lo

    def __getitem__(self, i: int):
        return self.get(i)

    def get(self, i: int, fields=None):
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.dataset.get(self.lo + i, fields)

    @property
    def label_ids(self):
        return getattr(self.dataset, "label_ids", None)


def split_datasets(workload: Workload, train: dict[str, TaskDataset], args: argparse.Namespace,
                   valid_paths: dict[str, list[str]], test_paths: dict[str, list[str]] | None = None
                   ) -> tuple[dict[str, TaskDataset], dict[str, TaskDataset], dict[str, TaskDataset]]:
    """(training datasets after --split, validation datasets, test datasets; the last two empty where the run
    evaluates none)."""
    from megatron_spindle.data.datasets import evaluation_dataset, open_task_dataset

    split = parse_split(args.split)
    enabled = validation_config(args).enabled
    test_paths = test_paths or {}
    # validation shards decode like the training shards (the entry point's tokenizers and processors)
    prep = next((d.preprocessing for d in train.values() if getattr(d, "preprocessing", None) is not None), None)
    out_train, valid, test = dict(train), {}, {}
    for t, ds in train.items():
        if split is not None:
            out_train[t], v, te = split_dataset(ds, split, args.split, t)
            if v is not None:
                valid[t] = evaluation_dataset(v)
            if te is not None:
                test[t] = evaluation_dataset(te)
        if t in test_paths:
            test[t] = evaluation_dataset(open_task_dataset(workload, t, test_paths[t], prep))
        if t in valid_paths:
            valid[t] = evaluation_dataset(open_task_dataset(workload, t, valid_paths[t], prep))
        elif enabled and t not in valid and isinstance(ds, MockTaskDataset):
            unseen = MockTaskDataset(workload, t, 2 * ds.size, ds.seed)  # samples size .. 2*size: never trained on
            valid[t] = DatasetRange(unseen, ds.size, 2 * ds.size)
    if test and validation_config(args).eval_iters > 0:
        missing = [t.name for t in workload.tasks if t.name not in test]
        if missing:
            raise ValueError(f"the test evaluation has no data for task(s) {missing}: give --test-data-path "
                             f"TASK=PATH or a test share with --split TRAIN,VALID,TEST")
    else:
        test = {}
    if not enabled:
        return out_train, {}, test
    missing = [t.name for t in workload.tasks if t.name not in valid]
    if missing:
        why = (f"--split {args.split} leaves {', '.join(f'{t} ({len(train[t])} samples)' for t in missing)} no "
               f"validation sample" if split is not None and split[1] > 0 else
               "it is given for other tasks only" if valid else "none is given")
        raise ValueError(f"validation has no data for task(s) {missing} ({why}): give --valid-data-path TASK=PATH, "
                         f"a validation share with --split TRAIN,VALID, or --eval-iters 0")
    return out_train, valid, test


def split_range(ds: TaskDataset, split: tuple[float, float, float], text: str, task: str):
    """(training, validation or None, test or None) ranges of one dataset by --split's proportions."""
    n, total = len(ds), sum(split)
    i1, i2 = round(n * split[0] / total), round(n * (split[0] + split[1]) / total)
    if i1 < 1:
        raise ValueError(f"--split {text}: task '{task}' has {n} training samples, none left to train on")
    return (DatasetRange(ds, 0, i1), DatasetRange(ds, i1, i2) if i2 > i1 else None,
            DatasetRange(ds, i2, n) if n > i2 else None)


def split_dataset(ds: TaskDataset, split: tuple[float, float, float], text: str, task: str):
    """(training, validation or None, test or None) of a task's dataset by --split: a blend splits part by part,
    and its shares stay blends of the same weights (a share some part has no samples for is left out)."""
    blend = getattr(ds, "blend", None)
    if blend is None:
        return split_range(ds, split, text, task)
    from megatron_spindle.data.datasets import ConcatTaskDataset

    shares = [split_range(part, split, text, task) for part in ds.parts]

    def blended(column: int):
        ranges = [share[column] for share in shares]
        return None if None in ranges else ConcatTaskDataset(ranges, blend.weights)

    return blended(0), blended(1), blended(2)


class ValidationBatches:
    """``batch_fn(workload, task, k, seed)`` -> validation batch k of the task (the engine's batch signature);
    ``needs``: of each task, what this rank reads (the engine's ``batch_needs``; data/datasets.py read_batch).
    With ``num_workers`` (--num-workers) threads decode a batch's samples in parallel, as in training."""

    def __init__(self, datasets: dict[str, TaskDataset], num_workers: int = 0):
        self.datasets = datasets
        self.pool = ThreadPoolExecutor(num_workers, thread_name_prefix="valid-data") if num_workers else None

    def batch_fn(self, workload: Workload, task: str, k: int, seed: int = 0, needs: dict | None = None):
        ds, b = self.datasets[task], workload.task(task).batch_size
        return read_batch(workload, task, ds, [(k * b + j) % len(ds) for j in range(b)], (needs or {}).get(task),
                          self.pool)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None


@dataclass(frozen=True)
class ValidationResult:
    iteration: int
    losses: dict[str, float]  # task -> mean over the passes
    weights: dict[str, float]
    lm_tasks: tuple[str, ...] = ()
    split: str = "validation"  # or "test"

    @property
    def total_loss(self) -> float:
        return sum(self.weights[t] * v for t, v in self.losses.items())

    def scalars(self, ppl: bool = False) -> dict[str, float]:
        """TensorBoard and W&B scalars; ``ppl`` (--log-validation-ppl-to-tensorboard): the LM tasks' perplexity."""
        out = {f"total loss {self.split}": self.total_loss}
        out.update({f"task loss {self.split}/{t}": v for t, v in self.losses.items()})
        if ppl:
            out.update({f"task ppl {self.split}/{t}": _ppl(v) for t, v in self.losses.items() if t in self.lm_tasks})
        return out

    def format(self) -> str:
        """Megatron's validation block: a dashed line, the losses, a dashed line."""
        where = "" if self.split == "validation" else f" on {self.split} set"
        parts = [f" validation loss at iteration {self.iteration}{where}", f"total loss value: {self.total_loss:.6E}"]
        for t, v in self.losses.items():
            parts.append(f"{t} loss value: {v:.6E}")
            if t in self.lm_tasks:
                parts.append(f"{t} loss PPL: {_ppl(v):.6E}")
        line = " | ".join(parts) + " |"
        return "\n".join(["-" * (len(line) + 1), line, "-" * (len(line) + 1)])


def run_validation(engine, batches: ValidationBatches, eval_iters: int, iteration: int,
                   weights: dict[str, float], split: str = "validation",
                   report: Callable[[str], None] | None = None) -> ValidationResult:
    """--eval-iters forward-only passes over ``split``'s batches; collective (every rank runs them). ``report``:
    a progress line about every tenth of the passes (Megatron-LM's "Evaluating iter k/N" of a verbose
    evaluation)."""
    sums: dict[str, float] = {}
    every = max(1, eval_iters // 10)
    for k in range(eval_iters):
        for t, v in engine.evaluate(k, functools.partial(batches.batch_fn, needs=engine.batch_needs)).items():
            sums[t] = sums.get(t, 0.0) + v
        if report is not None and ((k + 1) % every == 0 or k + 1 == eval_iters):
            report(f"evaluating the {split} set: pass {k + 1}/{eval_iters}")
    lm = tuple(t.name for t in engine.workload.tasks if t.loss is not None and t.loss.kind == "lm")
    return ValidationResult(iteration, {t: v / eval_iters for t, v in sums.items()}, dict(weights), lm, split)


def _ppl(loss: float) -> float:
    return math.exp(min(20.0, loss))  # Megatron's cap
