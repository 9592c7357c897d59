"""A text-only LM task's samples from a Megatron-LM indexed corpus: the PREFIX.bin / PREFIX.idx pair that
Megatron-LM's tools/preprocess_data.py writes (read with megatron-core's ``IndexedDataset``, memory-mapped).

As Megatron-LM's GPT dataset does, the corpus's documents are read as one stream of tokens in their stored order
(with the end-of-document tokens preprocess_data.py appended) and cut into windows of the task's LM length + 1
tokens, each starting where the previous one's inputs end: sample i is tokens [i*L, i*L + L + 1) for an LM text of
L tokens. The sampler shuffles the windows. Every token is a label (packed text has no padding), so the corpus's
own end-of-document tokens are learned too. A corpus feeds only a task whose one raw input is its LM text (an
LLM trained on text alongside the multimodal tasks); multimodal tasks read tar shards."""

from __future__ import annotations

import struct
from collections.abc import Collection
from pathlib import Path

import numpy as np
import torch

from megatron_spindle.data.shards import DatasetError
from megatron_spindle.graph.workload import Workload

# (pad, EOS) label ids that match no token: nothing in a packed window is padding
NO_PADDING = (-1, -2)


def is_indexed_prefix(path: str | Path) -> bool:
    """Whether ``path`` names a Megatron-LM indexed corpus (PREFIX.bin and PREFIX.idx beside each other)."""
    return Path(f"{path}.bin").is_file() and Path(f"{path}.idx").is_file()


class IndexedTextDataset:
    """Windows of a Megatron-LM indexed corpus as a text-only LM task's samples (see the module docstring)."""

    def __init__(self, workload: Workload, task: str, prefix: str | Path):
        from megatron_spindle.data.datasets import task_fields

        fields = task_fields(workload, task)
        lm = [f for f in fields.values() if f.type == "text" and f.lm]
        if len(fields) != 1 or not lm:
            raise DatasetError(f"data path {prefix}: a Megatron-LM indexed corpus feeds a task whose one raw input "
                               f"is its LM text; task '{task}' reads {sorted(fields)} (give it tar shards: "
                               f"tools/build_multitask_dataset.py)")
        self.workload, self.task, self.path = workload, task, Path(prefix)
        self.field, self.window = lm[0].module, lm[0].shape[0]
        self.vocab_size = workload.modules[self.field].frontend.vocab_size
        self.label_ids = {self.field: NO_PADDING}
        self.preprocessing = None
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        try:
            self.corpus = IndexedDataset(str(prefix), mmap=True)
        except (AssertionError, ValueError, OSError, struct.error) as e:
            raise DatasetError(f"data path {prefix}: not a readable Megatron-LM indexed corpus ({e})") from None
        self.ends = np.cumsum(self.corpus.sequence_lengths, dtype=np.int64)
        total = int(self.ends[-1]) if len(self.ends) else 0
        self.size = max(0, (total - 1) // (self.window - 1))
        if not self.size:
            raise DatasetError(f"data path {prefix}: {total} tokens, fewer than one sample of task '{task}' "
                               f"({self.window} tokens)")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.get(i)

    def get(self, i: int, fields: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.size:
            raise IndexError(i)
        if fields is not None and self.field not in fields:
            return {}
        start, need, parts = i * (self.window - 1), self.window, []
        doc = int(np.searchsorted(self.ends, start, side="right"))
        offset = start - (int(self.ends[doc - 1]) if doc else 0)
        while need:
            take = min(need, int(self.corpus.sequence_lengths[doc]) - offset)
            parts.append(self.corpus.get(doc, offset, take))
            need, doc, offset = need - take, doc + 1, 0
        tokens = torch.from_numpy(np.concatenate(parts).astype(np.int64))
        if int(tokens.max()) >= self.vocab_size or int(tokens.min()) < 0:
            raise DatasetError(f"data path {self.path}: sample {i} holds token ids in [{int(tokens.min())}, "
                               f"{int(tokens.max())}], module '{self.field}' has a vocabulary of {self.vocab_size}")
        return {self.field: tokens}

