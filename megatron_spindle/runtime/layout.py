"""Pure-Python layout logic of the runtime (no torch.distributed): a device's place in a slice, the parameter
units of a slice, and the checks that must pass before any communication.

The rules themselves (rows of a DP rank, message routing, transfers and parameter device groups a plan
implies) are plan/'s (layout.py, routing.py, derive.py); this module applies them to the runtime's questions.
"""

from __future__ import annotations

from megatron_spindle.compat.cpu import uses_te_spec
from megatron_spindle.graph.opgraph import MetaGraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.plan import layout
from megatron_spindle.plan.derive import plan_slice_pairs
from megatron_spindle.plan.schema import RUNTIME_ZERO_STAGES, Plan, PlanError, Slice, Transfer
from megatron_spindle.plan.validate import check_plan_workload, validate_plan


def dp_rank(s: Slice, device: int) -> int:
    return s.devices.index(device) // s.tp


def tp_rank(s: Slice, device: int) -> int:
    return s.devices.index(device) % s.tp


def is_tp_leader(s: Slice, device: int) -> bool:
    return tp_rank(s, device) == 0


def local_rows(s: Slice, device: int, batch: int) -> tuple[int, int]:
    """Samples [start, end) the device holds in the slice."""
    return layout.position_rows(s.devices.index(device), s.tp, s.dp, batch)


def batch_needs(reads: list[tuple[Slice, dict[str, bool] | None]], device: int, batch_sizes: dict[str, int],
                micro_batches: int) -> dict[str, dict[str, list[tuple[int, int]] | None] | None]:
    """Per task the device runs a slice of: the raw fields of its batch the device reads, each with the rows
    ``[lo, hi)`` it reads (merged, ascending; None: every row), or None for the whole batch. ``reads``: each
    local slice with its operator's ``batch_fields()`` (field -> whether it reads every row; None: the
    operator does not say, so it gets the whole batch). A slice reads its DP rank's rows of every micro-batch."""
    needs: dict[str, dict[str, list[tuple[int, int]] | None] | None] = {}
    for s, fields in reads:
        if fields is None:
            needs[s.task] = None
        if needs.setdefault(s.task, {}) is None:
            continue
        need = needs[s.task]
        rows = layout.input_rows(s.devices.index(device), s.tp, s.dp, batch_sizes[s.task], micro_batches)
        for name, every in fields.items():
            if every or (name in need and need[name] is None):
                need[name] = None
            else:
                need[name] = _merged(need.get(name, []) + rows)
    return needs


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def slice_units(metagraph: MetaGraph, s: Slice) -> list[str]:
    """Parameter units the slice's operator holds: those of layers [layer_start, layer_end) of its MetaOp."""
    return layout.slice_units(metagraph.metaops[s.metaop], s.layer_start, s.layer_end)


def check_settings_runnable(plan: Plan) -> None:
    """The execution settings this runtime implements: every ZeRO stage in ``RUNTIME_ZERO_STAGES`` (gradients in
    either reduce dtype: grad_buffers.py ``GRAD_DTYPES``); every execution order, micro-batch count and
    recomputation choice validate_plan accepts (checked there)."""
    st = plan.settings
    if st.zero_stage not in RUNTIME_ZERO_STAGES:
        raise PlanError(f"zero_stage {st.zero_stage}: the runtime supports {list(RUNTIME_ZERO_STAGES)}")


def check_runnable(plan: Plan, workload: Workload, metagraph: MetaGraph, world_size: int) -> None:
    """Everything the runtime relies on, checked before any communication. Raises PlanError."""
    check_plan_workload(plan, workload)
    if plan.num_devices > world_size:  # fewer is fine: the other ranks only join the step's collectives
        raise PlanError(f"the plan is for {plan.num_devices} devices, the world size is {world_size}")
    for s in plan.slices():
        bad = [d for d in s.devices if not 0 <= d < world_size]
        if bad:
            raise PlanError(f"slice '{s.id}': devices {bad} are beyond the world size {world_size} "
                            f"(ranks 0..{world_size - 1})")
        m = metagraph.metaops.get(s.metaop)
        if m is None:
            raise PlanError(f"slice '{s.id}': MetaOp '{s.metaop}' does not exist in workload '{workload.name}'")
        if not 0 <= s.layer_start < s.layer_end <= m.num_layers:
            raise PlanError(f"slice '{s.id}': layer range [{s.layer_start}, {s.layer_end}) does not exist in "
                            f"MetaOp '{m.id}' of {m.num_layers} layers")
    for info in plan.metaops:
        m = metagraph.metaops.get(info.id)
        if m is None or m.num_layers != info.num_layers or list(m.input_shape) != list(info.input_shape):
            raise PlanError(f"plan MetaOp '{info.id}' does not match the workload's MetaOp graph")
    validate_plan(plan, workload=workload, metagraph=metagraph, check_memory=False)
    check_settings_runnable(plan)
    uses_te_spec(plan.settings.attention_backend)  # a TE backend on a machine without TE
    have = {(t.producer, t.consumer) for t in plan.transfers}
    need = plan_slice_pairs(plan)
    missing = [p for p in need if p not in have]
    if missing:
        raise PlanError(f"plan lacks the transfers {missing[:3]} (producer slice -> consumer slice)")
    extra = sorted(have - set(need))
    if extra:
        raise PlanError(f"plan has transfers {extra[:3]} that no data flow needs")
    expected = layout.unit_holders([w.slices for w in plan.waves], metagraph.metaops)
    listed: dict[str, list[int]] = {}
    for g in plan.param_groups:
        for u in g.params:
            if u in listed:
                raise PlanError(f"parameter '{u}' is listed in two parameter device groups")
            listed[u] = sorted(g.devices)
    for u, devs in expected.items():
        if listed.get(u) != devs:
            raise PlanError(f"parameter '{u}' is held by devices {devs} but the plan's param_groups "
                            f"give {listed[u] if u in listed else 'none'}")


def transfer_input_index(plan: Plan, t: Transfer) -> int:
    """Position of a transfer's tensor in the consumer operator's ``inputs``: a continuation of the same
    MetaOp is input 0; otherwise the producer MetaOp's position in the consumer MetaOp's ``preds``."""
    p, c = plan.slice(t.producer), plan.slice(t.consumer)
    if p.metaop == c.metaop:
        return 0
    return plan.metaop(c.metaop).preds.index(p.metaop)
