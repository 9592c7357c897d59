"""What every CP-SAT model of one planning call shares: the inputs, typed by what the planner reads of them, and
each MetaOp's slice options in integer time units.

Options: a MetaOp's scaling-curve points (``curve.valid_ns`` with ``curve.config(n)``, the fastest (tp, dp) for
each n) plus any configuration the greedy plan uses that is not among them, so the greedy plan is a solution of
every full-option model (the warm-start hint).

Time is integer: ``unit = 2 * ROUNDING_TOLERANCE * greedy_makespan / total_layers``; the rounding error of any
plan's makespan is at most ``sum_m L_m * max_c |T_c - unit * round(T_c / unit)|`` seconds, reported as
``rounding_error_bound`` (about ``ROUNDING_TOLERANCE * greedy_makespan``; ops shorter than half a unit are
kept at one unit so they are never free).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaGraph, MetaOp
from megatron_spindle.planner.allocator import Curve
from megatron_spindle.planner.cpsat.accounting import MemoryModel, layer_bytes
from megatron_spindle.planner.placement import FlowCostModel
from megatron_spindle.planner.schedule import ScheduledWave

# target relative rounding error of the makespan: finer units only make the models' numbers larger
ROUNDING_TOLERANCE = 1e-4
# the communication phase in CP-SAT up to this many devices; beyond, its range model does not solve in
# time and placement.place() alone chooses the devices
COMM_MODEL_DEVICES = 16


class CpSatMemoryError(ValueError):
    """A MetaOp whose smallest possible slice does not fit one device's memory."""


@dataclass
class CpSatOptions:
    """The model's two knobs that callers set (tests size the models with them); the rest are constants."""

    extra_waves: int = 2  # slots per level block beyond the hint's wave count there
    exact_memory_devices: int = 16  # per-device memory variables only up to this many devices


@dataclass(frozen=True)
class SliceOption:
    n: int
    tp: int
    dp: int
    seconds: float  # per layer
    units: int  # per layer, integer time units


@dataclass(frozen=True)
class Problem:
    """One planning call's inputs as the models read them."""

    metagraph: MetaGraph
    cluster: ClusterSpec
    slice_options: dict[str, list[SliceOption]]
    cost_model: FlowCostModel
    memory_model: MemoryModel
    settings: CpSatOptions
    workers: int
    level_c_stars: dict[int, float] = field(default_factory=dict)  # MetaLevel index -> C~*
    n_star: dict[str, float] = field(default_factory=dict)  # MetaOp -> continuous optimum allocation

    def layer_cap(self, metaop: MetaOp, option: SliceOption) -> int:
        """Most layers of the MetaOp one slice with ``option`` holds on a device (its layer count if no bytes)."""
        per_layer = layer_bytes(metaop, option.tp, option.dp, self.memory_model)
        if per_layer <= 0:
            return metaop.num_layers
        return min(metaop.num_layers, int(self.cluster.gpu.memory_bytes // per_layer))

    def bracketed(self, metaops: list[str], plan: list[ScheduledWave]) -> Problem | None:
        """The same problem with each MetaOp's options cut to the two device counts around its n* and the
        configurations ``plan`` uses; None without n*. Far fewer options: such models solve in a fraction
        of the time and seed the full ones."""
        if not all(m in self.n_star for m in metaops):
            return None
        used = {(s.metaop, s.n, s.tp, s.dp) for w in plan for s in w.slices}
        options = dict(self.slice_options)
        for m in metaops:
            ns = sorted({o.n for o in options[m]})
            keep = set([n for n in ns if n <= self.n_star[m]][-1:] + [n for n in ns if n > self.n_star[m]][:1])
            options[m] = [o for o in options[m] if o.n in keep or (m, o.n, o.tp, o.dp) in used]
        return replace(self, slice_options=options)

    @property
    def exact_memory_possible(self) -> bool:
        """Per-device memory in the model: only when it can bind and the cluster is small (the variables
        grow with devices x slots); otherwise per-slice fit in the model and a check after it."""
        return self.cluster.num_devices <= self.settings.exact_memory_devices and self._memory_can_bind()

    @property
    def has_comm(self) -> bool:
        """Communication phase in CP-SAT: several islands, and few enough devices for its range model."""
        return self.cluster.num_nodes > 1 and self.cluster.num_devices <= COMM_MODEL_DEVICES

    def _memory_can_bind(self) -> bool:
        """False when even every MetaOp's largest per-device footprint on one device fits."""
        worst = sum(mo.num_layers * max(layer_bytes(mo, o.tp, o.dp, self.memory_model)
                                        for o in self.slice_options[mid])
                    for mid, mo in self.metagraph.metaops.items())
        return worst > self.cluster.gpu.memory_bytes


def curve_options(mid: str, curve: Curve, greedy_waves: list[ScheduledWave]) -> list[SliceOption]:
    """Curve points (fastest config per n) plus the greedy plan's own configs, so the hint is in the model;
    without time units yet (``with_units``)."""
    opts: dict[tuple[int, int, int], SliceOption] = {}
    for n in curve.valid_ns:
        tp, dp = curve.config(n)
        opts[(n, tp, dp)] = SliceOption(n, tp, dp, float(curve.time(n)), 0)
    for w in greedy_waves:
        for s in w.slices:
            key = (s.n, s.tp, s.dp)
            if s.metaop == mid and key not in opts:
                opts[key] = SliceOption(s.n, s.tp, s.dp, s.time / (s.layer_end - s.layer_start), 0)
    return sorted(opts.values(), key=lambda o: (o.n, o.tp))


def time_unit(greedy_makespan: float, metagraph: MetaGraph) -> float:
    total_layers = sum(m.num_layers for m in metagraph.metaops.values())
    return 2.0 * ROUNDING_TOLERANCE * max(greedy_makespan, 1e-12) / max(total_layers, 1)


def with_units(options: list[SliceOption], unit: float) -> list[SliceOption]:
    return [SliceOption(o.n, o.tp, o.dp, o.seconds, max(1, round(o.seconds / unit))) for o in options]


def rounding_bound(metagraph: MetaGraph, slice_options: Mapping[str, list[SliceOption]], unit: float) -> float:
    """|true makespan - unit * model makespan| <= sum over waves of the worst slice error <= this."""
    return sum(m.num_layers * max(abs(o.seconds - o.units * unit) for o in slice_options[mid])
               for mid, m in metagraph.metaops.items())


def check_memory_fits(metagraph: MetaGraph, slice_options: Mapping[str, list[SliceOption]],
                      memory_model: MemoryModel, cluster: ClusterSpec) -> None:
    """Raise CpSatMemoryError if some MetaOp cannot place even one layer on a device in any configuration."""
    cap = cluster.gpu.memory_bytes
    for mid, m in metagraph.metaops.items():
        need = min(layer_bytes(m, o.tp, o.dp, memory_model) for o in slice_options[mid])
        if need > cap:
            raise CpSatMemoryError(
                f"MetaOp '{mid}' does not fit: one layer needs {need / 2**30:.2f} GiB per device in its most "
                f"sharded configuration, but a {cluster.gpu.name} device has {cap / 2**30:.2f} GiB")
