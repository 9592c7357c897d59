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
    """The frozen weights of this rank's slices. ``export`` and ``norm_tensors`` are collective over each frozen
    slice's TP group (the operators gather their TP shards), in wave order like every export of the engine; they
    hold one slice's full tensors on the device at a time (a frozen LLM is most of a model)."""

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
        # full shapes, recorded by slices.initial_weights from the operators' own export
        self.shapes = {k: tuple(ls.keys.shapes[k]) for ls in self.slices for k in ls.frozen_keys}
        # the rank that counts a unit in norms over the model: the first device holding it
        holders = weight_holders(plan, metagraph.metaops)
        self.counted = {k for k, u in self.unit_of.items() if holders[u][0] == rank}

    @property
    def units(self) -> list[str]:
        return sorted(set(self.unit_of.values()))

    def expected_shapes(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """unit -> {key: full shape} (``RuntimeEngine.expected_shapes``'s form)."""
        out: dict[str, dict[str, tuple[int, ...]]] = {}
        for k, unit in sorted(self.unit_of.items()):
            out.setdefault(unit, {})[k] = self.shapes[k]
        return out

    def _exports(self):
        """(slice, its full state) per frozen slice, one at a time."""
        for ls in self.slices:
            with torch.no_grad():
                yield ls, ls.op.export_full_state()

    def export(self) -> dict[str, torch.Tensor]:
        """key -> full fp32 tensor on the CPU of every frozen weight this rank holds (a unit held by several
        slices: the first's; they hold the same values, loaded alike)."""
        out: dict[str, torch.Tensor] = {}
        for ls, state in self._exports():
            for k in ls.frozen_keys:
                if k not in out:
                    out[k] = state[k].detach().to("cpu", torch.float32, copy=True)
        return out

    def norm_tensors(self) -> list[torch.Tensor]:
        """What this rank adds to a norm over the model (runtime/clip.py ``global_norm``): the L2 norm of each
        frozen weight it counts (``counted``: each element once over the world), as one-element tensors."""
        out, seen = [], set()
        for ls, state in self._exports():
            for k in ls.frozen_keys:
                if k in self.counted and k not in seen:
                    seen.add(k)
                    out.append(torch.linalg.vector_norm(state[k].detach(), dtype=torch.float32).reshape(1))
        return out

    def load(self, state: Mapping[str, torch.Tensor]) -> None:
        """Write full tensors into every frozen slice's operator (each keeps its TP shard), one tensor on the device
        at a time. Never communicates."""
        missing = sorted(k for k in self.unit_of if k not in state)
        if missing:
            raise KeyError(f"frozen weights missing: {missing[:5]}")
        for ls in self.slices:
            device = next(ls.op.parameters()).device
            with torch.no_grad():
                for k in ls.frozen_keys:
                    ls.op.load_full_state({k: state[k].to(device)}, strict=False)
