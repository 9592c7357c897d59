"""The one planning entry point: workload + cluster -> Plan.

contract (graph) -> scaling curves (estimator) -> per-level allocation (bisection + bi-point) -> wavefront
waves -> placement -> [CP-SAT refinement] -> [light levels laid out like their neighbours] -> [on several nodes,
the islands chosen for the whole schedule (planner/islands.py), where the planner's estimate gains] -> assembled,
validated Plan [and beside it the same with level tails settled into one wave (planner/tails.py), where the planner's
estimate gains]. The memory options (micro-batches, ZeRO stage, recomputation) are chosen around allocation and
placement by planner/memory_search.py.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

from megatron_spindle.estimator import AnalyticCostModel, MemoryModel
from megatron_spindle.estimator.estimate import SHARER_COUNTS
from megatron_spindle.flags import check_choices, finite_float, flag
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import MetaGraph, build_metagraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.parallel import MAX_AUTO_WORKERS, PARALLEL_MIN_DEVICES
from megatron_spindle.plan.schema import (
    ATTENTION_BACKENDS,
    DROPOUTS,
    RECOMPUTE_MODULES,
    RUNTIME_ZERO_STAGES,
    Plan,
    PlanError,
    dropout_mismatch,
    dropout_probability,
    dropouts,
    reduce_dtype,
    resolve_attention_backend,
)
from megatron_spindle.plan.validate import validate_plan
from megatron_spindle.planner.assemble import assemble_plan
from megatron_spindle.planner.light_levels import follow_neighbours
from megatron_spindle.planner.memory_search import fastest_zero_stage, search_memory_options
from megatron_spindle.planner.objective import estimate_iteration
from megatron_spindle.planner.placement import PlacementError, place, place_on_islands
from megatron_spindle.planner.schedule import LevelAllocation, ScheduledWave
from megatron_spindle.planner.tails import settle_tail, settled_levels, tail_starts

PLANNERS = ("wavefront", "cpsat")
INVERSES = ("rate", "time")
PLACEMENTS = ("spindle", "sequential")
RECOMPUTE = ("auto", "none", "selective", "full")
DISTRIBUTED_OPTIMIZER = ("auto", "off", "on")
EARLY_BACKWARD = ("auto", "on", "off")
SYNC_AWARE = ("auto", "on", "off")
TASK_SEGMENTS = ("auto", "off")
SELECTIONS = ("simulate", "none")
LIGHT_FOLLOW_SLACK = 0.01


@dataclass
class PlannerConfig:
    """How to plan; every field is a ``--spindle-*`` flag (megatron_spindle/flags.py)."""

    planner: str = field(default="cpsat", metadata=flag(
        "wavefront: the paper's greedy planner; cpsat: refined by an OR-Tools CP-SAT model warm-started from the "
        "greedy plan.", choices=PLANNERS))
    inverse: str = field(default="rate", metadata=flag(
        "Interpolation of T^-1 in the allocator: linear in rate 1/T (consistent with sum n* = N) or linear in T "
        "(the paper's eq. 11).", choices=INVERSES))
    placement: str = field(default="spindle", metadata=flag(
        "Device placement: island/flow/memory-aware heuristics, or consecutive devices (ablation).",
        choices=PLACEMENTS))
    solver_time_limit: float = field(default=10.0, metadata=flag("CP-SAT time limit in seconds."))
    solver_workers: int = field(default=2, metadata=flag("CP-SAT search workers."))
    solver_deterministic: bool = field(default=False, metadata=flag(
        "CP-SAT: count --spindle-solver-time-limit in the solver's deterministic time (its unit is meant to be "
        "about a second; 1-2 s of wall time each on a 2-core VM) and search with one worker, so that the plan "
        "depends on the inputs alone, not on the machine's speed or load (same OR-Tools version)."))
    cross_level_overlap: bool = field(default=False, metadata=flag(
        "CP-SAT: let a MetaOp start when its own producers end instead of at the level barrier."))
    recompute: str = field(default="auto", metadata=flag(
        "Activation recomputation of transformer layers: auto chooses per slice the cheapest of none, selective "
        "(subsets of the attention core, the pre-norms and the MLP) and full recomputation of k of its layers "
        "(the others rerunning nothing or such a subset) whose memory fits, and nothing when memory allows; "
        "none, selective, full: that for every layer. --recompute-granularity overrides it.",
        choices=RECOMPUTE))
    recompute_granularity: str | None = field(default=None, metadata=flag(
        "Megatron-style: recompute every layer slice's attention core (selective) or whole layers (full, with "
        "--recompute-method and --recompute-num-layers); the planner uses it as given.",
        name="--recompute-granularity", choices=("full", "selective")))
    recompute_modules: tuple[str, ...] | None = field(default=None, metadata=flag(
        "Megatron-style, with --recompute-granularity selective: the parts of every layer recomputed (core_attn, "
        "layernorm, mlp; default core_attn). mlp only where a module's MLP is bias-free (LLMs): encoders rerun the "
        "rest.", name="--recompute-modules", choices=RECOMPUTE_MODULES, type=str, nargs="+"))
    recompute_method: str | None = field(default=None, metadata=flag(
        "With --recompute-granularity full: uniform (every layer, in chunks of --recompute-num-layers; the "
        "default) or block (the first --recompute-num-layers layers of every slice).",
        name="--recompute-method", choices=("uniform", "block")))
    recompute_num_layers: int | None = field(default=None, metadata=flag(
        "With --recompute-granularity full: layers per chunk (uniform, default 1) or recomputed layers per slice "
        "(block, default all).", name="--recompute-num-layers"))
    micro_batches: str = field(default="auto", metadata=flag(
        "Split every task's batch into N micro-batches (gradient accumulation; N divides every batch, and each "
        "slice's data-parallel degree divides a micro-batch): auto trades the per-device efficiency of smaller "
        "micro-batches against memory, 1 when memory allows, and always 1 when a task has a contrastive loss "
        "(its negatives are the rest of its micro-batch, so splitting the batch changes the loss; an LM loss "
        "stays the same sum). A given N splits contrastive batches too, and the plan says so.",
        metavar="auto|N"))
    early_backward: str = field(default="auto", metadata=flag(
        "Start a task's backward as soon as its loss is computed, one wave after each later forward wave "
        "(freeing its activations while other tasks' forward goes on): auto where the plan fits no other way; "
        "plan selection (--spindle-select simulate) also times it where it would only save recomputation.",
        choices=EARLY_BACKWARD))
    task_segments: str = field(default="auto", metadata=flag(
        "auto: where memory binds the plans that run every task at once, plan selection (--spindle-select "
        "simulate) also times the tasks split into 2-4 segments of balanced work that run one after another, each "
        "its forward then its backward, each segment's tasks planned together (a device holds one segment's "
        "activations at a time; every task still trains on its whole batch, with one optimizer step); off: "
        "never.", choices=TASK_SEGMENTS))
    distributed_optimizer: str = field(default="auto", metadata=flag(
        "Shard each unit's optimizer state over the data-parallel ranks that run it (ZeRO-1, like "
        "--use-distributed-optimizer): on; off: never; auto switches it on only when memory requires it, and "
        "shards the gradients too (ZeRO-2), or the gradients and the weights (ZeRO-3, each layer gathered over "
        "its slice's data-parallel ranks around its use; on several nodes plan selection also times the weights "
        "sharded over a slice's ranks on each node, ZeRO++'s hpZ, so that the gathers stay inside it), where "
        "ZeRO-1 needs recomputation or binds placement.",
        choices=DISTRIBUTED_OPTIMIZER))
    sync_aware: str = field(default="auto", metadata=flag(
        "Scaling curves whose configurations carry the gradient sync they cannot hide behind their backward "
        "(estimator/estimate.py exposed_sync_seconds), so a MetaOp with large weights for its compute takes more "
        "tensor parallelism or fewer devices: on; off: T(n) is compute alone; auto: compute alone, and plan "
        "selection (--spindle-select simulate) also times the planner on sync-aware curves on several nodes "
        "(a second way of splitting shared weights' sync among their holders where it would add at least 10 %% "
        "to the plan's device time).", choices=SYNC_AWARE))
    overlap_param_gather: bool = field(default=True, metadata=flag(
        "Megatron's --overlap-param-gather, for plans with the distributed optimizer (ZeRO-1/2): the updated "
        "weights' all-gather after the optimizer step overlaps the next forward, which waits for a parameter "
        "device group's weights only before the first layer using them; at ZeRO-3 the redistribution of "
        "the shared weights' shards likewise, each slice's waited for before its forward (recorded in the "
        "plan, charged by the planner and the simulator, done by the runtime); --no-overlap-param-gather: the "
        "gather ends within the step.", name="--overlap-param-gather"))
    sequence_parallel: bool = field(default=False, metadata=flag(
        "Megatron's sequence parallelism in the transformer layers of slices with tensor parallelism: norms, "
        "residuals and dropouts on 1/TP of the sequence (their activations divided by TP), an all-gather and a "
        "reduce-scatter for each TP all-reduce. Applied where the sequence divides by TP or the module is causal "
        "(padded at its end); recorded in the plan, charged by the planner and the simulator, run by the runtime.",
        name="--sequence-parallel"))
    attention_backend: str = field(default="auto", metadata=flag(
        "Megatron-LM's --attention-backend: the attention core every transformer layer runs, which the planner and "
        "the simulator charge and the runtime builds. flash, fused, unfused: Transformer Engine's (flash and fused "
        "charged as FlashAttention, unfused with its scores in memory); local: megatron-core's local spec (unfused, "
        "softmax in fp32); auto: Transformer Engine's own choice where TE runs (charged as flash), else local (a "
        "CPU, or pretrain_multitask.py on a machine without TE). Recorded in the plan.",
        name="--attention-backend", choices=ATTENTION_BACKENDS))
    hidden_dropout: float = field(default=0.0, metadata=flag(
        "Megatron-LM's --hidden-dropout: dropout probability after each transformer layer's attention and MLP "
        "blocks. Recorded in the plan, charged by the planner and the simulator (the masks' kernels and memory), "
        "run by the runtime with masks drawn per layer, iteration, micro-batch and data-parallel shard, whatever "
        "the order the plan runs them in (models/dropout.py). Default 0, where Megatron-LM's is 0.1: give 0.1 to "
        "train as a Megatron-LM script that leaves the flag out.", name="--hidden-dropout", type=finite_float))
    attention_dropout: float = field(default=0.0, metadata=flag(
        "Megatron-LM's --attention-dropout: dropout probability on the attention probabilities (inside the "
        "kernel with FlashAttention). Recorded, charged and run as --hidden-dropout. Default 0, where "
        "Megatron-LM's is 0.1.", name="--attention-dropout", type=finite_float))
    overlap_grad_reduce: bool = field(default=True, metadata=flag(
        "Megatron-LM's --overlap-grad-reduce: reduce each gradient bucket as soon as the backward completes it, "
        "beside the rest of the backward; --no-overlap-grad-reduce: every bucket after the device's whole "
        "backward. Recorded in the plan, charged by the planner and the simulator, done by the runtime.",
        name="--overlap-grad-reduce"))
    ddp_bucket_size: int | None = field(default=None, metadata=flag(
        "Megatron-LM's --ddp-bucket-size: parameters per gradient bucket. Recorded in the plan, charged by the "
        "planner and the simulator (each bucket a collective: its latency, and what the backward has left to hide "
        "it), done by the runtime. Default: plan selection (--spindle-select simulate) times megatron-core's "
        "default, max(40M, 1M x the parameter device group's size), and 20M and 10M, and keeps the fastest; "
        "megatron-core's default with --spindle-select none.", name="--ddp-bucket-size"))
    grad_reduce_in_bf16: bool = field(default=False, metadata=flag(
        "Megatron-LM's --grad-reduce-in-bf16: accumulate and reduce the gradients in bf16 main-gradient buffers "
        "(2 bytes per parameter, where the default fp32 ones take 4), cast to fp32 for the optimizer step. Halves "
        "every gradient collective's bytes and the gradients' memory, at bf16's precision in the sums. Recorded "
        "in the plan (grad_reduce_dtype), charged by the planner and the simulator, done by the runtime.",
        name="--grad-reduce-in-bf16"))

    planning_workers: int = field(default=0, metadata=flag(
        "Processes that simulate the candidate plans and plan the node-group partitions at once, on clusters of "
        f"{PARALLEL_MIN_DEVICES} devices or more, where a candidate's simulation takes a tenth of a second or "
        "more. That work is deterministic: the selected plan does not depend on this. 0: the CPUs this process may "
        f"run on, at most {MAX_AUTO_WORKERS}; 1: all in this process."))
    select: str = field(default="simulate", metadata=flag(
        "simulate: plan a few candidates (the configured planner, the greedy wavefront plan, node-bounded "
        "slices, the tasks partitioned over groups of nodes, with and without the distributed optimizer) and keep "
        "the one the simulator times fastest "
        "(megatron_spindle/autoplan.py); none: the configured planner's plan.", choices=SELECTIONS))
    # Not flags: variants plan selection (megatron_spindle/autoplan.py) asks for. At most this many devices per
    # slice (0: no limit), for MetaOps that have a configuration that small: a node (gpus_per_node) keeps every
    # slice's collectives and hand-offs on NVLink.
    max_slice_devices: int = 0
    # Light MetaLevels laid out like their neighbours (planner/light_levels.py) when that lengthens the waves
    # by at most LIGHT_FOLLOW_SLACK.
    light_follow: bool = False
    # Also the plan with each heavy MetaLevel's last waves settled into one (planner/tails.py) where the planner's
    # estimate of the placed plan says the transfers it saves outweigh the balance it costs
    # (``PlanningResult.settled``).
    settle_tails: bool = False
    # On several nodes, the plan's islands chosen again for the whole schedule at once (planner/islands.py) where
    # the planner's estimate of the placed plan is faster than the greedy placement's. None: on in plan selection
    # (megatron_spindle/autoplan.py), off in a planner run alone, where its CP-SAT model's half second or so would be
    # several times the greedy planner's own time.
    whole_schedule_islands: bool | None = None
    # How sync-aware curves count a MetaOp's weight sharers (estimator/estimate.py SHARER_COUNTS): plan selection
    # tries each where they differ.
    sync_sharers: str = "metaop"
    # Whether the runtime's optimizer step computes the gradient norm (pretrain_multitask.py: --clip-grad > 0 or
    # fp16 loss scaling; the cost model's CostModelConfig.grad_norm), as Megatron-LM's default --clip-grad 1.0
    # makes it do. Plans record it (ExecutionSettings.grad_norm), so the simulator charges what was planned.
    grad_norm: bool = True

    def __post_init__(self):
        check_choices(self)
        for name in DROPOUTS:
            setattr(self, name, dropout_probability(getattr(self, name), f"--{name}"))
        if self.micro_batches != "auto" and not (str(self.micro_batches).isdigit() and int(self.micro_batches) > 0):
            raise ValueError(f"--spindle-micro-batches must be auto or a positive integer, got {self.micro_batches!r}")
        self.micro_batches = str(self.micro_batches)
        if self.recompute_modules is not None:
            self.recompute_modules = tuple(self.recompute_modules)
            if self.recompute_granularity != "selective":
                raise ValueError("--recompute-modules needs --recompute-granularity selective")
        if self.recompute_granularity != "full" and (self.recompute_method or self.recompute_num_layers is not None):
            raise ValueError("--recompute-method and --recompute-num-layers need --recompute-granularity full")
        if self.recompute_num_layers is not None and self.recompute_num_layers < 1:
            raise ValueError(f"--recompute-num-layers must be >= 1, got {self.recompute_num_layers}")
        if self.ddp_bucket_size is not None and self.ddp_bucket_size < 1:
            raise ValueError(f"--ddp-bucket-size must be positive, got {self.ddp_bucket_size}")
        if self.solver_time_limit < 0:
            raise ValueError(f"solver time limit must be >= 0, got {self.solver_time_limit}")
        if self.solver_workers < 1:
            raise ValueError(f"solver workers must be >= 1, got {self.solver_workers}")
        if self.planning_workers < 0:
            raise ValueError(f"--spindle-planning-workers must be >= 0, got {self.planning_workers}")
        if self.sync_sharers not in SHARER_COUNTS:
            raise ValueError(f"sync_sharers must be one of {SHARER_COUNTS}, got {self.sync_sharers!r}")

    def curve_sync_sharers(self) -> str | None:
        """How the planner's curves count a MetaOp's weight sharers when they carry its gradient sync
        (estimator/estimate.py ``weight_sharers``); None: the curves are compute alone (auto leaves sync-aware
        curves to plan selection as candidates)."""
        return self.sync_sharers if self.sync_aware == "on" else None

    @property
    def grad_reduce_dtype(self) -> str:
        """The plan setting --grad-reduce-in-bf16 chooses (plan/schema.py ``EXECUTION_CHOICES``)."""
        return reduce_dtype(self.grad_reduce_in_bf16)

    def zero_stages(self) -> tuple[int, ...]:
        """The ZeRO stages a plan may use: --spindle-distributed-optimizer on is Megatron's ZeRO-1, off none,
        auto every stage the runtime implements."""
        return {"off": (0,), "on": (1,), "auto": RUNTIME_ZERO_STAGES}[self.distributed_optimizer]

    def fixes_memory_options(self) -> bool:
        """The user gave recomputation, micro-batches or the early backward (a plan must use them)."""
        return (self.recompute != "auto" or self.recompute_granularity is not None or self.micro_batches != "auto"
                or self.early_backward == "on")


@dataclass
class PlanningResult:
    """Everything planning produced; baselines and benchmarks reuse the intermediate pieces."""

    plan: Plan
    metagraph: MetaGraph
    curves: dict[str, Any]
    level_allocs: list[LevelAllocation]
    greedy_waves: list[ScheduledWave]
    cost_model: AnalyticCostModel
    memory_model: MemoryModel
    timings: dict[str, float] = field(default_factory=dict)
    solver: Any = None  # CpSatResult when the CP-SAT planner ran
    # with ``settle_tails``: the same plan with level tails settled into one wave (planner/tails.py), where the
    # planner's estimate prefers it; plan selection times both (the estimate cannot see the variants it makes)
    settled: PlanningResult | None = None
    # where whole-schedule islands (planner/islands.py) replaced the placement's own, the plan placed without them:
    # the planner's estimate is of the plan as planned, and the variants plan selection makes of it (light levels
    # pinned, ZeRO, buckets) can lose by them, so plan selection times both
    greedy_islands: PlanningResult | None = None


def make_plan(workload: Workload, cluster: ClusterSpec, config: PlannerConfig | None = None,
              profile: dict | None = None, progress: Callable[[str], None] | None = None) -> Plan:
    return plan_workload(workload, cluster, config, profile, progress).plan


def for_cluster(config: PlannerConfig, cluster: ClusterSpec, profile=None) -> PlannerConfig:
    """``config`` with its attention backend as the plan records it on ``cluster`` (plan/schema.py
    ``resolve_attention_backend``: auto is the local spec on CPUs; a Transformer Engine backend there is an
    error). A caller that knows whether TE is present where the plan runs resolves it first (training/trainer).
    With a profile that recorded the attention it measured, auto is that one, and another is an error: the plan
    would charge measured times of kernels it does not run; so is dropout other than the profile's."""
    measured_dropout = getattr(profile, "dropout", None)  # measured times of other masks (or none) would be charged
    differs = measured_dropout and dropout_mismatch(measured_dropout, dropouts(config))
    if differs:
        flag, p, wanted = differs
        raise PlanError(f"the profile measured {flag} {p:g}, the plan is for {wanted:g}: give {flag} {p:g}, or "
                        f"profile with {flag} {wanted:g}")
    measured = getattr(profile, "attention_backend", None)
    if measured is not None and config.attention_backend == "auto" and cluster.gpu.arch != "cpu":
        return replace(config, attention_backend=measured)
    backend = resolve_attention_backend(config.attention_backend, cluster.gpu.arch)
    if measured is not None and backend != measured:
        raise PlanError(f"the profile measured attention backend '{measured}', the plan is for '{backend}': give "
                        f"--attention-backend {measured}, or profile with --attention-backend {backend}")
    return config if backend == config.attention_backend else replace(config, attention_backend=backend)


def plan_workload(workload: Workload, cluster: ClusterSpec, config: PlannerConfig | None = None,
                  profile: dict | None = None, progress: Callable[[str], None] | None = None,
                  placements: dict | None = None) -> PlanningResult:
    """``placements``: a dict shared by planning runs of the same workload, cluster and profile (plan selection's
    candidates, megatron_spindle/autoplan.py): the memory search's placements, which depend on neither the
    planner nor the order, are made once."""
    config = for_cluster(config or PlannerConfig(), cluster, profile)
    say = progress or (lambda msg: None)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t0
        now = time.perf_counter()
        timings[name] = now - t0
        t0 = now

    metagraph = build_metagraph(workload)
    say(f"graph: {len(metagraph.metaops)} MetaOps in {len(metagraph.levels)} MetaLevels")
    lap("contract")
    best = search_memory_options(metagraph, workload, cluster, config, profile, say, placements)
    lap("estimate+allocate+schedule+place")
    say(f"scaling curves: {len(best.curves)} ({sum(c.source == 'profiled' for c in best.curves.values())} profiled)")
    say(f"wavefront: {len(best.waves)} waves; memory: {best.describe()}")
    info: dict[str, Any] = {"planner": "wavefront", "requested": asdict(config)}  # + the finished plan's memory_options
    solver, greedy = None, best.placed
    staged: dict[int, tuple[Any, Any]] = {}  # id(candidate) -> (it, it at its fastest ZeRO stage)

    def restaged(cand):
        """``fastest_zero_stage`` once per candidate (and none again for its result): finish meets the CP-SAT
        plan again wherever the islands and tails left it as it was."""
        if id(cand) not in staged:
            out = fastest_zero_stage(cand, workload, cluster, metagraph, config)
            staged[id(cand)], staged[id(out)] = (cand, out), (out, out)
        return staged[id(cand)][1]

    if config.planner == "cpsat":
        from megatron_spindle.planner.cpsat import solve_cpsat

        say(f"cp-sat: refining the greedy plan (limit {config.solver_time_limit:g} "
            + ("units of deterministic time, 1 worker)" if config.solver_deterministic
               else f"s, {config.solver_workers} workers)"))
        solver = solve_cpsat(best.metagraph, workload, best.placed_on, best.curves, best.placed, best.cost_model,
                             best.memory_model_placed, time_limit=config.solver_time_limit,
                             workers=config.solver_workers, deterministic=config.solver_deterministic,
                             cross_level_overlap=config.cross_level_overlap,
                             level_allocs=best.level_allocs)
        info["planner"] = "cpsat"
        info["solver"] = solver.summary()
        refined = best.with_waves(solver.waves, cluster, config)
        if refined is not None and (refined.recomputes or best.recomputes):
            # the solver times the waves without recomputation: what its plan needs recomputed may cost more
            refined = refined if refined.estimate(workload, cluster, metagraph) <= \
                best.estimate(workload, cluster, metagraph) else None
            if refined is None:
                info["notes"] = ["the CP-SAT plan needs more recomputation than it saves; the greedy plan is kept"]
        if refined is not None:
            best = refined
        else:
            info.setdefault("notes", ["the CP-SAT plan fits no recomputation choice; the greedy plan is kept"])
        best = restaged(best)
        lap("cpsat")
    if config.light_follow:
        relaid = _light_levels_follow(best.placed, best.metagraph, workload, best.placed_on, best.curves,
                                      best.cost_model, best.memory_model_placed, config)
        refined = best.with_waves(relaid, cluster, config) if relaid is not best.placed else None
        best = refined or best
    best_greedy_islands, best = best, _on_whole_schedule_islands(best, workload, cluster, metagraph, config)
    lap("islands")
    settled = _settle_tails(best, workload, cluster, metagraph, config) if config.settle_tails else best
    settled_greedy_islands = settled
    if settled is not best:  # placed again by the tail search: its islands are the greedy placement's
        settled = _on_whole_schedule_islands(settled, workload, cluster, metagraph, config)
    lap("tails")

    def finish(chosen, notes: dict) -> PlanningResult:
        # the islands and tails placed the waves again: their ZeRO stage is chosen once more
        chosen = restaged(chosen)
        # plan selection (megatron_spindle/autoplan.py ``memory_bound``) plans again with memory unlimited where
        # this or the plan's memory options say memory shaped it
        planner_info = {**info, **notes, "memory_options": chosen.describe(), "memory_limited": chosen.memory_limited}
        plan = assemble_plan(workload, cluster, metagraph, chosen.charged_waves(), chosen.cost_model,
                             chosen.memory_model, planner_info, level_allocs=chosen.level_allocs, curves=chosen.curves,
                             settings=chosen.settings())  # the user's run settings included (run_settings)
        validate_plan(plan, workload, cluster, metagraph)
        plan.predicted.update(estimate_iteration(plan, metagraph, cluster, chosen.cost_model).as_predicted())
        return PlanningResult(plan, metagraph, chosen.curves, chosen.level_allocs, greedy, chosen.cost_model,
                              chosen.memory_model, timings, solver)

    def finish_both(chosen, greedy_islands, notes: dict) -> PlanningResult:
        if chosen is greedy_islands:
            return finish(chosen, notes)
        out = finish(chosen, {**notes, "islands": WHOLE_SCHEDULE_ISLANDS})
        out.greedy_islands = finish(greedy_islands, notes)
        return out

    result = finish_both(best, best_greedy_islands, {})
    if settled is not best:
        result.settled = finish_both(settled, settled_greedy_islands, {"settled_tails": True})
    lap("assemble")
    for r in (result, result.greedy_islands, result.settled, result.settled and result.settled.greedy_islands):
        if r is not None:
            r.plan.planner["planning_seconds"] = sum(timings.values())
    return result


WHOLE_SCHEDULE_ISLANDS = "chosen for the whole schedule (planner/islands.py)"  # plan.planner["islands"]


def _on_whole_schedule_islands(best, workload: Workload, cluster: ClusterSpec, metagraph: MetaGraph,
                               config: PlannerConfig):
    """``best`` placed again on the islands chosen for the whole schedule (planner/placement.py
    ``place_on_islands``, one placement per hint) where the planner's estimate of that placed plan is faster."""
    if not config.whole_schedule_islands or config.placement != "spindle" or best.placed_on.num_nodes < 2:
        return best
    placements = place_on_islands(best.placed, best.metagraph, workload, best.placed_on, best.cost_model,
                                  best.memory_model_placed)
    options = [o for o in (best.with_waves(placed, cluster, config) for placed in placements) if o is not None]
    fastest = min(options, key=lambda o: o.estimate(workload, cluster, metagraph), default=None)
    if fastest is None or fastest.estimate(workload, cluster, metagraph) >= best.estimate(workload, cluster, metagraph):
        return best
    return fastest


def _settle_tails(best, workload: Workload, cluster: ClusterSpec, metagraph: MetaGraph, config: PlannerConfig):
    """``best`` with, level by level, the settled tail (planner/tails.py) whose placed plan the planner's estimate
    times fastest, where that is faster than the level as it is."""
    for level in settled_levels(best.placed, best.metagraph):
        options = []
        for k in tail_starts(best.placed, level):
            settled = settle_tail(best.placed, level, k, best.curves, best.placed_on.num_devices)
            if settled is None:
                continue
            for critical_first in (False, True):  # a settled wave's slices differ in length: which goes first
                try:
                    placed = place(settled, best.metagraph, workload, best.placed_on, best.cost_model,
                                   best.memory_model_placed, strategy=config.placement, critical_first=critical_first)
                except PlacementError:
                    continue
                option = best.with_waves(placed, cluster, config)
                if option is not None:
                    options.append(option)
        fastest = min(options, key=lambda o: o.estimate(workload, cluster, metagraph), default=None)
        if fastest is not None and fastest.estimate(workload, cluster, metagraph) < \
                best.estimate(workload, cluster, metagraph):
            best = fastest
    return best


def _light_levels_follow(waves, metagraph, workload, cluster, curves, cost_model, memory_model, config):
    """The waves with light levels laid out like their neighbours (planner/light_levels.py) and placed again;
    the waves as they are when that does not place."""
    relaid = follow_neighbours(waves, metagraph, curves, cluster.num_devices)
    before = max((w.end for w in waves), default=0.0)
    if relaid == list(waves) or max((w.end for w in relaid), default=0.0) > before * (1 + LIGHT_FOLLOW_SLACK):
        return waves
    try:
        return place(relaid, metagraph, workload, cluster, cost_model, memory_model, strategy=config.placement)
    except PlacementError:
        return waves
