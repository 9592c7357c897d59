"""--freeze in a run (Megatron-LM's --freeze-ViT / --freeze-LM): LLaVA's first stage from a checkpoint of the
whole model, then the whole model trained again. One process, in this process."""

import os
import re
import sys
import warnings

import pytest
import torch

from megatron_spindle.checkpointing import load_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import pretrain_multitask  # noqa: E402

COMMON = ["--workload", "tiny-vlm", "--mock-data", "--mock-data-samples", "16", "--seed", "3", "--lr", "1e-3",
          "--weight-decay", "0.1", "--spindle-planner", "wavefront", "--log-interval", "1"]
FROZEN = ("vision.", "llm.")


def test_freeze_from_a_checkpoint_then_thaw(tmp_path, capsys, one_thread):
    run = str(tmp_path / "run")
    assert pretrain_multitask.main(COMMON + ["--train-iters", "2", "--save", run]) == 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert pretrain_multitask.main(COMMON + ["--train-iters", "4", "--load", run, "--save", run,
                                                 "--freeze", "vision", "llm", "--log-num-zeros-in-grad"]) == 0
    assert not [w for w in caught if "was made for workload" in str(w.message)]  # the same model
    out = capsys.readouterr().out
    assert "frozen modules: vision, llm (no gradients" in out
    zeros = [float(z) for z in re.findall(r"\| num zeros: ([0-9.]+) \|", out)]
    assert len(zeros) == 2 and all(z > 0 for z in zeros)  # Megatron-LM's field, after the grad norm
    two, four = load_checkpoint(run, iteration=2), load_checkpoint(run, iteration=4)
    assert sorted(two.units) == sorted(four.units)
    for unit, state in four.units.items():
        same = all(torch.equal(v, two.units[unit].model[k]) for k, v in state.model.items())
        if unit.startswith(FROZEN):
            assert same and not state.optim, unit  # as loaded, and nothing for AdamW
        else:
            assert not same and all(o["step"] == 4 for o in state.optim.values()), unit
    synced = {u for g in four.plan["param_groups"] for u in g["params"]}
    assert synced and not [u for u in synced if u.startswith(FROZEN)]
    from tools.checkpoint import inspect_checkpoint

    assert inspect_checkpoint.main([run, "--summary"]) == 0
    listed = capsys.readouterr().out
    assert "  vision.layers.0  [frozen]  (" in listed and "  vis_proj.projector  [+optimizer state]  (" in listed

    # thawed: the frozen units train again from their weights, AdamW starting afresh for them
    assert pretrain_multitask.main(COMMON + ["--train-iters", "5", "--load", run, "--save", run]) == 0
    five = load_checkpoint(run, iteration=5)
    for unit, state in five.units.items():
        assert not all(torch.equal(v, four.units[unit].model[k]) for k, v in state.model.items()), unit
        assert {o["step"] for o in state.optim.values()} == ({1} if unit.startswith(FROZEN) else {5}), unit


def test_pretrained_checkpoint_starts_a_fine_tuning_run_until_it_has_its_own(tmp_path, capsys, one_thread):
    """Megatron-LM's --pretrained-checkpoint: while --load holds no checkpoint, the run starts from the pretrained
    weights as --finetune does (iteration 0, no optimizer state); once it saved, it resumes its own."""
    pre, ft = str(tmp_path / "pre"), str(tmp_path / "ft")
    assert pretrain_multitask.main(COMMON + ["--train-iters", "2", "--save", pre]) == 0
    stage = COMMON + ["--load", ft, "--save", ft, "--pretrained-checkpoint", pre, "--freeze", "vision", "llm"]
    assert pretrain_multitask.main(stage + ["--train-iters", "3"]) == 0
    out = capsys.readouterr().out
    assert f"--load {ft} holds no checkpoint yet: fine-tuning from --pretrained-checkpoint {pre}" in out
    assert "--finetune: weights only, starting at iteration 0" in out
    two, three = load_checkpoint(pre, iteration=2), load_checkpoint(ft, iteration=3)
    for unit, state in three.units.items():
        same = all(torch.equal(v, two.units[unit].model[k]) for k, v in state.model.items())
        assert same == unit.startswith(FROZEN), unit  # the pretrained weights, frozen ones unchanged
        assert {o["step"] for o in state.optim.values()} == (set() if unit.startswith(FROZEN) else {3}), unit
    assert pretrain_multitask.main(stage + ["--train-iters", "4"]) == 0
    assert f"loaded checkpoint {ft}/iter_0000003 at iteration 3" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        pretrain_multitask.main(COMMON + ["--train-iters", "1", "--pretrained-checkpoint", str(tmp_path / "none")])
    assert e.value.code == 2
    assert f"--pretrained-checkpoint {tmp_path / 'none'}: no such folder" in capsys.readouterr().err


@pytest.mark.multiproc
def test_two_ranks_save_each_frozen_unit_once(tmp_path, one_thread):
    """On 2 gloo processes (the CPU launch script), a frozen unit held by both ranks is written by one of them (the
    lowest holder), and a frozen tower placed on one rank by that rank."""
    import subprocess

    run = tmp_path / "run"
    env = dict(os.environ, CHECKPOINT_PATH=str(run), PYTHON=sys.executable, OMP_NUM_THREADS="1")
    r = subprocess.run(["bash", os.path.join(ROOT, "examples", "train_tiny_clip_cpu.sh"), *COMMON, "--train-iters",
                        "2", "--freeze", "vision", "llm"], capture_output=True, text=True, timeout=400, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ck = load_checkpoint(str(run))
    frozen = sorted(u for u in ck.units if u.startswith(FROZEN))
    assert frozen and ck.metadata["extra"]["frozen_units"] == frozen
    assert ck.metadata["world_size"] == 2 and all(not ck.units[u].optim for u in frozen)
    from megatron_spindle.graph.opgraph import build_metagraph
    from megatron_spindle.graph.workload import load_workload
    from megatron_spindle.plan.layout import weight_holders
    from megatron_spindle.plan.schema import Plan

    metaops = build_metagraph(load_workload("tiny-vlm").frozen(["vision", "llm"])).metaops
    holders = weight_holders(Plan.from_dict(ck.plan), metaops)
    assert {u: ck.metadata["units"][u]["rank"] for u in frozen} == {u: holders[u][0] for u in frozen}
    assert len({ck.metadata["units"][u]["rank"] for u in ck.units}) == 2  # both ranks wrote units
