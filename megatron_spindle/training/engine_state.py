"""Per-wave timing for the trainer, fed by the engine's ``on_wave`` hook.

Everything else the trainer needs from the engine is its public API (runtime/engine.py): ``export_units`` /
``load_units`` / ``expected_shapes`` (full per-unit weights and AdamW state, whatever the zero stage),
``set_lr`` and ``set_loss_weights``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class WaveTimer:
    """Per-wave time on this rank (forward + backward of its slices and the transfers into that wave), summed
    from the engine's ``on_wave(phase, wave_index, seconds)`` callbacks; ``collect`` takes the max over ranks
    (a wave lasts as long as its slowest device). Adds no synchronisation inside the step."""

    def __init__(self, engine):
        self.num_waves = len(engine.plan.waves)
        self.times = [0.0] * self.num_waves
        engine.on_wave = self.record

    def record(self, phase: str, wave: int, seconds: float) -> None:
        self.times[wave] += seconds

    def reset(self) -> None:
        self.times = [0.0] * self.num_waves

    def collect(self) -> list[float]:
        v = torch.tensor(self.times, dtype=torch.float64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
        return v.tolist()
