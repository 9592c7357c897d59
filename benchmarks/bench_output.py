"""Where benchmark results go, the same for every script in benchmarks/.

``--out-dir DIR`` (default ``benchmarks/out/``, ignored by git) receives ``<name>.txt`` (what the run printed)
and ``<name>.json`` (its numbers). ``benchmarks/results/`` holds the committed snapshot; refreshing it is a
deliberate step: ``--update-snapshot`` (the same as ``--out-dir benchmarks/results``, e.g. ``make
bench-snapshot``). Files are written at the end of a run, atomically, so a failed run leaves the old ones.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from megatron_spindle.fileio import write_text_atomic

BENCHMARKS = Path(__file__).resolve().parent
DEFAULT_OUT_DIR = BENCHMARKS / "out"
SNAPSHOT_DIR = BENCHMARKS / "results"


def cell(text: str) -> tuple[str, int]:
    """argparse type of a benchmark cell: WORKLOAD:GPUS -> (workload, GPUs)."""
    name, _, gpus = text.partition(":")
    if not name or not gpus.isdigit() or int(gpus) < 1:
        raise argparse.ArgumentTypeError(f"takes WORKLOAD:GPUS, got '{text}'")
    return name, int(gpus)


@contextmanager
def announced(what: str):
    """A long step of a benchmark, on stderr: ``what`` before it, its seconds after (the table stays on stdout)."""
    t0 = time.perf_counter()
    print(f"  {what} ...", file=sys.stderr, flush=True)
    yield
    print(f"    ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)


def plan_cell(name: str, gpus: int, planner: str):
    """The plan of a cell as tools/plan.py makes it (autoplan with ``planner`` configured, on ``gpus`` A800s in
    nodes of 8), announced on stderr."""
    from megatron_spindle.autoplan import autoplan
    from megatron_spindle.graph.cluster import make_cluster
    from megatron_spindle.graph.workload import load_workload
    from megatron_spindle.planner.pipeline import PlannerConfig

    print(f"  planning {name} / {gpus} ({planner}) ...", file=sys.stderr, flush=True)
    return autoplan(load_workload(name), make_cluster(gpus), PlannerConfig(planner=planner)).plan


def add_output_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("output")
    where = g.add_mutually_exclusive_group()
    where.add_argument("--out-dir", default=str(DEFAULT_OUT_DIR),
                       help="Write the printed tables (<name>.txt) and the numbers (<name>.json) here.")
    where.add_argument("--update-snapshot", action="store_true",
                       help=f"Refresh the committed snapshot: write into {SNAPSHOT_DIR.relative_to(BENCHMARKS.parent)}/.")
    return parser


def output_dir(args: argparse.Namespace) -> Path:
    return SNAPSHOT_DIR if args.update_snapshot else Path(args.out_dir)


class _Tee(io.TextIOBase):
    def __init__(self, stream):
        self.stream, self.text = stream, io.StringIO()

    def write(self, s: str) -> int:
        self.text.write(s)
        return self.stream.write(s)

    def flush(self) -> None:
        self.stream.flush()


class Recording:
    """Copies what is printed to stdout from now on (stderr, the progress, is not kept); ``save`` writes it and
    the numbers to the output folder."""

    def __init__(self, args: argparse.Namespace, name: str):
        self.out_dir, self.name = output_dir(args), name
        self._tee = _Tee(sys.stdout)
        sys.stdout = self._tee

    def save(self, data: Any = None) -> list[Path]:
        sys.stdout = self._tee.stream
        written = [self.out_dir / f"{self.name}.txt"]
        write_text_atomic(written[0], self._tee.text.getvalue())
        if data is not None:
            written.append(self.out_dir / f"{self.name}.json")
            write_text_atomic(written[1], json.dumps(data, indent=1, default=float))
        print(f"wrote {', '.join(map(str, written))}")
        return written
