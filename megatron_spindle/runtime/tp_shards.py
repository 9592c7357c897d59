"""The runtime's parameter keys under TP-sharded gradients (plan/tp_shards.py's rule).

Operators export and load *canonical* keys, "<unit>.<path>" with full (TP-unsharded) tensors. The runtime's
buffers, masters and gradient sync hold *runtime* keys: the canonical key itself, except for a TP-split
tensor of a unit reduced by TP shard, which becomes "<sub-unit>.<path>" holding only its TP shard of the
unit's degree t (``shard_full_tensor`` of t). So a device steps, reduces and stores 1/t of such a unit, over
the ring of devices holding that shard, as Megatron-LM does; the unit's replicated tensors stay whole, over
every member of its group. Without ``settings.tp_sharded_grads`` every key is canonical.

- ``SliceKeys``: one local slice's keys and the two translations. Canonical -> runtime cuts the shard out (of a
  weight, or of a gradient contribution, which is zero outside this TP rank's part, itself inside the
  shard); runtime -> canonical places the shard in a full tensor that is zero elsewhere, which
  ``load_full_state`` reads this TP rank's part from. Only operators that say how their tensors are split
  (``full_named_parameters``, megatron-core's ``tensor_model_parallel`` attributes) and export their own
  gradient part (``export_grad_contributions``) are split; other operators keep canonical keys. No full tensor
  is made where none is needed: a shard of the slice's own TP degree is the operator's local tensor
  (``SliceKeys.own``), and a TP rank's gradient of a whole key is a ``LocalPart`` the buffers add where it sits
  (``SliceKeys.placed``): a full tensor of zeros per parameter was host time in every backward on a GPU.
- ``KeyLayout``: this rank's slices' keys together, and ``canonical``: full tensors of every unit from the
  shards, collective over each plan group (for checkpoints, ``full_state`` and ``gather_grads``, never a step).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_spindle.checkpointing.checkpoint import UnitState
from megatron_spindle.plan.schema import Slice
from megatron_spindle.plan.tp_shards import UnitRings, shard_of, sub_unit


class SliceKeys:
    """``canonical`` keys of one slice's operator, the ``runtime`` key of each (``runtime_of``) and its unit
    (``unit_of``: a sub-unit for a split key), ``canonical_unit`` (canonical key -> unit), and for each split
    key its (parameter, shard, degree)."""

    def __init__(self, s: Slice, device: int, op: torch.nn.Module, canonical: Sequence[str],
                 units: Sequence[str], rings: Mapping[str, UnitRings]):
        self.canonical = list(canonical)
        self.runtime_of: dict[str, str] = {}
        self.split: dict[str, tuple[torch.nn.Parameter, int, int]] = {}  # runtime key -> (param, shard, degree)
        self.unit_of: dict[str, str] = {}
        self.canonical_unit: dict[str, str] = {}
        self.shapes: dict[str, torch.Size] = {}  # canonical key -> full shape (slices.initial_weights)
        tp_rank, tp_size = getattr(op, "tp_rank", 0), getattr(op, "tp_size", 1)
        params = (dict(op.full_named_parameters())
                  if (rings or tp_size > 1) and hasattr(op, "full_named_parameters")
                  and hasattr(op, "export_grad_contributions") else {})
        for k in self.canonical:
            unit = unit_of_key(k, units)
            if unit is None:
                raise RuntimeError(f"slice '{s.id}': exported parameter '{k}' belongs to none of its units {units}")
            p = params.get(k)
            self.canonical_unit[k] = unit
            if unit in rings and p is not None and getattr(p, "tensor_model_parallel", False):
                degree = rings[unit].degree
                shard = shard_of(s, device, degree)
                runtime_unit = sub_unit(unit, shard, degree)
                rk = runtime_unit + k[len(unit):]
                self.split[rk] = (p, shard, degree)
            else:
                rk, runtime_unit = k, unit
            self.runtime_of[k] = rk
            self.unit_of[rk] = runtime_unit
        self.canonical_of = {rk: k for k, rk in self.runtime_of.items()}
        # split keys whose shard is this rank's own part of the operator's tensor (degree = the slice's TP): the
        # runtime tensor is the operator's local one, so no full tensor is made on the way in or out
        self.own = frozenset(self.canonical_of[rk] for rk, (_, shard, degree) in self.split.items()
                             if degree == tp_size and shard == tp_rank)
        # whole (canonical) keys of TP-split tensors: this rank's gradient is added where it sits (``LocalPart``)
        self.placed = {k: (p, tp_rank, tp_size) for k, p in params.items()
                       if tp_size > 1 and self.runtime_of.get(k) == k and getattr(p, "tensor_model_parallel", False)}

    @property
    def runtime(self) -> list[str]:
        return [self.runtime_of[k] for k in self.canonical]

    def to_runtime(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Canonical tensors (the slice's keys among them) -> runtime ones."""
        out = {}
        for k in self.canonical:
            if k in tensors:
                rk = self.runtime_of[k]
                out[rk] = tensors[k] if rk not in self.split else shard_full_tensor(tensors[k], *self.split[rk])
        return out

    def runtime_grads(self, op: torch.nn.Module, units: Sequence[str]) -> dict[str, torch.Tensor | LocalPart]:
        """The operator's gradient contributions of ``units`` (``export_grad_contributions``) under runtime keys,
        as ``to_runtime`` gives them, without making full tensors where none is needed: an ``own`` key's is the
        operator's gradient itself, a ``placed`` key's a ``LocalPart`` of it."""
        local = self.own | self.placed.keys()
        grads = op.export_grad_contributions(units, **({"local": local} if local else {}))
        own = {self.runtime_of[k]: grads.pop(k) for k in self.own if k in grads}
        placed = {k: LocalPart(grads.pop(k), *self.placed[k]) for k in self.placed if k in grads}
        return {**self.to_runtime(grads), **own, **placed}

    def load(self, op: torch.nn.Module, tensors: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load runtime tensors (the slice's keys among them) into the operator: ``load_full_state`` of their
        ``to_canonical``, an ``own`` key's tensor given as the operator's shard itself."""
        own = {k: tensors[self.runtime_of[k]] for k in self.own if self.runtime_of[k] in tensors}
        state = {**self.to_canonical({rk: t for rk, t in tensors.items() if self.canonical_of.get(rk) not in own}),
                 **own}
        options = ({} if strict else {"strict": False}) | ({"local": self.own} if self.own else {})
        op.load_full_state(state, **options)  # only the options needed: an operator that splits nothing need not

    def to_canonical(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Runtime tensors (the slice's keys among them) -> canonical ones; a shard's full tensor is zero
        outside the shard."""
        out = {}
        for rk, k in self.canonical_of.items():
            if rk in tensors:
                out[k] = tensors[rk] if rk not in self.split else placed_full(tensors[rk], *self.split[rk])
        return out


@dataclass(frozen=True)
class LocalPart:
    """A TP rank's gradient contribution to a whole key, not made into the full tensor ``placed_full`` would
    make (this rank's ``tensor`` where its shard sits, zeros elsewhere): ``pairs(full)`` gives the views of a
    full-shape tensor where it sits and its pieces, to add it in place; ``full()`` makes it."""

    tensor: torch.Tensor
    param: torch.nn.Parameter
    rank: int
    size: int

    def full(self) -> torch.Tensor:
        return placed_full(self.tensor, self.param, self.rank, self.size)

    def pairs(self, full: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        from megatron_spindle.models import state  # not at import: models/ imports megatron-core

        return state.placed_pairs(full, self.tensor, self.param, self.rank, self.size)


def write_pairs(dests: Sequence[torch.Tensor], contributions: Sequence[torch.Tensor | LocalPart],
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(destination views, sources) that put every contribution (``runtime_grads``') into its full-shape
    destination, for one multi-tensor add or copy: a full tensor into the whole of it, a ``LocalPart`` into the
    views where it sits."""
    targets, sources = [], []
    for dest, g in zip(dests, contributions):
        if isinstance(g, LocalPart):  # no full tensor of zeros made for it
            views, pieces = g.pairs(dest)
            targets += views
            sources += pieces
        else:
            targets.append(dest)
            sources.append(g.to(dest.device))
    return targets, sources


class KeyLayout:
    """This rank's runtime keys: ``slices`` (slice id -> SliceKeys), ``rings`` (plan/tp_shards.py) and the plan's
    groups (sorted devices, units)."""

    def __init__(self, rings: Mapping[str, UnitRings], plan_groups: Sequence[tuple[tuple[int, ...], Sequence[str]]],
                 rank: int):
        self.rings, self.plan_groups, self.rank = dict(rings), list(plan_groups), rank
        self.slices: dict[str, SliceKeys] = {}

    @property
    def shapes(self) -> dict[str, torch.Size]:
        """canonical key -> full shape."""
        return {k: v for sk in self.slices.values() for k, v in sk.shapes.items()}

    def canonical_keys(self) -> list[str]:
        return sorted({k for sk in self.slices.values() for k in sk.canonical})

    def canonical_units(self) -> dict[str, str]:
        """canonical key -> its unit."""
        return {k: u for sk in self.slices.values() for k, u in sk.canonical_unit.items()}

    def expected_shapes(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """unit -> {canonical key: full shape} of every unit this rank holds (checkpoint form)."""
        shapes = self.shapes
        out: dict[str, dict[str, tuple[int, ...]]] = {}
        for k, u in sorted(self.canonical_units().items()):
            out.setdefault(u, {})[k] = tuple(shapes[k])
        return out

    def runtime_unit_states(self, units: Mapping[str, UnitState],
                            key_unit: Mapping[str, str]) -> dict[str, UnitState]:
        """Full units (checkpoint form) -> the runtime units of this rank (``key_unit``: runtime key -> runtime
        unit) in full runtime form: weights and AdamW moments cut as the runtime keys are."""
        model = self.to_runtime({k: v for st in units.values() for k, v in st.model.items()})
        moments = {name: self.to_runtime({k: o[name] for st in units.values() for k, o in st.optim.items()})
                   for name in ("exp_avg", "exp_avg_sq")}
        steps = {k: o["step"] for st in units.values() for k, o in st.optim.items()}
        out: dict[str, UnitState] = {}
        for sk in self.slices.values():
            for k, rk in sk.runtime_of.items():
                if rk not in model:
                    continue
                st = out.setdefault(key_unit[rk], UnitState({}, {}))
                st.model[rk] = model[rk]
                if k in steps:
                    st.optim[rk] = {"exp_avg": moments["exp_avg"][rk], "exp_avg_sq": moments["exp_avg_sq"][rk],
                                    "step": steps[k]}
        return out

    def canonical_unit_states(self, units: Mapping[str, UnitState], groups) -> dict[str, UnitState]:
        """The runtime's full units (``MasterOptimizer.export_units``) -> full canonical units. Collective like
        ``canonical``."""
        model = {k: v for st in units.values() for k, v in st.model.items()}
        optim = {k: o for st in units.values() for k, o in st.optim.items()}
        with_optim = bool(optim)  # every rank agrees: none before the first step, all after
        vectors = [model] + ([{k: o[n] for k, o in optim.items()} for n in ("exp_avg", "exp_avg_sq")]
                             if with_optim else [])
        full = self.canonical(vectors, groups)
        canonical_of = {rk: k for sk in self.slices.values() for rk, k in sk.canonical_of.items()}
        steps = {canonical_of[rk]: o["step"] for rk, o in optim.items()}
        out: dict[str, UnitState] = {}
        for k, unit in sorted(self.canonical_units().items()):
            st = out.setdefault(unit, UnitState({}, {}))
            st.model[k] = full[0][k]
            if with_optim:
                st.optim[k] = {"exp_avg": full[1][k], "exp_avg_sq": full[2][k], "step": steps[k]}
        return out

    def to_runtime(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Canonical tensors -> every runtime key of this rank's slices that they cover."""
        out: dict[str, torch.Tensor] = {}
        for sk in self.slices.values():
            out.update(sk.to_runtime(tensors))
        return out

    def _split_keys(self) -> dict[str, dict[str, tuple[torch.nn.Parameter, int, int]]]:
        """canonical key -> {runtime key: (parameter, shard, degree)} of every shard of it this rank holds."""
        out: dict[str, dict[str, tuple]] = {}
        for sk in self.slices.values():
            for rk, cut in sk.split.items():
                out.setdefault(sk.canonical_of[rk], {})[rk] = cut
        return out

    def canonical(self, vectors: Sequence[Mapping[str, torch.Tensor]], groups) -> list[dict[str, torch.Tensor]]:
        """Full canonical fp32 tensors of every key of this rank from runtime tensors (e.g. the weights, then
        the moments): each split key summed over its plan group from the lowest device of each shard's ring (one
        all-reduce per group, every member taking part), the other keys as they are. Collective when a plan
        group of this rank is reduced by TP shard."""
        split = self._split_keys()
        shard_keys = {rk for parts in split.values() for rk in parts}
        outs = [{k: v for k, v in vec.items() if k not in shard_keys} for vec in vectors]
        if not split:
            return outs
        shapes, unit_of = self.shapes, self.canonical_units()
        for devices, units in self.plan_groups:
            members = set(units)
            keys = sorted(k for k in split if unit_of[k] in members)
            if self.rank not in devices or not keys:
                continue
            fulls = [[self._assembled(split[k], vec, shapes[k], self.rings[unit_of[k]]) for k in keys]
                     for vec in vectors]
            flat = torch.cat([t.reshape(-1) for per_vec in fulls for t in per_vec])
            if len(devices) > 1:
                dist.all_reduce(flat, group=groups.param_group(devices))
            off = 0
            for out, per_vec in zip(outs, fulls):
                for k, t in zip(keys, per_vec):
                    out[k] = flat[off:off + t.numel()].view(t.shape).clone()  # not views of the whole buffer
                    off += t.numel()
        return outs

    def _assembled(self, parts: Mapping[str, tuple], vec: Mapping[str, torch.Tensor], shape: torch.Size,
                   rings: UnitRings) -> torch.Tensor:
        """A canonical tensor holding the shards of it this rank contributes (those whose ring it leads), zero
        elsewhere."""
        full = torch.zeros(shape, dtype=torch.float32, device=next(iter(vec.values())).device)
        for rk, (p, shard, degree) in parts.items():
            if rings.rings[shard][0] == self.rank:
                full += placed_full(vec[rk].to(torch.float32), p, shard, degree)
        return full


def shard_full_tensor(full: torch.Tensor, param: torch.nn.Parameter, shard: int, degree: int) -> torch.Tensor:
    from megatron_spindle.models import state  # not at import: models/ imports megatron-core (slow, warns)

    return state.shard_full_tensor(full, param, shard, degree)


def placed_full(tensor: torch.Tensor, param: torch.nn.Parameter, shard: int, degree: int) -> torch.Tensor:
    from megatron_spindle.models import state

    return state.placed_full(tensor, param, shard, degree)


def unit_of_key(key: str, units: Iterable[str]) -> str | None:
    return next((u for u in units if key.startswith(u + ".")), None)
