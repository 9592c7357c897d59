"""Gradient buckets of a plan: in which order the backward completes each parameter unit, how a parameter
device group's units are cut into buckets, and the one order in which every rank issues the buckets.

The runtime (runtime/grad_buffers.py, grad_sync.py) lays out and reduces its gradient buffers by these rules,
and the simulator times the same buckets, so both agree on what is reduced when:

- **Completion.** A unit's gradient is complete after the last backward that accumulates it: over every slice
  holding it, the one whose wave runs its backward last (plan/order.py's execution order: reverse wave order,
  or ``settings.backward_order``, segment after segment), and in that slice the unit's layer (a slice runs its
  layers' backward from last to first, so a lower position completes later). ``unit_completion`` gives a key
  per unit; a smaller key completes earlier.
- **Buckets.** A group's units in completion order, whole units, closed once a bucket holds at least
  ``limit`` elements: megatron-core DDP's ``bucket_size``, by default ``max(40M, 1M * group size)``
  (distributed_data_parallel_config.py).
- **Launch order.** Buckets by the completion of their last unit, then by group and index: buckets of one
  group come in index order, and any two ranks issue the buckets they share in the same relative order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from megatron_spindle.graph.opgraph import MetaOp
from megatron_spindle.plan.layout import SliceGeometry, slice_units
from megatron_spindle.plan.order import BWD, execution_order
from megatron_spindle.plan.schema import ExecutionSettings

DEFAULT_BUCKET_NUMEL = 40_000_000  # megatron-core DDP: max(40M, 1M * dp size) parameters per bucket
BUCKET_NUMEL_PER_MEMBER = 1_000_000

Completion = tuple[int, int]  # (backward step of the wave, -position of the unit in its slice); smaller: earlier


def default_bucket_numel(members: int) -> int:
    return max(DEFAULT_BUCKET_NUMEL, BUCKET_NUMEL_PER_MEMBER * members)


def backward_steps(num_waves: int, settings: ExecutionSettings) -> dict[int, int]:
    """wave index -> its step in the backward execution order (0 runs first)."""
    steps: dict[int, int] = {}
    for wi, phase in execution_order(num_waves, settings):
        if phase == BWD:
            steps[wi] = len(steps)
    return steps


def unit_completion(waves: Sequence[Sequence[SliceGeometry]], metaops: Mapping[str, MetaOp],
                    settings: ExecutionSettings) -> dict[str, Completion]:
    """unit -> when the backward completes it (module docstring): the latest (step, -position) over the slices
    holding it. With the default order this is the slice with the smallest (wave, position)."""
    steps = backward_steps(len(waves), settings)
    done: dict[str, Completion] = {}
    for wi, slices in enumerate(waves):
        for s in slices:
            for pos, u in enumerate(slice_units(metaops[s.metaop], s.layer_start, s.layer_end)):
                key = (steps[wi], -pos)
                if u not in done or key > done[u]:
                    done[u] = key
    return done


def completion_sorted(units: Sequence[str], completion: Mapping[str, Completion]) -> list[str]:
    """Units in the order the backward completes them (ties by name)."""
    return sorted(units, key=lambda u: (completion[u], u))


def split_buckets(units: Sequence[str], numel: Callable[[str], int], limit: int) -> list[list[str]]:
    """Whole units, in the given order, closed once a bucket holds at least ``limit`` elements."""
    out: list[list[str]] = []
    members: list[str] = []
    size = 0
    for i, u in enumerate(units):
        members.append(u)
        size += numel(u)
        if size >= limit or i == len(units) - 1:
            out.append(members)
            members, size = [], 0
    return out


def launch_key(done: Completion, devices: Sequence[int], index: int) -> tuple:
    """Sort key of a bucket in the plan-wide launch order: ``done`` is the completion of its last unit."""
    return (done, tuple(devices), index)
