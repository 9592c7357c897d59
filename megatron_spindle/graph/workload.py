"""Workload specification: modules, tasks and their flows (YAML or the Python API).

A workload declares *modules* (encoder towers, an LLM backbone, projectors, heads) and *tasks*. A task is
a DAG of flows over modules with its own global batch size, the tokens per sample at each module's input,
and a loss. Modules are shared by every task that uses them unless declared ``shared: false``.

YAML form (see megatron_spindle/graph/workloads/)::

    name: tiny-vl
    modules:
      vision: {kind: encoder, num_layers: 4, hidden_size: 64, num_heads: 4, ffn_hidden_size: 256,
               frontend: {type: patch, image_size: 32, patch_size: 8, in_channels: 3}}
      vis_proj: {kind: projector, input_size: 64, hidden_size: 128}
      llm: {kind: llm, num_layers: 4, hidden_size: 128, num_heads: 8, ffn_hidden_size: 512,
            frontend: {type: text, vocab_size: 1000}, frozen: true}   # frozen: no gradients (--freeze llm)
    tasks:
      - name: caption
        batch_size: 8
        tokens: {vision: 17, vis_proj: 16, llm: 48}
        flows: [[vision, vis_proj], [vis_proj, llm]]
        loss: {kind: lm, module: llm}

Python form, in the spirit of the paper's ``SpindleTask``/``add_flow``::

    task = SpindleTask("caption", batch_size=8, loss=LossSpec("lm", ("llm",)))
    task.add_flow("vision", "vis_proj", src_tokens=17, dst_tokens=16)
    task.add_flow("vis_proj", "llm", dst_tokens=48)
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_spindle.graph.yaml_loader import load_yaml_as

MODULE_KINDS = ("encoder", "llm", "projector", "head")
FRONTEND_TYPES = ("patch", "audio", "imu", "text")
LOSS_KINDS = ("contrastive", "lm")
ACTIVATIONS = ("gelu", "quick_gelu", "silu")
HEAD_POOLS = ("cls", "mean", "eos")
FRONTEND_STEMS = ("linear", "conv")


class WorkloadError(ValueError):
    """A workload spec that cannot be planned. The message names the offending item."""


@dataclass
class FrontendSpec:
    """Turns raw samples into the first layer's token sequence.

    patch: images [C, image_size, image_size] -> (image_size/patch_size)^2 patches (+1 class token); a task may
           declare fewer tokens, g^2 (+1), to feed it smaller images (g * patch_size pixels a side)
    audio: spectrogram [in_channels=mel bins, frames] -> frames/patch_size patches
    imu:   sensor windows [in_channels, samples] -> samples/patch_size windows
    text:  token ids -> embeddings (vocab_size)

    Options (defaults keep the original model):
    pre_norm: patch only: a LayerNorm over the embeddings (after positions), as CLIP's ``pre_layrnorm``.
    patch_bias: patch only: the patch projection has a bias (default). ``false`` builds it without one, as CLIP's
          patch embedding (a module converted from / exported to Hugging Face CLIP then has exactly its tensors).
    class_token_len: patch only, with class_token: learned class-token slots before the patches (default 1;
          NeMo's ViT-g/14 has 8), as megatron-core's CLIP ViT ``class_token_len``.
    stem: audio only: ``linear`` (a linear over non-overlapping windows of patch_size frames, learned positions)
          or ``conv`` (Whisper: conv1d k3 pad 1 + GELU, conv1d k3 stride patch_size pad 1 + GELU, positions
          initialised to Whisper's sinusoids). Both make frames // patch_size tokens (frames beyond a multiple of
          patch_size are dropped), so a task declares tokens = frames / patch_size either way (Whisper:
          patch_size 2, 3000 frames -> 1500 tokens).
    """

    type: str
    image_size: int = 0
    patch_size: int = 0
    in_channels: int = 0
    vocab_size: int = 0
    class_token: bool = True
    pre_norm: bool = False
    stem: str = "linear"
    patch_bias: bool = True
    class_token_len: int = 1  # patch, with class_token: learned class-token slots (megatron-core's class_token_len)

    @property
    def class_tokens(self) -> int:
        """Tokens a patch front end puts before the patches: ``class_token_len``, or none without a class token."""
        return self.class_token_len if self.class_token else 0

    @property
    def patch_grid(self) -> int:
        """Patches along each side of a full-size (``image_size``) image."""
        return self.image_size // self.patch_size

    @property
    def patch_tokens(self) -> int:
        """Tokens a patch front end makes per full-size image (its learned positions): the grid plus the class
        token(s)."""
        return self.patch_grid**2 + self.class_tokens

    def image_side(self, tokens: int) -> int | None:
        """Pixels per side of the square images that make ``tokens`` tokens: a task may feed a patch module
        smaller images than ``image_size`` (a g x g grid, g <= patch_grid, which takes the top-left g x g of the
        learned positions); None where no whole grid makes that many."""
        grid = math.isqrt(max(0, tokens - self.class_tokens))
        if 1 <= grid <= self.patch_grid and grid * grid + self.class_tokens == tokens:
            return grid * self.patch_size
        return None


@dataclass
class ModuleSpec:
    """One model component. ``hidden_size`` is the width of its token sequence (for a projector: output)."""

    name: str
    kind: str
    hidden_size: int
    num_layers: int = 1
    num_heads: int = 1
    ffn_hidden_size: int = 0
    num_query_groups: int | None = None  # GQA groups (None: = num_heads)
    frontend: FrontendSpec | None = None
    embed_dim: int | None = None  # pooled output projected to a shared embedding (contrastive towers)
    input_size: int | None = None  # projector input width
    pool: int = 1  # projector: token pooling factor (e.g. 1500 audio frames -> 750)
    vocab_size: int = 0  # llm: output vocabulary for the LM head (defaults to the text frontend's)
    causal: bool | None = None  # default: True for llm, False otherwise
    cross_attention: bool = False  # encoder-decoder decoders (OFASys); planner/simulator only
    shared: bool = True  # one set of weights for all tasks that use it
    # Frozen weights (Megatron-LM's --freeze-ViT / --freeze-LM): no gradient, no optimizer state, no gradient sync;
    # the module's backward computes only the input gradients an upstream trainable module needs, or nothing
    frozen: bool = False
    # Numerics options (defaults: the original model; see validate_workload for where each applies)
    activation: str | None = None  # gelu | quick_gelu | silu; None: gelu for encoders, silu (SwiGLU) for llm
    qkv_bias: bool = False  # llm: biases on the q/k/v projections (Qwen2); encoders always have them
    norm_epsilon: float | None = None  # every norm of the module; None: ModelConfig.layernorm_epsilon
    rotary_base: float | None = None  # llm RoPE base; None: ModelConfig.rotary_base
    rope_scaling_factor: float | None = None  # llm: Llama-3.x RoPE scaling (low/high freq factors 1/4, 8192 ctx)
    # contrastive head pooling: cls (position 0) | mean | eos (own text's EOS token, see eos_token_id);
    # None: cls for patch front ends with a class token, else mean
    head_pool: str | None = None
    # eos pooling: the first position of this token id in the module's own text; None: the argmax of the token ids
    # (original CLIP: the EOS token has the largest id of the vocabulary)
    eos_token_id: int | None = None

    @property
    def in_size(self) -> int:
        return self.input_size if self.kind == "projector" else self.hidden_size

    @property
    def out_size(self) -> int:
        return self.hidden_size

    @property
    def is_causal(self) -> bool:
        return self.kind == "llm" if self.causal is None else self.causal

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_heads

    @property
    def lm_vocab(self) -> int:
        if self.vocab_size:
            return self.vocab_size
        return self.frontend.vocab_size if self.frontend and self.frontend.type == "text" else 0

    @property
    def act(self) -> str:
        """Activation of the MLP (gated for llm modules: silu = SwiGLU)."""
        return self.activation or ("silu" if self.kind == "llm" else "gelu")

    @property
    def pooling(self) -> str:
        """Pooling of the contrastive head (``head_pool`` or the default by front end)."""
        if self.head_pool:
            return self.head_pool
        fe = self.frontend
        return "cls" if fe is not None and fe.type == "patch" and fe.class_token else "mean"

    @property
    def has_layers(self) -> bool:
        """Transformer layers (encoder/llm) vs a single light op (projector/head)."""
        return self.kind in ("encoder", "llm")


@dataclass
class LossSpec:
    """contrastive: InfoNCE between the pooled embeddings of two modules; lm: next-token CE on one module."""

    kind: str
    modules: tuple[str, ...]
    weight: float = 1.0
    temperature: float = 0.07


@dataclass
class SpindleTask:
    """One task: a DAG of flows over modules, with a global batch and tokens per sample at each module input."""

    name: str
    batch_size: int
    loss: LossSpec | None = None
    tokens: dict[str, int] = field(default_factory=dict)  # module -> tokens per sample at its input
    flows: list[tuple[str, str]] = field(default_factory=list)
    sampling_weight: float = 1.0

    def use(self, module: str, tokens: int) -> SpindleTask:
        """Declare that the task runs ``module`` with ``tokens`` tokens per sample at its input."""
        self.tokens[module] = tokens
        return self

    def add_flow(self, src: str, dst: str, src_tokens: int | None = None, dst_tokens: int | None = None) -> SpindleTask:
        """Data flows from ``src``'s output into ``dst``'s input (the paper's add_flow)."""
        if src_tokens is not None:
            self.tokens[src] = src_tokens
        if dst_tokens is not None:
            self.tokens[dst] = dst_tokens
        self.flows.append((src, dst))
        return self

    @property
    def modules(self) -> list[str]:
        return list(self.tokens)

    def predecessors(self, module: str) -> list[str]:
        return [s for s, d in self.flows if d == module]

    def topo_modules(self) -> list[str]:
        """Modules in a topological order of the task's flows (declaration order breaks ties)."""
        indeg = {m: 0 for m in self.tokens}
        for _, d in self.flows:
            indeg[d] += 1
        order, ready = [], [m for m in self.tokens if indeg[m] == 0]
        while ready:
            m = ready.pop(0)
            order.append(m)
            for s, d in self.flows:
                if s == m:
                    indeg[d] -= 1
                    if indeg[d] == 0:
                        ready.append(d)
        if len(order) != len(self.tokens):
            cyc = sorted(m for m, k in indeg.items() if k > 0)
            raise WorkloadError(f"task '{self.name}': flows form a cycle through modules {cyc}")
        return order


@dataclass
class Workload:
    name: str
    modules: dict[str, ModuleSpec]
    tasks: list[SpindleTask]

    def __post_init__(self):
        validate_workload(self)

    def task(self, name: str) -> SpindleTask:
        for t in self.tasks:
            if t.name == name:
                return t
        raise KeyError(f"unknown task '{name}'")

    def param_owner(self, module: str, task: str) -> str:
        """Name of the weights a task uses for a module: shared modules have one owner for all tasks."""
        return module if self.modules[module].shared else f"{module}@{task}"

    def is_frozen_unit(self, unit: str) -> bool:
        """Whether a parameter unit belongs to a frozen module."""
        module = unit_module(unit)
        return module in self.modules and self.modules[module].frozen

    @property
    def frozen_modules(self) -> list[str]:
        """The names of the frozen modules, in declaration order."""
        return [name for name, m in self.modules.items() if m.frozen]

    def frozen(self, modules: list[str]) -> Workload:
        """The same workload with ``modules`` frozen too (``--freeze``)."""
        for name in modules:
            if name not in self.modules:
                raise WorkloadError(f"--freeze: workload '{self.name}' has no module '{name}' "
                                    f"(modules: {', '.join(self.modules)})")
        mods = {k: dataclasses.replace(v, frozen=True) if k in modules else v for k, v in self.modules.items()}
        return Workload(self.name, mods, copy.deepcopy(self.tasks))

    def to_dict(self) -> dict[str, Any]:
        mods = {}
        for name, m in self.modules.items():
            d = {k: v for k, v in asdict(m).items() if k != "name"}
            _drop_defaults(d, _NEW_MODULE_DEFAULTS)
            if d.get("frontend"):
                _drop_defaults(d["frontend"], _NEW_FRONTEND_DEFAULTS)
            mods[name] = d
        tasks = []
        for t in self.tasks:
            d = asdict(t)
            d["flows"] = [list(f) for f in t.flows]
            if t.loss is not None:
                d["loss"]["modules"] = list(t.loss.modules)
            tasks.append(d)
        return {"name": self.name, "modules": mods, "tasks": tasks}

    def digest(self) -> str:
        """Content hash of the spec (canonical JSON): plans and profiles are keyed by it."""
        return _digest(self.to_dict())

    def model_digest(self) -> str:
        """``digest`` of the model alone, whichever modules are frozen: checkpoints are keyed by it (freezing a
        module, or thawing it, changes what trains and the plan, not the model). Equal to ``digest`` while
        nothing is frozen."""
        d = self.to_dict()
        for m in d["modules"].values():
            m.pop("frozen", None)
        return _digest(d)

    def subset(self, task_names: list[str]) -> Workload:
        """The same modules with only some tasks (e.g. CLIP-4 out of CLIP-10)."""
        known = [t.name for t in self.tasks]
        for n in task_names:
            if n not in known:
                raise WorkloadError(f"workload '{self.name}' has no task '{n}' (tasks: {', '.join(known)})")
            if task_names.count(n) > 1:
                raise WorkloadError(f"task '{n}' is named twice in {list(task_names)}")
        tasks = [copy.deepcopy(self.task(n)) for n in task_names]
        used = {m for t in tasks for m in t.tokens}
        mods = {k: v for k, v in self.modules.items() if k in used}
        return Workload(f"{self.name}[{len(tasks)}]", mods, tasks)


def unit_module(unit: str) -> str:
    """The module of a parameter unit or its owner, as ``Workload.param_owner`` names them:
    ``"vision@t1.layers.3"`` and ``"vision@t1"`` -> ``"vision"``."""
    return unit.partition(".")[0].partition("@")[0]


# Options added after plans and checkpoints were first keyed by ``digest()``: left out of ``to_dict`` while at
# their defaults, so existing workloads keep their digests.
_NEW_MODULE_DEFAULTS = {"frozen": False, "activation": None, "qkv_bias": False, "norm_epsilon": None, "rotary_base": None,
                        "rope_scaling_factor": None, "head_pool": None, "eos_token_id": None}
_NEW_FRONTEND_DEFAULTS = {"pre_norm": False, "stem": "linear", "patch_bias": True, "class_token_len": 1}


def _digest(d: dict[str, Any]) -> str:
    blob = json.dumps(d, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _drop_defaults(d: dict[str, Any], defaults: dict[str, Any]) -> None:
    for k, v in defaults.items():
        if k in d and d[k] == v and type(d[k]) is type(v):
            del d[k]


# ----------------------------------------------------------------------------------------------- parsing


def _positive(where: str, what: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise WorkloadError(f"{where}: {what} must be a positive integer, got {value!r}")


def _module_from_dict(name: str, d: dict[str, Any]) -> ModuleSpec:
    d = dict(d)
    fe = d.pop("frontend", None)
    known = set(ModuleSpec.__dataclass_fields__) - {"name", "frontend"}
    unknown = set(d) - known
    if unknown:
        raise WorkloadError(f"module '{name}': unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
    if fe is not None:
        if not isinstance(fe, dict) or "type" not in fe:
            raise WorkloadError(f"module '{name}': frontend must be a mapping with a 'type'")
        bad = set(fe) - set(FrontendSpec.__dataclass_fields__)
        if bad:
            raise WorkloadError(f"module '{name}': unknown frontend field(s) {sorted(bad)}")
        fe = FrontendSpec(**fe)
    if "kind" not in d or "hidden_size" not in d:
        raise WorkloadError(f"module '{name}': 'kind' and 'hidden_size' are required")
    return ModuleSpec(name=name, frontend=fe, **d)


def _task_from_dict(d: dict[str, Any]) -> SpindleTask:
    d = dict(d)
    if "name" not in d or "batch_size" not in d:
        raise WorkloadError(f"task {d!r}: 'name' and 'batch_size' are required")
    loss = d.pop("loss", None)
    if loss is not None:
        loss = dict(loss)
        mods = loss.pop("modules", None) or ([loss.pop("module")] if "module" in loss else [])
        loss = LossSpec(modules=tuple(mods), **loss)
    flows = [tuple(f) for f in d.pop("flows", [])]
    for f in flows:
        if len(f) != 2:
            raise WorkloadError(f"task '{d['name']}': a flow is [src, dst], got {list(f)}")
    unknown = set(d) - set(SpindleTask.__dataclass_fields__)
    if unknown:
        raise WorkloadError(f"task '{d['name']}': unknown field(s) {sorted(unknown)}")
    return SpindleTask(loss=loss, flows=flows, **d)


def workload_from_dict(d: dict[str, Any]) -> Workload:
    if not isinstance(d, dict) or "modules" not in d or "tasks" not in d:
        raise WorkloadError("a workload needs 'modules' and 'tasks'")
    if not isinstance(d["modules"], dict) or not d["modules"]:
        raise WorkloadError(f"'modules' must be a non-empty mapping of module name -> settings, got {d['modules']!r}")
    if not isinstance(d["tasks"], list) or not d["tasks"]:
        raise WorkloadError(f"'tasks' must be a non-empty list of tasks, got {d['tasks']!r}")
    for name, m in d["modules"].items():
        if not isinstance(m, dict):
            raise WorkloadError(f"module '{name}' must be a mapping of settings, got {m!r}")
    for t in d["tasks"]:
        if not isinstance(t, dict):
            raise WorkloadError(f"each task must be a mapping (name, batch_size, tokens, ...), got {t!r}")
    mods = {name: _module_from_dict(name, m) for name, m in d["modules"].items()}
    tasks = [_task_from_dict(t) for t in d["tasks"]]
    return Workload(d.get("name", "workload"), mods, tasks)


def load_workload(path: str | Path) -> Workload:
    """Load a workload YAML file, or a built-in workload by name (see ``builtin_workloads``)."""
    from megatron_spindle.graph.builtin import builtin_workload_path

    p = Path(path)
    if not p.exists():
        builtin = builtin_workload_path(str(path))
        if builtin is None:
            raise WorkloadError(f"workload '{path}': no such file and no built-in workload of that name")
        p = builtin
    d = load_yaml_as(p, "workload", WorkloadError)
    try:
        return workload_from_dict(d)
    except WorkloadError as e:
        raise WorkloadError(f"workload {p}: {e}") from None


# -------------------------------------------------------------------------------------------- validation


def validate_workload(w: Workload) -> None:
    """Raise WorkloadError naming the first problem found."""
    if not w.tasks:
        raise WorkloadError(f"workload '{w.name}' has no tasks")
    for name, m in w.modules.items():
        where = f"module '{name}'"
        if m.kind not in MODULE_KINDS:
            raise WorkloadError(f"{where}: unknown kind '{m.kind}' (expected one of {', '.join(MODULE_KINDS)})")
        _positive(where, "hidden_size", m.hidden_size)
        _positive(where, "num_layers", m.num_layers)
        _positive(where, "num_heads", m.num_heads)
        _positive(where, "pool", m.pool)
        if m.has_layers:
            _positive(where, "ffn_hidden_size", m.ffn_hidden_size)
            if m.hidden_size % m.num_heads:
                raise WorkloadError(f"{where}: hidden_size {m.hidden_size} is not divisible by num_heads {m.num_heads}")
            if m.num_heads % m.query_groups:
                raise WorkloadError(f"{where}: num_heads {m.num_heads} not divisible by num_query_groups {m.query_groups}")
        if m.kind == "projector":
            _positive(where, "input_size", m.input_size)
        if m.embed_dim is not None:
            _positive(where, "embed_dim", m.embed_dim)
        if m.frontend is not None:
            fe = m.frontend
            if fe.type not in FRONTEND_TYPES:
                raise WorkloadError(f"{where}: unknown frontend type '{fe.type}' (expected one of {FRONTEND_TYPES})")
            if fe.type == "text":
                _positive(where, "frontend vocab_size", fe.vocab_size)
            else:
                _positive(where, "frontend patch_size", fe.patch_size)
                _positive(where, "frontend in_channels", fe.in_channels)
                if fe.type == "patch":
                    _positive(where, "frontend image_size", fe.image_size)
                    if fe.image_size % fe.patch_size:
                        raise WorkloadError(f"{where}: frontend image_size {fe.image_size} is not a multiple of "
                                            f"patch_size {fe.patch_size} (the images are cut into whole patches)")
            if not isinstance(fe.pre_norm, bool):
                raise WorkloadError(f"{where}: frontend pre_norm must be true or false, got {fe.pre_norm!r}")
            if fe.pre_norm and fe.type != "patch":
                raise WorkloadError(f"{where}: frontend pre_norm is for patch front ends, not '{fe.type}'")
            if isinstance(fe.class_token_len, bool) or not isinstance(fe.class_token_len, int) \
                    or fe.class_token_len < 1:
                raise WorkloadError(f"{where}: frontend class_token_len must be a positive integer, got "
                                    f"{fe.class_token_len!r}")
            if fe.class_token_len != 1 and (fe.type != "patch" or not fe.class_token):
                raise WorkloadError(f"{where}: frontend class_token_len is for patch front ends with a class token")
            if not isinstance(fe.patch_bias, bool):
                raise WorkloadError(f"{where}: frontend patch_bias must be true or false, got {fe.patch_bias!r}")
            if not fe.patch_bias and fe.type != "patch":
                raise WorkloadError(f"{where}: frontend patch_bias is for patch front ends, not '{fe.type}'")
            if fe.stem not in FRONTEND_STEMS:
                raise WorkloadError(f"{where}: unknown frontend stem {fe.stem!r} (expected one of {FRONTEND_STEMS})")
            if fe.stem == "conv" and fe.type != "audio":
                raise WorkloadError(f"{where}: frontend stem 'conv' is for audio front ends, not '{fe.type}'")
        if not isinstance(m.frozen, bool):
            raise WorkloadError(f"{where}: frozen must be true or false, got {m.frozen!r}")
        _validate_options(where, m)
    names = set()
    for t in w.tasks:
        where = f"task '{t.name}'"
        if t.name in names:
            raise WorkloadError(f"{where}: duplicate task name")
        names.add(t.name)
        _positive(where, "batch_size", t.batch_size)
        if not t.tokens:
            raise WorkloadError(f"{where}: uses no modules (give 'tokens' per module or flows)")
        for mod, n in t.tokens.items():
            if mod not in w.modules:
                raise WorkloadError(f"{where}: unknown module '{mod}' (declared: {sorted(w.modules)})")
            _positive(where, f"tokens of '{mod}'", n)
        for src, dst in t.flows:
            for mod in (src, dst):
                if mod not in w.modules:
                    raise WorkloadError(f"{where}: flow {src} -> {dst} names unknown module '{mod}'")
                if mod not in t.tokens:
                    raise WorkloadError(f"{where}: flow {src} -> {dst}: tokens of '{mod}' not given")
            if src == dst:
                raise WorkloadError(f"{where}: flow {src} -> {dst} is a cycle (a module feeding itself)")
        t.topo_modules()  # raises on cycles
        for src, dst in t.flows:
            ms, md = w.modules[src], w.modules[dst]
            if ms.out_size != md.in_size:
                raise WorkloadError(
                    f"{where}: flow {src} -> {dst}: hidden size {ms.out_size} of '{src}' does not match input size "
                    f"{md.in_size} of '{dst}' and there is no projector between them"
                )
        _validate_tokens(w, t)
        _validate_loss(w, t)


def _validate_options(where: str, m: ModuleSpec) -> None:
    """The numerics options of a module: known values, and only where the module has the part they change."""
    if m.activation is not None:
        if m.activation not in ACTIVATIONS:
            raise WorkloadError(f"{where}: unknown activation {m.activation!r} (expected one of "
                                f"{', '.join(ACTIVATIONS)}; an llm module's MLP is gated, so silu there is "
                                f"SwiGLU, Megatron's --swiglu)")
        if not m.has_layers:
            raise WorkloadError(f"{where}: activation applies to encoder/llm layers, not a {m.kind}")
    if not isinstance(m.qkv_bias, bool):
        raise WorkloadError(f"{where}: qkv_bias must be true or false, got {m.qkv_bias!r}")
    if m.qkv_bias and m.kind != "llm":
        raise WorkloadError(f"{where}: qkv_bias is for llm modules (encoder layers always have q/k/v biases)")
    for what in ("norm_epsilon", "rotary_base", "rope_scaling_factor"):
        value = getattr(m, what)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise WorkloadError(f"{where}: {what} must be a positive number, got {value!r}")
        if what != "norm_epsilon" and m.kind != "llm":
            raise WorkloadError(f"{where}: {what} applies to llm modules (RoPE), not a {m.kind}")
    if m.norm_epsilon is not None and m.kind == "projector":
        raise WorkloadError(f"{where}: norm_epsilon: a projector has no norms")
    if m.head_pool is not None:
        if m.head_pool not in HEAD_POOLS:
            raise WorkloadError(f"{where}: unknown head_pool {m.head_pool!r} (expected one of {HEAD_POOLS}; the "
                                f"projector's token pooling factor is 'pool')")
        if m.kind == "projector":
            raise WorkloadError(f"{where}: head_pool is for modules with a contrastive head, not a projector")
        if m.head_pool == "eos" and not (m.frontend is not None and m.frontend.type == "text"):
            raise WorkloadError(f"{where}: head_pool 'eos' needs a text front end (the EOS position comes from the "
                                f"module's token ids)")
    if m.eos_token_id is not None:
        if m.head_pool != "eos":
            raise WorkloadError(f"{where}: eos_token_id is only used with head_pool: eos")
        vocab = m.frontend.vocab_size
        if isinstance(m.eos_token_id, bool) or not isinstance(m.eos_token_id, int) or not 0 <= m.eos_token_id < vocab:
            raise WorkloadError(f"{where}: eos_token_id must be a token id in [0, {vocab}), got {m.eos_token_id!r}")


def _validate_tokens(w: Workload, t: SpindleTask) -> None:
    """Token counts must be consistent along flows (the runtime builds real tensors from them)."""
    for mod in t.tokens:
        m = w.modules[mod]
        preds = t.predecessors(mod)
        if not preds:  # a source module: its front end (or precomputed features) makes its input
            fe = m.frontend
            if fe is not None and fe.type == "patch" and fe.image_side(t.tokens[mod]) is None:
                cls = f" + {fe.class_tokens} (class token{'s' if fe.class_tokens > 1 else ''})" \
                    if fe.class_tokens else ""
                raise WorkloadError(
                    f"task '{t.name}': module '{mod}' is declared with {t.tokens[mod]} tokens, which no image makes: "
                    f"its patch front end makes g*g{cls} for a g x g grid of patches, g at most {fe.patch_grid} "
                    f"(image_size {fe.image_size} / patch_size {fe.patch_size}: {fe.patch_tokens} tokens)")
            continue
        incoming = sum(output_tokens(w, t, p) for p in preds)
        own = t.tokens[mod] - incoming
        if m.kind == "projector" and len(preds) != 1:
            raise WorkloadError(f"task '{t.name}': projector '{mod}' needs exactly one input, has {preds}")
        if own < 0:
            raise WorkloadError(
                f"task '{t.name}': module '{mod}' gets {incoming} tokens from {preds} but its input is declared as "
                f"{t.tokens[mod]} tokens"
            )
        if own > 0 and not (m.frontend is not None and m.frontend.type == "text"):
            if m.kind != "projector":
                raise WorkloadError(
                    f"task '{t.name}': module '{mod}' input is {t.tokens[mod]} tokens but its inputs {preds} give "
                    f"{incoming} and it has no text front end for the other {own}"
                )


BACKWARDS = ("full", "input", "none")  # a module's backward in a task: everything, input gradients only, nothing


def grad_outputs(w: Workload, t: SpindleTask) -> dict[str, bool]:
    """module -> whether its output needs a gradient in task ``t``: it has trainable weights, or something
    upstream of it has."""
    needs: dict[str, bool] = {}
    for mod in t.topo_modules():
        needs[mod] = not w.modules[mod].frozen or any(needs[p] for p in t.predecessors(mod))
    return needs


def module_backward(w: Workload, t: SpindleTask, mod: str, needs: dict[str, bool] | None = None) -> str:
    """The backward of ``mod``'s layers (and head) in task ``t`` (``BACKWARDS``): full for trainable weights; a
    frozen module computes only the input gradients a trainable module upstream needs ("input"), or nothing."""
    if not w.modules[mod].frozen:
        return "full"
    needs = grad_outputs(w, t) if needs is None else needs
    return "input" if any(needs[p] for p in t.predecessors(mod)) else "none"


def check_trains(w: Workload) -> None:
    """WorkloadError naming a task of ``w`` that trains nothing (every module it runs is frozen). The task set a
    run trains or plans must not have one; a workload may, for task sets that leave such a task out."""
    for t in w.tasks:
        if not any(grad_outputs(w, t).values()):
            raise WorkloadError(f"task '{t.name}' trains nothing: every module it runs is frozen "
                                f"({', '.join(t.topo_modules())}); leave it out (--tasks) or freeze less")


def output_tokens(w: Workload, t: SpindleTask, mod: str) -> int:
    """Tokens per sample that ``mod`` emits in task ``t`` (projectors may pool)."""
    m = w.modules[mod]
    return t.tokens[mod] // m.pool if m.kind == "projector" else t.tokens[mod]


def _validate_loss(w: Workload, t: SpindleTask) -> None:
    if t.loss is None:
        return
    where = f"task '{t.name}'"
    if t.loss.kind not in LOSS_KINDS:
        raise WorkloadError(f"{where}: unknown loss kind '{t.loss.kind}' (expected one of {LOSS_KINDS})")
    for mod in t.loss.modules:
        if mod not in t.tokens:
            raise WorkloadError(f"{where}: loss uses module '{mod}' which the task does not run")
    if t.loss.kind == "contrastive":
        if len(t.loss.modules) != 2:
            raise WorkloadError(f"{where}: a contrastive loss pairs exactly two modules, got {list(t.loss.modules)}")
        dims = [w.modules[m].embed_dim for m in t.loss.modules]
        if None in dims or dims[0] != dims[1]:
            raise WorkloadError(f"{where}: contrastive modules {list(t.loss.modules)} need equal embed_dim, got {dims}")
    else:
        if len(t.loss.modules) != 1:
            raise WorkloadError(f"{where}: an lm loss names exactly one module, got {list(t.loss.modules)}")
        if not w.modules[t.loss.modules[0]].lm_vocab:
            raise WorkloadError(f"{where}: lm loss on '{t.loss.modules[0]}' which has no vocab_size")
