"""A text-only LM task reading a Megatron-LM indexed corpus (PREFIX.bin / PREFIX.idx, data/indexed.py): windows
of the documents' token stream, every token a label; refused for multimodal tasks and out-of-vocabulary ids; a
run trains on it beside a multimodal task on tar shards."""

import io
import os
import re
import sys

import numpy as np
import pytest
import torch
import yaml
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from PIL import Image
from script_loader import load_script

from megatron_spindle.data.datasets import open_task_dataset, read_batch
from megatron_spindle.data.indexed import IndexedTextDataset
from megatron_spindle.data.mock import IGNORE_INDEX
from megatron_spindle.data.shards import DatasetError
from megatron_spindle.graph.workload import workload_from_dict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import pretrain_multitask  # noqa: E402

WORKLOAD = {
    "name": "text-lm",
    "modules": {
        "vision": {"kind": "encoder", "num_layers": 1, "hidden_size": 32, "num_heads": 2, "ffn_hidden_size": 64,
                   "frontend": {"type": "patch", "image_size": 8, "patch_size": 4, "in_channels": 3}},
        "vis_proj": {"kind": "projector", "input_size": 32, "hidden_size": 32},
        "llm": {"kind": "llm", "num_layers": 2, "hidden_size": 32, "num_heads": 2, "ffn_hidden_size": 64,
                "frontend": {"type": "text", "vocab_size": 256}},
    },
    "tasks": [
        {"name": "caption", "batch_size": 2, "tokens": {"vision": 5, "vis_proj": 5, "llm": 9},
         "flows": [["vision", "vis_proj"], ["vis_proj", "llm"]], "loss": {"kind": "lm", "module": "llm"}},
        {"name": "text", "batch_size": 4, "tokens": {"llm": 6}, "loss": {"kind": "lm", "module": "llm"}},
    ],
}
DOCS = (5, 9, 3, 12, 40, 7)  # 76 tokens


def _corpus(path, top=255):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, top, n).astype(np.int32) for n in DOCS]
    builder = IndexedDatasetBuilder(f"{path}.bin", dtype=np.int32)
    for d in docs:
        builder.add_item(torch.from_numpy(d))
        builder.end_document()
    builder.finalize(f"{path}.idx")
    return np.concatenate(docs)


def test_windows_of_the_token_stream_every_token_a_label(tmp_path):
    w = workload_from_dict(WORKLOAD)
    stream = _corpus(tmp_path / "corpus")
    ds = open_task_dataset(w, "text", str(tmp_path / "corpus"))
    assert isinstance(ds, IndexedTextDataset) and len(ds) == (len(stream) - 1) // 6  # windows of 6 + 1 tokens
    for i in range(len(ds)):  # across document boundaries, each window starting where the last one's inputs end
        assert ds.get(i)["llm"].tolist() == stream[6 * i:6 * i + 7].tolist()
    assert ds.get(3, ["vision"]) == {}
    batch = read_batch(w, "text", ds, [4, 0, 11, 7])
    assert batch.inputs["llm"].tolist() == [stream[6 * i:6 * i + 6].tolist() for i in (4, 0, 11, 7)]
    assert batch.labels.tolist() == [stream[6 * i + 1:6 * i + 7].tolist() for i in (4, 0, 11, 7)]
    assert batch.num_label_tokens == 24 and not bool((batch.labels == IGNORE_INDEX).any())


def test_corpus_errors(tmp_path):
    w = workload_from_dict(WORKLOAD)
    _corpus(tmp_path / "corpus")
    with pytest.raises(DatasetError, match=r"feeds a task whose one raw input is its LM text; task 'caption' reads "
                                           r"\['llm', 'vision'\]"):
        open_task_dataset(w, "caption", str(tmp_path / "corpus"))
    _corpus(tmp_path / "big", top=300)
    ds = open_task_dataset(w, "text", str(tmp_path / "big"))
    with pytest.raises(DatasetError, match=r"sample \d+ holds token ids in \[\d+, 2\d\d\], module 'llm' has a "
                                           r"vocabulary of 256"):
        [ds.get(i) for i in range(len(ds))]
    # a blend of a corpus (no padding) and tar shards (their tokenizer's) is refused
    build = load_script("tools/build_multitask_dataset.py")
    (tmp_path / "raw").mkdir()
    for i in range(3):
        (tmp_path / "raw" / f"{i}.llm.txt").write_text(f"some text {i}")
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(WORKLOAD))
    assert build.main(["--input", str(tmp_path / "raw"), "--output", str(tmp_path / "shards" / "t"), "--workload",
                       str(tmp_path / "w.yaml"), "--task", "text", "--quiet"]) == 0
    with pytest.raises(DatasetError, match="task 'text': its datasets mark padding differently"):
        open_task_dataset(w, "text", [f"0.5:{tmp_path / 'corpus'}", f"0.5:{tmp_path / 'shards' / 't'}"])
    small = dict(WORKLOAD, tasks=[dict(WORKLOAD["tasks"][1], tokens={"llm": 100})])
    with pytest.raises(DatasetError, match="76 tokens, fewer than one sample of task 'text' \\(101 tokens\\)"):
        open_task_dataset(workload_from_dict(small), "text", str(tmp_path / "corpus"))


def test_a_run_trains_a_text_task_on_a_corpus_beside_tar_shards(tmp_path, capsys, one_thread):
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(WORKLOAD))
    raw = tmp_path / "raw"
    raw.mkdir()
    rng = np.random.default_rng(1)
    for i in range(6):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(buf, format="PNG")
        (raw / f"{i:04d}.vision.png").write_bytes(buf.getvalue())
        (raw / f"{i:04d}.llm.txt").write_text(f"thing {i}")
    build = load_script("tools/build_multitask_dataset.py")
    assert build.main(["--input", str(raw), "--output", str(tmp_path / "caption"), "--workload",
                       str(tmp_path / "w.yaml"), "--task", "caption", "--quiet"]) == 0
    _corpus(tmp_path / "corpus")
    assert pretrain_multitask.main(["--workload", str(tmp_path / "w.yaml"), "--spindle-planner", "wavefront",
                                    "--data-path", f"caption={tmp_path / 'caption'}", f"text={tmp_path / 'corpus'}",
                                    "--train-iters", "3", "--log-interval", "1"]) == 0
    out = capsys.readouterr().out
    losses = [float(x) for x in re.findall(r"\| text loss: (\S+) \|", out)]
    assert len(losses) == 3 and all(np.isfinite(losses))
