"""data/preprocess.py + data/processors.py: an imported Hugging Face model's own preprocessing, from local folders.

Our CLIPImageProcessor and WhisperFeatureExtractor equivalents (numpy / torch / Pillow) equal the transformers
classes on sample inputs; the HF tokenizer wrapper gives what the tokenizer gives with truncation and max-length
padding; the flags (Megatron-LM's --tokenizer-type / --tokenizer-model, per module) reach the shard datasets and
their LM labels ignore padding; data/ imports and the byte tokenizer works without transformers.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_spindle.data.datasets import ShardedTaskDataset, collate, decode_field, task_fields
from megatron_spindle.data.mock import IGNORE_INDEX
from megatron_spindle.data.preprocess import (
    HuggingFaceTokenizer,
    add_preprocessing_args,
    preprocessing_from_args,
)
from megatron_spindle.data.processors import (
    ImageProcessor,
    LogMelExtractor,
    ProcessorError,
    slaney_mel_filters,
)
from megatron_spindle.data.shards import ShardWriter
from megatron_spindle.graph.workload import workload_from_dict
from megatron_spindle.training.evaluate import DatasetRange, ValidationBatches

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["a", "photo", "of", "cat", "dog", "the", "on", "mat", "sat", "red", "big", "small"]


def _hf_tokenizer(folder: Path, pad: bool, eos_last: bool) -> Path:
    """A word-level tokenizer built locally (no download): ``<s> words </s>`` (CLIP-like, with a pad token) or
    ``<s> words`` without a pad token (Llama-like)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    single = "<s> $A </s>" if eos_last else "<s> $A"
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<s>", 1), ("</s>", 2)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", pad_token="<pad>" if pad else None)
    fast.save_pretrained(folder)
    return folder


def _image_processor_class():
    # transformers 5 names the Pillow backend CLIPImageProcessorPil (CLIPImageProcessor needs torchvision there)
    return getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor


def _png(arr: np.ndarray, mode: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).convert(mode).save(buf, format="PNG")
    return buf.getvalue()


def _wav(x: np.ndarray, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def test_image_processor_equals_clip_image_processor(tmp_path):
    """Resize of the shortest edge (bicubic), centre crop, rescale, normalise; non-square, RGBA (composited on
    white), grayscale and smaller-than-crop images; a processor with an exact resize and its own mean/std."""
    rng = np.random.default_rng(0)
    cls = _image_processor_class()
    for i, kw in enumerate([dict(size={"shortest_edge": 12}, crop_size={"height": 8, "width": 8}),
                            dict(size={"height": 10, "width": 10}, do_center_crop=False, image_mean=[0.5, 0.4, 0.3],
                                 image_std=[0.2, 0.3, 0.4], resample=2)]):
        cls(**kw).save_pretrained(tmp_path / f"p{i}")
        ours = ImageProcessor.from_pretrained(tmp_path / f"p{i}")
        theirs = cls.from_pretrained(tmp_path / f"p{i}")
        for (w, h), mode in (((20, 13), "RGB"), ((7, 30), "RGBA"), ((16, 16), "L"), ((5, 4), "RGB")):
            channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
            img = Image.open(io.BytesIO(_png(rng.integers(0, 256, (h, w, channels), dtype=np.uint8).squeeze(), mode)))
            want = theirs(images=img, return_tensors="pt")["pixel_values"][0]
            got = ours(img)
            assert got.dtype == torch.float32 and got.shape == want.shape
            assert torch.allclose(got, want, atol=1e-6), (kw, mode, float((got - want).abs().max()))


def test_log_mel_equals_whisper_feature_extractor(tmp_path):
    """80 and 8 mel bins; a waveform shorter than, equal to and longer than the frames (zero padding, cut)."""
    rng = np.random.default_rng(1)
    for bins in (80, 8):
        fe = transformers.WhisperFeatureExtractor(feature_size=bins, chunk_length=1)
        fe.save_pretrained(tmp_path / f"w{bins}")
        ours = LogMelExtractor.from_pretrained(tmp_path / f"w{bins}")
        assert np.allclose(slaney_mel_filters(bins, 400, 16000), fe.mel_filters)
        for n in (7000, 16000, 30000):
            x = (rng.standard_normal(n) * 0.1).astype(np.float32)
            want = fe(x, sampling_rate=16000, max_length=60 * 160, return_tensors="pt").input_features[0]
            got = ours(torch.from_numpy(x), 16000, 60)
            assert got.shape == want.shape == (bins, 60)
            assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())
    with pytest.raises(ProcessorError, match="expects 16000 Hz"):
        ours(torch.zeros(100), 8000, 60)


def test_hf_tokenizer_equals_the_tokenizer(tmp_path):
    """Truncation keeps the special tokens, padding to the length; a tokenizer without a pad token pads with EOS."""
    clip_like = HuggingFaceTokenizer(_hf_tokenizer(tmp_path / "clip", pad=True, eos_last=True))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path / "clip", local_files_only=True)
    for text in ("a photo of a cat", "the big red dog sat on the small mat a photo of a cat", "zebra"):
        for n in (4, 9, 16):
            want = ref(text, truncation=True, max_length=n, padding="max_length")["input_ids"]
            assert clip_like.encode(text, n).tolist() == want
    llama_like = HuggingFaceTokenizer(_hf_tokenizer(tmp_path / "llama", pad=False, eos_last=False))
    assert llama_like.pad_id == llama_like.eos_id == 2
    assert llama_like.encode("a cat", 6).tolist() == [1, 4, 7, 2, 2, 2]


def _workload():
    return workload_from_dict({"name": "prep", "modules": {
        "vision": {"kind": "encoder", "num_layers": 1, "hidden_size": 16, "num_heads": 2, "ffn_hidden_size": 32,
                   "embed_dim": 8, "frontend": {"type": "patch", "image_size": 8, "patch_size": 4, "in_channels": 3}},
        "text": {"kind": "encoder", "num_layers": 1, "hidden_size": 16, "num_heads": 2, "ffn_hidden_size": 32,
                 "embed_dim": 8, "frontend": {"type": "text", "vocab_size": 32}},
        "audio": {"kind": "encoder", "num_layers": 1, "hidden_size": 16, "num_heads": 2, "ffn_hidden_size": 32,
                  "embed_dim": 8, "frontend": {"type": "audio", "patch_size": 2, "in_channels": 8}},
        "llm": {"kind": "llm", "num_layers": 1, "hidden_size": 16, "num_heads": 2, "ffn_hidden_size": 32,
                "frontend": {"type": "text", "vocab_size": 32}}},
        "tasks": [{"name": "vt", "batch_size": 2, "tokens": {"vision": 5, "text": 9},
                   "loss": {"kind": "contrastive", "modules": ["vision", "text"]}},
                  {"name": "at", "batch_size": 2, "tokens": {"audio": 30, "text": 9},
                   "loss": {"kind": "contrastive", "modules": ["audio", "text"]}},
                  {"name": "lm", "batch_size": 2, "tokens": {"llm": 7}, "loss": {"kind": "lm", "module": "llm"}}]})


def _args(argv: list[str]) -> argparse.Namespace:
    return add_preprocessing_args(argparse.ArgumentParser()).parse_args(argv)


def test_flags_reach_the_shard_datasets(tmp_path):
    """--tokenizer-model per module (CLIP-like for the text tower, Llama-like for the llm), --image-processor and
    --audio-processor for every patch / audio module: decoded shard samples equal the HF classes' outputs, and the
    LM labels ignore the padding (the first EOS of a row stays: the Llama-like tokenizer pads with EOS)."""
    w = _workload()
    clip_dir, llama_dir = _hf_tokenizer(tmp_path / "clip", True, True), _hf_tokenizer(tmp_path / "llama", False, False)
    _image_processor_class()(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8}).save_pretrained(clip_dir)
    transformers.WhisperFeatureExtractor(feature_size=8, chunk_length=1).save_pretrained(tmp_path / "whisper")
    prep = preprocessing_from_args(_args(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                          f"text={clip_dir},llm={llama_dir}", "--image-processor", str(clip_dir),
                                          "--audio-processor", str(tmp_path / "whisper")]), w)
    assert sorted(prep.tokenizers) == ["llm", "text"] and list(prep.images) == ["vision"]
    rng = np.random.default_rng(2)
    image = _png(rng.integers(0, 256, (12, 20, 3), dtype=np.uint8), "RGB")
    sound = rng.standard_normal(5000) * 0.1
    writers = {t: ShardWriter(tmp_path / t) for t in ("vt", "at", "lm")}
    for i in range(2):
        writers["vt"].write(f"k{i}", {"vision": ("png", image), "text": ("txt", b"a photo of a cat")})
        writers["at"].write(f"k{i}", {"audio": ("wav", _wav(sound)), "text": ("txt", b"the dog")})
        writers["lm"].write(f"k{i}", {"llm": ("txt", b"a cat sat" if i else b"the big red dog sat on the mat")})
    for wr in writers.values():
        wr.close()
    vt = ShardedTaskDataset(w, "vt", tmp_path / "vt", prep)
    clip_tok = transformers.AutoTokenizer.from_pretrained(clip_dir, local_files_only=True)
    assert vt[0]["text"].tolist() == clip_tok("a photo of a cat", max_length=9, truncation=True,
                                              padding="max_length")["input_ids"]
    want = _image_processor_class().from_pretrained(clip_dir)(images=Image.open(io.BytesIO(image)),
                                                              return_tensors="pt")["pixel_values"][0]
    assert torch.allclose(vt[0]["vision"], want, atol=1e-6)
    at = ShardedTaskDataset(w, "at", tmp_path / "at", prep)
    fe = transformers.WhisperFeatureExtractor.from_pretrained(tmp_path / "whisper")
    from megatron_spindle.data.decode import read_wav

    wav, _ = read_wav(_wav(sound))
    want = fe(wav.numpy(), sampling_rate=16000, max_length=60 * 160, return_tensors="pt").input_features[0]
    assert torch.allclose(at[0]["audio"], want, atol=1e-5)
    lm = ShardedTaskDataset(w, "lm", tmp_path / "lm", prep)
    assert lm.label_ids == {"llm": (2, 2)}
    batch = collate(w, "lm", [lm[0], lm[1]], lm.label_ids)
    # row 1: <s> a cat sat | </s> </s> </s> (8 ids): labels a cat sat </s> then ignored padding
    assert lm[1]["llm"].tolist() == [1, 4, 7, 12, 2, 2, 2, 2]
    assert batch.labels[1].tolist() == [4, 7, 12, 2, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]
    assert batch.labels[0].tolist() == lm[0]["llm"][1:].tolist()  # truncated: nothing to ignore
    assert batch.num_label_tokens == 7 + 4
    # validation batches (--valid-data-path shards, or the --split share of the training shards) ignore the same
    # padding: they counted the 3 padding EOS of row 1 as labels (the byte tokenizer's ids)
    for valid in (lm, DatasetRange(lm, 0, 2)):
        v = ValidationBatches({"lm": valid}).batch_fn(w, "lm", 0)
        assert torch.equal(v.labels, batch.labels) and v.num_label_tokens == 7 + 4
    # without the flags: the byte tokenizer, as before
    plain = ShardedTaskDataset(w, "vt", tmp_path / "vt")
    from megatron_spindle.data.tokenizer import ByteTokenizer

    assert torch.equal(plain[0]["text"], ByteTokenizer(32).encode("a photo of a cat", 9))
    f = task_fields(w, "vt")["text"]
    assert torch.equal(decode_field(w, f, "txt", b"a photo of a cat"), plain[0]["text"])


def test_flag_errors_name_the_problem(tmp_path):
    w = _workload()
    clip_dir = _hf_tokenizer(tmp_path / "clip", True, True)
    cases = [
        (["--tokenizer-type", "HuggingFaceTokenizer"], "needs --tokenizer-model"),
        (["--tokenizer-model", str(clip_dir)], "is for --tokenizer-type HuggingFaceTokenizer"),
        (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", f"nope={clip_dir}"], "unknown module 'nope'"),
        (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", f"vision={clip_dir}"],
         "module 'vision' has no text front end"),
        (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "missing")],
         "no such folder"),
        (["--image-processor", str(clip_dir)], "no preprocessor_config.json"),
    ]
    for argv, message in cases:
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            preprocessing_from_args(_args(argv), w)
    small = _workload()
    small.modules["text"].frontend.vocab_size = 10
    with pytest.raises(ValueError, match="16 tokens, but module 'text' has vocab_size 10"):
        preprocessing_from_args(_args(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                       f"text={clip_dir}"]), small)
    _image_processor_class()(size={"shortest_edge": 12}, crop_size={"height": 12, "width": 12}).save_pretrained(
        tmp_path / "big")
    with pytest.raises(ValueError, match=r"makes \(12, 12\) RGB images, module 'vision' takes 3 x 8 x 8"):
        preprocessing_from_args(_args(["--image-processor", str(tmp_path / "big")]), w)
    _image_processor_class()(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8}).save_pretrained(
        tmp_path / "eight")
    low = _workload()
    low.task("vt").tokens["vision"] = 2  # a 1 x 1 grid + the class token: 4 x 4 images
    with pytest.raises(ValueError, match=r"makes \(8, 8\) images, but task 'vt' feeds module 'vision' 4 x 4 images"):
        preprocessing_from_args(_args(["--image-processor", str(tmp_path / "eight")]), low)


def test_data_works_without_transformers(tmp_path, monkeypatch):
    """data/ imports and decodes with the byte tokenizer when transformers is missing; asking for an HF tokenizer
    then fails with one line saying what to install."""
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import megatron_spindle.data.datasets, megatron_spindle.data.preprocess\n"
            "from megatron_spindle.data.preprocess import HuggingFaceTokenizer\n"
            "try:\n    HuggingFaceTokenizer('.')\nexcept ValueError as e:\n    print('ERR', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ERR --tokenizer-type HuggingFaceTokenizer needs the transformers package" in r.stdout


def test_pretrain_multitask_takes_the_flags(tmp_path, capsys):
    """The entry point has the group; a bad combination stops before training with one line (exit 2)."""
    sys.path.insert(0, str(ROOT))
    import pretrain_multitask

    with pytest.raises(SystemExit) as e:
        pretrain_multitask.main(["--workload", "tiny-clip", "--mock-data", "--train-iters", "1",
                                 "--tokenizer-type", "HuggingFaceTokenizer"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model" in err and "Traceback" not in err


def _gpt2_files(folder: Path, eod: bool = True) -> tuple[Path, Path]:
    """A tiny GPT-2 byte-level BPE: the 256 byte symbols (GPT-2's printable-or-shifted mapping), one merge "t h",
    and <|endoftext|>."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    shifted = iter(range(256, 512))
    symbols = {b: chr(b) if b in keep else chr(next(shifted)) for b in range(256)}
    vocab = {symbols[b]: b for b in range(256)} | {"th": 256} | ({"<|endoftext|>": 257} if eod else {})
    folder.mkdir()
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\nt h\n")
    return folder / "vocab.json", folder / "merges.txt"


def test_gpt2_bpe_tokenizer_from_megatron_files(tmp_path):
    """--tokenizer-type GPT2BPETokenizer --vocab-file --merge-file (Megatron-LM's): every text module gets GPT-2's
    BPE, no BOS, padded with <|endoftext|>, of which the first after the text is the LM's end-of-document label."""
    w = _workload()
    for m in ("text", "llm"):
        w.modules[m].frontend.vocab_size = 300
    vocab, merges = _gpt2_files(tmp_path / "gpt2")
    prep = preprocessing_from_args(_args(["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab),
                                          "--merge-file", str(merges)]), w)
    assert set(prep.tokenizers) == {"text", "llm"} and prep.tokenizers["text"] is prep.tokenizers["llm"]
    ids = prep.tokenizer(w, "llm").encode("the cat", 8).tolist()
    assert ids == [256, ord("e"), 32, ord("c"), ord("a"), ord("t"), 257, 257]  # "th" merged, the space as Ġ (32)
    field = task_fields(w, "lm")["llm"]
    sample = {"llm": decode_field(w, field, "txt", b"the cat", prep)}
    batch = collate(w, "lm", [sample], {"llm": prep.label_ids(w, "llm")})
    assert batch.labels[0].tolist() == [ord("e"), 32, ord("c"), ord("a"), ord("t"), 257, IGNORE_INDEX]
    for argv, message in [
        (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab)], "goes with --vocab-file and "
                                                                                "--merge-file"),
        (["--vocab-file", str(vocab), "--merge-file", str(merges)], "goes with --vocab-file and --merge-file"),
        (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "no.json"), "--merge-file",
          str(merges)], "no.json: no such file"),
    ]:
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            preprocessing_from_args(_args(argv), w)
    with pytest.raises(ValueError, match="258 tokens, but module 'text' has vocab_size 32"):
        preprocessing_from_args(_args(["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab),
                                       "--merge-file", str(merges)]), _workload())
    no_eod = _gpt2_files(tmp_path / "no_eod", eod=False)
    with pytest.raises(ValueError, match="no <\\|endoftext\\|> token"):
        preprocessing_from_args(_args(["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(no_eod[0]),
                                       "--merge-file", str(no_eod[1])]), w)
