"""Two "nodes" on one machine: network namespaces joined by a veth pair, one torchrun per namespace meeting over
a c10d rendezvous on the veth addresses (nothing else is reachable from inside: each namespace has only its
loopback and its end of the pair). pretrain_multitask.py with gloo on GLOO_SOCKET_IFNAME:

1. a --save folder private to each node (a tmpfs mounted inside each node's mount namespace) stops both nodes at
   start with the shared-filesystem message, and nothing reaches the disk;
2. tiny-clip trains 3 iterations on 2 nodes x 1 process (--gpus-per-node left out: taken from torchrun, so the
   plan has 2 one-device nodes), validating and saving into a folder both nodes share;
3. a second launch resumes that checkpoint for a 4th iteration.

Needs root and ``ip netns`` (CI runs as root); skipped with the reason otherwise. The namespaces get unique names
and are deleted by the fixture's finalizer whatever happens.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import uuid

import pytest

from megatron_spindle.checkpointing import load_checkpoint, read_latest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ADDRS = ("10.77.0.1", "10.77.0.2")  # inside the namespaces only: no clash with the host or other runs
TRAIN = ["--workload", "tiny-clip", "--mock-data", "--mock-data-samples", "24", "--seed", "5",
         "--spindle-planner", "wavefront", "--gpu-type", "CPU", "--log-interval", "1", "--num-workers", "0"]


def _ip(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_nodes():
    """[(namespace, veth, address)] x 2, joined by a veth pair; removed at the end even on failure."""
    if os.geteuid() != 0:
        pytest.skip("the two-node test needs root (ip netns); not root here")
    if shutil.which("ip") is None or shutil.which("mount") is None:
        pytest.skip("the two-node test needs the ip and mount commands")
    tag = uuid.uuid4().hex[:8]
    nodes = [(f"spindle-{tag}-{i}", f"vs{tag}{i}", addr) for i, addr in enumerate(ADDRS)]
    created: list[str] = []
    try:
        for ns, _, _ in nodes:
            r = _ip("netns", "add", ns)
            if r.returncode:
                pytest.skip(f"ip netns add is not allowed here: {r.stderr.strip()}")
            created.append(ns)
        (a_ns, a_if, a_addr), (b_ns, b_if, b_addr) = nodes
        steps = [("link", "add", a_if, "type", "veth", "peer", "name", b_if),
                 ("link", "set", a_if, "netns", a_ns), ("link", "set", b_if, "netns", b_ns)]
        for ns, dev, addr in nodes:
            steps += [("-n", ns, "addr", "add", f"{addr}/30", "dev", dev), ("-n", ns, "link", "set", dev, "up"),
                      ("-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            r = _ip(*step)
            assert r.returncode == 0, f"ip {' '.join(step)}: {r.stderr}"
        yield nodes
    finally:
        for ns in created:
            for pid in _ip("netns", "pids", ns).stdout.split():  # anything of ours still running inside
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns)  # also removes the veth pair


def _launch(nodes, flags, tmp_path, name, private_dir=None, timeout=300):
    """One torchrun per namespace (2 nodes x 1 process); returns [(returncode, stdout, stderr)] per node."""
    procs = []
    for i, (ns, dev, addr) in enumerate(nodes):
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ADDRS[0]}:29400", "--rdzv-id", name,
                    "--rdzv-conf", f"is_host={int(i == 0)},join_timeout=120", "--local-addr", addr,
                    os.path.join(ROOT, "pretrain_multitask.py"), *flags]
        cmd = ["ip", "netns", "exec", ns]
        if private_dir:  # a folder only this node sees: a tmpfs in the node's own mount namespace
            cmd += ["sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"', str(private_dir)]
        env = dict(os.environ, GLOO_SOCKET_IFNAME=dev, OMP_NUM_THREADS="1")
        out, err = (open(tmp_path / f"{name}-{i}.{s}", "w+") for s in ("out", "err"))
        procs.append((subprocess.Popen(cmd + torchrun, stdout=out, stderr=err, env=env, cwd=tmp_path,
                                       start_new_session=True), out, err))
    results = []
    for p, out, err in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        out.seek(0)
        err.seek(0)
        results.append((p.returncode, out.read(), err.read()))
        out.close()
        err.close()
    return results


@pytest.mark.multiproc
def test_two_nodes_over_a_veth_pair(two_nodes, tmp_path):
    # 1) a node-local --save: both nodes stop before planning, with the reason; nothing reaches the shared disk
    private = tmp_path / "node-local"
    private.mkdir()
    res = _launch(two_nodes, TRAIN + ["--train-iters", "3", "--save", str(private / "ckpt")], tmp_path, "local",
                  private_dir=private)
    for rc, out, err in res:
        assert rc != 0, out[-2000:]
        assert f"--save {private / 'ckpt'} is not shared between the ranks" in err, err[-3000:]
        assert "shared filesystem" in err and "plan for workload" not in out
    assert list(private.iterdir()) == []

    # 2) 3 iterations on 2 one-process nodes, validating, saving into the shared folder
    ckpt = tmp_path / "ckpt"
    res = _launch(two_nodes, TRAIN + ["--train-iters", "3", "--save", str(ckpt), "--eval-interval", "3",
                                      "--eval-iters", "1"], tmp_path, "train")
    for rc, out, err in res:
        assert rc == 0, (out[-3000:], err[-3000:])
    log = res[0][1]
    assert "plan for workload 'tiny-clip' on 2 devices (2 x 1 CPU)" in log, log[-3000:]  # 2 nodes from torchrun
    assert re.search(r" iteration\s+3/\s+3 \| consumed samples:\s+72 \|", log), log[-3000:]
    assert " validation loss at iteration 3 | total loss value:" in log
    assert read_latest(ckpt) == 3
    meta = load_checkpoint(ckpt).metadata
    assert meta["world_size"] == 2 and {m["rank"] for m in meta["units"].values()} == {0, 1}

    # 3) the next launch resumes it
    res = _launch(two_nodes, TRAIN + ["--train-iters", "4", "--save", str(ckpt), "--load", str(ckpt)], tmp_path,
                  "resume")
    for rc, out, err in res:
        assert rc == 0, (out[-3000:], err[-3000:])
    log = res[0][1]
    assert "at iteration 3 (saved by 2 rank(s), now 2)" in log, log[-3000:]
    assert re.search(r" iteration\s+4/\s+4 \|", log) and not re.search(r" iteration\s+3/\s+4 \|", log)
    assert read_latest(ckpt) == 4
