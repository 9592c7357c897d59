"""On-disk format for paired multimodal samples: WebDataset-style tar shards plus a JSON index.

A dataset is a folder::

    index.json              {"format": "megatron-spindle-shards", "version": 1, "fields": {"vision": "jpg", ...},
                             "shards": [{"file": "shard-000000.tar", "bytes": N, "samples": K}, ...],
                             "samples": [[key, shard number, {field: [offset, size]}], ...]}
    shard-000000.tar        members "<key>.<field>.<ext>", e.g. "000123.vision.jpg", "000123.text.txt"
    shard-000001.tar        ...

One sample is the set of members sharing a key (the WebDataset convention, so the shards can also be read by
any tar/WebDataset tool); ``field`` is the name of the workload module the file feeds. The index records
where each member's bytes start inside its tar, so a sample is read with one seek per field (random access
for a deterministic sampler) without scanning the tar. Files are stored as they came (encoded JPEG, WAV...)
and decoded when read (data/decode.py). Shards are written to a temporary name and renamed, the index last.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import threading
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from megatron_spindle.fileio import write_text_atomic

SHARDS_FORMAT = "megatron-spindle-shards"
SHARDS_VERSION = 1
INDEX_FILE = "index.json"


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
        self.samples: list[list] = []
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
        where = {}
        for f, (ext, data) in sorted(files.items()):
            info = tarfile.TarInfo(f"{key}.{f}.{ext}")
            info.size = len(data)
            info.mode = 0o644
            self._tar.addfile(info, io.BytesIO(data))
            padded = -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
            where[f] = [self._tar.offset - padded, len(data)]  # data starts after the header blocks
        self.samples.append([key, len(self.shards) - 1, where])
        self._keys.add(key)
        self._in_shard += 1

    def close(self) -> Path:
        """Finish the last shard and write the index (atomically). Returns the index path."""
        self._close()
        index = {"format": SHARDS_FORMAT, "version": SHARDS_VERSION, "fields": self.fields,
                 "num_samples": len(self.samples), "shards": self.shards, "samples": self.samples}
        path = self.out_dir / INDEX_FILE
        write_text_atomic(path, json.dumps(index))
        return path


@dataclass
class ShardIndex:
    root: Path
    fields: dict[str, str]
    shards: list[dict]
    samples: list[list]

    def __len__(self) -> int:
        return len(self.samples)


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
    if d.get("version") != SHARDS_VERSION:
        raise DatasetError(f"{p}: index version {d.get('version')} is not supported (expected {SHARDS_VERSION})")
    for s in d["shards"]:
        f = root / s["file"]
        if not f.exists():
            raise DatasetError(f"data path {root}: shard {s['file']} is missing")
        if f.stat().st_size != s["bytes"]:
            raise DatasetError(f"data path {root}: shard {s['file']} has {f.stat().st_size} bytes, the index says "
                               f"{s['bytes']} (truncated or rewritten)")
    if not d["samples"]:
        raise DatasetError(f"data path {root} holds no samples")
    return ShardIndex(root, d["fields"], d["shards"], d["samples"])


class ShardReader:
    """Random access to the raw bytes of sample i: ``{field: (ext, bytes)}``. Opens shard files lazily and reads
    with ``os.pread`` (no shared file position), so several threads may read at once."""

    def __init__(self, index: ShardIndex):
        self.index = index
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.index)

    def key(self, i: int) -> str:
        return self.index.samples[i][0]

    def _fd(self, shard: int) -> int:
        with self._lock:
            fd = self._fds.get(shard)
            if fd is None:
                fd = self._fds[shard] = os.open(self.index.root / self.index.shards[shard]["file"], os.O_RDONLY)
            return fd

    def read(self, i: int, fields: Collection[str] | None = None) -> dict[str, tuple[str, bytes]]:
        """Sample i's fields (``fields`` alone when given: the others' bytes are not read)."""
        key, shard, where = self.index.samples[i]
        fd = self._fd(shard)
        out = {}
        for field, (offset, size) in where.items():
            if fields is not None and field not in fields:
                continue
            data = os.pread(fd, size, offset)
            if len(data) != size:
                raise DatasetError(f"{self.index.root}: sample '{key}' field '{field}' is cut short")
            out[field] = (self.index.fields[field], data)
        return out

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __getstate__(self):  # picklable for worker processes: reopen lazily
        return {"index": self.index}

    def __setstate__(self, state):
        self.__init__(state["index"])
