"""Messages exchanged between loader and saver plugins, and helpers they share.

A loader's ``load_checkpoint(args, workload, meta)`` is a generator: first a ``Metadata``, then for each parameter
unit one ``UnitMessage`` with that unit's full tensors (``"<unit>.<path>"``, megatron-spindle local-spec names),
and ``Note`` messages where the conversion is not exact. With ``meta=True`` it yields meta-device tensors (shapes
and dtypes from file headers only): ``convert.py`` checks the whole stream against the workload before anything
is read or written. A saver's ``save_checkpoint(messages, args, workload)`` consumes the stream, holding at most
one unit (plus a bounded write buffer) in memory, writes to a temporary folder and renames it at the end.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tools.checkpoint.hf_io import HFCheckpointError


class ConversionError(ValueError):
    """Bad input or a conversion that would lose information; the message says what and where."""


@dataclass
class Metadata:
    source: str  # e.g. "hf:vision=/path,llm=/path", "spindle:/ckpt", "mcore:/ckpt"
    iteration: int = 0
    plan: dict[str, Any] | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class UnitMessage:
    unit: str
    tensors: dict[str, torch.Tensor]
    origin: str = ""  # where the tensors came from, for progress lines


@dataclass
class Note:
    """Something the conversion changed. ``inexact``: the converted model computes something else than the source
    (fails unless --allow-inexact); ``tensor`` names the tensor concerned and ``max_error`` the largest absolute
    change of its values (None where the difference is structural or only shapes are known, in dry runs)."""

    text: str
    inexact: bool = True
    tensor: str | None = None
    max_error: float | None = None

    def line(self) -> str:
        if self.tensor is None:
            return self.text
        err = "" if self.max_error is None else f": max error {self.max_error:.3g}"
        return f"{self.tensor}{err} ({self.text})"


class InexactReport:
    """Collects the inexact notes of a whole conversion and fails once, listing every one of them (per tensor
    with its max error), unless --allow-inexact; then each is printed as a warning. Call ``check`` before the
    output is committed (savers do it inside ``staged_output``, so a refused conversion writes nothing)."""

    def __init__(self, allow_inexact: bool, log=print):
        self.allow_inexact = allow_inexact
        self.log = log
        self.notes: list[Note] = []
        self._seen: set[str] = set()

    def add(self, note: Note) -> None:
        if note.line() not in self._seen:
            self._seen.add(note.line())
            self.notes.append(note)

    def check(self) -> None:
        if not self.notes:
            return
        if not self.allow_inexact:
            tensors = sum(n.tensor is not None for n in self.notes)
            listed = "\n  - ".join(n.line() for n in self.notes)
            raise ConversionError(f"the conversion is not exact ({len(self.notes)} item(s), {tensors} tensor(s)):\n"
                                  f"  - {listed}\n(pass --allow-inexact to convert anyway)")
        for n in self.notes:
            self.log(f"WARNING: inexact: {n.line()}")
        self.notes.clear()


def inexact_report(args) -> InexactReport:
    """The conversion's one report (created on first use; convert.py resets it per pass)."""
    report = getattr(args, "inexact", None)
    if report is None:
        report = args.inexact = InexactReport(getattr(args, "allow_inexact", False),
                                              getattr(args, "log", None) or print)
    return report


USER_ERRORS = (ConversionError, HFCheckpointError, KeyError, FileNotFoundError)


def parse_mapping(values: list[str] | None) -> dict[str, str]:
    """``["vision=/a,text=/a", "llm=/b"]`` or a file of ``module: path`` / ``module=path`` lines -> dict."""
    out: dict[str, str] = {}
    for value in values or []:
        items: list[str] = []
        if "=" not in value and Path(value).is_file():
            for line in Path(value).read_text().splitlines():
                line = line.split("#", 1)[0].strip()
                if line:
                    items.append(line.replace(":", "=", 1) if "=" not in line else line)
        else:
            items = [v for v in value.split(",") if v.strip()]
        for item in items:
            module, sep, path = item.partition("=")
            if not sep or not module.strip() or not path.strip():
                raise ConversionError(f"--mapping: expected MODULE=PATH, got {item!r}")
            module, path = module.strip(), path.strip()
            if module in out and out[module] != path:
                raise ConversionError(f"--mapping: module '{module}' given twice ({out[module]} and {path})")
            out[module] = path
    return out


def check_mapped_modules(mapping: dict[str, str], workload) -> None:
    for module in mapping:
        if module not in workload.modules:
            raise ConversionError(f"--mapping names module '{module}', which workload '{workload.name}' does not "
                                  f"have (modules: {sorted(workload.modules)})")


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def parse_dtype(name: str) -> torch.dtype | None:
    table = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "source": None}
    if name not in table:
        raise ConversionError(f"unknown dtype '{name}' (expected one of {sorted(table)})")
    return table[name]


@contextmanager
def staged_output(save_dir: str | Path):
    """A temporary folder beside ``save_dir``, renamed to ``save_dir`` when the block succeeds and removed when
    it fails: a failed conversion leaves nothing behind. ``save_dir`` must not exist or be empty."""
    save_dir = Path(save_dir).resolve()
    if save_dir.exists() and (not save_dir.is_dir() or any(save_dir.iterdir())):
        raise ConversionError(f"--save-dir {save_dir} exists and is not empty")
    save_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{save_dir.name}.", suffix=".converting", dir=save_dir.parent))
    try:
        yield tmp
        if save_dir.exists():
            save_dir.rmdir()
        os.replace(tmp, save_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
