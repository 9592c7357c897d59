"""Link bandwidth (point-to-point and all-reduce, inside a node and across nodes), the compute time a CPU rank
loses per message, and the DP communication of one operator."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_spindle.estimator.cost_model import AnalyticCostModel
from megatron_spindle.estimator.profile import PROFILED_GRAD_BYTES as GRAD_BYTES  # fp32 main gradients
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaOp
from megatron_spindle.profiler.settings import ProfilerSettings
from megatron_spindle.profiler.world import ProfileWorld, median_seconds
from megatron_spindle.runtime.transfer import receives_early

# The message-cost probe: chunks of compute, a message posted after each, all waited on at the end. The chunk is
# the workload's own lightest layer, forward and backward (``run_profile``); without one, matrix products about
# as long as a small slice's phase on a CPU (a few tenths of a millisecond).
HOST_PROBE_CHUNKS = 16
HOST_PROBE_MATMULS = 8
HOST_PROBE_SIZE = 128
HOST_PROBE_TRIALS = 15
# Repeats of the smallest message, whose time is the latency: on a shared CPU a small message's one-way time is
# heavy-tailed (two gloo ranks on this 2-core machine: median 52-76 us, about 1 in 10 near 2 ms, a transport
# thread waiting for its core), and a median of 5 landed on the tail in about 1 group of 16, which quadrupled
# a profile's simulated transfers (tiny-clip: 12.9 against 2.9-3.8 ms); 31 keep the median on the typical time
LATENCY_PROBE_REPEATS = 31
# The overlap probe: a gradient-bucket-sized all-reduce against matrix products long enough (about 20 ms on a
# CPU core) for the all-reduce to end beside them even when it waits milliseconds for the scheduler.
OVERLAP_PROBE_BYTES = 1 << 20
OVERLAP_PROBE_MATMULS = 64
OVERLAP_PROBE_SIZE = 256


@dataclass(frozen=True)
class ProbeChunk:
    """The compute the message-cost probe runs between messages, and what it is (written to the profile)."""

    name: str
    run: Callable[[], Any]


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


def _timed_after_barrier(fn: Callable[[], Any], group) -> float:
    """Wall seconds of ``fn`` on this rank, started together with the group's other members."""
    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _matmuls(x: torch.Tensor, count: int) -> None:
    for _ in range(count):
        x @ x


def message_host_seconds(world: ProfileWorld, a: int, b: int, nbytes: int = 4,
                         compute: Callable[[], Any] | None = None) -> float:
    """Compute time ranks ``a`` and ``b`` each lose per message that ``a`` sends ``b`` while both compute
    (max-reduced; 0 when not measurable). Both run the same chunks of compute (``compute``, by default matrix
    products), with and without a message sent after each chunk, alternating; receives are posted as the runtime
    posts them (on gloo all of them first, ``receives_early``), and everything is waited on at the end; the cost
    per message is the difference of the two medians over the chunks. On a CPU the transport's threads share the
    rank's core, and what a message costs them depends on what the core ran before: between a real layer's
    forward and backward about 3-4x what it costs between small matrix products (tiny-clip on two gloo ranks:
    115-137 against 33-37 us). On a GPU the host runs ahead of the kernels and NCCL's copies run beside them:
    not measured, 0."""
    if world.device.type != "cpu":
        return 0.0
    group = world.group([a, b])  # collective: every rank asks for it
    if world.rank not in (a, b):
        return world.all_max([0.0])[0]
    if compute is None:
        x = torch.randn(HOST_PROBE_SIZE, HOST_PROBE_SIZE)

        def compute():
            _matmuls(x, HOST_PROBE_MATMULS)
    msg = _comm_tensor(world, nbytes)
    sender = world.rank == a
    backend_early = receives_early(dist.get_backend())

    def chunks(messages: bool, tag: int) -> None:
        works = []
        if messages and not sender and backend_early:  # as the runtime posts them (runtime/transfer.py)
            works = [dist.irecv(torch.empty_like(msg), a, tag=tag + i) for i in range(HOST_PROBE_CHUNKS)]
        for i in range(HOST_PROBE_CHUNKS):
            compute()
            if messages and sender:
                works.append(dist.isend(msg, b, tag=tag + i))
            elif messages and not backend_early:
                works.append(dist.irecv(torch.empty_like(msg), a, tag=tag + i))
        for w in works:
            w.wait()

    for messages in (False, True):  # warm-up
        _timed_after_barrier(lambda messages=messages: chunks(messages, 0), group)
    plain, posting = [], []
    for k in range(HOST_PROBE_TRIALS):
        plain.append(_timed_after_barrier(lambda: chunks(False, 0), group))
        posting.append(_timed_after_barrier(lambda k=k: chunks(True, (k + 1) * HOST_PROBE_CHUNKS), group))
    seconds = max(0.0, (statistics.median(posting) - statistics.median(plain)) / HOST_PROBE_CHUNKS)
    return world.all_max([seconds])[0]


def overlap_constants(world: ProfileWorld, ranks: Sequence[int]) -> tuple[float, float]:
    """(slowdown, latency) of compute and an all-reduce over ``ranks`` that overlap ((0, 0) when not measured):
    compute alone (C), the all-reduce alone (X), then the all-reduce issued asynchronously and the compute run
    beside it in small chunks, noting when the compute ends (Tc) and when the all-reduce is first seen complete
    between two chunks (Tx). In the simulator's model (simulator/timeline.py) compute beside a collective runs
    ``slowdown`` times slower, and the collective beside compute takes slowdown * X + ``latency``; so with the
    collective done first, slowdown = Tx / (Tx + C - Tc) and latency = Tx - slowdown * X. On a CPU rank the
    compute loses the collective's own work, and the collective waits milliseconds for the scheduler to give its
    thread the core (the compute is made long enough for it to finish beside it). GPUs are not measured here
    ((0, 0): C10's factor applies, and no latency)."""
    if world.device.type != "cpu":
        return 0.0, 0.0
    group = world.group(ranks)  # collective: every rank asks for it
    if world.rank not in ranks:
        world.all_max([0.0, 0.0])
        return 0.0, 0.0
    x = torch.randn(OVERLAP_PROBE_SIZE, OVERLAP_PROBE_SIZE)
    buf = _comm_tensor(world, OVERLAP_PROBE_BYTES)

    def compute():
        _matmuls(x, OVERLAP_PROBE_MATMULS)

    def both() -> tuple[float, float]:
        t0 = time.perf_counter()
        work, done = dist.all_reduce(buf, group=group, async_op=True), None
        for _ in range(OVERLAP_PROBE_MATMULS):  # the compute in chunks of one product, polling between them
            _matmuls(x, 1)
            if done is None and work.is_completed():
                done = time.perf_counter() - t0
        computed = time.perf_counter() - t0
        work.wait()
        return computed, done if done is not None else time.perf_counter() - t0

    for fn in (compute, both):  # warm-up
        dist.barrier(group=group)
        fn()
    trials = []  # (C, X, Tc, Tx) of one trial, measured one after the other
    for _ in range(HOST_PROBE_TRIALS):
        c = _timed_after_barrier(compute, group)
        x_ = _timed_after_barrier(lambda: dist.all_reduce(buf, group=group), group)
        dist.barrier(group=group)
        trials.append((c, x_, *both()))
    slowdown, latency = overlap_fit(trials)
    slowdown, latency = world.all_max([slowdown, latency])
    return slowdown, latency


def overlap_fit(trials: Sequence[tuple[float, float, float, float]]) -> tuple[float, float]:
    """(slowdown, latency) from trials of (C, X, Tc, Tx) (``overlap_constants``): the median of each trial's fit,
    (0, 0) when no trial fits. A trial whose compute beside the collective lost more than the collective's whole
    window (Tc - C >= Tx: no progress at all beside it, which the model cannot hold) was slowed by something
    else on a shared machine, and is left out (1 in 15 on this 2-core machine). Fitting the medians of C, Tc and
    Tx over all trials instead once gave a factor of 7.5e6, and the simulator then stalled every compute beside a
    collective."""
    fits = []
    for c, x_, tc, tx in trials:
        if tx < tc:  # the collective ended beside the compute: it progressed tx + c - tc in tx
            progressed = tx + c - tc
            if progressed <= 0:
                continue
            slowdown = max(1.0, tx / progressed)
            fits.append((slowdown, max(0.0, tx - slowdown * x_)))
        else:  # the compute ended first: it ran beside the collective throughout, the rest of X ran alone
            slowdown = max(1.0, tc / c) if c > 0 else 1.0
            progressed = max(tc + x_ - tx, 1e-9)  # the share of X done beside the compute, in seconds alone
            latency = max(0.0, tc * x_ / progressed - slowdown * x_)
            fits.append((slowdown, min(latency, tx)))  # no progress at all: bounded by what was seen
    if not fits:
        return 0.0, 0.0
    return statistics.median(f[0] for f in fits), statistics.median(f[1] for f in fits)


def _measure_link(world: ProfileWorld, peer: int, ranks: Sequence[int], sizes: Sequence[int],
                  repeats: int, chunk: ProbeChunk | None) -> dict[str, Any]:
    sizes = sorted(sizes)
    k, big, small = len(ranks), sizes[-1], sizes[0]
    times = {s: max(repeats, LATENCY_PROBE_REPEATS) if s == small else repeats for s in sizes}
    p2p = {s: _p2p_seconds(world, 0, peer, s, times[s]) for s in sizes}
    group = world.group(ranks)
    ar = {s: _allreduce_seconds(world, ranks, s, times[s], group) for s in sizes}
    slowdown, latency = overlap_constants(world, ranks)
    return {
        "p2p_ranks": [0, peer],
        "p2p_bytes_per_s": big / p2p[big],
        "p2p_latency_s": p2p[small],
        "allreduce_ranks": list(ranks),
        "allreduce_bus_bytes_per_s": 2 * (k - 1) / k * big / ar[big],
        "allreduce_latency_s": ar[small] / (2 * (k - 1)),
        "message_host_s": message_host_seconds(world, 0, peer, sizes[0], chunk.run if chunk else None),
        "message_probe_compute": chunk.name if chunk else "matrix products",
        "overlap_slowdown": slowdown,
        "overlap_latency_s": latency,
        "p2p_seconds": {str(s): v for s, v in p2p.items()},
        "allreduce_seconds": {str(s): v for s, v in ar.items()},
    }


def measure_bandwidth(world: ProfileWorld, sizes: Sequence[int], repeats: int = 5,
                      chunk: ProbeChunk | None = None) -> dict[str, Any]:
    """Point-to-point (rank 0 to a peer) and all-reduce bandwidth inside node 0 and, with several nodes, across
    nodes (one rank per node), and what a message costs a CPU rank's compute (``chunk``: the work
    ``message_host_seconds`` runs between messages; matrix products without one). A section is None when there
    are not two ranks for it."""
    out: dict[str, Any] = {"intra_node": None, "inter_node": None}
    local = world.local_world_size
    if local >= 2:
        out["intra_node"] = _measure_link(world, 1, list(range(local)), sizes, repeats, chunk)
    if world.num_nodes >= 2:
        out["inter_node"] = _measure_link(world, local, [k * local for k in range(world.num_nodes)], sizes,
                                          repeats, chunk)
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
