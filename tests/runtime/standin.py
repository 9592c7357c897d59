"""Stand-in operators for runtime tests: small torch models that follow the operator contract of
``megatron_spindle.runtime.engine`` (models/ ``build_operator``) with real TP sharding, DP-aware losses and
weights initialised from unit names, plus a single-process reference over the same functions.

Layouts follow models/operator.py: token sequences [batch, tokens, hidden], pooled embeddings [batch, 1, embed].
A transformer "layer" is a pre-scaled MLP block with a column-parallel fc1 and a row-parallel fc2 (gradient
all-reduce of the input over TP in backward, output all-reduce in forward) plus a replicated scale ``norm``,
and a token-mixing term so that token order matters.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import Workload, output_tokens

RAW_FEATURES = 6  # non-text front ends read [B, tokens, RAW_FEATURES] features


def _seed(*parts) -> int:
    return zlib.crc32("|".join(str(p) for p in parts).encode())


# ------------------------------------------------------------------------------------------------ data


@dataclass
class StandinBatch:
    feats: dict[str, torch.Tensor]  # module -> [B, own tokens, RAW] (or token ids [B, own tokens])
    labels: torch.Tensor | None  # [B, tokens] for lm tasks
    micro_batches: int = 1  # a micro-batch of the iteration's batch (TaskBatch.micro's convention)

    def shard(self, k: int, dp: int) -> StandinBatch:
        def cut(x):
            n = x.shape[0] // dp
            return x[k * n:(k + 1) * n]

        return StandinBatch({m: cut(v) for m, v in self.feats.items()},
                            None if self.labels is None else cut(self.labels), self.micro_batches)

    def micro(self, j: int, m: int) -> StandinBatch:
        part = self.shard(j, m)
        part.micro_batches = m
        return part


def standin_batch(workload: Workload, task: str, step: int, seed: int) -> StandinBatch:
    t = workload.task(task)
    g = torch.Generator().manual_seed(_seed("batch", task, step, seed))
    feats = {}
    for mod in t.modules:
        m = workload.modules[mod]
        if m.frontend is None:
            continue
        own = t.tokens[mod] - sum(output_tokens(workload, t, p) for p in t.predecessors(mod))
        if own <= 0:
            continue
        if m.frontend.type == "text":
            feats[mod] = torch.randint(0, m.frontend.vocab_size, (t.batch_size, own), generator=g)
        else:
            feats[mod] = torch.randn(t.batch_size, own, RAW_FEATURES, generator=g)
    labels = None
    if t.loss is not None and t.loss.kind == "lm":
        m = workload.modules[t.loss.modules[0]]
        labels = torch.randint(0, m.lm_vocab, (t.batch_size, t.tokens[m.name]), generator=g)
    return StandinBatch(feats, labels)


# ------------------------------------------------------------------------------------------ TP autograd


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherBatch(torch.autograd.Function):
    """All-gather along dim 0 over a DP group; backward sums the gradients of every rank's copy."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ctx.n = x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        r = dist.get_rank(ctx.group)
        return g[r * ctx.n:(r + 1) * ctx.n], None


# ------------------------------------------------------------------------------------------- operators


@dataclass(frozen=True)
class ParamDef:
    key: str  # "<unit>.<path>"
    shape: tuple[int, ...]
    shard_dim: int | None  # TP-sharded along this dim, or replicated


def _init_full(d: ParamDef) -> torch.Tensor:
    g = torch.Generator().manual_seed(_seed("init", d.key))
    if len(d.shape) == 1:
        return 1.0 + 0.1 * torch.randn(d.shape, generator=g)
    return torch.randn(d.shape, generator=g) / d.shape[-1] ** 0.5


class StandinOp(torch.nn.Module):
    """Layers [layer_start, layer_end) of one MetaOp; TP shards over ``pg_collection.tp``."""

    def __init__(self, workload: Workload, info, layer_start: int, layer_end: int, pg_collection=None,
                 dp_group=None):
        super().__init__()
        self.w, self.info = workload, info
        self.kind, self.ls, self.le = info.kind, layer_start, layer_end
        self.tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
        self.dp_group = dp_group
        self.tp = dist.get_world_size(self.tp_group) if self.tp_group is not None else 1
        self.tp_rank = dist.get_rank(self.tp_group) if self.tp_group is not None else 0
        self.defs = self._param_defs()
        self.shared: dict[str, torch.Tensor] | None = None  # reference mode: full shared parameters
        self.params = torch.nn.ParameterDict()
        for d in self.defs:
            self.params[_pkey(d.key)] = torch.nn.Parameter(self._shard(d, _init_full(d)))

    # -- structure
    def _param_defs(self) -> list[ParamDef]:
        w, info = self.w, self.info
        if info.kind == "loss":
            return []
        mod = w.modules[info.module]
        owner = w.param_owner(info.module, info.task)
        H = mod.hidden_size
        if info.kind == "frontend":
            fe = mod.frontend
            if fe.type == "text":
                return [ParamDef(f"{owner}.frontend.emb", (fe.vocab_size, H), None)]
            return [ParamDef(f"{owner}.frontend.proj", (H, RAW_FEATURES), None)]
        if info.kind == "layer":
            out = []
            for i in range(self.ls, self.le):
                u = f"{owner}.layers.{info.layer_offset + i}"
                out += [ParamDef(f"{u}.norm", (H,), None), ParamDef(f"{u}.mix", (H,), None),
                        ParamDef(f"{u}.fc1", (mod.ffn_hidden_size, H), 0),
                        ParamDef(f"{u}.fc2", (H, mod.ffn_hidden_size), 1)]
            return out
        if info.kind == "projector":
            return [ParamDef(f"{owner}.projector.proj", (H, mod.input_size), None)]
        if info.kind == "head":
            return [ParamDef(f"{owner}.head.proj", (mod.embed_dim, H), None)]
        if info.kind == "lm_head":
            return [ParamDef(f"{owner}.lm_head.proj", (mod.lm_vocab, H), None)]
        raise ValueError(info.kind)

    def units(self) -> list[str]:
        return sorted({d.key.rsplit(".", 1)[0] for d in self.defs})

    def _shard(self, d: ParamDef, full: torch.Tensor) -> torch.Tensor:
        if d.shard_dim is None or self.tp == 1:
            return full.clone()
        return full.chunk(self.tp, d.shard_dim)[self.tp_rank].clone()

    def p(self, key: str) -> torch.Tensor:
        if self.shared is not None:
            return self.shared[key]
        return self.params[_pkey(key)]

    # -- full state
    def export_full_state(self) -> dict[str, torch.Tensor]:
        out = {}
        for d in self.defs:
            x = self.params[_pkey(d.key)].detach()
            if d.shard_dim is not None and self.tp > 1:
                parts = [torch.empty_like(x) for _ in range(self.tp)]
                dist.all_gather(parts, x.contiguous(), group=self.tp_group)
                x = torch.cat(parts, d.shard_dim)
            out[d.key] = x.clone()
        return out

    def load_full_state(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """As SliceOperator's: ``strict``: every parameter must be present."""
        with torch.no_grad():
            for d in self.defs:
                if d.key in state or strict:
                    self.params[_pkey(d.key)].copy_(self._shard(d, state[d.key]))

    # -- compute
    def forward(self, inputs: list[torch.Tensor], batch: StandinBatch) -> torch.Tensor:
        return getattr(self, f"_fwd_{self.kind}")(inputs, batch)

    def _fwd_frontend(self, inputs, batch):
        mod, owner = self.info.module, self.w.param_owner(self.info.module, self.info.task)
        x = batch.feats[mod]
        if self.w.modules[mod].frontend.type == "text":
            y = self.p(f"{owner}.frontend.emb")[x]
        else:
            y = x @ self.p(f"{owner}.frontend.proj").t()
        return y  # [b, S, H]

    def _fwd_layer(self, inputs, batch):
        x = torch.cat(inputs, 1) if len(inputs) > 1 else inputs[0]
        owner = self.w.param_owner(self.info.module, self.info.task)
        for i in range(self.ls, self.le):
            u = f"{owner}.layers.{self.info.layer_offset + i}"
            h = x * self.p(f"{u}.norm")
            if self.tp > 1 and self.shared is None:
                h = _CopyToTP.apply(h, self.tp_group)
            y = F.gelu(h @ self.p(f"{u}.fc1").t()) @ self.p(f"{u}.fc2").t()
            if self.tp > 1 and self.shared is None:
                y = _ReduceFromTP.apply(y, self.tp_group)
            prefix = torch.cumsum(x, 1) / torch.arange(1, x.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)
            x = x + y + torch.tanh(prefix) * self.p(f"{u}.mix")
        return x

    def _fwd_projector(self, inputs, batch):
        (x,) = inputs
        mod = self.w.modules[self.info.module]
        if mod.pool > 1:
            B, S, H = x.shape
            x = x[:, :S // mod.pool * mod.pool].reshape(B, S // mod.pool, mod.pool, H).mean(2)
        return x @ self.p(f"{self.w.param_owner(self.info.module, self.info.task)}.projector.proj").t()

    def _fwd_head(self, inputs, batch):
        (x,) = inputs
        return x.mean(1, keepdim=True) @ self.p(f"{self.w.param_owner(self.info.module, self.info.task)}.head.proj").t()

    def _fwd_lm_head(self, inputs, batch):
        (x,) = inputs  # [b, S, H]
        logits = x @ self.p(f"{self.w.param_owner(self.info.module, self.info.task)}.lm_head.proj").t()
        B, S = self.info.input_shape[0], self.info.input_shape[1]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.labels.reshape(-1),
                             reduction="sum")
        return ce / (B * S)  # summed over DP ranks = mean over the task batch

    def _fwd_loss(self, inputs, batch):
        a, b = (x.reshape(x.shape[0], -1) for x in inputs)
        dp = 1
        if self.dp_group is not None and self.shared is None:
            dp = dist.get_world_size(self.dp_group)
            if dp > 1:
                a, b = _GatherBatch.apply(a, self.dp_group), _GatherBatch.apply(b, self.dp_group)
        temp = self.w.task(self.info.task).loss.temperature
        logits = F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).t() / temp
        target = torch.arange(logits.shape[0])
        loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2
        # every DP rank computes the full loss; their sum is the task loss (a micro-batch's: 1/m of it)
        return loss / dp / batch.micro_batches


def _pkey(key: str) -> str:
    return key.replace(".", "__")


def standin_factory(workload, info, layer_start, layer_end, pg_collection=None, dp_group=None, recompute=None,
                    attention_backend="auto"):
    """Stand-ins keep every activation and have no attention (``recompute`` and ``attention_backend`` are for
    megatron-core's layers)."""
    return StandinOp(workload, info, layer_start, layer_end, pg_collection=pg_collection, dp_group=dp_group)


# ------------------------------------------------------------------------------------------ reference


class StandinReference(torch.nn.Module):
    """Single process, full weights, one parameter per key shared by every task that uses it."""

    def __init__(self, workload: Workload):
        super().__init__()
        self.w = workload
        self.g = build_metagraph(workload)
        self.ops: dict[str, StandinOp] = {}
        self.full = torch.nn.ParameterDict()
        for mid, m in self.g.metaops.items():
            op = StandinOp(workload, _Info(m), 0, m.num_layers)
            for d in op.defs:
                if _pkey(d.key) not in self.full:
                    self.full[_pkey(d.key)] = torch.nn.Parameter(_init_full(d))
            self.ops[mid] = op
        shared = _KeyView(self.full)
        for op in self.ops.values():
            op.shared = shared

    def state(self) -> dict[str, torch.Tensor]:
        return {k.replace("__", "."): v.detach().clone() for k, v in self.full.items()}

    def grads(self) -> dict[str, torch.Tensor]:
        return {k.replace("__", "."): v.grad.detach().clone() for k, v in self.full.items() if v.grad is not None}

    def forward(self, step: int, seed: int = 0, micro_batches: int = 1) -> dict[str, torch.Tensor]:
        losses = {}
        for t in self.w.tasks:
            whole = standin_batch(self.w, t.name, step, seed)
            for j in range(micro_batches):
                loss = self._task(t, whole.micro(j, micro_batches) if micro_batches > 1 else whole)
                losses[t.name] = loss if j == 0 else losses[t.name] + loss
        return losses

    def _task(self, t, batch) -> torch.Tensor:
        outs = {}
        for level in self.g.levels:
            for mid in level:
                m = self.g.metaops[mid]
                if m.task != t.name:
                    continue
                outs[mid] = self.ops[mid]([outs[p] for p in self.g.predecessors(mid)], batch)
                if m.kind in ("loss", "lm_head") and not self.g.successors(mid):
                    return outs[mid]
        raise ValueError(f"task '{t.name}' has no loss")


class _KeyView:
    def __init__(self, pd):
        self.pd = pd

    def __getitem__(self, key):
        return self.pd[_pkey(key)]


class _Info:
    """MetaOp -> the fields of plan.schema.MetaOpInfo the stand-ins read."""

    def __init__(self, m):
        self.id, self.task, self.module, self.kind = m.id, m.task, m.module, m.kind
        self.num_layers, self.layer_offset, self.input_shape = m.num_layers, m.layer_offset, list(m.input_shape)
