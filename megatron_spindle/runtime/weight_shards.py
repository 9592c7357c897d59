"""ZeRO stage 3: between uses, each local slice keeps only its data-parallel shard of its weights.

The plan's rule (plan/memory.py ``zero_state_bytes_per_param``, estimator/slice_time.py): at stage 3 a slice's
weights live sharded over its data-parallel ranks (each TP rank's part over the ranks that share its TP rank),
and a layer's weights are all-gathered over the slice's DP group before the layer's forward, and again before
its backward, as DeepSpeed ZeRO-3 and PyTorch FSDP do. Masters, moments and gradients are sharded as at stage 2
(over the parameter device group: optimizer.py, grad_shards.py). With ``settings.node_local_weights`` (ZeRO++'s
hierarchical partitioning) the weights are sharded, and a layer gathered, over the slice's DP ranks on this
rank's node only (groups.py ``weight_group_devices``, plan/layout.py ``weight_shard_group``).

After the optimizer step (plan/buckets.py ``regathered_groups``, the rule the cost model charges): a unit whose
every slice runs with TP 1 on exactly its group's devices keeps its weights flattened as its master is (keys
sorted by name) and chunked over the same members, so its weight shard *is* its master shard, cast
(``update_from_masters``: no communication, as in DeepSpeed ZeRO-3). Other units (TP shards, a unit shared by
slices on other device sets) are redistributed (runtime/weight_redistribution.py): each shard receives its
pieces from the master shards holding them, or where a slice's parameters are not master tensors as they are,
the slice keeps its shard of the full weights (``loading``).

A *gather unit* is one parameter unit of a slice's operator (``unit_modules``: a transformer layer, a front
end, a head; for an operator without them at TP 1, the unit's parameters found by ``identical_params``) or,
failing that, the whole operator. Its parameters keep their shapes and storages; only the storages' bytes are
released (``resize_(0)``) and refilled, so that autograd's saved references to the parameters stay valid
(FSDP's way).

- forward pre-hook: gather;
- forward hook, outside a backward: free, and when autograd records, hook the outputs so that the weights are
  gathered again when the outputs' gradient arrives, before the unit's own backward runs. Inside a backward
  (megatron-core recomputing the layer) the weights stay for the backward that follows;
- each parameter's post-accumulate-grad hook: once every parameter of the unit has its gradient, free;
- ``after_backward(slice)``: free what of the slice is still gathered (parameters that got no gradient).

As the cost model charges (estimator/slice_time.py), gathers are prefetched one unit ahead: a unit's forward
pre-hook issues the next unit's gather (``async_op``) and its backward hook the previous unit's, so that each
runs beside the current unit's compute (two units' weights held at once). Every DP rank of a slice runs the same
layers in the same order, so the gathers match on every member; they run on a process group of their own
(groups.py ``weight_group``), so no gradient bucket issued elsewhere in the step queues among them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron_spindle.runtime.groups import PlanGroups
from megatron_spindle.runtime.opstate import identical_params
from megatron_spindle.runtime.shards import chunk_bounds
from megatron_spindle.runtime.slices import LocalSlice


class GatherUnit:
    """The parameters of one unit (``unit``; None: several, a whole operator) of one slice, flattened in the given
    order and sharded over the slice's ``members`` DP ranks (``index``: this rank's position in ``group``):
    ``size = ceil(numel / members)`` elements each, the last shard zero-padded (runtime/shards.py's layout)."""

    def __init__(self, name: str, params: list[torch.nn.Parameter], group, members: int, index: int,
                 unit: str | None = None, keys: list[str] | None = None):
        for p in params:  # the storage is released and refilled whole: it must be the parameter's alone
            if p.storage_offset() != 0 or p.untyped_storage().nbytes() != p.numel() * p.element_size():
                raise RuntimeError(f"ZeRO-3: a parameter of '{name}' shares its storage; it cannot be sharded")
        self.name, self.params, self.group, self.members, self.index = name, params, group, members, index
        self.unit = unit
        self.keys = keys  # the parameters' canonical keys (None: a whole operator's, not told apart)
        self.numel = sum(p.numel() for p in params)
        self.size = -(-self.numel // members)
        self.shard: torch.Tensor | None = None
        self.gathered = True
        self.pending: set[torch.nn.Parameter] = set()  # parameters whose gradient this backward has not added
        self.gathers = 0  # all-gathers completed into the parameters, ``prefetched`` of them issued ahead
        self.prefetched = 0
        self.module: torch.nn.Module | None = None  # whose forward gathers it (WeightShards._hook)
        self._inflight = None  # (rows, work) of an all-gather issued ahead of its use
        # the parameters' storage through ``.data`` aliases, made once: autograd's saved references must not see a
        # new version, and an alias follows its storage through ``resize_``
        self._data = [p.data for p in params]

    @property
    def bounds(self) -> tuple[int, int]:
        """Elements ``[lo, hi)`` of the flat parameters this member's shard holds (the rest of it is padding)."""
        return chunk_bounds(self.index, self.size, self.numel)

    @property
    def full_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)

    def reshard(self) -> None:
        """Keep this member's part of the weights the parameters hold now; release the rest."""
        flat = _flatten_dense_tensors(self._data)  # one C++ call
        lo, hi = self.bounds
        self.shard = flat.new_zeros(self.size)
        self.shard[:hi - lo] = flat[lo:hi]
        self.free()

    def free(self) -> None:
        if self.gathered:
            for p in self.params:
                p.untyped_storage().resize_(0)
            self.gathered = False

    def materialize(self) -> None:
        """The parameters' storages back at full size (contents undefined until written)."""
        if not self.gathered:
            for p in self.params:
                p.untyped_storage().resize_(p.numel() * p.element_size())
            self.gathered = True

    def prefetch(self) -> None:
        """Issue the all-gather of the shards (``async_op``), unless the parameters hold them or it is issued."""
        if not self.gathered and self._inflight is None:
            rows = self.shard.new_empty(self.members, self.size)
            self._inflight = rows, dist.all_gather(list(rows.unbind(0)), self.shard, group=self.group,
                                                   async_op=True)

    def settle(self) -> None:
        """Wait for an all-gather issued and never used (the shard may change afterwards)."""
        if self._inflight is not None:
            self._inflight[1].wait()
            self._inflight = None

    def gather(self) -> None:
        """The shards all-gathered over the slice's DP group into the parameters (nothing when they hold them;
        waits for a prefetch)."""
        if self.gathered:
            return
        self.prefetched += self._inflight is not None
        self.prefetch()
        rows, work = self._inflight
        self._inflight = None
        work.wait()
        self.materialize()
        # one multi-tensor copy from views made in C++: a copy per parameter was host time in every layer's forward
        # and backward on a GPU
        torch._foreach_copy_(self._data, _unflatten_dense_tensors(rows.view(-1)[:self.numel], self._data))
        self.gathers += 1


def _tensors(output) -> Iterator[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for o in output:
            yield from _tensors(o)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _unit_params(ls: LocalSlice, modules: dict[str, torch.nn.Module], key_unit: dict[str, str],
                 device: torch.device) -> dict[str, list[tuple[str, torch.nn.Parameter]]] | None:
    """unit -> its (key, parameter) in the slice's operator (``modules``: its ``unit_modules``), keys sorted;
    None when they cannot be told apart (a TP-sharded operator without ``unit_modules``)."""
    if modules:
        return {u: sorted((f"{u}.{path}", p) for path, p in m.named_parameters()) for u, m in modules.items()}
    if ls.slice.tp != 1:
        return None
    found = identical_params(ls.op, ls.param_keys, device)
    if len(found) != len(ls.param_keys) or len({id(p) for p in found.values()}) != len(list(ls.op.parameters())):
        return None
    out: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for k in sorted(found):
        out.setdefault(key_unit[k], []).append((k, found[k]))
    return out


class WeightShards:
    """The gather units of every local slice with more than one DP rank in its weight shard group (groups.py
    ``weight_group_devices``; one: nothing to shard).
    ``aligned``: the units whose weight shards are their master shards (plan/buckets.py ``regathered_groups``).
    ``peak_gathered`` is the most bytes of weights gathered at once on this rank (for tests)."""

    def __init__(self, local: dict[str, LocalSlice], groups: PlanGroups, key_unit: dict[str, str], aligned: set[str],
                 masters: dict[str, torch.Tensor], device: torch.device):
        self.units: dict[str, list[GatherUnit]] = {}
        self.whole: set[str] = set()  # slices gathered as one unit (their operator has no unit modules)
        self._hooks = []
        self.peak_gathered = 0
        self._next: dict[int, GatherUnit] = {}
        self._previous: dict[int, GatherUnit] = {}
        for sid, ls in local.items():
            members = len(groups.weight_group_devices(sid))  # its DP ranks (with node-local shards: on this node)
            if members == 1 or ls.frozen_keys:  # frozen weights stay whole in the operator (runtime/frozen.py)
                continue
            group = groups.weight_group(sid)  # a group for these gathers alone
            index = dist.get_rank(group)
            modules = ls.op.unit_modules() if hasattr(ls.op, "unit_modules") else {}
            by_unit = _unit_params(ls, modules, key_unit, device)
            if by_unit is None:
                mixed = sorted(aligned & set(ls.units))
                if mixed:
                    raise RuntimeError(f"ZeRO-3: slice '{sid}' cannot tell its units' parameters apart, but the "
                                       f"plan keeps {mixed} sharded as their masters are")
                units = [GatherUnit(sid, list(ls.op.parameters()), group, members, index)]
                hooked = [(ls.op, units[0])]
                self.whole.add(sid)
            else:
                units = [GatherUnit(u, [p for _, p in kps], group, members, index,
                                    unit=u if u in aligned else None, keys=[k for k, _ in kps])
                         for u, kps in by_unit.items() if kps]
                hooked = [(modules.get(g.name, ls.op), g) for g in units]
            for module, g in hooked:
                self._hook(module, g)
            for g in units:
                g.reshard()
                if g.unit is not None and not torch.equal(g.shard, masters[g.unit].detach().to(g.shard.dtype)):
                    raise RuntimeError(f"ZeRO-3: unit '{g.unit}' of slice '{sid}' is not laid out as its master "
                                       f"(a permuted or TP-sharded layout); the plan keeps it sharded as its "
                                       f"master is")
            self.units[sid] = units
            for before, after in zip(units, units[1:]):  # forward order: a unit prefetches the next one's weights
                self._next[id(before)], self._previous[id(after)] = after, before

    def _hook(self, module: torch.nn.Module, unit: GatherUnit) -> None:
        unit.module = module
        self._hooks.append(module.register_forward_pre_hook(lambda _m, _a: self._gather(
            unit, None if _in_backward() else self._next)))  # recomputing: the backward's own order follows
        self._hooks.append(module.register_forward_hook(partial(self._after_forward, unit)))
        for p in unit.params:
            self._hooks.append(p.register_post_accumulate_grad_hook(partial(self._accumulated, unit)))

    @property
    def gathered_bytes(self) -> int:
        """Bytes of weights this rank holds gathered now."""
        return sum(u.full_bytes for units in self.units.values() for u in units if u.gathered)

    def _gather(self, unit: GatherUnit, ahead: dict[int, GatherUnit] | None = None) -> None:
        """Gather the unit; with ``ahead`` (forward: the next unit, backward: the previous one), issue that one's
        gather too, so that it runs beside this unit's compute (the prefetch the cost model charges)."""
        if not unit.gathered:
            unit.gather()
            self.peak_gathered = max(self.peak_gathered, self.gathered_bytes)
        following = ahead.get(id(unit)) if ahead is not None else None
        if following is not None:
            following.prefetch()

    def _after_forward(self, unit: GatherUnit, _module, _args, output) -> None:
        if torch.is_grad_enabled():
            unit.pending = {p for p in unit.params if p.requires_grad}
        if _in_backward():  # recomputed inside a backward: its backward follows on these weights
            return
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda _g: self._gather(unit, self._previous))
        unit.free()

    def _accumulated(self, unit: GatherUnit, param: torch.nn.Parameter) -> None:
        unit.pending.discard(param)
        if not unit.pending:
            unit.free()

    def after_backward(self, ls: LocalSlice) -> None:
        """After the slice's backward: nothing of it stays gathered."""
        for u in self.units.get(ls.slice.id, ()):
            u.pending.clear()
            u.settle()
            u.free()

    def update_from_masters(self, masters: dict[str, torch.Tensor]) -> None:
        """After the optimizer step: every aligned unit's weight shard from its updated master shard."""
        for units in self.units.values():
            for u in units:
                if u.unit is not None:
                    u.settle()
                    u.free()
                    u.shard.copy_(masters[u.unit].detach())

    @contextmanager
    def loading(self, ls: LocalSlice, aligned_too: bool = True, unit: str | None = None):
        """Around writing full weights into the slice's operator (after the optimizer step: the units that are
        not aligned, ``aligned_too=False``, one ``unit`` at a time; a checkpoint load: all): the parameters at
        full size inside, this rank's shards of what was written kept afterwards. ``unit`` needs a slice
        gathered unit by unit (not in ``whole``: materialising a part of one gather unit would lose the rest)."""
        if unit is not None and ls.slice.id in self.whole:
            raise ValueError(f"ZeRO-3: slice '{ls.slice.id}' is gathered whole, not unit '{unit}' alone")
        units = [u for u in self.units.get(ls.slice.id, ())
                 if (aligned_too or u.unit is None) and (unit is None or u.name == unit)]
        for u in units:
            u.settle()
            u.materialize()
        self.peak_gathered = max(self.peak_gathered, self.gathered_bytes)
        yield
        for u in units:
            u.reshard()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
