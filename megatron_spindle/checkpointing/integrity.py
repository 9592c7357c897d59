"""Checksums of every file of a checkpoint, their verification, and the clean-up of interrupted saves.

At save, ``metadata.json`` records ``files``: ``{relative path: {"sha256", "bytes"}}`` for every other file of
the iteration folder (unit files, each rank's RNG state, the plan). ``verify_checkpoint`` re-reads them all
(``tools/checkpoint/inspect_checkpoint.py --verify``); checkpoints saved before ``files`` existed have checksums
for their unit files only, and the rest is reported as unchecked.

``remove_stale_saves`` runs at the start of every save: a save killed midway leaves ``iter_N.tmp`` (and a
re-save killed while swapping leaves ``iter_N.old``), a process killed while replacing a file leaves fileio's
hidden ``.<name>.<random>.tmp``; none is ever pointed to, so all go (the --save lock says no one else writes).
"""

from __future__ import annotations

import hashlib
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METADATA_FILE = "metadata.json"
_STALE = re.compile(r"^iter_\d+\.(tmp|old)$")
_STALE_FILE = re.compile(r"^\..+\.tmp(\.[A-Za-z0-9]+)?$")  # fileio's temporary files (plan.json, pointer)
_CHUNK = 1 << 20


def sha256_file(path: Path) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


def file_checksums(folder: Path, known: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{relative path: {"sha256", "bytes"}}`` of every file under ``folder`` except the metadata; files in
    ``known`` (relative path -> entry with "sha256" and "bytes", e.g. the unit files hashed when they were
    serialised) are not read again."""
    out: dict[str, dict[str, Any]] = {}
    for p in sorted(folder.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(folder).as_posix()
        if rel == METADATA_FILE:
            continue
        if rel in known:
            out[rel] = {"sha256": known[rel]["sha256"], "bytes": known[rel]["bytes"]}
        else:
            digest, n = sha256_file(p)
            out[rel] = {"sha256": digest, "bytes": n}
    return out


@dataclass
class VerifyResult:
    folder: Path
    checked: int = 0
    problems: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)  # files without a recorded checksum (older checkpoints)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(folder: str | Path, metadata: dict[str, Any]) -> VerifyResult:
    """Re-read every file of the iteration folder ``folder`` and compare it with the checksums recorded in
    ``metadata`` (its parsed metadata.json); missing, extra, truncated or modified files are problems."""
    folder = Path(folder)
    res = VerifyResult(folder)
    recorded: dict[str, dict[str, Any]] = dict(metadata.get("files") or {})
    for unit, meta in (metadata.get("units") or {}).items():
        recorded.setdefault(meta["file"], {"sha256": meta["sha256"], "bytes": meta.get("bytes"), "unit": unit})
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {METADATA_FILE}
    for rel in sorted(recorded):
        entry = recorded[rel]
        if rel not in present:
            res.problems.append(f"{rel}: missing")
            continue
        digest, n = sha256_file(folder / rel)
        res.checked += 1
        if digest != entry["sha256"]:
            size = f"{n} bytes, expected {entry['bytes']}" if entry.get("bytes") is not None else f"{n} bytes"
            res.problems.append(f"{rel}: checksum mismatch ({size}; truncated or modified)")
    extra = sorted(present - set(recorded))
    if metadata.get("files") is not None:
        res.problems += [f"{rel}: not part of the checkpoint (no checksum recorded)" for rel in extra]
    else:
        res.unchecked = extra
    return res


def recorded_checksum(metadata: dict[str, Any], rel: str) -> str | None:
    entry = (metadata.get("files") or {}).get(rel)
    return entry["sha256"] if entry else None


def remove_stale_saves(save_dir: Path) -> list[str]:
    """Delete the ``iter_*.tmp`` / ``iter_*.old`` folders and temporary files of interrupted writes; returns
    their names."""
    removed = []
    if not save_dir.is_dir():
        return removed
    for p in sorted(save_dir.iterdir()):
        if _STALE.match(p.name) and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
            removed.append(p.name)
        elif _STALE_FILE.match(p.name) and p.is_file():
            p.unlink()
            removed.append(p.name)
    return removed


def verify(path: str | Path) -> VerifyResult:
    """``verify_checkpoint`` of a checkpoint root (the iteration its pointer names) or an iteration folder."""
    from megatron_spindle.checkpointing.checkpoint import (
        CheckpointError,
        iteration_dir,
        read_latest,
        read_metadata,
    )

    path = Path(path)
    if not (path / METADATA_FILE).exists():
        it = read_latest(path)
        if it is None:
            raise CheckpointError(f"{path} holds no megatron-spindle checkpoint (no latest_checkpointed_iteration.txt "
                                  f"and no {METADATA_FILE})")
        path = iteration_dir(path, it)
    return verify_checkpoint(path, read_metadata(path))


def verify_report(res: VerifyResult) -> tuple[bool, str]:
    """(ok, one line) for a tool to print."""
    if not res.ok:
        shown = "; ".join(res.problems[:6]) + (" ..." if len(res.problems) > 6 else "")
        return False, f"checkpoint {res.folder} fails verification ({len(res.problems)} problem(s)): {shown}"
    note = (f"; {len(res.unchecked)} file(s) have no recorded checksum (saved by an older version): "
            f"{', '.join(res.unchecked[:4])}" if res.unchecked else "")
    return True, f"verified {res.folder}: all {res.checked} file(s) match their checksums{note}"
