"""Communication time: collectives inside and across nodes, point-to-point transfers, and bucketed gradient
synchronisation overlapped with the backward.

A collective over a group costs a latency plus its bytes at a bus bandwidth (the nccl-tests convention:
all-reduce moves 2(n-1)/n of its buffer over the slowest link, all-gather and reduce-scatter (n-1)/n of the
gathered size, all-to-all (n-1)/n of a rank's buffer, send/recv its buffer, ``bus_factor``):

- inside a node: the node's measured NVLink bus bandwidth (C8); NVLink SHARP all-reduces where the GPU has them;
- across nodes: the least of (a) the network paths of the group's GPUs on its thinnest node (one per GPU,
  ``network_rail_bw``), (b) what one group's ring reaches (``inter_node_bw``), and (c) its share of the node's
  network (``node_network_bw``), which the cross-node groups running at the same time divide: strided groups
  (one or a few GPUs per node, e.g. the DP groups of a TP x DP layout) crossing the same nodes (C9);
- latency: one small collective inside a node, plus the network's when it crosses nodes;
- all-to-all (ZeRO-3's weights redistributed after the step, runtime/weight_redistribution.py) at the bus
  bandwidth of an all-gather over the same group: each rank's bytes leave on its own links, as a ring's do.
  ``cost-model-data.md`` has no measured all-to-all point, so this is the model's assumption, not a fit.

Gradients are reduced in the configured dtype (bf16: 2 bytes, fp32: 4 bytes per element). Megatron-core's DDP
reduces them in buckets as the backward produces them; the bucket all-reduces run on their own stream and both
sides slow down while they overlap (C10): ``overlapped_backward_seconds``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_spindle.estimator.errors import EstimatorError
from megatron_spindle.graph.cluster import HBM_STREAM_EFFICIENCY, NVLS_MIN_BYTES, ClusterSpec

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
# C10: compute (and communication) slow down by this factor while a gradient all-reduce overlaps the backward
# (AFDWang/Hetu-Galvatron profile_hardware/hardware_configs/overlap_coefficient.json, measured by
# profile_overlap.py on the Spindle authors' A800 cluster).
OVERLAP_SLOWDOWN = 1.145979403115153
# megatron-core DDP: buckets of max(40M, 1M x dp) parameters (distributed_data_parallel.py, bucket_size=None).
MEGATRON_BUCKET_PARAMS = 40_000_000
MEGATRON_BUCKET_PARAMS_PER_DP_RANK = 1_000_000


@dataclass(frozen=True)
class GroupPlacement:
    """Where the ranks of one process group sit: ``ranks_per_node`` of every node it spans."""

    ranks_per_node: tuple[int, ...]

    def __post_init__(self):
        if not self.ranks_per_node or any(r <= 0 for r in self.ranks_per_node):
            raise EstimatorError(f"group placement: ranks per node must be positive, got {self.ranks_per_node}")

    @classmethod
    def of_devices(cls, devices: Sequence[int], cluster: ClusterSpec) -> GroupPlacement:
        count = Counter(cluster.island(d) for d in devices)
        return cls(tuple(count[node] for node in sorted(count)))

    @classmethod
    def strided(cls, ranks: int, stride: int, cluster: ClusterSpec, first: int = 0) -> GroupPlacement:
        """``ranks`` devices ``first, first + stride, ...`` (a DP group of a compact TP x DP block: stride = tp)."""
        return cls.of_devices([first + i * stride for i in range(ranks)], cluster)

    @classmethod
    def dp_ring(cls, devices: Sequence[int], tp: int, cluster: ClusterSpec) -> GroupPlacement:
        """The data-parallel ring of one TP rank of a group of ``devices`` holding TP shards of degree ``tp``
        (its members on each node, divided among the TP ranks): what a gradient bucket's ring spans."""
        count = Counter(cluster.island(d) for d in devices)
        return cls(tuple(max(1, math.ceil(count[node] / tp)) for node in sorted(count)))

    @property
    def size(self) -> int:
        return sum(self.ranks_per_node)

    @property
    def nodes(self) -> int:
        return len(self.ranks_per_node)

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1


class CommModel:
    """Seconds of collectives and transfers on ``cluster``."""

    def __init__(self, cluster: ClusterSpec):
        self.cluster = cluster

    # ----------------------------------------------------------------------------------------- bandwidth

    def bus_bandwidth(self, op: str, group: GroupPlacement, nbytes: float = math.inf, concurrent: int = 1) -> float:
        """Bus bandwidth (bytes/s) a collective ``op`` of ``group`` reaches while ``concurrent`` cross-node groups
        (this one included) share the network of its nodes."""
        _check_op(op)
        c = self.cluster
        if op == "send_recv":
            return c.network_rail_bandwidth if group.crosses_nodes else c.intra_node_p2p_bandwidth
        if not group.crosses_nodes:
            if op == "all_reduce" and nbytes >= NVLS_MIN_BYTES:
                nvls = dict(c.nvls_bus_bw)
                if group.size in nvls:
                    return max(nvls[group.size], c.intra_node_bw)
            return c.intra_node_bw
        if concurrent < 1:
            raise EstimatorError(f"concurrent groups must be >= 1, got {concurrent}")
        rails = min(group.ranks_per_node) * c.network_rail_bandwidth
        return min(rails, c.inter_node_bw, c.node_network_bandwidth / concurrent)

    def latency(self, group: GroupPlacement) -> float:
        """Small-message time of one collective: the in-node phase where a node holds several of its ranks, plus
        the network when it crosses nodes."""
        c = self.cluster
        seconds = c.collective_latency if max(group.ranks_per_node) > 1 else 0.0
        return seconds + (c.network_latency if group.crosses_nodes else 0.0)

    # ---------------------------------------------------------------------------------------- collectives

    def collective_seconds(self, op: str, nbytes: float, group: GroupPlacement, concurrent: int = 1) -> float:
        """Seconds of one collective. ``nbytes`` as nccl-tests counts it: the per-rank buffer of an all-reduce,
        the gathered (whole) buffer of an all-gather / reduce-scatter, a rank's buffer of an all-to-all (for an
        uneven one, the busiest rank's), the message of a send/recv."""
        _check_op(op)
        n = group.size
        if nbytes <= 0 or (n <= 1 and op != "send_recv"):
            return 0.0
        return self.latency(group) + bus_factor(op, n) * nbytes / self.bus_bandwidth(op, group, nbytes, concurrent)

    def all_reduce(self, nbytes: float, group: GroupPlacement, concurrent: int = 1) -> float:
        return self.collective_seconds("all_reduce", nbytes, group, concurrent)

    def all_gather(self, total_bytes: float, group: GroupPlacement, concurrent: int = 1) -> float:
        return self.collective_seconds("all_gather", total_bytes, group, concurrent)

    def reduce_scatter(self, total_bytes: float, group: GroupPlacement, concurrent: int = 1) -> float:
        return self.collective_seconds("reduce_scatter", total_bytes, group, concurrent)

    def send_recv(self, nbytes: float, cross_node: bool) -> float:
        """One point-to-point transfer between two GPUs, over NVLink or across nodes."""
        group = GroupPlacement((1, 1) if cross_node else (2,))
        return self.collective_seconds("send_recv", nbytes, group)

    @property
    def overlap_slowdown(self) -> float:
        """How much compute and a collective slow while they overlap: the cluster's measured factor, else C10's."""
        return self.cluster.overlap_slowdown or OVERLAP_SLOWDOWN

    @property
    def overlap_latency(self) -> float:
        """What a collective issued beside compute takes beyond its slowed time: the measured delay (0 unless a
        CPU profile measured one; ClusterSpec ``overlap_latency``)."""
        return self.cluster.overlap_latency

    def send_recv_latency(self, cross_node: bool) -> float:
        """A small message's time point to point: the measured one inside a node where a profile gave it
        (``p2p_latency``), else a small collective's (``latency``)."""
        if not cross_node and self.cluster.p2p_latency > 0:
            return self.cluster.p2p_latency
        return self.latency(GroupPlacement((1, 1) if cross_node else (2,)))

    def send_recv_bandwidth(self, cross_node: bool) -> float:
        """Bytes/s one GPU sends (or receives) point to point: its own network path across nodes (C9's p2p
        profile), NVLink inside a node."""
        return self.bus_bandwidth("send_recv", GroupPlacement((1, 1) if cross_node else (2,)))

    def local_copy_bandwidth(self) -> float:
        """Bytes/s of a device-to-device copy on one GPU: it reads and writes HBM at the streaming efficiency."""
        return self.cluster.gpu.memory_bandwidth * HBM_STREAM_EFFICIENCY / 2

    def concurrent_seconds(self, collectives: Sequence[tuple[str, float, Sequence[int]]]) -> list[float]:
        """Seconds of collectives (op, bytes, devices) that run at the same time: the cross-node ones share the
        network of every node they cross (each gets its share on its busiest node)."""
        c = self.cluster
        placements = [GroupPlacement.of_devices(devs, c) for _, _, devs in collectives]
        users = Counter(node for (_, _, devs), g in zip(collectives, placements) if g.crosses_nodes
                        for node in {c.island(d) for d in devs})
        out = []
        for (op, nbytes, devs), group in zip(collectives, placements):
            sharing = max((users[c.island(d)] for d in devs), default=1) if group.crosses_nodes else 1
            out.append(self.collective_seconds(op, nbytes, group, max(1, sharing)))
        return out

    # ------------------------------------------------------------------------------- data-parallel layouts

    def dp_group(self, tp: int, dp: int) -> tuple[GroupPlacement, int]:
        """The DP group of TP rank 0 in a compact block of tp * dp devices starting at device 0, and how many DP
        groups (one per TP rank) cross each node's network with it."""
        group = GroupPlacement.strided(dp, tp, self.cluster)
        concurrent = min(tp, self.cluster.gpus_per_node) if group.crosses_nodes else 1
        return group, concurrent

    def dp_allreduce_seconds(self, nbytes: float, tp: int, dp: int) -> float:
        """All-reduce of ``nbytes`` per rank over the DP ranks of a compact tp x dp block; the tp DP groups run
        at the same time."""
        if dp <= 1:
            return 0.0
        group, concurrent = self.dp_group(tp, dp)
        return self.all_reduce(nbytes, group, concurrent)

    def tp_allreduce_seconds(self, nbytes: float, tp: int) -> float:
        """All-reduce of ``nbytes`` per rank over a TP group (tp consecutive devices, inside a node)."""
        if tp <= 1:
            return 0.0
        return self.all_reduce(nbytes, GroupPlacement.strided(tp, 1, self.cluster))

    def tp_collective_seconds(self, nbytes: float, tp: int, sequence_parallel: bool = False) -> float:
        """One of a layer's TP collectives of an ``nbytes`` activation: the all-reduce, or with sequence
        parallelism an all-gather or a reduce-scatter of it (the same bytes and latency either way)."""
        if not sequence_parallel:
            return self.tp_allreduce_seconds(nbytes, tp)
        if tp <= 1:
            return 0.0
        return self.all_gather(nbytes, GroupPlacement.strided(tp, 1, self.cluster))


def bus_factor(op: str, n: int) -> float:
    """nccl-tests bus bytes per byte of a collective's buffer over ``n`` ranks (``collective_seconds``)."""
    if op == "send_recv":
        return 1.0
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def _check_op(op: str) -> None:
    if op not in COLLECTIVES:
        raise EstimatorError(f"collective must be one of {COLLECTIVES}, got '{op}'")


# --------------------------------------------------------------------------------- gradient sync and overlap


def bucket_params(dp: int, bucket: int | None = None) -> int:
    """Parameters per gradient bucket (megatron-core's default for ``dp`` ranks unless ``bucket`` is given)."""
    if bucket is not None:
        if bucket <= 0:
            raise EstimatorError(f"bucket size must be positive, got {bucket}")
        return bucket
    return max(MEGATRON_BUCKET_PARAMS, MEGATRON_BUCKET_PARAMS_PER_DP_RANK * dp)


def grad_buckets(params: int, dp: int, bucket: int | None = None) -> list[int]:
    """Parameters of each bucket of ``params`` gradients, in the order the backward completes them."""
    size = bucket_params(dp, bucket)
    full, rest = divmod(int(params), size)
    return [size] * full + ([rest] if rest else [])


@dataclass(frozen=True)
class OverlapTimes:
    """``backward_end``: when the (slowed) backward compute ends; ``sync_end``: when the last bucket is reduced;
    ``exposed_sync``: the synchronisation left after the backward (sync_end - backward_end, >= 0)."""

    backward_end: float
    sync_end: float

    @property
    def end(self) -> float:
        return max(self.backward_end, self.sync_end)

    @property
    def exposed_sync(self) -> float:
        return max(0.0, self.sync_end - self.backward_end)


def overlapped_backward_seconds(backward: float, syncs: Sequence[float], ready: Sequence[float] | None = None,
                                slowdown: float = OVERLAP_SLOWDOWN, latency: float = 0.0) -> OverlapTimes:
    """A backward of ``backward`` seconds of compute whose gradient buckets are all-reduced as they complete.

    Bucket i (``syncs[i]`` seconds alone) is ready once a fraction ``ready[i]`` of the backward's compute is done
    (default: evenly spread, the last one at the end). The all-reduces run one after another on their own stream;
    while compute and communication overlap both progress ``slowdown`` times slower (C10), and a bucket beside
    compute takes ``latency`` more (a measured CPU scheduling delay, ClusterSpec ``overlap_latency``): its rate
    is 1 / (slowdown + latency / syncs[i]), as the simulator's timeline runs it."""
    if backward < 0 or any(s < 0 for s in syncs) or slowdown < 1 or latency < 0:
        raise EstimatorError("overlap: seconds and the latency must be >= 0, the slowdown >= 1")
    k = len(syncs)
    ready = list(ready) if ready is not None else [(i + 1) / k for i in range(k)]
    if len(ready) != k or any(not 0 <= r <= 1 for r in ready) or ready != sorted(ready):
        raise EstimatorError("overlap: ready fractions must be sorted, in [0, 1], one per bucket")
    t, done = 0.0, 0.0  # wall time, compute done (seconds of work)
    comm_left, nxt = 0.0, 0  # current bucket's remaining work, next bucket to start
    backward_end = backward if backward == 0 else None
    while backward_end is None or comm_left > 0 or nxt < k:
        if comm_left <= 0 and nxt < k and ready[nxt] * backward <= done + 1e-15:
            comm_left, nxt = syncs[nxt], nxt + 1
            continue
        computing, communicating = backward_end is None, comm_left > 0
        overlapping = computing and communicating
        rate = 1.0 / slowdown if overlapping else 1.0
        comm_rate = 1.0 / (slowdown + latency / syncs[nxt - 1]) if overlapping else 1.0
        steps = []
        if computing:
            target = ready[nxt] * backward if (nxt < k and not communicating) else backward
            steps.append((max(target - done, 0.0) / rate, "compute"))
        if communicating:
            steps.append((comm_left / comm_rate, "comm"))
        dt = min(s for s, _ in steps)
        t += dt
        if computing:
            done = min(backward, done + dt * rate)
            if done >= backward - 1e-15:
                backward_end = t
        if communicating:
            comm_left = max(0.0, comm_left - dt * comm_rate)
            if comm_left <= 1e-18:
                comm_left = 0.0
    return OverlapTimes(backward_end, t if k else 0.0)
