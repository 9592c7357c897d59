"""The GPU launch scripts: torchrun arguments for multi-node runs, flags that pretrain_multitask.py accepts,
"$@" pass-through last, node-count limits. torchrun is replaced by a stub that records its arguments."""

import os
import subprocess

import pytest

from megatron_spindle.graph.workload import load_workload
from megatron_spindle.training.trainer import build_pretrain_parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(script, tmp_path, env_extra, *extra):
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    (stub / "torchrun").write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$STUB_OUT"\n')
    (stub / "torchrun").chmod(0o755)
    out = tmp_path / "args.txt"
    env = dict(os.environ, PATH=f"{stub}:{os.environ['PATH']}", STUB_OUT=str(out), **env_extra)
    r = subprocess.run(["bash", os.path.join(ROOT, "examples", script), *extra], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=60)
    return r, (out.read_text().splitlines() if out.exists() else [])


@pytest.mark.parametrize("script,workload,nodes,bad", [("pretrain_clip10_gpu.sh", "clip-10", 2, 9),
                                                         ("pretrain_qwen_val_gpu.sh", "qwen-val", 4, 3)])
def test_gpu_launch_scripts(tmp_path, script, workload, nodes, bad):
    r, argv = _run(script, tmp_path, {"NUM_NODES": str(nodes), "NODE_RANK": "1", "MASTER_ADDR": "10.1.2.3"},
                   "--train-iters", "5", "--data-path", "t=/data/t")
    assert r.returncode == 0, r.stderr
    dist = argv[:argv.index(os.path.join(ROOT, "pretrain_multitask.py"))]
    assert " ".join(dist) == (f"--nproc-per-node 8 --nnodes {nodes} --node-rank 1 --master-addr 10.1.2.3 "
                              "--master-port 6000")
    flags = argv[len(dist) + 1:]
    assert flags[-4:] == ["--train-iters", "5", "--data-path", "t=/data/t"]  # "$@" last: it overrides
    args = build_pretrain_parser("test").parse_args(flags)
    assert args.workload == workload and args.bf16 and args.train_iters == 5 and not args.mock_data
    assert args.gpus_per_node == 8 and args.save == args.load and args.save.endswith(f"_{nodes}n")
    load_workload(args.workload)
    _, argv = _run(script, tmp_path, {"NUM_NODES": str(nodes)})
    assert "--mock-data" in argv  # no --data-path: mock data
    r, _ = _run(script, tmp_path, {"NUM_NODES": str(bad)})
    assert r.returncode == 2 and "NUM_NODES must be" in r.stderr
