"""Built-in workloads, addressable by name wherever a workload YAML path is accepted: the YAML files shipped in
the package (graph/workloads/: the tiny CPU workloads and the paper's, see examples/workloads/README.md)."""

from __future__ import annotations

from pathlib import Path

_WORKLOADS = Path(__file__).parent / "workloads"


def builtin_workloads() -> dict[str, Path]:
    """name (the file's stem) -> YAML path."""
    return {p.stem: p for p in sorted(_WORKLOADS.glob("*.yaml"))}


def builtin_workload_path(name: str) -> Path | None:
    return builtin_workloads().get(name)
