"""The activation memory a rank's step really allocates: every tensor autograd saves for the backward, counted
once per storage while it is saved (``torch.autograd.graph.saved_tensors_hooks``).

Saved tensors are what activation memory is (what recomputation and micro-batches trade against time); the
rest of a step's memory is parameter state, gradient buffers, and transient outputs and gradients the planner
does not count. A storage saved by several operations (q, k, v as views of one projection output; a layer's
input saved by the recomputation and again by its first norm) counts once, from its first save until the last
reference autograd holds is released (the graph is freed by the backward, or a recomputed layer's inner
graph after its own backward), so recomputation's transient activations are measured too. Parameters (and
anything sharing their storage: the fast path's masters) are not activations and are left out.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class SavedTensorMeter:
    """Context manager: while active, ``live`` is the bytes of the distinct storages autograd holds for the
    backward, ``peak`` its maximum. ``exclude``: tensors (parameters) whose storages are not counted."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = list(exclude)  # their storages are looked up at each save: ZeRO-3 refills them
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self.live = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or any(e.untyped_storage().data_ptr() == key for e in self._exclude):
            return t
        return _Saved(self, key, storage.nbytes(), t)

    @staticmethod
    def _unpack(saved) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _add(self, key: int, nbytes: int) -> None:
        ref = self._refs.get(key)
        if ref is None:
            self._refs[key] = [1, nbytes]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        else:
            ref[0] += 1

    def _release(self, key: int) -> None:
        ref = self._refs[key]
        ref[0] -= 1
        if ref[0] == 0:
            del self._refs[key]
            self.live -= ref[1]


class _Saved:
    """One saved tensor as autograd holds it: released (and uncounted) when autograd drops it."""

    __slots__ = ("meter", "key", "tensor")

    def __init__(self, meter: SavedTensorMeter, key: int, nbytes: int, tensor: torch.Tensor):
        self.meter, self.key, self.tensor = meter, key, tensor
        meter._add(key, nbytes)

    def __del__(self):
        self.meter._release(self.key)
