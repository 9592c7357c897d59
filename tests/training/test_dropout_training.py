"""--hidden-dropout / --attention-dropout in a run: the masks are drawn per iteration, so a resumed run draws what
the straight run drew and ends with its weights; a saved plan made with other dropout, or other gradient-sync
flags, is refused. One process, in this process."""

import os
import sys

import torch
from checkpoint_params import checkpoint_params
from script_loader import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import pretrain_multitask  # noqa: E402

COMMON = ["--workload", "tiny-vlm", "--mock-data", "--mock-data-samples", "16", "--seed", "5", "--lr", "1e-3",
          "--lr-decay-iters", "4", "--spindle-planner", "wavefront", "--log-interval", "1"]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def test_resumed_run_draws_the_straight_runs_masks(tmp_path, one_thread):
    straight, plain, resumed = [], [], []
    assert pretrain_multitask.main(COMMON + DROPOUT + ["--train-iters", "4", "--save", str(tmp_path / "a")],
                                   history=straight) == 0
    assert pretrain_multitask.main(COMMON + ["--train-iters", "4"], history=plain) == 0
    assert all(s.losses != p.losses for s, p in zip(straight, plain))
    run = str(tmp_path / "b")
    assert pretrain_multitask.main(COMMON + DROPOUT + ["--train-iters", "2", "--save", run]) == 0
    assert pretrain_multitask.main(COMMON + DROPOUT + ["--train-iters", "4", "--load", run, "--save", run],
                                   history=resumed) == 0
    assert [r.losses for r in resumed] == [s.losses for s in straight[2:]]
    _, a = checkpoint_params(tmp_path / "a")
    _, b = checkpoint_params(run)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_saved_plan_with_other_dropout_is_refused(tmp_path, capsys):
    plan_tool = load_script("tools/plan.py")
    out = tmp_path / "plan.json"
    assert plan_tool.main(["--workload", "tiny-vlm", "--num-gpus", "1", "--spindle-planner", "wavefront",
                           "--hidden-dropout", "0.1", "--out", str(out), "--quiet"]) == 0
    try:
        pretrain_multitask.main(COMMON + ["--train-iters", "1", "--spindle-plan", str(out)])
    except SystemExit as e:
        assert e.code == 2
    err = capsys.readouterr().err
    assert f"--spindle-plan {out} was made with --hidden-dropout 0.1, this run gives 0: give --hidden-dropout 0.1" \
           in err and "Traceback" not in err, err
    assert pretrain_multitask.main(COMMON + ["--train-iters", "1", "--spindle-plan", str(out),
                                             "--hidden-dropout", "0.1"]) == 0


def test_saved_plan_with_other_gradient_sync_flags_is_refused(tmp_path, capsys):
    """The runtime cuts, issues and types its gradient buckets as the plan says (--ddp-bucket-size,
    --overlap-grad-reduce, --grad-reduce-in-bf16 are the planner's flags): a run that gives others is one line,
    exit 2; unset, the bucket size is the plan's. The plan's bf16 gradients train."""
    plan_tool = load_script("tools/plan.py")
    out = tmp_path / "plan.json"
    assert plan_tool.main(["--workload", "tiny-vlm", "--num-gpus", "1", "--spindle-planner", "wavefront",
                           "--ddp-bucket-size", "4096", "--no-overlap-grad-reduce", "--grad-reduce-in-bf16",
                           "--out", str(out), "--quiet"]) == 0
    for given, words in ((["--no-overlap-grad-reduce", "--ddp-bucket-size", "8192", "--grad-reduce-in-bf16"],
                          "was made with --ddp-bucket-size 4096, this run gives --ddp-bucket-size 8192"),
                         (["--grad-reduce-in-bf16"],
                          "was made with --no-overlap-grad-reduce, this run gives --overlap-grad-reduce"),
                         (["--no-overlap-grad-reduce"],
                          "was made with --grad-reduce-in-bf16, this run gives gradients reduced in fp32")):
        try:
            pretrain_multitask.main(COMMON + ["--train-iters", "1", "--spindle-plan", str(out), *given])
        except SystemExit as e:
            assert e.code == 2
        err = capsys.readouterr().err
        assert f"--spindle-plan {out} {words}: give the plan's" in err and "Traceback" not in err, err
    assert pretrain_multitask.main(COMMON + ["--train-iters", "1", "--spindle-plan", str(out),
                                             "--no-overlap-grad-reduce", "--grad-reduce-in-bf16"]) == 0
