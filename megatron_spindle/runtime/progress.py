"""Where this rank is: the last point it reached in a step, for the training watchdog (training/watchdog.py).

The wave schedule, the gradient sync and the engine call ``point(...)`` before each thing that may block on
another rank (a transfer, a slice with TP/DP collectives, the loss all-reduce, the gradient all-reduces, the
optimizer's all-gathers); the trainer calls ``set_iteration`` and ``point("saving checkpoint")`` etc. A point is
one tuple swapped in under the GIL (no lock, no formatting: ~0.3 us), so it costs nothing next to an operator;
``describe`` turns it into words only when the watchdog needs them ("iteration 4, forward wave 2: transfer 3
(vision.l0 -> vision.l2) with rank 1").
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

WAVE_PHASES = ("forward", "backward", "validation forward")  # point(phase, wave_index, obj) from the schedule


class Point(NamedTuple):
    seq: int  # increases with every point: the rank made progress when it changed
    iteration: int | None
    what: tuple[Any, ...]  # (phase, wave, obj) from the runtime, or (text,) from the trainer
    since: float  # time.monotonic() when the point was reached
    # a rank whose work this point waits for however long it takes (rank 0 planning): no timeout applies while
    # that rank lives; None: a collective's wait, bounded by --distributed-timeout-minutes
    awaits: int | None = None


_current = Point(0, None, ("starting",), time.monotonic())


def point(*what: Any, awaits: int | None = None) -> None:
    """This rank reached ``what``: ``point("forward", wave, transfer_op)``, ``point("loss all-reduce")``;
    ``point("planning (rank 0)", awaits=0)``: a wait for rank 0's own work, with no timeout."""
    global _current
    c = _current
    _current = Point(c.seq + 1, c.iteration, what, time.monotonic(), awaits)


def set_iteration(iteration: int | None) -> None:
    """The iteration being computed (1-based, as in the log lines)."""
    global _current
    c = _current
    _current = Point(c.seq + 1, iteration, c.what, time.monotonic(), c.awaits)


def current() -> Point:
    return _current


def _peers(obj: Any, rank: int) -> list[int]:
    peers: set[int] = set()
    for direction in ("fwd", "bwd"):
        for m in getattr(obj, direction, []) or []:
            if rank in (m.src, m.dst):
                peers.add(m.dst if m.src == rank else m.src)
    peers.discard(rank)
    return sorted(peers)


def _describe_obj(obj: Any, rank: int, phase: str) -> str:
    if hasattr(obj, "producer") and hasattr(obj, "consumer"):  # a TransferOp
        peers = _peers(obj, rank)
        direction = "from" if phase.endswith("forward") == (rank in obj.consumer.devices) else "to"
        with_ = f" {direction} rank(s) {', '.join(map(str, peers))}" if peers else ""
        return f"transfer {obj.index} ({obj.producer.id} -> {obj.consumer.id}){with_}"
    s = getattr(obj, "slice", None)
    if s is not None and hasattr(s, "devices"):  # a LocalSlice
        group = f" with its TP/DP group, ranks {list(s.devices)}" if len(s.devices) > 1 else ""
        return f"slice {s.id}{group}"
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(g, (list, tuple)) for g in obj):
        groups = "; ".join(f"ranks {list(g)}" for g in obj[:4]) + (" ..." if len(obj) > 4 else "")
        return f"groups {groups}"
    return str(obj)


def describe(p: Point, rank: int) -> str:
    """``p`` in words, e.g. "iteration 4, forward wave 2: transfer 3 (a -> b) from rank(s) 1"."""
    what = p.what
    head = f"iteration {p.iteration}, " if p.iteration is not None else ""
    if len(what) >= 3 and what[0] in WAVE_PHASES and isinstance(what[1], int):
        return f"{head}{what[0]} wave {what[1]}: {_describe_obj(what[2], rank, what[0])}"
    text = " ".join(_describe_obj(w, rank, "") for w in what if w is not None)
    return f"{head}{text}"
