"""The execution plan, schema version 2: the contract between the planners, the simulator and the runtime.

Layout conventions (implemented once, in ``plan/layout.py`` and ``plan/routing.py``):

- A slice runs layers ``[layer_start, layer_end)`` of its MetaOp's chain (0-based, relative to the MetaOp; the
  module layer is ``metaop.layer_offset + i``) on ``devices`` with ``tp * dp == len(devices)``. Device
  ``devices[r]`` has tensor-parallel rank ``r % tp`` and data-parallel rank ``r // tp``; data-parallel rank k
  holds samples ``[k*B/dp, (k+1)*B/dp)`` of the MetaOp's batch B. Planners order each TP group's devices so
  that a device holds one TP shard of every unit over all its slices (``plan/tp_shards.py``
  ``aligned_device_orders``); a hand-made plan need not, and then reduces those shards on larger rings
  (which the simulator charges: ``group_rings``).
- Wave ``i`` is ``waves[i]`` (``index == i``) and waves run one after another; within a wave the slices' device
  sets are disjoint. The order of forward and backward passes is the ``settings``' (``plan/order.py``).
- A transfer moves a producer slice's output to a consumer slice (activations forward, their gradients
  backward): between consecutive slices of one MetaOp, and from the slice holding a producer MetaOp's last
  layer to the slice holding the consumer MetaOp's first layer.
- ``param_groups`` lists, per distinct device set, the weights held by exactly those devices (the paper's
  parameter device group pool); gradients of those weights are synchronised inside that set.

``settings`` (``ExecutionSettings``) is everything the runtime and the simulator obey. ``planner`` is a free
dict of planner diagnostics (which planner, solver status, notes, timings) that nothing executes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 2
PLAN_FORMAT = "megatron-spindle-plan"
TRANSFER_KINDS = ("local", "intra_island", "inter_island")
RECOMPUTE_MODES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("block", "uniform")  # megatron-core's recompute_method
# megatron-core's recompute_modules of a dense layer under selective recomputation, in canonical order
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp")
DEFAULT_RECOMPUTE_MODULES = ("core_attn",)
# module kinds whose layers may recompute their MLP: megatron-core 0.16.1's checkpoint of an MLP that returns its
# fc2 bias (every encoder's: linear biases) recurses in the backward without end, so only bias-free MLPs (llm)
MLP_RECOMPUTE_KINDS = ("llm",)
PHASES = ("fwd", "bwd")
ZERO_STAGES = (0, 1, 2, 3)
RUNTIME_ZERO_STAGES = (0, 1, 2, 3)  # what Spindle's runtime implements (runtime/weight_shards.py: 3)
REDUCE_DTYPE_BYTES = {"fp32": 4, "bf16": 2}
# Megatron-LM's --attention-backend (megatron-core AttnBackend): flash, fused and unfused are Transformer Engine's
# attention kernels, local megatron-core's own attention core (its local spec), auto Transformer Engine's choice
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
# ExecutionSettings' fields the user's flags choose and the models charge: the cost model (estimator.
# execution_cost_config) the first five and the last, the planner's estimate and the simulator the gradient
# sync's two and the last (its bytes);
# PlannerConfig has them too, by the same names, and every plan records the ones it was planned with
EXECUTION_CHOICES = ("sequence_parallel", "attention_backend", "grad_norm", "hidden_dropout", "attention_dropout",
                     "overlap_grad_reduce", "ddp_bucket_size", "grad_reduce_dtype")
DROPOUTS = ("hidden_dropout", "attention_dropout")


class PlanError(ValueError):
    """A plan that is malformed or does not match the workload/cluster it is used with."""


@dataclass(frozen=True)
class Recompute:
    """Activation recomputation of a slice's transformer layers, as megatron-core's TransformerConfig says it:

    - ``none``: every layer keeps what its backward needs;
    - ``selective``: parts of every layer are recomputed in the backward (``recompute_granularity="selective"``)
      as ``modules`` says (megatron-core's ``recompute_modules``; None: ``["core_attn"]``, its default):
      ``core_attn`` the attention core (QK^T, softmax, PV), ``layernorm`` the two pre-norms (their outputs are
      released after use and rerun when the backward needs them), ``mlp`` the whole MLP;
    - ``full``: a recomputed layer keeps only its input and reruns its forward in the backward
      (``recompute_granularity="full"``). With ``method="block"`` the first ``layers`` layers of the slice
      recompute, each on its own (None: all of them; ``recompute_method="block"``, ``recompute_num_layers``);
      with ``method="uniform"`` every layer recomputes, in chunks of ``layers`` layers that keep one input each
      (None: chunks of 1; ``recompute_method="uniform"``). ``full`` with the block method and ``modules``: the
      first ``layers`` layers recompute fully and the others selectively, rerunning ``modules``. megatron-core
      takes one granularity per TransformerBlock, so such a slice runs as two blocks (``blocks``)."""

    mode: str = "none"
    layers: int | None = None
    method: str = "block"
    modules: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.mode not in RECOMPUTE_MODES:
            raise PlanError(f"recompute mode '{self.mode}' is not one of {', '.join(RECOMPUTE_MODES)}")
        if self.method not in RECOMPUTE_METHODS:
            raise PlanError(f"recompute method '{self.method}' is not one of {', '.join(RECOMPUTE_METHODS)}")
        if self.modules is not None:
            self._check_modules()
        if self.layers is not None and (self.mode != "full" or not _is_count(self.layers)):
            raise PlanError(f"recompute layers {self.layers!r}: only 'full' takes a count of layers (an integer "
                            f">= 0), got mode '{self.mode}'")
        if self.method == "uniform" and (self.mode != "full" or self.layers == 0):
            raise PlanError(f"recompute method 'uniform' needs mode 'full' and chunks of at least 1 layer, got "
                            f"mode '{self.mode}', layers {self.layers!r}")

    def _check_modules(self) -> None:
        mods = self.modules
        if isinstance(mods, str) or not all(isinstance(m, str) for m in mods):
            raise PlanError(f"recompute modules {mods!r}: a list of module names")
        unknown = sorted(set(mods) - set(RECOMPUTE_MODULES))
        if unknown or not mods:
            raise PlanError(f"recompute modules {list(mods)!r}: each one of {', '.join(RECOMPUTE_MODULES)}, at "
                            f"least one")
        if self.mode == "none" or self.method != "block":
            raise PlanError(f"recompute modules {list(mods)!r}: only mode 'selective', or 'full' with method "
                            f"'block' (for the layers it does not recompute fully), takes modules, got mode "
                            f"'{self.mode}', method '{self.method}'")
        canonical = tuple(m for m in RECOMPUTE_MODULES if m in mods)
        # selective's default is stored as None, so Recompute("selective") equals it; full's None reruns nothing
        default = self.mode == "selective" and canonical == DEFAULT_RECOMPUTE_MODULES
        object.__setattr__(self, "modules", None if default else canonical)

    @property
    def recompute_modules(self) -> tuple[str, ...]:
        """The layer parts a selective recomputation reruns: every layer's, or under ``full`` those of the layers
        not recomputed fully (none for other modes)."""
        if self.mode == "full":
            return self.modules or ()
        if self.mode != "selective":
            return ()
        return self.modules or DEFAULT_RECOMPUTE_MODULES

    def blocks(self, num_layers: int) -> list[tuple[int, Recompute]]:
        """A slice of ``num_layers`` layers as runs of consecutive layers, first to last, each with the one
        megatron-core recomputation of a TransformerBlock: (layers, choice). One run, except full recomputation
        of some of the layers with the others' modules rerun: the fully recomputed ones, then the others."""
        rc = self.for_layers(num_layers)
        if rc.mode != "full" or rc.modules is None:
            return [(num_layers, rc)]
        k = rc.recomputed_layers(num_layers)
        return [(k, Recompute("full")), (num_layers - k, Recompute("selective", modules=rc.modules))]

    def recomputed_layers(self, num_layers: int) -> int:
        """How many of a slice's ``num_layers`` layers rerun their whole forward in the backward."""
        if self.mode != "full":
            return 0
        if self.method == "uniform" or self.layers is None:
            return num_layers
        return min(self.layers, num_layers)

    def chunk(self, num_layers: int | None = None) -> int:
        """Layers per checkpointed chunk (1 except ``uniform``); of a slice of ``num_layers`` layers, the largest
        divisor of its layer count up to ``layers`` (megatron-core's uniform method needs whole chunks)."""
        if self.method != "uniform":
            return 1
        c = self.layers or 1
        if num_layers is not None:
            c = min(c, num_layers)
            while num_layers % c:
                c -= 1
        return c

    def for_layers(self, num_layers: int) -> Recompute:
        """The same choice for a slice of ``num_layers`` layers, in its plainest form: full recomputation of 0
        layers is none (or selective of its modules), of every layer (one at a time) is ``Recompute("full")``."""
        if self.mode != "full":
            return self
        if self.method == "uniform":
            c = self.chunk(num_layers)
            return Recompute("full") if c == 1 else Recompute("full", c, "uniform")
        k = self.recomputed_layers(num_layers)
        if k == 0:
            return Recompute("selective", modules=self.modules) if self.modules else Recompute("none")
        return Recompute("full") if k == num_layers else Recompute("full", k, modules=self.modules)

    def describe(self) -> str:
        if self.mode == "selective" and self.modules is not None:
            return f"selective ({', '.join(self.modules)})"
        if self.mode != "full" or (self.layers is None and self.method == "block"):
            return self.mode
        if self.method == "uniform":
            return f"full (uniform, chunks of {self.chunk()})"
        rest = f" + selective ({', '.join(self.modules)})" if self.modules else ""
        return f"full ({self.layers} layers){rest}"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recompute:
        d = dict(d)
        if isinstance(d.get("modules"), list):
            d["modules"] = tuple(d["modules"])
        return cls(**d)


def recompute_fits(recompute: Recompute, module_kind: str) -> bool:
    """Whether a layer of a module of ``module_kind`` can run ``recompute`` (``MLP_RECOMPUTE_KINDS``)."""
    return "mlp" not in recompute.recompute_modules or module_kind in MLP_RECOMPUTE_KINDS


def fitted_recompute(recompute: Recompute, module_kind: str) -> Recompute:
    """``recompute`` for a layer of ``module_kind``: without the MLP where it cannot rerun it (the other modules
    it names, or megatron-core's default core_attn when the MLP was the only one)."""
    if recompute_fits(recompute, module_kind):
        return recompute
    rest = tuple(m for m in recompute.recompute_modules if m != "mlp")
    return dataclasses.replace(recompute, modules=rest or DEFAULT_RECOMPUTE_MODULES)


Step = tuple[int, str, "str | None"]  # (wave index, "fwd" | "bwd", task or None: every slice of the wave)


@dataclass(frozen=True)
class ExecutionSettings:
    """What the runtime and the simulator obey, besides the waves themselves.

    - ``recompute``: the plan-wide activation recomputation of layer slices; ``slice_recompute`` overrides it
      per slice id.
    - ``zero_stage``: ZeRO stage of the whole plan (0 none, 1 optimizer state, 2 + gradients, 3 + weights
      sharded over a slice's data-parallel ranks; 1 is Megatron's distributed optimizer).
    - ``segments``: groups of wave indices that run forward then backward one after another (temporal
      decoupling, a task per segment); None: the whole plan is one segment.
    - ``micro_batches``: every task's batch is split into this many micro-batches (rows
      ``[j*B/m, (j+1)*B/m)``), each run through the whole order, gradients accumulated (dp divides B/m).
    - ``backward_order``: wave indices in the order their backward runs (per segment); None: reverse wave order.
    - ``order``: an explicit execution order instead of segments and backward order: steps ``(wave, phase,
      task)``, each the forward or backward of the wave's slices of ``task`` (None: all of them), every slice's
      forward and backward exactly once (plan/order.py); e.g. early backward, a task's backward right after
      its loss.
    - ``grad_reduce_dtype``: the dtype gradients are accumulated and reduced in (``grad_reduce_bytes`` per
      element): fp32 main gradients (Megatron-LM's default for bf16 training) or, with ``--grad-reduce-in-bf16``,
      bf16 ones, cast to fp32 for the optimizer step; the memory model counts their bytes.
    - ``overlap_param_gather``: at ZeRO stages 1 and 2, the all-gather of the updated weights after the optimizer
      step is asynchronous, and the next iteration's forward waits for a parameter device group's gather only
      before the first slice that uses its weights (Megatron's ``--overlap-param-gather``); at stage 3 the
      redistribution of the regathered groups' weights likewise (plan/buckets.py); False: every gather
      completes within the step (DeepSpeed's ZeRO-1/2). Without the key (plans written before it): False.
    - ``sequence_parallel``: Megatron's sequence parallelism in the layer slices where ``sequence_parallel_runs``
      says it applies (``--sequence-parallel``). Without the key: False.
    - ``attention_backend``: the attention core every transformer layer runs (``ATTENTION_BACKENDS``), which the
      planner and the simulator charge (``attention_kernels``) and the runtime builds: ``local`` megatron-core's
      local spec; the others Transformer Engine's spec with that attention (``auto``: TE's own choice of flash
      or fused; charged as flash). Without the key (plans written before it): auto, which a runtime without
      TE runs on the local spec, as those plans were run.
    - ``tp_sharded_grads``: the layout gradients and optimizer state are kept and reduced in. True (the
      default, as in Megatron-LM and DeepSpeed): by TP shard, each shard of a parameter device group's degree
      (plan/buckets.py ``group_tp``) over the ring of devices holding it (plan/tp_shards.py; the runtime's
      runtime/tp_shards.py). False: whole units (the TP ranks' parts added into one canonical buffer), reduced
      and, under ZeRO, sharded over every member of the parameter device group; a unit held at TP t then moves
      t times the bytes, and at ZeRO 0 and 1 holds t times the gradient (ZeRO 0: and optimizer) state of a
      shard (plan/memory.py ``zero_sharded_bytes``). The two are the same where no group's degree exceeds 1.
      Without the key (plans written before it, which the runtime ran in whole units): False.
    - ``grad_norm``: the optimizer step computes the global gradient norm (``--clip-grad`` > 0 or fp16 loss
      scaling), which the planner and the simulator charge (a read of every gradient); the runtime computes it
      as its arguments say. Without the key (plans written before it): True, as Megatron-LM's default
      ``--clip-grad 1.0`` and the simulator then charged it.
    - ``hidden_dropout``, ``attention_dropout``: the transformer layers' dropout probabilities (Megatron-LM's
      ``--hidden-dropout`` after the attention and MLP blocks, ``--attention-dropout`` on the attention
      probabilities), which the planner and the simulator charge (the masks' kernels and bytes) and the runtime
      runs (models/dropout.py). Without the keys (plans written before them): 0, as those plans were run.
    - ``overlap_grad_reduce``: each gradient bucket is reduced as soon as the backward completes it, beside the
      rest of the backward (megatron-core DDP's ``overlap_grad_reduce``, Megatron-LM's ``--overlap-grad-reduce``);
      False: every bucket after the device's whole backward. Without the key: True, as those plans were run.
    - ``ddp_bucket_size``: elements per gradient bucket (Megatron-LM's ``--ddp-bucket-size``); None:
      megatron-core's default for the parameter device group's size (plan/buckets.py ``bucket_limit``).
      Without the key: None, as those plans were run.
    - ``node_local_weights`` (ZeRO-3 only): a slice shards its weights over its data-parallel ranks on each
      node, not over all of them (ZeRO++'s hierarchical partitioning, hpZ), so that a layer's gathers stay inside
      the node, at the price of a larger weight shard; masters, moments and gradients are sharded as before
      (plan/layout.py ``weight_shard_group``). Without the key: False.
    """

    recompute: Recompute = Recompute()
    slice_recompute: dict[str, Recompute] = field(default_factory=dict)
    zero_stage: int = 0
    segments: tuple[tuple[int, ...], ...] | None = None
    micro_batches: int = 1
    backward_order: tuple[int, ...] | None = None
    grad_reduce_dtype: str = "fp32"
    order: tuple[Step, ...] | None = None
    overlap_param_gather: bool = False
    sequence_parallel: bool = False
    tp_sharded_grads: bool = True
    attention_backend: str = "auto"
    grad_norm: bool = True
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    overlap_grad_reduce: bool = True
    ddp_bucket_size: int | None = None
    node_local_weights: bool = False

    def __post_init__(self):
        if self.zero_stage not in ZERO_STAGES or isinstance(self.zero_stage, bool):
            raise PlanError(f"zero_stage must be one of {ZERO_STAGES}, got {self.zero_stage!r}")
        if not _is_count(self.micro_batches) or self.micro_batches < 1:
            raise PlanError(f"micro_batches must be a positive integer, got {self.micro_batches!r}")
        for name in ("overlap_param_gather", "sequence_parallel", "tp_sharded_grads", "grad_norm",
                     "overlap_grad_reduce", "node_local_weights"):
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.node_local_weights and self.zero_stage != 3:
            raise PlanError(f"node_local_weights shards the weights of ZeRO stage 3, not {self.zero_stage}")
        if self.ddp_bucket_size is not None and (not _is_count(self.ddp_bucket_size) or self.ddp_bucket_size < 1):
            raise PlanError(f"ddp_bucket_size must be a positive integer or null, got {self.ddp_bucket_size!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise PlanError(f"attention_backend '{self.attention_backend}' is not one of {', '.join(ATTENTION_BACKENDS)}")
        for name in DROPOUTS:
            object.__setattr__(self, name, dropout_probability(getattr(self, name), name, PlanError))
        if self.grad_reduce_dtype not in REDUCE_DTYPE_BYTES:
            raise PlanError(f"grad_reduce_dtype '{self.grad_reduce_dtype}' is not one of "
                            f"{', '.join(REDUCE_DTYPE_BYTES)}")
        if self.segments is not None:
            object.__setattr__(self, "segments", tuple(tuple(_index(i, "segments") for i in seg)
                                                       for seg in self.segments))
        if self.backward_order is not None:
            object.__setattr__(self, "backward_order",
                               tuple(_index(i, "backward_order") for i in self.backward_order))
        if self.order is not None:
            if self.segments is not None or self.backward_order is not None:
                raise PlanError("settings.order replaces segments and backward_order: give one or the other")
            object.__setattr__(self, "order", tuple(_step(st) for st in self.order))
        object.__setattr__(self, "slice_recompute", {
            str(k): v if isinstance(v, Recompute) else Recompute.from_dict(v) for k, v in self.slice_recompute.items()})
        if not isinstance(self.recompute, Recompute):
            object.__setattr__(self, "recompute", Recompute.from_dict(self.recompute))

    @property
    def grad_reduce_bytes(self) -> int:
        return REDUCE_DTYPE_BYTES[self.grad_reduce_dtype]

    def recompute_of(self, slice_id: str) -> Recompute:
        return self.slice_recompute.get(slice_id, self.recompute)

    def recompute_choices(self) -> list[str]:
        """The distinct recomputation choices of the plan, described (for summaries)."""
        return sorted({r.describe() for r in [self.recompute, *self.slice_recompute.values()]})

    def to_dict(self) -> dict[str, Any]:
        return {
            "recompute": _recompute_dict(self.recompute),
            "slice_recompute": {k: _recompute_dict(v) for k, v in self.slice_recompute.items()},
            "zero_stage": self.zero_stage,
            "segments": None if self.segments is None else [list(s) for s in self.segments],
            "micro_batches": self.micro_batches,
            "backward_order": None if self.backward_order is None else list(self.backward_order),
            "grad_reduce_dtype": self.grad_reduce_dtype,
            "order": None if self.order is None else [list(st) for st in self.order],
            "overlap_param_gather": self.overlap_param_gather,
            "sequence_parallel": self.sequence_parallel,
            "tp_sharded_grads": self.tp_sharded_grads,
            "attention_backend": self.attention_backend,
            "grad_norm": self.grad_norm,
            "hidden_dropout": self.hidden_dropout,
            "attention_dropout": self.attention_dropout,
            "overlap_grad_reduce": self.overlap_grad_reduce,
            "ddp_bucket_size": self.ddp_bucket_size,
            "node_local_weights": self.node_local_weights,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExecutionSettings:
        return cls(**{"tp_sharded_grads": False, **d})  # a plan written before the key: whole units


def reduce_dtype(grad_reduce_in_bf16: bool) -> str:
    """The ``grad_reduce_dtype`` Megatron-LM's ``--grad-reduce-in-bf16`` chooses."""
    return "bf16" if grad_reduce_in_bf16 else "fp32"


def reduce_dtype_of_bytes(grad_bytes: int) -> str:
    """The ``grad_reduce_dtype`` of ``grad_bytes`` per element (``REDUCE_DTYPE_BYTES`` read backwards)."""
    return next(dtype for dtype, n in REDUCE_DTYPE_BYTES.items() if n == grad_bytes)


def execution_choices(source) -> dict[str, Any]:
    """The choices of what the runtime executes that the planner, the cost model and the simulator charge
    (``EXECUTION_CHOICES``), read from anything that carries them by those names: a plan's ``ExecutionSettings``,
    a ``PlannerConfig``, the baselines' context."""
    return {name: getattr(source, name) for name in EXECUTION_CHOICES}


def dropout_probability(p: Any, name: str, error: type[Exception] = ValueError) -> float:
    """A dropout probability, checked: a number in [0, 1) (1 would zero every activation)."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
        raise error(f"{name.replace('_', '-')} must be a probability in [0, 1), got {p!r}")
    return float(p)


def dropouts(source) -> dict[str, float]:
    """The dropout probabilities (``DROPOUTS``) of anything that carries them by those names: a plan's settings,
    a ``PlannerConfig``, ``ProfilerSettings``, parsed arguments."""
    return {name: getattr(source, name) for name in DROPOUTS}


def dropout_mismatch(recorded: dict[str, float], wanted: dict[str, float]) -> tuple[str, float, float] | None:
    """The first dropout where what a plan or profile recorded differs from what is wanted: (its flag, recorded,
    wanted); None where they agree."""
    for name in DROPOUTS:
        if recorded[name] != wanted[name]:
            return f"--{name.replace('_', '-')}", recorded[name], wanted[name]
    return None


def attention_kernels(backend: str) -> tuple[str, bool]:
    """What an attention backend (``ATTENTION_BACKENDS``) computes, as the cost and memory models name it: the
    attention kind (``flash``: a fused kernel that never stores the scores, TE's flash or cuDNN fused attention;
    ``unfused``: the scores written, soft-maxed and read) and, for unfused attention, whether the softmax is one
    fused kernel (Transformer Engine's) or megatron-core's torch softmax in fp32 (the local spec, which runs with
    ``masked_softmax_fusion`` off: models/config.py)."""
    if backend not in ATTENTION_BACKENDS:
        raise PlanError(f"attention backend '{backend}' is not one of {', '.join(ATTENTION_BACKENDS)}")
    if backend == "local":
        return "unfused", False
    if backend == "unfused":
        return "unfused", True
    return "flash", False


def resolve_attention_backend(requested: str, arch: str, te_present: bool | None = None) -> str:
    """The attention backend a plan records for ``--attention-backend requested`` on a device of ``arch``, where
    Transformer Engine is present or not (``te_present``; None: unknown, planning for another machine, where a
    GPU cluster is taken to have TE as Megatron-LM's default spec does). auto is the local spec where TE cannot
    run (a CPU, or no TE here); a TE backend where TE cannot run is an error."""
    if requested not in ATTENTION_BACKENDS:
        raise PlanError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, got '{requested}'")
    no_te = arch == "cpu" or te_present is False
    if requested == "auto":
        return "local" if no_te else "auto"
    if requested != "local" and no_te:
        where = "a CPU" if arch == "cpu" else "this machine, where Transformer Engine is not available"
        raise PlanError(f"--attention-backend {requested} is a Transformer Engine backend and cannot run on {where}: "
                        f"use local (megatron-core's attention) or auto")
    return requested


def sequence_parallel_runs(enabled: bool, kind: str, tp: int, tokens: int, module) -> bool:
    """Whether a slice of a MetaOp of ``kind`` with ``tokens`` tokens on ``tp`` TP ranks runs sequence-parallel
    when the plan enables it: transformer layers at TP > 1, whose sequence divides by TP or, in a causal module,
    is padded at its end to a multiple of TP (no real token attends to the padding). A bidirectional module whose
    sequence does not divide (a ViT's 197 tokens at TP 2) runs without it. ``module``: the MetaOp's workload
    module (graph/workload.py ModuleSpec; read only for a layer, so None will do for a loss)."""
    return enabled and kind == "layer" and tp > 1 and (tokens % tp == 0 or module.is_causal)


def sequence_parallel_tokens(tokens: int, tp: int) -> int:
    """The sequence length a sequence-parallel layer runs on: ``tokens`` padded at the end to a multiple of tp."""
    return -(-tokens // tp) * tp


@dataclass
class Slice:
    id: str  # unique in the plan, e.g. "w3:t1/vision"
    metaop: str
    module: str
    task: str
    kind: str
    layer_start: int
    layer_end: int
    devices: list[int]
    tp: int
    dp: int
    predicted_time: float  # seconds for this slice (per-layer T(n) times its layer count)

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start


@dataclass
class Wave:
    index: int
    level: int
    start: float
    duration: float
    slices: list[Slice] = field(default_factory=list)

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclass
class Transfer:
    producer: str  # slice id
    consumer: str  # slice id
    bytes: float  # activation bytes of the producer's output for the whole batch
    kind: str  # the forward direction's worst route: local | intra_island | inter_island
    src_devices: list[int] = field(default_factory=list)
    dst_devices: list[int] = field(default_factory=list)
    # bytes received per route (plan/routing.py): forward summed over consumer devices (every TP rank of a
    # consumer receives its rows), backward (input gradients) summed over producer devices
    bytes_by_kind: dict[str, float] = field(default_factory=dict)
    backward_bytes_by_kind: dict[str, float] = field(default_factory=dict)


@dataclass
class ParamGroup:
    devices: list[int]
    params: list[str]
    bytes: float = 0.0  # gradient all-reduce volume of the group (parameters x settings.grad_reduce_bytes)


@dataclass
class MetaOpInfo:
    id: str
    task: str
    module: str
    kind: str
    num_layers: int
    layer_offset: int
    input_shape: list[int]
    level: int
    preds: list[str]
    params: list[str]
    curve_source: str = "analytic"  # analytic | profiled
    curve_fit_error: float = 0.0
    allocation: list[list[float]] = field(default_factory=list)  # bi-point tuples [[n, l], ...] after rounding
    n_star: float = 0.0  # continuous optimum allocation
    backward: str = "full"  # graph/opgraph.py MetaOp.backward: "none" sends no gradient back to its producers


@dataclass
class LevelInfo:
    index: int
    metaops: list[str]
    c_star: float  # relaxed optimum C~* of this level (Theorem 1)
    start: float
    end: float


@dataclass
class Plan:
    workload_name: str
    workload_digest: str
    cluster: dict[str, Any]
    cluster_digest: str
    planner: dict[str, Any]  # diagnostics: planner, requested config, solver status, notes, timings
    metaops: list[MetaOpInfo]
    levels: list[LevelInfo]
    waves: list[Wave]
    transfers: list[Transfer]
    param_groups: list[ParamGroup]
    memory_per_device: list[float]  # predicted peak bytes (plan/memory.py)
    predicted: dict[str, float]  # iteration_time, c_star, gap, utilisation, inter_island_bytes, ...
    settings: ExecutionSettings = field(default_factory=ExecutionSettings)
    schema_version: int = SCHEMA_VERSION

    @property
    def num_devices(self) -> int:
        return int(self.cluster["num_nodes"]) * int(self.cluster["gpus_per_node"])

    @property
    def gpus_per_node(self) -> int:
        """Devices per island: device d lives on island d // gpus_per_node."""
        return int(self.cluster["gpus_per_node"])

    @property
    def weight_scope(self) -> int | None:
        """ZeRO-3's weight shards confined to a node of this many devices (``settings.node_local_weights``), or
        None (plan/layout.py ``weight_scope``)."""
        from megatron_spindle.plan.layout import weight_scope

        return weight_scope(self.settings.node_local_weights, self.gpus_per_node)

    @property
    def iteration_time(self) -> float:
        """The waves' span: the longest device component's (plan/timeline.py; for one component, the last wave's
        end)."""
        from megatron_spindle.plan.timeline import makespan  # timeline reads plans: imported here, not above

        return makespan(self)

    def slices(self) -> list[Slice]:
        return [s for w in self.waves for s in w.slices]

    def recomputes(self) -> bool:
        """Whether some layer slice recomputes (the settings' choice for it is not "none")."""
        return any(self.settings.recompute_of(s.id).mode != "none" for s in self.slices() if s.kind == "layer")

    def slice(self, slice_id: str) -> Slice:
        for s in self.slices():
            if s.id == slice_id:
                return s
        raise KeyError(slice_id)

    def metaop(self, mid: str) -> MetaOpInfo:
        for m in self.metaops:
            if m.id == mid:
                return m
        raise KeyError(mid)

    def save(self, path) -> None:
        """Atomic write (plan/io.py)."""
        from megatron_spindle.plan.io import save_plan

        save_plan(self, path)

    def to_dict(self) -> dict[str, Any]:
        from megatron_spindle.plan.io import plan_to_dict

        return plan_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        from megatron_spindle.plan.io import plan_from_dict

        return plan_from_dict(d)

    @classmethod
    def load(cls, path) -> Plan:
        from megatron_spindle.plan.io import load_plan

        return load_plan(path)


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _index(x: Any, what: str) -> int:
    if not _is_count(x):
        raise PlanError(f"{what}: wave index {x!r} is not a non-negative integer")
    return x


def _step(x: Any) -> Step:
    try:
        wave, phase, task = x
    except (TypeError, ValueError):
        raise PlanError(f"settings.order: step {x!r} is not [wave, phase, task]") from None
    if phase not in PHASES:
        raise PlanError(f"settings.order: step {list(x)!r}: phase must be one of {', '.join(PHASES)}")
    if task is not None and not isinstance(task, str):
        raise PlanError(f"settings.order: step {list(x)!r}: task must be a task name or null")
    return (_index(wave, "settings.order"), phase, task)


def _recompute_dict(r: Recompute) -> dict[str, Any]:
    d: dict[str, Any] = {"mode": r.mode, "layers": r.layers}
    if r.method != "block":
        d["method"] = r.method
    if r.modules is not None:
        d["modules"] = list(r.modules)
    return d
