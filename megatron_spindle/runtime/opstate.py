"""Probes of an operator's full (TP-unsharded, canonical) state: which exported keys are parameters, which
parameters the export returns unchanged, and the full gradients.

Operators only promise ``export_full_state() -> {"<unit>.<path>": tensor}`` (models/operator.py); these helpers
learn the rest by exporting with every parameter's data temporarily replaced.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def _export_swapped(op: torch.nn.Module, replacement: Callable) -> dict[str, torch.Tensor]:
    """``export_full_state`` with every parameter's data temporarily replaced by ``replacement(p)``."""
    params = list(op.parameters())
    saved = [p.data for p in params]
    for p in params:
        p.data = replacement(p)
    try:
        with torch.no_grad():
            return op.export_full_state()
    finally:
        for p, d in zip(params, saved):
            p.data = d


def param_keys(op: torch.nn.Module) -> list[str]:
    """Keys of ``export_full_state`` that come from parameters (not buffers): export once with every
    parameter set to NaN and keep the all-NaN entries. Collective over the operator's TP group."""
    st = _export_swapped(op, lambda p: torch.full_like(p, math.nan))
    return sorted(k for k, v in st.items() if v.is_floating_point() and v.numel() and bool(torch.isnan(v).all()))


def identical_params(op: torch.nn.Module, keys: list[str], device: torch.device) -> dict[str, torch.nn.Parameter]:
    """key -> the one fp32 parameter on ``device`` that ``export_full_state`` returns unchanged as that key,
    found by a probe: every parameter filled with distinct random values, each key's export compared with
    every probe. Keys that match no parameter, several, or a parameter another key matches are left out (a
    permuted layout, e.g. a QKV reorder, or a TP shard fails the comparison)."""
    gen = torch.Generator().manual_seed(0)
    probes = {id(p): torch.randn(p.shape, generator=gen).to(p.device, p.dtype) for p in op.parameters()}
    state = _export_swapped(op, lambda p: probes[id(p)])
    found: dict[str, torch.nn.Parameter] = {}
    for k in keys:
        hits = [p for p in op.parameters() if p.dtype == torch.float32 and p.device == device
                and p.shape == state[k].shape and torch.equal(probes[id(p)], state[k])]
        if len(hits) == 1:
            found[k] = hits[0]
    owners = [id(p) for p in found.values()]
    return {k: p for k, p in found.items() if owners.count(id(p)) == 1}


def full_grads(op: torch.nn.Module, keys: list[str]) -> dict[str, torch.Tensor]:
    """Full (TP-gathered, canonical) gradients: the operator's ``export_full_grads`` if it has one, else its
    ``export_full_state`` run on the gradients in place of the weights. Collective over its TP group."""
    if hasattr(op, "export_full_grads"):
        return op.export_full_grads()
    st = _export_swapped(op, lambda p: p.grad if p.grad is not None else torch.zeros_like(p))
    return {k: st[k] for k in keys}
