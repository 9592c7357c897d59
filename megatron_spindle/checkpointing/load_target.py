"""What ``--load`` points at, and what a run may write into ``--save``: a resume never destroys a checkpoint.

``resolve_load(load, save)``:

- a checkpoint root (``latest_checkpointed_iteration.txt`` names the iteration) -> that iteration;
- an iteration folder (it holds ``metadata.json``) -> exactly that iteration;
- anything else is an error naming what was looked for, except ``--load`` equal to ``--save`` with no checkpoint
  in it yet (missing, empty, or only an interrupted first save): the auto-resume pattern ``--save X --load X``,
  which starts from scratch with a one-line notice (an error too with ``exit_on_missing``:
  --exit-on-missing-checkpoint);
- a root with iteration folders but no pointer is an error that names the folders (never "no checkpoint").

``check_save_target(save, start, loaded_from_save)``: a run that starts at iteration ``start`` must not
overwrite checkpoints in ``--save`` that are later than ``start`` (e.g. a fresh run onto a folder of a previous
one), unless it resumed from that folder's own pointer.

``check_complete(ck, load_rng, load_optim)``: a checkpoint missing its RNG or optimizer state is an error unless
``--no-load-rng`` / ``--no-load-optim`` says to go without (a checkpoint at iteration 0 has no optimizer state
to miss: converted or freshly initialised weights).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from megatron_spindle.checkpointing.checkpoint import (
    LATEST_FILE,
    METADATA_FILE,
    CheckpointError,
    LoadedCheckpoint,
    iteration_dir,
    read_latest,
    read_metadata,
)

_ITER = re.compile(r"^iter_(\d+)$")


@dataclass(frozen=True)
class LoadTarget:
    """``folder``: the iteration folder to load (None: start from scratch, ``notice`` says why);
    ``root``: the folder holding the pointer when ``--load`` named a root."""

    folder: Path | None
    iteration: int | None
    root: Path | None = None
    notice: str | None = None


def same_folder(a: str | Path | None, b: str | Path | None) -> bool:
    if a is None or b is None:
        return False
    pa, pb = Path(a), Path(b)
    if pa.exists() and pb.exists():
        return os.path.samefile(pa, pb)
    return os.path.normpath(pa.absolute()) == os.path.normpath(pb.absolute())


def finished_iterations(folder: Path) -> list[int]:
    """Iterations of the complete ``iter_*`` folders (with metadata.json) in ``folder``, ascending."""
    if not folder.is_dir():
        return []
    its = []
    for p in folder.iterdir():
        m = _ITER.match(p.name)
        if m and (p / METADATA_FILE).is_file():
            its.append(int(m.group(1)))
    return sorted(its)


def _other_format(folder: Path) -> str | None:
    if (folder / ".metadata").exists() or any((p / ".metadata").exists() for p in folder.glob("iter_*")):
        return "a megatron-core checkpoint (convert it with tools/checkpoint/convert.py --loader mcore)"
    if (folder / "config.json").exists():
        return "a Hugging Face folder (convert it with tools/checkpoint/convert.py --loader hf)"
    return None


def resolve_load(load: str | Path, save: str | Path | None = None, flag: str = "--load",
                 exit_on_missing: bool = False, missing_ok: bool = False) -> LoadTarget:
    """The checkpoint ``load`` names. A folder without one is an error, except ``save`` itself (a run resuming
    into its own folder starts from scratch the first time; not with ``exit_on_missing``) or with ``missing_ok``
    (--pretrained-checkpoint is the fallback)."""
    p = Path(load)
    auto_resume = missing_ok or (same_folder(load, save) and not exit_on_missing)
    fresh = LoadTarget(None, None, p, f"no checkpoint in {load} yet: training from scratch")
    if not p.exists():
        if auto_resume:
            return fresh
        raise CheckpointError(f"{flag} {load}: no such folder")
    if not p.is_dir():
        raise CheckpointError(f"{flag} {load} is a file, not a checkpoint folder")
    other = _other_format(p)
    if other is not None and not (p / METADATA_FILE).exists():
        raise CheckpointError(f"{flag} {load} is {other}")
    if (p / METADATA_FILE).is_file():
        meta = read_metadata(p)
        return LoadTarget(p, int(meta["iteration"]))
    if (p / LATEST_FILE).exists():
        it = read_latest(p)
        folder = iteration_dir(p, it)
        read_metadata(folder)  # names a missing or corrupt folder the pointer names
        return LoadTarget(folder, it, p)
    its = finished_iterations(p)
    if its:
        names = [iteration_dir(p, i).name for i in its]
        raise CheckpointError(f"{flag} {load} has no {LATEST_FILE} but holds iteration folder(s) "
                              f"{', '.join(names[-4:])}: give {flag} {iteration_dir(p, its[-1])} to resume one of "
                              f"them")
    if auto_resume:
        return fresh
    raise CheckpointError(f"{flag} {load} holds no checkpoint: no {LATEST_FILE}, no {METADATA_FILE} (an "
                          f"iteration folder) and no complete iter_* folder")


def check_save_target(save: str | Path | None, start: int, loaded_from_save: bool) -> None:
    """Refuse a run that would overwrite checkpoints of ``save`` later than its start iteration."""
    if save is None or not Path(save).is_dir():
        return
    save = Path(save)
    its = finished_iterations(save)
    latest = read_latest(save) if (save / LATEST_FILE).exists() else None
    if latest is not None:
        its = sorted(set(its) | {latest})
    later = [i for i in its if i > start]
    if loaded_from_save or not later:
        return
    what = "starts from scratch" if start == 0 else f"starts at iteration {start}"
    raise CheckpointError(f"--save {save} already holds checkpoints up to iteration {later[-1]} "
                          f"({len(later)} later than this run's start); this run {what} and would overwrite "
                          f"them: resume with --load {save}, or give another --save")


FROZEN_UNITS_KEY = "frozen_units"  # metadata["extra"]: the units of modules frozen in the run that saved it


def check_complete(ck: LoadedCheckpoint, load_rng: bool, load_optim: bool) -> None:
    """CheckpointError when the RNG or (after iteration 0) the optimizer state of a loaded unit is missing. A
    unit frozen in the run that saved it has none to miss: thawed, it starts AdamW afresh."""
    if load_rng and ck.rng is None:
        raise CheckpointError(f"checkpoint {ck.path} has no RNG state (rng/rank_*.pt): give --no-load-rng to "
                              f"start the random number generators afresh")
    if not load_optim or ck.iteration == 0:
        return
    manifest = ck.metadata.get("units", {})
    frozen = set(ck.metadata.get("extra", {}).get(FROZEN_UNITS_KEY, []))
    lacking = [u for u in sorted(ck.units) if u not in frozen and set(manifest.get(u, {}).get("optim", [])) !=
               set(manifest.get(u, {}).get("tensors", {}))]
    if lacking:
        raise CheckpointError(f"checkpoint {ck.path} (iteration {ck.iteration}) has no optimizer state for "
                              f"{len(lacking)} unit(s), e.g. '{lacking[0]}': give --no-load-optim to start AdamW "
                              f"afresh")
