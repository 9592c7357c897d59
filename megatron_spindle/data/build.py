"""The check tools/build_multitask_dataset.py runs on every sample: each field decoded as training will decode it
(a bad file is named now, not mid-training), and the fields of --store-decoded encoded as .npy arrays. On
``workers`` spawned processes (Megatron-LM's preprocess_data.py --workers) the samples are checked in parallel,
a bounded window of them at a time, and come back in their order, so the shards are the same as with one.
"""

from __future__ import annotations

import argparse
import multiprocessing
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

from megatron_spindle.data.preprocess import Preprocessing
from megatron_spindle.data.sources import RawFile
from megatron_spindle.graph.workload import Workload

SampleIn = tuple[str, dict[str, RawFile]]
WINDOW_PER_WORKER = 8  # samples in flight per worker: enough to keep it busy, few enough to bound the memory


class SampleCheck:
    """Decodes a sample's fields for ``task`` of ``workload`` with ``preprocessing``; returns the fields ``stored``
    names as .npy (the others are stored as they came)."""

    def __init__(self, workload: Workload, task: str, preprocessing: Preprocessing, stored: set[str]):
        from megatron_spindle.data.datasets import task_fields

        self.workload, self.preprocessing, self.stored = workload, preprocessing, stored
        self.fields = task_fields(workload, task)

    @classmethod
    def from_args(cls, args: argparse.Namespace, stored: set[str]) -> SampleCheck:
        """The check of the build tool's --workload, --task and preprocessing flags (each worker makes its own)."""
        from megatron_spindle.data.preprocess import preprocessing_from_args
        from megatron_spindle.graph.workload import load_workload

        workload = load_workload(args.workload)
        return cls(workload, args.task, preprocessing_from_args(args, workload), stored)

    def __call__(self, files: dict[str, RawFile]) -> dict[str, tuple[str, bytes]]:
        from megatron_spindle.data.datasets import decode_field
        from megatron_spindle.data.decode import DecodeError, encode_npy
        from megatron_spindle.data.shards import DatasetError

        out = {}
        for f, r in files.items():
            try:
                x = decode_field(self.workload, self.fields[f], r.ext, r.data, self.preprocessing)
            except DecodeError as e:
                raise DatasetError(f"{r.name}: {e}") from None
            if f in self.stored:
                out[f] = ("npy", encode_npy(x))
        return out


_worker_check: SampleCheck | None = None


def _start_worker(args: argparse.Namespace, stored: set[str]) -> None:
    global _worker_check
    import torch

    torch.set_num_threads(1)  # the workers are the parallelism: each of its own core, not all of them each
    _worker_check = SampleCheck.from_args(args, stored)


def _check_in_worker(files: dict[str, RawFile]) -> dict[str, tuple[str, bytes]]:
    return _worker_check(files)


def checked_samples(samples: Iterator[SampleIn], check: SampleCheck, args: argparse.Namespace,
                    workers: int) -> Iterator[tuple[str, dict[str, tuple[str, bytes]]]]:
    """Each sample as it is stored, ``{field: (ext, bytes)}``, in order, checked by ``check`` in this process
    (``workers`` <= 1) or on ``workers`` processes, each making its own from ``args``. A check's error is raised
    here."""
    if workers <= 1:
        for key, files in samples:
            yield key, _as_stored(files, check(files))
        return
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_worker, initargs=(args, check.stored))
    window: deque = deque()
    try:
        for key, files in samples:
            window.append((key, files, pool.submit(_check_in_worker, files)))
            if len(window) >= WINDOW_PER_WORKER * workers:
                key, files, done = window.popleft()
                yield key, _as_stored(files, done.result())
        while window:
            key, files, done = window.popleft()
            yield key, _as_stored(files, done.result())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _as_stored(files: dict[str, RawFile], encoded: dict[str, tuple[str, bytes]]) -> dict[str, tuple[str, bytes]]:
    return {f: encoded.get(f, (r.ext, r.data)) for f, r in files.items()}
