"""What --load names (root, iteration folder, nothing), what --save may be written with, checksums of every file,
stale temporary folders, and the --save lock."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron_spindle.checkpointing import (
    CheckpointError,
    UnitState,
    iteration_dir,
    load_checkpoint,
    read_latest,
    save_checkpoint,
)
from megatron_spindle.checkpointing.integrity import remove_stale_saves, verify, verify_report
from megatron_spindle.checkpointing.load_target import check_complete, check_save_target, resolve_load
from megatron_spindle.checkpointing.lock import LOCK_FILE, SaveFolderLock, SaveFolderLocked


def _units(with_optim=True):
    w = torch.arange(6.0).reshape(2, 3)
    optim = {"u.w": {"exp_avg": w * 0, "exp_avg_sq": w * 0, "step": 1.0}} if with_optim else {}
    return {"u": UnitState({"u.w": w}, optim)}


def _save(root, it, with_optim=True):
    return save_checkpoint(root, it, _units(with_optim), data_position={"iteration": it}, plan={"p": 1})


def test_resolve_root_iteration_folder_and_auto_resume(tmp_path):
    root = tmp_path / "ckpt"
    _save(root, 1)
    _save(root, 2)
    t = resolve_load(root, tmp_path / "other")
    assert (t.folder, t.iteration, t.root) == (iteration_dir(root, 2), 2, root)
    t = resolve_load(iteration_dir(root, 1))  # exactly that iteration, not the latest
    assert (t.folder, t.iteration) == (iteration_dir(root, 1), 1)
    assert load_checkpoint(iteration_dir(root, 1)).iteration == 1
    for fresh in (tmp_path / "new", tmp_path / "empty"):  # --load == --save before the first save
        if fresh.name == "empty":
            fresh.mkdir()
        t = resolve_load(fresh, fresh)
        assert t.folder is None and "no checkpoint in" in t.notice and "training from scratch" in t.notice
    (tmp_path / "tmponly" / "iter_0000005.tmp").mkdir(parents=True)  # an interrupted first save
    assert resolve_load(tmp_path / "tmponly", tmp_path / "tmponly").folder is None


def test_resolve_errors_name_what_was_looked_for(tmp_path):
    root = tmp_path / "ckpt"
    _save(root, 3)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoint: no latest_checkpointed_iteration.txt, no "
                                              "metadata.json"):
        resolve_load(tmp_path / "empty", tmp_path / "save")
    with pytest.raises(CheckpointError, match="no such folder"):
        resolve_load(tmp_path / "missing", tmp_path / "save")
    (root / "latest_checkpointed_iteration.txt").unlink()
    for save in (root, tmp_path / "save"):  # even as its own --save: folders but no pointer is never "empty"
        with pytest.raises(CheckpointError, match=r"has no latest_checkpointed_iteration.txt but holds iteration "
                                                  r"folder\(s\) iter_0000003: give --load .*iter_0000003"):
            resolve_load(root, save)
    (root / "latest_checkpointed_iteration.txt").write_text("9\n")
    with pytest.raises(CheckpointError, match="the pointer names it but the folder is gone"):
        resolve_load(root)


def test_save_target_and_complete_checkpoints(tmp_path):
    root = tmp_path / "ckpt"
    _save(root, 4)
    with pytest.raises(CheckpointError, match="already holds checkpoints up to iteration 4 .* starts from scratch"):
        check_save_target(root, 0, loaded_from_save=False)
    check_save_target(root, 0, loaded_from_save=True)  # resumed from its own pointer
    check_save_target(root, 4, loaded_from_save=False)  # nothing later than the start
    check_save_target(tmp_path / "new", 0, loaded_from_save=False)
    ck = load_checkpoint(root)
    check_complete(ck, load_rng=True, load_optim=True)
    ck.rng = None
    with pytest.raises(CheckpointError, match="has no RNG state .* --no-load-rng"):
        check_complete(ck, load_rng=True, load_optim=True)
    check_complete(ck, load_rng=False, load_optim=True)
    _save(tmp_path / "noopt", 4, with_optim=False)
    ck = load_checkpoint(tmp_path / "noopt")
    with pytest.raises(CheckpointError, match="no optimizer state for 1 unit.*--no-load-optim"):
        check_complete(ck, load_rng=True, load_optim=True)
    check_complete(ck, load_rng=True, load_optim=False)
    _save(tmp_path / "init", 0, with_optim=False)  # iteration 0 (converted weights): nothing to miss
    check_complete(load_checkpoint(tmp_path / "init"), load_rng=True, load_optim=True)


def test_every_file_has_a_checksum_and_verify_finds_each_problem(tmp_path):
    folder = _save(tmp_path, 2)
    meta = json.loads((folder / "metadata.json").read_text())
    assert sorted(meta["files"]) == ["plan.json", "rng/rank_00000.pt", "units/u.pt"]
    ok, line = verify_report(verify(tmp_path))
    assert ok and "all 3 file(s) match" in line
    (folder / "rng" / "rank_00000.pt").write_bytes(b"changed")
    (folder / "plan.json").unlink()
    (folder / "stray.txt").write_text("?")
    ok, line = verify_report(verify(folder))
    assert not ok and "(3 problem(s))" in line
    assert "plan.json: missing" in line and "rng/rank_00000.pt: checksum mismatch" in line
    assert "stray.txt: not part of the checkpoint" in line
    with pytest.raises(CheckpointError, match="rng/rank_00000.pt fails its checksum"):
        load_checkpoint(tmp_path)


def test_stale_temporaries_are_removed_at_the_start_of_every_save(tmp_path):
    _save(tmp_path, 1)
    for name in ("iter_0000007.tmp", "iter_0000001.old"):
        (tmp_path / name / "units").mkdir(parents=True)
    (tmp_path / ".plan.json.abc123.tmp").write_text("half")
    (tmp_path / "notes.tmp").write_text("the user's")  # not ours: kept
    _save(tmp_path, 2)  # another iteration than the stale one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "iter_0000002",
                                                          "latest_checkpointed_iteration.txt", "notes.tmp"]
    assert remove_stale_saves(tmp_path) == [] and read_latest(tmp_path) == 2


def test_lock_names_the_holder_and_dies_with_it(tmp_path):
    save = tmp_path / "a" / "save"
    with SaveFolderLock(save):
        holder = json.loads((save / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid()
        with pytest.raises(SaveFolderLocked, match=rf"--save {save} is in use by another job \(host .*, pid "
                                                   rf"{os.getpid()}, started "):
            SaveFolderLock(save).acquire()
    assert not (tmp_path / "a").exists()  # nothing was written: the folders it made are gone again
    save.mkdir(parents=True)
    code = (f"import sys, time; sys.path.insert(0, {os.getcwd()!r}); from megatron_spindle.checkpointing.lock "
            f"import SaveFolderLock; SaveFolderLock({str(save)!r}).acquire(); print('held', flush=True); "
            f"time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(SaveFolderLocked, match=f"pid {p.pid}"):
            SaveFolderLock(save).acquire()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    deadline = time.monotonic() + 10
    lock = SaveFolderLock(save)
    lock.acquire()  # the kernel released the dead holder's lock; its stale file is taken over
    assert json.loads((save / LOCK_FILE).read_text())["pid"] == os.getpid() and time.monotonic() < deadline
    lock.release()
    assert list(save.iterdir()) == []
