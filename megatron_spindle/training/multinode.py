"""Multi-node sanity checks at start: the node layout torchrun launched, and a checkpoint folder every node sees.

- ``resolve_node_layout`` (before anything else): under torchrun, LOCAL_WORLD_SIZE is the number of processes,
  so devices, per node. The planner treats a node as one NVLink island, so --gpus-per-node must equal it (or a
  2-node x 1-process run is planned as if both ranks shared NVLink). Left out, it is taken from torchrun; a
  --cluster file must agree too.
- ``check_shared_folder`` (after the process group, before planning or training): every rank writes a probe file
  into --save, then every rank looks for all of them. Checkpoints need that folder to be shared (each rank writes
  the units it owns, rank 0 publishes the manifest of all of them, and a resume reads units written by any rank):
  a node-local folder would lose the run at its first save. Probes are removed again; a folder the check created
  is removed when the check fails. Network filesystems may show other clients' new files late, so a rank looks
  for up to ``SHARED_WAIT_SECONDS`` before it reports a probe missing.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_spindle.errors import on_every_rank

SHARED_WAIT_SECONDS = 3.0


def resolve_node_layout(args: argparse.Namespace, environ=os.environ) -> None:
    """Check --gpus-per-node (or --cluster) against torchrun's LOCAL_WORLD_SIZE; fill --gpus-per-node from it
    when it was left out. ValueError naming the flag on a mismatch."""
    local = environ.get("LOCAL_WORLD_SIZE")
    if local is None:
        return
    local, world = int(local), int(environ.get("WORLD_SIZE", local))
    nodes = world // local if local and world % local == 0 else None
    where = f"torchrun started {local} process(es) per node" + (f" on {nodes} node(s)" if nodes else "")
    if getattr(args, "cluster", None):
        from megatron_spindle.graph.cluster import load_cluster

        per_node = load_cluster(args.cluster).gpus_per_node
        if per_node != local:
            raise ValueError(f"--cluster {args.cluster} has {per_node} devices per node, but {where} "
                             f"(LOCAL_WORLD_SIZE): the runtime runs one rank per device, and the planner would put "
                             f"slices across nodes as if they shared a node's links")
        return
    if args.gpus_per_node is None:
        args.gpus_per_node = local
    elif args.gpus_per_node != local:
        raise ValueError(f"--gpus-per-node {args.gpus_per_node} does not match torchrun: {where} "
                         f"(LOCAL_WORLD_SIZE={local}); the planner would put slices across nodes as if they "
                         f"shared a node's links. Give --gpus-per-node {local}, or leave it out (taken from torchrun)")


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (pickled: small objects). Collective."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def check_shared_folder(path: str | None, flag: str, rank: int, world_size: int) -> None:
    """Collective: ValueError on every rank when some rank does not see every rank's probe file in ``path``."""
    if not path or world_size == 1:
        return
    token = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    folder = Path(path)
    created = not folder.exists()
    host = socket.gethostname()
    err = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        mine = folder / f".spindle-shared-probe-{token[0]}-{rank}"
        tmp = mine.with_suffix(".tmp")
        tmp.write_text(host)
        os.replace(tmp, mine)
    except OSError as e:
        err = f"cannot write into {flag} {path}: {e}"
    hosts = all_gather_objects(host)
    dist.barrier()  # every probe is written (or failed) before anyone looks
    unseen: list[int] = []
    if err is None:
        deadline = time.monotonic() + SHARED_WAIT_SECONDS
        while True:
            unseen = [r for r in range(world_size) if not (folder / f".spindle-shared-probe-{token[0]}-{r}").exists()]
            if not unseen or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    reports = all_gather_objects((err, unseen))
    dist.barrier()  # everyone has looked before probes go away
    try:
        (folder / f".spindle-shared-probe-{token[0]}-{rank}").unlink(missing_ok=True)
    except OSError:
        pass
    problems = [(r, e, u) for r, (e, u) in enumerate(reports) if e or u]
    if not problems:
        return
    if created:
        try:
            folder.rmdir()  # only if empty: this check made it
        except OSError:
            pass
    r, e, u = problems[0]
    if e:
        raise on_every_rank(ValueError(f"rank {r} (host {hosts[r]}): {e}"))
    others = ", ".join(f"{x} (host {hosts[x]})" for x in u[:8])
    raise on_every_rank(ValueError(
        f"{flag} {path} is not shared between the ranks: rank {r} (host {hosts[r]}) does not see the files written "
        f"there by rank(s) {others}. Checkpoints need a folder every node reads and writes (a shared filesystem "
        f"such as NFS or Lustre mounted at the same path on every node)"))
