"""Per-wave and per-phase timing for the trainer, fed by the engine's ``on_wave`` hook and ``phase_times``.

Everything else the trainer needs from the engine is its public API (runtime/engine.py): ``export_units`` /
``load_units`` / ``expected_shapes`` (full per-unit weights and AdamW state, whatever the zero stage),
``set_lr``, ``set_loss_weights``, ``evaluate`` and ``last_step``.

--timing-log-level (Megatron's): 0 the iteration time and the per-wave times (no synchronisation added inside
the step); 1 also the step's phases, once per iteration each (forward-backward, all-grads-sync, the optimizer's
parts), with CUDA synchronised at their boundaries; 2 also the batch generator and the forward / backward part
of every wave, with CUDA synchronised after each (without it a wave's time on a GPU is the host's: the time to
launch its kernels, or a wait for earlier waves' work at a synchronising copy). Phases print as Megatron's
"(min, max) time across ranks (ms):" block.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

TIMING_LOG_LEVELS = (0, 1, 2)
LEVEL_1_TIMERS = ("forward-backward", "all-grads-sync", "optimizer-clip-main-grad", "optimizer-inner-step",
                  "optimizer-copy-main-to-model-params", "optimizer")
LEVEL_2_TIMERS = ("batch-generator",)
# --overlap-param-gather: the forward's waits for the weights' all-gathers (and loading them; inside
# forward-backward), and any flush before a checkpoint export or load
OVERLAP_PARAM_GATHER_TIMERS = ("params-all-gather",)


def over_ranks(v: torch.Tensor, op: str = "max") -> torch.Tensor:
    """The elementwise max (or min) of ``v`` over the ranks (a copy on NCCL, which reduces on the GPU)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        red = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN
        if dist.get_backend() == "nccl":
            w = v.cuda()
            dist.all_reduce(w, op=red)
            return w.cpu()
        dist.all_reduce(v, op=red)
    return v


class WaveTimer:
    """Per-wave time on this rank (forward + backward of its slices and the transfers into that wave), summed
    from the engine's ``on_wave(phase, wave_index, seconds)`` callbacks; ``collect`` takes the max over ranks
    (a wave lasts as long as its slowest device). Adds no synchronisation inside the step."""

    def __init__(self, engine):
        self.num_waves = len(engine.plan.waves)
        self.reset()
        engine.on_wave = self.record

    def record(self, phase: str, wave: int, seconds: float) -> None:
        (self.forward if phase == "forward" else self.backward)[wave] += seconds

    def reset(self) -> None:
        self.forward = [0.0] * self.num_waves
        self.backward = [0.0] * self.num_waves
        self.busiest = 0.0

    def collect(self) -> list[float]:
        """Per-wave total (forward + backward) seconds, the max over ranks; ``phases`` then holds the forward
        and backward parts, each the max over ranks, and ``busiest`` the largest of the ranks' own sums over the
        waves. (The sum of the per-wave maxima is no time of any rank: with ranks slow in different waves it
        can exceed the iteration.) Collective."""
        n = self.num_waves
        total = [f + b for f, b in zip(self.forward, self.backward)]
        v = over_ranks(torch.tensor(total + self.forward + self.backward + [sum(total)],
                                    dtype=torch.float64)).tolist()
        self.phases = (v[n:2 * n], v[2 * n:3 * n])
        self.busiest = v[3 * n]
        return v[:n]


class PhaseTimer:
    """The engine's per-phase step times at --timing-log-level >= 1 (``engine.phase_times``)."""

    def __init__(self, engine, level: int):
        overlap = getattr(engine, "param_gather", None) is not None
        self.names = LEVEL_1_TIMERS + (OVERLAP_PARAM_GATHER_TIMERS if overlap else ()) + (
            LEVEL_2_TIMERS if level >= 2 else ())
        self.engine = engine
        engine.phase_times = {} if level >= 1 else None

    def collect(self, iterations: int) -> dict[str, tuple[float, float]]:
        """name -> (min, max) over ranks of the mean ms per iteration since the last call. Collective."""
        times = self.engine.phase_times
        if times is None:
            return {}
        v = torch.tensor([times.get(k, 0.0) * 1e3 / max(iterations, 1) for k in self.names], dtype=torch.float64)
        hi = over_ranks(v.clone(), "max").tolist()
        lo = over_ranks(v.clone(), "min").tolist()
        times.clear()
        return {k: (a, b) for k, a, b in zip(self.names, lo, hi)}


def format_timers(t: dict[str, tuple[float, float]]) -> str:
    """Megatron's timer block."""
    lines = ["(min, max) time across ranks (ms):"]
    lines += [f"    {(name + ' ').ljust(48, '.')}: ({lo:.2f}, {hi:.2f})" for name, (lo, hi) in t.items()]
    return "\n".join(lines)


def format_wave_phases(forward: list[float], backward: list[float], iterations: int) -> str:
    waves = " ".join(f"w{i}={f * 1e3 / iterations:.1f}/{b * 1e3 / iterations:.1f}"
                     for i, (f, b) in enumerate(zip(forward, backward)))
    return f"  measured wave time forward/backward (ms): {waves}"
