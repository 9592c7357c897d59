#!/usr/bin/env python
"""Print what a checkpoint holds: its modules (parameter units), tensor shapes and dtypes, iteration and the plan
it was saved under.

    python tools/checkpoint/inspect_checkpoint.py /runs/ckpt                 # megatron-spindle (root or iter_XXXXXXX)
    python tools/checkpoint/inspect_checkpoint.py /ckpt/llama                # Hugging Face folder (safetensors)
    python tools/checkpoint/inspect_checkpoint.py /megatron/ckpt             # megatron-core torch_dist
    python tools/checkpoint/inspect_checkpoint.py /runs/ckpt --units 'llm.*' --summary

Reads metadata and file headers only (no tensor data). Exit status 2 when the folder is not a checkpoint.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
if sys.path and os.path.abspath(sys.path[0] or os.curdir) == _HERE:
    sys.path[0] = _ROOT  # run as a script: import this folder as the package tools.checkpoint
elif _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import fnmatch  # noqa: E402
import json  # noqa: E402
from math import prod  # noqa: E402
from pathlib import Path  # noqa: E402

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4, "int8": 1, "uint8": 1,
          "bool": 1}


def _size(shape, dtype: str) -> int:
    return prod(shape) * _BYTES.get(dtype, 4)


def _print_tensors(group: str, tensors: dict[str, tuple[tuple[int, ...], str]], summary: bool, out) -> None:
    total = sum(_size(s, d) for s, d in tensors.values())
    print(f"  {group}  ({len(tensors)} tensors, {total / 2 ** 20:.2f} MB)", file=out)
    if summary:
        return
    width = max((len(n) for n in tensors), default=0)
    for name, (shape, dtype) in tensors.items():
        print(f"    {name:<{width}}  {str(tuple(shape)):<16} {dtype}", file=out)


def _plan_line(plan: dict | None) -> str:
    if not plan:
        return "plan: none (not saved under a plan, e.g. a converted checkpoint)"
    waves = plan.get("waves", [])
    slices = sum(len(w.get("slices", [])) for w in waves) if isinstance(waves, list) else "?"
    cluster = plan.get("cluster") or {}
    try:  # the plan JSON's own fields (plan/io.py): the cluster's nodes x GPUs per node, the schema version
        devices = int(cluster["num_nodes"]) * int(cluster["gpus_per_node"])
    except (KeyError, TypeError, ValueError):
        devices = "?"
    gpu = (cluster.get("gpu") or {}).get("name", "?") if isinstance(cluster, dict) else "?"
    return (f"plan: workload '{plan.get('workload_name', '?')}', {devices} devices ({gpu}), {len(waves)} waves, "
            f"{slices} slices, schema version {plan.get('schema_version', '?')}")


def _data_lines(position: dict) -> list[str]:
    """Where each task's data stands (data/sampler.py's position): its epoch and offset, a blend's per part."""
    def place(st: dict) -> str:
        size = f" of {st['size']}" if "size" in st else ""
        return f"epoch {st.get('epoch', 0)}, sample {st.get('offset', 0)}{size}"

    lines = []
    for task, st in sorted((position.get("tasks") or {}).items()):
        if "parts" in st:
            parts = "; ".join(f"part {k} ({p['weight']:.3g}): {place(p)}" for k, p in enumerate(st["parts"]))
            lines.append(f"  {task}: blend, {parts}")
        else:
            lines.append(f"  {task}: {place(st)}")
    return ["data position:"] + lines if lines else []


def inspect_spindle(path: Path, patterns: list[str], summary: bool, out) -> None:
    from tools.checkpoint.loader_spindle import resolve

    ckpt, md = resolve(path, None)
    plan = json.loads((ckpt / "plan.json").read_text()) if (ckpt / "plan.json").exists() else None
    print(f"megatron-spindle checkpoint: {ckpt}", file=out)
    print(f"iteration: {md['iteration']}", file=out)
    print(f"workload: {md.get('workload_name') or '?'} (digest {md.get('workload_digest') or '?'}), saved by "
          f"{md.get('world_size', '?')} rank(s)", file=out)
    print(_plan_line(plan), file=out)
    frozen = set((md.get("extra") or {}).get("frozen_units", []))  # marked on the units below
    extra = {k: v for k, v in (md.get("extra") or {}).items() if k not in ("args", "frozen_units")}
    for k, v in extra.items():
        print(f"{k}: {v}", file=out)
    for line in _data_lines(md.get("data_position") or {}):
        print(line, file=out)
    units = {u: m for u, m in md["units"].items() if _wanted(u, patterns)}
    modules = sorted({u.split(".")[0] for u in units})
    print(f"modules: {', '.join(modules)}; {len(units)} parameter units", file=out)
    for unit in units:
        meta = units[unit]
        tensors = {k[len(unit) + 1:]: (tuple(t["shape"]), t["dtype"]) for k, t in meta["tensors"].items()}
        marks = ("  [+optimizer state]" if meta.get("optim") else "") + ("  [frozen]" if unit in frozen else "")
        _print_tensors(f"{unit}{marks}", tensors, summary, out)


def inspect_hf(path: Path, patterns: list[str], summary: bool, out) -> None:
    from tools.checkpoint.hf_io import HFFolder

    folder = HFFolder(path)
    cfg = folder.config
    print(f"Hugging Face folder: {path}", file=out)
    print(f"model_type: {cfg.get('model_type')}  architectures: {cfg.get('architectures')}", file=out)
    print("iteration: n/a; plan: none", file=out)
    groups: dict[str, dict] = {}
    for name in folder.keys():
        if not _wanted(name, patterns):
            continue
        parts = name.split(".")
        cut = next((i + 2 for i, p in enumerate(parts) if p == "layers" and i + 1 < len(parts)), 1)
        group = ".".join(parts[:cut]) if cut > 1 else "(top level)"
        groups.setdefault(group, {})[name] = (tuple(folder.get_shape(name)), str(folder.dtype(name)).replace("torch.", ""))
    for group, tensors in groups.items():
        _print_tensors(group, tensors, summary, out)


def inspect_mcore(path: Path, patterns: list[str], summary: bool, out) -> None:
    from tools.checkpoint.loader_mcore import TorchDistReader, resolve_dir

    folder, iteration = resolve_dir(path)
    reader = TorchDistReader(folder)
    print(f"megatron-core torch_dist checkpoint: {folder}", file=out)
    print(f"iteration: {iteration}; plan: none (megatron-core layout is not recorded in the tensors)", file=out)
    tensors = {k: (reader.shape(k), str(reader.dtype(k)).replace("torch.", "")) for k in reader.tensors
               if _wanted(k, patterns)}
    model = {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
    _print_tensors("model", model, summary, out)
    optim = {k: v for k, v in tensors.items() if k.startswith("optimizer.")}
    if optim:
        _print_tensors("optimizer", optim, True, out)


def _wanted(name: str, patterns: list[str]) -> bool:
    return not patterns or any(fnmatch.fnmatch(name, p) for p in patterns)


def detect(path: Path) -> str:
    if (path / "config.json").exists():
        return "hf"
    if (path / ".metadata").exists():
        return "mcore"
    latest = path / "latest_checkpointed_iteration.txt"
    if (path / "metadata.json").exists():
        return "spindle"
    if latest.exists():
        text = latest.read_text().strip()
        sub = path / ("release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else text)
        return "mcore" if (sub / ".metadata").exists() else "spindle"
    raise ValueError(f"{path}: not a megatron-spindle, megatron-core or Hugging Face checkpoint")


def main(argv: list[str] | None = None, out=None) -> int:
    parser = argparse.ArgumentParser(description="Print a checkpoint's modules, shapes, dtypes, iteration and plan.")
    parser.add_argument("path", help="Checkpoint folder.")
    parser.add_argument("--format", choices=["auto", "spindle", "hf", "mcore"], default="auto")
    parser.add_argument("--units", action="append", default=[], help="Only units / tensors matching this glob.")
    parser.add_argument("--summary", action="store_true", help="One line per unit, no tensor list.")
    parser.add_argument("--verify", action="store_true", help="Re-read every file of a megatron-spindle checkpoint "
                        "and check it against the checksums recorded at save (exit status 2 on any mismatch).")
    args = parser.parse_args(argv)
    out = out or sys.stdout
    path = Path(args.path)
    try:
        kind = detect(path) if args.format == "auto" else args.format
        if args.verify:
            from megatron_spindle.checkpointing.integrity import verify, verify_report

            if kind != "spindle":
                raise ValueError(f"{path}: --verify checks megatron-spindle checkpoints, this is a {kind} one")
            ok, line = verify_report(verify(path))
            print(line if ok else f"error: {line}", file=out if ok else sys.stderr)
            if not ok:
                return 2
        {"spindle": inspect_spindle, "hf": inspect_hf, "mcore": inspect_mcore}[kind](path, args.units,
                                                                                     args.summary, out)
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
