"""A simple deterministic byte-level tokenizer (no vocabulary file, no download).

Text is encoded as UTF-8 bytes. Ids 0, 1 and 2 are reserved (PAD, BOS, EOS); byte ``b`` becomes ``3 + b`` when the
vocabulary has room for all 256 bytes (``vocab_size >= 259``), and otherwise ``3 + b % (vocab_size - 3)``: bytes
are folded onto the ids that fit, so every id is always ``< vocab_size`` (lossy for tiny vocabularies, which is
fine for the tiny CPU workloads it feeds). A sequence is ``BOS, bytes..., EOS`` truncated (EOS kept) or padded
with PAD to a fixed length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD, BOS, EOS = 0, 1, 2
NUM_SPECIAL = 3


@dataclass(frozen=True)
class ByteTokenizer:
    vocab_size: int

    def __post_init__(self):
        if self.vocab_size <= NUM_SPECIAL:
            raise ValueError(f"byte tokenizer needs vocab_size > {NUM_SPECIAL}, got {self.vocab_size}")

    def token_id(self, byte: int) -> int:
        span = self.vocab_size - NUM_SPECIAL
        return NUM_SPECIAL + (byte if span >= 256 else byte % span)

    def encode(self, text: str, length: int | None = None) -> torch.Tensor:
        """Token ids (int64): BOS, one id per UTF-8 byte, EOS; cut or PAD-padded to ``length`` when given."""
        ids = [BOS] + [self.token_id(b) for b in text.encode("utf-8")] + [EOS]
        if length is not None:
            if length <= 0:
                raise ValueError(f"token length must be positive, got {length}")
            if len(ids) > length:
                ids = ids[: length - 1] + [EOS] if length > 1 else ids[:1]
            ids += [PAD] * (length - len(ids))
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids) -> str:
        """Inverse of ``encode`` for vocabularies that hold every byte (specials dropped)."""
        if self.vocab_size - NUM_SPECIAL < 256:
            raise ValueError(f"vocab_size {self.vocab_size} folds bytes; decoding is not defined")
        data = bytes(int(i) - NUM_SPECIAL for i in ids if int(i) >= NUM_SPECIAL)
        return data.decode("utf-8", errors="replace")
