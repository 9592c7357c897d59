"""Which preprocessing each front end's raw data gets: the byte tokenizer and data/decode.py's defaults, or the
imported Hugging Face model's own (tokenizer, CLIPImageProcessor, WhisperFeatureExtractor), read from local folders.

Command line (Megatron-LM's tokenizer flag names; a value is one PATH for every module of that front-end type, or
MODULE=PATH[,...] for some of them; repeatable):

    --tokenizer-type HuggingFaceTokenizer --tokenizer-model /ckpt/llama          # every text module
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model text=/ckpt/clip,llm=/ckpt/llama
    --image-processor /ckpt/clip      # patch modules: the folder's preprocessor_config.json (CLIPImageProcessor)
    --audio-processor audio=/ckpt/whisper                 # audio modules: WhisperFeatureExtractor settings

Text modules without a tokenizer model keep the byte tokenizer (data/tokenizer.py, the default, also for mock
data: mock samples are random ids and tensors, untouched by any of this). They apply where raw files are decoded:
tar-shard datasets (``--data-path``) and tools/build_multitask_dataset.py's check. Hugging Face tokenizers need
the ``transformers`` package (the ``convert`` extra); nothing here imports it unless a tokenizer model is given.
Tokenizers are loaded with ``local_files_only``: never downloaded.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_spindle.data.processors import ImageProcessor, LogMelExtractor, ProcessorError
from megatron_spindle.data.tokenizer import EOS, PAD, ByteTokenizer
from megatron_spindle.graph.workload import Workload

TOKENIZER_TYPES = ("ByteTokenizer", "HuggingFaceTokenizer")


class HuggingFaceTokenizer:
    """A Hugging Face tokenizer from a local folder (``AutoTokenizer``, ``local_files_only``). ``encode`` gives what
    ``tokenizer(text, truncation=True, max_length=n, padding="max_length")`` gives - the model's special tokens
    added, content cut so they survive - padded with ``pad_id`` (the pad token, else EOS)."""

    def __init__(self, path: str | Path):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ProcessorError("--tokenizer-type HuggingFaceTokenizer needs the transformers package (pip install "
                                 "'megatron-spindle[convert]'); without it use the byte tokenizer") from None
        if not Path(path).is_dir():
            raise FileNotFoundError(f"--tokenizer-model {path}: no such folder")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise ProcessorError(f"--tokenizer-model {path}: no Hugging Face tokenizer there ({e})") from None
        self.path = str(path)
        tok = self.tokenizer
        self.eos_id = tok.eos_token_id if tok.eos_token_id is not None else tok.pad_token_id
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_id
        if self.pad_id is None:
            raise ProcessorError(f"--tokenizer-model {path}: the tokenizer has neither a pad nor an EOS token")

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str, length: int) -> torch.Tensor:
        ids = self.tokenizer(text, truncation=True, max_length=length)["input_ids"]
        return torch.tensor(list(ids) + [self.pad_id] * (length - len(ids)), dtype=torch.long)


@dataclass
class Preprocessing:
    """Per-module preprocessors; modules not listed get the defaults."""

    tokenizers: dict[str, HuggingFaceTokenizer] = field(default_factory=dict)
    images: dict[str, ImageProcessor] = field(default_factory=dict)
    audio: dict[str, LogMelExtractor] = field(default_factory=dict)

    def tokenizer(self, workload: Workload, module: str):
        return self.tokenizers.get(module) or ByteTokenizer(workload.modules[module].frontend.vocab_size)

    def label_ids(self, workload: Workload, module: str) -> tuple[int, int]:
        """(pad id, EOS id) of a text module's tokenizer (LM labels ignore padding, see datasets.collate)."""
        tok = self.tokenizers.get(module)
        return (tok.pad_id, tok.eos_id) if tok is not None else (PAD, EOS)


def add_preprocessing_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("preprocessing (raw data of --data-path datasets)")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default="ByteTokenizer",
                   help="ByteTokenizer: UTF-8 bytes (no files). HuggingFaceTokenizer: the tokenizer of a local HF "
                        "model folder (--tokenizer-model), per text module.")
    g.add_argument("--tokenizer-model", action="append", default=[], metavar="PATH | MODULE=PATH[,...]",
                   help="HF folder(s) of --tokenizer-type HuggingFaceTokenizer: one PATH for every text module, or "
                        "MODULE=PATH for some (the others keep the byte tokenizer); repeatable.")
    g.add_argument("--image-processor", action="append", default=[], metavar="PATH | MODULE=PATH[,...]",
                   help="HF folder whose preprocessor_config.json (CLIPImageProcessor) resizes, crops and normalises "
                        "the images of patch modules (default: resize to image_size, scale to [-1, 1]).")
    g.add_argument("--audio-processor", action="append", default=[], metavar="PATH | MODULE=PATH[,...]",
                   help="HF folder whose preprocessor_config.json (WhisperFeatureExtractor) gives the log-mel "
                        "features of audio modules (default: data/decode.py's log-mel).")
    return parser


def _per_module(values: list[str], flag: str, workload: Workload, types: tuple[str, ...]) -> dict[str, str]:
    """``["PATH"]`` -> every module with a front end of ``types``; ``["m=PATH,n=PATH"]`` -> those modules."""
    wanted = [m for m, s in workload.modules.items() if s.frontend is not None and s.frontend.type in types]
    out: dict[str, str] = {}
    for value in values:
        for item in (v.strip() for v in value.split(",")):
            if not item:
                continue
            module, sep, path = item.partition("=")
            pairs = [(module.strip(), path.strip())] if sep else [(m, item) for m in wanted]
            for m, p in pairs:
                if m not in workload.modules:
                    raise ValueError(f"{flag}: unknown module '{m}' (modules: {sorted(workload.modules)})")
                if m not in wanted:
                    raise ValueError(f"{flag}: module '{m}' has no {'/'.join(types)} front end")
                if out.get(m, p) != p:
                    raise ValueError(f"{flag}: module '{m}' given twice ({out[m]} and {p})")
                out[m] = p
    return out


def preprocessing_from_args(args: argparse.Namespace, workload: Workload) -> Preprocessing:
    """Load every preprocessor the flags name and check it fits its module (vocabulary, image size, mel bins)."""
    models = _per_module(getattr(args, "tokenizer_model", []), "--tokenizer-model", workload, ("text",))
    kind = getattr(args, "tokenizer_type", "ByteTokenizer")
    if kind == "HuggingFaceTokenizer" and not models:
        raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH (or MODULE=PATH)")
    if kind != "HuggingFaceTokenizer" and models:
        raise ValueError(f"--tokenizer-model is for --tokenizer-type HuggingFaceTokenizer (got {kind})")
    prep = Preprocessing()
    loaded: dict[str, HuggingFaceTokenizer] = {}
    for module, path in models.items():
        tok = loaded.setdefault(path, HuggingFaceTokenizer(path))
        vocab = workload.modules[module].frontend.vocab_size
        if tok.vocab_size > vocab:
            raise ValueError(f"--tokenizer-model {path}: {tok.vocab_size} tokens, but module '{module}' has "
                             f"vocab_size {vocab}")
        prep.tokenizers[module] = tok
    for module, path in _per_module(getattr(args, "image_processor", []), "--image-processor", workload,
                                    ("patch",)).items():
        proc, fe = ImageProcessor.from_pretrained(path), workload.modules[module].frontend
        if proc.output_hw != (fe.image_size, fe.image_size) or fe.in_channels != 3:
            raise ValueError(f"--image-processor {path}: makes {proc.output_hw} RGB images, module '{module}' takes "
                             f"{fe.in_channels} x {fe.image_size} x {fe.image_size}")
        smaller = next((t.name for t in workload.tasks
                        if t.tokens.get(module) and not t.predecessors(module)
                        and fe.image_side(t.tokens[module]) != fe.image_size), None)
        if smaller is not None:
            side = fe.image_side(workload.task(smaller).tokens[module])
            raise ValueError(f"--image-processor {path}: makes {proc.output_hw} images, but task '{smaller}' feeds "
                             f"module '{module}' {side} x {side} images")
        prep.images[module] = proc
    for module, path in _per_module(getattr(args, "audio_processor", []), "--audio-processor", workload,
                                    ("audio",)).items():
        proc, fe = LogMelExtractor.from_pretrained(path), workload.modules[module].frontend
        if proc.feature_size != fe.in_channels:
            raise ValueError(f"--audio-processor {path}: {proc.feature_size} mel bins, module '{module}' takes "
                             f"in_channels {fe.in_channels}")
        prep.audio[module] = proc
    return prep
