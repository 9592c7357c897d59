"""End to end: the CPU launch script (2 gloo processes under torchrun, distributed optimizer on) trains and
saves; resuming its checkpoint in 1 process under another plan without the distributed optimizer matches a
straight run; TensorBoard, Gantt and logs are there.

One multi-process launch (the script) and two single-process runs in this process.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from checkpoint_params import checkpoint_params

from megatron_spindle.checkpointing import iteration_dir, load_checkpoint, read_latest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import pretrain_multitask  # noqa: E402

# The same training settings for every run (the script's own flags are overridden by these, "$@" comes last).
# --gpu-type A800-80GB: on 2 ranks the planner then gives every slice one device (tp = dp = 1), placed across
# the two ranks, so the 2-rank plan sums every gradient in the same order as the 1-rank plan and the runs can
# be compared at 1e-6. Plans with dp > 1 (the script's own --gpu-type CPU) reorder the fp32 gradient sums, and
# AdamW's first steps amplify that rounding to ~1e-5 whether or not a checkpoint is involved.
COMMON = ["--workload", "tiny-clip", "--mock-data", "--mock-data-samples", "24", "--seed", "7", "--lr", "2e-3",
          "--min-lr", "2e-4", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--lr-decay-iters", "6",
          "--weight-decay", "0.01", "--spindle-planner", "wavefront", "--gpu-type", "A800-80GB",
          "--log-interval", "1"]



@pytest.mark.multiproc
def test_launch_script_then_resume_on_one_rank_under_another_plan(tmp_path, capsys, one_thread):
    first = tmp_path / "first"
    env = dict(os.environ, CHECKPOINT_PATH=str(first), TENSORBOARD_LOGS_PATH=str(tmp_path / "tb"),
               PYTHON=sys.executable, OMP_NUM_THREADS="1")
    r = subprocess.run(["bash", os.path.join(ROOT, "examples", "train_tiny_clip_cpu.sh"), *COMMON,
                        "--train-iters", "3", "--save-interval", "100", "--spindle-distributed-optimizer", "on"],
                       capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert re.search(r" iteration\s+3/\s+3 \| consumed samples:\s+72 \|", out), out[-2000:]
    assert "vision_text loss:" in out and "measured wave time (ms): w0=" in out
    assert "predicted iteration time (ms):" in out and "plan for workload 'tiny-clip' on 2 devices" in out
    assert read_latest(first) == 3 and (first / "plan.png").stat().st_size > 0
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
    meta = load_checkpoint(first).metadata
    assert meta["world_size"] == 2 and meta["data_position"]["iteration"] == 3
    first_plan = load_checkpoint(first).plan  # sharded optimizer state (units held by both ranks), full checkpoint
    assert first_plan["settings"]["zero_stage"] == 1 and any(len(g["devices"]) > 1 for g in first_plan["param_groups"])
    assert {m["rank"] for m in meta["units"].values()} == {0, 1}  # both ranks wrote the units they own

    # 6 iterations straight, one process
    straight = tmp_path / "straight"
    assert pretrain_multitask.main(COMMON + ["--train-iters", "6", "--save", str(straight)]) == 0
    # resume the 2-rank checkpoint on 1 rank (another plan: 1 device) for 3 more
    resumed = tmp_path / "resumed"
    hist = []
    assert pretrain_multitask.main(COMMON + ["--train-iters", "6", "--load", str(first), "--save", str(resumed)],
                                   history=hist) == 0
    log = capsys.readouterr().out
    assert "loaded checkpoint" in log and "at iteration 3 (saved by 2 rank(s), now 1)" in log
    assert [h.iteration for h in hist] == [4, 5, 6]
    ck_a, a = checkpoint_params(straight)
    ck_b, b = checkpoint_params(resumed)
    assert sorted(a) == sorted(b) and len(a) > 20
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= 1e-6, worst
    _, f = checkpoint_params(first)
    moved = max(float((a[k] - f[k]).abs().max()) for k in a)
    assert moved > 0  # training really changed the weights after iteration 3
    for u, s in ck_a.units.items():  # AdamW state too
        for k, st in s.optim.items():
            assert torch.allclose(st["exp_avg"], ck_b.units[u].optim[k]["exp_avg"], atol=1e-6)
            assert st["step"] == ck_b.units[u].optim[k]["step"] == 6
    assert ck_a.data_position == ck_b.data_position
    assert (iteration_dir(resumed, 6) / "plan.json").exists()
    assert ck_a.plan["cluster"]["num_nodes"] * ck_a.plan["cluster"]["gpus_per_node"] == 1
    assert load_checkpoint(first).plan["cluster"]["gpus_per_node"] == 2  # the first half ran another plan
    assert ck_a.plan["settings"]["zero_stage"] == ck_b.plan["settings"]["zero_stage"] == 0

    # a corrupt or mismatched checkpoint stops the run with the reason, and leaves the folder as it was
    unit_file = next((iteration_dir(resumed, 6) / "units").glob("vision.layers.0.pt"))
    unit_file.write_bytes(unit_file.read_bytes()[:100])
    with pytest.raises(SystemExit) as e:
        pretrain_multitask.main(COMMON + ["--train-iters", "7", "--load", str(resumed), "--save", str(resumed)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "units/vision.layers.0.pt of unit 'vision.layers.0' fails its checksum" in err, err[-2000:]
    assert read_latest(resumed) == 6 and not (resumed / "iter_0000007").exists()
    meta_path = iteration_dir(straight, 6) / "metadata.json"
    meta = json.loads(meta_path.read_text())
    name = next(iter(meta["units"]["vision.layers.0"]["tensors"]))
    meta["units"]["vision.layers.0"]["tensors"][name]["shape"] = [7, 7]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(SystemExit):
        pretrain_multitask.main(COMMON + ["--train-iters", "7", "--load", str(straight)])
    assert f"tensor '{name}' has shape (7, 7) in the checkpoint but the model expects" in capsys.readouterr().err
