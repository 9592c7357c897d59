"""Megatron-LM's flags on pretrain_multitask.py, each by its effect (one process, in this process).

- validation: the losses printed every --eval-interval equal the single-process reference's on the same unseen
  validation batches with the checkpointed weights, and validating leaves training bit for bit unchanged;
- --log-throughput, --timing-log-level 2, --log-memory-to-tensorboard, grad norm and loss scale: in the log line,
  the timer block and TensorBoard; wandb (a stand-in module) gets the same scalars;
- --manual-gc: the automatic garbage collector is off while training and every rank collects at the start,
  every --manual-gc-interval iterations and around validation (unless --no-manual-gc-eval);
- --no-save-optim saves no optimizer state, --finetune restarts from the weights alone at iteration 0,
  --global-batch-size scales the task batches, --use-distributed-optimizer shards the optimizer;
- refused at start with one line: --micro-batch-size, --fp16 on CPU, wandb not importable, a --gpus-per-node that
  torchrun contradicts.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import re
import sys
import types

import pytest
import torch

from megatron_spindle.checkpointing import load_checkpoint
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.training.batch_size import apply_batch_size_args
from megatron_spindle.training.multinode import resolve_node_layout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import pretrain_multitask  # noqa: E402

COMMON = ["--workload", "tiny-clip", "--mock-data", "--mock-data-samples", "16", "--seed", "3", "--lr", "2e-3",
          "--spindle-planner", "wavefront", "--train-iters", "2", "--log-interval", "1", "--num-workers", "0"]
EVAL = ["--eval-interval", "1", "--eval-iters", "2"]


class FakeWandb(types.ModuleType):
    """What pretrain_multitask.py uses of wandb: init(**kw) -> run with log(dict, step=) and finish()."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kw):
        self.inits.append(kw)
        return self

    def log(self, data, step=None):
        self.logged.append((step, dict(data)))

    def finish(self):
        self.finished += 1


def _weights(path):
    ck = load_checkpoint(path)
    return ck, {k: v for s in ck.units.values() for k, v in s.model.items()}


def _validation_losses(out: str, iteration: int) -> dict[str, float]:
    line = next(s for s in out.splitlines() if s.startswith(f" validation loss at iteration {iteration} |"))
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"(\w+) loss value: (\S+) \|", line)}


def test_validation_logging_and_checkpoint_flags(tmp_path, capsys, monkeypatch, one_thread):
    from megatron_spindle.data.datasets import MockTaskDataset
    from megatron_spindle.models.reference import ReferenceModel
    from megatron_spindle.training.evaluate import DatasetRange, ValidationBatches

    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert pretrain_multitask.main(COMMON + EVAL + [
        "--save", str(a), "--tensorboard-dir", str(tmp_path / "tb"), "--log-throughput", "--timing-log-level", "2",
        "--log-memory-to-tensorboard", "--wandb-project", "proj", "--wandb-exp-name", "run-a", "--wandb-entity", "team",
        "--log-timers-to-tensorboard", "--log-world-size-to-tensorboard", "--tensorboard-queue-size", "5"]) == 0
    out = capsys.readouterr().out
    # the Megatron log line, with throughput, loss scale and grad norm
    line = next(s for s in out.splitlines() if re.search(r" iteration\s+2/\s+2 \|", s))
    assert re.search(r"\| throughput per GPU \(TFLOP/s/GPU\): [\d.]+ \| samples per second: [\d.]+ \|", line), line
    assert re.search(r"\| loss scale: 1\.0 \| grad norm: [\d.]+ \| number of skipped iterations:\s+0 \| "
                     r"number of nan iterations:\s+0 \|$", line), line
    samples_per_s = float(re.search(r"samples per second: ([\d.]+)", line).group(1))
    ms = float(re.search(r"elapsed time per iteration \(ms\): ([\d.]+)", line).group(1))
    assert samples_per_s == pytest.approx(24 / (ms / 1e3), rel=0.02)  # 24 samples per iteration
    assert "(min, max) time across ranks (ms):" in out and "    forward-backward ....." in out
    assert "measured wave time forward/backward (ms): w0=" in out
    # validation after every iteration, equal to the reference with the saved weights on the unseen batches (the
    # trainer decodes them on its --num-workers threads, 2 by default; the reference's batches on none)
    w = load_workload("tiny-clip")
    ref = ReferenceModel(w)
    _, weights = _weights(a)
    ref.load_full_state(weights)
    batches = ValidationBatches({t.name: DatasetRange(MockTaskDataset(w, t.name, 32, 3), 16, 32) for t in w.tasks})
    with torch.no_grad():
        passes = [ref({t.name: batches.batch_fn(w, t.name, k) for t in w.tasks}) for k in range(2)]
    printed = _validation_losses(out, 2)
    for t in w.tasks:
        want = sum(float(p[t.name]) for p in passes) / 2
        assert printed[t.name] == pytest.approx(want, rel=1e-5), (t.name, printed[t.name], want)
    assert printed["total"] == pytest.approx(sum(printed[t.name] for t in w.tasks), rel=1e-6)
    assert _validation_losses(out, 1)
    # TensorBoard and wandb get the scalars
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(glob.glob(str(tmp_path / "tb" / "*"))[0])
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert {"throughput", "samples-per-second", "grad-norm", "loss-scale", "mem-rss-bytes", "total loss validation",
            "task loss validation/vision_text", "timers (ms)/forward-backward",
            "wave-time (ms)/busiest rank", "world-size"} <= tags, tags
    assert [e.value for e in ea.Scalars("world-size")] == [1.0, 1.0]
    assert wandb.inits[0]["project"] == "proj" and wandb.inits[0]["name"] == "run-a"
    assert wandb.inits[0]["entity"] == "team"
    assert wandb.inits[0]["dir"] == str(a / "wandb") and wandb.finished == 1
    logged = {k for _, d in wandb.logged for k in d}
    assert {"throughput", "grad-norm", "total loss validation", "task loss/vision_text"} <= logged

    # validating changed nothing in training; --no-save-optim keeps the weights and drops AdamW's state
    assert pretrain_multitask.main(COMMON + ["--save", str(b), "--no-save-optim", "--no-save-rng"]) == 0
    ck_a, wa = _weights(a)
    ck_b, wb = _weights(b)
    assert sorted(wa) == sorted(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert all(st.optim for st in ck_a.units.values()) and not any(st.optim for st in ck_b.units.values())
    assert ck_a.rng is not None and ck_b.rng is None  # --no-save-rng: resuming needs --no-load-rng
    _fails(capsys, COMMON + ["--train-iters", "3", "--load", str(b), "--no-load-optim"],
           "has no RNG state (rng/rank_*.pt): give --no-load-rng")
    assert "validation loss" not in capsys.readouterr().out

    # --finetune: the weights of b, AdamW from scratch, iteration 0; with a doubled global batch, sharded AdamW
    assert pretrain_multitask.main(COMMON + ["--train-iters", "1", "--load", str(b), "--save", str(c), "--finetune",
                                             "--global-batch-size", "48", "--use-distributed-optimizer",
                                             "--tensorboard-dir", str(tmp_path / "tb_c"), "--timing-log-level", "1",
                                             "--no-log-loss-scale-to-tensorboard"]) == 0
    out = capsys.readouterr().out
    ea = EventAccumulator(glob.glob(str(tmp_path / "tb_c" / "*"))[0])
    ea.Reload()
    tags = set(ea.Tags()["scalars"])  # timers printed, but written only with --log-timers-to-tensorboard
    assert "grad-norm" in tags and not {"loss-scale", "world-size"} & tags and not any("timers" in t for t in tags)
    assert "(min, max) time across ranks (ms):" in out
    assert "--finetune: weights only, starting at iteration 0" in out
    assert re.search(r" iteration\s+1/\s+1 \| consumed samples:\s+48 \|.*\| global batch size:\s+48 \|", out)
    ck_c = load_checkpoint(c)
    assert ck_c.iteration == 1 and ck_c.data_position["iteration"] == 1
    assert {st["step"] for s in ck_c.units.values() for st in s.optim.values()} == {1.0}
    assert ck_c.plan["settings"]["zero_stage"] == 1
    assert {m["task"]: m["input_shape"][0] for m in ck_c.plan["metaops"]} == {  # planned for the new batches
        "text_audio": 16, "vision_depth": 8, "vision_text": 8, "audio_depth": 16}


def _test_losses(out: str, iteration: int) -> dict[str, float]:
    line = next(s for s in out.splitlines() if s.startswith(f" validation loss at iteration {iteration} on test set |"))
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"(\w+) loss value: (\S+) \|", line)}


def test_test_share_after_the_last_iteration_and_skip_train(tmp_path, capsys, one_thread):
    """--split's test share is evaluated once after the last iteration (Megatron-LM's test set), equal to the
    reference with the saved weights; --skip-train --load evaluates the validation and test shares of the saved
    model, with the same losses, and writes nothing (--save ignored, no TensorBoard)."""
    from megatron_spindle.data.datasets import MockTaskDataset
    from megatron_spindle.models.reference import ReferenceModel
    from megatron_spindle.training.evaluate import DatasetRange, ValidationBatches

    a, b, tb = tmp_path / "a", tmp_path / "b", tmp_path / "tb"
    split = ["--split", "2,1,1", "--eval-iters", "2"]  # 16 mock samples: train 0-7, validate 8-11, test 12-15
    assert pretrain_multitask.main(COMMON + split + ["--eval-interval", "2", "--save", str(a)]) == 0
    out = capsys.readouterr().out
    assert out.index(" validation loss at iteration 2 |") < out.index(" validation loss at iteration 2 on test set |")
    tested, validated = _test_losses(out, 2), _validation_losses(out, 2)
    w = load_workload("tiny-clip")
    ref = ReferenceModel(w)
    ref.load_full_state(_weights(a)[1])
    batches = ValidationBatches({t.name: DatasetRange(MockTaskDataset(w, t.name, 16, 3), 12, 16) for t in w.tasks})
    with torch.no_grad():
        passes = [ref({t.name: batches.batch_fn(w, t.name, k) for t in w.tasks}) for k in range(2)]
    for t in w.tasks:
        want = sum(float(p[t.name]) for p in passes) / 2
        assert tested[t.name] == pytest.approx(want, rel=1e-5), (t.name, tested[t.name], want)
    assert all(tested[t.name] != pytest.approx(validated[t.name], rel=1e-5) for t in w.tasks)  # other samples
    # --skip-train: no --eval-interval needed, the shares of the same split; nothing written
    assert pretrain_multitask.main(COMMON + split + ["--skip-train", "--load", str(a), "--save", str(b),
                                                     "--tensorboard-dir", str(tb)]) == 0
    out = capsys.readouterr().out
    assert "skipping training (--skip-train): evaluating the checkpoint of iteration 2; nothing is saved" in out
    assert not re.search(r" iteration\s+\d+/", out)  # no training step logged
    assert all(f"evaluating the {s} set: pass {k}/2" in out for s in ("validation", "test") for k in (1, 2))
    for t, v in _validation_losses(out, 2).items():
        assert v == pytest.approx(validated[t], rel=1e-6), t
    for t, v in _test_losses(out, 2).items():
        assert v == pytest.approx(tested[t], rel=1e-6), t
    assert not b.exists() and not tb.exists()
    # a validation share without --eval-interval validates every 1000 iterations (Megatron-LM's default) and after
    # the last one
    assert pretrain_multitask.main(COMMON + ["--split", "2,1", "--eval-iters", "1"]) == 0
    out = capsys.readouterr().out
    assert " validation loss at iteration 2 |" in out and " validation loss at iteration 1 |" not in out
    assert "on test set" not in out  # no test share


def test_seed_and_init_method_std_set_the_initial_weights(tmp_path, capsys, one_thread):
    """--seed and --init-method-std give the initial weights (a step at a negligible LR keeps them); a Megatron-LM
    script's --use-mcore-models and zero dropouts are taken."""
    from megatron_spindle.models.config import ModelConfig
    from megatron_spindle.models.reference import ReferenceModel

    w = load_workload("tiny-clip")
    assert pretrain_multitask.main(COMMON + ["--train-iters", "1", "--lr", "1e-12", "--init-method-std", "0.05",
                                             "--use-mcore-models", "--attention-dropout", "0",
                                             "--hidden-dropout", "0.0", "--save", str(tmp_path / "a"),
                                             "--log-params-norm"]) == 0
    _, saved = _weights(tmp_path / "a")
    want = ReferenceModel(w, ModelConfig(init_std=0.05, init_seed=3)).export_full_state()
    assert sorted(saved) == sorted(want)
    assert max(float((saved[k] - want[k]).abs().max()) for k in want) <= 1e-9
    norm = float(re.search(r"\| grad norm: \S+ \| params norm: (\S+) \|", capsys.readouterr().out).group(1))
    assert norm == pytest.approx(math.sqrt(sum(float(v.double().square().sum()) for v in want.values())), abs=1e-3)
    other = ReferenceModel(w, ModelConfig(init_std=0.05, init_seed=0)).export_full_state()
    assert max(float((saved[k] - other[k]).abs().max()) for k in want) > 0.01  # the seed made them


def test_a_nan_loss_stops_the_run_before_its_optimizer_step(tmp_path, capsys, one_thread):
    """An LR that blows the weights up makes iteration 2's losses NaN: the run stops there with one line, and the
    checkpoint of iteration 1 stays the latest; --no-check-for-nan-in-loss-and-grad trains on and counts them."""
    from megatron_spindle.checkpointing import read_latest

    save = tmp_path / "ckpt"
    blowup = COMMON + ["--train-iters", "3", "--lr", "1e30", "--weight-decay", "0"]  # lr x decay >= 1 is refused
    err = _fails(capsys, blowup + ["--save", str(save), "--save-interval", "1"],
                 "iteration 2: the loss of task(s) audio_depth, text_audio, vision_depth, vision_text and the gradient "
                 "norm (nan) are not finite; stopped before the optimizer step, the weights are those of iteration 1")
    assert err.count("\n") == 1 and read_latest(save) == 1
    assert pretrain_multitask.main(blowup + ["--no-check-for-nan-in-loss-and-grad"]) == 0
    assert re.search(r" iteration\s+3/\s+3 \|.*total loss: NAN \|.*number of nan iterations:\s+1 \|",
                     capsys.readouterr().out)


def test_weight_decay_schedule_drives_the_optimizer(tmp_path, one_thread):
    """--start/--end-weight-decay with an increment style set AdamW's decay each iteration: a schedule from 0.5 to
    0.5 gives --weight-decay 0.5's weights exactly, one from 0 to 1 other weights."""
    runs = {"flat": ["--weight-decay", "0.5"],
            "same": ["--weight-decay-incr-style", "linear", "--start-weight-decay", "0.5", "--end-weight-decay", "0.5"],
            "rise": ["--weight-decay-incr-style", "cosine", "--start-weight-decay", "0", "--end-weight-decay", "1"]}
    weights = {}
    for name, flags in runs.items():
        assert pretrain_multitask.main(COMMON + flags + ["--save", str(tmp_path / name)]) == 0
        weights[name] = _weights(tmp_path / name)[1]
    assert all(torch.equal(weights["flat"][k], weights["same"][k]) for k in weights["flat"])
    assert max(float((weights["flat"][k] - weights["rise"][k]).abs().max()) for k in weights["flat"]) > 1e-5


def test_validation_perplexity_scalars_of_lm_tasks():
    from megatron_spindle.training.evaluate import ValidationResult

    result = ValidationResult(7, {"caption": 1.5, "clip": 2.0}, {"caption": 1.0, "clip": 0.5}, ("caption",), "test")
    assert result.scalars() == {"total loss test": 2.5, "task loss test/caption": 1.5, "task loss test/clip": 2.0}
    assert result.scalars(ppl=True)["task ppl test/caption"] == pytest.approx(math.exp(1.5))
    assert "task ppl test/clip" not in result.scalars(ppl=True)
    assert " validation loss at iteration 7 on test set | total loss value: 2.500000E+00 |" in result.format()
    assert f"caption loss PPL: {math.exp(1.5):.6E} |" in result.format()


def _fails(capsys, argv, match):
    with pytest.raises(SystemExit) as e:
        pretrain_multitask.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err, err
    return err


def test_flags_refused_at_start(capsys, monkeypatch):
    base = ["--workload", "tiny-clip", "--mock-data", "--train-iters", "2"]
    _fails(capsys, base + ["--micro-batch-size", "4"], "--micro-batch-size 4: Spindle has no per-rank micro batch")
    _fails(capsys, base + ["--global-batch-size", "25"], "scale to whole samples only for multiples of 6")
    if torch.cuda.is_available():
        _fails(capsys, base + ["--fp16", "--bf16"], "not both")
    else:  # megatron-core's loss scaler lives on CUDA
        _fails(capsys, base + ["--fp16"], "--fp16 needs a GPU")
    _fails(capsys, base + ["--clip-grad", "-1"], "--clip-grad must be >= 0")
    _fails(capsys, base + ["--eval-interval", "0"], "--eval-interval must be positive")
    _fails(capsys, base + ["--valid-data-path", "vision_text=/nope"], "--valid-data-path: /nope (task 'vision_text') "
                                                                      "does not exist")
    _fails(capsys, base + ["--split", "0,1"], "--split '0,1'")
    _fails(capsys, base + ["--hidden-dropout", "1"], "--hidden-dropout must be a probability in [0, 1), got 1.0")
    _fails(capsys, base + ["--spindle-micro-batches", "0"], "--spindle-micro-batches must be auto or a positive")
    _fails(capsys, base + ["--init-method-std", "0"], "--init-method-std must be positive")
    _fails(capsys, base + ["--lr", "200", "--weight-decay", "0.01"], "--lr x the weight decay = 2 >= 1")
    _fails(capsys, base + ["--tensorboard-queue-size", "0"], "--tensorboard-queue-size must be positive")
    _fails(capsys, base + ["--test-data-path", "vision_text=/nope", "--eval-iters", "0"],
           "--test-data-path needs --eval-iters > 0")
    _fails(capsys, base + ["--valid-data-path", "vision_text=/nope", "--skip-train", "--eval-iters", "0"],
           "--valid-data-path needs --eval-iters > 0")
    _fails(capsys, base + ["--finetune"], "--finetune needs --load")
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    _fails(capsys, base + ["--wandb-project", "p"], "--wandb-project needs the wandb package")
    _fails(capsys, base + ["--wandb-exp-name", "x"], "need --wandb-project")
    # torchrun says 1 process per node on 2 nodes: --gpus-per-node 2 would plan both ranks as one NVLink island
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    err = _fails(capsys, base + ["--gpus-per-node", "2"], "--gpus-per-node 2 does not match torchrun")
    assert "1 process(es) per node on 2 node(s)" in err and "Give --gpus-per-node 1" in err


class _RecordingGC:
    """The gc module as megatron_spindle/training/manual_gc.py uses it, recording each collection and whether the
    automatic collector was on at that moment."""

    def __init__(self):
        self.enabled, self.collections = True, []

    def isenabled(self):
        return self.enabled

    def disable(self):
        self.enabled = False

    def enable(self):
        self.enabled = True

    def collect(self):
        self.collections.append(self.enabled)
        return 0


def test_manual_gc_collects_at_the_same_points_on_every_rank(capsys, monkeypatch, one_thread):
    from megatron_spindle.training import manual_gc

    for extra, collections in ((["--manual-gc-interval", "1"], 1 + 2 + 2 * 2),  # start, 2 iterations, 2 validations
                               (["--manual-gc-interval", "2", "--no-manual-gc-eval"], 1 + 1),
                               ([], 1 + 2 * 2)):  # --manual-gc-interval 0: around validation only
        fake = _RecordingGC()
        monkeypatch.setattr(manual_gc, "gc", fake)
        assert pretrain_multitask.main(COMMON + EVAL + ["--manual-gc"] + extra) == 0
        assert len(fake.collections) == collections, (extra, fake.collections)
        assert not any(fake.collections)  # the automatic collector is off throughout training ...
        assert fake.enabled  # ... and on again afterwards
    fake = _RecordingGC()
    monkeypatch.setattr(manual_gc, "gc", fake)
    assert pretrain_multitask.main(COMMON + ["--manual-gc-interval", "1"]) == 0  # without --manual-gc: Megatron's
    assert fake.collections == [] and fake.enabled
    capsys.readouterr()
    _fails(capsys, COMMON + ["--manual-gc", "--manual-gc-interval", "-1"], "--manual-gc-interval must be >= 0")


def test_node_layout_and_batch_flags_map():
    args = argparse.Namespace(gpus_per_node=None, cluster=None)
    resolve_node_layout(args, {"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8"})
    assert args.gpus_per_node == 4  # taken from torchrun when left out
    resolve_node_layout(args, {})  # no torchrun: nothing to check
    w = load_workload("tiny-clip")
    same = apply_batch_size_args(w, argparse.Namespace(global_batch_size=None, micro_batch_size=None))
    assert same is w
    half = apply_batch_size_args(w, argparse.Namespace(global_batch_size=12, micro_batch_size=None))
    assert [t.batch_size for t in half.tasks] == [4, 2, 2, 4] and [t.batch_size for t in w.tasks] == [8, 4, 4, 8]
    assert half.digest() != w.digest()
