"""Every entry point on bad input: exit status 2, one line naming the problem (and the value), no traceback, and
every file already on disk unchanged, byte for byte and mode for mode.

The cases run in this process through each entry point's ``main(argv)`` (the same code a shell runs; argparse
and the shared error mechanism raise SystemExit or return the status); a few real subprocesses at the end show
the same from a shell, and that SPINDLE_DEBUG=1 brings the traceback back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from script_loader import load_script  # noqa: E402

import pretrain_multitask  # noqa: E402
from megatron_spindle.checkpointing import UnitState, load_checkpoint, save_checkpoint  # noqa: E402
from megatron_spindle.checkpointing.lock import SaveFolderLock  # noqa: E402
from megatron_spindle.runtime import __main__ as runtime_main  # noqa: E402
from tools.checkpoint import convert, inspect_checkpoint  # noqa: E402

PLAN, DATASET, DEMO, PROFILE, ESTIMATE = (load_script(f"tools/{n}.py") for n in (
    "plan", "build_multitask_dataset", "demo", "profile_metaops", "estimate"))
ENTRY = {"plan": PLAN.main, "pretrain": pretrain_multitask.main, "runtime": runtime_main.main,
         "dataset": DATASET.main, "inspect": inspect_checkpoint.main, "convert": convert.main, "demo": DEMO.main,
         "profile": PROFILE.main, "estimate": ESTIMATE.main}
TRAIN = ["--workload", "tiny-clip", "--mock-data", "--mock-data-samples", "8", "--spindle-planner", "wavefront",
         "--gpu-type", "A800-80GB", "--log-interval", "1", "--train-iters", "3"]
PLANNING = ["--workload", "tiny-clip", "--num-gpus", "2", "--spindle-planner", "wavefront", "--quiet"]

TINY = """
name: tiny
modules:
  a: {kind: encoder, num_layers: 1, hidden_size: 8, num_heads: 2, ffn_hidden_size: 16}
tasks:
  - {name: t, batch_size: 2, tokens: {a: 4}}
"""


@dataclass
class Case:
    entry: str
    argv: list[str]  # "{ws}" stands for the workspace folder
    match: str  # the message must contain this (the problem and, where there is one, the value)
    id: str = ""
    prepare: list = field(default_factory=list)


def _snapshot(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every file and folder under ``root``: mode and content."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_mode, p.read_bytes() if p.is_file() else None)
    return out


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """The user's files: a real checkpoint, variants of it, workloads, clusters, plans, raw data."""
    ws = tmp_path_factory.mktemp("ws")
    assert pretrain_multitask.main(TRAIN[:-1] + ["1", "--save", str(ws / "ckpt")]) == 0
    (ws / "previous_plan.json").write_text("previous plan")
    assert PLAN.main(PLANNING + ["--out", str(ws / "plan2.json")]) == 0
    (ws / "bad.json").write_text("{oops")
    (ws / "list.json").write_text("[1, 2]")
    (ws / "dup.yaml").write_text(TINY.replace("hidden_size: 8,", "hidden_size: 8, hidden_size: 16,"))
    (ws / "notasks.yaml").write_text(TINY.split("tasks:")[0] + "tasks:\n")
    (ws / "notyaml.yaml").write_text("modules: [unclosed\n")
    (ws / "cluster.yaml").write_text("num_nodes: 1\ngpus_per_node: 2\ngpu: A800-80GB\nbandwidth: 3\n")
    (ws / "a_file").write_text("not a folder")
    (ws / "empty").mkdir()
    (ws / "user_folder").mkdir()
    (ws / "user_folder" / "notes.txt").write_text("the user's notes")
    nopointer = ws / "nopointer"
    shutil.copytree(ws / "ckpt", nopointer)
    (nopointer / "latest_checkpointed_iteration.txt").unlink()
    gone = ws / "gone"
    gone.mkdir()
    (gone / "latest_checkpointed_iteration.txt").write_text("7\n")
    norng = ws / "norng"
    shutil.copytree(ws / "ckpt", norng)
    shutil.rmtree(norng / "iter_0000001" / "rng")
    ck = load_checkpoint(ws / "ckpt")
    save_checkpoint(ws / "nooptim", 1, {u: UnitState(s.model, {}) for u, s in ck.units.items()},
                    workload_name=ck.metadata["workload_name"], workload_digest=ck.metadata["workload_digest"],
                    data_position=ck.data_position, plan=ck.plan)
    corrupt = ws / "corrupt"
    shutil.copytree(ws / "ckpt", corrupt)
    unit = next((corrupt / "iter_0000001" / "units").iterdir())
    unit.write_bytes(unit.read_bytes()[:-10] + b"x" * 10)
    mcore = ws / "mcore"
    (mcore / "iter_0000010").mkdir(parents=True)
    (mcore / "iter_0000010" / ".metadata").write_text("torch_dist")
    (mcore / "latest_checkpointed_iteration.txt").write_text("10")
    raw = ws / "raw"
    raw.mkdir()
    (raw / "0001.text.txt").write_text("hello")
    (ws / "dataset").mkdir()
    (ws / "dataset" / "index.json").write_text("{}")
    return ws


CASES = [
    # tools/plan.py: workload, cluster, flags, outputs
    Case("plan", PLANNING + ["--gpus-per-node", "0"], "--gpus-per-node must be positive, got 0"),
    Case("plan", PLANNING[:2] + ["--num-gpus", "0"], "--num-gpus must be positive, got 0"),
    Case("plan", PLANNING + ["--tasks", "vision_text,nope"], "--tasks: unknown task 'nope'"),
    Case("plan", PLANNING + ["--tasks", ","], "--tasks: no task named"),
    Case("plan", PLANNING + ["--out", "{ws}/empty"], "--out {ws}/empty is a folder, not a file"),
    Case("plan", PLANNING + ["--out", "{ws}/previous_plan.json", "--gantt", "{ws}/plan.xyz"],
         "--gantt {ws}/plan.xyz: unsupported file type '.xyz'"),
    Case("plan", PLANNING + ["--out", "{ws}/previous_plan.json", "--gantt", "{ws}/a_file/plan.png"],
         "{ws}/a_file is a file, not a folder"),
    Case("plan", PLANNING + ["--spindle-solver-time-limit", "nan"], "invalid finite float value: 'nan'"),
    Case("plan", PLANNING + ["--spindle-solver-time-limit", "-1"], "solver time limit must be >= 0, got -1.0"),
    Case("plan", PLANNING + ["--spindle-solver-workers", "0"], "solver workers must be >= 1, got 0"),
    Case("plan", PLANNING + ["--spindle-planner", "magic"], "invalid choice: 'magic'"),
    Case("plan", PLANNING + ["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    Case("plan", PLANNING + ["--tensor-model-parallel-size", "2"],
         "--tensor-model-parallel-size is Megatron-LM's, not Spindle's: the planner chooses each slice's"),
    Case("plan", ["--workload", "{ws}/dup.yaml", "--num-gpus", "2"], "duplicate key 'hidden_size'"),
    Case("plan", ["--workload", "{ws}/notasks.yaml", "--num-gpus", "2"], "'tasks' must be a non-empty list"),
    Case("plan", ["--workload", "{ws}/notyaml.yaml", "--num-gpus", "2"], "workload {ws}/notyaml.yaml:"),
    Case("plan", ["--workload", "{ws}/empty", "--num-gpus", "2"], "workload {ws}/empty: cannot read it"),
    Case("plan", ["--workload", "no-such-workload", "--num-gpus", "2"], "no built-in workload of that name"),
    Case("plan", ["--workload", "tiny-clip", "--cluster", "{ws}/cluster.yaml"], "unknown field(s) ['bandwidth']"),
    Case("plan", ["--workload", "tiny-clip", "--cluster", "{ws}/dup.yaml", "--num-gpus", "2"], "not both"),
    Case("plan", ["--workload", "tiny-clip"], "give --num-gpus N"),
    Case("plan", PLANNING + ["--spindle-profile", "{ws}/nope.json"], "--spindle-profile {ws}/nope.json: no such file"),
    # python -m megatron_spindle.runtime: plan, workload, flags
    Case("runtime", ["--plan", "{ws}/nope.json", "--workload", "tiny-clip"], "--plan {ws}/nope.json: no such file"),
    Case("runtime", ["--plan", "{ws}/bad.json", "--workload", "tiny-clip"], "{ws}/bad.json: not valid JSON"),
    Case("runtime", ["--plan", "{ws}/list.json", "--workload", "tiny-clip"], "not a megatron-spindle plan"),
    Case("runtime", ["--plan", "{ws}/plan2.json", "--workload", "tiny-vlm"], "plan was made for workload 'tiny-clip'"),
    Case("runtime", ["--plan", "{ws}/plan2.json", "--workload", "tiny-clip", "--steps", "-1"],
         "--steps must be >= 0, got -1"),
    Case("runtime", ["--plan", "{ws}/plan2.json", "--workload", "tiny-clip", "--lr", "inf"],
         "invalid finite float value: 'inf'"),
    # pretrain_multitask.py: --load, --save, checkpoints, flags
    Case("pretrain", TRAIN + ["--load", "{ws}/empty", "--save", "{ws}/ckpt"], "--load {ws}/empty holds no checkpoint"),
    Case("pretrain", TRAIN + ["--load", "{ws}/nopointer", "--save", "{ws}/nopointer"],
         "has no latest_checkpointed_iteration.txt but holds iteration folder(s) iter_0000001"),
    Case("pretrain", TRAIN + ["--load", "{ws}/gone"], "the pointer names it but the folder is gone"),
    Case("pretrain", TRAIN + ["--load", "{ws}/a_file"], "--load {ws}/a_file is a file"),
    Case("pretrain", TRAIN + ["--load", "{ws}/mcore"], "is a megatron-core checkpoint"),
    Case("pretrain", TRAIN + ["--load", "{ws}/norng", "--save", "{ws}/norng"], "has no RNG state"),
    Case("pretrain", TRAIN + ["--load", "{ws}/nooptim"], "has no optimizer state for"),
    Case("pretrain", TRAIN + ["--load", "{ws}/corrupt", "--save", "{ws}/corrupt"], "fails its checksum"),
    Case("pretrain", TRAIN + ["--save", "{ws}/ckpt"], "--save {ws}/ckpt already holds checkpoints up to iteration 1"),
    Case("pretrain", TRAIN + ["--load", "{ws}/ckpt", "--save", "{ws}/ckpt"], "is in use by another job (host",
         prepare=["lock ckpt"]),
    Case("pretrain", TRAIN + ["--save", "{ws}/a_file"], "--save {ws}/a_file is a file, not a folder"),
    Case("pretrain", TRAIN + ["--exit-interval", "0"], "--exit-interval must be positive, got 0"),
    Case("pretrain", TRAIN + ["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be positive"),
    Case("pretrain", TRAIN + ["--plan-gantt", "{ws}/plan.gif"], "--plan-gantt {ws}/plan.gif: unsupported file type"),
    Case("pretrain", TRAIN + ["--weight-decay", "nan"], "invalid finite float value: 'nan'"),
    Case("pretrain", TRAIN + ["--tasks", "nope"], "--tasks: unknown task 'nope'"),
    Case("pretrain", TRAIN + ["--task-schedule", "2:nope"], "unknown task 'nope'"),
    Case("pretrain", TRAIN + ["--spindle-plan", "{ws}/bad.json"], "not valid JSON"),
    Case("pretrain", TRAIN + ["--workload", "{ws}/dup.yaml"], "duplicate key 'hidden_size'"),
    # pretrain_multitask.py: the Megatron flags' refusals (issue 17) through the same mechanism
    Case("pretrain", TRAIN + ["--micro-batch-size", "4"], "--micro-batch-size 4: Spindle has no per-rank micro batch"),
    Case("pretrain", TRAIN + ["--global-batch-size", "25"], "--global-batch-size 25:"),
    Case("pretrain", TRAIN + ["--fp16", "--bf16"], "not both") if torch.cuda.is_available() else
    Case("pretrain", TRAIN + ["--fp16"], "--fp16 needs a GPU"),  # megatron-core's loss scaler lives on CUDA
    Case("pretrain", TRAIN + ["--clip-grad", "nan"], "invalid finite float value: 'nan'"),
    Case("pretrain", TRAIN + ["--clip-grad", "-1"], "--clip-grad must be >= 0"),
    Case("pretrain", TRAIN + ["--eval-interval", "0"], "--eval-interval must be positive"),
    Case("pretrain", TRAIN + ["--finetune"], "--finetune needs --load"),
    Case("pretrain", TRAIN + ["--load", "{ws}/ckpt", "--save", "{ws}/ckpt", "--finetune"],
         "--save {ws}/ckpt already holds checkpoints up to iteration 1"),  # a fine-tune restarts at iteration 0
    Case("pretrain", TRAIN + ["--wandb-project", "p"], "--wandb-project needs the wandb package",
         prepare=["no wandb"]),
    Case("pretrain", TRAIN + ["--gpus-per-node", "2"], "--gpus-per-node 2 does not match torchrun",
         prepare=["torchrun 2 nodes x 1"]),
    # tools/build_multitask_dataset.py, tools/checkpoint/*, tools/demo.py, tools/profile_metaops.py
    Case("dataset", ["--input", "{ws}/nope", "--output", "{ws}/out"], "input {ws}/nope does not exist"),
    Case("dataset", ["--input", "{ws}/raw", "--output", "{ws}/dataset"], "output {ws}/dataset already exists"),
    Case("dataset", ["--input", "{ws}/raw", "--output", "{ws}/out", "--workload", "tiny-clip", "--task", "nope"],
         "has no task 'nope'"),
    Case("inspect", ["{ws}/empty"], "not a megatron-spindle, megatron-core or Hugging Face checkpoint"),
    Case("inspect", ["{ws}/corrupt", "--verify"], "fails verification (1 problem(s)): units/"),
    Case("convert", ["--loader", "nope", "--saver", "spindle", "--workload", "tiny-clip", "--save-dir", "{ws}/out"],
         "no loader plugin named 'nope'"),
    Case("demo", ["--out", "{ws}/user_folder"], "--out {ws}/user_folder is a folder the demo did not make"),
    Case("profile", ["--workload", "tiny-clip", "--out", "{ws}/empty"], "--out {ws}/empty is a folder, not a file"),
    Case("estimate", ["layer", "--hidden-size", "0", "--num-attention-heads", "2", "--ffn-hidden-size", "8",
                      "--seq-length", "4", "--micro-batch-size", "1"], "argument --hidden-size: must be positive, got 0"),
    Case("estimate", ["collective", "--op", "all_reduce", "--bytes", "12X", "--num-gpus", "2"],
         "'12X' is not a byte count"),
]


def _call(entry: str, argv: list[str]) -> int:
    try:
        rc = ENTRY[entry](argv)
    except SystemExit as e:
        rc = e.code
    return 0 if rc is None else rc if isinstance(rc, int) else 1


def _fill(items: list[str], ws: Path) -> list[str]:
    return [a.replace("{ws}", str(ws)) for a in items]


def test_there_are_enough_cases_for_every_entry_point():
    assert len(CASES) >= 30
    assert {c.entry for c in CASES} == set(ENTRY)


@pytest.mark.parametrize("case", CASES, ids=[f"{c.entry}-{i}" for i, c in enumerate(CASES)])
def test_bad_input(case: Case, ws: Path, capsys, monkeypatch):
    monkeypatch.delenv("SPINDLE_DEBUG", raising=False)
    holder = None
    if "lock ckpt" in case.prepare:
        holder = SaveFolderLock(ws / "ckpt")
        holder.acquire()  # another job (here: another open file) holds the folder
    if "no wandb" in case.prepare:
        monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    if "torchrun 2 nodes x 1" in case.prepare:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
    before = _snapshot(ws)
    capsys.readouterr()
    try:
        rc = _call(case.entry, _fill(case.argv, ws))
    finally:
        if holder is not None:
            holder.release()
            assert not (ws / "ckpt" / ".spindle.lock").exists()
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err[-2000:]
    assert case.match.replace("{ws}", str(ws)) in errors[0], err[-2000:]
    assert "Traceback" not in err
    after = _snapshot(ws) if holder is None else {k: v for k, v in _snapshot(ws).items() if k != "ckpt/.spindle.lock"}
    if holder is not None:
        before = {k: v for k, v in before.items() if k != "ckpt/.spindle.lock"}
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, changed


def _shell(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_real_processes(ws: Path):
    """From a shell: the exit status, the one line and no traceback; SPINDLE_DEBUG=1 shows the traceback."""
    before = _snapshot(ws)
    r = _shell(str(ROOT / "tools" / "plan.py"), *PLANNING, "--gpus-per-node", "0", "--out", str(ws / "p.json"))
    assert r.returncode == 2 and r.stderr.strip() == "plan.py: error: --gpus-per-node must be positive, got 0", r.stderr
    r = _shell("-m", "megatron_spindle.runtime", "--plan", str(ws / "nope.json"), "--workload", "tiny-clip")
    assert r.returncode == 2 and r.stderr.strip() == (f"python -m megatron_spindle.runtime: error: --plan "
                                                      f"{ws / 'nope.json'}: no such file"), r.stderr
    r = _shell(str(ROOT / "tools" / "profile_metaops.py"), "--workload", "nope")  # before megatron-core's warnings
    assert r.returncode == 2 and r.stderr.strip() == ("profile_metaops.py: error: workload 'nope': no such file and "
                                                      "no built-in workload of that name"), r.stderr
    r = _shell(str(ROOT / "pretrain_multitask.py"), *TRAIN, "--load", str(ws / "empty"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"pretrain_multitask.py: error: --load {ws / 'empty'} holds no checkpoint" in r.stderr
    r = _shell(str(ROOT / "tools" / "plan.py"), "--workload", str(ws / "dup.yaml"), "--num-gpus", "2",
               env={"SPINDLE_DEBUG": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr and "duplicate key 'hidden_size'" in r.stderr
    assert _snapshot(ws) == before


def test_outputs_get_the_usual_permissions(ws: Path, tmp_path):
    """Plan files and checkpoint files: 0666 / 0777 less the umask, not mkstemp's 0600."""
    mask = os.umask(0o022)
    os.umask(mask)
    assert PLAN.main(PLANNING + ["--out", str(tmp_path / "p.json"), "--gantt", str(tmp_path / "p.png")]) == 0
    for p in (tmp_path / "p.json", tmp_path / "p.png", ws / "ckpt" / "latest_checkpointed_iteration.txt",
              ws / "ckpt" / "plan.json", ws / "ckpt" / "iter_0000001" / "metadata.json"):
        assert p.stat().st_mode & 0o777 == 0o666 & ~mask, (p, oct(p.stat().st_mode))
    assert json.loads((tmp_path / "p.json").read_text())["format"] == "megatron-spindle-plan"
    assert sorted(q.name for q in tmp_path.iterdir()) == ["p.json", "p.png"]  # no temporary files left
