"""Which island (node) each slice runs on, chosen for the whole schedule at once.

Greedy placement (planner/placement.py) picks a slice's island wave by wave, by what earlier waves left where:
it cannot see that putting a slice on the other node now would let the next waves' slices of the same MetaOp
stay put. When a later wave's packing then forces a MetaOp across the node boundary, its activations cross
the network, forward and back, at a GPU's own network path (C9's p2p profile, about 17x slower than NVLink):
on clip-7 / 16 the CP-SAT plans pack their waves to 694 ms but move 0.9 GB across nodes.

Here a small CP-SAT model chooses the island of every island-sized block of every slice (``block_sizes``: a
slice of at most a node is one block; a larger one is whole nodes plus the remainder, as placement cuts it) so
that every wave's blocks fit the islands, minimising

- the activation bytes whose producer and consumer blocks sit on different islands (each pair of blocks
  weighted by the samples their rows share, the rows model of plan/layout.py), plus
- the gradient bytes of every unit whose holders span several islands, once per extra island (its parameter
  device group's sync crosses the network; weighted like placement's ``sync_penalty``).

The greedy placement's islands are the hint, and an assignment that costs no less than them on this count is
not returned; placement then picks the devices inside each island as usual (local copies, shared weights, memory).
Memory is not modelled here: a block whose island has no room falls back to placement's own choice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from megatron_spindle.plan.layout import position_rows

ISLANDS_TIME_LIMIT = 0.5  # deterministic units of CP-SAT time per assignment (0.4-0.8 s on a 2-core VM)
ISLANDS_MAX_CHOICES = 4000  # blocks x islands; larger schedules keep the greedy islands (1024 GPUs: 128 islands)
BYTES_UNIT = 1e5  # the model's integer weights count this many bytes
SEED = 0


def block_sizes(n: int, gpus_per_node: int) -> list[int]:
    """A slice's island-sized pieces: itself when it fits a node, else whole nodes plus the remainder (so TP
    groups never straddle nodes)."""
    if n <= gpus_per_node:
        return [n]
    return [gpus_per_node] * (n // gpus_per_node) + ([n % gpus_per_node] if n % gpus_per_node else [])


def slice_blocks(n: int, tp: int, dp: int, gpus_per_node: int) -> list[tuple[int, int, float, float]]:
    """(first position, size, lo, hi) of each block (``block_sizes``) of a (tp, dp) slice of n devices, with the
    fraction [lo, hi) of the batch its positions hold (the rows model; TP replicas hold the same rows)."""
    out, start = [], 0
    for size in block_sizes(n, gpus_per_node):
        lo = position_rows(start, tp, dp, dp)[0] / dp
        hi = position_rows(start + size - 1, tp, dp, dp)[1] / dp
        out.append((start, size, lo, hi))
        start += size
    return out


def assign_islands(slices: Mapping, producers: Mapping, flow_bytes: Mapping, unit_grad_bytes: Mapping,
                   waves: Sequence[Sequence], num_islands: int, gpus_per_node: int,
                   hint: Mapping | None = None, time_limit: float | None = None) -> dict | None:
    """``{(slice key, block index): island}`` for every block, or None when the model is too large, finds
    nothing, or finds nothing cheaper than ``hint``. ``slices``: key -> (n, tp, dp); ``producers``: key ->
    producer keys; ``flow_bytes``: key -> {producer: activation bytes of the whole batch}; ``unit_grad_bytes``:
    key -> {unit: gradient bytes}; ``waves``: the keys of each wave; ``hint``: the greedy placement's islands,
    same keys as the result."""
    from ortools.sat.python import cp_model

    blocks = {key: slice_blocks(*slices[key], gpus_per_node) for key in slices}
    block_keys = [(key, b) for key, bl in blocks.items() for b in range(len(bl))]
    if num_islands < 2 or len(block_keys) * num_islands > ISLANDS_MAX_CHOICES:
        return None
    pairs, spreads = _weights(blocks, producers, flow_bytes, unit_grad_bytes)
    model = cp_model.CpModel()
    islands = range(num_islands)
    y = {(kb, i): model.new_bool_var("") for kb in block_keys for i in islands}
    for kb in block_keys:
        model.add_exactly_one(y[kb, i] for i in islands)
    for keys in waves:
        for i in islands:
            model.add(sum(size * y[(key, b), i] for key in keys for b, (_, size, _, _) in enumerate(blocks[key]))
                      <= gpus_per_node)
    cost = []
    for weight, a, b in pairs:
        x = model.new_bool_var("")  # 1 when the blocks sit on different islands: a tighter relaxation than
        for i in islands:  # "kept" indicators per island, which the search improved more slowly
            model.add(x >= y[a, i] - y[b, i])
        cost.append(weight * x)
    for weight, held in spreads:
        for i in islands:
            h = model.new_bool_var("")  # the unit has a holder on island i
            for kb in held:
                model.add_implication(y[kb, i], h)
            cost.append(weight * h)
    model.minimize(sum(cost))
    for kb, island in (hint or {}).items():
        for i in islands:
            model.add_hint(y[kb, i], int(i == island))
    solver = cp_model.CpSolver()
    solver.parameters.random_seed = SEED
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = time_limit or ISLANDS_TIME_LIMIT
    if solver.solve(model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    chosen = {kb: next(i for i in islands if solver.value(y[kb, i])) for kb in block_keys}
    if hint is not None and _cost(chosen, pairs, spreads) >= _cost(hint, pairs, spreads):
        return None
    return chosen


def _weights(blocks: Mapping, producers: Mapping, flow_bytes: Mapping, unit_grad_bytes: Mapping):
    """The objective's integer weights: (weight, producer block, consumer block) for each pair of blocks whose
    rows overlap, and (weight, blocks holding the unit) for each unit."""
    pairs = []
    for c, prods in producers.items():
        for p in prods:
            for bp, (_, _, plo, phi) in enumerate(blocks[p]):
                for bc, (_, _, clo, chi) in enumerate(blocks[c]):
                    weight = round(flow_bytes[c][p] * max(0.0, min(phi, chi) - max(plo, clo)) / BYTES_UNIT)
                    if weight > 0:
                        pairs.append((weight, (p, bp), (c, bc)))
    held: dict[str, list] = {}
    grad: dict[str, float] = {}
    for key, units in unit_grad_bytes.items():
        for u, g in units.items():
            held.setdefault(u, []).extend((key, b) for b in range(len(blocks[key])))
            grad[u] = max(grad.get(u, 0.0), g)
    spreads = [(round(grad[u] / BYTES_UNIT), kbs) for u, kbs in held.items() if round(grad[u] / BYTES_UNIT) > 0]
    return pairs, spreads


def _cost(assignment: Mapping, pairs: list, spreads: list) -> int:
    """The objective of an assignment (every block keyed)."""
    return sum(w for w, a, b in pairs if assignment[a] != assignment[b]) + \
        sum(w * len({assignment[kb] for kb in kbs}) for w, kbs in spreads)
