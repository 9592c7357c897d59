"""What the training loop reports (Megatron's ``training_log``): per-interval means of the losses and the step
time, the grad norm and loss scale, skipped and nan iterations, throughput, memory, timers, validation results;
printed on rank 0 in Megatron's format and written to TensorBoard and wandb.

Collective at log iterations (wave times, timers and memory are reduced over the ranks): every rank calls
``end_iteration`` and ``validation`` with the same iterations.
"""

from __future__ import annotations

import argparse
import math

from megatron_spindle.runtime import progress
from megatron_spindle.training.engine_state import PhaseTimer, format_timers, format_wave_phases
from megatron_spindle.training.log import StepRecord, TensorBoardLogger, format_log_line, format_wave_line
from megatron_spindle.training.throughput import ThroughputMeter
from megatron_spindle.training.wandb_writer import WandbWriter


class TrainingMonitor:
    """``attach(phase)`` to the engine of the current task set (training/task_switch.py) and again after a
    change, ``end_iteration`` after every step, ``log`` to close an interval early (a task-set change)."""

    def __init__(self, args: argparse.Namespace, workload, rank: int, world_size: int, printer=print):
        self.args, self.rank, self.print = args, rank, printer
        self.meter = ThroughputMeter(workload, world_size) if args.log_throughput else None
        self.tb = TensorBoardLogger(args.tensorboard_dir if rank == 0 else None, args.tensorboard_queue_size)
        self.world_size = world_size
        self.wandb = WandbWriter(args, rank)
        self.records: list[StepRecord] = []
        self.engine = self.waves = self.timers = None
        self.predicted_ms, self.gbs = 0.0, 0
        self._reset()

    def attach(self, phase) -> None:
        """Measure this phase's engine (its wave timer, per-phase step times at --timing-log-level >= 1)."""
        self.engine, self.waves = phase.engine, phase.timer
        self.timers = PhaseTimer(phase.engine, self.args.timing_log_level)
        phase.engine.sync_waves = self.args.timing_log_level >= 2  # the waves' device times, not their launches
        self.predicted_ms, self.gbs = phase.predicted_ms, phase.global_batch_size
        self.waves.reset()

    def _reset(self) -> None:
        self.n, self.elapsed, self.loss_sum, self.skipped, self.nans = 0, 0.0, {}, 0, 0
        if self.meter is not None:
            self.meter.reset()
        if self.waves is not None:
            self.waves.reset()

    def end_iteration(self, iteration: int, lr: float, losses: dict[str, float], weights: dict[str, float],
                      active: dict[str, bool], seconds: float, consumed: int) -> StepRecord | None:
        """After the step of ``iteration`` (1-based): accumulate, and log at log iterations."""
        self.n += 1
        self.elapsed += seconds
        self.loss_sum = {t: self.loss_sum.get(t, 0.0) + v for t, v in losses.items()}
        stats = self.engine.last_step
        self.skipped += int(stats.skipped)
        self.nans += int(not all(math.isfinite(v) for v in losses.values()))
        if self.meter is not None:
            self.meter.add(active)
        if iteration % self.args.log_interval and iteration != self.args.train_iters:
            return None
        return self.log(iteration, lr, weights, consumed)

    def log(self, iteration: int, lr: float, weights: dict[str, float], consumed: int) -> StepRecord | None:
        """Log the interval ending at ``iteration`` (nothing when it is empty). Collective."""
        if not self.n:
            return None
        progress.point("logging (the wave-time and timer all-reduces)")
        stats = self.engine.last_step
        waves = [t / self.n * 1e3 for t in self.waves.collect()]
        timers = self.timers.collect(self.n)
        memory = {}
        if self.args.log_memory_to_tensorboard:
            from megatron_spindle.training.memory import memory_scalars

            memory = memory_scalars()
        rec = StepRecord(iteration, self.args.train_iters, consumed, lr,
                         {t: v / self.n for t, v in self.loss_sum.items()},  # Megatron: mean over the interval
                         weights, self.elapsed / self.n * 1e3, self.predicted_ms, waves, self.gbs,
                         grad_norm=stats.grad_norm, loss_scale=stats.loss_scale, skipped_iters=self.skipped,
                         nan_iters=self.nans,
                         throughput=self.meter.rate(self.elapsed) if self.meter is not None else None,
                         memory=memory, busiest_waves_ms=self.waves.busiest / self.n * 1e3,
                         params_norm=self.engine.params_norm() if self.args.log_params_norm else None,
                         num_zeros=stats.num_zeros)
        self.print(format_log_line(rec))
        if not self.records and self.engine.device.type == "cuda":  # Megatron-LM's report, once
            from megatron_spindle.training.memory import memory_report

            for line in memory_report(iteration):
                self.print(line)
        self.print(format_wave_line(rec))
        if self.args.timing_log_level >= 2:
            self.print(format_wave_phases(*self.waves.phases, self.n))
        if timers:
            self.print(format_timers(timers))
        scalars = self._scalars(rec, timers)
        self.tb.log_scalars(scalars, iteration)
        self.wandb.log(scalars, iteration)
        self.records.append(rec)
        self._reset()
        return rec

    def validation(self, result) -> None:
        self.print(result.format())
        scalars = result.scalars(ppl=self.args.log_validation_ppl_to_tensorboard)
        self.tb.log_scalars(scalars, result.iteration)
        self.wandb.log(scalars, result.iteration)

    def close(self) -> None:
        self.tb.close()
        self.wandb.close()


    def _scalars(self, rec: StepRecord, timers: dict[str, tuple[float, float]]) -> dict[str, float]:
        """The logged iteration's TensorBoard and W&B scalars, as Megatron's --log-*-to-tensorboard flags say."""
        from megatron_spindle.training.log import step_scalars

        out = step_scalars(rec)
        if not self.args.log_loss_scale_to_tensorboard:
            del out["loss-scale"]
        if self.args.log_world_size_to_tensorboard:
            out["world-size"] = float(self.world_size)
        if self.args.log_timers_to_tensorboard:
            out.update({f"timers (ms)/{name}": hi for name, (_, hi) in timers.items()})
        return out
