"""Built-in workloads, addressable by name wherever a workload YAML path is accepted."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).parent / "workloads"
_EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "workloads"


def builtin_workloads() -> dict[str, Path]:
    """name -> YAML path: the tiny CPU workloads shipped in the package, and the paper's workloads in
    examples/workloads/ when running from a source checkout."""
    found = {}
    for folder in (_EXAMPLES, _HERE):
        if folder.is_dir():
            for p in sorted(folder.glob("*.yaml")):
                found[p.stem] = p
    return found


def builtin_workload_path(name: str) -> Path | None:
    return builtin_workloads().get(name)
