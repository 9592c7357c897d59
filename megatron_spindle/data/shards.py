"""On-disk format for paired multimodal samples: WebDataset-style tar shards plus an index.

A dataset is a folder::

    index.json              {"format": "megatron-spindle-shards", "version": 2, "fields": {"vision": "jpg", ...},
                             "num_samples": N, "shards": [{"file": "shard-000000.tar", "bytes": B, "samples": K}, ...]}
    samples.npy             int64 [N, 1 + 2 x fields]: per sample its shard, then per field (in "fields" order)
                            the offset of its bytes in that tar and their size
    shard-000000.tar        members "<key>.<field>.<ext>", e.g. "000123.vision.jpg", "000123.text.txt"
    shard-000001.tar        ...

One sample is the set of members sharing a key (the WebDataset convention, so the shards can also be read by
any tar/WebDataset tool); ``field`` is the name of the workload module the file feeds. The index records
where each member's bytes start inside its tar, so a sample is read with one seek per field (random access
for a deterministic sampler) without scanning the tar. The table is memory-mapped, as Megatron-LM's indexed
datasets are: a rank opens a dataset of any size at once and holds only the pages it reads (version 1 kept every
sample's entry in index.json: 2.6 s to parse and 720 MB per rank and task at 1M samples; still read). A key is read
from its member's tar header when an error names it. Files are stored as they came (encoded JPEG, WAV...) and
decoded when read (data/decode.py). Shards are written to a temporary name and renamed, the index last.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import threading
from array import array
from collections import OrderedDict
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_spindle.fileio import write_bytes_atomic, write_text_atomic

SHARDS_FORMAT = "megatron-spindle-shards"
SHARDS_VERSION = 2
INDEX_FILE = "index.json"
TABLE_FILE = "samples.npy"


class DatasetError(ValueError):
    """A dataset folder that is missing, corrupt, or does not fit the task it is used for."""


def split_member(name: str) -> tuple[str, str, str]:
    """``"key.field.ext"`` -> (key, field, ext). Keys may not contain dots."""
    base = os.path.basename(name)
    parts = base.split(".")
    if len(parts) < 3 or not all(parts):
        raise DatasetError(f"file name '{base}' is not <key>.<field>.<ext> (e.g. 000001.vision.jpg)")
    return ".".join(parts[:-2]), parts[-2], parts[-1].lower()


class ShardWriter:
    """Packs samples ``{field: (ext, bytes)}`` into tar shards of ``samples_per_shard`` samples."""

    def __init__(self, out_dir: str | Path, samples_per_shard: int = 1000):
        if samples_per_shard <= 0:
            raise ValueError(f"samples per shard must be positive, got {samples_per_shard}")
        self.out_dir = Path(out_dir)
        self.samples_per_shard = samples_per_shard
        self.fields: dict[str, str] = {}
        self.rows = array("q")  # samples.npy's rows, flat
        self.num_samples = 0
        self.shards: list[dict] = []
        self._tar: tarfile.TarFile | None = None
        self._tmp: Path | None = None
        self._in_shard = 0
        self._keys: set[str] = set()
        self.out_dir.mkdir(parents=True, exist_ok=True)

    def _open(self) -> None:
        name = f"shard-{len(self.shards):06d}.tar"
        self._tmp = self.out_dir / f".{name}.tmp"
        self._tar = tarfile.open(self._tmp, "w", format=tarfile.USTAR_FORMAT)
        self.shards.append({"file": name, "bytes": 0, "samples": 0})
        self._in_shard = 0

    def _close(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        with open(self._tmp, "rb+") as f:
            os.fsync(f.fileno())
        final = self.out_dir / self.shards[-1]["file"]
        os.replace(self._tmp, final)
        self.shards[-1]["bytes"] = final.stat().st_size
        self.shards[-1]["samples"] = self._in_shard
        self._tar, self._tmp = None, None

    def write(self, key: str, files: dict[str, tuple[str, bytes]]) -> None:
        if not key or "." in key or "/" in key:
            raise DatasetError(f"sample key {key!r} must be non-empty without '.' or '/'")
        if key in self._keys:
            raise DatasetError(f"sample key '{key}' appears twice")
        if not self.fields:
            self.fields = {f: ext for f, (ext, _) in sorted(files.items())}
        if set(files) != set(self.fields):
            raise DatasetError(f"sample '{key}' has fields {sorted(files)}, the dataset has {sorted(self.fields)}")
        for f, (ext, _) in files.items():
            if ext != self.fields[f]:
                raise DatasetError(f"sample '{key}': field '{f}' is .{ext}, earlier samples have .{self.fields[f]}")
        if self._tar is None or self._in_shard >= self.samples_per_shard:
            self._close()
            self._open()
        self.rows.append(len(self.shards) - 1)
        for f, (ext, data) in sorted(files.items()):
            info = tarfile.TarInfo(f"{key}.{f}.{ext}")
            info.size = len(data)
            info.mode = 0o644
            self._tar.addfile(info, io.BytesIO(data))
            padded = -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
            self.rows.extend((self._tar.offset - padded, len(data)))  # data starts after the header blocks
        self._keys.add(key)
        self.num_samples += 1
        self._in_shard += 1

    def close(self) -> Path:
        """Finish the last shard and write the table, then the index (each atomically). Returns the index path."""
        self._close()
        table = np.frombuffer(self.rows, dtype=np.int64).reshape(self.num_samples, 1 + 2 * len(self.fields))
        buf = io.BytesIO()
        np.save(buf, table)
        write_bytes_atomic(self.out_dir / TABLE_FILE, buf.getvalue())
        index = {"format": SHARDS_FORMAT, "version": SHARDS_VERSION, "fields": self.fields,
                 "num_samples": self.num_samples, "shards": self.shards}
        path = self.out_dir / INDEX_FILE
        write_text_atomic(path, json.dumps(index))
        return path


@dataclass
class ShardIndex:
    """Where each sample's fields are: ``table`` row i is sample i's shard, then (offset, size) per field in
    ``fields`` order (memory-mapped from samples.npy; in memory for a version-1 index, whose ``keys`` it keeps)."""

    root: Path
    fields: dict[str, str]
    shards: list[dict]
    table: np.ndarray
    keys: list[str] | None = None

    def __len__(self) -> int:
        return len(self.table)

    def location(self, i: int) -> tuple[int, dict[str, tuple[int, int]]]:
        """(shard number, {field: (offset, size)}) of sample i."""
        row = self.table[i].tolist()
        return row[0], {f: (row[1 + 2 * j], row[2 + 2 * j]) for j, f in enumerate(self.fields)}


def read_index(root: str | Path) -> ShardIndex:
    root = Path(root)
    if not root.exists():
        raise DatasetError(f"data path {root} does not exist")
    if not root.is_dir():
        raise DatasetError(f"data path {root} is not a folder of shards (build one with "
                           f"tools/build_multitask_dataset.py)")
    p = root / INDEX_FILE
    if not p.exists():
        raise DatasetError(f"data path {root} has no {INDEX_FILE} (build it with tools/build_multitask_dataset.py)")
    try:
        d = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetError(f"{p} is corrupt: not valid JSON ({e})") from None
    if not isinstance(d, dict) or d.get("format") != SHARDS_FORMAT:
        raise DatasetError(f"{p}: not a megatron-spindle shard index")
    if d.get("version") not in (1, SHARDS_VERSION):
        raise DatasetError(f"{p}: index version {d.get('version')} is not supported (expected {SHARDS_VERSION})")
    fields = d["fields"]
    keys = None
    if d["version"] == 1:  # every sample in the JSON: [key, shard, {field: [offset, size]}]
        keys = [k for k, _, _ in d["samples"]]
        table = np.array([[shard, *(v for f in fields for v in where[f])] for _, shard, where in d["samples"]],
                         dtype=np.int64).reshape(len(keys), 1 + 2 * len(fields))
    else:
        table = _read_table(root, d, len(fields))
    if not len(table):
        raise DatasetError(f"data path {root} holds no samples")
    return ShardIndex(root, fields, d["shards"], table, keys)


def check_shard_files(index: ShardIndex) -> None:
    """Every shard of the index is there, with the size the index records. A file-system request per shard: the
    trainer makes it once per node at start (data/datasets.py ``check_files``), and the reader checks a shard's
    size again whenever it opens one (``ShardReader``), so a dataset of 100k shards is not stat'ed by every rank."""
    for number in range(len(index.shards)):
        try:
            size = (index.root / index.shards[number]["file"]).stat().st_size
        except FileNotFoundError:
            raise DatasetError(f"data path {index.root}: shard {index.shards[number]['file']} is missing") from None
        _check_shard_size(index, number, size)


def _check_shard_size(index: ShardIndex, number: int, size: int) -> None:
    shard = index.shards[number]
    if size != shard["bytes"]:
        raise DatasetError(f"data path {index.root}: shard {shard['file']} has {size} bytes, the index says "
                           f"{shard['bytes']} (truncated or rewritten)")


def _read_table(root: Path, index: dict, num_fields: int) -> np.ndarray:
    path = root / TABLE_FILE
    try:
        table = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise DatasetError(f"data path {root} has no {TABLE_FILE} (its index.json names none of its samples)") from None
    except (ValueError, OSError) as e:
        raise DatasetError(f"{path} is corrupt: {e}") from None
    want = (index["num_samples"], 1 + 2 * num_fields)
    if table.dtype != np.int64 or table.shape != want:
        raise DatasetError(f"{path}: {table.dtype} {list(table.shape)}, index.json says int64 {list(want)}")
    return table


class ShardReader:
    """Random access to the raw bytes of sample i: ``{field: (ext, bytes)}``. Opens shard files lazily and reads
    with ``os.pread`` (no shared file position), so several threads may read at once. At most ``max_open`` shard
    files stay open (the least recently used idle one is closed): a sampler visits every shard of a large dataset,
    and one descriptor per shard ran into the process's limit (1024 by default) past about a thousand shards."""

    MAX_OPEN = 64

    def __init__(self, index: ShardIndex, max_open: int = MAX_OPEN):
        self.index, self.max_open = index, max_open
        self._open: OrderedDict[int, list[int]] = OrderedDict()  # shard -> [descriptor, reads in flight]
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.index)

    def key(self, i: int) -> str:
        """Sample i's key: from a version-1 index, or from the tar header before its first field's bytes."""
        if self.index.keys is not None:
            return self.index.keys[i]
        shard, where = self.index.location(i)
        offset = min(o for o, _ in where.values())
        with self._file(shard) as fd:
            header = os.pread(fd, tarfile.BLOCKSIZE, offset - tarfile.BLOCKSIZE)
        try:
            return split_member(tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape").name)[0]
        except (tarfile.TarError, DatasetError):
            return f"#{i}"

    @contextmanager
    def _file(self, shard: int) -> Iterator[int]:
        """The shard's descriptor, open (and not closed by another thread) while in use."""
        with self._lock:
            entry = self._open.get(shard)
            if entry is None:
                entry = self._open[shard] = [self._open_shard(shard), 0]
            self._open.move_to_end(shard)
            entry[1] += 1
        try:
            yield entry[0]
        finally:
            with self._lock:
                entry[1] -= 1
                self._close_idle()

    def _open_shard(self, shard: int) -> int:
        """A descriptor of the shard, whose size is the index's (the stat of an open file costs no request to a
        network file system's metadata server)."""
        try:
            fd = os.open(self.index.root / self.index.shards[shard]["file"], os.O_RDONLY)
        except FileNotFoundError:
            raise DatasetError(f"data path {self.index.root}: shard {self.index.shards[shard]['file']} is "
                               f"missing") from None
        try:
            _check_shard_size(self.index, shard, os.fstat(fd).st_size)
        except DatasetError:
            os.close(fd)
            raise
        return fd

    def _close_idle(self) -> None:
        for shard in list(self._open):  # least recently used first
            if len(self._open) <= self.max_open:
                return
            fd, users = self._open[shard]
            if not users:
                os.close(fd)
                del self._open[shard]

    def read(self, i: int, fields: Collection[str] | None = None) -> dict[str, tuple[str, bytes]]:
        """Sample i's fields (``fields`` alone when given: the others' bytes are not read)."""
        shard, where = self.index.location(i)
        out = {}
        with self._file(shard) as fd:
            for field, (offset, size) in where.items():
                if fields is not None and field not in fields:
                    continue
                data = os.pread(fd, size, offset)
                if len(data) != size:
                    raise DatasetError(f"{self.index.root}: sample '{self.key(i)}' field '{field}' is cut short")
                out[field] = (self.index.fields[field], data)
        return out

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._open.values():
                os.close(fd)
            self._open.clear()

    def __getstate__(self):  # picklable for worker processes: reopen lazily
        return {"index": self.index, "max_open": self.max_open}

    def __setstate__(self, state):
        self.__init__(state["index"], state["max_open"])
