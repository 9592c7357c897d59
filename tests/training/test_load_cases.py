"""--load as users point it: a checkpoint root, one iteration folder, --save itself before and after its first
checkpoint. The user's existing checkpoints stay byte for byte as they were. (An empty folder and a root without
its pointer are errors: tests/test_bad_inputs.py, which also checks nothing on disk changed.)"""

import sys
from pathlib import Path

import pytest
import torch

from megatron_spindle.checkpointing import iteration_dir, load_checkpoint, read_latest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import pretrain_multitask  # noqa: E402

COMMON = ["--workload", "tiny-clip", "--mock-data", "--mock-data-samples", "8", "--spindle-planner", "wavefront",
          "--gpu-type", "A800-80GB", "--log-interval", "1", "--lr-decay-iters", "10"]


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for s in load_checkpoint(folder).units.values() for k, v in s.model.items()}


def test_load_root_iteration_folder_and_save_itself(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert pretrain_multitask.main(COMMON + ["--train-iters", "2", "--save", str(ckpt), "--save-interval", "1"]) == 0
    users = _files(ckpt)
    capsys.readouterr()

    # a root: its latest checkpoint
    assert pretrain_multitask.main(COMMON + ["--train-iters", "3", "--load", str(ckpt), "--save",
                                             str(tmp_path / "a")]) == 0
    assert f"loaded checkpoint {iteration_dir(ckpt, 2)} at iteration 2" in capsys.readouterr().out
    assert read_latest(tmp_path / "a") == 3 and _files(ckpt) == users

    # one iteration folder: exactly that one (not the latest); one more iteration reproduces the original's next
    assert pretrain_multitask.main(COMMON + ["--train-iters", "2", "--load", str(iteration_dir(ckpt, 1)), "--save",
                                             str(tmp_path / "b")]) == 0
    assert f"loaded checkpoint {iteration_dir(ckpt, 1)} at iteration 1" in capsys.readouterr().out
    a, b = _weights(iteration_dir(ckpt, 2)), _weights(tmp_path / "b")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    assert _files(ckpt) == users

    # --load equal to --save before its first checkpoint: from scratch, with a notice; an error with
    # --exit-on-missing-checkpoint, before anything is written
    fresh = tmp_path / "fresh"
    with pytest.raises(SystemExit):
        pretrain_multitask.main(COMMON + ["--train-iters", "1", "--load", str(fresh), "--save", str(fresh),
                                          "--exit-on-missing-checkpoint"])
    assert f"--load {fresh} holds no checkpoint" in capsys.readouterr().err
    assert not fresh.exists() or not list(fresh.iterdir())
    assert pretrain_multitask.main(COMMON + ["--train-iters", "1", "--load", str(fresh), "--save", str(fresh)]) == 0
    assert f"no checkpoint in {fresh} yet: training from scratch" in capsys.readouterr().out
    assert read_latest(fresh) == 1

    # ... and after it: resumes, adding to the folder, never rewriting what is there
    assert pretrain_multitask.main(COMMON + ["--train-iters", "3", "--load", str(ckpt), "--save", str(ckpt)]) == 0
    assert read_latest(ckpt) == 3
    after = _files(ckpt)
    assert {k: v for k, v in after.items() if k in users and not k.startswith(("latest", "plan."))} == \
        {k: v for k, v in users.items() if not k.startswith(("latest", "plan."))}
    assert not any(k.startswith(".") for k in after)  # no lock file or temporaries left behind
