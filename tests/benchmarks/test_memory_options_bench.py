"""benchmarks/memory_options.py: the table says which plan selection kept for Spindle and its segments' tasks."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import memory_options as bench  # noqa: E402


def _entry(ms: float, selected: str, segments: list) -> dict:
    return {"iteration_time": ms / 1e3, "peak_memory_gib": 70.0, "memory_options": "zero2", "selected": selected,
            "segments": segments}


def test_the_table_names_spindles_plans_and_their_segments():
    rows = {"spindle": {"without": _entry(5482, "spindle-seq", [["a"], ["b"]]),
                        "with": _entry(5158, "task-segments-2-unlimited+zero2", [["a", "b"], ["c"]])},
            "deepspeed": {"without": _entry(5482, "deepspeed", []), "with": _entry(5482, "deepspeed", [])}}
    text = bench.table(rows, 80.0)
    assert "spindle's plans: without spindle-seq (2 segments: a | b); with task-segments-2-unlimited+zero2 " \
           "(2 segments: a+b | c)" in text
    assert text.splitlines()[1].split()[:3] == ["spindle", "5482", "5158"]
