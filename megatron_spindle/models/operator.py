"""Operator API: one torch module per slice of a MetaOp (a contiguous layer range on an explicit TP group).

``build_operator(workload, metaop, layer_start, layer_end, pg_collection=None, dp_group=None, config=None)``
returns a ``SliceOperator`` for MetaOp kinds frontend | layer | projector | head | lm_head | loss.

Conventions (the runtime depends on them):

- ``forward(inputs, batch)``: ``inputs[i]`` is the output of ``metaop.preds[i]`` (what the runtime received from
  that producer; a slice after the first of a MetaOp gets the previous slice's output as its only input).
  Front ends read ``batch`` (the local DP shard's ``TaskBatch``) and take no inputs. Activations are
  ``[batch, seq, hidden]``, batch first, on the local DP shard, replicated over the TP group.
- The first layer of a module concatenates its inputs along the sequence in flow order (``task.flows``), followed
  by its own text front end's output; the operator reorders ``inputs`` itself from ``metaop.preds``.
- A contrastive head returns ``[b, 1, embed_dim]``; the loss operator pairs the two heads of ``loss.modules``.
- Loss operators (``loss`` and ``lm_head``) return this DP rank's SHARE of the task loss: the task loss is the sum
  of the shares over the DP ranks and gradients are to be SUMMED over DP ranks (see models/losses.py). The
  contrastive share is L/dp of the loss over the DP-gathered batch; the LM share is this shard's token-loss sum
  over the labelled tokens of the global batch. With ``dp_group=None`` (or dp=1) the share is the whole loss.
  Of a micro-batch (``TaskBatch.micro``) the share is of the iteration's loss: the LM token sum still over the
  whole batch's labelled tokens, the contrastive loss of the micro-batch divided by the micro-batch count.
- Weights: each parameter unit (``units()``, e.g. ``"vision.layers.3"``, ``"vision.frontend"``,
  ``"llm.lm_head"``, ``"vis_proj.projector"``; ``"<module>@<task>"`` for ``shared: false`` modules) is
  initialised from full tensors drawn from a generator seeded by the parameter name (``models/state.py``), so
  every TP layout and plan starts from the same full weights. ``export_full_state`` / ``export_full_grads`` /
  ``load_full_state`` use full TP-unsharded tensors named ``"<unit>.<submodule path>"``; export is collective over
  the TP group (every TP rank must call it).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Iterable, Iterator

import torch
import torch.distributed as dist
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.transformer_block import TransformerBlock
from torch import nn

from megatron_spindle.checkpointing.names import local_spelling
from megatron_spindle.compat.cpu import apply_cpu_shim, layer_spec, uses_te_spec
from megatron_spindle.compat.groups import (
    ensure_global_memory_buffer,
    ensure_model_parallel_rng,
    ensure_torch_distributed,
    group_rank,
    group_size,
    make_pg_collection,
)
from megatron_spindle.compat.recompute import patch_checkpoint_without_output
from megatron_spindle.data.mock import TaskBatch, own_text_tokens
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.models.config import (
    ModelConfig,
    lm_head_config,
    norm_epsilon,
    projector_config,
    rotary_base,
    sequence_parallel,
    transformer_config,
)
from megatron_spindle.models.dropout import seed_layer_dropout
from megatron_spindle.models.frontends import ConvStemFrontend, PatchFrontend, TextFrontend, WindowFrontend
from megatron_spindle.models.heads import LMHead, PooledHead, eos_positions
from megatron_spindle.models.losses import contrastive_loss, lm_loss
from megatron_spindle.models.state import (
    full_shape,
    gather_full,
    init_full_tensor,
    placed_full,
    shard_full_tensor,
)
from megatron_spindle.plan.derive import metaop_infos as plan_metaop_infos
from megatron_spindle.plan.schema import MetaOpInfo, sequence_parallel_tokens

METAOP_KINDS = ("frontend", "layer", "projector", "head", "lm_head", "loss")


def metaop_infos(workload: Workload) -> dict[str, MetaOpInfo]:
    """MetaOpInfo of every MetaOp of the workload's graph, by id (the records a Plan holds)."""
    return {info.id: info for info in plan_metaop_infos(build_metagraph(workload))}


def _pred_modules(workload: Workload, metaop: MetaOpInfo) -> list[tuple[str, str]]:
    """(module, kind) of each predecessor MetaOp."""
    graph = build_metagraph(workload).metaops
    out = []
    for pid in metaop.preds:
        if pid in graph:
            out.append((graph[pid].module, graph[pid].kind))
        else:  # unknown id: parse "<task>/<module>[.<kind>|@<layer>]"
            tail = pid.split("/", 1)[-1]
            out.append((tail.split("@")[0].split(".")[0], tail.split(".")[1] if "." in tail else "layer"))
    return out


class SliceOperator(nn.Module):
    """Base class: parameter units, full-state export/load and deterministic initialisation."""

    def __init__(self, workload: Workload, metaop: MetaOpInfo, layer_start: int, layer_end: int,
                 pg_collection: ProcessGroupCollection | None, dp_group, config: ModelConfig):
        super().__init__()
        self.workload = workload
        self.metaop = metaop
        self.layer_start, self.layer_end = layer_start, layer_end
        self.pg_collection = make_pg_collection(base=pg_collection)
        self.tp_group = self.pg_collection.tp
        self.dp_group = dp_group
        self.config = config
        self.owner = workload.param_owner(metaop.module, metaop.task) if metaop.module else ""

    @property
    def tp_size(self) -> int:
        return group_size(self.tp_group)

    @property
    def tp_rank(self) -> int:
        return group_rank(self.tp_group)

    # ------------------------------------------------------------------------------------------ units
    def unit_modules(self) -> dict[str, nn.Module]:
        """Parameter unit name -> the module holding that unit's parameters."""
        return {}

    def batch_fields(self) -> dict[str, bool]:
        """What this operator reads of its task's batch (``batch_fields``): the data loader reads no more than
        the rank's operators say."""
        return batch_fields(self.workload, self.metaop)

    def units(self) -> list[str]:
        """Names of the parameter units this operator holds, e.g. ``["vision.layers.2", "vision.layers.3"]``."""
        return list(self.unit_modules())

    named_units = units  # docs/architecture.md spelling

    def full_named_parameters(self, units: Iterable[str] | None = None) -> Iterator[tuple[str, nn.Parameter]]:
        """(``"<unit>.<path>"``, local parameter) for every parameter of every unit (of ``units`` when given)."""
        wanted = None if units is None else set(units)
        for unit, named in self._named_by_unit.items():
            if wanted is None or unit in wanted:
                yield from named

    @functools.cached_property
    def _named_by_unit(self) -> dict[str, list[tuple[str, nn.Parameter]]]:
        """unit -> its (``"<unit>.<path>"``, parameter) pairs, made once: the runtime asks for a unit's gradients
        after every slice's backward, and walking the modules each time cost a step about 1 ms of host time on
        tiny-clip (the parameters are loaded in place, never replaced). Names are in the local spec's spelling
        whatever spec the layers are built on (checkpointing/names.py)."""
        return {unit: [(local_spelling(f"{unit}.{path}"), p) for path, p in module.named_parameters()]
                for unit, module in self.unit_modules().items()}

    # ------------------------------------------------------------------------------------------ full state
    def export_full_state(self) -> dict[str, torch.Tensor]:
        """Full (TP-unsharded) copies of the parameters. Collective over the TP group."""
        return {name: gather_full(p, p, self.tp_group) for name, p in self.full_named_parameters()}

    def export_full_grads(self, units: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Full (TP-unsharded) gradients (zeros where no gradient was produced), of ``units`` when given.
        Collective over the TP group. Parameters marked ``sequence_parallel`` (norms and row-parallel biases of
        sequence-parallel layers) are replicated but saw only this rank's part of the sequence: their gradients
        are summed over the group."""
        out = {}
        for name, p in self.full_named_parameters(units):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            out[name] = gather_full(grad, p, self.tp_group)
            if getattr(p, "sequence_parallel", False) and self.tp_size > 1:
                dist.all_reduce(out[name], group=self.tp_group)
        return out

    def export_grad_contributions(self, units: Iterable[str] | None = None,
                                  local: Collection[str] = ()) -> dict[str, torch.Tensor]:
        """This TP rank's part of ``export_full_grads`` (of ``units`` when given), without communication: full
        (TP-unsharded) tensors whose sum over the TP group is ``export_full_grads``. A sharded parameter's
        gradient sits at its own positions, zeros elsewhere; a replicated one's is the TP leader's (zeros on the
        others), except those marked ``sequence_parallel``, whose every rank contributes its own part. The
        runtime adds them into gradient buffers that its group reduction sums anyway, so no TP all-gather of
        gradients is needed. ``local``: sharded parameters whose gradient is wanted as this rank's shard itself,
        not placed in a full tensor (the runtime keeps exactly that shard, or adds it where it sits:
        runtime/tp_shards.py). A part is the gradient itself wherever it can be, not a copy (a copy per
        parameter tensor was host time in every backward wave on a GPU): read it before the next backward."""
        out = {}
        rank, size = self.tp_rank, self.tp_size
        for name, p in self.full_named_parameters(units):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)  # no history (no create_graph backward)
            sharded = getattr(p, "tensor_model_parallel", False)
            if size == 1 or (sharded and name in local):
                out[name] = grad
            elif sharded:
                out[name] = placed_full(grad, p, rank, size)
            elif getattr(p, "sequence_parallel", False) or rank == 0:
                out[name] = grad  # replicated: the full tensor already
            else:
                out[name] = self._zero_contribution(name, grad)
        return out

    def _zero_contribution(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """A replicated parameter's contribution on a TP rank other than the leader: zeros, made once per
        parameter and read every step (a new tensor per parameter each backward was the non-leader ranks' host
        time: twice the leader's runtime operations at TP 2)."""
        zeros = self._zero_contributions.get(name)
        if zeros is None or zeros.shape != grad.shape or zeros.dtype != grad.dtype or zeros.device != grad.device:
            zeros = self._zero_contributions[name] = torch.zeros_like(grad)
        return zeros

    @functools.cached_property
    def _zero_contributions(self) -> dict[str, torch.Tensor]:
        return {}

    @functools.cached_property
    def _params_by_name(self) -> dict[str, nn.Parameter]:
        """``full_named_parameters`` as a dict, made once."""
        return dict(self.full_named_parameters())

    @torch.no_grad()
    def load_full_state(self, state: dict[str, torch.Tensor], strict: bool = True,
                        local: Collection[str] = ()) -> None:
        """Load full tensors (any TP layout's export) into this rank's shards. ``strict``: every parameter of the
        operator must be present (extra names, e.g. other units', are ignored); without, only the names given are
        visited (the overlapped weight gather loads one unit at a time, runtime/param_gather.py). ``local``:
        names given as this rank's shard already (the runtime's TP shards of the operator's own degree), loaded as
        they are."""
        params, rank, size = self._params_by_name, self.tp_rank, self.tp_size
        if strict:
            missing = next((name for name in params if name not in state), None)
            if missing is not None:
                raise KeyError(f"{self.metaop.id}: full state lacks '{missing}'")
        targets, sources = [], []
        for name in (params if strict else [n for n in state if n in params]):
            p = params[name]
            full = state[name]
            if name in local:
                if full.shape != p.shape:
                    raise ValueError(f"{name}: shard shape {tuple(full.shape)} != expected {tuple(p.shape)}")
                targets.append(p)
                sources.append(full)
                continue
            if tuple(full.shape) != full_shape(p, size):
                raise ValueError(f"{name}: full shape {tuple(full.shape)} != expected {full_shape(p, size)}")
            targets.append(p)
            sources.append(shard_full_tensor(full, p, rank, size))
        # one call for all (copy_ casts, e.g. fp32 masters into bf16 weights, with the same rounding as .to): a
        # copy per tensor from Python was most of the optimizer step's 67 ms on an H200 (clip-4, ~1500 tensors)
        if targets:
            torch._foreach_copy_(targets, sources)

    def initial_full_state(self) -> dict[str, torch.Tensor]:
        cfg = self.config
        return {
            name: init_full_tensor(name, full_shape(p, self.tp_size), cfg.init_std, cfg.init_seed)
            for name, p in self.full_named_parameters()
        }

    def init_weights(self) -> None:
        """Deterministic initialisation from the parameter names (independent of TP layout and plan)."""
        self.load_full_state(self.initial_full_state())

    def forward(self, inputs: list[torch.Tensor], batch: TaskBatch) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"metaop={self.metaop.id}, layers=[{self.layer_start}, {self.layer_end}), tp={self.tp_size}"


class FrontendOperator(SliceOperator):
    """The module's front end on ``batch.inputs[module]`` -> ``[b, own tokens, hidden]``."""

    def __init__(self, *args):
        super().__init__(*args)
        spec = self.workload.modules[self.metaop.module]
        fe, dtype = spec.frontend, self.config.params_dtype
        max_tokens = max(
            own_text_tokens(self.workload, t.name, spec.name) for t in self.workload.tasks if spec.name in t.tokens
        )
        if fe.type == "patch":
            self.frontend = PatchFrontend(fe, spec.hidden_size, dtype, norm_epsilon(spec, self.config))
        elif fe.type == "audio" and fe.stem == "conv":
            self.frontend = ConvStemFrontend(fe, spec.hidden_size, max_tokens, dtype)
        elif fe.type in ("audio", "imu"):
            self.frontend = WindowFrontend(fe, spec.hidden_size, max_tokens, dtype)
        else:
            tcfg = lm_head_config(spec, self.tp_size, self.config)
            positions = None if spec.kind == "llm" else max_tokens  # LLMs: RoPE in the layers
            self.frontend = TextFrontend(fe, spec.hidden_size, positions, tcfg, self.tp_group)
            if self.config.hidden_dropout > 0:  # every TP rank holds the whole embedding: one mask (models/dropout.py)
                seed_layer_dropout(self.frontend, (self.metaop.task, f"{self.owner}.frontend",
                                                   group_rank(self.dp_group)), self.tp_rank, False)

    def unit_modules(self):
        return {f"{self.owner}.frontend": self.frontend}

    def forward(self, inputs, batch):
        raw = batch.inputs[self.metaop.module]
        if raw.is_floating_point():  # images / spectrograms / IMU: to the parameters' dtype and device
            raw = raw.to(next(self.frontend.parameters()))
        return self.frontend(raw)


class LayerRangeOperator(SliceOperator):
    """Transformer layers ``[layer_start, layer_end)`` of the MetaOp (megatron-core TransformerBlocks: one, or
    one per recomputation granularity when some layers recompute fully and the others selectively,
    ``Recompute.blocks``). Encoders: bidirectional. LLMs: causal with RoPE over the whole (concatenated)
    sequence."""

    def __init__(self, *args):
        super().__init__(*args)
        spec = self.workload.modules[self.metaop.module]
        self.module_spec = spec
        self.first_layer = self.metaop.layer_offset + self.layer_start  # module layer of the first layer here
        blocks = self.config.recomputation.blocks(self.layer_end - self.layer_start)
        tcfgs = [transformer_config(spec, n, self.tp_size, dataclasses.replace(self.config, recompute=rc))
                 for n, rc in blocks]
        self.sequence_parallel = sequence_parallel(self.config, self.tp_size)
        self.te_spec = uses_te_spec(self.config.attention_backend)
        self.blocks = nn.ModuleList(
            TransformerBlock(tcfg, layer_spec(spec, self.sequence_parallel, self.config.attention_backend),
                             post_layer_norm=False,
                             pg_collection=self.pg_collection)
            for tcfg in tcfgs)
        tcfg = tcfgs[0]
        self.rotary = None
        if spec.kind == "llm":
            scaling = spec.rope_scaling_factor is not None
            self.rotary = RotaryEmbedding(tcfg.kv_channels, rotary_percent=1.0,
                                          rotary_base=rotary_base(spec, self.config), rope_scaling=scaling,
                                          rope_scaling_factor=spec.rope_scaling_factor if scaling else 8.0,
                                          use_cpu_initialization=True)
        self.input_order = self._flow_order() if self.layer_start == 0 else None
        if self.config.hidden_dropout > 0 or self.config.attention_dropout > 0:
            for unit, layer in self.unit_modules().items():  # the masks' key: models/dropout.py
                seed_layer_dropout(layer, (self.metaop.task, unit, group_rank(self.dp_group)), self.tp_rank,
                                   self.sequence_parallel)

    def _flow_order(self) -> list[int]:
        """Order of ``inputs`` (given in ``metaop.preds`` order): flows into the module in ``task.flows`` order,
        then the module's own front end."""
        task = self.workload.task(self.metaop.task)
        flow_rank = {m: i for i, m in enumerate(task.predecessors(self.metaop.module))}

        def key(i_pred):
            module, kind = i_pred[1]
            if kind == "frontend" and module == self.metaop.module:
                return (1, 0)
            return (0, flow_rank.get(module, len(flow_rank)))

        pairs = list(enumerate(_pred_modules(self.workload, self.metaop)))
        return [i for i, _ in sorted(pairs, key=key)]

    def unit_modules(self):
        layers = [layer for block in self.blocks for layer in block.layers]
        return {f"{self.owner}.layers.{self.first_layer + i}": layer for i, layer in enumerate(layers)}

    def assemble_input(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        if len(inputs) == 1:
            return inputs[0]
        order = self.input_order if self.input_order and len(self.input_order) == len(inputs) else range(len(inputs))
        return torch.cat([inputs[i] for i in order], dim=1)

    def forward(self, inputs, batch):
        hidden = self.assemble_input(inputs).transpose(0, 1).contiguous()  # [s, b, h]
        tokens = hidden.shape[0]
        if self.sequence_parallel:
            hidden = self._split_sequence(hidden)
        seq = hidden.shape[0] * (self.tp_size if self.sequence_parallel else 1)  # padded: what attention sees
        rotary = self.rotary(seq) if self.rotary is not None else None
        mask = None
        if self.module_spec.is_causal and not self.te_spec:
            mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=hidden.device), diagonal=1)[None, None]
        for block in self.blocks:
            hidden = block(hidden, attention_mask=mask, rotary_pos_emb=rotary)
        if self.sequence_parallel:  # replicated again, as the operator contract has it; each rank's gradient is
            # the whole one already, so the backward only takes this rank's part (no reduce-scatter)
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                          group=self.tp_group)[:tokens]
        return hidden.transpose(0, 1).contiguous()

    def _split_sequence(self, hidden: torch.Tensor) -> torch.Tensor:
        """This TP rank's part of the sequence. A causal module's sequence is padded at the end to a multiple of
        the TP size: no real token attends to a later one, so the padding changes no output or gradient of theirs;
        a bidirectional one's must divide (plan/ enables sequence parallelism only there)."""
        tokens = hidden.shape[0]
        pad = sequence_parallel_tokens(tokens, self.tp_size) - tokens
        if pad and not self.module_spec.is_causal:
            raise ValueError(f"{self.metaop.id}: sequence parallelism over {self.tp_size} TP ranks needs a sequence "
                             f"length divisible by {self.tp_size} in a bidirectional module, got {tokens} tokens")
        if pad:
            hidden = torch.cat([hidden, hidden.new_zeros(pad, *hidden.shape[1:])])
        # a copy, as megatron's embedding clones its scatter's output: the part is a view of the whole sequence,
        # and the first layer saving it would keep all of it alive until the backward
        return scatter_to_sequence_parallel_region(hidden, group=self.tp_group).clone()


class ProjectorOperator(SliceOperator):
    """Token pooling (mean of each group of ``pool`` consecutive tokens), then megatron's MultimodalProjector: a
    2-layer MLP ``input_size -> hidden -> hidden`` with GELU."""

    def __init__(self, *args):
        super().__init__(*args)
        spec = self.workload.modules[self.metaop.module]
        self.pool = spec.pool
        self.projector = MultimodalProjector(
            projector_config(spec, self.tp_size, self.config),
            MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            projector_type="mlp", input_size=spec.in_size, tp_group=self.tp_group,
        )

    def unit_modules(self):
        return {f"{self.owner}.projector": self.projector}

    def forward(self, inputs, batch):
        x = inputs[0]
        if self.pool > 1:
            B, S, H = x.shape
            n = S // self.pool
            x = x[:, : n * self.pool].reshape(B, n, self.pool, H).mean(dim=2)
        return self.projector(x.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()


class PooledHeadOperator(SliceOperator):
    """Contrastive head of a tower (or a standalone ``head`` module): ``[b, S, H] -> [b, 1, embed_dim]``.
    Pooling: the module's ``pooling`` (cls, mean, or eos: the EOS token of the module's own text, which is the
    last part of the sequence, found in ``batch.inputs[module]`` by ``heads.eos_positions``)."""

    def __init__(self, *args):
        super().__init__(*args)
        spec = self.workload.modules[self.metaop.module]
        self.eos_token_id = spec.eos_token_id
        out_dim = spec.embed_dim or spec.hidden_size
        self.head = PooledHead(spec.hidden_size, out_dim, spec.pooling, norm_epsilon(spec, self.config),
                               self.config.params_dtype)

    def unit_modules(self):
        return {f"{self.owner}.head": self.head}

    def forward(self, inputs, batch):
        hidden = inputs[0]
        positions = None
        if self.head.pool == "eos":
            if batch is None or self.metaop.module not in batch.inputs:
                raise ValueError(f"{self.metaop.id}: eos pooling needs the token ids of '{self.metaop.module}'")
            ids = batch.inputs[self.metaop.module]
            positions = hidden.shape[1] - ids.shape[1] + eos_positions(ids, self.eos_token_id)
        return self.head(hidden, positions)


class LMHeadOperator(SliceOperator):
    """Final RMSNorm + vocab-parallel output layer + LM loss on the sequence's last T positions (the module's own
    text; positions from projected modalities carry no label). Returns this DP rank's loss share."""

    def __init__(self, *args):
        super().__init__(*args)
        spec = self.workload.modules[self.metaop.module]
        tcfg = lm_head_config(spec, self.tp_size, self.config)
        self.lm_head = LMHead(spec.hidden_size, spec.lm_vocab, tcfg, self.tp_group)

    def unit_modules(self):
        return {f"{self.owner}.lm_head": self.lm_head}

    def forward(self, inputs, batch):
        if batch.labels is None:
            raise ValueError(f"{self.metaop.id}: the batch of task '{batch.task}' has no LM labels")
        if batch.num_label_tokens < 0:
            raise ValueError(f"{self.metaop.id}: the batch of task '{batch.task}' was read without all of its "
                             f"LM text, so its labelled tokens are not counted")
        text = batch.labels.shape[1]
        hidden = inputs[0][:, -text:].transpose(0, 1).contiguous()  # [T, b, H]
        logits = self.lm_head(hidden)  # [T, b, V/tp]
        return lm_loss(logits, batch.labels.t(), batch.num_label_tokens, self.tp_group)


class ContrastiveLossOperator(SliceOperator):
    """Symmetric InfoNCE between the two towers' embeddings gathered over ``dp_group``. No parameters."""

    def __init__(self, *args):
        super().__init__(*args)
        loss = self.workload.task(self.metaop.task).loss
        self.loss_modules = tuple(loss.modules)
        self.temperature = loss.temperature
        pred_modules = [m for m, _ in _pred_modules(self.workload, self.metaop)]
        self.input_order = [pred_modules.index(m) for m in self.loss_modules] if set(pred_modules) == set(
            self.loss_modules) and len(pred_modules) == 2 else [0, 1]

    def forward(self, inputs, batch):
        a, b = (inputs[i].reshape(inputs[i].shape[0], -1) for i in self.input_order)
        # an iteration of m micro-batches trains on the mean of their losses (each over its own micro-batch)
        micro_batches = getattr(batch, "micro_batches", 1) if batch is not None else 1
        return contrastive_loss(a, b, self.temperature, self.dp_group) / micro_batches


def batch_fields(workload: Workload, metaop: MetaOpInfo) -> dict[str, bool]:
    """The raw fields of its task's batch a MetaOp's operator reads -> whether it reads every row of the global
    batch, not only its DP rank's. A front end reads its module's input, a head pooling at the EOS token its
    module's token ids, an LM head the labels of its LM text in every row (its loss is normalised by the
    labelled tokens of the whole batch); the others read nothing."""
    if metaop.kind == "frontend":
        return {metaop.module: False}
    if metaop.kind == "head" and workload.modules[metaop.module].pooling == "eos":
        return {metaop.module: False}
    if metaop.kind == "lm_head":
        return {workload.task(metaop.task).loss.modules[0]: True}
    return {}


_OPERATOR_CLASSES = {
    "frontend": FrontendOperator,
    "layer": LayerRangeOperator,
    "projector": ProjectorOperator,
    "head": PooledHeadOperator,
    "lm_head": LMHeadOperator,
    "loss": ContrastiveLossOperator,
}


def build_operator(workload: Workload, metaop: MetaOpInfo, layer_start: int, layer_end: int,
                   pg_collection: ProcessGroupCollection | None = None, dp_group=None,
                   config: ModelConfig | None = None) -> SliceOperator:
    """The operator running layers ``[layer_start, layer_end)`` (relative to the MetaOp) of ``metaop`` with the TP
    group ``pg_collection.tp`` (TP=1 when None) and, for contrastive losses, the DP group ``dp_group``.

    Applies the CPU shim when CUDA is absent and, when torch.distributed has no world yet, creates a one-process
    gloo world (megatron-core's tensor-parallel mappings need one; see compat/groups.py): a process that wants its
    own multi-process world must call ``init_process_group`` before building operators. Also creates megatron's
    global memory buffer and ``model-parallel-rng`` stream when missing (``initialize_model_parallel`` would
    otherwise do it; do not call that after building operators: it asserts the buffer is unset).
    """
    if metaop.kind not in _OPERATOR_CLASSES:
        raise ValueError(f"{metaop.id}: unknown MetaOp kind '{metaop.kind}' (expected one of {METAOP_KINDS})")
    limit = metaop.num_layers if metaop.kind == "layer" else 1
    if not 0 <= layer_start < layer_end <= limit:
        raise ValueError(f"{metaop.id}: layer range [{layer_start}, {layer_end}) outside [0, {limit})")
    apply_cpu_shim()
    patch_checkpoint_without_output()
    ensure_torch_distributed()
    ensure_global_memory_buffer()
    ensure_model_parallel_rng()
    cls = _OPERATOR_CLASSES[metaop.kind]
    op = cls(workload, metaop, layer_start, layer_end, pg_collection, dp_group, config or ModelConfig())
    op.init_weights()
    module = workload.modules.get(metaop.module)
    if module is not None and module.frozen:  # megatron-core's linears then keep no inputs for a weight gradient
        op.requires_grad_(False)
    return op
