"""Reading and writing Hugging Face checkpoint folders tensor by tensor (safetensors), without transformers.

``HFFolder(path)`` reads ``config.json`` and ``model.safetensors`` or a sharded ``model.safetensors.index.json``;
``get(name)`` reads one tensor (``meta=True``: an empty tensor on the meta device with the stored shape and dtype,
read from the file header only, for dry runs). ``ShardWriter`` writes tensors into ``model-0000k.safetensors``
shards of bounded size and the index at the end.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class HFCheckpointError(ValueError):
    """A Hugging Face folder that cannot be read or does not fit the workload."""


class HFFolder:
    """A local Hugging Face model folder: its config and lazily read tensors."""

    def __init__(self, path: str | Path, meta: bool = False):
        self.path = Path(path)
        self.meta = meta
        cfg = self.path / "config.json"
        if not cfg.exists():
            raise HFCheckpointError(f"{self.path}: not a Hugging Face model folder (no config.json)")
        self.config = json.loads(cfg.read_text())
        self.weight_map = self._weight_map()
        self._handles: dict[str, object] = {}

    def _weight_map(self) -> dict[str, str]:
        index = self.path / INDEX_FILE
        if index.exists():
            return dict(json.loads(index.read_text())["weight_map"])
        single = self.path / SINGLE_FILE
        if single.exists():
            with safe_open(single, "pt") as f:
                return {k: SINGLE_FILE for k in f.keys()}
        bins = sorted(p.name for p in self.path.glob("*.bin"))
        hint = f" (found {bins}: re-save with save_pretrained(..., safe_serialization=True))" if bins else ""
        raise HFCheckpointError(f"{self.path}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = safe_open(self.path / file, "pt")
        return self._handles[file]

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise HFCheckpointError(f"{self.path}: no tensor '{name}'")
        handle = self._handle(self.weight_map[name])
        if self.meta:
            sl = handle.get_slice(name)
            return torch.empty(sl.get_shape(), dtype=_DTYPES.get(sl.get_dtype(), torch.float32), device="meta")
        return handle.get_tensor(name)

    def get_shape(self, name: str) -> list[int]:
        return list(self._handle(self.weight_map[name]).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        sl = self._handle(self.weight_map[name]).get_slice(name)
        return _DTYPES.get(sl.get_dtype(), torch.float32)

    def find_prefix(self, candidates: list[str], anchor: str) -> str:
        """The first prefix ``p`` of ``candidates`` with ``p + anchor`` in the folder."""
        for p in candidates:
            if p + anchor in self.weight_map:
                return p
        raise HFCheckpointError(f"{self.path}: no tensor '{anchor}' under any of the prefixes {candidates} "
                                f"(model_type {self.config.get('model_type')!r})")


class ShardWriter:
    """Writes tensors into size-bounded safetensors shards under ``folder``; ``close()`` writes the index (or
    renames a lone shard to ``model.safetensors``). Holds at most one shard's tensors in memory."""

    def __init__(self, folder: Path, max_shard_bytes: int = 2 << 30):
        self.folder = Path(folder)
        self.max_shard_bytes = max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[str] = []
        self.weight_map: dict[str, str] = {}
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.weight_map or name in self.pending:
            raise HFCheckpointError(f"tensor '{name}' written twice")
        t = tensor.detach().cpu().contiguous()
        nbytes = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_shard_bytes:
            self.flush()
        self.pending[name] = t
        self.pending_bytes += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        file = f"model-{len(self.files) + 1:05d}.safetensors"
        save_file(self.pending, str(self.folder / file), metadata={"format": "pt"})
        self.files.append(file)
        for k in self.pending:
            self.weight_map[k] = file
        self.total_bytes += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        self.flush()
        if len(self.files) == 1:
            (self.folder / self.files[0]).rename(self.folder / SINGLE_FILE)
            return
        index = {"metadata": {"total_size": self.total_bytes},
                 "weight_map": {k: self.weight_map[k] for k in sorted(self.weight_map)}}
        total = len(self.files)
        renames = {f: f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i, f in enumerate(self.files)}
        for old, new in renames.items():
            (self.folder / old).rename(self.folder / new)
        index["weight_map"] = {k: renames[v] for k, v in index["weight_map"].items()}
        (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2))
