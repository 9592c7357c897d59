"""megatron-core 0.16.1's layernorm recomputation without Transformer Engine.

``recompute_modules=["layernorm"]`` runs each pre-norm under ``tensor_parallel.CheckpointWithoutOutput()``,
whose ``__init__`` sets ``self.fp8 = fp8 is not None``: with its default ``fp8=False`` that is True, so its
forward calls ``FP8GlobalStateManager``, which megatron/core/tensor_parallel/random.py imports only from
Transformer Engine. Without TE the first forward fails with "NameError: name 'FP8GlobalStateManager' is not
defined". ``patch_checkpoint_without_output()`` makes the flag what the caller passed where TE is absent (FP8
needs TE anyway); with TE installed it changes nothing.
"""

from __future__ import annotations

_PATCHED = False


def patch_checkpoint_without_output() -> None:
    """Idempotent; a no-op where megatron-core imported Transformer Engine."""
    global _PATCHED
    if _PATCHED:
        return
    from megatron.core.tensor_parallel import random as mrandom

    _PATCHED = True
    if getattr(mrandom, "HAVE_TE", False):
        return
    cls = mrandom.CheckpointWithoutOutput
    init = cls.__init__

    def __init__(self, fp8=False):
        init(self, fp8)
        self.fp8 = bool(fp8)  # not `fp8 is not None`: False must mean no FP8

    cls.__init__ = __init__
