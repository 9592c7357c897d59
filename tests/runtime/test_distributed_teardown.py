"""runtime/distributed.py ``destroy_distributed``: what a run left in reference cycles is freed while the default
group still exists, not during the interpreter's finalization (where gloo objects abort the process)."""

from __future__ import annotations

import gc

from megatron_spindle.runtime import distributed
from megatron_spindle.runtime.distributed import DistContext, destroy_distributed


class _Cycle:
    """An object only a reference cycle keeps alive (as an engine's hooks keep the engine)."""

    freed: list[str] = []

    def __init__(self):
        self.me = self

    def __del__(self):
        _Cycle.freed.append("cycle")


def test_reference_cycles_are_freed_before_the_default_group_is_destroyed(monkeypatch):
    # the default group's own calls stand in (other tests of this process may hold a real one): the order matters
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda group=None: _Cycle.freed.append("group"))
    enabled = gc.isenabled()
    gc.disable()  # only the teardown's own collection may free the cycle
    try:
        _Cycle()
        assert _Cycle.freed == []
        destroy_distributed(DistContext(rank=0, world_size=1, local_rank=0, backend="gloo", owned=True))
        assert _Cycle.freed == ["cycle", "group"]
        destroy_distributed(DistContext(rank=0, world_size=1, local_rank=0, backend="gloo", owned=False))
        assert _Cycle.freed == ["cycle", "group"]  # a group it did not create is left alone
    finally:
        if enabled:
            gc.enable()
