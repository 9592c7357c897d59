"""Frozen weights (a module with ``frozen: true`` in the workload, or ``--freeze``): held by the operators of the
slices that run them, in the compute dtype with ``requires_grad`` off (models/operator.py ``build_operator``), as
Megatron-LM keeps a frozen module's parameters. They have no master copy, gradient buffer, gradient sync or
optimizer state (the plan lists them in no parameter device group), and ZeRO does not shard them: every slice
keeps its TP shard whole. Checkpoints save and load them in full form like any unit, without optimizer state.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megatron_spindle.graph.opgraph import MetaGraph
from megatron_spindle.plan.layout import held_units, weight_holders
from megatron_spindle.plan.schema import Plan
from megatron_spindle.runtime.slices import LocalSlice, in_wave_order
from megatron_spindle.runtime.tp_shards import unit_of_key


class FrozenWeights:
    """The frozen weights of this rank's slices. ``export`` is collective over each frozen slice's TP group (the
    operators gather their TP shards), in wave order like every export of the engine."""

    def __init__(self, local: dict[str, LocalSlice], metagraph: MetaGraph, plan: Plan, rank: int):
        self.slices = [ls for ls in in_wave_order(local) if ls.frozen_keys]
        self.unit_of: dict[str, str] = {}
        for ls in self.slices:
            units = held_units(metagraph.metaops[ls.slice.metaop], ls.slice.layer_start, ls.slice.layer_end)
            for k in ls.frozen_keys:
                unit = unit_of_key(k, units)
                if unit is None:
                    raise RuntimeError(f"slice '{ls.slice.id}': frozen parameter '{k}' belongs to none of its "
                                       f"units {units}")
                self.unit_of[k] = unit
        self.shapes = {k: tuple(v.shape) for k, v in self.export().items()}
        # the rank that counts a unit in norms over the model: the first device holding it
        holders = weight_holders(plan, metagraph.metaops)
        self.counted = sorted(k for k, u in self.unit_of.items() if holders[u][0] == rank)

    @property
    def units(self) -> list[str]:
        return sorted(set(self.unit_of.values()))

    def expected_shapes(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """unit -> {key: full shape} (``RuntimeEngine.expected_shapes``'s form)."""
        out: dict[str, dict[str, tuple[int, ...]]] = {}
        for k, unit in sorted(self.unit_of.items()):
            out.setdefault(unit, {})[k] = self.shapes[k]
        return out

    def export(self) -> dict[str, torch.Tensor]:
        """key -> full fp32 tensor of every frozen weight this rank holds (a unit held by several slices: the
        first's; they hold the same values, loaded alike)."""
        out: dict[str, torch.Tensor] = {}
        for ls in self.slices:
            with torch.no_grad():
                state = ls.op.export_full_state()
            for k in ls.frozen_keys:
                out.setdefault(k, state[k].detach().to(torch.float32).clone())
        return out

    def norm_tensors(self) -> list[torch.Tensor]:
        """The frozen weights this rank counts in a norm over the model (``counted``: each element once over the
        world; runtime/clip.py ``global_norm``), as full tensors. Collective like ``export``."""
        state = self.export()
        return [state[k] for k in self.counted]

    def load(self, state: Mapping[str, torch.Tensor]) -> None:
        """Write full tensors into every frozen slice's operator (each keeps its TP shard). Never communicates."""
        missing = sorted(k for k in self.unit_of if k not in state)
        if missing:
            raise KeyError(f"frozen weights missing: {missing[:5]}")
        for ls in self.slices:
            with torch.no_grad():
                ls.op.load_full_state({k: state[k] for k in ls.frozen_keys})
