"""The launch scripts: torchrun arguments for multi-node runs, flags that pretrain_multitask.py accepts, "$@"
pass-through last, node-count limits, precision from PRECISION (a CPU machine defaults to fp32, so the GPU
scripts dry-run there), one way to find the launcher (TORCHRUN, PYTHON, the repository's .venv, PATH) and
--data-path replacing the mock data. torchrun is replaced by stubs that record their arguments."""

import os
import shutil
import subprocess

import pytest

from megatron_spindle.graph.workload import load_workload
from megatron_spindle.training.arguments import validate_args
from megatron_spindle.training.precision import check_precision_args
from megatron_spindle.training.trainer import build_pretrain_parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = ("pretrain_clip10_gpu.sh", "pretrain_qwen_val_gpu.sh", "train_tiny_clip_cpu.sh")


def _stub(path):
    """An executable that records its own name, then its arguments, one a line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('#!/bin/bash\nprintf "%s\\n" "$(basename "$0")" "$@" > "$STUB_OUT"\n')
    path.chmod(0o755)
    return path


def _run(script, tmp_path, env_extra, *extra, root=ROOT, launcher="TORCHRUN"):
    out = tmp_path / "args.txt"
    out.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHRUN", "PYTHON", "PRECISION")}
    env.update(STUB_OUT=str(out), PATH=f"{_stub(tmp_path / 'bin' / 'torchrun').parent}:{env['PATH']}")
    if launcher:
        env[launcher] = str(_stub(tmp_path / "stub" / f"{launcher.lower()}-stub"))
    env.update(env_extra)
    r = subprocess.run(["bash", os.path.join(root, "examples", script), *extra], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=60)
    lines = out.read_text().splitlines() if out.exists() else []
    return r, lines[1:] if launcher else lines  # the launcher's name is checked where it matters


def _flags(argv, root=ROOT):
    return argv[argv.index(os.path.join(root, "pretrain_multitask.py")) + 1:]


@pytest.mark.parametrize("script,workload,nodes,bad", [("pretrain_clip10_gpu.sh", "clip-10", 2, 9),
                                                         ("pretrain_qwen_val_gpu.sh", "qwen-val", 4, 3)])
def test_gpu_launch_scripts(tmp_path, script, workload, nodes, bad):
    env = {"NUM_NODES": str(nodes), "NODE_RANK": "1", "MASTER_ADDR": "10.1.2.3", "PRECISION": "bf16"}
    r, argv = _run(script, tmp_path, env, "--train-iters", "5", "--data-path", "t=/data/t")
    assert r.returncode == 0, r.stderr
    dist = argv[:argv.index(os.path.join(ROOT, "pretrain_multitask.py"))]
    assert " ".join(dist) == (f"--nproc-per-node 8 --nnodes {nodes} --node-rank 1 --master-addr 10.1.2.3 "
                              "--master-port 6000")
    flags = _flags(argv)
    assert flags[-4:] == ["--train-iters", "5", "--data-path", "t=/data/t"]  # "$@" last: it overrides
    args = build_pretrain_parser("test").parse_args(flags)
    assert args.workload == workload and args.bf16 and args.train_iters == 5 and not args.mock_data
    assert args.gpus_per_node == 8 and args.save == args.load and args.save.endswith(f"_{nodes}n")
    load_workload(args.workload)
    _, argv = _run(script, tmp_path, {"NUM_NODES": str(nodes), "PRECISION": "fp16"})
    args = build_pretrain_parser("test").parse_args(_flags(argv))
    assert args.mock_data and args.fp16 and not args.bf16  # no --data-path: mock data
    r, _ = _run(script, tmp_path, {"NUM_NODES": str(bad)})
    assert r.returncode == 2 and "NUM_NODES must be" in r.stderr
    r, _ = _run(script, tmp_path, {"NUM_NODES": str(nodes), "PRECISION": "fp8"})
    assert r.returncode == 2 and "PRECISION must be bf16, fp16 or fp32" in r.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine defaults to bf16")
def test_gpu_scripts_dry_run_on_cpu(tmp_path):
    """Without PRECISION a machine without GPUs gets fp32: the flags pass pretrain_multitask.py's checks."""
    for script, nodes in (("pretrain_clip10_gpu.sh", 1), ("pretrain_qwen_val_gpu.sh", 4)):
        r, argv = _run(script, tmp_path, {"NUM_NODES": str(nodes)})
        assert r.returncode == 0, r.stderr
        args = build_pretrain_parser("test").parse_args(_flags(argv))
        assert not args.bf16 and not args.fp16
        validate_args(args, 8 * nodes, cuda=False)
        check_precision_args(args, cuda=False)


def test_cpu_script_data_path_replaces_mock_data(tmp_path):
    r, argv = _run("train_tiny_clip_cpu.sh", tmp_path, {}, "--data-path", "vision_text=/d/vt")
    assert r.returncode == 0, r.stderr
    args = build_pretrain_parser("test").parse_args(_flags(argv))
    assert not args.mock_data and args.data_path == ["vision_text=/d/vt"] and not args.bf16
    _, argv = _run("train_tiny_clip_cpu.sh", tmp_path, {}, "--data-path=vision_text=/d/vt")
    assert "--mock-data" not in argv
    _, argv = _run("train_tiny_clip_cpu.sh", tmp_path, {})
    assert "--mock-data" in argv


def test_every_script_finds_the_launcher_the_same_way(tmp_path):
    """TORCHRUN wins, then PYTHON -m torch.distributed.run, then <repo>/.venv/bin/python, then PATH's torchrun."""
    repo = tmp_path / "repo"
    shutil.copytree(os.path.join(ROOT, "examples"), repo / "examples",
                    ignore=shutil.ignore_patterns("workloads"))
    env = {"NUM_NODES": "4"}
    stub = tmp_path / "stub"
    for script in SCRIPTS:
        r, argv = _run(script, tmp_path, env, root=str(repo), launcher=None)  # no .venv: torchrun from PATH
        assert r.returncode == 0 and argv[:2] == ["torchrun", "--nproc-per-node"], (script, r.stderr, argv[:3])
        _stub(repo / ".venv" / "bin" / "python")
        _, argv = _run(script, tmp_path, env, root=str(repo), launcher=None)  # the repository's .venv
        assert argv[:3] == ["python", "-m", "torch.distributed.run"], (script, argv[:3])
        env_py = dict(env, PYTHON=str(_stub(stub / "python-env")))
        _, argv = _run(script, tmp_path, env_py, root=str(repo), launcher=None)  # PYTHON beats the .venv
        assert argv[:3] == ["python-env", "-m", "torch.distributed.run"], (script, argv[:3])
        env_tr = dict(env_py, TORCHRUN=str(_stub(stub / "torchrun-env")))
        _, argv = _run(script, tmp_path, env_tr, root=str(repo), launcher=None)  # TORCHRUN beats everything
        assert argv[:2] == ["torchrun-env", "--nproc-per-node"], (script, argv[:3])
        (repo / ".venv" / "bin" / "python").unlink()
