"""Dynamic task sets in the trainer (paper App. D): resume a checkpoint with another task set, and change the
set inside a run (``--task-schedule``, training/task_schedule.py) without a restart.

What a change keeps and what it starts afresh, the same whether it happens in-process or by stop and resume:

- units both sets use keep their weights and AdamW state (moved between ranks in memory, runtime/handover.py,
  or read from the checkpoint under any world size);
- units new to the model start exactly as a fresh run would start them: the operators initialise weights from
  their names, and AdamW starts with no state;
- units no remaining task uses are kept aside (checkpointing/task_set.py ``RetainedUnits``) and saved with every
  checkpoint, so a task that comes back resumes with its trained weights;
- data positions are kept per task (data/sampler.py): a new task starts at its beginning, a returning one
  where it left off;
- the iteration, the LR schedule (a function of the iteration) and the RNG states continue;
- the plan is made for the new set (once per distinct set: ``plans`` caches them by set).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from megatron_spindle.checkpointing import (
    METADATA_FILE,
    CheckpointError,
    LoadedCheckpoint,
    get_rng_state,
    iteration_dir,
    load_checkpoint,
    read_latest,
    read_metadata,
    set_rng_state,
)
from megatron_spindle.checkpointing.task_set import (
    CONSUMED_KEY,
    TASK_SET_KEY,
    RetainedUnits,
    saved_tasks,
    spread,
    task_set_record,
)
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.task_sets import describe_change, task_set_workload, workload_units
from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan.layout import weight_holders
from megatron_spindle.runtime.distributed import start_together
from megatron_spindle.training.task_schedule import TaskSchedule


@dataclass
class Phase:
    """What trains one task set: its workload, plan, engine, data loader and wave timer."""

    tasks: tuple[str, ...]
    workload: Workload
    plan: Any
    engine: Any
    loader: Any
    timer: Any

    @property
    def global_batch_size(self) -> int:
        return sum(t.batch_size for t in self.workload.tasks)

    @property
    def predicted_ms(self) -> float:
        return self.plan.predicted.get("iteration_time", self.plan.iteration_time) * 1e3


@dataclass
class Resume:
    """A checkpoint about to be loaded into a phase: its task set against the phase's."""

    load_dir: str
    iteration: int
    old_tasks: tuple[str, ...]
    new_tasks: tuple[str, ...]
    digest: str  # the workload digest the checkpoint should have been made for
    initialised: list[str]  # units of the new model the checkpoint lacks (new tasks' towers, heads)
    retired: list[str]  # units in the checkpoint the new model does not use (kept aside)
    restored: list[str]  # units the checkpoint kept aside for an earlier set, back in the model

    @property
    def changed(self) -> bool:
        return set(self.old_tasks) != set(self.new_tasks)


def _plan_units(phase: Phase) -> dict[str, tuple[int, ...]]:
    """unit -> the sorted devices holding its weights under the phase's plan (frozen units too)."""
    return {u: tuple(devices) for u, devices in weight_holders(phase.plan, build_metagraph(phase.workload).metaops).items()}


def change_report(where: str, old: tuple[str, ...], new: tuple[str, ...], initialised: list[str],
                  set_aside: list[str], restored: list[str], timing: str | None = None) -> str:
    """The one log block of a task-set change."""
    added, dropped = describe_change(old, new)
    none = "(none)"
    lines = [f"task set change {where}: [{', '.join(old)}] -> [{', '.join(new)}]",
             f"  added tasks:       {', '.join(added) or none}",
             f"  dropped tasks:     {', '.join(dropped) or none}",
             f"  initialised units: {', '.join(initialised) or none} (fresh, as a new run initialises them)",
             f"  units set aside:   {', '.join(set_aside) or none} (no task uses them now; kept in checkpoints)"]
    if restored:
        lines.append(f"  units restored:    {', '.join(restored)} (trained before, back with their task)")
    if timing:
        lines.append(f"  {timing}")
    return "\n".join(lines)


class TaskSets:
    """The run's task sets over time: builds each phase, resumes checkpoints of any set, switches in-process.

    ``plan_fn(args, workload)`` makes (or loads) a plan collectively (the trainer's ``get_plan``);
    ``engine_provider`` and ``loader_factory(workload, datasets)`` build a phase's engine and data loader.
    """

    def __init__(self, args: argparse.Namespace, base: Workload, schedule: TaskSchedule, datasets: dict,
                 engine_provider: Callable, loader_factory: Callable, plan_fn: Callable, rank: int,
                 world_size: int, log: Callable[[str], None]):
        self.args, self.base, self.schedule, self.datasets = args, base, schedule, datasets
        self.engine_provider, self.loader_factory, self.plan_fn = engine_provider, loader_factory, plan_fn
        self.rank, self.world_size, self.log = rank, world_size, log
        self.plans: dict[frozenset, Any] = {}
        self.retained = RetainedUnits()
        self.phase: Phase | None = None
        self.consumed_samples = 0
        self._saved_plan_digest = self._check_saved_plan()

    # ------------------------------------------------------------------------------------------ phases
    def workload(self, tasks: tuple[str, ...]) -> Workload:
        return task_set_workload(self.base, tasks)

    def _check_saved_plan(self) -> str | None:
        if not (self.args.spindle_plan and self.schedule.changes):
            return None
        from megatron_spindle.plan.schema import Plan

        digest = Plan.load(self.args.spindle_plan).workload_digest
        if not any(self.workload(s).digest() == digest for s in self.schedule.task_sets()):
            raise ValueError(f"--spindle-plan {self.args.spindle_plan} is for none of the task sets of "
                             f"--task-schedule (each other set is planned when it starts)")
        return digest

    def plan(self, tasks: tuple[str, ...]) -> tuple[Any, float, bool]:
        """(plan, planning seconds, whether it came from the cache) for a task set; collective when new."""
        key = frozenset(tasks)
        if key in self.plans:
            return self.plans[key], 0.0, True
        workload = self.workload(tasks)
        args = self.args
        if self._saved_plan_digest is not None and workload.digest() != self._saved_plan_digest:
            args = copy.copy(args)
            args.spindle_plan = None  # --spindle-plan is for another set of the schedule
        t0 = time.perf_counter()
        plan = self.plan_fn(args, workload)
        self.plans[key] = plan
        return plan, time.perf_counter() - t0, False

    def build(self, tasks: tuple[str, ...], plan) -> Phase:
        """A phase's data loader, engine and wave timer (the engine is collective to build)."""
        from megatron_spindle.training.engine_state import WaveTimer

        workload = self.workload(tasks)
        loader = self.loader_factory(workload, {t: self.datasets[t] for t in tasks})
        try:
            engine = self.engine_provider(plan, workload, self.rank, self.world_size, self.args, loader.batch_fn)
        except BaseException:
            loader.close()
            raise
        loader.read_only(engine.batch_needs)  # this rank's rows and fields of each task, not every rank's
        self.phase = Phase(tasks, workload, plan, engine, loader, WaveTimer(engine))
        if not self.args.mock_data:
            self._report_decoding(self.phase)
        return self.phase

    def _report_decoding(self, phase: Phase) -> None:
        """Log whether the busiest rank's data threads keep up with the plan (training/data_rate.py). Collective."""
        from megatron_spindle.training.data_rate import busiest_rank, decode_report, rank_decode_load

        loads = rank_decode_load(phase.workload, self.datasets, phase.engine.batch_needs)
        rank, busiest = busiest_rank(loads)
        self.log(decode_report(rank, busiest, self.args.num_workers, phase.predicted_ms / 1e3))

    def close(self) -> None:
        if self.phase is not None:
            self.phase.loader.close()

    # ------------------------------------------------------------------------------------------ checkpoints
    def checkpoint_extra(self, tasks: tuple[str, ...]) -> dict[str, Any]:
        return {TASK_SET_KEY: task_set_record(self.base.name, self.base.model_digest(), tasks),
                CONSUMED_KEY: self.consumed_samples}

    def units_to_save(self) -> tuple[dict, list[str]]:
        """(retained units this rank writes, every retained unit) for the checkpoint."""
        return self.retained.mine(), sorted(self.retained.holder)

    def open_checkpoint(self, load_dir: str, phase: Phase) -> Resume | None:
        """Read the checkpoint's metadata and compare its task set with the phase's; CheckpointError when its
        units cannot be explained by a task-set change (another workload). ``load_dir`` may be an iteration
        folder itself (checkpointing/load_target.py)."""
        if (Path(load_dir) / METADATA_FILE).is_file():
            ckpt = Path(load_dir)
            meta = read_metadata(ckpt)
            iteration = int(meta["iteration"])
        else:
            iteration = read_latest(load_dir)
            if iteration is None:
                return None
            ckpt = iteration_dir(load_dir, iteration)
            meta = read_metadata(ckpt)
        old = saved_tasks(meta)
        known = [t.name for t in self.base.tasks]
        in_ckpt = set(meta["units"])
        units = _plan_units(phase)
        if set(old) == set(phase.tasks) or not old:  # every unit of the model must be there (checked on loading)
            return Resume(load_dir, iteration, phase.tasks, phase.tasks, phase.workload.model_digest(), [],
                          sorted(in_ckpt - set(units)), [])
        unknown = [t for t in old if t not in known]
        if unknown:
            raise CheckpointError(f"checkpoint {ckpt} was trained with task(s) {', '.join(unknown)} that workload "
                                  f"'{self.base.name}' does not have (it has: {', '.join(known)})")
        old = tuple(t for t in known if t in old)
        initialised = sorted(set(units) - in_ckpt)
        old_units = workload_units(self.workload(old))
        lost = sorted(set(initialised) & old_units)
        if lost:
            raise CheckpointError(f"checkpoint {ckpt} has no parameter unit '{lost[0]}' although its tasks "
                                  f"[{', '.join(old)}] use it; was it made for another workload?")
        return Resume(load_dir, iteration, old, phase.tasks, self.workload(old).model_digest(), initialised,
                      sorted(in_ckpt - set(units)), sorted((set(units) & in_ckpt) - old_units))

    def fresh_units(self, phase: Phase, resume: Resume) -> dict:
        """The phase's own (freshly initialised) units when the checkpoint lacks some. Collective at zero
        stage 1: every rank calls it, before anything that may fail on one rank only."""
        return phase.engine.export_units() if resume.initialised else {}

    def load_units(self, resume: Resume, phase: Phase, fresh: dict, load_optim: bool) -> LoadedCheckpoint:
        """Load the checkpoint's units into the phase's engine (new units: ``fresh``) and keep the ones no task
        of the phase uses; returns the checkpoint (RNG, data position still to apply). Never communicates."""
        engine = phase.engine
        expected = engine.expected_shapes()
        kept = {u: shapes for u, shapes in expected.items() if u not in resume.initialised}
        keepers = spread(resume.retired, self.world_size)
        mine = [u for u in resume.retired if keepers[u] == self.rank]
        ck = load_checkpoint(resume.load_dir, iteration=resume.iteration, units=sorted(kept) + mine,
                             expected=kept, rank=self.rank, workload_digest=resume.digest)
        units = {u: ck.units[u] if u in kept else fresh[u] for u in expected}
        engine.load_units(units, load_optim=load_optim)
        self.retained = RetainedUnits()
        for u in resume.retired:
            self.retained.keep(u, keepers[u], self.rank, ck.units.get(u))
        self.consumed_samples = int(ck.metadata.get("extra", {}).get(CONSUMED_KEY,
                                                                     ck.iteration * phase.global_batch_size))
        return ck

    def resume_report(self, resume: Resume) -> str:
        return change_report(f"at resume (checkpoint iteration {resume.iteration})", resume.old_tasks,
                             resume.new_tasks, resume.initialised, resume.retired, resume.restored)

    # ------------------------------------------------------------------------------------------ in-process
    def switch(self, iteration: int) -> Phase:
        """Change to the set of ``iteration`` in-process: export, tear down, replan (cached by set), rebuild,
        move units in memory, restore positions and RNG. Collective; returns the new phase."""
        from megatron_spindle.runtime.handover import hand_over, plan_moves

        old = self.phase
        tasks = self.schedule.tasks_at(iteration)
        t0 = time.perf_counter()
        rng = get_rng_state()  # building operators must not shift the run's random streams
        exported = old.engine.export_units()  # collective at zero stage 1
        position = old.loader.state_dict()
        old_units, old_tasks = _plan_units(old), old.tasks
        old.loader.close()
        old.engine.close()
        self.phase = old = None
        gc.collect()
        teardown = time.perf_counter() - t0
        plan, plan_seconds, cached = self.plan(tasks)
        t1 = time.perf_counter()
        phase = self.build(tasks, plan)
        new_units = _plan_units(phase)
        holders = {**old_units, **{u: (r,) for u, r in self.retained.holder.items()}}
        available = {**exported, **self.retained.mine()}
        moves = plan_moves(holders, new_units)
        received = hand_over(available, moves, phase.engine.expected_shapes(), self.rank, phase.engine.device)
        initialised = sorted(set(new_units) - set(holders))
        fresh = phase.engine.export_units() if initialised else {}  # every rank: collective at stage 1
        units = {}
        for u in phase.engine.units:
            units[u] = received[u] if u in received else available[u] if u in available else fresh[u]
        phase.engine.load_units(units, load_optim=True)
        restored = sorted(u for u in self.retained.holder if u in new_units)
        for u in restored:
            self.retained.release(u)
        set_aside = sorted(set(old_units) - set(new_units))
        for u in set_aside:
            self.retained.keep(u, min(old_units[u]), self.rank, exported.get(u))
        phase.loader.load_state_dict(position, tasks_may_change=True)
        set_rng_state(rng)
        rebuild = time.perf_counter() - t1 + teardown
        timing = (f"planning: {plan_seconds:.3f} s{' (cached plan of this set)' if cached else ''} | rebuild: "
                  f"{rebuild:.3f} s (engine and process groups; {len(moves)} unit(s) moved between ranks)")
        self.log(change_report(f"at iteration {iteration}", old_tasks, tasks, initialised, set_aside, restored,
                               timing))
        self.publish_plan(plan, iteration)
        start_together(self.world_size, f"the first iteration of the new task set at {iteration} (rank 0 writes "
                                        "its plan and chart)")
        return phase

    def publish_plan(self, plan, iteration: int) -> None:
        """Rank 0: the new plan and its Gantt chart next to the checkpoints (``plan_iter_<k>.json/.png``)."""
        if self.rank != 0 or not self.args.save:
            return
        from megatron_spindle.fileio import staged_outputs
        from megatron_spindle.planner.report import draw_gantt, plan_summary

        stem = Path(self.args.save) / f"plan_iter_{iteration:07d}"
        print(plan_summary(plan), flush=True)
        with staged_outputs() as out:  # both files, or neither
            draw_gantt(plan, out.path(stem.with_suffix(".png")))
            out.write_text(stem.with_suffix(".json"), json.dumps(plan.to_dict(), indent=1))
        print(f"plan from iteration {iteration} written to {stem}.json, its Gantt chart to {stem}.png", flush=True)
