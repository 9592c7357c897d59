"""Run megatron-core 0.16.1 on a CPU-only torch, and choose Transformer Engine or local layer specs.

``apply_cpu_shim()`` installs a few small patches, each needed by a named piece of megatron-core code. It does
nothing when CUDA is available and is idempotent. What it fixes (measured with torch 2.13.0+cpu and gloo):

- without it, the first attention forward fails in ``GlobalMemoryBuffer.get_tensor`` (megatron/core/utils.py)
  with "Torch not compiled with CUDA enabled": about 80 places in tensor_parallel, transformer, models and
  pipeline_parallel allocate on ``torch.cuda.current_device()``;
- ``model_parallel_cuda_manual_seed`` fails in ``CudaRNGStatesTracker.add`` (``torch.cuda.get_rng_state``), and
  attention forks that tracker on every forward;
- the causal masks hard-code ``device="cuda"`` (``transformer/utils.py get_default_causal_mask`` and
  ``get_sliding_window_causal_mask``, built on every causal attention forward with ``attention_mask=None``): they
  run under ``cuda_factories_on_cpu()``, a torch-function mode that rewrites the device, entered only around
  them. The mode used to stay on for the whole thread; every torch call then passed through Python, which made a
  one-rank tiny-clip step 17 % slower (30.4 against 25.3 ms, alternating steps in one process);
- the RNG patch alone is not enough: the all-gather/reduce-scatter mappings still allocate on the CUDA device.

With the shim, GPTModel and TransformerBlock (local spec, TP 1 and 2) train on CPU, and TP=2 column/row parallel
linears match a dense reference to 2.4e-7. Sequence parallelism needs ``SequenceParallelTorchNorm`` in the local
spec (megatron-core's torch norm asserts it off). Still unsupported on CPU: gradient clipping in megatron's
optimizer (asserts ``torch.cuda.FloatTensor``), megatron's distributed optimizer (TypeError on CPU tensors),
megatron's grad scalers and its pipeline schedules (both allocate with ``device="cuda"``; wrap such calls in
``cuda_factories_on_cpu()``).

``te_available()`` and ``layer_spec(module_spec)`` pick megatron's Transformer Engine spec only where TE can work
and the plan's attention backend (``--attention-backend``) asks for TE; ``select_te_attention`` sets the switches
TE chooses its attention kernel by.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import os

import torch
from torch.overrides import TorchFunctionMode

_SHIM_APPLIED = False
_DEFAULT_MODEL_PARALLEL_SEED = 1234 + 2718  # megatron's offset for the model-parallel stream


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class CudaToCpuFactoryMode(TorchFunctionMode):
    """Rewrites ``device="cuda"`` in torch calls to the CPU, while entered (``cuda_factories_on_cpu``).

    Needed by megatron-core code that hard-codes the device: ``transformer/utils.py get_default_causal_mask``
    (``torch.ones(sq, sq, device="cuda")``), ``get_sliding_window_causal_mask``, and outside what the runtime
    runs, ``pipeline_parallel/schedules.py`` and the grad scalers.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Every torch call inside the mode passes through here: touch only calls that name a CUDA device.
        if kwargs and _is_cuda_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **(kwargs or {}))


def cuda_factories_on_cpu() -> CudaToCpuFactoryMode:
    """A context in which torch calls that name a CUDA device allocate on the CPU instead."""
    return CudaToCpuFactoryMode()


def _on_cpu(fn):
    @functools.wraps(fn)
    def on_cpu(*args, **kwargs):
        with cuda_factories_on_cpu():
            return fn(*args, **kwargs)
    return on_cpu


def _patch_causal_masks() -> None:
    """megatron's causal masks, built on the CPU: in ``transformer/utils.py`` and where ``fusions/fused_softmax.py``
    imported them by name (the softmax calls them on every causal forward without a mask)."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as mutils

    for name in ("get_default_causal_mask", "get_sliding_window_causal_mask"):
        patched = _on_cpu(getattr(mutils, name))
        setattr(mutils, name, patched)
        setattr(fused_softmax, name, patched)


def _cpu_current_device() -> str:
    """Stands in for ``torch.cuda.current_device()``.

    Needed by megatron-core's ``utils.GlobalMemoryBuffer.get_tensor`` (the attention score buffer in
    ``transformer/dot_product_attention.py``), the all-gather/reduce-scatter outputs in
    ``tensor_parallel/mappings.py``, ``tensor_parallel/layers.py`` and ``RotaryEmbedding`` buffers, which allocate
    on ``torch.cuda.current_device()``.
    """
    return "cpu"


def _no_cuda_synchronize(*args, **kwargs) -> None:
    """Stands in for ``torch.cuda.synchronize()``.

    Needed by ``pipeline_parallel/p2p_communication.py`` (after ``batch_isend_irecv`` when ``batch_p2p_sync``)
    and ``parallel_state.update_pg_timeout``.
    """
    return None


def _install_cpu_rng_tracker() -> None:
    """Replaces megatron's CUDA RNG tracker by one that forks the CPU generator.

    Needed by ``tensor_parallel/random.py``: ``CudaRNGStatesTracker.add`` calls ``torch.cuda.get_rng_state`` (so
    ``model_parallel_cuda_manual_seed`` fails on CPU) and ``fork`` (used around attention dropout in
    ``transformer/dot_product_attention.py`` and GPU-style weight init) swaps CUDA RNG states.
    """
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Named RNG streams on the CPU generator (same contract as megatron's CUDA tracker)."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    tracker = CpuRNGStatesTracker()
    # DotProductAttention forks this stream on every forward (even with dropout 0); megatron's
    # model_parallel_cuda_manual_seed(seed) resets the tracker and re-adds it with per-TP-rank seeds.
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, _DEFAULT_MODEL_PARALLEL_SEED)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _no_cuda_rng_state(*args, **kwargs) -> None:
    """megatron/core/tensor_parallel/random.py ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``: activation
    recomputation (``CheckpointFunction``, ``_fork_rng``) saves and restores the CUDA generator next to the CPU one.
    On CPU there is no CUDA generator; the CPU state it also saves is what dropout draws from, so nothing is lost."""
    return None


def _patch_cuda_rng_state() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = _no_cuda_rng_state
    mrandom._set_cuda_rng_state = _no_cuda_rng_state


def apply_cpu_shim() -> bool:
    """Install the CPU patches when CUDA is absent. Idempotent; returns True when the shim is (now) active.

    Do not call megatron's ``model_parallel_cuda_manual_seed(..., force_reset_rng=True)`` afterwards: that
    re-creates the CUDA RNG tracker.
    """
    global _SHIM_APPLIED
    if torch.cuda.is_available():
        return False
    if _SHIM_APPLIED:
        return True
    torch.cuda.current_device = _cpu_current_device
    torch.cuda.synchronize = _no_cuda_synchronize
    _install_cpu_rng_tracker()
    _patch_cuda_rng_state()
    _patch_causal_masks()
    _SHIM_APPLIED = True
    return True


@functools.cache
def te_available() -> bool:
    """True when CUDA is available and Transformer Engine imports cleanly.

    ``except Exception``: a TE install without its CUDA libraries raises RuntimeError, not ImportError.
    """
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


# Transformer Engine chooses its attention kernel by these switches (1: allowed). megatron-core's LanguageModule
# sets them from TransformerConfig.attention_backend; our operators build TransformerBlocks without one.
TE_ATTENTION_SWITCHES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
TE_ATTENTION_SETTINGS = {"flash": ("1", "0", "0"), "fused": ("0", "1", "0"), "unfused": ("0", "0", "1")}


def uses_te_spec(attention_backend: str = "auto") -> bool:
    """Whether transformer layers with this attention backend (plan/schema.py ``ATTENTION_BACKENDS``) are built on
    Transformer Engine's spec: local never; auto where TE is available (else the local spec); flash, fused and
    unfused only with TE (an error without it: the plan charged a kernel this machine cannot run)."""
    if attention_backend == "local":
        return False
    if te_available():
        return True
    if attention_backend == "auto":
        return False
    from megatron_spindle.plan.schema import PlanError

    raise PlanError(f"attention backend '{attention_backend}' is Transformer Engine's, which is not available on "
                    f"this machine: plan with --attention-backend local or auto")


def select_te_attention(attention_backend: str, environ=os.environ) -> None:
    """Set Transformer Engine's attention switches for a TE backend (flash, fused, unfused), as megatron-core's
    LanguageModule does; auto and local leave them as they are (TE's own choice, or unused). A switch the user
    set to another value is an error, as in megatron-core."""
    from megatron_spindle.plan.schema import PlanError

    wanted = TE_ATTENTION_SETTINGS.get(attention_backend)
    if wanted is None or not uses_te_spec(attention_backend):
        return
    for name, value in zip(TE_ATTENTION_SWITCHES, wanted):
        if environ.get(name, value) != value:
            raise PlanError(f"{name}={environ[name]} contradicts --attention-backend {attention_backend}, which "
                             f"sets it to {value}: unset NVTE_FLASH_ATTN, NVTE_FUSED_ATTN and NVTE_UNFUSED_ATTN")
    environ.update(zip(TE_ATTENTION_SWITCHES, wanted))


class SequenceParallelTorchNorm:
    """megatron-core's WrappedTorchNorm for a sequence-parallel layer of the local spec, which megatron-core refuses
    (``assert not config.sequence_parallel``, torch_norm.py) because nothing would sum the norm's gradients over
    the TP group: each rank's norm sees only its part of the sequence. Built from the layer's config with sequence
    parallelism off (the norm itself does not depend on it), its parameters are marked ``sequence_parallel`` as
    Transformer Engine's norms mark theirs, and the operators sum the gradients of every parameter so marked over
    the TP group (models/operator.py ``export_full_grads``; RowParallelLinear marks its biases itself)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        norm = WrappedTorchNorm(config=dataclasses.replace(config, sequence_parallel=False), hidden_size=hidden_size,
                                eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm


def layer_spec(module_spec, sequence_parallel: bool = False, attention_backend: str = "auto"):
    """megatron-core layer spec for a workload module (graph.workload.ModuleSpec): the Transformer Engine spec
    where ``uses_te_spec(attention_backend)``, else the local spec; RMSNorm for LLMs; the attention mask type from
    ``is_causal`` (bidirectional encoders use ``AttnMaskType.no_mask``). ``sequence_parallel``: the local spec's
    pre-norms are ``SequenceParallelTorchNorm`` (Transformer Engine's norms handle it themselves)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.enums import AttnMaskType

    normalization = "RMSNorm" if module_spec.kind == "llm" else "LayerNorm"
    te = uses_te_spec(attention_backend)
    if te:
        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = get_gpt_layer_local_spec(normalization=normalization)
    spec = copy.deepcopy(spec)
    if sequence_parallel and not te:
        spec.submodules.input_layernorm = SequenceParallelTorchNorm
        spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    mask_type = AttnMaskType.causal if module_spec.is_causal else AttnMaskType.no_mask
    spec.submodules.self_attention.params = {**spec.submodules.self_attention.params, "attn_mask_type": mask_type}
    return spec
