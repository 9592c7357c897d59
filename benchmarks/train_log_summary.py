"""One line about a pretrain_multitask.py run, read from its training log: the measured iteration time (median of
the logged intervals after the first, which holds the warm-up) against the plan's predicted one, and the total
loss from the first logged iteration to the last (and, with --log-throughput, the achieved TFLOP/s per GPU); on
CUDA also the peak memory allocated (Megatron-LM's report after the first interval, the largest over the ranks)
against the plan's largest per-device prediction. benchmarks/gpu_validate.sh runs it on its training runs.

    python benchmarks/train_log_summary.py LOG [--name NAME] [--json FILE]

``--json FILE`` adds the run under NAME to FILE (a JSON object of runs; written atomically).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_spindle.fileio import write_text_atomic
from megatron_spindle.planner.report import parse_memory_per_device
from megatron_spindle.training.log import parse_log_line, steady_iteration_ms
from megatron_spindle.training.memory import parse_report_line


def summarize(lines) -> dict | None:
    """The run's times and losses (None when no training log line is among ``lines``)."""
    lines = list(lines)
    records = [r for r in map(parse_log_line, lines) if r is not None]
    if not records:
        return None
    measured, predicted = steady_iteration_ms(records), records[-1].predicted_ms
    peaks = [r[1] for r in map(parse_report_line, lines) if r is not None]
    planned = next((b for b in map(parse_memory_per_device, lines) if b is not None), None)
    return {"iterations": records[-1].iteration, "logged": len(records), "measured_ms": measured,
            "predicted_ms": predicted, "measured_over_predicted": measured / predicted if predicted else None,
            "tflops_per_gpu": records[-1].tflops_per_gpu,
            "first_loss": records[0].total, "last_loss": records[-1].total,
            "first_iteration": records[0].iteration,
            "max_allocated_gb": max(peaks) / 1e9 if peaks else None,
            "predicted_memory_gb": planned / 1e9 if planned is not None else None}


def summary_line(name: str, s: dict) -> str:
    ratio = f"{s['measured_over_predicted']:.2f}" if s["measured_over_predicted"] else "n/a"
    return (f"{name}: measured {s['measured_ms']:.1f} ms per iteration (median of {max(s['logged'] - 1, 1)} logged "
            f"interval(s) after the first), predicted {s['predicted_ms']:.1f} ms, measured / predicted {ratio}"
            + (f", {s['tflops_per_gpu']:.1f} TFLOP/s per GPU (model FLOPs)" if s.get("tflops_per_gpu") else "")
            + "; "
            f"total loss {s['first_loss']:.4f} (iteration {s['first_iteration']}) -> {s['last_loss']:.4f} "
            f"(iteration {s['iterations']})"
            + (f"; peak memory {s['max_allocated_gb']:.2f} GB allocated"
               + (f" against {s['predicted_memory_gb']:.2f} GB predicted "
                  f"({s['max_allocated_gb'] / s['predicted_memory_gb']:.2f})" if s.get("predicted_memory_gb") else "")
               if s.get("max_allocated_gb") is not None else ""))


def add_to_json(path: Path, name: str, s: dict) -> None:
    runs = json.loads(path.read_text()) if path.exists() else {}
    runs[name] = s
    write_text_atomic(path, json.dumps(runs, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--name", default=None, help="the run's name (default: the log's file name)")
    parser.add_argument("--json", type=Path, default=None, help="add the run to this JSON file")
    args = parser.parse_args(argv)
    if not args.log.is_file():
        parser.error(f"{args.log}: no such file")
    name = args.name or args.log.stem
    s = summarize(args.log.read_text(errors="replace").splitlines())
    if s is None:
        print(f"{name}: no training log line in {args.log}", file=sys.stderr)
        return 1
    print(summary_line(name, s))
    if args.json is not None:
        add_to_json(args.json, name, s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
