"""Raw samples each rank decodes per iteration: every rank reading the whole global batch of each task it runs a
slice of (what the data loader did before the thirty-sixth session), against the rows and fields its slices read
(runtime/layout.py ``batch_needs``, what it reads now), for a plan made here as tools/plan.py makes it.

A sample's field is counted once per rank that decodes it. The CPU seconds are those counts times the time this
machine takes to decode one sample of each field with the data loader's default preprocessing
(data/datasets.py ``decode_field``: a 256 x 256 JPEG resized to the front end's side, a WAV turned into the
front end's log-mel frames, a .npy window, UTF-8 text through the byte tokenizer), measured here, one thread.
Real images are often larger than 256 px, so the seconds are a floor. The plan's predicted iteration time is
beside them: a rank's data workers have that long, per iteration, to prepare the next one's batches. The third
figure is the own rows and fields read from the arrays ``tools/build_multitask_dataset.py --store-decoded``
stores.

    python benchmarks/data_reads.py                          # clip-10 / 32, ofasys-7 / 32, qwen-val / 32
    python benchmarks/data_reads.py --cells clip-4:8 --planner cpsat
"""

from __future__ import annotations

import argparse
import io
import sys
import time
import wave

import numpy as np
from bench_output import Recording, add_output_args, cell, plan_cell

from megatron_spindle.data.datasets import decode_field, task_fields
from megatron_spindle.data.decode import encode_npy
from megatron_spindle.graph.workload import Workload, load_workload
from megatron_spindle.models.operator import batch_fields
from megatron_spindle.plan.schema import Plan
from megatron_spindle.planner.pipeline import PLANNERS
from megatron_spindle.runtime.layout import batch_needs

DEFAULT_CELLS = (("clip-10", 32), ("ofasys-7", 32), ("qwen-val", 32))
REPEATS = 20


def raw_sample(field) -> tuple[str, bytes]:
    """(extension, bytes) of a synthetic raw sample for a field of the task."""
    rng = np.random.default_rng(0)
    if field.type == "patch":
        from PIL import Image

        buf = io.BytesIO()
        channels = field.shape[0]
        arr = rng.integers(0, 256, (256, 256, 3) if channels == 3 else (256, 256), dtype=np.uint8)
        Image.fromarray(arr).save(buf, format="JPEG", quality=90)
        return "jpg", buf.getvalue()
    if field.type == "audio":
        n_fft = 1 << max(4, int(np.ceil(np.log2(4 * field.shape[0]))))
        samples = field.shape[1] * n_fft // 2  # the log-mel's hop: as many frames as the front end takes
        buf = io.BytesIO()
        with wave.open(buf, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(16000)
            w.writeframes((rng.standard_normal(samples) * 3000).astype("<i2").tobytes())
        return "wav", buf.getvalue()
    if field.type == "imu":
        buf = io.BytesIO()
        np.save(buf, rng.standard_normal(field.shape).astype(np.float32))
        return "npy", buf.getvalue()
    return "txt", b"a photo of " * (field.shape[0] // 11 + 1)


def decode_seconds(workload: Workload) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]]:
    """(task, field) -> seconds to decode one sample of it here (median of REPEATS): from the raw file, and from
    the .npy array ``tools/build_multitask_dataset.py --store-decoded`` stores instead."""
    import torch

    torch.set_num_threads(1)
    raw, stored = {}, {}
    for t in workload.tasks:
        for m, f in task_fields(workload, t.name).items():
            ext, data = raw_sample(f)
            array = encode_npy(decode_field(workload, f, ext, data))
            raw[t.name, m], stored[t.name, m] = (_median_seconds(workload, f, e, d) for e, d in ((ext, data),
                                                                                                 ("npy", array)))
    return raw, stored


def _median_seconds(workload: Workload, field, ext: str, data: bytes) -> float:
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        decode_field(workload, field, ext, data)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def rank_reads(plan: Plan, workload: Workload) -> list[tuple[dict, dict]]:
    """Per rank: ({(task, field): samples} read whole, {(task, field): samples} read as its slices need)."""
    infos = {m.id: m for m in plan.metaops}
    sizes = {t.name: t.batch_size for t in workload.tasks}
    out = []
    for rank in range(plan.num_devices):
        mine = [s for w in plan.waves for s in w.slices if rank in s.devices]
        whole = {(t, m): sizes[t] for t in {s.task for s in mine} for m in task_fields(workload, t)}
        needs = batch_needs([(s, batch_fields(workload, infos[s.metaop])) for s in mine], rank, sizes,
                            plan.settings.micro_batches)
        partial = {}
        for t, need in needs.items():
            for m, ranges in (need or {}).items():
                partial[t, m] = sizes[t] if ranges is None else sum(hi - lo for lo, hi in ranges)
        out.append((whole, partial))
    return out


def cell_row(name: str, gpus: int, planner: str) -> dict:
    """The numbers of one cell (the samples of a rank are sample-fields; seconds as the module says)."""
    workload = load_workload(name)
    plan = plan_cell(name, gpus, planner)
    cost, stored = decode_seconds(workload)
    ranks = {"whole": [], "own": [], "own_stored": []}
    for whole, own in rank_reads(plan, workload):
        for kind, reads, per in (("whole", whole, cost), ("own", own, cost), ("own_stored", own, stored)):
            ranks[kind].append((sum(reads.values()), sum(n * per[key] for key, n in reads.items())))
    return {"workload": name, "gpus": gpus, "iteration_s": plan.predicted["iteration_time"],
            "decode_s_per_sample": {f"{t}/{m}": s for (t, m), s in cost.items()},
            "stored_s_per_sample": {f"{t}/{m}": s for (t, m), s in stored.items()},
            "busiest": {k: max(v, key=lambda x: x[1]) for k, v in ranks.items()},
            "mean_seconds": {k: sum(s for _, s in v) / gpus for k, v in ranks.items()},
            "all_samples": {k: sum(n for n, _ in v) for k, v in ranks.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", nargs="+", type=cell, default=None,
                        help="WORKLOAD:GPUS ... (default: %s)" % " ".join(f"{w}:{n}" for w, n in DEFAULT_CELLS))
    parser.add_argument("--planner", choices=PLANNERS, default="wavefront")
    add_output_args(parser)
    args = parser.parse_args(argv)
    record = Recording(args, "data_reads")
    print("Samples decoded per iteration per rank (sample-fields) and their CPU seconds on this machine (one "
          "thread): whole batches | own rows and fields | own, stored decoded (--store-decoded)")
    print(f"{'workload':<10}{'GPUs':>5}{'iteration':>11}  {'busiest rank: samples':>24}{'seconds':>26}"
          f"{'mean rank: seconds':>28}{'all ranks: samples':>24}")
    rows = []
    for name, gpus in args.cells or DEFAULT_CELLS:
        row = cell_row(name, gpus, args.planner)
        rows.append(row)
        (nb, sb), (na, sa), (_, ss) = (row["busiest"][k] for k in ("whole", "own", "own_stored"))
        mean, total = row["mean_seconds"], row["all_samples"]
        print(f"{name:<10}{gpus:>5}{row['iteration_s']:>10.3f}s  {nb:>12} | {na:>8}{sb:>9.2f} | {sa:>5.2f} | "
              f"{ss:>5.2f}s{mean['whole']:>12.2f} | {mean['own']:>5.2f} | {mean['own_stored']:>5.2f}s"
              f"{total['whole']:>13} | {total['own']:>7}")
    record.save(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
