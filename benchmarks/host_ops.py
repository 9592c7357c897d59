#!/usr/bin/env python
"""Host operations per training step: what the runtime dispatches beside its model's own (issue 13).

On a GPU the small towers are host-bound (the twenty-ninth session's H200 breakdown: 3.5-4.7 ms per layer where
the model has 1.6): every ATen operation costs the host 5-60 us whatever its size, and per-tensor copies in
the runtime add up. The number of operations does not depend on the device, so this counts them on the CPU:
a torch dispatch mode sees every operation one ``RuntimeEngine.train_step`` dispatches (the forward, autograd's
backward, gradient sync and the optimizer) and attributes each to whoever asked for it:

- the model: megatron-core's modules and our operators (``megatron_spindle/models``), forward and backward;
- the runtime: the innermost frame in ``megatron_spindle/runtime`` (gradient buffers, shards, optimizer, ...).

A plain PyTorch step of the same modules (``models.reference.ReferenceModel``, the loss's backward, torch
AdamW) is counted the same way. Views (no kernel) are counted apart from the operations that launch work.
The runtime is counted in fp32 (units alias their masters: the CPU path) and in bf16 (units copy to and from
fp32 masters: the GPU path), and in bf16 at ZeRO-1 and ZeRO-3 (the sharded runtime: gradient staging rows, weight
gathers and loads). ``--two-ranks`` also counts, on two gloo processes, the layouts one rank cannot have: TP 2
(each tower's group reduced by TP shard, or in whole units beside TP-1 slices) and ZeRO-3's per-layer gathers. On
the CPU, AdamW runs a loop per master tensor; CUDA's fused AdamW is one operation per parameter group, so the
"optimizer" rows overstate a GPU's.

With ``--device cuda`` (benchmarks/gpu_breakdown.sh) the steps run on the GPU; the timed steps' milliseconds
over the operations then give the host's time per operation where the step is host-bound. Every step's batches
are made before the steps run (``made_before``): making CLIP-4's mock batches on the host took most of a timed step
on the fortieth session's H100 (341-382 ms per step of one task whose waves take about 80 ms in training).

Printed, not asserted, written (host_ops.txt, .json) to --out-dir. Example:
    python benchmarks/host_ops.py --workload tiny-clip [--two-ranks]
    python benchmarks/host_ops.py --workload clip-4 --global-batch-size 128 --device cuda
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
from bench_output import Recording, add_output_args
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_spindle.arguments import add_batch_args, add_workload_args, workload_from_args

PACKAGE = "megatron_spindle/"
SCHEDULE_MODEL_CALLS = ("_forward_slice", "_backward_slice")  # runtime/schedule.py: the operators' forward, backward
THIS_FILE = __file__.replace("\\", "/")  # the plain loop's backward


def who(stack: traceback.StackSummary) -> str:
    """The one who asked for an operation, from the innermost frame that says: "optimizer" (torch's AdamW);
    "model" (megatron-core, or a forward or backward the runtime's schedule or the plain loop runs); else
    "runtime <file>:<function>" (our models' and data's helpers count for whoever called them: loading
    weights and exporting gradients are the runtime's)."""
    for frame in reversed(stack):
        path = frame.filename.replace("\\", "/")
        if "torch/optim/" in path:
            return "optimizer"
        if "megatron/core/" in path or path == THIS_FILE:
            return "model"
        if PACKAGE + "runtime/" in path:
            if frame.name in SCHEDULE_MODEL_CALLS:
                return "model"
            return f"runtime {path.split(PACKAGE, 1)[1]}:{frame.name}"
    return "other"


class OperationCounter(TorchDispatchMode):
    """Counts every operation dispatched inside it: (who, view or not) -> count, and per operation name."""

    def __init__(self):
        super().__init__()
        self.by_caller: collections.Counter = collections.Counter()
        self.by_name: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        caller = who(traceback.extract_stack(limit=48)[:-1])
        view = bool(getattr(func, "is_view", False)) or func.overloadpacket.__name__ in ("detach", "_unsafe_view")
        self.by_caller[caller, view] += 1
        self.by_name[func.overloadpacket.__name__, caller.split(" ")[0]] += 1
        return func(*args, **(kwargs or {}))

    def totals(self) -> dict[str, int]:
        out = collections.Counter()
        for (caller, view), n in self.by_caller.items():
            group = caller.split(" ")[0]
            out[group + (" views" if view else "")] += n
        return dict(out)


@dataclass
class Counted:
    """One training step's operations (``counter``) and the median seconds of ``timed`` uncounted steps."""

    counter: OperationCounter
    seconds: float


def count_steps(step, warmup: int, timed: int, device: str) -> Counted:
    """``warmup`` steps, one counted, then ``timed`` timed ones (the device synchronised around each)."""
    for i in range(warmup):
        step(i)
    counter = OperationCounter()
    with counter:
        step(warmup)
    seconds = []
    for i in range(timed):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(warmup + 1 + i)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    return Counted(counter, statistics.median(seconds) if seconds else float("nan"))


def made_before(batch_fn, workload, steps: int, seed: int) -> Callable:
    """``batch_fn``'s batches of steps 0 .. ``steps`` - 1 (every task), made now; returns a ``batch_fn`` that hands
    them out, so that the counted and timed steps are the training step alone."""
    made = {(t.name, step): batch_fn(workload, t.name, step, seed) for step in range(steps) for t in workload.tasks}
    return lambda _workload, task, step, _seed: made[task, step]


def count_engine(workload, dtype: torch.dtype, warmup: int, timed: int = 0, device: str = "cpu",
                 zero_stage: int = 0) -> Counted:
    """The runtime's step on a plan for one device (its waves one after another), at ``zero_stage`` (one device
    holds whole shards, but the sharded runtime's staging rows, gathers and weight loads run as on many)."""
    from megatron_spindle.graph.cluster import make_cluster
    from megatron_spindle.planner.pipeline import PlannerConfig, make_plan
    from megatron_spindle.runtime.engine import EngineConfig, RuntimeEngine

    plan = at_zero_stage(make_plan(workload, make_cluster(1, 1, "CPU"), PlannerConfig(planner="wavefront")),
                         zero_stage)
    engine = RuntimeEngine(plan, workload, 0, 1, EngineConfig(dtype=dtype, device=device))
    engine.batch_fn = made_before(engine.batch_fn, workload, warmup + 1 + timed, engine.config.data_seed)
    return count_steps(engine.train_step, warmup, timed, device)


def at_zero_stage(plan, stage: int):
    """The plan at ZeRO ``stage``, with the weight gather overlapped at 1 and 2 as the planner's plans run."""
    import dataclasses

    plan.settings = dataclasses.replace(plan.settings, zero_stage=stage, overlap_param_gather=stage in (1, 2))
    return plan


TWO_RANK_ROWS = (  # (layout, ZeRO stage) counted on two gloo ranks
    ("towers at TP 2, reduced by TP shard", 0), ("towers at TP 2, reduced by TP shard", 1),
    ("towers at TP 2, in whole-unit groups", 0), ("towers at TP 2, in whole-unit groups", 1),
    ("every MetaOp on both ranks at TP 1", 3))


def two_rank_layouts(workload) -> dict:
    """layout -> a plan for two CPU devices (planner/explicit.py): the layer MetaOps at TP 2 on both devices, the
    light ones on one device (so each tower's parameter group holds TP-2 slices only: reduced by TP shard) or on
    both at TP 1 (so the groups mix TP 2 and TP 1: whole units); every MetaOp on both devices at TP 1."""
    from megatron_spindle.estimator import valid_configs
    from megatron_spindle.graph.cluster import make_cluster
    from megatron_spindle.graph.opgraph import build_metagraph
    from megatron_spindle.planner.explicit import plan_from_slices

    g, cluster = build_metagraph(workload), make_cluster(2, 2, "CPU")

    def tp2(mid: str) -> bool:
        return g.metaops[mid].kind == "layer" and (2, 1) in valid_configs(g.metaops[mid], workload, cluster)

    def waves(light: Callable[[int], list[int]], tp: int) -> list:
        """One wave per MetaOp: a layer MetaOp at ``tp`` on both devices where it can be, else at TP 1 on
        ``light(its level)``."""
        layers = lambda mid: g.metaops[mid].num_layers  # noqa: E731
        return [[(mid, 0, layers(mid), [0, 1], tp) if tp > 1 and tp2(mid) else (mid, 0, layers(mid), light(li), 1)]
                for li, level in enumerate(g.levels) for mid in level]

    return {TWO_RANK_ROWS[0][0]: plan_from_slices(workload, cluster, waves(lambda li: [0] if li == 0 else [1], 2)),
            TWO_RANK_ROWS[2][0]: plan_from_slices(workload, cluster, waves(lambda li: [0, 1], 2)),
            TWO_RANK_ROWS[4][0]: plan_from_slices(workload, cluster, waves(lambda li: [0, 1], 1))}


def _two_rank_worker(rank: int, workload, warmup: int, store: str, out: str) -> None:
    import json

    import torch.distributed as dist

    from megatron_spindle.compat.cpu import apply_cpu_shim
    from megatron_spindle.runtime.engine import EngineConfig, RuntimeEngine

    apply_cpu_shim()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    plans, rows = two_rank_layouts(workload), {}
    for layout, stage in TWO_RANK_ROWS:
        engine = RuntimeEngine(at_zero_stage(plans[layout], stage), workload, rank, 2,
                               EngineConfig(dtype=torch.bfloat16, device="cpu"))
        rows[f"{layout}, ZeRO-{stage}"] = count_steps(engine.train_step, warmup, 0, "cpu").counter.totals()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def count_two_ranks(workload, warmup: int) -> dict[str, dict[str, int]]:
    """The busier rank's operations of one bf16 step under each of ``TWO_RANK_ROWS`` (two gloo processes): the one
    with more runtime operations, which paces the TP group (``rank`` says which)."""
    import json
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/rows.json"
        mp.spawn(_two_rank_worker, args=(workload, warmup, f"{tmp}/store", out), nprocs=2)
        ranks = []
        for rank in range(2):
            with open(f"{out}.{rank}") as f:
                ranks.append(json.load(f))
    busier = {}
    for layout in ranks[0]:
        rank = max(range(2), key=lambda r: (ranks[r][layout].get("runtime", 0), -r))
        busier[layout] = {**ranks[rank][layout], "rank": rank}
    return busier


def count_plain(workload, warmup: int, timed: int = 0, device: str = "cpu") -> tuple[Counted, int]:
    """A plain fp32 PyTorch step of the same modules: the summed task losses' backward, torch AdamW."""
    from megatron_spindle.data.mock import mock_batch
    from megatron_spindle.models.reference import ReferenceModel

    model = ReferenceModel(workload).to(device)
    params = list(dict.fromkeys(model.full_named_parameters().values()))
    optimizer = torch.optim.AdamW(params)
    batch_fn = made_before(lambda w, t, step, seed: mock_batch(w, t, step, seed).to(device), workload,
                           warmup + 1 + timed, 0)

    def step(i: int) -> None:
        batches = {t.name: batch_fn(workload, t.name, i, 0) for t in workload.tasks}
        optimizer.zero_grad(set_to_none=True)
        model.total_loss(model(batches)).backward()
        optimizer.step()

    return count_steps(step, warmup, timed, device), len(params)


def table(rows: list[tuple[str, dict[str, int], float]], tensors: int, width: int = 28) -> str:
    """A row per step: operations by who asked, in all, the runtime's per parameter tensor, and (timed steps) ms
    per step and us per operation (on a host-bound device, the host's time per operation)."""
    cols = ("model", "model views", "optimizer", "runtime", "runtime views")
    lines = [f"{'step':{width}s}" + "".join(f"{c:>15s}" for c in cols)
             + f"{'total':>9s}{'runtime/tensor':>16s}{'ms/step':>10s}{'us/op':>8s}"]
    for name, t, seconds in rows:
        runtime = t.get("runtime", 0) + t.get("runtime views", 0)
        t = {**t, "optimizer": t.get("optimizer", 0) + t.pop("optimizer views", 0)}
        total = sum(t.values())
        timing = f"{seconds * 1e3:10.1f}{seconds * 1e6 / total:8.1f}" if seconds == seconds else ""
        lines.append(f"{name:{width}s}" + "".join(f"{t.get(c, 0):15d}" for c in cols)
                     + f"{total:9d}{runtime / tensors:16.1f}" + timing)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(parser)
    add_batch_args(parser)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the counted one")
    parser.add_argument("--timed-steps", type=int, default=3, help="uncounted steps timed after it (the median)")
    parser.add_argument("--top", type=int, default=12, help="the runtime's functions listed (most operations first)")
    parser.add_argument("--two-ranks", action="store_true",
                        help="also count a bf16 step on two gloo processes in the layouts one rank has not: TP 2 "
                             "(by TP shard and in whole units) and ZeRO-3's gathers (CPU only)")
    add_output_args(parser)
    args = parser.parse_args(argv)
    from megatron_spindle.compat.cpu import apply_cpu_shim
    from megatron_spindle.compat.groups import ensure_torch_distributed

    if args.two_ranks and args.device != "cpu":
        print("host_ops: --two-ranks counts on CPU processes (gloo); leave out --device cuda", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("host_ops: CUDA is not available (use --device cpu)", file=sys.stderr)
        return 2
    workload = workload_from_args(args)
    if args.device == "cpu":
        apply_cpu_shim()
        torch.set_num_threads(1)
    ensure_torch_distributed()
    recording = Recording(args, "host_ops")
    start = time.perf_counter()
    steps = (args.warmup, args.timed_steps, args.device)
    plain, tensors = count_plain(workload, *steps)
    counted = {"plain PyTorch (fp32)": plain}
    for dtype in (torch.float32, torch.bfloat16):
        counted[f"runtime ({str(dtype).split('.')[-1]})"] = count_engine(workload, dtype, *steps)
    for stage in (1, 3):  # the sharded runtime (ZeRO-2 runs as ZeRO-1 on one micro-batch)
        counted[f"runtime (bfloat16, ZeRO-{stage})"] = count_engine(workload, torch.bfloat16, *steps, zero_stage=stage)
    print(f"host_ops: operations dispatched in one training step of {args.workload} on one rank "
          f"({tensors} parameter tensors), device {args.device}, torch {torch.__version__}")
    rows = [(name, c.counter.totals(), c.seconds) for name, c in counted.items()]
    print(table(rows, tensors))
    bf16 = counted["runtime (bfloat16)"].counter
    print("\nthe runtime's own operations in bf16, by function (views included):")
    per_function = collections.Counter()
    for (caller, _), n in bf16.by_caller.items():
        if caller.startswith("runtime"):
            per_function[caller.split(" ", 1)[1]] += n
    for name, n in per_function.most_common(args.top):
        print(f"{n:8d}  {name}")
    two = {}
    if args.two_ranks:
        two = count_two_ranks(workload, args.warmup)
        print("\ntwo gloo ranks, bf16, the busier rank's operations in one step (layouts one rank has not):")
        print(table([(f"{name} (rank {totals['rank']})", {k: v for k, v in totals.items() if k != "rank"},
                      float("nan")) for name, totals in two.items()], tensors, width=54))
    print(f"({time.perf_counter() - start:.0f} s)")
    recording.save({"workload": args.workload, "device": args.device, "parameter_tensors": tensors,
                    "steps": {name: t for name, t, _ in rows},
                    "seconds_per_step": {name: seconds for name, _, seconds in rows},
                    "runtime_bf16_by_function": dict(per_function), "two_ranks": two})
    return 0


if __name__ == "__main__":
    sys.exit(main())
