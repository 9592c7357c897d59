"""Device placement (paper section 3.5): which concrete devices run each slice of a wavefront schedule.

The "spindle" strategy places greedily, wave by wave. Inside a wave the slices with the most communication
go first (activation bytes flowing in from their producer slices plus their own TP/DP traffic, plus the
gradient sync they would spread onto the network away from the island earlier waves put their units on), so
the biggest flows, and the slices of a tower already placed, get the best spots; with ``critical_first`` the
slices that set the wave's length go before them (they have no slack: a transfer into them lengthens the
wave, where the others' transfers overlap the rest of it; which order moves less onto the critical path
depends on the waves, so the pipeline's estimate decides, planner/pipeline.py ``_settle_tails``). For each
slice:

- its devices sit in one island (node) when ``n <= gpus_per_node``; a larger slice takes whole nodes (plus
  one partial node for the remainder), so TP groups never straddle nodes;
- an island is chosen so that the wave stays packable (later slices still find an island each), then by the
  bytes of incoming rows already inside that island less the rows of later slices it would push out of their
  favourite island and less the gradient sync it would spread onto the network (units of the slice held on
  other islands only: their parameter device group would cross nodes), then by the bytes that become local
  copies;
- inside the island, device ``devices[r]`` is preferably the device that already holds the rows data-parallel
  rank ``r // tp`` needs (the producer's samples), then a device holding no rows later slices could copy
  locally, then a device that already holds the slice's weights (MetaOps sharing parameters co-locate,
  weights stored once), then the device with the most free memory.

Memory is tracked per device as the plan's predicted peak, by plan/memory.py's rules (``DeviceMemory``): the
parameter state of every unit a device runs, each unit once (selective storage), plus the activations of every
slice it runs (a Spindle plan is one segment: every forward finishes before the first backward). Devices a slice does not fit on are never
candidates, so an overflow falls back to worse-communication choices; when a wave cannot be placed at all, it
is placed again memory-first ("balance"), then up to ``max_backtrack`` earlier waves are placed again
memory-first. If that fails too, ``PlacementError`` names the wave, the MetaOp and the bytes.

``place_on_islands`` takes a placed schedule, chooses the islands of its slices again for the whole schedule at
once (planner/islands.py: a wave-by-wave choice cannot see that a slice's island now decides where the next
waves' slices of its MetaOp can go), and places the slices again inside them, each block on its island where
the island has room for it.

The "sequential" strategy is the paper's ablation baseline (Sp*): in each wave, slice after slice takes the
next run of consecutive device ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaGraph, MetaOp
from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan.layout import SlicePos, graph_transfer_pairs, position_rows, slice_units
from megatron_spindle.plan.memory import (
    GRAD_BYTES_PER_PARAM,
    DeviceMemory,
    ShardedNumbers,
    SliceMemory,
    grad_bytes_of,
    peak_memory,
    slice_memory,
    state_bytes_per_param,
)
from megatron_spindle.planner.islands import assign_islands, block_sizes, slice_blocks
from megatron_spindle.planner.schedule import ScheduledSlice, ScheduledWave

PLACEMENT_STRATEGIES = ("spindle", "sequential")
DEFAULT_MAX_BACKTRACK = 4
SLACK_RTOL = 1e-9  # a slice shorter than its wave by more than this (relative) has slack
TP_COLLECTIVES_PER_LAYER = 4  # Megatron TP: two all-reduces forward, two backward per transformer layer

SliceKey = SlicePos  # (wave index, slice index in the wave)


class PlacementError(ValueError):
    """The schedule cannot be placed: malformed input, or a slice that fits on no devices."""


class FlowCostModel(Protocol):
    """What placement needs from the estimator's ``AnalyticCostModel``."""

    def activation_bytes(self, metaop: MetaOp) -> float: ...

    def param_count(self, param_name: str) -> int: ...


def producer_slices(waves: Sequence[ScheduledWave], metagraph: MetaGraph) -> dict[SliceKey, list[SliceKey]]:
    """For every slice, the earlier slices whose output it reads (plan/layout.py transfer_pairs)."""
    producers: dict[SliceKey, list[SliceKey]] = {(wi, si): [] for wi, w in enumerate(waves) for si in range(len(w.slices))}
    for p, c in graph_transfer_pairs([w.slices for w in waves], metagraph):
        producers[c].append(p)
    return producers


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def predicted_memory(waves: Sequence[ScheduledWave], metagraph: MetaGraph, memory_model: ShardedNumbers,
                     cluster: ClusterSpec) -> list[float]:
    """Predicted peak bytes per device of placed waves run as one segment (plan/memory.py, the accounting
    placement tracks)."""
    for wi, w in enumerate(waves):
        for s in w.slices:
            if s.devices is None:
                raise PlacementError(f"wave {wi}: slice of MetaOp '{s.metaop}' has no devices yet")
    return peak_memory([w.slices for w in waves], metagraph.metaops, memory_model, cluster.num_devices)


# ------------------------------------------------------------------------------------------ the entry


def place(waves: Sequence[ScheduledWave], metagraph: MetaGraph, workload: Workload, cluster: ClusterSpec,
          cost_model: FlowCostModel, memory_model: ShardedNumbers, strategy: str = "spindle",
          max_backtrack: int = DEFAULT_MAX_BACKTRACK, critical_first: bool = False) -> list[ScheduledWave]:
    """Copies of ``waves`` with every slice's ``devices`` filled (any devices already set are replaced).
    ``critical_first``: inside a wave, the slices that set its length are placed first (module docstring).

    Deterministic: the same inputs give the same placement.
    """
    if strategy not in PLACEMENT_STRATEGIES:
        raise PlacementError(f"unknown placement strategy '{strategy}' (expected one of {PLACEMENT_STRATEGIES})")
    if not isinstance(max_backtrack, int) or max_backtrack < 0:
        raise PlacementError(f"max_backtrack must be a non-negative integer, got {max_backtrack!r}")
    _check_schedule(waves, metagraph, workload, cluster)
    problem = _Problem.build(waves, metagraph, cluster, cost_model, memory_model, critical_first)
    devices = _place_sequential(problem) if strategy == "sequential" else _place_spindle(problem, max_backtrack)
    return _with_devices(waves, devices)


def place_on_islands(waves: Sequence[ScheduledWave], metagraph: MetaGraph, workload: Workload,
                     cluster: ClusterSpec, cost_model: FlowCostModel, memory_model: ShardedNumbers,
                     max_backtrack: int = DEFAULT_MAX_BACKTRACK) -> list[list[ScheduledWave]]:
    """The placed ``waves`` placed again (the "spindle" strategy) inside the islands ``assign_islands`` chooses
    for the whole schedule, once per hint: their own islands and, where it differs (a schedule placed
    critical-first), the plain greedy placement's; the model is a short search from its hint. Each re-placement
    is returned once, where it places, is cheaper than its hint and differs from both the schedule and its hint;
    empty where there is none."""
    if any(len(s.devices or ()) != s.n for w in waves for s in w.slices):
        raise PlacementError("place_on_islands needs a placed schedule: every slice's devices set")
    _check_schedule(waves, metagraph, workload, cluster)
    problem = _Problem.build(waves, metagraph, cluster, cost_model, memory_model)
    placed = {(wi, si): list(s.devices) for wi, w in enumerate(waves) for si, s in enumerate(w.slices)}
    hints = [placed]
    try:
        greedy = _place_spindle(problem, max_backtrack)
    except PlacementError:
        greedy = placed
    if greedy != placed:
        hints.append(greedy)
    out: list[dict[SliceKey, list[int]]] = []
    for hint in hints:
        devices = _place_on_islands(problem, hint, max_backtrack)
        if devices is not None and devices not in (placed, hint) and devices not in out:
            out.append(devices)
    return [_with_devices(waves, devices) for devices in out]


def _with_devices(waves: Sequence[ScheduledWave], devices: dict[SliceKey, list[int]]) -> list[ScheduledWave]:
    return [
        replace(w, slices=[replace(s, devices=list(devices[(wi, si)])) for si, s in enumerate(w.slices)])
        for wi, w in enumerate(waves)
    ]


def _check_schedule(waves: Sequence[ScheduledWave], metagraph: MetaGraph, workload: Workload,
                    cluster: ClusterSpec) -> None:
    tasks = {t.name for t in workload.tasks}
    for wi, w in enumerate(waves):
        for s in w.slices:
            where = f"wave {wi}: slice of MetaOp '{s.metaop}'"
            m = metagraph.metaops.get(s.metaop)
            if m is None:
                raise PlacementError(f"{where}: the MetaGraph has no such MetaOp")
            if m.task and m.task not in tasks:
                raise PlacementError(f"{where}: task '{m.task}' is not in workload '{workload.name}'")
            if s.n < 1 or s.tp < 1 or s.dp < 1 or s.tp * s.dp != s.n:
                raise PlacementError(f"{where}: n {s.n} must equal tp {s.tp} x dp {s.dp} (all positive)")
            if m.batch % s.dp:
                raise PlacementError(f"{where}: dp {s.dp} does not divide the batch {m.batch}")
            if not 0 <= s.layer_start < s.layer_end <= m.num_layers:
                raise PlacementError(f"{where}: layer range [{s.layer_start}, {s.layer_end}) is not inside its "
                                     f"{m.num_layers} layers")
        if w.devices_used > cluster.num_devices:
            raise PlacementError(f"wave {wi}: slices need {w.devices_used} devices, the cluster has "
                                 f"{cluster.num_devices}")


# ------------------------------------------------------------------------------- per-slice precompute


@dataclass
class _SliceInfo:
    key: SliceKey
    metaop: MetaOp
    sched: ScheduledSlice
    memory: SliceMemory  # parameter-state bytes per unit and activations, on one device
    producers: list[SliceKey]
    flow_bytes: dict[SliceKey, float]  # producer -> activation bytes it sends (whole batch)
    volume: float  # incoming flow bytes + own TP/DP traffic: the ordering key inside a wave

    @property
    def n(self) -> int:
        return self.sched.n


@dataclass
class _Problem:
    waves: Sequence[ScheduledWave]
    cluster: ClusterSpec
    info: dict[SliceKey, _SliceInfo]
    critical_first: bool = False
    # main-gradient bytes per parameter (the memory numbers'; plan settings' grad_reduce_bytes): what the
    # gradient sync moves per parameter
    grad_bytes: int = GRAD_BYTES_PER_PARAM
    forced_islands: dict[tuple[SliceKey, int], int] = field(default_factory=dict)  # (slice, block) -> island

    @classmethod
    def build(cls, waves, metagraph, cluster, cost_model, memory_model, critical_first: bool = False) -> _Problem:
        producers = producer_slices(waves, metagraph)
        grad_bytes = grad_bytes_of(memory_model)
        info = {}
        for wi, w in enumerate(waves):
            for si, s in enumerate(w.slices):
                m = metagraph.metaops[s.metaop]
                mem = slice_memory(m, s, memory_model)
                flows = {p: float(cost_model.activation_bytes(metagraph.metaops[waves[p[0]].slices[p[1]].metaop]))
                         for p in producers[(wi, si)]}
                volume = sum(flows.values()) + _own_traffic_bytes(m, s, cost_model, grad_bytes)
                info[(wi, si)] = _SliceInfo((wi, si), m, s, mem, producers[(wi, si)], flows, volume)
        return cls(waves, cluster, info, critical_first, grad_bytes)

    def grad_per_state_byte(self, sl: _SliceInfo) -> float:
        """A unit's gradient bytes (all TP shards) per byte of its parameter state on one of the slice's devices."""
        return self.grad_bytes / state_bytes_per_param(self.grad_bytes) * sl.sched.tp

    def slice_order(self, wi: int, sync_stake: dict[SliceKey, float]) -> list[SliceKey]:
        """Biggest communication first (with ``critical_first``, after the slices as long as the wave); larger
        slices before smaller ones on ties (they are harder to fit). ``sync_stake``: per slice the gradient bytes
        it would spread onto the network on its worst island rather than its best (units earlier waves placed),
        counted with its communication, so a slice whose tower already sits on a node gets there before others
        fill it."""
        keys = [(wi, si) for si in range(len(self.waves[wi].slices))]
        longest = max((self.info[k].sched.time for k in keys), default=0.0)

        def slack(k: SliceKey) -> bool:
            return self.critical_first and self.info[k].sched.time < longest * (1.0 - SLACK_RTOL)

        return sorted(keys, key=lambda k: (slack(k), -(self.info[k].volume + sync_stake[k]), -self.info[k].n,
                                           k[1]))


def _own_traffic_bytes(m: MetaOp, s: ScheduledSlice, cost_model: FlowCostModel, grad_bytes: int) -> float:
    """Bytes a slice moves inside its own device group: TP all-reduces of activations (ring: 2(tp-1)/tp of the
    tensor per device) and the DP all-reduce of its gradients (``grad_bytes`` per parameter)."""
    layers = s.layer_end - s.layer_start
    tp_bytes = 0.0
    if s.tp > 1 and m.kind == "layer":
        tp_bytes = layers * TP_COLLECTIVES_PER_LAYER * 2 * (s.tp - 1) * float(cost_model.activation_bytes(m))
    dp_bytes = 0.0
    if s.dp > 1:
        params = sum(cost_model.param_count(u) for u in slice_units(m, s.layer_start, s.layer_end))
        dp_bytes = 2 * (s.dp - 1) * grad_bytes * params
    return tp_bytes + dp_bytes


# ---------------------------------------------------------------------------------------- sequential


def _place_sequential(problem: _Problem) -> dict[SliceKey, list[int]]:
    memory = DeviceMemory(problem.cluster.num_devices, problem.cluster.gpu.memory_bytes)
    devices: dict[SliceKey, list[int]] = {}
    for wi, w in enumerate(problem.waves):
        cursor = 0
        for si in range(len(w.slices)):
            sl = problem.info[(wi, si)]
            chosen = list(range(cursor, cursor + sl.n))
            cursor += sl.n
            over = [d for d in chosen if memory.need(d, sl.memory) > memory.free(d)]
            if over:
                raise _overflow_error(sl, memory, chosen, "sequential placement")
            for d in chosen:
                memory.forward(d, sl.memory)
            devices[(wi, si)] = chosen
    return devices


# ------------------------------------------------------------------------------------------- spindle


class _WaveDoesNotFit(Exception):
    def __init__(self, sl: _SliceInfo, candidates: list[int]):
        super().__init__(sl.key)
        self.slice = sl
        self.candidates = candidates


@dataclass
class _State:
    memory: DeviceMemory
    devices: dict[SliceKey, list[int]] = field(default_factory=dict)

    def copy(self) -> _State:
        return _State(self.memory.copy(), dict(self.devices))


def _place_spindle(problem: _Problem, max_backtrack: int) -> dict[SliceKey, list[int]]:
    num_waves = len(problem.waves)
    modes = ["comm"] * num_waves
    depth_tried = [0] * num_waves
    snapshots: list[_State | None] = [None] * (num_waves + 1)
    snapshots[0] = _State(DeviceMemory(problem.cluster.num_devices, problem.cluster.gpu.memory_bytes))
    wi = 0
    while wi < num_waves:
        state = snapshots[wi].copy()
        try:
            _place_wave(problem, wi, state, modes[wi])
        except _WaveDoesNotFit as failure:
            if modes[wi] == "comm":
                modes[wi] = "balance"  # the same wave again, memory first
                continue
            depth_tried[wi] += 1
            depth = depth_tried[wi]
            if depth > max_backtrack or depth > wi:
                tried = min(depth - 1, wi)
                raise _overflow_error(failure.slice, snapshots[wi].memory, failure.candidates,
                                      f"placement (backtracked {tried} wave(s))") from None
            start = wi - depth
            for k in range(start, wi + 1):
                modes[k] = "balance"
            wi = start
            continue
        snapshots[wi + 1] = state
        wi += 1
    return snapshots[num_waves].devices


def _place_on_islands(problem: _Problem, placed: dict[SliceKey, list[int]],
                      max_backtrack: int) -> dict[SliceKey, list[int]] | None:
    """The slices placed again inside the islands ``assign_islands`` chooses for the whole schedule, hinted by
    those of the ``placed`` devices; None where the choice is no cheaper or does not place."""
    cluster = problem.cluster
    gpn = cluster.gpus_per_node
    hint = {}
    for key, devs in placed.items():
        s = problem.info[key].sched
        for b, (start, size, _, _) in enumerate(slice_blocks(s.n, s.tp, s.dp, gpn)):
            islands = [cluster.island(d) for d in devs[start:start + size]]
            hint[(key, b)] = max(set(islands), key=lambda i: (islands.count(i), -i))
    chosen = assign_islands(
        {key: (sl.n, sl.sched.tp, sl.sched.dp) for key, sl in problem.info.items()},
        {key: sl.producers for key, sl in problem.info.items()},
        {key: sl.flow_bytes for key, sl in problem.info.items()},
        {key: {u: problem.grad_per_state_byte(sl) * b for u, b in sl.memory.units.items()}
         for key, sl in problem.info.items()},
        [[(wi, si) for si in range(len(w.slices))] for wi, w in enumerate(problem.waves)],
        cluster.num_nodes, gpn, hint)
    if chosen is None:  # nothing cheaper than the islands as placed
        return None
    try:
        return _place_spindle(replace(problem, forced_islands=chosen), max_backtrack)
    except PlacementError:
        return None


def _overflow_error(sl: _SliceInfo, memory: DeviceMemory, candidates: list[int], what: str) -> PlacementError:
    """Name the slice, what one of its devices needs, and how many of the candidate devices have that room."""
    s = sl.sched
    needs = {d: memory.need(d, sl.memory) for d in candidates}
    need = min(needs.values(), default=sl.memory.activations + sum(sl.memory.units.values()))
    roomy = sum(1 for d in candidates if needs[d] <= memory.free(d))
    free = max((memory.free(d) for d in candidates), default=0.0)
    gib = 2**30
    return PlacementError(
        f"wave {sl.key[0]}: {what} found no {s.n} devices with room for MetaOp '{sl.metaop.id}' layers "
        f"[{s.layer_start}, {s.layer_end}) (tp {s.tp}, dp {s.dp}): it needs {need:.0f} bytes ({need / gib:.2f} GiB) "
        f"per device (activations {sl.memory.activations:.0f} bytes, parameter state up to "
        f"{sum(sl.memory.units.values()):.0f} bytes), but only {roomy} of its {len(candidates)} candidate devices "
        f"have that much free (the most: {free:.0f} bytes, {free / gib:.2f} GiB; capacity {memory.capacity:.0f} "
        f"bytes per device)"
    )


def _place_wave(problem: _Problem, wi: int, state: _State, mode: str) -> None:
    cluster = problem.cluster
    free_devices = set(range(cluster.num_devices))
    keys = [(wi, si) for si in range(len(problem.waves[wi].slices))]
    # producers sit in earlier waves and a device taken in this wave is no candidate any more, so each
    # slice's scores can be computed once, up front (the order counts their sync stakes)
    unit_islands = _unit_islands(state.memory, cluster, {u for key in keys for u in problem.info[key].memory.units})
    scorers = {key: _Scorer(problem, problem.info[key], state, unit_islands) for key in keys}
    order = problem.slice_order(wi, {key: sc.sync_stake() for key, sc in scorers.items()})
    for pos, key in enumerate(order):
        sl = problem.info[key]
        pending = _Pending.of([scorers[k] for k in order[pos + 1:]], cluster)
        chosen = _place_slice(scorers[key], free_devices, pending, mode, problem.forced_islands)
        for d in chosen:
            state.memory.forward(d, sl.memory)
            free_devices.discard(d)
        state.devices[key] = chosen


@dataclass
class _Pending:
    """What the slices not yet placed in this wave want, so that an earlier slice leaves it alone when it can:
    their island-sized blocks (to keep the wave packable), the island holding most of each block's rows, and
    the bytes of their rows on every device (local copies they could make)."""

    blocks: list[int]
    island_wants: list[tuple[int, int, float]]  # (favourite island, block size, bytes of the block's rows there)
    device_demand: dict[int, float]

    @classmethod
    def of(cls, scorers: list[_Scorer], cluster: ClusterSpec) -> _Pending:
        blocks: list[int] = []
        wants: list[tuple[int, int, float]] = []
        demand: dict[int, float] = {}
        for sc in scorers:
            blocks += block_sizes(sc.sl.n, cluster.gpus_per_node)
            wants += sc.block_wants()
            for d, b in sc.device_demand().items():
                demand[d] = demand.get(d, 0.0) + b
        return cls(blocks, wants, demand)

    def displaced_bytes(self, island: int, free_before: int, taken: int) -> float:
        """Rows of later slices that could have stayed on ``island`` but no longer find room there."""
        return sum(b for i, n, b in self.island_wants if i == island and free_before >= n > free_before - taken)


def _packable(capacities: tuple[int, ...], sizes: list[int]) -> bool:
    """First-fit decreasing: can every block still get an island of its own? Both sorted largest first."""
    caps = list(capacities)
    for size in sizes:
        for i, c in enumerate(caps):
            if c >= size:
                caps[i] = c - size
                break
        else:
            return False
    return True


def _unit_islands(memory: DeviceMemory, cluster: ClusterSpec, units: set[str]) -> dict[str, set[int]]:
    """unit -> the islands whose devices hold its state so far, for these units (once for a wave's slices)."""
    out: dict[str, set[int]] = {u: set() for u in units}
    for d, have in enumerate(memory.held):
        for u in units & have.keys():
            out[u].add(cluster.island(d))
    return out


class _Scorer:
    """Communication and memory scores of putting one slice's positions on devices (cached per device)."""

    def __init__(self, problem: _Problem, sl: _SliceInfo, state: _State, unit_islands: dict[str, set[int]]):
        self.cluster = problem.cluster
        self.sl = sl
        self.memory = state.memory
        s = sl.sched
        # per producer: device -> the samples [lo, hi) of its output it holds, and the bytes per sample
        sources: list[tuple[dict[int, tuple[int, int]], float]] = []
        for p in sl.producers:
            ps, batch = problem.info[p].sched, problem.info[p].metaop.batch
            held = {d: position_rows(r, ps.tp, ps.dp, batch) for r, d in enumerate(state.devices[p])}
            sources.append((held, sl.flow_bytes[p] / batch))
        # device -> {position: bytes of that position's rows the device already holds}, and the same per island
        # (a row range held by several TP replicas of an island counts once), both sparse
        self.local: dict[int, dict[int, float]] = {}
        self.in_island: dict[int, dict[int, float]] = {}
        self._per_rank = sl.metaop.batch // s.dp
        for held, bytes_per_sample in sources:
            for d, rows in held.items():
                self._add_rows(self.local.setdefault(d, {}), rows, bytes_per_sample)
            island_rows = {(self.cluster.island(d), rows) for d, rows in held.items()}
            for island, rows in sorted(island_rows):
                self._add_rows(self.in_island.setdefault(island, {}), rows, bytes_per_sample)
        self._shared: dict[int, float] = {}
        self._free_after: dict[int, float] = {}
        # islands already holding each of the slice's units, and the weight of their gradients: a unit held on
        # another island makes its parameter device group's gradient sync cross the network
        self._unit_islands = {u: unit_islands[u] for u in sl.memory.units}
        # a unit's gradient bytes per byte of its parameter state; state bytes are per TP shard
        self._sync_weight = problem.grad_per_state_byte(sl)
        self._sync_penalty: dict[int, float] = {}
        self._block_wants: list[tuple[int, int, float]] | None = None
        self._device_demand: dict[int, float] | None = None

    def local_bytes(self, position: int, device: int) -> float:
        table = self.local.get(device)
        return table.get(position, 0.0) if table else 0.0

    def best_local_bytes(self, positions: range, devices: list[int]) -> float:
        """Upper bound of the local-copy bytes these devices can give the positions (one device each)."""
        best: dict[int, float] = {}
        for d in devices:
            for r, b in self.local.get(d, {}).items():
                if r in positions and b > best.get(r, 0.0):
                    best[r] = b
        return sum(best.values())

    def _add_rows(self, table: dict[int, float], rows: tuple[int, int], bytes_per_sample: float) -> None:
        """Credit every position whose samples overlap ``rows`` with the overlapping bytes."""
        per_rank, tp = self._per_rank, self.sl.sched.tp
        for rank in range(rows[0] // per_rank, (rows[1] - 1) // per_rank + 1):
            common = _overlap(rows, (rank * per_rank, (rank + 1) * per_rank)) * bytes_per_sample
            for r in range(rank * tp, (rank + 1) * tp):
                table[r] = table.get(r, 0.0) + common

    def sync_penalty(self, island: int) -> float:
        """Activation-byte equivalent of the gradient sync that spreads onto the network when the slice goes to
        ``island``: the gradient bytes of its units held on other islands only. Both cross the network on the
        slice's n devices' own paths (a transfer moves 1/n of the rows per device, forward and back; a ring's
        all-reduce about twice each rank's gradients at the bandwidth of the GPUs its thinnest node holds), so
        a gradient byte weighs about as much as a byte of rows."""
        if island not in self._sync_penalty:
            self._sync_penalty[island] = self._sync_weight * sum(
                b for u, b in self.sl.memory.units.items()
                if self._unit_islands[u] and island not in self._unit_islands[u])
        return self._sync_penalty[island]

    def sync_stake(self) -> float:
        """The gradient sync (activation-byte equivalent, ``sync_penalty``) the slice spreads onto the network on
        its worst island beyond its best."""
        penalties = [self.sync_penalty(i) for i in range(self.cluster.num_nodes)]
        return max(penalties) - min(penalties)

    def island_bytes(self, positions: range, island: int) -> float:
        """Bytes these positions need that some producer device on the island already holds."""
        table = self.in_island.get(island)
        return sum(b for r, b in table.items() if r in positions) if table else 0.0

    def shared(self, device: int) -> float:
        if device not in self._shared:
            self._shared[device] = self.memory.shared_param_bytes(device, self.sl.memory.units)
        return self._shared[device]

    def free_after(self, device: int) -> float:
        if device not in self._free_after:
            need = self.memory.need(device, self.sl.memory, self.shared(device))
            self._free_after[device] = self.memory.free(device) - need
        return self._free_after[device]

    def block_wants(self) -> list[tuple[int, int, float]]:
        """For each island-sized block of the slice: (island holding most of the block's rows, block size,
        those bytes); blocks without rows anywhere are left out."""
        if self._block_wants is not None:
            return self._block_wants
        islands = sorted({self.cluster.island(d) for d in self.local})
        wants = []
        start = 0
        for size in block_sizes(self.sl.n, self.cluster.gpus_per_node):
            positions = range(start, start + size)
            start += size
            scored = [(self.island_bytes(positions, i), -i) for i in islands]
            if scored:
                best, neg_island = max(scored)
                if best > 0:
                    wants.append((-neg_island, size, best))
        self._block_wants = wants
        return wants

    def device_demand(self) -> dict[int, float]:
        """Bytes of this slice's rows on each device holding some (the most it could copy locally there)."""
        if self._device_demand is None:
            self._device_demand = {d: max(table.values(), default=0.0) for d, table in self.local.items()}
        return self._device_demand

    def match(self, positions: range, devices: list[int], mode: str,
              demand: dict[int, float] | None = None) -> dict[int, int]:
        """Greedy matching position -> device. comm: local rows, then devices later slices of the wave want
        least (``demand``: bytes of their rows on the device), then shared weights, then free memory;
        balance: free memory first."""
        if mode == "comm":
            return self._match_comm(positions, devices, demand or {})
        pairs = sorted((((self.free_after(d), self.local_bytes(r, d), self.shared(d)), -d, -r)
                        for d in devices for r in positions), reverse=True)
        return _greedy(pairs, len(positions), {}, set())

    def _match_comm(self, positions: range, devices: list[int], demand: dict[int, float]) -> dict[int, int]:
        # pairs that make a local copy first; the rest only depends on the device
        pairs = []
        for d in devices:
            for r, local in self.local.get(d, {}).items():
                if local > 0 and r in positions:
                    pairs.append(((local, self.shared(d), self.free_after(d)), -d, -r))
        pairs.sort(reverse=True)
        out = _greedy(pairs, len(positions), {}, set())
        used = set(out.values())
        rest = sorted((d for d in devices if d not in used),
                      key=lambda d: (demand.get(d, 0.0), -self.shared(d), -self.free_after(d), d))
        for r, d in zip((r for r in positions if r not in out), rest):
            out[r] = d
        return out


def _greedy(pairs: list, wanted: int, out: dict[int, int], used: set[int]) -> dict[int, int]:
    """Take (key, -device, -position) pairs best first while both sides are free."""
    for _, neg_d, neg_r in pairs:
        r, d = -neg_r, -neg_d
        if r in out or d in used:
            continue
        out[r] = d
        used.add(d)
        if len(out) == wanted:
            break
    return out


def _place_slice(scorer: _Scorer, free_devices: set[int], pending: _Pending, mode: str,
                 forced: dict[tuple[SliceKey, int], int] | None = None) -> list[int]:
    cluster = scorer.cluster
    sl = scorer.sl
    fitting = sorted(d for d in free_devices if scorer.free_after(d) >= 0)
    if len(fitting) < sl.n:
        raise _WaveDoesNotFit(sl, sorted(free_devices))
    free_count = [0] * cluster.num_nodes
    for d in free_devices:
        free_count[cluster.island(d)] += 1
    by_island: dict[int, list[int]] = {}
    for d in fitting:
        by_island.setdefault(cluster.island(d), []).append(d)
    available = {i: _IslandDevices(scorer, devs) for i, devs in by_island.items()}
    blocks = block_sizes(sl.n, cluster.gpus_per_node)
    assignment: dict[int, int] = {}
    start = 0
    for bi, size in enumerate(blocks):
        positions = range(start, start + size)
        start += size
        island = forced.get((sl.key, bi)) if forced else None
        allowed = available if island is None or len(available.get(island, ())) < size else \
            {island: available[island]}
        picked = _pick_island(scorer, positions, allowed, free_count, blocks[bi + 1:], pending, mode)
        if picked is None:
            return _place_split(scorer, fitting, mode)
        island, matched = picked
        assignment.update(matched)
        taken = set(matched.values())
        available[island] = _IslandDevices(scorer, [d for d in available[island].devices if d not in taken])
        free_count[island] -= size
    return [assignment[r] for r in range(sl.n)]


class _IslandDevices:
    """One island's devices a slice may still take, with what ``_pick_island`` ranks them by: the slice's shared
    weights and free memory per device, best first (computed once per island, not once per block)."""

    def __init__(self, scorer: _Scorer, devices: list[int]):
        self.devices = devices
        self.shared = sorted((scorer.shared(d) for d in devices), reverse=True)
        self.free_after = sorted((scorer.free_after(d) for d in devices), reverse=True)
        self.has_local = any(d in scorer.local for d in devices)

    def __len__(self) -> int:
        return len(self.devices)


def _pick_island(scorer: _Scorer, positions: range, available: dict[int, _IslandDevices], free_count: list[int],
                 own_blocks: list[int], pending: _Pending, mode: str) -> tuple[int, dict[int, int]] | None:
    """Best island for one block of positions, keeping the rest of the wave packable when possible.

    comm: the slice's rows already in the island minus the rows of later slices it pushes out, then the best
    local copy per position, the weights and the free memory of its best devices (cheap bounds: only the
    winner is matched device by device). balance: free memory first."""
    size = len(positions)
    later_blocks = sorted(own_blocks + pending.blocks, reverse=True)
    # whether the rest of the wave stays packable depends only on the taken island's free count (the multiset of
    # counts left is the same for islands with equal counts)
    packable: dict[int, bool] = {}
    candidates = []
    for island, devs in available.items():
        if len(devs) < size:
            continue
        in_island = scorer.island_bytes(positions, island)
        in_island -= pending.displaced_bytes(island, free_count[island], size)
        in_island -= scorer.sync_penalty(island)
        local = scorer.best_local_bytes(positions, devs.devices) if devs.has_local else 0
        shared = sum(devs.shared[:size])
        min_free = devs.free_after[size - 1]
        key = (in_island, local, shared, min_free) if mode == "comm" else (min_free, in_island, local, shared)
        count = free_count[island]
        if count not in packable:
            caps = list(free_count)
            caps[island] -= size
            packable[count] = _packable(tuple(sorted(caps, reverse=True)), later_blocks)
        candidates.append((packable[count], key, -island))
    if not candidates:
        return None
    _, _, neg_island = max(candidates)
    island = -neg_island
    return island, scorer.match(positions, available[island].devices, mode, pending.device_demand)


def _place_split(scorer: _Scorer, fitting: list[int], mode: str) -> list[int]:
    """No island can take the slice: spread it over the fewest islands, TP groups kept inside nodes where the
    free devices allow it."""
    cluster = scorer.cluster
    s = scorer.sl.sched
    by_island: dict[int, list[int]] = {}
    for d in fitting:
        by_island.setdefault(cluster.island(d), []).append(d)
    everyone = range(s.n)
    island_rank = sorted(by_island, key=lambda i: (-len(by_island[i]), -scorer.island_bytes(everyone, i), i))
    chosen: list[int] = []
    for whole_groups in (True, False):
        for island in island_rank:
            devs = [d for d in by_island[island] if d not in chosen]
            take = min(len(devs), s.n - len(chosen))
            if whole_groups:
                take -= take % s.tp
            chosen += sorted(devs, key=lambda d: (-scorer.free_after(d), d))[:take]
    # positions of one TP group go to devices of one node: match block by block in island order
    chosen.sort(key=lambda d: (island_rank.index(cluster.island(d)), d))
    assignment: dict[int, int] = {}
    for g in range(0, s.n, s.tp):
        positions = range(g, g + s.tp)
        group_devices = chosen[g:g + s.tp]
        assignment.update(scorer.match(positions, group_devices, mode))
    return [assignment[r] for r in range(s.n)]

