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

TOKENIZER_TYPES = ("ByteTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer")


def _transformers(kind: str):
    try:
        import transformers
    except ImportError:
        raise ProcessorError(f"--tokenizer-type {kind} needs the transformers package (pip install "
                             f"'megatron-spindle[convert]'); without it use the byte tokenizer") from None
    return transformers


class HuggingFaceTokenizer:
    """A Hugging Face tokenizer from a local folder (``AutoTokenizer``, ``local_files_only``). ``encode`` gives what
    ``tokenizer(text, truncation=True, max_length=n, padding="max_length")`` gives - the model's special tokens
    added, content cut so they survive - padded with ``pad_id`` (the pad token, else EOS)."""

    def __init__(self, path: str | Path):
        auto = _transformers("HuggingFaceTokenizer").AutoTokenizer
        if not Path(path).is_dir():
            raise FileNotFoundError(f"--tokenizer-model {path}: no such folder")
        try:
            tokenizer = auto.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise ProcessorError(f"--tokenizer-model {path}: no Hugging Face tokenizer there ({e})") from None
        self._adopt(tokenizer, f"--tokenizer-model {path}")
        self.path = str(path)

    def _adopt(self, tokenizer, source: str) -> None:
        self.tokenizer = tok = tokenizer
        self.eos_id = tok.eos_token_id if tok.eos_token_id is not None else tok.pad_token_id
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_id
        if self.pad_id is None:
            raise ProcessorError(f"{source}: the tokenizer has neither a pad nor an EOS token")

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str, length: int) -> torch.Tensor:
        ids = self.tokenizer(text, truncation=True, max_length=length)["input_ids"]
        return torch.tensor(list(ids) + [self.pad_id] * (length - len(ids)), dtype=torch.long)


class GPT2BPETokenizer(HuggingFaceTokenizer):
    """Megatron-LM's GPT2BPETokenizer: GPT-2's byte-level BPE from its vocab.json and merges.txt (--vocab-file,
    --merge-file), through Hugging Face's fast GPT-2 tokenizer; no BOS, padded with <|endoftext|> (the first one
    after the text is its end-of-document label)."""

    EOD = "<|endoftext|>"

    def __init__(self, vocab_file: str | Path, merge_file: str | Path):
        fast = _transformers("GPT2BPETokenizer").PreTrainedTokenizerFast
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not Path(path).is_file():
                raise FileNotFoundError(f"{flag} {path}: no such file")
        try:  # the tokenizers library's byte-level BPE: the same in every transformers version
            bpe = Tokenizer(models.BPE.from_file(str(vocab_file), str(merge_file)))
        except Exception as e:  # the library raises its own exception type for unreadable files
            raise ProcessorError(f"--vocab-file {vocab_file} / --merge-file {merge_file}: not GPT-2 BPE files "
                                 f"({e})") from None
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        if bpe.token_to_id(self.EOD) is None:
            raise ProcessorError(f"--vocab-file {vocab_file}: no {self.EOD} token")
        self._adopt(fast(tokenizer_object=bpe, eos_token=self.EOD, bos_token=self.EOD, unk_token=self.EOD),
                    f"--vocab-file {vocab_file}")
        self.path = str(vocab_file)


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


def tokenizer_type(value: str) -> str:
    """--tokenizer-type: one of ``TOKENIZER_TYPES``; Megatron-LM's others are answered with what reads them."""
    if value not in TOKENIZER_TYPES:
        raise argparse.ArgumentTypeError(
            f"'{value}' is not one of {', '.join(TOKENIZER_TYPES)}: for Megatron-LM's SentencePiece, Llama, Mistral "
            f"or TikToken tokenizers give HuggingFaceTokenizer with --tokenizer-model FOLDER (the model's Hugging "
            f"Face tokenizer)")
    return value


def add_preprocessing_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("preprocessing (raw data of --data-path datasets)")
    g.add_argument("--tokenizer-type", type=tokenizer_type, default="ByteTokenizer",
                   metavar="{" + ",".join(TOKENIZER_TYPES) + "}",
                   help="ByteTokenizer: UTF-8 bytes (no files). HuggingFaceTokenizer: the tokenizer of a local HF "
                        "model folder (--tokenizer-model), per text module. GPT2BPETokenizer: GPT-2's BPE from "
                        "--vocab-file and --merge-file, for every text module (Megatron-LM's).")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: GPT-2's vocab.json.")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: GPT-2's merges.txt.")
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
    files = [getattr(args, "vocab_file", None), getattr(args, "merge_file", None)]
    if (kind == "GPT2BPETokenizer") != all(files) or (kind != "GPT2BPETokenizer" and any(files)):
        raise ValueError("--tokenizer-type GPT2BPETokenizer goes with --vocab-file and --merge-file (got "
                         f"--tokenizer-type {kind}, --vocab-file {files[0]}, --merge-file {files[1]})")
    if kind == "GPT2BPETokenizer":
        bpe = GPT2BPETokenizer(*files)
        models = {m: files[0] for m, s in workload.modules.items() if s.frontend is not None
                  and s.frontend.type == "text"}
    prep = Preprocessing()
    loaded: dict[str, HuggingFaceTokenizer] = {files[0]: bpe} if kind == "GPT2BPETokenizer" else {}
    for module, path in models.items():
        if path not in loaded:
            loaded[path] = HuggingFaceTokenizer(path)
        tok = loaded[path]
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
