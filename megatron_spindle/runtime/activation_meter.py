"""The activation memory a rank's step really allocates: every tensor autograd saves for the backward, counted
once per storage while it is saved (``torch.autograd.graph.saved_tensors_hooks``).

Saved tensors are what activation memory is (what recomputation and micro-batches trade against time); the
rest of a step's memory is parameter state, gradient buffers, and transient outputs and gradients the planner
does not count. A storage saved by several operations (q, k, v as views of one projection output; a layer's
input saved by the recomputation and again by its first norm) counts once, from its first save until the last
reference autograd holds is released (the graph is freed by the backward, or a recomputed layer's inner
graph after its own backward), so recomputation's transient activations are measured too. A storage counts
at its size now: megatron-core's layernorm recomputation releases a norm's output (``resize_(0)``) after the
next projection saved it, and refills it in the backward. Parameters (and anything sharing their storage: the
fast path's masters) are not activations and are left out.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class SavedTensorMeter:
    """Context manager: while active, ``live`` is the bytes of the distinct storages autograd holds for the
    backward, ``peak`` its maximum. ``exclude``: tensors (parameters) whose storages are not counted."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {e.untyped_storage()._cdata for e in exclude}  # kept through ZeRO-3's release/refill
        self._refs: dict[int, list] = {}  # storage -> [references, storage]
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage._cdata  # the storage itself, whatever its data pointer (released and refilled storages)
        if storage.nbytes() == 0 or key in self._exclude:
            return t
        return _Saved(self, key, storage, t)

    @staticmethod
    def _unpack(saved) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    @property
    def live(self) -> int:
        """Bytes of the storages autograd holds now, each at its current size."""
        return sum(storage.nbytes() for _, storage in self._refs.values())

    def _add(self, key: int, storage) -> None:
        ref = self._refs.get(key)
        if ref is None:
            self._refs[key] = [1, storage]
            self.peak = max(self.peak, self.live)
        else:
            ref[0] += 1

    def _release(self, key: int) -> None:
        ref = self._refs[key]
        ref[0] -= 1
        if ref[0] == 0:
            del self._refs[key]


class _Saved:
    """One saved tensor as autograd holds it: released (and uncounted) when autograd drops it."""

    __slots__ = ("meter", "key", "tensor")

    def __init__(self, meter: SavedTensorMeter, key: int, storage, tensor: torch.Tensor):
        self.meter, self.key, self.tensor = meter, key, tensor
        meter._add(key, storage)

    def __del__(self):
        self.meter._release(self.key)
