#!/usr/bin/env python
"""Runtime engine on CPU: overhead against plain PyTorch, and measured against simulated iteration time.

1. One rank: seconds per training step of ``runtime.RuntimeEngine`` (a plan for one CPU device) against a plain
   PyTorch loop over the same megatron-core modules (``models.reference.ReferenceModel`` + AdamW). Steps of the
   two alternate so that machine load hits both alike. Target: engine / plain <= 1.05. Also the simulator's
   time of that plan from a profile taken on the rank afterwards: the model of one rank, without a second
   rank's effects (printed, no target).
2. Two gloo ranks (spawned): the workload is profiled on the two ranks (tools/profile_metaops.py's measuring code),
   planned from that profile as ``tools/plan.py --spindle-profile`` plans (plan selection on the profile's
   operators, links and message cost), and the engine's measured iteration time is compared with the
   simulator's prediction from the same measurements (``ProfiledCostModel``, links at the measured bandwidth and
   latency, the compute each message costs a rank, the AdamW step at the measured per-element and per-tensor
   cost). The CPU's speed drifts by tens of percent
   within seconds (shared machine), so ``--rounds`` rounds each profile again and then time ``--steps`` steps;
   each round's median step is compared with the simulation of the one plan (made from the first profile)
   from that round's profile, and the median of the per-round ratios is the result. Each rank is pinned to its
   own core (``--no-pin`` to leave them to the scheduler). Target: within 20 %.

Printed, not asserted, and written (runtime_cpu.txt, .json) to --out-dir. Example:
    python benchmarks/runtime_cpu.py --workload tiny-clip --steps 8
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_output import Recording, add_output_args

from megatron_spindle.arguments import add_workload_args, build_parser, workload_from_args
from megatron_spindle.planner.pipeline import PLANNERS

OVERHEAD_TARGET = 1.05
SIMULATION_TARGET = 0.20


def add_benchmark_args(parser):
    g = parser.add_argument_group("benchmark")
    g.add_argument("--steps", type=int, default=6, help="Timed steps (the median is reported).")
    g.add_argument("--warmup", type=int, default=2, help="Untimed steps first.")
    g.add_argument("--threads", type=int, default=1, help="torch threads per process.")
    g.add_argument("--planner", choices=PLANNERS, default="wavefront")
    g.add_argument("--profile", default=None,
                   help="Use this 2-device CPU profile (tools/profile_metaops.py) instead of profiling first.")
    g.add_argument("--profile-layers", type=int, default=2)
    g.add_argument("--profile-repeats", type=int, default=5)
    g.add_argument("--rounds", type=int, default=5,
                   help="Two ranks: rounds of (profile, timed steps); the median per-round ratio is the result.")
    g.add_argument("--no-pin", action="store_true", help="Do not pin each of the two ranks to its own core.")
    g.add_argument("--skip-one-rank", action="store_true")
    g.add_argument("--skip-two-ranks", action="store_true")
    return parser


def _median_after_warmup(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:] or times)


# ------------------------------------------------------------------------------------------------ one rank


def one_rank(workload, args) -> dict[str, float]:
    from megatron_spindle.compat.cpu import apply_cpu_shim
    from megatron_spindle.compat.groups import ensure_torch_distributed
    from megatron_spindle.data.mock import mock_batch
    from megatron_spindle.graph.cluster import make_cluster
    from megatron_spindle.models.reference import ReferenceModel
    from megatron_spindle.planner.pipeline import PlannerConfig, make_plan
    from megatron_spindle.runtime.engine import EngineConfig, RuntimeEngine

    apply_cpu_shim()
    ensure_torch_distributed()
    plan = make_plan(workload, make_cluster(1, 1, "CPU"), PlannerConfig(planner=args.planner, grad_norm=False))
    config = EngineConfig()
    engine = RuntimeEngine(plan, workload, 0, 1, config)
    model = ReferenceModel(workload)
    params = list(dict.fromkeys(model.full_named_parameters().values()))
    opt_cfg = config.optimizer
    optimizer = torch.optim.AdamW(params, lr=opt_cfg.lr, betas=opt_cfg.betas, eps=opt_cfg.eps,
                                  weight_decay=opt_cfg.weight_decay)
    tasks = [t.name for t in workload.tasks]

    def plain_step(step: int) -> None:
        batches = {t: mock_batch(workload, t, step, config.data_seed) for t in tasks}
        optimizer.zero_grad(set_to_none=True)
        model.total_loss(model(batches)).backward()
        optimizer.step()

    engine_times, plain_times = [], []
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        engine.train_step(step)
        engine_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        plain_step(step)
        plain_times.append(time.perf_counter() - t0)
    return {"engine": _median_after_warmup(engine_times, args.warmup),
            "plain": _median_after_warmup(plain_times, args.warmup), "waves": len(plan.waves),
            "simulated": _simulated_one_rank(plan, workload, args)}


def _simulated_one_rank(plan, workload, args) -> float:
    """The simulator's time of the one-rank plan from a profile taken on this rank just after the steps: what
    the model gets wrong without a second rank (the two-rank rows measure the rest)."""
    from megatron_spindle.graph.cluster import ClusterSpec
    from megatron_spindle.profiler import ProfileWorld, run_profile

    cluster = ClusterSpec.from_dict(plan.cluster)
    profile = run_profile(workload, cluster, _profiler_settings(args), ProfileWorld.current("cpu")).profile()
    return _simulate_profiled(plan, workload, cluster, profile)[1].iteration_time


def _profiler_settings(args):
    from megatron_spindle.profiler import ProfilerSettings

    return ProfilerSettings(layers=args.profile_layers, repeats=args.profile_repeats, warmup=1)


def _simulate_profiled(plan, workload, cluster, profile):
    """(cost model, simulation) of the plan from a profile: its measured operators, optimizer step and links. The
    engines here do not clip (EngineConfig's default), so their step computes no gradient norm, and their plans
    are made and recorded without it (``PlannerConfig(grad_norm=False)``)."""
    from megatron_spindle.estimator import execution_cost_config
    from megatron_spindle.estimator.profiled import ProfiledCostModel, cluster_with_bandwidth
    from megatron_spindle.simulator import simulate

    measured = cluster_with_bandwidth(cluster, profile.bandwidth)
    cost_model = ProfiledCostModel(workload, measured, profile.measurements, optimizer=profile.optimizer,
                                   config=execution_cost_config(plan.settings))
    return cost_model, simulate(plan, workload, measured, cost_model=cost_model)


# ------------------------------------------------------------------------------------------------ two ranks


def _pin_to_core(rank: int, world_size: int) -> None:
    """One core per rank, as a GPU launch binds one process per device. Unpinned, the two ranks' compute ran
    about 2x slower and erratically on a 2-core machine (the scheduler moves them and their gloo threads)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= world_size:
        os.sched_setaffinity(0, {cpus[rank]})


def _two_rank_worker(rank: int, world_size: int, port: int, workload, args, queue) -> None:
    if not args.no_pin:
        _pin_to_core(rank, world_size)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        result = _two_ranks(rank, world_size, workload, args)
        if rank == 0:
            queue.put(result)
    except BaseException as e:  # report instead of hanging the parent
        if rank == 0:
            queue.put({"error": repr(e)})
        raise
    finally:
        # what the run left in reference cycles (the engine, through its hooks, most likely) is freed here, while the
        # process groups and the interpreter live: left to the interpreter's finalization, gloo objects aborted a
        # worker ("terminate called without an active exception") in 3 of 4 runs on a 2-core machine, 0 of 9 so
        gc.collect()
        dist.destroy_process_group()


def _two_ranks(rank: int, world_size: int, workload, args) -> dict[str, float]:
    from megatron_spindle.autoplan import autoplan
    from megatron_spindle.compat.cpu import apply_cpu_shim
    from megatron_spindle.estimator.profile import load_profile
    from megatron_spindle.estimator.profiled import cluster_with_bandwidth
    from megatron_spindle.graph.cluster import make_cluster
    from megatron_spindle.plan.schema import Plan
    from megatron_spindle.planner.pipeline import PlannerConfig
    from megatron_spindle.profiler import ProfileWorld, run_profile
    from megatron_spindle.runtime.engine import RuntimeEngine

    apply_cpu_shim()
    cluster = make_cluster(world_size, world_size, "CPU")
    world = ProfileWorld.current("cpu")
    settings = _profiler_settings(args)

    def profile_now():
        """A fresh profile, or --profile (whose optimizer cost may be None: the analytic one applies)."""
        if args.profile:
            return load_profile(args.profile, workload, cluster)
        return run_profile(workload, cluster, settings, world).profile()

    t0 = time.perf_counter()
    profiles = [profile_now()]
    profiling = time.perf_counter() - t0
    plan = None
    if rank == 0:
        plan = autoplan(workload, cluster_with_bandwidth(cluster, profiles[0].bandwidth),
                        PlannerConfig(planner=args.planner, grad_norm=False), profile=profiles[0]).plan.to_dict()
    plan = Plan.from_dict(world.broadcast(plan))
    engine = RuntimeEngine(plan, workload, rank, world_size)
    wave_seconds: dict[tuple[str, int], list[float]] = {}  # (phase, wave) -> wall seconds, timed train_steps only
    wave_cpu: dict[tuple[str, int], list[float]] = {}  # (phase, wave) -> this rank's own CPU seconds in it
    phase_times: dict[str, float] = {}

    def timed(fn, step: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn(step)
        dist.barrier()
        return time.perf_counter() - t0

    steps, fwd_bwd = [], []
    threads = {"compute": 0.0, "communication": 0.0}  # CPU seconds of this rank's threads over the timed steps
    for r in range(args.rounds):  # rounds alternate profiling and running: both see the machine's changing speed
        if r > 0 and not args.profile:
            profiles.append(profile_now())
        for step in range(args.warmup + args.steps):
            a = timed(engine.forward_backward, step)  # everything but the optimizer step
            engine.on_wave = _wave_recorder(wave_seconds, wave_cpu) if step >= args.warmup else None
            engine.phase_times = phase_times if step >= args.warmup else None  # the engine's Megatron-style timers
            before = _thread_cpu()
            b = timed(engine.train_step, step)
            if step >= args.warmup:
                _add_thread_cpu(threads, before, _thread_cpu())
            engine.on_wave, engine.phase_times = None, None
            if step >= args.warmup:
                fwd_bwd.append(a)
                steps.append(b)
    steps, fwd_bwd = world.all_max(steps), world.all_max(fwd_bwd)
    cost_models, sims = zip(*(_simulate_profiled(plan, workload, cluster, profile) for profile in profiles))
    median = sorted(range(len(sims)), key=lambda i: sims[i].iteration_time)[(len(sims) - 1) // 2]
    sim = sims[median]  # the median profile's simulation
    waves = _waves_against_profile(plan, workload, cost_models[median], rank, wave_seconds, wave_cpu, sim)
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, {k: v / len(steps) for k, v in threads.items()})
    rank_waves = [None] * world_size  # every rank's own waves (rank 0's are printed wave by wave)
    dist.all_gather_object(rank_waves, waves)
    return {"measured": statistics.median(steps), "measured_fwd_bwd": statistics.median(fwd_bwd),
            "thread_cpu": per_rank, "rank_waves": rank_waves,
            "simulated": sim.iteration_time, "simulated_all": [x.iteration_time for x in sims],
            "measured_rounds": [statistics.median(steps[i * args.steps:(i + 1) * args.steps])
                                for i in range(args.rounds)],
            "sim_compute": sim.compute_time, "sim_transfer": sim.transfer_time, "sim_grad_sync": sim.grad_sync_time,
            "sim_optimizer": sim.optimizer_time,
            "planner": float(plan.predicted["iteration_time"]), "waves": len(plan.waves), "profiling": profiling,
            "selected": plan.planner.get("selection", {}).get("selected", ""), "zero_stage": plan.settings.zero_stage,
            "links": _measured_links(cost_models[median].cluster),
            "rank0_phase_times": {k: v / len(steps) for k, v in phase_times.items()}}


def _thread_cpu() -> dict[int, float]:
    """CPU seconds of each of this process's threads (Linux's /proc; empty elsewhere)."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    tick = os.sysconf("SC_CLK_TCK")
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended
        fields = stat[stat.rindex(")") + 2:].split()  # after the name: state is field 3, utime 14, stime 15
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _add_thread_cpu(into: dict[str, float], before: dict[int, float], after: dict[int, float]) -> None:
    """The CPU time between two ``_thread_cpu`` readings: this (compute) thread's, and the rest of the process's
    (gloo's event loops and workers, which share the rank's core)."""
    main = threading.get_native_id()
    for tid, seconds in after.items():
        into["compute" if tid == main else "communication"] += seconds - before.get(tid, 0.0)


def _measured_links(measured) -> dict[str, float]:
    """What the model takes of the ranks' link from a profile (``measured``: its cost model's cluster, the
    profile's links in it: ``_simulate_profiled``)."""
    return {"p2p_latency": measured.p2p_latency, "message_host_seconds": measured.message_host_seconds,
            "overlap_slowdown": measured.overlap_slowdown, "overlap_latency": measured.overlap_latency,
            "allreduce_bus_bw": measured.intra_node_bw}


def _wave_recorder(into: dict[tuple[str, int], list[float]], cpu_into: dict[tuple[str, int], list[float]]):
    """One step's ``on_wave``: each wave step's wall seconds, and the CPU seconds of this rank's main thread
    since the previous wave step (the first one's since the recorder was made, just before the step: the
    step's own start is in it). Wall minus CPU is what the rank waited."""
    last = [time.thread_time()]

    def record(phase: str, wave: int, seconds: float) -> None:
        now = time.thread_time()
        into.setdefault((phase, wave), []).append(seconds)
        cpu_into.setdefault((phase, wave), []).append(now - last[0])
        last[0] = now
    return record


def _simulated_walls(plan, sim, rank: int) -> dict[tuple[str, int], float]:
    """(phase, wave) -> the simulated wall time of this rank's step of it, waits included: from the end of the
    rank's previous interval to the end of this one (what ``on_wave`` measures in the runtime)."""
    wave_of = {s.id: w.index for w in plan.waves for s in w.slices}
    phase = {"fwd": "forward", "bwd": "backward"}
    out, last = {}, 0.0
    for iv in sim.busy[rank]:
        key = (phase[iv.phase], wave_of[iv.slice_id])
        out[key] = out.get(key, 0.0) + iv.end - last
        last = iv.end
    return out


def _waves_against_profile(plan, workload, cost_model, rank: int, wave_seconds, wave_cpu, sim) -> list[dict]:
    """Per wave of this rank: its slice, the measured wall time of the wave's forward and backward step (median
    over the timed steps; waits for the other rank included) and the rank's own CPU time in it, the profiled operators' forward and backward as
    the simulator charges them (``step_phases`` of the profile's cost model, times the slice's layers) and the
    simulated wall time of the step, waits included."""
    from megatron_spindle.estimator.cost_model import step_phases
    from megatron_spindle.graph.opgraph import build_metagraph

    metaops = build_metagraph(workload).metaops
    walls = _simulated_walls(plan, sim, rank)
    rows = []
    for w in plan.waves:
        mine = [s for s in w.slices if rank in s.devices]
        fwd = bwd = 0.0
        for s in mine:
            f, b = step_phases(cost_model, metaops[s.metaop], s.tp, s.dp)
            fwd, bwd = fwd + f * s.num_layers, bwd + b * s.num_layers
        rows.append({"wave": w.index, "slices": [s.metaop for s in mine],
                     "measured_forward": statistics.median(wave_seconds.get(("forward", w.index), [0.0])),
                     "measured_backward": statistics.median(wave_seconds.get(("backward", w.index), [0.0])),
                     "cpu_forward": statistics.median(wave_cpu.get(("forward", w.index), [0.0])),
                     "cpu_backward": statistics.median(wave_cpu.get(("backward", w.index), [0.0])),
                     "simulated_forward": fwd, "simulated_backward": bwd,
                     "simulated_wall_forward": walls.get(("forward", w.index), 0.0),
                     "simulated_wall_backward": walls.get(("backward", w.index), 0.0)})
    return rows


def two_ranks(workload, args, world_size: int = 2) -> dict[str, float]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_two_rank_worker, args=(world_size, port, workload, args, queue), nprocs=world_size,
                       join=True, start_method="spawn")
    result = queue.get(timeout=5)
    if "error" in result:
        raise RuntimeError(f"two-rank run failed: {result['error']}")
    return result


# ------------------------------------------------------------------------------------------------ report


def _wave_rows(rank_waves: list[list[dict]], step: float) -> list[tuple[str, str, str]]:
    """Rank 0's waves one by one, then every rank's waves summed, measured against the profiled operators: where a
    step's time goes that the simulator does not charge."""
    out = []
    for w in rank_waves[0]:
        out.append((f"2 ranks: rank 0 wave {w['wave']:>2} fwd / bwd", f"{w['measured_forward'] * 1e3:5.2f} / "
                    f"{w['measured_backward'] * 1e3:5.2f} ms", f"cpu {w['cpu_forward'] * 1e3:.2f} / "
                    f"{w['cpu_backward'] * 1e3:.2f} ms, profiled {w['simulated_forward'] * 1e3:.2f} / "
                    f"{w['simulated_backward'] * 1e3:.2f} ms, simulated wall {w['simulated_wall_forward'] * 1e3:.2f} / "
                    f"{w['simulated_wall_backward'] * 1e3:.2f} ms  " + ", ".join(w["slices"])))
    for rank, waves in enumerate(rank_waves):
        measured = [sum(w[f"measured_{p}"] for w in waves) for p in ("forward", "backward")]
        cpu = [sum(w[f"cpu_{p}"] for w in waves) for p in ("forward", "backward")]
        profiled = [sum(w[f"simulated_{p}"] for w in waves) for p in ("forward", "backward")]
        walls = [sum(w[f"simulated_wall_{p}"] for w in waves) for p in ("forward", "backward")]
        share = [m[0] / max(sum(m), 1e-12) for m in (measured, profiled)]  # forward's share, measured and modelled
        out.append((f"2 ranks: rank {rank} waves, fwd / bwd", f"{measured[0] * 1e3:5.2f} / {measured[1] * 1e3:5.2f} ms",
                    f"cpu {cpu[0] * 1e3:.2f} / {cpu[1] * 1e3:.2f} ms (the rest waited), "
                    f"profiled {profiled[0] * 1e3:.2f} / {profiled[1] * 1e3:.2f} ms (forward share measured "
                    f"{share[0]:.0%}, modelled {share[1]:.0%}), simulated wall {walls[0] * 1e3:.2f} / "
                    f"{walls[1] * 1e3:.2f} ms"))
        out.append((f"2 ranks: rank {rank} step outside the waves", _ms(step - sum(measured)),
                    "optimizer, gradient-sync wait, the step's own work"))
    return out


def _ms(s: float) -> str:
    return f"{s * 1e3:10.2f} ms"


def main(argv=None) -> int:
    parser = build_parser(__doc__.strip().splitlines()[0], [add_workload_args, add_benchmark_args, add_output_args])
    args = parser.parse_args(argv)
    record = Recording(args, "runtime_cpu")
    results = {}
    torch.set_num_threads(args.threads)
    workload = workload_from_args(args)
    load_before = os.getloadavg()
    rows = []
    if not args.skip_one_rank:
        r = results["one_rank"] = one_rank(workload, args)
        ratio = r["engine"] / r["plain"]
        rows += [("1 rank: RuntimeEngine.train_step", _ms(r["engine"]), ""),
                 ("1 rank: plain PyTorch (ReferenceModel + AdamW)", _ms(r["plain"]), ""),
                 ("1 rank: engine / plain", f"{ratio:10.3f} x ", f"target <= {OVERHEAD_TARGET:.2f}: "
                  + ("met" if ratio <= OVERHEAD_TARGET else "NOT met")),
                 ("1 rank: simulated (profiled on this rank)", _ms(r["simulated"]), ""),
                 ("1 rank: measured / simulated", f"{r['engine'] / r['simulated']:10.3f} x ",
                  "the model of one rank, without the second rank's effects")]
    if not args.skip_two_ranks:
        r = results["two_ranks"] = two_ranks(workload, args)
        sims = r["simulated_all"] if len(r["simulated_all"]) == len(r["measured_rounds"]) else \
            r["simulated_all"][:1] * len(r["measured_rounds"])  # --profile: one profile for every round
        ratios = [m / x for m, x in zip(r["measured_rounds"], sims)]
        ratio = statistics.median(ratios)
        rows += [("2 ranks: measured iteration (train_step)", _ms(r["measured"]), f"{r['waves']} waves"),
                 ("2 ranks: measured forward_backward + grad sync", _ms(r["measured_fwd_bwd"]),
                  "no optimizer step"),
                 ("2 ranks: measured per round", " ".join(f"{x * 1e3:.1f}" for x in r["measured_rounds"]) + " ms", ""),
                 ("2 ranks: simulated per profile", " ".join(f"{x * 1e3:.1f}" for x in r["simulated_all"]) + " ms",
                  "the same plan, one profile per round"),
                 ("2 ranks: simulated (median profile)", _ms(r["simulated"]),
                  f"compute {r['sim_compute'] * 1e3:.1f} + transfer {r['sim_transfer'] * 1e3:.1f} + "
                  f"grad sync {r['sim_grad_sync'] * 1e3:.1f} + optimizer {r['sim_optimizer'] * 1e3:.1f} ms"),
                 ("2 ranks: planner prediction", _ms(r["planner"]),
                  f"selected {r['selected'] or 'the planned one'} (ZeRO-{r['zero_stage']})"),
                 ("2 ranks: measured link", f"{r['links']['p2p_latency'] * 1e6:.0f} us",
                  f"a small message's latency; a message costs a rank {r['links']['message_host_seconds'] * 1e6:.0f} us "
                  f"of compute, compute beside an all-reduce runs x{r['links']['overlap_slowdown']:.2f} and the "
                  f"all-reduce beside compute takes {r['links']['overlap_latency'] * 1e3:.2f} ms more, "
                  f"all-reduce bus {r['links']['allreduce_bus_bw'] / 1e9:.2f} GB/s"),
                 ("2 ranks: measured / simulated per round", " ".join(f"{x:.3f}" for x in ratios) + " x",
                  "each round against the profile taken just before it"),
                 ("2 ranks: measured / simulated (median of rounds)", f"{ratio:10.3f} x ",
                  f"target within {SIMULATION_TARGET:.0%}: " + ("met" if abs(ratio - 1) <= SIMULATION_TARGET
                                                                else "NOT met")),
                 ("2 ranks: median measured / median simulated", f"{r['measured'] / r['simulated']:10.3f} x ", ""),
                 ("2 ranks: measured fwd_bwd / simulated w/o optimizer",
                  f"{r['measured_fwd_bwd'] / (r['simulated'] - r['sim_optimizer']):10.3f} x ", "")]
        if not args.profile:
            rows.append(("2 ranks: profiling took", f"{r['profiling']:10.2f} s ", "per round"))
        if any(t["compute"] for t in r["thread_cpu"]):
            rows.append(("2 ranks: CPU per step, compute / other threads", ", ".join(
                f"rank {i} {t['compute'] * 1e3:.1f} / {t['communication'] * 1e3:.1f}" for i, t in
                enumerate(r["thread_cpu"])) + " ms", "the other threads (gloo's) share the rank's core; 10 ms ticks"))
        rows += _wave_rows(r["rank_waves"], r["measured"])
        rows.append(("2 ranks: rank 0 engine timers per step", " ".join(
            f"{k} {v * 1e3:.1f}" for k, v in r["rank0_phase_times"].items()) + " ms", ""))
    load_after = os.getloadavg()
    results["load_average"] = {"before": load_before, "after": load_after}
    rows.append(("machine load (1/5/15 min) before, after", " / ".join(f"{x:.1f}" for x in load_before) + ", "
                 + " / ".join(f"{x:.1f}" for x in load_after), f"{os.cpu_count()} CPUs (shared: timings are noisy)"))
    print(f"\nruntime_cpu: workload '{workload.name}', {args.steps} timed steps (median) after {args.warmup} "
          f"warm-up ({args.rounds} rounds on two ranks), {args.threads} thread(s) per rank, planner {args.planner}")
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"  {name:<{width}}  {value}  {note}")
    record.save({"workload": workload.name, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
                 "threads": args.threads, "planner": args.planner, **results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
