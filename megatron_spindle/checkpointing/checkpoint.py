"""Layout-independent training checkpoints: one file per parameter unit, written atomically.

Why per-unit files and not megatron-core ``dist_checkpointing``
----------------------------------------------------------------
A Spindle plan gives every MetaOp its own device set and (tp, dp); a parameter unit (``"vision.layers.3"``,
``"llm.lm_head"``, ``"vision@t1.frontend"``) is held whole by one *parameter device group* and may be TP-sharded
differently from the next unit. ``dist_checkpointing`` describes a tensor by its global offsets under one
model-parallel layout (``ShardedTensor`` with ``replica_id`` over a single TP/PP/DP grid), which fits a uniform
Megatron model but not a set of modules each living on its own sub-grid, and it needs the async writer's
``__main__`` guard and ``psutil``. The unit is the natural grain here: the operators already export and load
*full* (TP-unsharded) tensors per unit, so a checkpoint made of one ``torch.save`` file per unit is readable
under any other plan, world size or placement, each unit is written exactly once (by the lowest rank of the
device group that holds it), and a rank loading a new plan reads only the files of the units it now holds.

On-disk layout (Megatron's names for the pointer file and the iteration folders)::

    <save>/latest_checkpointed_iteration.txt     "12" (written last, atomically)
    <save>/iter_0000012/metadata.json            format, version, iteration, workload name and digest, data
                                                 position, extra state, per unit: file, sha256, tensor
                                                 names, shapes and dtypes, optimizer state present or not;
                                                 and the sha256 of every other file (integrity.py)
    <save>/iter_0000012/plan.json                the plan the run used (for the record; loading may use another)
    <save>/iter_0000012/units/<unit>.pt          {"model": {name: tensor}, "optim": {name: {"exp_avg",
                                                 "exp_avg_sq", "step"}}} (full tensors, AdamW state per parameter)
    <save>/iter_0000012/rng/rank_00000.pt        each rank's RNG states (python, numpy, torch, cuda)

Atomicity: every rank writes into ``<save>/iter_0000012.tmp/`` (files fsynced), a barrier, then rank 0 checks
that each unit was written exactly once, writes ``metadata.json``, renames the folder to ``iter_0000012`` and
only then replaces the pointer file (temporary file, fsync, rename). A crash at any point leaves the previous
checkpoint and pointer intact; stale ``iter_*.tmp`` folders are removed at the start of the next save.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from megatron_spindle.checkpointing.integrity import file_checksums, recorded_checksum, remove_stale_saves
from megatron_spindle.checkpointing.names import from_te_names
from megatron_spindle.checkpointing.rng import get_rng_state
from megatron_spindle.fileio import fsync_dir, write_text_atomic

CHECKPOINT_FORMAT = "megatron-spindle-checkpoint"
CHECKPOINT_VERSION = 1
LATEST_FILE = "latest_checkpointed_iteration.txt"
METADATA_FILE = "metadata.json"
PLAN_FILE = "plan.json"
OPTIM_KEYS = ("exp_avg", "exp_avg_sq")


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or does not match the model it is loaded into."""


@dataclass
class UnitState:
    """One parameter unit in full form: model tensors and the AdamW state of each of them.

    ``model``: ``{"vision.layers.3.mlp.linear_fc1.weight": tensor, ...}`` (full, TP-unsharded).
    ``optim``: ``{same name: {"exp_avg": tensor, "exp_avg_sq": tensor, "step": float}}``; empty when the
    optimizer has not stepped yet (or is not saved).
    """

    model: dict[str, torch.Tensor]
    optim: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class LoadedCheckpoint:
    path: Path
    iteration: int
    units: dict[str, UnitState]
    rng: dict[str, Any] | None  # this rank's RNG states (or rank 0's when the world size changed)
    data_position: dict[str, Any]
    plan: dict[str, Any] | None
    metadata: dict[str, Any]
    warnings: list[str] = field(default_factory=list)


def iteration_dir(save_dir: str | Path, iteration: int) -> Path:
    return Path(save_dir) / f"iter_{iteration:07d}"


def unit_file_name(unit: str) -> str:
    safe = "".join(c if c.isalnum() or c in "._@-" else "_" for c in unit)
    return f"units/{safe}.pt"


def _write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _serialise(obj: Any) -> tuple[bytes, str]:
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def _tensor_meta(t: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}


def _check_unit(unit: str, state: UnitState) -> None:
    for name, t in state.model.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"unit '{unit}': model entry '{name}' is not a tensor")
    for name, st in state.optim.items():
        if name not in state.model:
            raise CheckpointError(f"unit '{unit}': optimizer state for '{name}' which is not one of its tensors")
        for k in OPTIM_KEYS:
            if k in st and tuple(st[k].shape) != tuple(state.model[name].shape):
                raise CheckpointError(f"unit '{unit}': optimizer {k} of '{name}' has shape {tuple(st[k].shape)}, "
                                      f"the parameter {tuple(state.model[name].shape)}")


# ------------------------------------------------------------------------------------------------ saving


def _default_barrier(group=None) -> Callable[[], None]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return lambda: dist.barrier(group=group)
    return lambda: None


def _broadcast_status(msg: str | None, rank: int, group=None) -> str | None:
    """Rank 0's outcome (None = ok, else the error) to every rank, so no rank hangs or goes on alone."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return msg
    box = [msg if rank == 0 else None]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def save_checkpoint(save_dir: str | Path, iteration: int, units: dict[str, UnitState], *,
                    rank: int = 0, world_size: int = 1, group=None,
                    workload_name: str = "", workload_digest: str = "",
                    data_position: dict[str, Any] | None = None, plan: dict[str, Any] | None = None,
                    extra: dict[str, Any] | None = None, expected_units: list[str] | None = None,
                    rng: dict[str, Any] | None = None, barrier: Callable[[], None] | None = None,
                    save_rng: bool = True) -> Path:
    """Write this rank's ``units`` (those it owns) into the checkpoint of ``iteration``; collective.

    Every rank of ``group`` (default: the world) calls it. Rank 0 also writes the metadata, the plan and moves
    the ``latest`` pointer, after checking that every unit in ``expected_units`` was written by exactly one
    rank. Returns the final folder. Raises CheckpointError on every rank if rank 0's checks fail.
    ``barrier`` overrides ``torch.distributed.barrier(group)`` (tests drive several ranks as threads).
    ``save_rng=False`` (--no-save-rng) leaves the RNG states out: loading it then needs --no-load-rng.
    """
    save_dir = Path(save_dir)
    final = iteration_dir(save_dir, iteration)
    tmp = final.with_name(final.name + ".tmp")
    barrier = barrier or _default_barrier(group)
    error: str | None = None
    if rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_saves(save_dir)  # iter_*.tmp / .old left behind by crashed saves: never pointed to
        (tmp / "units").mkdir(parents=True)
        (tmp / "rng").mkdir()
        (tmp / "parts").mkdir()
    barrier()
    # --- every rank: its units, its RNG, its part of the manifest
    part: dict[str, Any] = {}
    try:
        for unit, state in sorted(units.items()):
            _check_unit(unit, state)
            payload = {"model": {k: v.detach().cpu().contiguous() for k, v in state.model.items()},
                       "optim": {k: {kk: (vv.detach().cpu().contiguous() if isinstance(vv, torch.Tensor) else vv)
                                     for kk, vv in st.items()} for k, st in state.optim.items()}}
            data, digest = _serialise(payload)
            rel = unit_file_name(unit)
            _write_bytes(tmp / rel, data)
            part[unit] = {"file": rel, "sha256": digest, "bytes": len(data), "rank": rank,
                          "tensors": {k: _tensor_meta(v) for k, v in state.model.items()},
                          "optim": sorted(state.optim)}
        if save_rng:
            data, _ = _serialise(rng if rng is not None else get_rng_state())
            _write_bytes(tmp / "rng" / f"rank_{rank:05d}.pt", data)
        _write_bytes(tmp / "parts" / f"rank_{rank:05d}.json", json.dumps(part).encode())
    except Exception as e:  # reported through rank 0 so that every rank fails together
        error = f"rank {rank}: writing the checkpoint failed: {e}"
        _write_bytes(tmp / "parts" / f"rank_{rank:05d}.error", error.encode())
    barrier()
    # --- rank 0: merge, check, publish
    if rank == 0:
        try:
            final_path = _publish(save_dir, tmp, final, iteration, world_size, workload_name, workload_digest,
                                  data_position or {}, plan, extra or {}, expected_units)
            assert final_path == final
            error = None
        except Exception as e:
            error = str(e)
    error = _broadcast_status(error, rank, group)
    if error:
        raise CheckpointError(error)
    return final


def _publish(save_dir: Path, tmp: Path, final: Path, iteration: int, world_size: int, workload_name: str,
             workload_digest: str, data_position: dict, plan: dict | None, extra: dict,
             expected_units: list[str] | None) -> Path:
    errors = sorted((tmp / "parts").glob("*.error"))
    if errors:
        raise CheckpointError("; ".join(p.read_text() for p in errors))
    manifest: dict[str, Any] = {}
    for r in range(world_size):
        p = tmp / "parts" / f"rank_{r:05d}.json"
        if not p.exists():
            raise CheckpointError(f"checkpoint {final.name}: rank {r} wrote no manifest (did it call save?)")
        for unit, meta in json.loads(p.read_text()).items():
            if unit in manifest:
                raise CheckpointError(f"checkpoint {final.name}: unit '{unit}' written by both rank "
                                      f"{manifest[unit]['rank']} and rank {meta['rank']}")
            manifest[unit] = meta
    if expected_units is not None:
        missing = sorted(set(expected_units) - set(manifest))
        if missing:
            raise CheckpointError(f"checkpoint {final.name}: no rank wrote unit(s) {missing[:8]}"
                                  f"{' ...' if len(missing) > 8 else ''}")
    shutil.rmtree(tmp / "parts")
    if plan is not None:
        _write_bytes(tmp / PLAN_FILE, json.dumps(plan, indent=1).encode())
    files = file_checksums(tmp, {m["file"]: m for m in manifest.values()})  # every file: inspect --verify
    meta = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "iteration": iteration,
            "world_size": world_size, "workload_name": workload_name, "workload_digest": workload_digest,
            "data_position": data_position, "extra": extra, "units": manifest, "files": files}
    _write_bytes(tmp / METADATA_FILE, json.dumps(meta, indent=1).encode())
    for d in (tmp / "units", tmp / "rng", tmp):
        fsync_dir(d)
    if final.exists():  # re-saving an iteration: move the old copy aside, swap, then drop it
        old = final.with_name(final.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    fsync_dir(save_dir)
    _update_latest(save_dir, iteration)
    return final


def _update_latest(save_dir: Path, iteration: int) -> None:
    """The last step of a save: point ``latest`` at the new iteration (atomic replace)."""
    write_text_atomic(save_dir / LATEST_FILE, f"{iteration}\n")


# ----------------------------------------------------------------------------------------------- loading


def read_latest(load_dir: str | Path) -> int | None:
    """The iteration the pointer file names; None when the folder holds no checkpoint yet."""
    load_dir = Path(load_dir)
    if not load_dir.exists():
        raise CheckpointError(f"checkpoint folder {load_dir} does not exist")
    if not load_dir.is_dir():
        raise CheckpointError(f"checkpoint path {load_dir} is not a folder")
    p = load_dir / LATEST_FILE
    if not p.exists():
        return None
    text = p.read_text().strip()
    try:
        it = int(text)
    except ValueError:
        raise CheckpointError(f"{p}: corrupt pointer file, expected an iteration number, got {text[:40]!r}") from None
    if it < 0:
        raise CheckpointError(f"{p}: negative iteration {it}")
    return it


def read_metadata(ckpt: Path) -> dict[str, Any]:
    p = ckpt / METADATA_FILE
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint {ckpt} is missing (the pointer names it but the folder is gone)")
    if not p.exists():
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: no {METADATA_FILE}")
    try:
        meta = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: {METADATA_FILE} is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{p}: not a megatron-spindle checkpoint (format={meta.get('format')!r})"
                              if isinstance(meta, dict) else f"{p}: not a megatron-spindle checkpoint")
    if meta.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{p}: checkpoint version {meta.get('version')} is not supported "
                              f"(expected {CHECKPOINT_VERSION})")
    for key in ("iteration", "units"):
        if key not in meta:
            raise CheckpointError(f"{p}: corrupt metadata, no '{key}'")
    return meta


def _load_unit_file(ckpt: Path, unit: str, meta: dict[str, Any]) -> UnitState:
    p = ckpt / meta["file"]
    if not p.exists():
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: file {meta['file']} of unit '{unit}' is missing")
    data = p.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != meta["sha256"]:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: file {meta['file']} of unit '{unit}' fails its "
                              f"checksum ({len(data)} bytes, expected {meta.get('bytes')}; truncated or modified)")
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: cannot read {meta['file']}: {e}") from None
    state = UnitState(payload.get("model", {}), payload.get("optim", {}))
    for name, tm in meta["tensors"].items():
        if name not in state.model or list(state.model[name].shape) != tm["shape"]:
            raise CheckpointError(f"checkpoint {ckpt} is corrupt: tensor '{name}' in {meta['file']} does not match "
                                  f"its metadata")
    # one name per tensor whichever layer spec wrote it (checkpointing/names.py): a Transformer Engine run's fused
    # pre-norm names, had it saved them, read as the local spec's
    return UnitState(from_te_names(state.model), from_te_names(state.optim))


def _shape(x) -> tuple[int, ...]:
    return tuple(int(v) for v in x)


def check_shapes(ckpt: Path, manifest: dict[str, Any], expected: dict[str, dict[str, tuple[int, ...]]]) -> None:
    """Every expected unit and tensor is in the checkpoint with the same shape; nothing unexpected is."""
    for unit, tensors in sorted(expected.items()):
        if unit not in manifest:
            held = sorted(manifest)
            raise CheckpointError(f"checkpoint {ckpt} has no parameter unit '{unit}' (it holds {len(held)} units: "
                                  f"{held[:6]}{' ...' if len(held) > 6 else ''}); was it made for another workload?")
        have = manifest[unit]["tensors"]
        for name, shape in sorted(tensors.items()):
            if name not in have:
                raise CheckpointError(f"checkpoint {ckpt}: tensor '{name}' of unit '{unit}' is missing from the "
                                      f"checkpoint (it has {sorted(have)[:6]})")
            if _shape(have[name]["shape"]) != _shape(shape):
                raise CheckpointError(f"checkpoint {ckpt}: tensor '{name}' has shape {_shape(have[name]['shape'])} "
                                      f"in the checkpoint but the model expects {_shape(shape)}")
        extra = sorted(set(have) - set(tensors))
        if extra:
            raise CheckpointError(f"checkpoint {ckpt}: unit '{unit}' has tensor(s) {extra[:6]} the model does not")


def load_checkpoint(load_dir: str | Path, *, units: list[str] | None = None,
                    expected: dict[str, dict[str, tuple[int, ...]]] | None = None, rank: int = 0,
                    iteration: int | None = None, workload_digest: str | None = None) -> LoadedCheckpoint | None:
    """Read the checkpoint ``latest`` names (or ``iteration``); None when ``load_dir`` holds none yet. A
    ``load_dir`` that is an iteration folder itself (it holds metadata.json) is read as it is.

    ``units``: the units to read (default: all); ``expected``: ``{unit: {tensor: shape}}`` of the model being
    loaded into, checked against the metadata before any file is read (names and both shapes in the error).
    A different ``workload_digest`` is only a warning: names and shapes decide whether the weights fit.
    """
    load_dir = Path(load_dir)
    if (load_dir / METADATA_FILE).is_file():  # an iteration folder itself: exactly that checkpoint
        ckpt = load_dir
        meta = read_metadata(ckpt)
        iteration = int(meta["iteration"]) if iteration is None else iteration
    else:
        if iteration is None:
            iteration = read_latest(load_dir)
            if iteration is None:
                return None
        ckpt = iteration_dir(load_dir, iteration)
        meta = read_metadata(ckpt)
    if int(meta["iteration"]) != iteration:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: its metadata says iteration {meta['iteration']}")
    notes = []
    if workload_digest and meta.get("workload_digest") and meta["workload_digest"] != workload_digest:
        notes.append(f"checkpoint {ckpt} was made for workload '{meta.get('workload_name')}' "
                     f"({meta['workload_digest']}), loading it into workload digest {workload_digest}")
        warnings.warn(notes[-1], stacklevel=2)
    manifest = meta["units"]
    if expected is not None:  # names in the local spec's spelling, as the loaded states have them
        check_shapes(ckpt, {u: {**m, "tensors": from_te_names(m["tensors"])} for u, m in manifest.items()},
                     expected)
    wanted = sorted(manifest) if units is None else list(units)
    out: dict[str, UnitState] = {}
    for unit in wanted:
        if unit not in manifest:
            raise CheckpointError(f"checkpoint {ckpt} has no parameter unit '{unit}'")
        out[unit] = _load_unit_file(ckpt, unit, manifest[unit])
    rng = _load_rng(ckpt, rank, meta)
    plan = None
    if (ckpt / PLAN_FILE).exists():
        try:
            plan = json.loads((ckpt / PLAN_FILE).read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"checkpoint {ckpt} is corrupt: {PLAN_FILE} is not valid JSON ({e})") from None
    return LoadedCheckpoint(ckpt, iteration, out, rng, meta.get("data_position", {}), plan, meta, notes)


def _load_rng(ckpt: Path, rank: int, meta: dict[str, Any]) -> dict[str, Any] | None:
    for r in (rank, 0):
        p = ckpt / "rng" / f"rank_{r:05d}.pt"
        if p.exists():
            data = p.read_bytes()
            want = recorded_checksum(meta, f"rng/{p.name}")
            if want is not None and hashlib.sha256(data).hexdigest() != want:
                raise CheckpointError(f"checkpoint {ckpt} is corrupt: rng/{p.name} fails its checksum "
                                      f"(truncated or modified)")
            try:
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as e:
                raise CheckpointError(f"checkpoint {ckpt} is corrupt: cannot read {p.name}: {e}") from None
    return None


def unit_owners(param_groups: list[tuple[list[int], list[str]]]) -> dict[str, int]:
    """Which rank writes each unit: the lowest device of the (largest) device group holding it.

    ``param_groups``: ``[(devices, unit names), ...]`` as in ``Plan.param_groups``. A unit held by several groups
    (it should not be, but be safe) goes to the lowest rank among them, so every unit has exactly one writer.
    """
    owners: dict[str, int] = {}
    for devices, params in param_groups:
        if not devices:
            continue
        r = min(devices)
        for p in params:
            owners[p] = min(owners.get(p, r), r)
    return owners
