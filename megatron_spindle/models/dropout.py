"""Dropout masks keyed by where they are drawn, not by when: (seed, iteration, micro-batch) of the draw position,
and (task, module, layer, data-parallel rank) of the layer.

megatron-core draws a transformer layer's dropout from two generators: the default one (hidden dropout of
activations every TP rank holds whole, which the ranks must draw alike) and its RNG tracker's model-parallel
stream (attention dropout of this TP rank's heads and, under sequence parallelism, the whole block, each rank its
part of the sequence). A Spindle rank runs the slices of many MetaOps in the plan's order; drawn in that order, a
layer's masks would depend on the plan, and the TP peers of a slice, which run other slices in between, would
disagree. So before its forward each layer seeds both generators from its key (the model-parallel one with the
TP rank in it) and afterwards gives the default generator its state back. Recomputation reruns a layer under
the same key and replays its masks; a run resumed at iteration i draws what it would have drawn; a plan whose
slices are not data-parallel draws the single-process reference's masks.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

_MODEL_PARALLEL_STREAM = "model-parallel-rng"  # megatron-core's _MODEL_PARALLEL_RNG_TRACKER_NAME


@dataclass
class DrawPosition:
    """Where in training the next masks are drawn: the run's seed, the iteration, the micro-batch."""

    seed: int = 0
    iteration: int = 0
    micro_batch: int = 0


_POSITION = DrawPosition()


@contextmanager
def draw_position(seed: int, iteration: int) -> Iterator[DrawPosition]:
    """Draw this iteration's masks (micro-batch 0 until ``set_micro_batch``); the previous position afterwards."""
    global _POSITION
    saved, _POSITION = _POSITION, DrawPosition(seed, iteration)
    try:
        yield _POSITION
    finally:
        _POSITION = saved


def set_micro_batch(index: int) -> None:
    _POSITION.micro_batch = index


def key_seed(*key) -> int:
    """A 63-bit seed of ``key`` (any reprs), the same in every process and Python version."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _generator_state(seed: int, device: torch.device) -> torch.Tensor:
    return torch.Generator(device=device).manual_seed(seed).get_state()


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def seed_layer_dropout(layer: nn.Module, key: tuple, tp_rank: int, sequence_parallel: bool) -> None:
    """Seed ``layer``'s dropout from ``key`` (its task, module, layer and data-parallel rank) and the draw
    position at each forward (see the module docstring). ``sequence_parallel``: the layer runs inside its
    block's fork of the model-parallel stream, so the default generator is that stream there and takes the TP
    rank's seed."""
    from megatron.core.tensor_parallel import random as mrandom

    saved: list[torch.Tensor] = []

    def before(module, args):
        device = next(module.parameters()).device
        p = _POSITION
        drawn = (p.seed, p.iteration, p.micro_batch, *key)
        own = _generator_state(key_seed(*drawn, "tp", tp_rank), device)
        mrandom.get_cuda_rng_tracker().states_[_MODEL_PARALLEL_STREAM] = own
        saved.append(_get_state(device))
        _set_state(own if sequence_parallel else _generator_state(key_seed(*drawn), device), device)

    def after(module, args, output):
        _set_state(saved.pop(), next(module.parameters()).device)

    layer.register_forward_pre_hook(before)
    layer.register_forward_hook(after)
