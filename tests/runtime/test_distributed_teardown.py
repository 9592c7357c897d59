"""runtime/distributed.py ``destroy_distributed``: what a run left in reference cycles is freed while the default
group still exists, not during the interpreter's finalization (where gloo objects abort the process)."""

from __future__ import annotations

import gc

import torch.distributed as dist

from megatron_spindle.runtime.distributed import destroy_distributed, init_distributed


class _Cycle:
    """An object only a reference cycle keeps alive (as an engine's hooks keep the engine); notes whether the
    default group still existed when it was freed."""

    freed_with_group: list[bool] = []

    def __init__(self):
        self.me = self

    def __del__(self):
        _Cycle.freed_with_group.append(dist.is_initialized())


def test_reference_cycles_are_freed_before_the_default_group_is_destroyed():
    assert not dist.is_initialized()
    enabled = gc.isenabled()
    gc.disable()  # only the teardown's own collection may free the cycle
    try:
        ctx = init_distributed("gloo")
        assert ctx.owned
        _Cycle()
        assert _Cycle.freed_with_group == []
        destroy_distributed(ctx)
        assert _Cycle.freed_with_group == [True]
        assert not dist.is_initialized()
    finally:
        if enabled:
            gc.enable()
