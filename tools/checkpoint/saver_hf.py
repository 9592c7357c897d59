"""Saver plugin ``hf``: parameter units -> Hugging Face folders (``from_pretrained``-loadable).

``--mapping MODULE=VALUE[,...]`` says where each workload module goes:

- a reference folder (``vision=/ckpt/clip``): the HF folder the module was converted from (or one of the same
  architecture and size). It supplies the config, tokenizer files and every tensor our model does not hold
  (Whisper's decoder, the other CLIP tower; CLIP's pre-LayerNorm and Whisper's conv stem when the workload does not
  declare ``pre_norm`` / ``stem: conv``); the saver writes our weights over it, in the reference's dtypes. Modules
  sharing a reference are written together into ``<save-dir>/<module>[+<module>...]``;
- an HF class (``vision=CLIPVisionModelWithProjection``, see hf_config.HF_CLASSES) or ``auto`` (the class that
  fits the module, hf_config.default_hf_class): export from scratch into ``<save-dir>/<module>``, with a
  ``config.json`` written from the module's hyper-parameters and options, in ``--saver-dtype``.

Without ``--mapping`` every module with an HF class is exported from scratch; modules not exported (projectors)
are listed. Every tensor is written once, one unit at a time. What the HF model cannot hold is reported per tensor
(hf_mapping.export_unit) and fails the export unless ``--allow-inexact``, before the output folder appears.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_spindle.checkpointing.names import from_te_names
from tools.checkpoint.common import (
    ConversionError,
    Note,
    UnitMessage,
    check_mapped_modules,
    inexact_report,
    parse_dtype,
    parse_mapping,
    staged_output,
)
from tools.checkpoint.hf_config import (
    HF_CLASSES,
    default_hf_class,
    module_family,
    scratch_config,
    scratch_has_bias,
    scratch_tower,
)
from tools.checkpoint.hf_io import INDEX_FILE, SINGLE_FILE, HFFolder, ShardWriter
from tools.checkpoint.hf_mapping import (
    IGNORED_SUFFIXES,
    check_module_fits,
    export_unit,
    find_tower,
    missing_part_tensors,
    numerics_notes,
)
from tools.checkpoint.layout import split_unit, workload_units


def add_arguments(parser) -> None:
    group = parser.add_argument_group(title="Hugging Face saver")
    group.add_argument("--max-shard-size-mb", type=int, default=2048, help="Largest safetensors shard written.")
    group.add_argument("--saver-dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                       help="dtype of modules exported from scratch (over a reference folder, its dtypes are kept).")


def is_scratch(value: str) -> bool:
    return value == "auto" or value in HF_CLASSES


class _Target:
    """One output folder: a reference HF folder (or a from-scratch class) and the workload modules written into it."""

    def __init__(self, base: str | None, modules: list[str], folder: Path, max_shard_bytes: int,
                 config: dict | None = None, dtype: torch.dtype = torch.float32):
        self.base = HFFolder(base) if base is not None else None
        self.modules = modules
        self.folder = folder
        self.folder.mkdir(parents=True)
        self.writer = ShardWriter(folder, max_shard_bytes)
        self.config = dict(self.base.config) if self.base is not None else dict(config)
        self.dtype = dtype
        self.embed: torch.Tensor | None = None  # kept only while a tied lm_head may need it
        self.parts: set[tuple[str, str]] = set()  # (module, part) written

    def has_tensor(self, name: str, tower) -> bool:
        if self.base is not None:
            return name in self.base
        return scratch_has_bias(tower, name)

    def write(self, name: str, tensor: torch.Tensor, unit: str) -> None:
        if self.base is None:
            self.writer.add(name, tensor.to(self.dtype))
            return
        if name not in self.base:
            raise ConversionError(f"unit '{unit}': tensor '{name}' is not in the reference HF folder {self.base.path}")
        shape = tuple(self.base.get_shape(name))
        if tuple(tensor.shape) != shape:
            raise ConversionError(f"unit '{unit}': tensor '{name}' has shape {tuple(tensor.shape)} but the reference "
                                  f"HF folder {self.base.path} has {shape}")
        self.writer.add(name, tensor.to(self.base.dtype(name)))

    def finish(self, log) -> None:
        copied = 0
        if self.base is not None:
            for name in self.base.keys():
                if name not in self.writer.weight_map and name not in self.writer.pending:
                    if name.endswith(IGNORED_SUFFIXES):
                        continue
                    self.writer.add(name, self.base.get(name))
                    copied += 1
        self.writer.close()
        if self.base is not None:
            for p in self.base.path.iterdir():  # tokenizer, generation config, preprocessor config, ...
                if p.is_file() and p.name not in (SINGLE_FILE, INDEX_FILE, "config.json") and \
                        not p.name.endswith((".safetensors", ".bin")):
                    shutil.copy2(p, self.folder / p.name)
        (self.folder / "config.json").write_text(json.dumps(self.config, indent=2) + "\n")
        how = f"{copied} kept from the reference" if self.base is not None else \
            f"from scratch as {self.config['architectures'][0]}"
        log(f"wrote {self.folder.name}: {len(self.writer.weight_map)} tensors ({how})")


def _write_unit(target: _Target, tower, spec, unit: str, part: str, tensors: dict, report, log) -> None:
    rel = {k[len(unit) + 1:]: v for k, v in from_te_names(tensors).items()}
    hf, notes = export_unit(tower, spec, part, unit, rel, lambda name: target.has_tensor(name, tower))
    _report(notes, report, log)
    target.parts.add((spec.name, part))
    embed_name = tower.prefix + "embed_tokens.weight"
    tied = bool(target.config.get("tie_word_embeddings")) and target.base is not None and \
        "lm_head.weight" not in target.base
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


def _report(notes: list[Note], report, log) -> None:
    for n in notes:
        if n.inexact:
            report.add(n)
        else:
            log(f"note: {n.line()}")


def _export_plan(args, workload) -> dict[str, str]:
    """module -> reference folder or HF class (``auto`` resolved)."""
    mapping = parse_mapping(args.mapping)
    check_mapped_modules(mapping, workload)
    if not mapping:
        mapping = {m: "auto" for m, spec in workload.modules.items() if module_family(spec) is not None}
        if not mapping:
            raise ConversionError(f"workload '{workload.name}' has no module with a Hugging Face class to export")
    unshared = sorted(m for m in mapping if not workload.modules[m].shared)
    if unshared:
        raise ConversionError(f"module(s) {unshared} are `shared: false` (one copy per task); exporting one task's "
                              f"copy to Hugging Face is not supported")
    return {m: default_hf_class(workload, m) if v == "auto" else v for m, v in mapping.items()}


def save_checkpoint(messages: Iterator, args, workload) -> Path:
    plan = _export_plan(args, workload)
    log = getattr(args, "log", print)
    report = inexact_report(args)
    dtype = parse_dtype(args.saver_dtype)
    by_base: dict[str, list[str]] = {}
    for module, value in plan.items():
        by_base.setdefault(module if is_scratch(value) else value, []).append(module)
    skipped: list[str] = []
    with staged_output(args.save_dir) as tmp:
        targets, towers = {}, {}
        for key, mods in by_base.items():
            value = plan[mods[0]]
            if is_scratch(value):
                config = scratch_config(workload, key, value)
                targets[key] = _Target(None, mods, tmp / key, args.max_shard_size_mb << 20, config, dtype)
                towers[key] = scratch_tower(value, config)
            else:
                targets[key] = _Target(value, mods, tmp / "+".join(mods), args.max_shard_size_mb << 20)
                for module in mods:
                    spec = workload.modules[module]
                    towers[module] = find_tower(targets[key].base, spec.kind, spec.frontend.type if spec.frontend else None)
            for module in mods:
                check_module_fits(towers[module], workload.modules[module], str(value))
                if is_scratch(value):  # what the written config cannot express (the loader checks references)
                    for text in numerics_notes(towers[module], workload.modules[module]):
                        report.add(Note(f"{module} ({value}): {text}"))
        target_of = {m: targets[k] for k, mods in by_base.items() for m in mods}
        like = None
        for msg in messages:
            if not isinstance(msg, UnitMessage):
                continue
            owner, module, part = split_unit(msg.unit)
            if module not in plan:
                skipped.append(msg.unit)
                continue
            like = like if like is not None else next(iter(msg.tensors.values()))
            _write_unit(target_of[module], towers[module], workload.modules[module], msg.unit, part, msg.tensors,
                        report, log)
        _fill_missing_parts(workload, plan, target_of, towers, like, report, log)
        report.check()
        for target in targets.values():
            target.finish(log)
        if skipped:
            log(f"not exported (no HF target): {skipped[:8]}{' ...' if len(skipped) > 8 else ''}")
    return Path(args.save_dir)


def _fill_missing_parts(workload, plan, target_of, towers, like, report, log) -> None:
    """From-scratch targets need every tensor of their class: parts the loader gave no unit for (a tower without
    a contrastive head) get identity norms (hf_mapping.missing_part_tensors); a module without any unit fails."""
    units = workload_units(workload)
    for module, value in plan.items():
        target = target_of[module]
        if not any(m == module for m, _ in target.parts):
            raise ConversionError(f"the loader produced no weights for module '{module}' (nothing to export)")
        if not is_scratch(value):
            continue
        if towers[module].family in ("llama", "qwen2") and (module, "lm_head") not in target.parts:
            raise ConversionError(f"module '{module}' has no lm_head unit (no lm task in the workload), so "
                                  f"{value} would have no output layer")
        for part in ("frontend", "head"):
            if (module, part) in target.parts:
                continue
            if f"{module}.{part}" in units:
                raise ConversionError(f"the loader produced no '{module}.{part}' unit for the export of '{module}'")
            tensors, notes = missing_part_tensors(towers[module], workload.modules[module], part,
                                                  like if like is not None else torch.zeros(()))
            _report(notes, report, log)
            for name, t in tensors.items():
                target.write(name, t, f"{module}.{part}")
