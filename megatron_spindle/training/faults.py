"""What keeps a training run from losing the user's work, put together for the trainer (training/trainer.py).

``FaultGuards(args, info)`` is a ``with`` block around a run, entered right after the process group forms:

- the exclusive lock on ``--save`` (checkpointing/lock.py), taken by rank 0; a second job on the same folder
  stops on every rank with one line naming the holder, before it reads or writes anything;
- the watchdog (training/watchdog.py) on every rank of a multi-rank world;
- the exit conditions (training/signals.py: ``--exit-signal-handler``, ``--exit-interval``,
  ``--exit-duration-in-mins``), checked by ``exit_reason(iteration)`` after every iteration;
- ``resolve_load()``: what ``--load`` points at (checkpointing/load_target.py), the same on every rank.

On the way out it stops the watchdog, restores the signal handlers and releases the lock; an exception that a
missing rank explains ends the process there with the watchdog's line.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from megatron_spindle.errors import USER_ERRORS, on_every_rank
from megatron_spindle.flags import add_flags, config_from_args
from megatron_spindle.runtime.distributed import DistributedConfig, wait_for_rank0
from megatron_spindle.training.signals import ExitConfig, ExitMonitor

if TYPE_CHECKING:
    from megatron_spindle.checkpointing.load_target import LoadTarget
    from megatron_spindle.runtime.distributed import DistContext


def add_fault_tolerance_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("fault tolerance")
    add_flags(g, ExitConfig)  # --exit-signal-handler, --exit-interval, --exit-duration-in-mins
    add_flags(g, DistributedConfig)  # --distributed-timeout-minutes
    return parser


def exit_config_from_args(args: argparse.Namespace) -> ExitConfig:
    return config_from_args(ExitConfig, args)


def distributed_config_from_args(args: argparse.Namespace) -> DistributedConfig:
    return config_from_args(DistributedConfig, args)


def rank0_outcome(fn, rank: int, world_size: int, wait_key: str | None = None) -> Any:
    """Run ``fn`` on rank 0 and give every rank its result, or raise its user error on every rank.
    ``wait_key``: ``fn`` may take longer than the collectives' timeout (planning); the other ranks wait for it
    outside the collective (runtime/distributed.py ``wait_for_rank0``, unique key)."""
    box: list[Any] = [None]
    if rank == 0:
        try:
            box = [("ok", fn())]
        except USER_ERRORS as e:
            box = [("error", e)]
    if world_size > 1:
        if wait_key is not None:
            wait_for_rank0(rank, wait_key)
        dist.broadcast_object_list(box, src=0)
    status, payload = box[0]
    if status == "error":
        raise on_every_rank(payload)
    return payload


class FaultGuards:
    def __init__(self, args: argparse.Namespace, info: DistContext, prog: str = "pretrain_multitask.py"):
        self.args, self.info, self.prog = args, info, prog
        self.lock = None
        self.watchdog = None
        self.exits = ExitMonitor(exit_config_from_args(args), info.world_size)

    def __enter__(self) -> FaultGuards:
        from megatron_spindle.runtime import progress
        from megatron_spindle.training.watchdog import Watchdog

        progress.point("starting the run (the --save lock, the watchdog)")
        try:
            if self.info.world_size > 1:
                self.watchdog = Watchdog.for_world(self.info.rank, self.info.world_size,
                                                   distributed_config_from_args(self.args).timeout_minutes * 60,
                                                   self.prog, report_sigterm=not self.exits.config.exit_signal_handler)
                if self.watchdog is not None:
                    self.watchdog.start()
            if self.args.save:
                rank0_outcome(self._take_lock, self.info.rank, self.info.world_size)
            self.exits.__enter__()
        except BaseException:
            self._close()
            raise
        return self

    def _take_lock(self) -> None:
        from megatron_spindle.checkpointing.lock import SaveFolderLock

        lock = SaveFolderLock(self.args.save)
        lock.acquire()
        self.lock = lock

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and self.watchdog is not None and not isinstance(exc, USER_ERRORS) \
                and isinstance(exc, Exception):
            self.watchdog.fail(exc)  # ends the process when a missing rank explains the error
        self._close()

    def _close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        self.exits.__exit__(None, None, None)
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # ------------------------------------------------------------------------------------------ queries
    def resolve_load(self) -> LoadTarget | None:
        """What --load points at (None without --load); the same on every rank, or the same error. While it
        holds no checkpoint, --pretrained-checkpoint's, fine-tuned from (``args.finetune`` set, as Megatron-LM
        sets it)."""
        from megatron_spindle.checkpointing.load_target import resolve_load

        pretrained = self.args.pretrained_checkpoint
        target = None
        if self.args.load:
            target = rank0_outcome(lambda: resolve_load(self.args.load, self.args.save,
                                                        exit_on_missing=self.args.exit_on_missing_checkpoint,
                                                        missing_ok=pretrained is not None),
                                   self.info.rank, self.info.world_size)
        if pretrained is None or (target is not None and target.folder is not None):
            return target
        found = rank0_outcome(lambda: resolve_load(pretrained, flag="--pretrained-checkpoint"), self.info.rank,
                              self.info.world_size)
        self.args.finetune = True
        where = f"--load {self.args.load} holds no checkpoint yet" if self.args.load else "no --load"
        return dataclasses.replace(found, notice=f"{where}: fine-tuning from --pretrained-checkpoint {pretrained}")

    def check_save_target(self, start: int, target: LoadTarget | None) -> None:
        """Refuse (on every rank) a run that would overwrite later checkpoints in --save."""
        if not self.args.save:
            return
        from megatron_spindle.checkpointing.load_target import check_save_target, same_folder

        from_save = target is not None and target.root is not None and same_folder(target.root, self.args.save)
        rank0_outcome(lambda: check_save_target(self.args.save, start, from_save), self.info.rank,
                      self.info.world_size)

    def exit_reason(self, iteration: int) -> str | None:
        return self.exits.check(iteration)
