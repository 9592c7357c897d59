"""Loader plugin ``spindle``: a megatron-spindle checkpoint -> parameter units, one unit at a time.

Checkpoints are layout-independent (full tensors per unit), so a checkpoint saved under one plan is converted or
loaded under any other without resharding. Transformer Engine tensor names are translated to local-spec names.
``--load-iteration`` picks an iteration other than the one ``latest_checkpointed_iteration.txt`` names.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_spindle.checkpointing.names import from_te_names
from tools.checkpoint.common import ConversionError, Metadata, UnitMessage
from tools.checkpoint.layout import workload_units

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser) -> None:
    group = parser.add_argument_group(title="megatron-spindle loader")
    group.add_argument("--load-iteration", type=int, default=None,
                       help="Iteration to read (default: the latest).")


def resolve(load_dir: str | Path, iteration: int | None) -> tuple[Path, dict]:
    """(iteration folder, metadata) of a checkpoint root or of an ``iter_XXXXXXX`` folder."""
    from megatron_spindle.checkpointing import iteration_dir, read_latest, read_metadata

    load_dir = Path(load_dir)
    if (load_dir / "metadata.json").exists() and iteration is None:
        return load_dir, read_metadata(load_dir)
    it = iteration if iteration is not None else read_latest(load_dir)
    if it is None:
        raise ConversionError(f"{load_dir} holds no megatron-spindle checkpoint (no latest_checkpointed_iteration.txt)")
    ckpt = iteration_dir(load_dir, it)
    return ckpt, read_metadata(ckpt)


def load_checkpoint(args, workload, meta: bool = False) -> Iterator[Metadata | UnitMessage]:
    from megatron_spindle.checkpointing import load_checkpoint as read_checkpoint

    ckpt, md = resolve(args.load_dir, args.load_iteration)
    plan = json.loads((ckpt / "plan.json").read_text()) if (ckpt / "plan.json").exists() else None
    yield Metadata(source=f"spindle:{ckpt}", iteration=int(md["iteration"]), plan=plan,
                   info={"workload_name": md.get("workload_name"), "workload_digest": md.get("workload_digest")})
    manifest = md["units"]
    order = [u for u in workload_units(workload) if u in manifest] + sorted(set(manifest) - set(workload_units(workload)))
    for unit in order:
        if meta:
            tensors = {k: torch.empty(v["shape"], dtype=_DTYPES.get(v["dtype"], torch.float32), device="meta")
                       for k, v in manifest[unit]["tensors"].items()}
        else:
            loaded = read_checkpoint(ckpt.parent, units=[unit], iteration=int(md["iteration"]))
            tensors = dict(loaded.units[unit].model)
        yield UnitMessage(unit, from_te_names(tensors), origin=str(ckpt))
