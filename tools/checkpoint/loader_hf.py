"""Loader plugin ``hf``: Hugging Face folders -> megatron-spindle parameter units, one unit at a time.

``--mapping vision=/ckpt/clip,text=/ckpt/clip,audio=/ckpt/whisper,llm=/ckpt/llama`` says which folder feeds which
workload module (a CLIP folder feeds a ``patch`` module with its vision tower and a ``text`` module with its text
tower). Units of modules not in the mapping (projectors, unmapped towers) are not produced; the spindle saver
fills them with the training run's deterministic initialisation. See hf_mapping.py for the architectures.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from tools.checkpoint.common import Metadata, Note, UnitMessage, check_mapped_modules, parse_mapping
from tools.checkpoint.hf_io import HFFolder
from tools.checkpoint.hf_mapping import (
    check_module_fits,
    find_tower,
    import_unit,
    numerics_notes,
    pooled_only,
    unused_keys,
)
from tools.checkpoint.layout import split_unit, unit_shapes, workload_units


def add_arguments(parser) -> None:
    """No options of its own: --mapping and --init-seed are converter-wide."""


def _fill(unit: str, workload, meta: bool, seed: int):
    from megatron_spindle.models.config import ModelConfig
    from megatron_spindle.models.state import init_full_tensor

    shapes = unit_shapes(workload, unit)

    def fill(rel: str, shape) -> torch.Tensor:
        name = f"{unit}.{rel}"
        shape = tuple(shapes.get(name, shape))
        if meta:
            return torch.empty(shape, device="meta")
        return init_full_tensor(name, shape, ModelConfig().init_std, seed)

    return fill


def load_checkpoint(args, workload, meta: bool = False) -> Iterator[Metadata | UnitMessage | Note]:
    mapping = parse_mapping(args.mapping)
    if not mapping:
        raise ValueError("--loader hf needs --mapping MODULE=HF_FOLDER[,...]")
    check_mapped_modules(mapping, workload)
    folders = {path: HFFolder(path, meta=meta) for path in sorted(set(mapping.values()))}
    towers = {}
    for module, path in mapping.items():
        spec = workload.modules[module]
        towers[module] = find_tower(folders[path], spec.kind, spec.frontend.type if spec.frontend else None)
        check_module_fits(towers[module], spec, path)
    yield Metadata(source="hf:" + ",".join(f"{m}={p}" for m, p in mapping.items()),
                   info={m: t.family for m, t in towers.items()})
    for module, tower in towers.items():
        for text in numerics_notes(tower, workload.modules[module]):
            yield Note(f"{module} ({tower.family}): {text}")
    used: dict[str, set[str]] = {m: set() for m in mapping}
    for unit in workload_units(workload):
        _, module, part = split_unit(unit)
        if module not in mapping:
            continue
        tensors, names, notes = import_unit(folders[mapping[module]], towers[module], workload.modules[module], part,
                                            _fill(unit, workload, meta, args.init_seed))
        used[module] |= names
        yield from notes
        if tensors:
            yield UnitMessage(unit, {f"{unit}.{k}": v for k, v in tensors.items()}, origin=mapping[module])
    for module, tower in towers.items():
        folder = folders[mapping[module]]
        taken = set().union(*(used[m] for m in mapping if mapping[m] == mapping[module]))
        dropped = unused_keys(folder, tower, taken)
        pooled = [k for k in dropped if pooled_only(tower, k)]
        if pooled:
            yield Note(f"{module}: {pooled} act only on the {tower.family} model's pooled output, which the "
                       f"workload does not compute for this module (no contrastive head): not used", inexact=False)
        for key in dropped:
            if key not in pooled:
                t = folder.get(key)
                yield Note(f"{module}: HF tensor with no counterpart in our model (dropped)", tensor=key,
                           max_error=None if meta else float(t.abs().max()) if t.numel() else 0.0)
