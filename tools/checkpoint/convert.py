#!/usr/bin/env python
"""Convert checkpoints between Hugging Face, megatron-core and megatron-spindle, one parameter unit at a time.

    python tools/checkpoint/convert.py --loader hf --saver spindle --workload tiny-vlm \\
        --mapping vision=/ckpt/clip-vit,llm=/ckpt/llama --load-dir . --save-dir /ckpt/spindle-init
    python tools/checkpoint/convert.py --loader mcore --saver spindle --workload my.yaml \\
        --load-dir /megatron/ckpt --save-dir /ckpt/spindle-init
    python tools/checkpoint/convert.py --loader spindle --saver hf --workload my.yaml \\
        --mapping vision=/ckpt/clip-vit,llm=/ckpt/llama --load-dir /runs/ckpt --save-dir /export

Plugins (Megatron-LM's converter shape): ``loader_<name>.py`` with ``add_arguments(parser)`` and
``load_checkpoint(args, workload, meta)`` (a generator of messages, see common.py), ``saver_<name>.py`` with
``add_arguments(parser)`` and ``save_checkpoint(messages, args, workload)``. Looked up in this folder first, then
as a bare module name on ``PYTHONPATH``.

Order of work: a dry run of the loader on meta tensors (file headers only) is checked against the workload -
every tensor's name and full shape - and any mismatch fails naming the tensor and both shapes, before anything
is read or written; then the real stream goes through the same check into the saver, which writes into a
temporary folder renamed to ``--save-dir`` at the end. Conversions our model cannot reproduce exactly fail
unless ``--allow-inexact``, listing every inexact tensor with its max error (config-level differences already in
the dry run, value-dependent ones - e.g. a non-zero bias the target has no place for - before the output is
committed). Exit status 2 on bad input.
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
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402

from tools.checkpoint.common import (  # noqa: E402
    USER_ERRORS,
    ConversionError,
    InexactReport,
    Metadata,
    Note,
    UnitMessage,
    tensor_bytes,
)

LOADERS = ("hf", "mcore", "spindle")
SAVERS = ("spindle", "hf", "mcore")
MAPPING_HELP = (
    "Which Hugging Face folder goes with each workload module, MODULE=VALUE[,...] (repeatable, or a file of "
    "MODULE=VALUE lines). --loader hf: the HF folder the module's weights are read from (a CLIPModel folder "
    "serves a patch module with its vision tower and a text module with its text tower). --saver hf: the "
    "reference folder the module is written over (its config, tokenizer and the tensors we do not hold are kept), "
    "or an HF class (CLIPVisionModel[WithProjection], CLIPTextModel[WithProjection], WhisperEncoder, "
    "LlamaForCausalLM, Qwen2ForCausalLM) or 'auto' to export from scratch with a config.json written from the "
    "module's hyper-parameters; without --mapping every module with an HF class is exported from scratch.")


def load_plugin(kind: str, name: str):
    """``tools.checkpoint.<kind>_<name>``, else a module ``<kind>_<name>`` or ``<name>`` on the path."""
    for module in (f"tools.checkpoint.{kind}_{name}", f"{kind}_{name}", name):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            continue
        plugin = importlib.import_module(module)
        entry = "load_checkpoint" if kind == "loader" else "save_checkpoint"
        if not hasattr(plugin, entry) or not hasattr(plugin, "add_arguments"):
            raise ConversionError(f"plugin {module} lacks add_arguments() or {entry}()")
        return plugin
    raise ConversionError(f"no {kind} plugin named '{name}' (built in: "
                          f"{', '.join(LOADERS if kind == 'loader' else SAVERS)})")


def build_parser(loader_name: str | None = None, saver_name: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="megatron-spindle checkpoint converter", allow_abbrev=False)
    parser.add_argument("--loader", required=True, help=f"Loader plugin ({', '.join(LOADERS)}).")
    parser.add_argument("--saver", required=True, help=f"Saver plugin ({', '.join(SAVERS)}).")
    parser.add_argument("--load-dir", default=".", help="Checkpoint to read (hf: folders come from --mapping).")
    parser.add_argument("--save-dir", required=True, help="Output folder (must not exist or be empty).")
    parser.add_argument("--workload", required=True, help="Workload YAML file or built-in workload name.")
    parser.add_argument("--mapping", action="append", default=[], metavar="MODULE=HF_FOLDER[,...] | FILE",
                        help=MAPPING_HELP)
    parser.add_argument("--allow-inexact", action="store_true",
                        help="Convert even where the converted model cannot compute what the source computes. "
                             "Without it such a conversion fails listing every inexact tensor and its max error; "
                             "with it they are printed as warnings.")
    parser.add_argument("--init-seed", type=int, default=0,
                        help="Seed of the deterministic initialisation (ModelConfig.init_seed of the training run) "
                             "given to tensors and units the source does not have.")
    parser.add_argument("--quiet", action="store_true", help="No per-unit progress lines.")
    for kind, name in (("loader", loader_name), ("saver", saver_name)):
        if name:
            load_plugin(kind, name).add_arguments(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--loader")
    pre.add_argument("--saver")
    known, _ = pre.parse_known_args(argv)
    return build_parser(known.loader, known.saver).parse_args(argv)


def checked_stream(messages: Iterator, expected: dict, args, progress: bool, total: int | None = None,
                   report: InexactReport | None = None) -> Iterator:
    """Pass messages on, failing on units or tensors the workload does not have or whose shape differs; inexact
    notes go to ``report``, checked when the stream ends (before the saver commits anything); one progress line
    per unit."""
    log = args.log
    report = report or InexactReport(args.allow_inexact, log)
    seen: set[str] = set()
    start = time.perf_counter()
    total = total or len(expected)
    for msg in messages:
        if isinstance(msg, Note):
            if msg.inexact:
                report.add(msg)
            elif progress:
                log(f"note: {msg.line()}")
            continue
        if isinstance(msg, UnitMessage):
            check_unit(msg, expected)
            if msg.unit in seen:
                raise ConversionError(f"unit '{msg.unit}' produced twice by the loader")
            seen.add(msg.unit)
            if progress:
                mb = tensor_bytes(msg.tensors) / 2 ** 20 if next(iter(msg.tensors.values())).device.type != "meta" else 0
                log(f"[{len(seen):4d}/{total}] {msg.unit}: {len(msg.tensors)} tensors, {mb:.1f} MB "
                    f"({time.perf_counter() - start:.1f} s)")
        yield msg
    report.check()


def check_unit(msg: UnitMessage, expected: dict) -> None:
    if msg.unit not in expected:
        raise ConversionError(f"unit '{msg.unit}' is not a parameter unit of the workload "
                              f"(it has {len(expected)}: {sorted(expected)[:6]} ...)")
    want = expected[msg.unit]
    for name, t in msg.tensors.items():
        if name not in want:
            raise ConversionError(f"tensor '{name}' is not a parameter of the workload's unit '{msg.unit}' "
                                  f"(it has {sorted(want)})")
        if tuple(t.shape) != tuple(want[name]):
            raise ConversionError(f"tensor '{name}': shape {tuple(t.shape)} in the checkpoint but the workload "
                                  f"expects {tuple(want[name])}")
    missing = sorted(set(want) - set(msg.tensors))
    if missing:
        raise ConversionError(f"unit '{msg.unit}': the checkpoint lacks tensor(s) {missing}")


def convert(args: argparse.Namespace) -> str:
    """Run the conversion; returns the output folder. Raises ConversionError (and friends) on bad input."""
    from megatron_spindle.graph.workload import load_workload
    from tools.checkpoint.layout import expected_units

    args.log = getattr(args, "log", None) or (lambda s: print(s, flush=True))
    loader, saver = load_plugin("loader", args.loader), load_plugin("saver", args.saver)
    workload = load_workload(args.workload)
    expected = expected_units(workload)
    t0 = time.perf_counter()
    units = 0
    dry = InexactReport(args.allow_inexact, log=lambda s: None)  # warnings are printed once, by the real pass
    for msg in checked_stream(loader.load_checkpoint(args, workload, meta=True), expected, args, progress=False,
                              report=dry):
        units += isinstance(msg, UnitMessage)
        if isinstance(msg, Metadata):
            args.log(f"loader {args.loader}: {msg.source} (iteration {msg.iteration})")
    args.log(f"checked {units} unit(s) against workload '{workload.name}' ({time.perf_counter() - t0:.1f} s); "
             f"converting with saver {args.saver}")
    args.inexact = InexactReport(args.allow_inexact, args.log)  # savers add their own notes to it
    stream = checked_stream(loader.load_checkpoint(args, workload, meta=False), expected, args,
                            progress=not args.quiet, total=units, report=args.inexact)
    out = saver.save_checkpoint(stream, args, workload)
    args.log(f"done: {out} ({time.perf_counter() - t0:.1f} s)")
    return str(out)


def main(argv: list[str] | None = None) -> int:
    from megatron_spindle.checkpointing import CheckpointError
    from megatron_spindle.graph.workload import WorkloadError

    try:
        convert(parse_args(argv))
    except (*USER_ERRORS, CheckpointError, WorkloadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
