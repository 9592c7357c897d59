"""Dynamic task sets (issue 15, paper App. D): --task-schedule in-process equals stopping and resuming with the new
--tasks (growing, shrinking, a set coming back), both equal a single-process reference that switches its task set,
data positions are kept per task, a 2-rank schedule resumes on 1 rank with another set, unknown task names.

The equality runs share one schedule on tiny-clip (world size 1, in this process):
    iterations 0-1 {text_audio, vision_text}; 2-3 all four (grows: the depth tower is new);
    4-5 {vision_depth, audio_depth} (shrinks: the text tower is set aside); 6-7 {text_audio, vision_text} again
    (the text tower and both tasks' data positions come back; the plan comes from the cache).
"""

import contextlib
import io
import os
import re
import subprocess
import sys

import pytest
import torch
from checkpoint_params import checkpoint_params

from megatron_spindle.checkpointing import load_checkpoint
from megatron_spindle.data.datasets import MockTaskDataset, collate
from megatron_spindle.data.sampler import MultiTaskSampler, epoch_permutation
from megatron_spindle.graph.task_sets import select_tasks
from megatron_spindle.graph.workload import WorkloadError, load_workload
from megatron_spindle.training.schedule import LRSchedule
from megatron_spindle.training.task_schedule import parse_task_schedule

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import pretrain_multitask  # noqa: E402

SEED, SAMPLES, ITERS = 7, 24, 8
LR = dict(lr=2e-3, min_lr=2e-4, warmup_iters=2, decay_iters=6, style="cosine")
# --gpu-type A800-80GB: on 2 ranks every slice gets one device (tp = dp = 1), so the 2-rank run sums gradients
# in the order the 1-rank run does and the two can be compared at 1e-6 (see test_train_resume.py).
# --clip-grad 0: clipping to 1 shrinks the new depth tower's gradients into AdamW's eps regime, where fp32
# summation-order noise moves weights by ~4e-5 against the reference (clipping is tested in tests/runtime).
COMMON = ["--workload", "tiny-clip", "--mock-data", "--mock-data-samples", str(SAMPLES), "--seed", str(SEED),
          "--lr", "2e-3", "--min-lr", "2e-4", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
          "--lr-decay-iters", "6", "--weight-decay", "0.01", "--spindle-planner", "wavefront",
          "--gpu-type", "A800-80GB", "--log-interval", "1", "--num-workers", "0", "--clip-grad", "0"]
ALL = "text_audio,vision_depth,vision_text,audio_depth"
PHASES = [(0, "text_audio,vision_text"), (2, ALL), (4, "vision_depth,audio_depth"), (6, "text_audio,vision_text")]
SCHEDULE = ["--tasks", PHASES[0][1], "--task-schedule", ";".join(f"{k}:{t}" for k, t in PHASES[1:])]



def _worst(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory):
    """The in-process --task-schedule run (8 iterations, world size 1): (checkpoint folder, its log)."""
    save = tmp_path_factory.mktemp("scheduled")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the launch script's ranks run one thread: the same reduction order
    try:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert pretrain_multitask.main(COMMON + SCHEDULE + ["--train-iters", str(ITERS), "--save", str(save)]) == 0
    finally:
        torch.set_num_threads(threads)
    return save, out.getvalue()


def test_schedule_and_task_names():
    w = load_workload("tiny-clip")
    s = parse_task_schedule("2:" + ALL + "; 4:audio_depth,vision_depth;5:vision_depth,audio_depth;6:vision_text",
                            w, "vision_text,text_audio")
    assert s.initial == ("text_audio", "vision_text")  # a set: the workload's order
    assert [k for k, _ in s.changes] == [2, 4, 6]  # 5 repeats the set in force: no change
    assert [s.tasks_at(i) for i in (0, 1, 2, 3, 4, 5, 6, 99)] == [s.initial] * 2 + [tuple(ALL.split(","))] * 2 + \
        [("vision_depth", "audio_depth")] * 2 + [("vision_text",)] * 2
    assert s.boundaries(0, 8) == [2, 4, 6] and s.boundaries(4, 6) == [] and s.boundaries(3, 7) == [4, 6]
    assert parse_task_schedule("0:vision_text;3:text_audio", w, None).initial == ("vision_text",)
    for text, match in (("2:vision_text;2:text_audio", "iterations must increase"), ("x:vision_text", "not an integer"),
                        ("3", "is not ITER:TASK"), ("3:", "no task named"), ("0:vision_text", "name the first task"),
                        ("3:vision_text,vision_text", "named twice"), ("-1:vision_text", "negative")):
        with pytest.raises(ValueError, match=match):
            parse_task_schedule(text, w, "text_audio")
    with pytest.raises(WorkloadError) as e:
        select_tasks(w, ["vision_text", "nope"])
    assert str(e.value) == ("--tasks: unknown task 'nope' (workload 'tiny-clip' has tasks: text_audio, vision_depth, "
                            "vision_text, audio_depth)")


def test_unknown_task_name_is_one_clear_error(capsys):
    for argv, where in ((["--tasks", "vision_text,nope"], "--tasks"),
                        (["--task-schedule", "3:vision_text,nope"], "--task-schedule (at iteration 3)")):
        with pytest.raises(SystemExit) as e:
            pretrain_multitask.main(COMMON + argv + ["--train-iters", "4"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"pretrain_multitask.py: error: {where}: unknown task 'nope' (workload 'tiny-clip' has tasks: " \
               "text_audio, vision_depth, vision_text, audio_depth)" in err, err
        assert "Traceback" not in err


def test_sampler_keeps_positions_per_task():
    sizes, batches = {"a": 10, "b": 6, "c": 8}, {"a": 4, "b": 3, "c": 2}
    one = MultiTaskSampler({t: sizes[t] for t in "ab"}, {t: batches[t] for t in "ab"}, seed=3)
    for _ in range(3):
        one.next()
    with pytest.raises(ValueError, match="saved data position is for tasks"):
        MultiTaskSampler({"c": 8}, {"c": 2}, seed=3).load_state_dict(one.state_dict())
    two = MultiTaskSampler({t: sizes[t] for t in "bc"}, {t: batches[t] for t in "bc"}, seed=3)  # a leaves, c joins
    two.load_state_dict(one.state_dict(), tasks_may_change=True)
    assert (two.iteration, two.epoch["b"], two.offset["b"]) == (3, 1, 3) and (two.epoch["c"], two.offset["c"]) == (0, 0)
    two.next()
    state = two.state_dict()
    assert state["dropped_tasks"]["a"]["epoch"] == 1 and state["dropped_tasks"]["a"]["offset"] == 2
    three = MultiTaskSampler({"c": 8}, {"c": 2}, seed=3)  # b leaves too; a stays dropped through this save
    three.load_state_dict(state, tasks_may_change=True)
    back = MultiTaskSampler(sizes, batches, seed=3)  # everyone back, where each left off
    back.load_state_dict(three.state_dict(), tasks_may_change=True)
    assert {t: (back.epoch[t], back.offset[t]) for t in sizes} == {"a": (1, 2), "b": (2, 0), "c": (0, 2)}
    assert "dropped_tasks" not in back.state_dict()
    a = back.next().indices["a"]  # a continues its epoch-1 permutation at offset 2
    assert a == epoch_permutation(10, 3, "a", 1)[2:6].tolist()


def test_schedule_equals_stop_and_resume_and_a_reference(scheduled, tmp_path):
    save, log = scheduled
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        chain = tmp_path / "chain"  # stop at every change, resume with the new --tasks
        ends = [k for k, _ in PHASES[1:]] + [ITERS]
        for (_, tasks), end in zip(PHASES, ends):
            assert pretrain_multitask.main(COMMON + ["--tasks", tasks, "--train-iters", str(end), "--save", str(chain),
                                                     "--load", str(chain)]) == 0
        again = tmp_path / "again"  # resuming with the same set keeps the units set aside too
        assert pretrain_multitask.main(COMMON + SCHEDULE + ["--train-iters", str(ITERS + 1), "--load", str(save),
                                                            "--save", str(again)]) == 0
    finally:
        torch.set_num_threads(threads)
    ck_a, a = checkpoint_params(save)
    ck_b, b = checkpoint_params(chain)
    assert len(ck_a.units) == 18  # the whole tiny-clip model: the depth tower is set aside, not lost
    assert sorted(load_checkpoint(again).units) == sorted(ck_a.units)
    assert _worst(a, b) <= 1e-6, _worst(a, b)  # growing, shrinking and coming back
    for u, s in ck_a.units.items():
        assert sorted(s.optim) == sorted(ck_b.units[u].optim)
        for k, st in s.optim.items():
            assert st["step"] == ck_b.units[u].optim[k]["step"]
            assert torch.allclose(st["exp_avg_sq"], ck_b.units[u].optim[k]["exp_avg_sq"], rtol=0, atol=1e-9)
    # AdamW steps per unit: the text tower trains in iterations 0-3 and 6-7, depth in 2-5, vision and audio in all
    step = {u: next(iter(s.optim.values()))["step"] for u, s in ck_a.units.items()}
    assert step["text.layers.0"] == 6 and step["depth.layers.0"] == 4 and step["vision.layers.0"] == 8
    assert step["audio.layers.0"] == 8
    assert ck_a.data_position == ck_b.data_position
    pos = ck_a.data_position  # per task: samples taken = batch * iterations it trained
    assert pos["tasks"]["text_audio"] == {"epoch": 2, "offset": 0, "size": 24, "batch_size": 8}  # 6 iterations x 8
    assert pos["tasks"]["vision_text"] == {"epoch": 1, "offset": 0, "size": 24, "batch_size": 4}  # 6 x 4
    assert pos["dropped_tasks"]["vision_depth"]["offset"] == 16 and pos["dropped_tasks"]["audio_depth"]["epoch"] == 1
    assert ck_a.metadata["extra"]["task_set"]["tasks"] == ["text_audio", "vision_text"]
    assert ck_a.metadata["extra"]["consumed_train_samples"] == ck_b.metadata["extra"]["consumed_train_samples"] == \
        2 * 12 + 2 * 24 + 2 * 12 + 2 * 12
    # the in-process run's log block, plan files and plan cache
    assert "task set change at iteration 2: [text_audio, vision_text] -> [text_audio, vision_depth, vision_text, " \
           "audio_depth]" in log
    assert "added tasks:       vision_depth, audio_depth" in log
    assert "initialised units: depth.frontend, depth.head, depth.layers.0, depth.layers.1 (fresh" in log
    assert "dropped tasks:     text_audio, vision_text" in log and "units set aside:   text.frontend, text.head" in log
    assert "units restored:    text.frontend, text.head, text.layers.0, text.layers.1" in log
    assert re.search(r"planning: 0\.000 s \(cached plan of this set\) \| rebuild: [0-9.]+ s", log)
    assert log.count("[plan] done in") == 3  # three distinct sets planned, the fourth phase reuses the first
    for k in (2, 4, 6):
        assert (save / f"plan_iter_{k:07d}.json").stat().st_size and (save / f"plan_iter_{k:07d}.png").stat().st_size
    ref = _reference()
    # 1e-5, not the 1e-6 between runs: the runtime spares biases and norms AdamW's decay by scaling them up just
    # before its step (runtime/optimizer.py), which rounds them by an ulp per step where torch's parameter groups
    # do not touch them; Adam's division by each element's magnitude carries that to ~3e-6 over the 8 steps
    assert _worst(a, ref) <= 1e-5, _worst(a, ref)


def _reference() -> dict[str, torch.Tensor]:
    """A single-process reference of the schedule written from the semantics alone: the whole model, one
    AdamW over every parameter (a parameter no task of the set uses gets no gradient, so AdamW leaves it and
    its state alone), each task reading its own sample stream (epoch permutations in a row), which advances
    only while the task trains."""
    from megatron_spindle.models.config import ModelConfig
    from megatron_spindle.models.reference import ReferenceModel

    base = load_workload("tiny-clip")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = ReferenceModel(base, ModelConfig(init_seed=SEED))  # --seed seeds the initial weights too
        params = model.full_named_parameters()
        plain = [p for k, p in params.items() if k.endswith(".bias") or p.dim() == 1]  # no decay: Megatron-LM's rule
        decayed = [p for k, p in params.items() if not (k.endswith(".bias") or p.dim() == 1)]
        opt = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.01}, {"params": plain, "weight_decay": 0.0}],
                                lr=LR["lr"], betas=(0.9, 0.999), eps=1e-8)
        lr = LRSchedule(**LR)
        data = {t.name: MockTaskDataset(base, t.name, SAMPLES, SEED) for t in base.tasks}
        taken = {t.name: 0 for t in base.tasks}
        for it in range(ITERS):
            tasks = [ts for k, ts in PHASES if k <= it][-1].split(",")
            for g in opt.param_groups:
                g["lr"] = lr(it)
            opt.zero_grad(set_to_none=True)
            batches = {}
            for t in tasks:
                n = base.task(t).batch_size
                idx = [int(epoch_permutation(SAMPLES, SEED, t, i // SAMPLES)[i % SAMPLES])
                       for i in range(taken[t], taken[t] + n)]
                taken[t] += n
                batches[t] = collate(base, t, [data[t][i] for i in idx])
            losses = model(batches)
            sum(base.task(t).loss.weight * losses[t] for t in tasks).backward()
            opt.step()
        return model.export_full_state()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.multiproc
def test_two_rank_schedule_then_resume_on_one_rank_with_another_set(scheduled, tmp_path, capsys):
    """2 gloo ranks (the launch script, distributed optimizer on) run the schedule to iteration 4, moving units
    between ranks in memory at the change at 2; one rank resumes at 4, where the set changes (and the world
    size), and continues the same schedule: the result equals the 1-rank schedule run."""
    first = tmp_path / "two_ranks"
    env = dict(os.environ, CHECKPOINT_PATH=str(first), TENSORBOARD_LOGS_PATH=str(tmp_path / "tb"),
               PYTHON=sys.executable, OMP_NUM_THREADS="1")
    r = subprocess.run(["bash", os.path.join(ROOT, "examples", "train_tiny_clip_cpu.sh"), *COMMON, *SCHEDULE,
                        "--train-iters", "4", "--save-interval", "100", "--spindle-distributed-optimizer", "on"],
                       capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    moved = re.search(r"rebuild: [0-9.]+ s \(engine and process groups; (\d+) unit\(s\) moved between ranks\)", r.stdout)
    assert moved and int(moved.group(1)) > 0, r.stdout[-3000:]
    assert (first / "plan_iter_0000002.json").exists()
    meta = load_checkpoint(first).metadata
    assert meta["world_size"] == 2 and meta["extra"]["task_set"]["tasks"] == ALL.split(",")
    resumed = tmp_path / "resumed"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert pretrain_multitask.main(COMMON + SCHEDULE + ["--train-iters", str(ITERS), "--load", str(first),
                                                            "--save", str(resumed)]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "at iteration 4 (saved by 2 rank(s), now 1)" in out
    assert "task set change at resume (checkpoint iteration 4): [text_audio, vision_depth, vision_text, audio_depth]" \
           " -> [vision_depth, audio_depth]" in out
    ck_s, s = checkpoint_params(scheduled[0])
    ck_r, r_ = checkpoint_params(resumed)
    assert _worst(s, r_) <= 1e-6, _worst(s, r_)
    assert ck_s.data_position == ck_r.data_position
