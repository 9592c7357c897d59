"""Two profiles of one workload on one GPU type, MetaOp by MetaOp: the compute seconds each measured per operator
at every config both have, and their ratio. benchmarks/gpu_breakdown.sh takes one profile on a cold GPU (first
thing) and one after the training runs: on the fortieth session's H100 two such profiles disagreed 2.8x on the
ViT-H layer, which the profiler's device warm-up (profiler/world.py ``warm_device``) is to remove.

    python benchmarks/profile_compare.py FIRST.json SECOND.json [--out FILE]

Prints (and with --out writes) the table and a last line with the largest disagreement; exit 1 with one line when
the files cannot be compared (not profiles, or of other workloads or GPUs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_spindle.fileio import write_text_atomic


class CompareError(Exception):
    pass


def _measurements(path: Path) -> tuple[dict, dict[tuple[str, int, int], float]]:
    try:
        doc = json.loads(path.read_text())
        return doc, {(m["metaop"], m["tp"], m["dp"]): float(m["compute_seconds"]) for m in doc["measurements"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CompareError(f"{path}: not a readable profile ({type(e).__name__}: {e})") from None


def _disagreement(x: float, y: float) -> float:
    """The larger of y / x and x / y (inf where one is 0)."""
    return max(x / y, y / x) if min(x, y) > 0 else float("inf")


def compare(first: Path, second: Path) -> tuple[list[tuple[str, int, int, float, float]], str]:
    """(MetaOp, tp, dp, first seconds, second seconds) of the configs both measured, and the table as text."""
    a_doc, a = _measurements(first)
    b_doc, b = _measurements(second)
    for key in ("workload", "gpu"):
        if a_doc.get(key) != b_doc.get(key):
            raise CompareError(f"the profiles are of other {key}s: {a_doc.get(key)!r} and {b_doc.get(key)!r}")
    rows = [(m, tp, dp, a[m, tp, dp], b[m, tp, dp]) for (m, tp, dp) in a if (m, tp, dp) in b]
    if not rows:
        raise CompareError("the profiles have no measured config in common")
    width = max(len(m) for m, *_ in rows) + 2
    lines = [f"{'MetaOp':<{width}}{'tp':>3}{'dp':>4}{'first ms':>11}{'second ms':>11}{'second/first':>14}"]
    for m, tp, dp, x, y in rows:
        ratio = y / x if x > 0 else float("inf")
        lines.append(f"{m:<{width}}{tp:>3}{dp:>4}{x * 1e3:>11.3f}{y * 1e3:>11.3f}{ratio:>14.2f}")
    worst = max(rows, key=lambda r: _disagreement(r[3], r[4]))
    spread = _disagreement(worst[3], worst[4])
    lines.append(f"largest disagreement: {spread:.2f}x ({worst[0]}, tp {worst[1]} dp {worst[2]}) over {len(rows)} "
                 f"configs")
    return rows, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    try:
        _, text = compare(args.first, args.second)
    except CompareError as e:
        print(f"profile_compare: {e}", file=sys.stderr)
        return 1
    print(text)
    if args.out is not None:
        write_text_atomic(args.out, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
