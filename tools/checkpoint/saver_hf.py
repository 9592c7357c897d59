"""Saver plugin ``hf``: parameter units -> Hugging Face folders (``from_pretrained``-loadable).

``--mapping MODULE=BASE_HF_FOLDER`` names, per workload module, the Hugging Face folder the module was converted
from (or one of the same architecture and size). The base supplies the config, tokenizer files and every tensor
our model does not hold (Whisper's decoder, the other CLIP tower; CLIP's pre-LayerNorm and Whisper's conv stem when
the workload does not declare ``pre_norm`` / ``stem: conv``); the saver writes our weights over it, in the base's
dtypes, one unit at a time. Modules sharing a base are written together
into ``<save-dir>/<module>[+<module>...]``; modules not in the mapping (projectors) are not exported.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from tools.checkpoint.common import (
    ConversionError,
    UnitMessage,
    check_mapped_modules,
    handle_notes,
    parse_mapping,
    staged_output,
)
from tools.checkpoint.hf_io import INDEX_FILE, SINGLE_FILE, HFFolder, ShardWriter
from tools.checkpoint.hf_mapping import IGNORED_SUFFIXES, check_module_fits, export_unit, find_tower
from tools.checkpoint.layout import from_te_names, split_unit


def add_arguments(parser) -> None:
    group = parser.add_argument_group(title="Hugging Face saver")
    group.add_argument("--max-shard-size-mb", type=int, default=2048, help="Largest safetensors shard written.")


class _Target:
    """One output folder: a base HF folder and the workload modules written into it."""

    def __init__(self, base: str, modules: list[str], folder: Path, max_shard_bytes: int):
        self.base = HFFolder(base)
        self.modules = modules
        self.folder = folder
        self.folder.mkdir(parents=True)
        self.writer = ShardWriter(folder, max_shard_bytes)
        self.config = dict(self.base.config)
        self.embed: torch.Tensor | None = None  # kept only while a tied lm_head may need it

    def base_shape(self, name: str):
        return tuple(self.base.get_shape(name)) if name in self.base else None

    def write(self, name: str, tensor: torch.Tensor, unit: str) -> None:
        shape = self.base_shape(name)
        if shape is None:
            raise ConversionError(f"unit '{unit}': tensor '{name}' is not in the base HF folder {self.base.path}")
        if tuple(tensor.shape) != shape:
            raise ConversionError(f"unit '{unit}': tensor '{name}' has shape {tuple(tensor.shape)} but the base HF "
                                  f"folder {self.base.path} has {shape}")
        self.writer.add(name, tensor.to(self.base.dtype(name)))

    def finish(self, log) -> None:
        copied = 0
        for name in self.base.keys():
            if name not in self.writer.weight_map and name not in self.writer.pending:
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                self.writer.add(name, self.base.get(name))
                copied += 1
        self.writer.close()
        for p in self.base.path.iterdir():  # config, tokenizer, generation config, ...
            if p.is_file() and p.name not in (SINGLE_FILE, INDEX_FILE, "config.json") and \
                    not p.name.endswith((".safetensors", ".bin")):
                shutil.copy2(p, self.folder / p.name)
        (self.folder / "config.json").write_text(json.dumps(self.config, indent=2) + "\n")
        log(f"wrote {self.folder.name}: {len(self.writer.weight_map)} tensors ({copied} kept from the base)")


def _write_unit(target: _Target, tower, spec, unit: str, part: str, tensors: dict, notes: list[str]) -> None:
    rel = {k[len(unit) + 1:]: v for k, v in from_te_names(tensors).items()}
    hf, unit_notes = export_unit(tower, spec, part, unit, rel, target.base_shape)
    notes.extend(unit_notes)
    embed_name = tower.prefix + "embed_tokens.weight"
    tied = bool(target.config.get("tie_word_embeddings")) and "lm_head.weight" not in target.base
    for name, t in hf.items():
        if name == embed_name and tied:
            target.embed = t.detach().clone()
        if name == "lm_head.weight" and tied:
            if target.embed is not None and torch.equal(target.embed, t):
                continue  # still tied: HF re-ties lm_head to the embedding
            target.config["tie_word_embeddings"] = False  # trained apart: write an untied lm_head
            if target.embed is None:
                raise ConversionError(f"unit '{unit}': cannot check the tied lm_head before the embedding")
            target.writer.add(name, t.to(target.base.dtype(embed_name)))
            continue
        target.write(name, t, unit)


def save_checkpoint(messages: Iterator, args, workload) -> Path:
    mapping = parse_mapping(args.mapping)
    if not mapping:
        raise ConversionError("--saver hf needs --mapping MODULE=BASE_HF_FOLDER[,...]")
    check_mapped_modules(mapping, workload)
    unshared = sorted(m for m in mapping if not workload.modules[m].shared)
    if unshared:
        raise ConversionError(f"module(s) {unshared} are `shared: false` (one copy per task); exporting one task's "
                              f"copy to Hugging Face is not supported")
    log = getattr(args, "log", print)
    by_base: dict[str, list[str]] = {}
    for module, base in mapping.items():
        by_base.setdefault(base, []).append(module)
    notes: list[str] = []
    skipped: list[str] = []
    with staged_output(args.save_dir) as tmp:
        targets = {base: _Target(base, mods, tmp / "+".join(mods), args.max_shard_size_mb << 20)
                   for base, mods in by_base.items()}
        towers = {}
        for module, base in mapping.items():
            spec = workload.modules[module]
            towers[module] = find_tower(targets[base].base, spec.kind, spec.frontend.type if spec.frontend else None)
            check_module_fits(towers[module], spec, base)
        for msg in messages:
            if not isinstance(msg, UnitMessage):
                continue
            owner, module, part = split_unit(msg.unit)
            if module not in mapping:
                skipped.append(msg.unit)
                continue
            _write_unit(targets[mapping[module]], towers[module], workload.modules[module], msg.unit, part,
                        msg.tensors, notes)
            handle_notes(notes, args.allow_inexact, log)
            notes.clear()
        for target in targets.values():
            target.finish(log)
        if skipped:
            log(f"not exported (no HF target in --mapping): {skipped[:8]}{' ...' if len(skipped) > 8 else ''}")
    return Path(args.save_dir)

