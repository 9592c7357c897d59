"""Moving parameter units between ranks in memory, when the plan changes inside a run (a task-set change).

Before the old engine is torn down, every rank exports the units it holds in full form (``export_units``: fp32
weights and AdamW state). Under the new plan a unit may be needed on ranks that did not hold it; ``hand_over``
sends it there from one rank that has it. Every rank computes the same message list from globally known maps
(who holds each unit, who needs it), so no metadata travels except a two-number header per message saying
whether AdamW state comes along and its step; payloads are one flat fp32 vector per (unit, receiver), tensors
in name order: weights, then exp_avg, then exp_avg_sq. P2P over the default group (``batch_isend_irecv``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_spindle.checkpointing.checkpoint import UnitState


@dataclass(frozen=True)
class Move:
    unit: str
    src: int
    dst: int


def plan_moves(holders: Mapping[str, Sequence[int]], needs: Mapping[str, Sequence[int]]) -> list[Move]:
    """(unit, from, to) for every rank in ``needs[u]`` outside ``holders[u]``; the sender is the lowest holder.
    Sorted by unit then receiver, the order every rank posts its operations in. A needed unit nobody holds is
    not moved (the caller initialises it)."""
    moves = []
    for u in sorted(needs):
        have = sorted(holders.get(u, ()))
        if not have:
            continue
        moves += [Move(u, have[0], d) for d in sorted(set(needs[u]) - set(have))]
    return moves


def _flat(state: UnitState, keys: list[str]) -> torch.Tensor:
    parts = [state.model[k].reshape(-1) for k in keys]
    if state.optim:
        parts += [state.optim[k]["exp_avg"].reshape(-1) for k in keys]
        parts += [state.optim[k]["exp_avg_sq"].reshape(-1) for k in keys]
    return torch.cat([p.to(torch.float32) for p in parts])


def _unflat(flat: torch.Tensor, shapes: Mapping[str, tuple[int, ...]], has_optim: bool, step: float) -> UnitState:
    keys = sorted(shapes)
    views, off = [], 0
    for _ in range(3 if has_optim else 1):
        part = {}
        for k in keys:
            n = int(torch.Size(shapes[k]).numel())
            part[k] = flat[off:off + n].view(shapes[k]).clone()
            off += n
        views.append(part)
    optim = {k: {"exp_avg": views[1][k], "exp_avg_sq": views[2][k], "step": step} for k in keys} if has_optim else {}
    return UnitState(views[0], optim)


def _exchange(ops: list) -> None:
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()


def hand_over(held: Mapping[str, UnitState], moves: Sequence[Move], shapes: Mapping[str, Mapping[str, tuple]],
              rank: int, device: torch.device) -> dict[str, UnitState]:
    """Run ``moves`` (``plan_moves``): send what this rank holds (``held``) and return what it receives.
    ``shapes[u]``: the full shapes of unit ``u``'s tensors on the receiving rank (its new engine's
    ``expected_shapes()``). Collective over the ranks that send or receive."""
    mine_out = [m for m in moves if m.src == rank]
    mine_in = [m for m in moves if m.dst == rank]
    headers, ops = {}, []
    for m in mine_out:
        st = held[m.unit]
        step = float(next(iter(st.optim.values()))["step"]) if st.optim else 0.0
        h = torch.tensor([1.0 if st.optim else 0.0, step], dtype=torch.float64, device=device)
        ops.append(dist.P2POp(dist.isend, h, m.dst))
    for m in mine_in:
        headers[m] = torch.empty(2, dtype=torch.float64, device=device)
        ops.append(dist.P2POp(dist.irecv, headers[m], m.src))
    _exchange(ops)
    ops, payloads = [], {}
    for m in mine_out:
        st = held[m.unit]
        ops.append(dist.P2POp(dist.isend, _flat(st, sorted(st.model)).to(device), m.dst))
    for m in mine_in:
        numel = sum(int(torch.Size(s).numel()) for s in shapes[m.unit].values())
        payloads[m] = torch.empty(numel * (3 if headers[m][0] else 1), dtype=torch.float32, device=device)
        ops.append(dist.P2POp(dist.irecv, payloads[m], m.src))
    _exchange(ops)
    return {m.unit: _unflat(payloads[m], shapes[m.unit], bool(headers[m][0]), float(headers[m][1]))
            for m in mine_in}
