"""Link bandwidth (point-to-point and all-reduce, inside a node and across nodes) and the DP communication of
one operator."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_spindle.estimator.cost_model import AnalyticCostModel
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaOp
from megatron_spindle.profiler.settings import ProfilerSettings
from megatron_spindle.profiler.world import ProfileWorld, median_seconds

GRAD_BYTES = 4  # fp32 main gradients, as the cost model and the runtime engine reduce them


def _comm_tensor(world: ProfileWorld, nbytes: int) -> torch.Tensor:
    return torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=world.device)


def _p2p_seconds(world: ProfileWorld, a: int, b: int, nbytes: int, repeats: int) -> float:
    """One-way time of ``nbytes`` from rank a to rank b (half a ping-pong), on every rank (max-reduced)."""
    x = _comm_tensor(world, nbytes)

    def ping():
        if world.rank == a:
            dist.send(x, b)
            dist.recv(x, b)
        elif world.rank == b:
            dist.recv(x, a)
            dist.send(x, a)

    seconds = median_seconds(ping, world, 1, repeats) / 2 if world.rank in (a, b) else 0.0
    return world.all_max([seconds])[0]


def _allreduce_seconds(world: ProfileWorld, ranks: Sequence[int], nbytes: int, repeats: int,
                       group=None) -> float:
    group = group if group is not None else world.group(ranks)
    x = _comm_tensor(world, nbytes)
    seconds = 0.0
    if world.rank in ranks:
        seconds = median_seconds(lambda: dist.all_reduce(x, group=group), world, 1, repeats)
    return world.all_max([seconds])[0]


def _measure_link(world: ProfileWorld, peer: int, ranks: Sequence[int], sizes: Sequence[int],
                  repeats: int) -> dict[str, Any]:
    sizes = sorted(sizes)
    p2p = {s: _p2p_seconds(world, 0, peer, s, repeats) for s in sizes}
    group = world.group(ranks)
    ar = {s: _allreduce_seconds(world, ranks, s, repeats, group) for s in sizes}
    k, big, small = len(ranks), sizes[-1], sizes[0]
    return {
        "p2p_ranks": [0, peer],
        "p2p_bytes_per_s": big / p2p[big],
        "p2p_latency_s": p2p[small],
        "allreduce_ranks": list(ranks),
        "allreduce_bus_bytes_per_s": 2 * (k - 1) / k * big / ar[big],
        "allreduce_latency_s": ar[small] / (2 * (k - 1)),
        "p2p_seconds": {str(s): v for s, v in p2p.items()},
        "allreduce_seconds": {str(s): v for s, v in ar.items()},
    }


def measure_bandwidth(world: ProfileWorld, sizes: Sequence[int], repeats: int = 5) -> dict[str, Any]:
    """Point-to-point (rank 0 to a peer) and all-reduce bandwidth inside node 0 and, with several nodes, across
    nodes (one rank per node). A section is None when there are not two ranks for it."""
    out: dict[str, Any] = {"intra_node": None, "inter_node": None}
    local = world.local_world_size
    if local >= 2:
        out["intra_node"] = _measure_link(world, 1, list(range(local)), sizes, repeats)
    if world.num_nodes >= 2:
        out["inter_node"] = _measure_link(world, local, [k * local for k in range(world.num_nodes)], sizes,
                                          repeats)
    world.barrier()
    return out


def dp_comm_seconds(world: ProfileWorld, cluster: ClusterSpec, model: AnalyticCostModel, m: MetaOp, tp: int, dp: int,
             grad_numel: int, settings: ProfilerSettings, measured_links: bool) -> tuple[float, str]:
    """Seconds of one operator's DP communication and where the number comes from."""
    data = model.data_comm_seconds(m, tp, dp)
    if dp == 1:
        return 0.0, "none"
    if grad_numel == 0:
        return data, ("bandwidth" if measured_links else "nominal") if data > 0 else "none"
    n = tp * dp
    same_kind = (n <= world.local_world_size) == (n <= cluster.gpus_per_node)
    if n <= world.world_size and same_kind:
        groups = [world.group([t + j * tp for j in range(dp)]) for t in range(tp)]  # collective
        seconds = 0.0
        if world.rank < n:
            group = groups[world.rank % tp]
            x = torch.zeros(grad_numel, dtype=torch.float32, device=world.device)
            seconds = median_seconds(lambda: dist.all_reduce(x, group=group), world, settings.warmup,
                                      settings.repeats)
        return world.all_max([seconds])[0] + data, "measured"
    ring = model.allreduce_seconds(grad_numel * GRAD_BYTES, dp, n)
    return ring + data, "bandwidth" if measured_links else "nominal"
