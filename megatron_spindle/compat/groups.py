"""Process groups for operators that run on an explicit tensor-parallel group, outside megatron's global
``parallel_state`` (every slice of a Spindle plan has its own TP group).

megatron-core 0.16.1 layers read ``pg_collection.tp``, ``.pp`` and ``.cp`` and call ``group.size()`` /
``group.rank()`` on them, and skip every collective when ``size() == 1``. A ``SingleRankGroup`` stands in for a
group of one process, so TP=1 operators work with or without ``torch.distributed`` being initialised and without
creating (collective) process groups.
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection


class SingleRankGroup:
    """A process group of one rank. megatron-core bypasses collectives on groups of size 1, so this object is
    never handed to ``torch.distributed``; do not pass it to torch collectives yourself."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "SingleRankGroup()"


def group_size(group) -> int:
    return 1 if group is None else group.size()


def group_rank(group) -> int:
    return 0 if group is None else group.rank()


def make_pg_collection(tp_group=None, base: ProcessGroupCollection | None = None) -> ProcessGroupCollection:
    """A ProcessGroupCollection for one operator: ``tp`` from ``tp_group`` (or ``base.tp``; a SingleRankGroup when
    neither is given), ``pp`` and ``cp`` from ``base`` when it has them, else SingleRankGroups."""
    pgs = ProcessGroupCollection()
    tp = tp_group if tp_group is not None else getattr(base, "tp", None) if base is not None else None
    pgs.tp = tp if tp is not None else SingleRankGroup()
    for name in ("pp", "cp"):
        setattr(pgs, name, getattr(base, name, None) if base is not None else None)
        if getattr(pgs, name) is None:
            setattr(pgs, name, SingleRankGroup())
    return pgs


def ensure_global_memory_buffer() -> None:
    """megatron-core's ``DotProductAttention`` takes its score buffer from ``parallel_state``'s global memory buffer,
    which only ``initialize_model_parallel`` creates. Create it when missing (a megatron global, not ours)."""
    from megatron.core import parallel_state

    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()



def ensure_torch_distributed() -> bool:
    """Initialise a one-process gloo world (in-memory HashStore) when torch.distributed has none.

    megatron-core 0.16.1's ``get_tensor_model_parallel_group_if_none`` (called by every tensor-parallel mapping)
    turns any group into None when torch.distributed is not initialised, and the mappings then assert. With a
    world of one, explicit groups pass through. Returns True when it created the world. A process that wants its
    own multi-process world must call ``init_process_group`` before building operators.
    """
    if is_distributed():
        return False
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def ensure_model_parallel_rng(seed: int = 1234 + 2718) -> None:
    """megatron-core's ``DotProductAttention`` forks the tracker's ``model-parallel-rng`` stream on every forward
    (dropout or not). Add the stream when nobody has (``model_parallel_cuda_manual_seed`` does it in Megatron
    launches; the CPU shim already adds it). Dropout masks then depend on ``seed`` only, not the TP rank."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    if mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME not in tracker.get_states():
        tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed)
