"""Plan JSON: save (atomic), load, and version-1 files converted to version 2 on load.

Version 1 kept the execution settings in the untyped ``planner`` dict (``recompute``: bool, ``zero_stage``,
``segments``), had no backward bytes per transfer and counted a parameter group's bytes as its bf16 weights.
Loading converts losslessly what it had: the settings become typed, transfers are routed again by
``plan/routing.py`` (forward and backward), and group bytes become the fp32 gradient all-reduce volume.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from megatron_spindle.fileio import write_text_atomic
from megatron_spindle.plan.routing import Router
from megatron_spindle.plan.schema import (
    PLAN_FORMAT,
    SCHEMA_VERSION,
    ExecutionSettings,
    LevelInfo,
    MetaOpInfo,
    ParamGroup,
    Plan,
    PlanError,
    Recompute,
    Slice,
    Transfer,
    Wave,
)

V1_WEIGHT_BYTES_PER_PARAM = 2  # what version 1 wrote into ParamGroup.bytes per parameter
REPLAN_HINT = "replan with: python tools/plan.py --workload NAME --num-gpus N --out plan.json"


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    d = asdict(plan)
    d["settings"] = plan.settings.to_dict()
    for m in d["metaops"]:  # left out at its default, as plans were written before frozen modules
        if m["backward"] == "full":
            del m["backward"]
    return {"format": PLAN_FORMAT, "schema_version": d.pop("schema_version"), **d}


def plan_from_dict(d: dict[str, Any]) -> Plan:
    if not isinstance(d, dict) or d.get("format") != PLAN_FORMAT:
        raise PlanError(f"not a megatron-spindle plan (format={d.get('format') if isinstance(d, dict) else None!r})")
    version = d.get("schema_version")
    if version == 1:
        return _from_v1(d)
    if version != SCHEMA_VERSION:
        raise PlanError(f"plan schema version {version!r} is not supported (this version reads 1 and "
                        f"{SCHEMA_VERSION}); {REPLAN_HINT}")
    d = dict(d)
    d.pop("format")
    try:
        return _build(d, ExecutionSettings.from_dict(d.pop("settings")))
    except (TypeError, KeyError, AttributeError) as e:
        raise PlanError(f"malformed plan: {e}") from e


def save_plan(plan: Plan, path: str | Path) -> None:
    """Atomic write: a temporary file in the same folder, then rename."""
    write_text_atomic(path, json.dumps(plan_to_dict(plan), indent=1))


def load_plan(path: str | Path) -> Plan:
    try:
        with open(path) as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"{path}: not valid JSON: {e}") from e
    try:
        return plan_from_dict(d)
    except PlanError as e:
        raise PlanError(f"{path}: {e}") from None


def _build(d: dict[str, Any], settings: ExecutionSettings) -> Plan:
    waves = [Wave(**{**w, "slices": [Slice(**s) for s in w["slices"]]}) for w in d.pop("waves")]
    return Plan(
        waves=waves,
        metaops=[MetaOpInfo(**m) for m in d.pop("metaops")],
        levels=[LevelInfo(**lv) for lv in d.pop("levels")],
        transfers=[Transfer(**t) for t in d.pop("transfers")],
        param_groups=[ParamGroup(**g) for g in d.pop("param_groups")],
        settings=settings,
        **d,
    )


def _from_v1(d: dict[str, Any]) -> Plan:
    d = dict(d)
    d.pop("format")
    d["schema_version"] = SCHEMA_VERSION
    planner = dict(d.get("planner") or {})
    try:
        settings = ExecutionSettings(recompute=Recompute("full" if planner.pop("recompute", False) else "none"),
                                     zero_stage=int(planner.pop("zero_stage", 0) or 0),
                                     segments=planner.pop("segments", None))
        d["planner"] = planner
        for g in d["param_groups"]:
            g["bytes"] = g.get("bytes", 0.0) / V1_WEIGHT_BYTES_PER_PARAM * settings.grad_reduce_bytes
        d["transfers"] = [{k: v for k, v in t.items() if k != "bytes_by_kind"} for t in d["transfers"]]
        plan = _build(d, settings)
    except (TypeError, KeyError, AttributeError, ValueError) as e:
        raise PlanError(f"malformed version-1 plan ({e}); {REPLAN_HINT}") from e
    _reroute(plan)
    return plan


def _reroute(plan: Plan) -> None:
    """Route every transfer again (version 1 recorded the forward bytes of an older routing rule)."""
    slices = {s.id: s for s in plan.slices()}
    batch = {m.id: int(m.input_shape[0]) for m in plan.metaops}
    router = Router(plan.gpus_per_node)
    for i, t in enumerate(plan.transfers):
        p, c = slices.get(t.producer), slices.get(t.consumer)
        if p is None or c is None:
            raise PlanError(f"transfer {t.producer} -> {t.consumer}: no such slice; {REPLAN_HINT}")
        plan.transfers[i] = router.transfer(t.producer, t.consumer, p, c, batch[p.metaop], t.bytes)
