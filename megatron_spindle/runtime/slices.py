"""The slices this rank runs (localization, paper section 3.6 step 1): each built once, complete, with its
operator, its process groups and the parameter keys it exports; and the initial weights they hold."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_spindle.graph.opgraph import MetaGraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan.schema import Plan, Slice, dropouts, sequence_parallel_runs
from megatron_spindle.runtime.groups import PlanGroups
from megatron_spindle.runtime.layout import is_tp_leader, slice_units
from megatron_spindle.runtime.opstate import param_keys
from megatron_spindle.runtime.tp_shards import KeyLayout, SliceKeys

TERMINAL_KINDS = ("loss", "lm_head")


@dataclass(frozen=True)
class LocalSlice:
    """A slice this rank runs. ``param_keys``: the runtime keys of its parameters ("<unit>.<path>", full form,
    or a TP shard's "<sub-unit>.<path>": runtime/tp_shards.py), ``keys`` their translation to and from the
    operator's canonical keys; ``dp_loss_mean``: a terminal operator whose DP ranks each return the task loss
    (not a share of it). A slice of a frozen module trains nothing: its weights are ``frozen_keys``, outside every
    gradient and optimizer structure."""

    slice: Slice
    wave: int
    op: torch.nn.Module
    pgs: Any
    units: list[str]
    terminal: bool
    tp_leader: bool
    num_inputs: int
    param_keys: list[str]
    dp_loss_mean: bool
    keys: SliceKeys
    frozen_keys: tuple[str, ...] = ()  # canonical keys of its frozen weights (runtime/frozen.py): none of the above


def is_terminal(metagraph: MetaGraph, s: Slice) -> bool:
    m = metagraph.metaops[s.metaop]
    return m.kind in TERMINAL_KINDS and s.layer_end == m.num_layers and not metagraph.successors(m.id)


def build_local_slices(plan: Plan, workload: Workload, metagraph: MetaGraph, rank: int, groups: PlanGroups,
                       factory: Callable, device: torch.device, dtype: torch.dtype,
                       layout: KeyLayout) -> dict[str, LocalSlice]:
    """slice id -> LocalSlice for every slice on ``rank``, built in wave order (operator construction and the
    parameter probe are collective over the slice's TP group). A slice that recomputes activations
    (``settings.recompute_of``) is built with ``factory(..., recompute=Recompute)``, one that runs
    sequence-parallel (``sequence_parallel_runs``) with ``factory(..., sequence_parallel=True)``, and a layer slice
    of a plan with an attention backend other than auto with ``factory(..., attention_backend=...)``, and a layer
    or front-end slice of a plan with dropout with ``factory(..., hidden_dropout=p, attention_dropout=q)`` (those
    not 0). Each slice's keys are registered in ``layout``."""
    local = {}
    for wi, w in enumerate(plan.waves):
        for s in w.slices:
            if rank not in s.devices:
                continue
            info = plan.metaop(s.metaop)
            pgs = groups.slice_pgs(s.id)
            rc = plan.settings.recompute_of(s.id).for_layers(s.num_layers) if s.kind == "layer" else None
            extra = {"recompute": rc} if rc is not None and rc.mode != "none" else {}
            if sequence_parallel_runs(plan.settings.sequence_parallel, s.kind, s.tp, info.input_shape[1],
                                      workload.modules.get(s.module)):
                extra["sequence_parallel"] = True
            if s.kind == "layer" and plan.settings.attention_backend != "auto":
                extra["attention_backend"] = plan.settings.attention_backend
            if s.kind in ("layer", "frontend"):  # a text front end drops its embeddings (models/frontends.py)
                extra.update({name: p for name, p in dropouts(plan.settings).items() if p})
            op = factory(workload, info, s.layer_start, s.layer_end, pg_collection=pgs, dp_group=pgs.dp, **extra)
            op = op.to(device=device, dtype=dtype)
            units = slice_units(metagraph, s)  # none of a frozen slice's (its operator's weights need no gradient)
            canonical = param_keys(op)
            frozen = tuple(canonical) if metagraph.metaops[s.metaop].frozen else ()
            keys = layout.slices[s.id] = SliceKeys(s, rank, op, [] if frozen else canonical, units, layout.rings)
            local[s.id] = LocalSlice(
                slice=s, wave=wi, op=op, pgs=pgs, units=units, terminal=is_terminal(metagraph, s),
                tp_leader=is_tp_leader(s, rank), num_inputs=1 if s.layer_start > 0 else len(info.preds),
                param_keys=keys.runtime, dp_loss_mean=getattr(op, "dp_loss_reduction", "sum") == "mean", keys=keys,
                frozen_keys=frozen)
    return local


def in_wave_order(local: dict[str, LocalSlice]) -> list[LocalSlice]:
    return sorted(local.values(), key=lambda ls: ls.wave)


def unit_holders(local: dict[str, LocalSlice],
                 key_unit: dict[str, str]) -> dict[str, list[tuple[LocalSlice, list[str]]]]:
    """unit -> the local slices holding it (wave order) and each one's parameter keys of it."""
    holders: dict[str, list[tuple[LocalSlice, list[str]]]] = {}
    for ls in in_wave_order(local):
        keys: dict[str, list[str]] = {}
        for k in ls.param_keys:
            keys.setdefault(key_unit[k], []).append(k)
        for u, ks in keys.items():
            holders.setdefault(u, []).append((ls, ks))
    return holders


def local_slice_units(local: dict[str, LocalSlice], key_unit: dict[str, str]) -> dict[str, list[str]]:
    """slice id -> the runtime units its parameter keys belong to (a unit's TP shards are units of their own)."""
    return {sid: sorted({key_unit[k] for k in ls.param_keys}) for sid, ls in local.items()}


def initial_weights(local: dict[str, LocalSlice], rank: int,
                    device: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(runtime key -> full fp32 weight, runtime key -> its unit) from the operators' own deterministic
    initialisation, and the canonical shapes recorded in each slice's keys; slices holding the same key must
    agree. Collective per TP group (wave order)."""
    full: dict[str, torch.Tensor] = {}
    key_unit: dict[str, str] = {}
    for ls in in_wave_order(local):
        state = ls.op.export_full_state()
        ls.keys.shapes.update({k: state[k].shape for k in (*ls.keys.canonical, *ls.frozen_keys)})
        for k, v in ls.keys.to_runtime({k: state[k] for k in ls.keys.canonical}).items():
            v = v.detach().to(device, torch.float32)
            if k in full:
                if not torch.equal(full[k], v):
                    raise RuntimeError(f"parameter '{k}' was initialised differently by two slices on rank "
                                       f"{rank}: operators must initialise weights from unit names")
                continue
            full[k] = v.clone()
            key_unit[k] = ls.keys.unit_of[k]
    return full, key_unit
