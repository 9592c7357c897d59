"""Per-task datasets (mock or tar shards), collation into ``TaskBatch`` and the multi-task loader.

A task's *fields* are the modules whose front end reads raw data in that task (data/mock.py's ``TaskBatch``
convention): ``patch`` -> an image ``[C, S, S]``, ``audio`` -> a spectrogram ``[bins, tokens * patch_size]``,
``imu`` -> a window ``[channels, tokens * patch_size]``, ``text`` -> token ids ``[tokens]``; the text of the task's LM
loss module holds one more token, split into inputs ``ids[:-1]`` and labels ``ids[1:]`` (PAD labels ignored).
A dataset returns one sample as ``{module: tensor}``; ``collate`` stacks a list of them into a ``TaskBatch``.
Raw files are decoded with each module's preprocessing (data/preprocess.py: the byte tokenizer and decode.py's
image / audio defaults, or an imported Hugging Face model's tokenizer, image processor and log-mel).
"""

from __future__ import annotations

import copy
import itertools
import threading
from bisect import bisect_right
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from megatron_spindle.data import decode as dec
from megatron_spindle.data.indexed import IndexedTextDataset, is_indexed_prefix
from megatron_spindle.data.mock import IGNORE_INDEX, TaskBatch, mock_batch, own_text_tokens
from megatron_spindle.data.preprocess import Preprocessing
from megatron_spindle.data.processors import ProcessorError
from megatron_spindle.data.sampler import Blend, MixedBatch, MultiTaskSampler, blend_weights, weighted_path
from megatron_spindle.data.shards import DatasetError, ShardReader, check_shard_files, read_index
from megatron_spindle.data.tokenizer import EOS, PAD
from megatron_spindle.errors import prints_errors_of_every_rank
from megatron_spindle.graph.workload import Workload


@dataclass(frozen=True)
class FieldSpec:
    module: str
    type: str  # front-end type: patch | audio | imu | text
    shape: tuple[int, ...]  # one sample
    lm: bool = False  # the text of the task's LM loss (one extra token for the shifted labels)

    @property
    def dtype(self) -> torch.dtype:
        return torch.long if self.type == "text" else torch.float32


def task_fields(workload: Workload, task: str) -> dict[str, FieldSpec]:
    """The raw inputs one sample of ``task`` needs, keyed by module."""
    t = workload.task(task)
    lm_module = t.loss.modules[0] if t.loss is not None and t.loss.kind == "lm" else None
    out = {}
    for module in t.topo_modules():
        spec = workload.modules[module]
        own = own_text_tokens(workload, task, module)
        if spec.frontend is None or own <= 0:
            continue
        fe = spec.frontend
        if fe.type == "patch":
            side = fe.image_side(own)  # the task's resolution: image_size, or smaller for fewer tokens
            shape = (fe.in_channels, side, side)
        elif fe.type in ("audio", "imu"):
            shape = (fe.in_channels, own * fe.patch_size)
        else:
            lm = module == lm_module
            out[module] = FieldSpec(module, "text", (own + 1 if lm else own,), lm)
            continue
        out[module] = FieldSpec(module, fe.type, shape)
    return out


class TaskDataset(Protocol):
    task: str

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]: ...

    def get(self, i: int, fields: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """Sample ``i``: of ``fields`` alone when given (the others are not decoded)."""


# What a rank reads of a task's global batch (runtime/layout.py ``batch_needs``): raw field (module) -> the rows
# [lo, hi) of the batch its slices read, None for every row. A field it does not name is not read.
BatchNeed = dict[str, list[tuple[int, int]] | None]


class MockTaskDataset:
    """``size`` deterministic mock samples of a task: sample i is data/mock.py's ``mock_batch`` of a one-sample
    copy of the task at step i (so each sample costs one sample's worth of random numbers, and has exactly the
    shapes and value ranges of the mock batches). A small mock dataset repeats, so a model can fit it."""

    def __init__(self, workload: Workload, task: str, size: int = 256, seed: int = 0):
        if size <= 0:
            raise ValueError(f"mock dataset size must be positive, got {size}")
        self.workload, self.task, self.size, self.seed = workload, task, size, seed
        self.fields = task_fields(workload, task)
        self._one = copy.deepcopy(workload)
        self._one.task(task).batch_size = 1

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.get(i)

    def get(self, i: int, fields: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.size:
            raise IndexError(i)
        b = mock_batch(self._one, self.task, i, self.seed, modules=fields)
        out = {}
        for m, f in self.fields.items():
            if fields is not None and m not in fields:
                continue
            x = b.inputs[m][0]
            if f.lm:
                x = torch.cat([x, b.labels[0, -1:]])
            out[m] = x
        return out


class ShardedTaskDataset:
    """A task's samples from a tar-shard folder (data/shards.py), decoded for the task's front ends with each
    module's preprocessing (default: byte tokenizer, decode.py's image and audio decoding).

    ``check_files``: check every shard's size at open (``check_shard_files``); None: in the process that prints the
    errors every rank makes alike, one per node (``errors.prints_errors_of_every_rank``). The others check a shard
    when they first read it: at 100k shards a stat per shard and rank loads a network file system's metadata
    server for nothing."""

    def __init__(self, workload: Workload, task: str, path: str | Path, preprocessing: Preprocessing | None = None,
                 check_files: bool | None = None):
        self.workload, self.task, self.path = workload, task, Path(path)
        self.preprocessing = preprocessing or Preprocessing()
        self.fields = task_fields(workload, task)
        # (pad, EOS) ids of the text modules: collate ignores the padding of LM labels
        self.label_ids = {m: self.preprocessing.label_ids(workload, m) for m, f in self.fields.items()
                          if f.type == "text"}
        self.index = read_index(self.path)
        missing = sorted(set(self.fields) - set(self.index.fields))
        if missing:
            raise DatasetError(f"data path {self.path} for task '{task}' has no field(s) {missing} (it has "
                               f"{sorted(self.index.fields)}; the task's front ends need {sorted(self.fields)})")
        for m, f in self.fields.items():
            ext = self.index.fields[m]
            ok = {"patch": dec.IMAGE_EXTS + dec.ARRAY_EXTS, "audio": dec.AUDIO_EXTS + dec.ARRAY_EXTS,
                  "imu": dec.ARRAY_EXTS, "text": dec.TEXT_EXTS + dec.ARRAY_EXTS}[f.type]
            if ext not in ok:
                raise DatasetError(f"data path {self.path}: field '{m}' is .{ext}, but module '{m}' has a {f.type} "
                                   f"front end that reads {', '.join('.' + e for e in ok)}")
        if prints_errors_of_every_rank() if check_files is None else check_files:
            check_shard_files(self.index)
        self.reader = ShardReader(self.index)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.get(i)

    def get(self, i: int, fields: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        raw = self.reader.read(i, fields)
        out = {}
        for m, f in self.fields.items():
            if fields is not None and m not in fields:
                continue
            ext, data = raw[m]
            try:
                out[m] = decode_field(self.workload, f, ext, data, self.preprocessing)
            except dec.DecodeError as e:
                raise DatasetError(f"data path {self.path}: sample '{self.reader.key(i)}' field '{m}': {e}") from None
        return out


def decode_field(workload: Workload, f: FieldSpec, ext: str, data: bytes,
                 preprocessing: Preprocessing | None = None) -> torch.Tensor:
    """Raw bytes of one field -> the tensor its front end needs (shape checked), with the module's preprocessing."""
    prep = preprocessing or Preprocessing()
    fe = workload.modules[f.module].frontend
    try:
        if f.type == "text" and ext in dec.TEXT_EXTS:
            x = dec.decode_text(data, prep.tokenizer(workload, f.module), f.shape[0])
        elif f.type == "patch" and ext in dec.IMAGE_EXTS:
            image = prep.images.get(f.module)
            x = dec.decode_image(data, f.shape[-1], fe.in_channels) if image is None else _hf_image(image, data)
        elif f.type == "audio" and ext in dec.AUDIO_EXTS:
            x = _audio_features(prep, f, fe, *dec.read_wav(data))
        else:
            x = dec.decode_npy(data)
            if f.type == "audio" and x.ndim == 1:
                x = _audio_features(prep, f, fe, x.float(), dec.DEFAULT_SAMPLE_RATE)
            x = x.long() if f.type == "text" else x.float()
            if f.type == "text" and x.ndim == 1 and x.numel() != f.shape[0]:
                pad = prep.label_ids(workload, f.module)[0]
                x = torch.cat([x, torch.full((f.shape[0],), pad, dtype=torch.long)])[: f.shape[0]]
            if f.type == "text" and x.numel() and (int(x.min()) < 0 or int(x.max()) >= fe.vocab_size):
                raise dec.DecodeError(f"token ids must lie in [0, {fe.vocab_size}), got [{int(x.min())}, "
                                      f"{int(x.max())}]")
    except ProcessorError as e:
        raise dec.DecodeError(str(e)) from None
    if tuple(x.shape) != f.shape:
        raise dec.DecodeError(f"decoded to shape {tuple(x.shape)}, module '{f.module}' needs {f.shape}")
    return x


def _hf_image(processor, data: bytes) -> torch.Tensor:
    from PIL import UnidentifiedImageError

    try:
        return processor(data)
    except (UnidentifiedImageError, OSError) as e:
        raise dec.DecodeError(f"not a readable image: {e}") from None


def _audio_features(prep: Preprocessing, f: FieldSpec, fe, waveform: torch.Tensor, rate: int) -> torch.Tensor:
    extractor = prep.audio.get(f.module)
    if extractor is None:
        return dec.log_mel_features(waveform, rate, fe.in_channels, f.shape[1])
    return extractor(waveform, rate, f.shape[1])


def collate(workload: Workload, task: str, samples: list[dict[str, torch.Tensor]],
            label_ids: dict[str, tuple[int, int]] | None = None) -> TaskBatch:
    """Stack samples into the task's global batch (LM text split into inputs and shifted labels). Labels that are
    padding are ignored: ``label_ids[module] = (pad id, EOS id)`` (default: the byte tokenizer's); where the
    tokenizer pads with its EOS token, the first EOS of a row is a real label and the rest padding."""
    fields = task_fields(workload, task)
    return _stack(workload, task, {m: [s[m] for s in samples] for m in fields}, len(samples), {}, label_ids)


def read_batch(workload: Workload, task: str, dataset: TaskDataset, indices: Sequence[int],
               need: BatchNeed | None = None, pool: ThreadPoolExecutor | None = None,
               pin: bool = False) -> TaskBatch:
    """The task's global batch of samples ``indices`` (row r is sample ``indices[r]``), or the part of it ``need``
    names: only the rows and fields a rank reads are decoded (each row once, with the fields it is read for; on
    ``pool``'s threads when given), and the batch holds those rows (``TaskBatch.rows``). The dataset's
    ``label_ids`` (its tokenizer's padding) mark the LM labels to ignore. ``pin``: in page-locked memory."""
    read = BatchRead(workload, task, dataset, indices, need)
    if pool is None:
        return read.stack(read.decode(read.rows), pin)
    samples: dict[int, dict[str, torch.Tensor]] = {}
    for part in pool.map(read.decode, [[r] for r in read.rows]):
        samples.update(part)
    return read.stack(samples, pin)


class BatchRead:
    """One read of a task's batch (``read_batch``): the rows to decode, each with its fields; ``decode`` a chunk of
    them (on any thread), ``stack`` the decoded rows into the ``TaskBatch``."""

    def __init__(self, workload: Workload, task: str, dataset: TaskDataset, indices: Sequence[int],
                 need: BatchNeed | None = None):
        fields = task_fields(workload, task)
        if need is None:
            need = dict.fromkeys(fields)
        unknown = sorted(set(need) - set(fields))
        if unknown:
            raise ValueError(f"task '{task}' has no raw field(s) {unknown} (it has {sorted(fields)})")
        self.workload, self.task, self.dataset, self.indices = workload, task, dataset, indices
        B = len(indices)
        self.field_rows = {m: range(B) if ranges is None else sorted({r for lo, hi in ranges for r in range(lo, hi)})
                           for m, ranges in need.items()}
        self.row_fields: dict[int, list[str]] = {}
        for m, rows in self.field_rows.items():
            for r in rows:
                self.row_fields.setdefault(r, []).append(m)
        self.rows = sorted(self.row_fields)

    def chunks(self, n: int) -> list[list[int]]:
        """The rows in at most ``n`` contiguous chunks of nearly equal size."""
        n = max(1, min(n, len(self.rows)))
        return [self.rows[len(self.rows) * k // n: len(self.rows) * (k + 1) // n] for k in range(n)]

    def decode(self, rows: Sequence[int]) -> dict[int, dict[str, torch.Tensor]]:
        return {r: self.dataset.get(self.indices[r], self.row_fields[r]) for r in rows}

    def stack(self, samples: dict[int, dict[str, torch.Tensor]], pin: bool = False) -> TaskBatch:
        B = len(self.indices)
        columns = {m: [samples[r][m] for r in rows] for m, rows in self.field_rows.items() if rows}
        held = {m: tuple(rows) for m, rows in self.field_rows.items() if 0 < len(rows) < B}
        batch = _stack(self.workload, self.task, columns, B, held, getattr(self.dataset, "label_ids", None))
        return batch.pin_memory() if pin else batch

    def assemble(self, parts: list[Future], pin: bool = False) -> TaskBatch:
        """``stack`` of the chunks ``parts`` decode (futures submitted before this one: it only waits for them)."""
        samples: dict[int, dict[str, torch.Tensor]] = {}
        for part in parts:
            samples.update(part.result())
        return self.stack(samples, pin)


def _stack(workload: Workload, task: str, columns: dict[str, list[torch.Tensor]], batch_size: int,
           held: dict[str, tuple[int, ...]], label_ids: dict[str, tuple[int, int]] | None) -> TaskBatch:
    """A ``TaskBatch`` of ``batch_size`` rows from each field's samples (``held[m]``: the rows field m's samples
    are, where not all of them). The LM field's labels count their tokens only when the field is whole."""
    fields = task_fields(workload, task)
    batch = TaskBatch(task=task, global_batch_size=batch_size)
    for m, xs in columns.items():
        f, x = fields[m], torch.stack(xs)
        if m in held:
            batch.rows[m] = held[m]
        if f.lm:
            batch.inputs[m] = x[:, :-1].contiguous()
            labels = x[:, 1:].clone()
            pad, eos = (label_ids or {}).get(m, (PAD, EOS))
            ignore = labels == pad
            if pad == eos:
                ignore &= ignore.cumsum(dim=1) > 1
            labels[ignore] = IGNORE_INDEX
            batch.labels, batch.label_rows = labels, held.get(m)
            batch.num_label_tokens = int((labels != IGNORE_INDEX).sum()) if m not in held else -1
        else:
            batch.inputs[m] = x
    return batch


class MultiTaskDataLoader:
    """Each iteration's mixed batch: ``advance()`` moves the sampler one iteration (every rank, in step),
    ``batch(task)`` reads and collates that task's global batch (only for tasks this rank runs), or after
    ``read_only`` the rows and fields of it this rank reads.
    ``batch_fn`` has the runtime engine's ``(workload, task, step, seed)`` signature.

    With ``num_workers > 0`` a thread pool decodes the samples of a batch in parallel and, once a task has been
    asked for, prepares its batch of the *next* iteration while the current step runs (the sampler's indices
    are known in advance), each batch split over all the workers (a rank whose one front end reads hundreds of
    audio clips gets them all). The batches are the same as without workers. ``pin_memory``: batches are collated into
    page-locked memory (by the workers, for the batches they prepare), so the runtime's copies to the GPU run
    asynchronously."""

    def __init__(self, workload: Workload, datasets: dict[str, TaskDataset], seed: int = 0,
                 sampling_weights: dict[str, float] | None = None, num_workers: int = 0, pin_memory: bool = False):
        if num_workers < 0:
            raise ValueError(f"number of data workers must be >= 0, got {num_workers}")
        self.workload = workload
        self.datasets = datasets
        batch_sizes = {t: workload.task(t).batch_size for t in datasets}
        blends = {t: d.blend for t, d in datasets.items() if getattr(d, "blend", None) is not None}
        self.sampler = MultiTaskSampler({t: len(d) for t, d in datasets.items()}, batch_sizes, seed,
                                        sampling_weights, blends)
        self.current: MixedBatch | None = None
        self._batches: dict[str, TaskBatch | Future] = {}
        self._ahead: dict[str, Future] = {}
        self._wanted: set[str] = set()
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="data") if num_workers else None
        self._workers = num_workers
        self.pin_memory = pin_memory
        self._needs: dict[str, BatchNeed | None] = {}

    def read_only(self, needs: dict[str, BatchNeed | None]) -> None:
        """From now on a task's batch holds only what ``needs[task]`` names (the runtime engine's
        ``batch_needs``: the rows and fields this rank's slices read); a task it does not name, or names with
        None, is read whole. Batches already prepared hold more, which is as good."""
        self._needs = dict(needs)

    def _collate(self, task: str, indices: list[int]) -> TaskBatch:
        return read_batch(self.workload, task, self.datasets[task], indices, self._needs.get(task), self._pool,
                          self.pin_memory)

    def advance(self) -> MixedBatch:
        self.current = self.sampler.next()
        self._batches, self._ahead = dict(self._ahead), {}
        if self._pool is not None and self._wanted:
            upcoming = self.sampler.peek()
            for task in sorted(self._wanted):  # each batch in chunks over the workers, then stacked by one of them
                read = BatchRead(self.workload, task, self.datasets[task], upcoming.indices[task],
                                 self._needs.get(task))
                parts = [self._pool.submit(read.decode, rows) for rows in read.chunks(self._workers)]
                self._ahead[task] = self._pool.submit(read.assemble, parts, self.pin_memory)
        return self.current

    def batch(self, task: str) -> TaskBatch:
        if self.current is None:
            raise RuntimeError("MultiTaskDataLoader.batch() before advance()")
        self._wanted.add(task)
        b = self._batches.get(task)
        if b is None:
            b = self._collate(task, self.current.indices[task])
        elif isinstance(b, Future):
            b = b.result()
        self._batches[task] = b
        return b

    def batch_fn(self, workload: Workload, task: str, step: int, seed: int = 0) -> TaskBatch:
        if self.current is None or step != self.current.iteration:
            raise RuntimeError(f"data loader is at iteration {None if self.current is None else self.current.iteration}"
                               f", the engine asked for step {step}")
        return self.batch(task)

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict, tasks_may_change: bool = False) -> None:
        self.sampler.load_state_dict(state, tasks_may_change)
        self.current, self._batches, self._ahead = None, {}, {}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


class ConcatTaskDataset:
    """Datasets of one task read as one, in order: parts built separately (tools/build_multitask_dataset.py run
    on parts of a corpus at once), each checked against the task's fields as it opens. With ``weights`` the
    parts are a blend (``blend``): the sampler draws each batch from them in those proportions
    (data/sampler.py); indices stay those of the concatenation."""

    def __init__(self, parts: list[TaskDataset], weights: Sequence[float] | None = None):
        self.parts, self.task = parts, parts[0].task
        self.preprocessing = getattr(parts[0], "preprocessing", None)
        self.label_ids = getattr(parts[0], "label_ids", None)
        if any(getattr(p, "label_ids", None) != self.label_ids for p in parts):  # one batch, one padding rule
            raise ValueError(f"its datasets mark padding differently ({[getattr(p, 'label_ids', None) for p in parts]}"
                             f": a Megatron-LM corpus has none, tar shards their tokenizer's); give one kind")
        self.ends = list(itertools.accumulate(len(p) for p in parts))
        self.blend = None if weights is None else Blend.of([len(p) for p in parts], weights)

    def __len__(self) -> int:
        return self.ends[-1]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.get(i)

    def get(self, i: int, fields: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        k = bisect_right(self.ends, i)
        return self.parts[k].get(i - (self.ends[k - 1] if k else 0), fields)


class InterleavedTaskDataset:
    """A blend read in one fixed order, its parts interleaved in their proportions (``Blend.parts_of``), each
    part's samples in their own order: the validation and test batches of a blended task (batch k holds samples
    [k*B, (k+1)*B)) hold its mix, not the first part alone."""

    def __init__(self, blended: ConcatTaskDataset):
        self.dataset, self.task, self.blend = blended, blended.task, blended.blend
        self.preprocessing, self.label_ids = blended.preprocessing, blended.label_ids
        self._order: list[int] = []
        self._taken = [0] * len(self.blend.sizes)
        self._lock = threading.Lock()  # data threads ask for indices at once

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.get(i)

    def _index(self, i: int) -> int:
        with self._lock:
            starts = self.blend.starts
            while len(self._order) <= i:
                k = self.blend.parts_of(self._taken, 1)[0]
                self._order.append(starts[k] + self._taken[k] % self.blend.sizes[k])
                self._taken[k] += 1
            return self._order[i]

    def get(self, i: int, fields: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.dataset.get(self._index(i), fields)


def evaluation_dataset(dataset: TaskDataset) -> TaskDataset:
    """The dataset validation and test batches read: a blend interleaved (``InterleavedTaskDataset``)."""
    return InterleavedTaskDataset(dataset) if getattr(dataset, "blend", None) is not None else dataset


def open_task_dataset(workload: Workload, task: str, paths: str | Path | Sequence[str | Path],
                      preprocessing: Preprocessing | None = None,
                      check_files: bool | None = None) -> ShardedTaskDataset | ConcatTaskDataset:
    """The task's dataset of one shard folder (or a Megatron-LM indexed corpus's PREFIX for a text-only LM task:
    data/indexed.py), or of several read in order as one, or blended: ``WEIGHT:PATH`` for each
    (``--data-path TASK=WEIGHT:PATH``)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    items = [weighted_path(p) for p in paths]
    try:
        weights = blend_weights([w for w, _ in items])
    except ValueError as e:
        raise DatasetError(f"task '{task}' has {e}") from None
    parts = [IndexedTextDataset(workload, task, p) if is_indexed_prefix(p) else
             ShardedTaskDataset(workload, task, p, preprocessing, check_files) for _, p in items]
    if len(parts) == 1:
        return parts[0]
    try:
        return ConcatTaskDataset(parts, weights)
    except ValueError as e:
        raise DatasetError(f"task '{task}': {e}") from None


def build_datasets(workload: Workload, data_paths: dict[str, str | list[str]] | None, mock: bool, seed: int = 0,
                   mock_size: int = 256, preprocessing: Preprocessing | None = None) -> dict[str, TaskDataset]:
    """One dataset per task: shards from ``data_paths[task]`` (a folder, or several read in order) decoded with
    ``preprocessing``, or mock data (``mock``) for every task."""
    tasks = [t.name for t in workload.tasks]
    data_paths = data_paths or {}
    unknown = sorted(set(data_paths) - set(tasks))
    if unknown:
        raise DatasetError(f"--data-path given for unknown task(s) {unknown} (tasks: {tasks})")
    if mock:
        if data_paths:
            raise DatasetError("give either --mock-data or --data-path, not both")
        return {t: MockTaskDataset(workload, t, mock_size, seed) for t in tasks}
    missing = [t for t in tasks if t not in data_paths]
    if missing:
        raise DatasetError(f"no --data-path for task(s) {missing} (give --data-path TASK=PATH for each task, "
                           f"or --mock-data)")
    return {t: open_task_dataset(workload, t, data_paths[t], preprocessing) for t in tasks}
