"""The fast path ("direct units"): operator parameters that alias their fp32 master and gradient buffer.

A unit is direct on this rank when the replicated optimizer (zero_stage 0) runs in float32 and every local
slice holding it has TP 1 and an operator whose parameters are the unit's canonical tensors themselves
(``opstate.identical_params``: a permuted layout such as a QKV reorder stays generic). Its parameters are bound
to views of the master (``.data``) and of the gradient buffer (``.grad``); local slices holding the same key
share the views (tied storage). Autograd then accumulates every slice's contribution in place into the buffer
(GradMode is off in backward), AdamW's in-place update of the master is the operators' update, and nothing is
exported or pushed for these units. Other units (TP shards, ZeRO-1 and 2, low precision, other layouts) are generic:
their gradients are exported after each slice's backward and their weights loaded back after each step.
Directness is decided per rank; the buffers' layout is not, so ranks may differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_spindle.runtime.opstate import identical_params
from megatron_spindle.runtime.shards import UnitShard
from megatron_spindle.runtime.slices import LocalSlice


@dataclass(frozen=True)
class DirectBinding:
    """``units``: the direct units (sorted); per slice id: ``params`` key -> the bound parameter,
    ``generic_keys`` the keys of units that are not direct, ``free_params`` the parameters not bound."""

    units: list[str]
    params: dict[str, dict[str, torch.nn.Parameter]]
    generic_keys: dict[str, list[str]]
    free_params: dict[str, list[torch.nn.Parameter]]


def bind_direct_units(local: dict[str, LocalSlice], key_unit: dict[str, str], shards: dict[str, UnitShard],
                      masters: dict[str, torch.nn.Parameter], key_grads: dict[str, torch.Tensor], enabled: bool,
                      device: torch.device) -> DirectBinding:
    """Bind every eligible unit's parameters to views of its master and gradient buffer (``enabled``: the
    optimizer is replicated and fp32)."""
    direct = set(shards) if enabled else set()
    found: dict[str, dict[str, torch.nn.Parameter]] = {}
    for sid, ls in local.items():
        found[sid] = identical_params(ls.op, ls.param_keys, device) if ls.slice.tp == 1 else {}
        direct -= {key_unit[k] for k in ls.param_keys if k not in found[sid]}
    weights = {k: v for u in direct for k, v in shards[u].unflatten(masters[u].detach()).items()}
    params, generic, free = {}, {}, {}
    for sid, ls in local.items():
        params[sid] = {k: p for k, p in found[sid].items() if key_unit[k] in direct}
        for k, p in params[sid].items():
            p.data, p.grad = weights[k], key_grads[k]
        tied = {id(p) for p in params[sid].values()}
        generic[sid] = [k for k in ls.param_keys if key_unit[k] not in direct]
        free[sid] = [p for p in ls.op.parameters() if id(p) not in tied]
    return DirectBinding(sorted(direct), params, generic, free)
