"""Megatron-LM's manual garbage collection (``--manual-gc``, ``--manual-gc-interval``, ``--no-manual-gc-eval``).

Python's threshold-based collector runs a full (generation-2) collection whenever enough objects have piled up;
with megatron-core and torch loaded that walks millions of objects and stops the rank for a long moment
(measured on CPU with tiny-clip: about 165 ms once every 20 steps or so, on a 40 ms step). Each rank decides
alone, so in a multi-rank step the others wait at the next transfer or collective: a straggler the cost model
does not know. With ``--manual-gc`` the automatic collector is off for the whole run and every rank collects at
the same points: at the start, every ``--manual-gc-interval`` iterations (0: never between steps) and, unless
``--no-manual-gc-eval``, before and after each validation run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass


def add_manual_gc_args(group) -> None:
    group.add_argument("--manual-gc", action="store_true",
                       help="Turn Python's automatic garbage collector off and collect on every rank at the same "
                            "points (start, --manual-gc-interval, around validation), so no rank stalls alone "
                            "in the middle of a step.")
    group.add_argument("--manual-gc-interval", type=int, default=0,
                       help="With --manual-gc: collect every this many iterations (0: not between iterations).")
    group.add_argument("--no-manual-gc-eval", dest="manual_gc_eval", action="store_false",
                       help="With --manual-gc: do not collect before and after each validation run.")


def check_manual_gc_args(args: argparse.Namespace) -> None:
    if args.manual_gc_interval < 0:
        raise ValueError(f"--manual-gc-interval must be >= 0, got {args.manual_gc_interval}")


@dataclass
class ManualGC:
    """The collection points of a run (all inactive unless ``enabled``)."""

    enabled: bool = False
    interval: int = 0
    around_eval: bool = True

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ManualGC:
        return cls(args.manual_gc, args.manual_gc_interval, args.manual_gc_eval)

    @contextlib.contextmanager
    def training(self) -> Iterator[ManualGC]:
        """The training loop's extent: automatic collection off inside (and one collection at the start), the
        collector's previous state restored after."""
        if not self.enabled:
            yield self
            return
        was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()
        try:
            yield self
        finally:
            if was_enabled:
                gc.enable()

    def after_iteration(self, iteration: int) -> None:
        """``iteration``: how many iterations have run."""
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def validation(self) -> Iterator[None]:
        if self.enabled and self.around_eval:
            gc.collect()
        try:
            yield
        finally:
            if self.enabled and self.around_eval:
                gc.collect()
