"""Unified operator graph of all tasks, contracted into MetaOps and MetaLevels (paper section 3.1).

One operator per transformer layer, plus light ops: a module's front end (patch/token embedding), a projector,
a head (pooling + projection to the contrastive embedding, or the LM output layer with its loss) and a task's
contrastive loss. Operators with the same (type, input shape) on an exclusive chain merge into a MetaOp.
Weights used with different input shapes (other batch, tokens or task) become different MetaOps that share
parameters; their parameter names tell which.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_spindle.graph.workload import (
    Workload,
    WorkloadError,
    grad_outputs,
    module_backward,
    output_tokens,
)

# Operator kinds. "layer" ops are the only ones that form multi-operator MetaOps in practice.
OP_KINDS = ("frontend", "layer", "projector", "head", "lm_head", "loss")


@dataclass(frozen=True)
class Operator:
    id: str
    type: str  # structural type: same type + same input shape = same workload
    input_shape: tuple[int, ...]  # (batch, tokens, hidden)
    params: tuple[str, ...] = ()  # names of the weights it uses
    task: str = ""
    module: str = ""
    kind: str = "layer"
    layer: int = 0  # index within the module (layers) else 0
    backward: str = "full"  # full | input (a frozen module's input gradients only) | none (graph/workload.py)
    frozen: bool = False  # its weights are frozen: no gradient, no optimizer state


@dataclass
class OperatorGraph:
    ops: dict[str, Operator] = field(default_factory=dict)
    edges: list[tuple[str, str]] = field(default_factory=list)

    def add(self, op: Operator) -> Operator:
        if op.id in self.ops:
            raise WorkloadError(f"operator '{op.id}' defined twice")
        self.ops[op.id] = op
        return op

    def connect(self, src: str, dst: str) -> None:
        self.edges.append((src, dst))

    def successors(self, op: str) -> list[str]:
        return [d for s, d in self.edges if s == op]

    def predecessors(self, op: str) -> list[str]:
        return [s for s, d in self.edges if d == op]

    def topo_order(self) -> list[str]:
        indeg = {o: 0 for o in self.ops}
        succ: dict[str, list[str]] = {o: [] for o in self.ops}
        for s, d in self.edges:
            indeg[d] += 1
            succ[s].append(d)
        ready = [o for o in self.ops if indeg[o] == 0]
        order = []
        while ready:
            o = ready.pop(0)
            order.append(o)
            for d in succ[o]:
                indeg[d] -= 1
                if indeg[d] == 0:
                    ready.append(d)
        if len(order) != len(self.ops):
            raise WorkloadError(f"operator graph has a cycle through {sorted(o for o in indeg if indeg[o] > 0)[:5]}")
        return order


@dataclass
class MetaOp:
    """A chain of ``num_layers`` identical operators. ``layer_offset`` is the module layer of the first one."""

    id: str
    type: str
    input_shape: tuple[int, ...]
    ops: list[str]
    params: list[tuple[str, ...]]  # per operator, in chain order
    task: str
    module: str
    kind: str
    layer_offset: int
    level: int = 0
    backward: str = "full"  # full | input | none: what its backward computes (Operator.backward)
    frozen: bool = False  # frozen weights: no gradient, optimizer state or gradient sync

    @property
    def trained_params(self) -> list[tuple[str, ...]]:
        """``params`` that get gradients: none of a frozen MetaOp's."""
        return [() for _ in self.params] if self.frozen else self.params

    @property
    def num_layers(self) -> int:
        return len(self.ops)

    @property
    def batch(self) -> int:
        return self.input_shape[0]

    @property
    def tokens(self) -> int:
        return self.input_shape[1]

    @property
    def hidden(self) -> int:
        return self.input_shape[2]

    def param_names(self) -> set[str]:
        return {p for ps in self.params for p in ps}

    def trained_param_names(self) -> set[str]:
        """``param_names`` that get gradients (synchronised wherever they are held): none of a frozen MetaOp's."""
        return set() if self.frozen else self.param_names()


@dataclass
class MetaGraph:
    metaops: dict[str, MetaOp]
    edges: list[tuple[str, str]]  # producer MetaOp -> consumer MetaOp
    levels: list[list[str]]  # MetaLevels in dependency order, each a list of MetaOp ids

    def predecessors(self, m: str) -> list[str]:
        return [s for s, d in self.edges if d == m]

    def successors(self, m: str) -> list[str]:
        return [d for s, d in self.edges if s == m]

    def shares_params(self, a: str, b: str) -> bool:
        return bool(self.metaops[a].param_names() & self.metaops[b].param_names())

    def sharing_groups(self) -> list[list[str]]:
        """MetaOps grouped by shared weights (connected components of the sharing relation)."""
        owner: dict[str, str] = {}
        parent = {m: m for m in self.metaops}

        def find(x):
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for m, mo in self.metaops.items():
            for p in mo.param_names():
                if p in owner:
                    parent[find(m)] = find(owner[p])
                else:
                    owner[p] = m
        groups: dict[str, list[str]] = {}
        for m in self.metaops:
            groups.setdefault(find(m), []).append(m)
        return list(groups.values())


# ------------------------------------------------------------------------------------ workload -> operators


def build_operator_graph(w: Workload) -> OperatorGraph:
    """One operator per layer of every module every task runs, plus the light front/back ops."""
    g = OperatorGraph()
    for t in w.tasks:
        first: dict[str, str] = {}  # module -> op that receives flows into the module
        last: dict[str, str] = {}  # module -> op whose output flows out of the module
        loss_mods = set(t.loss.modules) if t.loss else set()
        needs = grad_outputs(w, t)
        for mod in t.topo_modules():
            m = w.modules[mod]
            grad = {"backward": module_backward(w, t, mod, needs), "frozen": m.frozen}
            owner = w.param_owner(mod, t.name)
            B, S = t.batch_size, t.tokens[mod]
            prefix = f"{t.name}/{mod}"
            preds = t.predecessors(mod)
            chain: list[str] = []
            if m.frontend is not None:
                own = S - sum(output_tokens(w, t, p) for p in preds)
                if own > 0:
                    fe = g.add(Operator(f"{prefix}.frontend", f"{owner}.frontend", (B, own, m.hidden_size),
                                        (f"{owner}.frontend",), t.name, mod, "frontend",
                                        backward="none" if m.frozen else "full", frozen=m.frozen))
                    chain.append(fe.id)
            if m.has_layers:
                layer_ids = []
                for i in range(m.num_layers):
                    op = g.add(Operator(f"{prefix}.layer{i}", f"{owner}.layer", (B, S, m.hidden_size),
                                        (f"{owner}.layers.{i}",), t.name, mod, "layer", i, **grad))
                    layer_ids.append(op.id)
                entry = layer_ids[0]
                if chain:
                    g.connect(chain[-1], entry)
                chain += layer_ids
                for a, b in zip(layer_ids, layer_ids[1:]):
                    g.connect(a, b)
            else:
                kind = "projector" if m.kind == "projector" else "head"
                op = g.add(Operator(f"{prefix}", f"{owner}.{kind}", (B, S, m.in_size), (f"{owner}.{kind}",),
                                    t.name, mod, kind, **grad))
                entry = op.id
                if chain:
                    g.connect(chain[-1], entry)
                chain.append(op.id)
            exit_op = chain[-1]
            if mod in loss_mods and m.has_layers:
                kind = "lm_head" if t.loss.kind == "lm" else "head"
                head = g.add(Operator(f"{prefix}.{kind}", f"{owner}.{kind}", (B, S, m.hidden_size),
                                      (f"{owner}.{kind}",), t.name, mod, kind, **grad))
                g.connect(exit_op, head.id)
                exit_op = head.id
            first[mod], last[mod] = entry, exit_op
            for p in preds:
                g.connect(last[p], entry)
        if t.loss is not None and t.loss.kind == "contrastive":
            a, b = t.loss.modules
            dim = w.modules[a].embed_dim
            loss = g.add(Operator(f"{t.name}/loss", f"{t.name}.contrastive_loss", (t.batch_size, 2, dim), (),
                                  t.name, "", "loss"))
            g.connect(last[a], loss.id)
            g.connect(last[b], loss.id)
    return g


# ------------------------------------------------------------------------------------------- contraction


def contract(g: OperatorGraph) -> MetaGraph:
    """Merge exclusive chains of identical (type, input shape) operators into MetaOps; assign MetaLevels."""
    succ = {o: g.successors(o) for o in g.ops}
    pred = {o: g.predecessors(o) for o in g.ops}
    absorbed: dict[str, str] = {}
    chains: dict[str, list[str]] = {}
    for o in g.topo_order():
        if o in absorbed:
            continue
        chain, tail = [o], o
        head_op = g.ops[o]
        while len(succ[tail]) == 1:
            nxt = succ[tail][0]
            if len(pred[nxt]) != 1:
                break
            n_op = g.ops[nxt]
            if (n_op.type, n_op.input_shape) != (head_op.type, head_op.input_shape):
                break
            chain.append(nxt)
            absorbed[nxt] = o
            tail = nxt
        chains[o] = chain
        absorbed[o] = o
    metaops: dict[str, MetaOp] = {}
    op_to_meta: dict[str, str] = {}
    for head, chain in chains.items():
        h = g.ops[head]
        mid = _metaop_id(h, len(chain))
        metaops[mid] = MetaOp(mid, h.type, h.input_shape, chain, [g.ops[c].params for c in chain],
                              h.task, h.module, h.kind, h.layer, backward=h.backward, frozen=h.frozen)
        for c in chain:
            op_to_meta[c] = mid
    edges = []
    for s, d in g.edges:
        ms, md = op_to_meta[s], op_to_meta[d]
        if ms != md and (ms, md) not in edges:
            edges.append((ms, md))
    levels = _longest_path_levels(metaops, edges)
    return MetaGraph(metaops, edges, levels)


def _metaop_id(head: Operator, length: int) -> str:
    if head.kind == "layer" and head.module:
        return f"{head.task}/{head.module}" if head.layer == 0 else f"{head.task}/{head.module}@{head.layer}"
    return head.id


def _longest_path_levels(metaops: dict[str, MetaOp], edges: list[tuple[str, str]]) -> list[list[str]]:
    """level(m) = 1 + max level(pred): unlike BFS depth, every level is dependency-free (paper summary 2.1)."""
    preds: dict[str, list[str]] = {m: [] for m in metaops}
    for s, d in edges:
        preds[d].append(s)
    level: dict[str, int] = {}

    def lvl(m: str, stack=()) -> int:
        if m not in level:
            if m in stack:
                raise WorkloadError(f"MetaOp graph has a cycle through '{m}'")
            level[m] = 1 + max((lvl(p, stack + (m,)) for p in preds[m]), default=-1)
        return level[m]

    for m in metaops:
        lvl(m)
    out: list[list[str]] = [[] for _ in range(max(level.values()) + 1)]
    for m, k in level.items():
        metaops[m].level = k
        out[k].append(m)
    return out


def build_metagraph(w: Workload) -> MetaGraph:
    return contract(build_operator_graph(w))
