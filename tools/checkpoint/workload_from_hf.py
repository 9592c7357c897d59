#!/usr/bin/env python
"""Write the workload ``modules:`` section that holds Hugging Face checkpoints exactly.

    python tools/checkpoint/workload_from_hf.py \\
        --mapping vision=/ckpt/clip,text=/ckpt/clip,audio=/ckpt/whisper-small,llm=/ckpt/llama-3.2-1b \\
        --out modules.yaml

``--mapping`` has convert.py's form (MODULE=HF_FOLDER[,...], repeatable, or a file of such lines). A CLIPModel
folder given for two modules gives the first its vision tower and the second its text tower; ``--clip-tower
MODULE=vision|text`` says it explicitly (needed when a CLIPModel folder serves one module). Each module gets its
hyper-parameters and every numerics option (activation, norm_epsilon, rotary_base, rope_scaling_factor, qkv_bias,
causal, head_pool, eos_token_id, pre_norm, patch_bias, the conv audio stem), the ones equal to our defaults
included, so ``convert.py --loader hf`` converts exactly with no hand edits. Comments say how many tokens tasks must
give each module (the rows of its position table). Add projectors and tasks, or merge the section into an existing
workload. Reads config.json and tensor headers only; ``--out`` is written atomically and only replaced with
``--overwrite``. Exit status 2 on bad input.
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
from pathlib import Path  # noqa: E402

import yaml  # noqa: E402

from tools.checkpoint.common import USER_ERRORS, ConversionError, parse_mapping  # noqa: E402

TOWERS = ("vision", "text")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0], allow_abbrev=False)
    parser.add_argument("--mapping", action="append", default=[], required=True,
                        metavar="MODULE=HF_FOLDER[,...] | FILE",
                        help="The Hugging Face folder each workload module is converted from (convert.py's form).")
    parser.add_argument("--clip-tower", default=None, metavar="MODULE=vision|text[,...]",
                        help="Which tower of a CLIPModel folder a module takes (default: the first module mapped "
                             "to the folder the vision tower, the second the text tower).")
    parser.add_argument("--out", required=True, help="YAML file to write (the modules: section).")
    parser.add_argument("--overwrite", action="store_true", help="Replace --out if it exists.")
    return parser


def _clip_towers(mapping: dict[str, str], folders: dict, explicit: dict[str, str]) -> dict[str, str]:
    """module -> "vision" | "text" for the modules mapped to CLIPModel folders."""
    out = {}
    for path in dict.fromkeys(mapping.values()):
        if folders[path].config.get("model_type") != "clip":
            continue
        mods = [m for m, p in mapping.items() if p == path]
        for m in mods:
            if m in explicit:
                out[m] = explicit[m]
        rest = [m for m in mods if m not in explicit]
        free = [t for t in TOWERS if t not in {out[m] for m in mods if m in out}]
        if len(rest) > len(free) or (len(mods) == 1 and not explicit.get(mods[0])):
            raise ConversionError(f"{path} is a CLIPModel (vision and text towers); say which tower module(s) "
                                  f"{rest} take with --clip-tower MODULE=vision|text")
        out.update(zip(rest, free))
    return out


def module_section(mapping: dict[str, str], clip_towers: dict[str, str] | None = None) -> tuple[dict, dict]:
    """({module: YAML mapping}, {module: comment lines}) for the HF folders of ``mapping``."""
    from tools.checkpoint.hf_config import module_from_tower, position_rows
    from tools.checkpoint.hf_io import HFFolder
    from tools.checkpoint.hf_mapping import find_tower

    folders = {p: HFFolder(p, meta=True) for p in dict.fromkeys(mapping.values())}
    for m, t in (clip_towers or {}).items():
        if m not in mapping:
            raise ConversionError(f"--clip-tower names module '{m}', which --mapping does not")
        if t not in TOWERS:
            raise ConversionError(f"--clip-tower {m}={t}: expected vision or text")
    towers_of = _clip_towers(mapping, folders, clip_towers or {})
    modules, comments = {}, {}
    for module, path in mapping.items():
        folder = folders[path]
        mt = folder.config.get("model_type")
        kind = "llm" if mt in ("llama", "qwen2") else "encoder"
        fe_type = {"vision": "patch", "text": "text"}.get(towers_of.get(module, ""), None)
        if mt == "clip_vision_model":
            fe_type = "patch"
        tower = find_tower(folder, kind, fe_type)
        modules[module] = module_from_tower(tower, module, tower.projection is not None)
        rows = position_rows(tower)
        note = [f"{module}: {tower.family} from {path}"]
        if tower.family == "clip_vision":
            note.append(f"tokens: {rows} in every task (class token + patches)")
        elif tower.family == "whisper_encoder":
            note.append(f"tokens: at most {rows} (frames / 2), and {rows} in at least one task (position table rows)")
        elif rows is not None:
            note.append(f"tokens: at most {rows}, and {rows} in at least one task (position table rows)")
        if tower.family in ("whisper_encoder", "clip_text"):
            note.append("its final LayerNorm is our head's: a task feeding the tower only to a projector drops it "
                        "(inexact)")
        if "embed_dim" not in modules[module] and kind == "encoder":
            note.append("no projection in the HF model: add embed_dim for a contrastive task (initialised)")
        comments[module] = note
    _check(modules)
    return modules, comments


def _check(modules: dict) -> None:
    """The modules are a valid workload section (a throwaway task uses each of them)."""
    from megatron_spindle.graph.workload import FrontendSpec, WorkloadError, workload_from_dict

    def tokens(spec: dict) -> int:  # a patch front end's images make its full grid; others take any count
        fe = spec.get("frontend") or {}
        return FrontendSpec(**fe).patch_tokens if fe.get("type") == "patch" else 1

    try:
        workload_from_dict({"name": "check", "modules": modules,
                            "tasks": [{"name": "t", "batch_size": 1,
                                       "tokens": {m: tokens(spec) for m, spec in modules.items()}}]})
    except WorkloadError as e:  # pragma: no cover - a module_from_tower bug, not user input
        raise ConversionError(f"the generated modules are not a valid workload section: {e}") from None


def render(modules: dict, comments: dict, argv: list[str]) -> str:
    lines = ["# Generated by tools/checkpoint/workload_from_hf.py " + " ".join(argv),
             "# Every numerics option is spelled out: tools/checkpoint/convert.py --loader hf converts exactly.",
             "# Add projectors and tasks (or merge this section into a workload).", "modules:"]
    for name, spec in modules.items():
        lines += [f"  # {c}" for c in comments[name]]
        body = yaml.safe_dump({name: spec}, sort_keys=False, default_flow_style=None, width=110)
        lines += ["  " + line for line in body.rstrip("\n").splitlines()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from megatron_spindle.fileio import write_text_atomic

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        mapping = parse_mapping(args.mapping)
        if not mapping:
            raise ConversionError("--mapping names no module")
        towers = dict(parse_mapping([args.clip_tower])) if args.clip_tower else {}
        out = Path(args.out)
        if out.exists() and not args.overwrite:
            raise ConversionError(f"--out {out} exists (pass --overwrite to replace it)")
        modules, comments = module_section(mapping, towers)
        text = render(modules, comments, argv)
        write_text_atomic(out, text)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}: modules {', '.join(modules)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
