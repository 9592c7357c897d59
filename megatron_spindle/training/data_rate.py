"""Whether the data workers keep up with the plan. The planner does not charge host decoding (JPEG, log-mel,
tokenizing), and a plan may give a light front end, with its task's whole batch, to one or two devices: their
ranks then decode far more than the others (an audio front end of CLIP on one device decodes every audio sample
of the batch, 8.6 CPU-s per 0.57 s iteration from raw WAVs: benchmarks/data_reads.py). At start the trainer times
a few samples of each field a rank reads and says, for the busiest rank, how long its data threads need per
iteration against the plan's predicted iteration, with the remedy when they fall behind."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch.distributed as dist

from megatron_spindle.data.datasets import BatchNeed, BatchRead, TaskDataset
from megatron_spindle.graph.workload import Workload
from megatron_spindle.parallel import available_cpus

# samples timed per field: the first warms up (a tokenizer's first call, the file's first pages), the median of
# the others is kept
PROBE_SAMPLES = 4
# the data threads' time per iteration above which the log says they hold the steps back: prefetching hides them
# behind the step only while they take less than it, and they share the rank's cores with its host work
BEHIND_FRACTION = 0.5


@dataclass(frozen=True)
class FieldLoad:
    """One raw field a rank decodes each iteration: ``rows`` samples of ``seconds_per_sample`` each."""

    task: str
    field: str
    rows: int
    seconds_per_sample: float

    @property
    def seconds(self) -> float:
        return self.rows * self.seconds_per_sample

    def describe(self) -> str:
        return f"{self.task}/{self.field} {self.rows} x {self.seconds_per_sample * 1e3:.2f} ms"


def rank_decode_load(workload: Workload, datasets: dict[str, TaskDataset],
                     needs: dict[str, BatchNeed | None]) -> list[FieldLoad]:
    """The fields this rank decodes per iteration (``needs``: the engine's ``batch_needs``, tasks it reads
    nothing of left out), each with its rows and its decoding time, measured on the dataset's first samples."""
    loads = []
    for task in workload.tasks:
        if task.name not in needs:
            continue
        dataset = datasets[task.name]
        read = BatchRead(workload, task.name, dataset, range(task.batch_size), needs[task.name])
        for field, rows in read.field_rows.items():
            if rows:
                loads.append(FieldLoad(task.name, field, len(rows), _seconds_per_sample(dataset, field)))
    return loads


def _seconds_per_sample(dataset: TaskDataset, field: str) -> float:
    times = []
    for i in range(min(PROBE_SAMPLES, len(dataset))):
        t0 = time.perf_counter()
        dataset.get(i, (field,))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:] or times)


def data_threads(num_workers: int) -> int:
    """The threads that decode in parallel on a rank: ``--num-workers``, at most the rank's share of its node's
    cores (0: decoding runs inside the step)."""
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return min(num_workers, max(1, available_cpus() // ranks))


def decode_report(rank: int, loads: list[FieldLoad], num_workers: int, predicted_seconds: float) -> str:
    """The log line of the busiest rank (``rank``, with its ``loads``: ``busiest_rank``)."""
    cpu = sum(x.seconds for x in loads)
    threads = data_threads(num_workers)
    parts = ", ".join(x.describe() for x in sorted(loads, key=lambda x: -x.seconds)[:3])
    line = f"data: decoding takes the busiest rank ({rank}) {cpu:.2f} CPU-s per iteration ({parts or 'nothing'})"
    if threads == 0:
        line += f", inside the step (--num-workers 0); the plan predicts {predicted_seconds:.2f} s per iteration"
        wall = cpu
    else:
        wall = cpu / threads
        line += (f", about {wall:.2f} s on its {threads} data thread(s), against the plan's predicted "
                 f"{predicted_seconds:.2f} s iteration")
    if wall > BEHIND_FRACTION * predicted_seconds and loads:
        field = max(loads, key=lambda x: x.seconds).field
        line += (f": the data will hold the steps back. Store the field decoded (tools/build_multitask_dataset.py "
                 f"--store-decoded {field}) or give more --num-workers (the planner does not see decoding)")
    return line


def busiest_rank(loads: list[FieldLoad]) -> tuple[int, list[FieldLoad]]:
    """(rank, its loads) of the rank with the most decoding per iteration. Collective."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 0, loads
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, loads)
    rank = max(range(len(every)), key=lambda r: sum(x.seconds for x in every[r]))
    return rank, every[rank]
