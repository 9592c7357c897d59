"""Gradient and weight bytes per device and step: what the simulator charges against what the runtime's layout
moves, for a plan (made here, as tools/plan.py makes it, or given). Prints a table; writes it to --out-dir.

Derived, not measured (no GPU): the simulator's side is its own buckets (simulator/grad_sync.py); the runtime's
side follows the sets of units the runtime reduces together (plan/tp_shards.py ``runtime_groups``, which
runtime/engine.py builds its buffers on), in the runtime's buffers' dtype (fp32, or bf16 with the plan's
grad_reduce_dtype: runtime/grad_buffers.py ``GRAD_DTYPES``):

- whole units (``settings.tp_sharded_grads`` False, or a group of degree 1): every unit reduced whole over all
  of its group's devices;
- by TP shard: each of a unit's TP shards (1/t of it, counted here as 1/t of all of its parameters) over the ring
  of devices holding it; its replicated tensors (norms, biases: not counted) stay whole over the group;
- weights after the step: the groups plan/buckets.py ``regathered_groups`` names, gathered in bf16 over the same
  sets; at ZeRO-3 redistributed instead, each device receiving what its slices keep (plan/buckets.py
  ``redistributed_params``), where the simulator charges every member what the busiest one receives.

The simulator times each shard on the rings plan/tp_shards.py ``group_rings`` names. Where a device holds a
unit at different TP ranks in different slices it reduces that unit's shards on several rings; the simulator
then charges every member what that busiest device moves, so its side is the larger one here. Plans are
assembled with their TP ranks ordered so that this does not happen where any order allows it (plan/tp_shards.py
``aligned_device_orders``).

Bytes are nccl-tests bus bytes (all-reduce 2(n-1)/n of the buffer, all-gather, reduce-scatter and all-to-all
(n-1)/n), per gradient reduction round (ZeRO-2 and 3 reduce once per micro-batch, both sides alike).

    python benchmarks/comm_bytes.py                                   # qwen-val / 32 and qwen-val-70b / 256
    python benchmarks/comm_bytes.py --cells clip-10:16 --planner cpsat
    python benchmarks/comm_bytes.py --plan plan.json --workload qwen-val
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from bench_output import Recording, add_output_args, cell, plan_cell

from megatron_spindle.estimator import AnalyticCostModel
from megatron_spindle.estimator.comm_model import bus_factor
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.plan.buckets import redistributed_params, regathered_groups, unit_holders
from megatron_spindle.plan.schema import Plan
from megatron_spindle.plan.tp_shards import base_unit, runtime_groups, unit_rings
from megatron_spindle.planner.pipeline import PLANNERS
from megatron_spindle.runtime.grad_buffers import GRAD_DTYPES
from megatron_spindle.simulator.grad_sync import group_infos, param_gathers, plan_buckets

DEFAULT_CELLS = (("qwen-val", 32), ("qwen-val-70b", 256))
RUNTIME_WEIGHT_BYTES = 2  # the weights' all-gather in the model's dtype (bf16 on GPUs)
GB = 1e9


def runtime_sets(plan: Plan, metaops, param_count) -> list[tuple[tuple[int, ...], float, bool]]:
    """(devices, parameters, gathered after the step) of every set of units the runtime reduces together."""
    waves = [w.slices for w in plan.waves]
    plan_groups = [(tuple(sorted(g.devices)), list(g.params)) for g in plan.param_groups]
    rings = unit_rings(waves, metaops, [units for _, units in plan_groups], plan.settings)
    again = regathered_groups(waves, metaops, plan_groups, plan.settings.zero_stage, plan.weight_scope)
    regathered = {u for (_, units), a in zip(plan_groups, again) if a for u in units}
    out = []
    for devices, units in runtime_groups(plan_groups, rings):
        params = sum(param_count(base_unit(u)) / rings[base_unit(u)].degree if u != base_unit(u)
                     else 0.0 if u in rings else param_count(u) for u in units)
        out.append((devices, params, any(base_unit(u) in regathered for u in units)))
    return out


def plan_bytes(plan: Plan, workload) -> dict:
    """Per device (bytes): the simulator's and the runtime's gradient reduction and weight gather after the step;
    the busiest device's row, the maxima and the sums over the devices."""
    cluster = ClusterSpec.from_dict(plan.cluster)
    metagraph, cost = build_metagraph(workload), AnalyticCostModel(workload, cluster)
    groups = group_infos(plan, metagraph.metaops, cost.param_count, cluster)
    holders = unit_holders([w.slices for w in plan.waves], metagraph.metaops)
    sums = {k: Counter() for k in ("model_grad", "runtime_grad", "model_weights", "runtime_weights")}
    gathering = set(param_gathers(plan, groups, metagraph.metaops))
    for b in plan_buckets(plan, metagraph.metaops, cost.param_count, groups):
        for d in b.devices:
            sums["model_grad"][d] += bus_factor(b.op, b.ring.size) * b.nbytes
            if b.group in gathering:
                sums["model_weights"][d] += bus_factor(b.weight_op, b.ring.size) * b.weight_bytes
    op = "all_reduce" if plan.settings.zero_stage == 0 else "reduce_scatter"
    grad_bytes = GRAD_DTYPES[plan.settings.grad_reduce_dtype].itemsize  # the runtime's buffers
    zero3 = plan.settings.zero_stage == 3
    for devices, params, regathered in runtime_sets(plan, metagraph.metaops, cost.param_count):
        for d in devices:
            sums["runtime_grad"][d] += bus_factor(op, len(devices)) * params * grad_bytes
            if regathered and not zero3:
                sums["runtime_weights"][d] += bus_factor("all_gather", len(devices)) * params * RUNTIME_WEIGHT_BYTES
    for gi in gathering if zero3 else ():  # each device receives what its slices keep (weight_redistribution.py)
        g = groups[gi]
        for d, params in redistributed_params(holders, g.units, g.tp, cost.param_count, plan.weight_scope).items():
            sums["runtime_weights"][d] += bus_factor("all_to_all", g.ring.size) * params * RUNTIME_WEIGHT_BYTES
    runtime_total = Counter()
    for k in ("runtime_grad", "runtime_weights"):
        runtime_total.update(sums[k])
    busiest = max(range(plan.num_devices), key=lambda d: runtime_total[d])
    return {"zero_stage": plan.settings.zero_stage, "busiest_device": busiest,
            "busiest": {k: v[busiest] for k, v in sums.items()},
            "max": {k: max(v.values(), default=0.0) for k, v in sums.items()},
            "total": {k: sum(v.values()) for k, v in sums.items()},
            "tp_degrees": sorted({s.tp for w in plan.waves for s in w.slices})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", nargs="+", type=cell, default=None, help="WORKLOAD:GPUS ... (default: %s)" % " ".join(
        f"{w}:{n}" for w, n in DEFAULT_CELLS))
    parser.add_argument("--planner", choices=PLANNERS, default="wavefront")
    parser.add_argument("--plan", type=Path, default=None, help="a plan JSON (tools/plan.py --out) instead of cells")
    parser.add_argument("--workload", default=None, help="the plan's workload (with --plan)")
    add_output_args(parser)
    args = parser.parse_args(argv)
    if (args.plan is None) != (args.workload is None):
        parser.error("--plan and --workload go together")
    if args.plan is not None and args.cells:
        parser.error("give --plan or --cells, not both")
    if args.plan is not None:
        try:
            plans = [(args.workload, Plan.from_dict(json.loads(args.plan.read_text())))]
        except (OSError, ValueError, KeyError) as e:
            parser.error(f"--plan {args.plan}: {e}")
    else:
        plans = [(name, plan_cell(name, gpus, args.planner)) for name, gpus in args.cells or DEFAULT_CELLS]
    record = Recording(args, "comm_bytes")
    print("GB per gradient round (nccl-tests bus bytes), the runtime's busiest device and all devices together: "
          "simulator charges | runtime's layout moves")
    print(f"{'workload':<14}{'GPUs':>5}{'ZeRO':>5}  {'TP':<10}{'grad sync':>19}{'weight gather':>19}"
          f"{'all: grad sync':>24}{'weight gather':>22}")
    rows = []
    for name, plan in plans:
        row = {"workload": name, "gpus": plan.num_devices, **plan_bytes(plan, load_workload(name))}
        rows.append(row)
        b, t = row["busiest"], row["total"]
        print(f"{name:<14}{plan.num_devices:>5}{row['zero_stage']:>5}  {','.join(map(str, row['tp_degrees'])):<10}"
              f"{b['model_grad'] / GB:>9.1f} | {b['runtime_grad'] / GB:>6.1f}"
              f"{b['model_weights'] / GB:>9.1f} | {b['runtime_weights'] / GB:>6.1f}"
              f"{t['model_grad'] / GB:>14.0f} | {t['runtime_grad'] / GB:>7.0f}"
              f"{t['model_weights'] / GB:>12.0f} | {t['runtime_weights'] / GB:>7.0f}")
    record.save(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
