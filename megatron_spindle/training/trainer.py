"""The training driver behind pretrain_multitask.py: plan (or load a plan), build the runtime engine and the
data loader, resume, train with the LR schedule, log in Megatron's format, save layout-independent checkpoints.

Megatron-LM shape: ``pretrain(datasets_provider, engine_provider, extra_args_provider=...)``; the providers are
the model/data hooks an entry point supplies (pretrain_multitask.py has the defaults).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from megatron_spindle.arguments import (
    add_cluster_args,
    add_spindle_args,
    add_workload_args,
    build_parser,
    cluster_from_args,
    load_workload_arg,
    planner_config_from_args,
)
from megatron_spindle.errors import USER_ERRORS, alike_on_every_rank, exit_on_user_error, on_every_rank
from megatron_spindle.runtime import progress
from megatron_spindle.runtime.distributed import start_together
from megatron_spindle.training.arguments import (
    add_checkpointing_args,
    add_data_args,
    add_logging_args,
    add_plan_args,
    add_task_args,
    add_training_args,
    lr_schedule_from_args,
    parse_data_paths,
    parse_task_values,
    validate_args,
    weight_decay_schedule_from_args,
)
from megatron_spindle.training.evaluate import add_validation_args, check_validation_args
from megatron_spindle.training.faults import (
    FaultGuards,
    add_fault_tolerance_args,
    distributed_config_from_args,
    exit_config_from_args,
    rank0_outcome,
)
from megatron_spindle.training.precision import add_precision_args, check_precision_args
from megatron_spindle.training.task_schedule import parse_task_schedule

if TYPE_CHECKING:
    from megatron_spindle.runtime.distributed import DistContext

ARG_GROUPS = [add_workload_args, add_cluster_args, add_spindle_args, add_plan_args, add_training_args,
              add_precision_args, add_task_args, add_data_args, add_validation_args, add_checkpointing_args,
              add_logging_args, add_fault_tolerance_args]


def build_pretrain_parser(description: str, extra_args_provider: Callable | None = None) -> argparse.ArgumentParser:
    return build_parser(description, ARG_GROUPS, extra_args_provider)


def raise_agreed(error: str | None) -> None:
    """Collective: raise the first rank's error (by rank) on every rank, marked ``on_every_rank``, so all ranks
    stop together instead of hanging; nothing where no rank has one."""
    if dist.get_world_size() > 1:
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((f"rank {r}: {e}" for r, e in enumerate(errors) if e), None)
    if error:
        raise on_every_rank(ValueError(error))


def print_rank_0(*a, **k) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*a, **k, flush=True)


# Apart from the attention core (--attention-backend), the analytic model describes Transformer Engine's fused
# kernels; without TE the runtime runs megatron-core's local spec, whose layers measured 1.3-2.2x the model on an
# H200 (benchmarks/results/gpu, twenty-ninth session), and CLIP-4's step 1.7x the prediction on an H100, 1.05x
# planned from a profile taken after training runs (gpu/h100, fortieth session; a second profile on an idle GPU was
# 2.8x slow on the largest layer, which the profiler's device warm-up now addresses).
LOCAL_SPEC_NOTE = ("[plan] note: Transformer Engine is not available, so the runtime runs megatron-core's local spec. "
                   "The plan charges its unfused attention (--attention-backend local), but the analytic cost model's "
                   "other kernels are TE's fused ones, where the local spec runs unfused norms and activations with "
                   "more host work per layer: expect iterations slower than predicted (Multitask-CLIP-4 on one H100: "
                   "1.5x). --spindle-profile (tools/profile_metaops.py) plans on measured MetaOps of what runs here "
                   "(the same run: 1.05x).")
# The CPU type's constants are placeholders that keep the tiny workloads' plans shaped like GPU plans
# (graph/cluster.py "CPU"), not this machine's speed.
CPU_PLACEHOLDER_NOTE = ("[plan] note: --gpu-type CPU plans on placeholder numbers (they keep the plan shaped like a "
                        "GPU plan), not this machine's speed: expect measured iterations several times the "
                        "predicted ones. --spindle-profile (tools/profile_metaops.py) plans on measured MetaOps.")
# A saved plan made where TE was assumed (--attention-backend auto on a GPU type) runs the local spec here.
SAVED_PLAN_LOCAL_SPEC_NOTE = ("[plan] note: the plan was charged for Transformer Engine's attention (attention backend "
                              "auto), which is not available here: the runtime runs megatron-core's local spec, "
                              "slower than planned. Plan here, or with --attention-backend local, to charge what runs.")


def computes_grad_norm(args) -> bool:
    """Whether this run's optimizer step computes the global gradient norm (what a plan's ``grad_norm`` charges)."""
    return args.clip_grad > 0 or args.fp16


def saved_plan_grad_norm_note(planned: bool, args) -> str:
    """The note for a saved plan charged with (``planned``) or without the gradient norm, against this run."""
    return (f"[plan] note: the plan was charged {'with' if planned else 'without'} the optimizer step's gradient "
            f"norm, which this run {'does not compute' if planned else 'computes'} (--clip-grad {args.clip_grad:g}"
            f"{', --fp16' if args.fp16 else ''}): its predicted optimizer step is off by that pass (a read of every "
            f"gradient). Plan with the same --clip-grad to charge what runs.")


def grad_sync_mismatch(settings, args) -> tuple[str, str] | None:
    """(what a saved plan was made with, what this run gives) where the run's gradient-sync flags differ from the
    plan's settings, which the runtime follows: --overlap-grad-reduce and --grad-reduce-in-bf16 either way;
    --ddp-bucket-size only where given (unset, the plan's, which plan selection may have chosen); None where they
    agree."""
    from megatron_spindle.plan.schema import reduce_dtype

    wanted = reduce_dtype(args.grad_reduce_in_bf16)
    if settings.grad_reduce_dtype != wanted:
        def reduce_flag(dtype: str) -> str:
            return "--grad-reduce-in-bf16" if dtype == "bf16" else "gradients reduced in fp32"
        return reduce_flag(settings.grad_reduce_dtype), reduce_flag(wanted)
    if settings.overlap_grad_reduce != args.overlap_grad_reduce:
        def name(on: bool) -> str:
            return "--overlap-grad-reduce" if on else "--no-overlap-grad-reduce"
        return name(settings.overlap_grad_reduce), name(args.overlap_grad_reduce)
    if args.ddp_bucket_size is not None and args.ddp_bucket_size != settings.ddp_bucket_size:
        planned = settings.ddp_bucket_size
        return (f"--ddp-bucket-size {planned}" if planned else "megatron-core's default bucket size",
                f"--ddp-bucket-size {args.ddp_bucket_size}")
    return None


def get_plan(args, workload, world_size: int, rank: int):
    """The saved plan (--spindle-plan) or a fresh one made on rank 0 and broadcast (CP-SAT with a wall-clock
    limit is not deterministic, so ranks must not plan separately; with --spindle-solver-deterministic they could,
    but one plan sent is cheaper than a plan made on every rank)."""
    from megatron_spindle.plan.schema import Plan, PlanError, dropout_mismatch, dropouts
    from megatron_spindle.plan.validate import validate_plan

    if args.spindle_plan:
        plan = Plan.load(args.spindle_plan)
        validate_plan(plan, workload, check_memory=False)
        if plan.num_devices != world_size:
            raise PlanError(f"--spindle-plan {args.spindle_plan} is for {plan.num_devices} devices, the world size "
                            f"is {world_size}")
        differs = dropout_mismatch(dropouts(plan.settings), dropouts(args))  # the plan charged it, the runtime runs it
        if differs:
            flag, planned, given = differs
            raise PlanError(f"--spindle-plan {args.spindle_plan} was made with {flag} {planned:g}, this run gives "
                            f"{given:g}: give {flag} {planned:g}, or plan again with this run's")
        differs = grad_sync_mismatch(plan.settings, args)  # the plan charged its buckets, the runtime cuts them so
        if differs:
            raise PlanError(f"--spindle-plan {args.spindle_plan} was made with {differs[0]}, this run gives "
                            f"{differs[1]}: give the plan's, or plan again with this run's")
        if rank == 0 and plan.settings.attention_backend == "auto" and torch.cuda.is_available():
            from megatron_spindle.compat.cpu import te_available

            if not te_available():  # a GPU without TE (on a CPU, whatever the plan says, the local spec runs)
                print(SAVED_PLAN_LOCAL_SPEC_NOTE, flush=True)
        if rank == 0 and plan.settings.grad_norm != computes_grad_norm(args):
            print(saved_plan_grad_norm_note(plan.settings.grad_norm, args), flush=True)
        return plan
    # rank 0 plans for as long as it takes (minutes for a large cluster, beyond the collectives' timeout): the
    # others wait outside any collective, and their watchdogs only watch that rank 0 lives
    where = progress.current()
    progress.point("planning (rank 0) and sharing the plan", awaits=0)
    try:
        payload = rank0_outcome(lambda: _plan_on_rank0(args, workload, world_size), rank, world_size,
                                wait_key=f"plan/{workload.digest()}")
    except USER_ERRORS as e:
        raise PlanError(str(e)) from None
    progress.point(*where.what, awaits=where.awaits)
    return Plan.from_dict(payload)


def _plan_on_rank0(args, workload, world_size: int) -> dict:
    """The plan for this run, as a dict to broadcast: autoplan on the cluster (and profile) the flags give."""
    from megatron_spindle.autoplan import autoplan
    from megatron_spindle.compat.cpu import te_available
    from megatron_spindle.plan.schema import resolve_attention_backend

    cluster = cluster_from_args(args, default_num_gpus=world_size)
    profile = None
    if args.spindle_profile:
        from megatron_spindle.estimator.profiled import load_planning_profile, profile_summary

        profile, cluster = load_planning_profile(args.spindle_profile, workload, cluster)
        print(f"[plan] {profile_summary(profile, cluster)}", flush=True)
    t0 = time.perf_counter()
    config = planner_config_from_args(args)
    # the attention this machine will run: auto is the local spec where TE is missing
    config = dataclasses.replace(config, attention_backend=resolve_attention_backend(
        config.attention_backend, cluster.gpu.arch, te_available()),
        grad_norm=computes_grad_norm(args))  # what the runtime's optimizer step computes
    plan = autoplan(workload, cluster, config,
                    profile=profile, progress=lambda m: print(f"[plan] {m}", flush=True)).plan
    print(f"[plan] done in {time.perf_counter() - t0:.3f} s", flush=True)
    if profile is None and cluster.gpu.arch != "cpu" and not te_available():
        print(LOCAL_SPEC_NOTE, flush=True)
    if profile is None and cluster.gpu.arch == "cpu":
        print(CPU_PLACEHOLDER_NOTE, flush=True)
    return plan.to_dict()


def pretrain(datasets_provider: Callable, engine_provider: Callable, argv: list[str] | None = None,
             extra_args_provider: Callable | None = None, description: str = "Multi-task multi-modal training "
             "with Spindle plans", history: list | None = None) -> int:
    """Parse flags, check them, and train. User errors end in one line on stderr and exit code 2.
    ``history``, when given, receives the StepRecord of every logged iteration (rank 0)."""
    parser = build_pretrain_parser(description, extra_args_provider)
    args = parser.parse_args(argv)
    prog = Path(sys.argv[0]).name if argv is None else "pretrain_multitask.py"
    with exit_on_user_error(prog):
        from megatron_spindle.training.batch_size import batched_task_set
        from megatron_spindle.training.evaluate import split_datasets
        from megatron_spindle.training.multinode import resolve_node_layout
        from megatron_spindle.training.wandb_writer import check_wandb

        cuda = torch.cuda.is_available()
        with alike_on_every_rank():  # the same flags and files on every rank of a node
            validate_args(args, int(os.environ.get("WORLD_SIZE", 1)), cuda)
            check_precision_args(args, cuda)
            check_validation_args(args)
            check_wandb(args)
            resolve_node_layout(args)
            exit_config_from_args(args)  # --exit-* checked now, not after the process group formed
            dist_config = distributed_config_from_args(args)
            base = load_workload_arg(args)
            schedule = parse_task_schedule(args.task_schedule, base, args.tasks)
            base, workload = batched_task_set(base, args, schedule.all_tasks(base))  # all scheduled tasks
            loss_weights = parse_task_values(args.task_loss_weights, "--task-loss-weights", workload, positive=False)
            sampling_weights = parse_task_values(args.task_sampling_weights, "--task-sampling-weights", workload,
                                                 positive=True)
            data_paths = parse_data_paths(args.data_path, workload)
            valid_paths = parse_data_paths(args.valid_data_path, workload, "--valid-data-path")
            test_paths = parse_data_paths(args.test_data_path, workload, "--test-data-path")
            datasets = datasets_provider(workload, args, data_paths)
            datasets, valid, test = split_datasets(workload, datasets, args, valid_paths, test_paths)
            if args.skip_train:
                args.save = None  # nothing is saved, and nothing is written to --save (lock, probes, plan files)
        # the slow imports (planner, megatron-core operators) now, on every rank at once, rather than while the
        # other ranks wait for this one inside a collective (and its timeout)
        import megatron_spindle.models  # noqa: F401
        import megatron_spindle.planner.pipeline  # noqa: F401
        from megatron_spindle.runtime.distributed import destroy_distributed, init_distributed

        info = init_distributed("nccl" if cuda else "gloo", dist_config)
        try:
            with FaultGuards(args, info, prog) as guards:
                records = train(args, base, schedule, datasets, engine_provider, info, loss_weights,
                                sampling_weights, guards, valid_datasets=valid, test_datasets=test)
            if history is not None:
                history.extend(records)
        finally:
            destroy_distributed(info)
    return 0


def _unit_owners(plan, workload) -> dict[str, int]:
    """Which rank writes each unit: the lowest device holding its weights (frozen units too, which no parameter
    device group lists)."""
    from megatron_spindle.checkpointing import unit_owners
    from megatron_spindle.graph.opgraph import build_metagraph
    from megatron_spindle.plan.layout import weight_holders

    return unit_owners([(devices, [u]) for u, devices in weight_holders(plan, build_metagraph(workload).metaops).items()])


def save(args, iteration: int, engine, loader, plan, workload, info: DistContext, sets=None) -> Path:
    from megatron_spindle.checkpointing import save_checkpoint
    from megatron_spindle.checkpointing.checkpoint import UnitState
    from megatron_spindle.checkpointing.load_target import FROZEN_UNITS_KEY
    from megatron_spindle.training.precision import scaler_state

    progress.point(f"saving the checkpoint of iteration {iteration}")
    owners = _unit_owners(plan, workload)
    # collective with the distributed optimizer: every rank exports, the owner of each unit writes it
    mine = {u: s for u, s in engine.export_units().items() if owners.get(u, 0) == info.rank}
    extra = {"args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, list, type(None)))}}
    expected = sorted(owners)
    # units that had no optimizer state to save: thawed later, they start AdamW afresh (load_target.check_complete)
    extra[FROZEN_UNITS_KEY] = [u for u in expected if workload.is_frozen_unit(u)]
    if sets is not None:  # units of tasks that left the set, and the task-set record
        retained, all_retained = sets.units_to_save()
        mine.update(retained)
        expected = sorted(set(expected) | set(all_retained))
        extra.update(sets.checkpoint_extra(sets.phase.tasks))
    if args.no_save_optim:  # the weights alone
        mine = {u: UnitState(s.model, {}) for u, s in mine.items()}
    elif scaler_state(getattr(getattr(engine, "config", None), "grad_scaler", None)):  # fp16's loss scale
        extra["grad_scaler"] = scaler_state(engine.config.grad_scaler)
    t0 = time.perf_counter()
    path = save_checkpoint(args.save, iteration, mine, rank=info.rank, world_size=info.world_size,
                           workload_name=workload.name, workload_digest=workload.model_digest(),
                           data_position=loader.state_dict(), plan=plan.to_dict(), extra=extra,
                           expected_units=expected, save_rng=not args.no_save_rng)
    print_rank_0(f"saved checkpoint at iteration {iteration:8d} to {path} ({time.perf_counter() - t0:.2f} s)")
    return path


def load(args, phase, sets, info: DistContext, target) -> int:
    """Restore model, optimizer, RNG and data position from the checkpoint ``target`` names (--load, resolved
    by FaultGuards.resolve_load); returns the iteration to start at. The checkpoint may have been trained with
    another task set (training/task_switch.py). --finetune: the weights only, from iteration 0."""
    from megatron_spindle.checkpointing import set_rng_state
    from megatron_spindle.checkpointing.load_target import check_complete
    from megatron_spindle.training.precision import load_scaler_state

    if target.notice:  # starting from scratch, or fine-tuning from --pretrained-checkpoint
        print_rank_0(target.notice)
    if target.folder is None:
        return 0
    progress.point(f"loading the checkpoint {target.folder}")
    err, ck, resume = None, None, None
    try:
        resume = sets.open_checkpoint(str(target.folder), phase)
    except USER_ERRORS as e:
        err = str(e)
    raise_agreed(err)
    fresh = sets.fresh_units(phase, resume)  # collective when the checkpoint lacks units of this model
    try:
        load_optim = not (args.no_load_optim or args.finetune)
        load_rng = not (args.no_load_rng or args.finetune)
        ck = sets.load_units(resume, phase, fresh, load_optim=load_optim)
        check_complete(ck, load_rng=load_rng, load_optim=load_optim)
        if load_optim:
            load_scaler_state(getattr(getattr(phase.engine, "config", None), "grad_scaler", None),
                              ck.metadata.get("extra", {}).get("grad_scaler"))
        if ck.rng is not None and load_rng:
            set_rng_state(ck.rng)
        if args.finetune:
            sets.consumed_samples = 0
        else:
            phase.loader.load_state_dict(ck.data_position, tasks_may_change=resume.changed)
        if not args.finetune and phase.loader.sampler.iteration != ck.iteration:
            raise ValueError(f"checkpoint {ck.path}: data position is at iteration {phase.loader.sampler.iteration}, "
                             f"the checkpoint at {ck.iteration}")
    except USER_ERRORS as e:
        err = str(e)
    progress.point("agreeing that every rank loaded the checkpoint")
    raise_agreed(err)
    old = ck.metadata.get("world_size")
    print_rank_0(f"loaded checkpoint {ck.path} at iteration {ck.iteration} (saved by {old} rank(s), "
                 f"now {info.world_size})" + ("; --finetune: weights only, starting at iteration 0"
                                              if args.finetune else ""))
    if resume.changed:
        print_rank_0(sets.resume_report(resume))
    return 0 if args.finetune else ck.iteration


def write_plan_files(args, plan, gantt: str | None) -> None:
    """<save>/plan.json and the Gantt chart, both or neither, once the run has started (rank 0)."""
    from megatron_spindle.fileio import staged_outputs
    from megatron_spindle.planner.report import draw_gantt

    with staged_outputs() as out:
        if gantt:
            draw_gantt(plan, out.path(gantt))
        if args.save:
            out.write_text(Path(args.save) / "plan.json", json.dumps(plan.to_dict(), indent=1))
    if gantt:
        print(f"plan Gantt chart written to {gantt}", flush=True)


def train(args, base, schedule, datasets, engine_provider, info: DistContext, loss_weights: dict[str, float],
          sampling_weights: dict[str, float], guards: FaultGuards, valid_datasets: dict | None = None,
          test_datasets: dict | None = None) -> list:
    from megatron_spindle.data.datasets import MultiTaskDataLoader
    from megatron_spindle.planner.report import plan_summary
    from megatron_spindle.training.multinode import check_shared_folder
    from megatron_spindle.training.task_switch import TaskSets

    progress.point("checking that --save is shared between the ranks (probe files)")
    check_shared_folder(args.save, "--save", info.rank, info.world_size)  # before planning or training
    target = guards.resolve_load()  # a --load that names no checkpoint stops here, before anything is written
    start = (target.iteration or 0) if target is not None and not args.finetune else 0  # --finetune: from 0
    # a fine-tuning run restarts the iteration count, so a --save holding later checkpoints would be overwritten
    # even when --load names that folder
    guards.check_save_target(start, None if args.finetune else target)

    def loader_factory(workload, task_datasets):
        return MultiTaskDataLoader(workload, task_datasets, seed=args.seed, num_workers=args.num_workers,
                                   pin_memory=torch.cuda.is_available(),
                                   sampling_weights={t: w for t, w in sampling_weights.items() if t in task_datasets})

    sets = TaskSets(args, base, schedule, datasets, engine_provider, loader_factory,
                    lambda a, workload: get_plan(a, workload, info.world_size, info.rank), info.rank,
                    info.world_size, print_rank_0)
    tasks = schedule.tasks_at(start)
    progress.point("planning (rank 0) and sharing the plan")
    plan, _, _ = sets.plan(tasks)
    gantt = args.plan_gantt or (str(Path(args.save) / "plan.png") if args.save else None)
    if info.rank == 0:
        print(plan_summary(plan), flush=True)
    if not torch.cuda.is_available():
        from megatron_spindle.compat.cpu import apply_cpu_shim

        apply_cpu_shim()
    torch.manual_seed(args.seed)
    try:
        progress.point("building the runtime engine (process groups, operators)")
        sets.build(tasks, plan)
        return _train_loop(args, sets, info, loss_weights, gantt, guards, target, valid_datasets or {},
                           test_datasets or {})
    finally:
        sets.close()


def evaluate_once(args, engine, datasets: dict, iteration: int, weights: dict[str, float], split: str):
    """--eval-iters passes over ``datasets`` (None when there are none): the test set after the last iteration
    (Megatron-LM's), the validation and test sets under --skip-train. Collective."""
    from megatron_spindle.training.evaluate import ValidationBatches, run_validation

    if not datasets:
        return None
    batches = ValidationBatches(datasets, args.num_workers)
    try:
        return run_validation(engine, batches, args.eval_iters, iteration, weights, split, print_rank_0)
    finally:
        batches.close()


def _train_loop(args, sets, info: DistContext, loss_weights: dict[str, float], gantt: str | None,
                guards: FaultGuards, target, valid_datasets: dict, test_datasets: dict) -> list:
    from megatron_spindle.training.evaluate import ValidationBatches, run_validation, validation_config
    from megatron_spindle.training.manual_gc import ManualGC
    from megatron_spindle.training.monitor import TrainingMonitor
    from megatron_spindle.training.profiling import StepProfiler

    phase = sets.phase
    start = load(args, phase, sets, info, target) if target is not None else 0
    base = {t.name: loss_weights.get(t.name, t.loss.weight if t.loss else 1.0) for t in sets.base.tasks}
    if args.skip_train:
        what = f"the checkpoint of iteration {start}" if target is not None and target.folder else "fresh weights"
        print_rank_0(f"skipping training (--skip-train): evaluating {what}; nothing is saved")
        for split, datasets in (("validation", valid_datasets), ("test", test_datasets)):
            result = evaluate_once(args, phase.engine, datasets, start, base, split)
            if result is not None:
                print_rank_0(result.format())  # not to TensorBoard or W&B: no run is logged
        return []
    if info.rank == 0:  # the load succeeded: only now is anything written into --save
        write_plan_files(args, phase.plan, gantt)
    if start >= args.train_iters:
        print_rank_0(f"the checkpoint is at iteration {start}, --train-iters is {args.train_iters}: nothing to do")
        return []
    sched = lr_schedule_from_args(args)
    wd_sched = weight_decay_schedule_from_args(args)
    monitor = TrainingMonitor(args, sets.base, info.rank, info.world_size, print_rank_0)
    monitor.attach(phase)
    valid = validation_config(args)
    batches = ValidationBatches(valid_datasets, args.num_workers) if valid.enabled else None
    last_saved = None
    changes = set(sets.schedule.boundaries(start, args.train_iters))
    lr, weights = 0.0, {}
    print_rank_0(f"training {phase.workload.name} for {args.train_iters} iterations from iteration {start} on "
                 f"{info.world_size} rank(s)")
    if phase.workload.frozen_modules:
        print_rank_0(f"frozen modules: {', '.join(phase.workload.frozen_modules)} (no gradients, optimizer state or gradient sync; their "
                     f"weights as loaded or initialised)")
    start_together(info.world_size, "the start of training (rank 0 writes the plan and its chart)")
    collector = ManualGC.from_args(args)  # --manual-gc
    profiler = StepProfiler(args, info.rank, lambda m: print(m, flush=True))  # --profile
    try:
        with collector.training():
            for it in range(start, args.train_iters):
                progress.set_iteration(it + 1)
                progress.point("loading the batch")
                if it in changes:
                    monitor.log(it, lr, weights, sets.consumed_samples)  # the old set's part of the interval
                    progress.point("changing the task set (export, replan, rebuild, unit hand-over between ranks)")
                    phase = sets.switch(it)
                    monitor.attach(phase)
                engine, loader = phase.engine, phase.loader
                lr = sched(it)
                engine.set_lr(lr)
                if wd_sched is not None:
                    engine.set_weight_decay(wd_sched(it))
                mb = loader.advance()
                weights = {t: (base[t] if mb.active[t] else 0.0) for t in phase.tasks}
                engine.set_loss_weights(weights)
                profiler.before_iteration(it)
                engine.slice_ranges = profiler.active
                t0 = time.perf_counter()
                losses = engine.train_step(it)
                seconds = time.perf_counter() - t0
                profiler.after_iteration(it + 1)
                sets.consumed_samples += phase.global_batch_size
                monitor.end_iteration(it + 1, lr, losses, weights, mb.active, seconds, sets.consumed_samples)
                collector.after_iteration(it + 1)
                if batches is not None and ((it + 1) % valid.eval_interval == 0 or it + 1 == args.train_iters):
                    with collector.validation():
                        result = run_validation(engine, batches, valid.eval_iters, it + 1, base)
                    monitor.validation(result)
                if args.save and args.save_interval and (it + 1) % args.save_interval == 0:
                    save(args, it + 1, engine, loader, phase.plan, phase.workload, info, sets)
                    last_saved = it + 1
                reason = guards.exit_reason(it + 1)
                if reason is not None:
                    if args.save and last_saved != it + 1:
                        save(args, it + 1, engine, loader, phase.plan, phase.workload, info, sets)
                        last_saved = it + 1
                    saved = f" (checkpoint saved in {args.save})" if args.save else " (no --save: nothing saved)"
                    print_rank_0(f"exiting at iteration {it + 1}: {reason}{saved}")
                    return monitor.records
        if args.save and last_saved != args.train_iters:
            save(args, args.train_iters, phase.engine, phase.loader, phase.plan, phase.workload, info, sets)
        tested = evaluate_once(args, phase.engine, test_datasets, args.train_iters, base, "test")
        if tested is not None:
            monitor.validation(tested)
    finally:
        profiler.stop()
        monitor.close()
        if batches is not None:
            batches.close()
    if info.rank == 0:
        where = [f"checkpoints: {args.save}"] if args.save else []
        where += [f"plan picture: {gantt}"] if gantt else []
        where += [f"TensorBoard logs: {args.tensorboard_dir}"] if args.tensorboard_dir else []
        if where:
            print("done. " + "; ".join(where), flush=True)
    return monitor.records
