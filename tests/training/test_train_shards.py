"""Real on-disk data through the whole stack: raw files -> tools/build_multitask_dataset.py -> tar shards ->
pretrain_multitask.py (one process), with sampling weights, and the data position in the checkpoint."""

import io
import os
import re
import shutil
import sys
import wave

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_spindle.checkpointing import load_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from script_loader import load_script  # noqa: E402

import pretrain_multitask  # noqa: E402


def test_train_on_built_shards(tmp_path, capsys):
    rng = np.random.default_rng(1)
    vt, ta = tmp_path / "raw_vt", tmp_path / "raw_ta"
    vt.mkdir()
    ta.mkdir()
    for i in range(10):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(buf, format="JPEG")
        (vt / f"{i:04d}.vision.jpg").write_bytes(buf.getvalue())
        (vt / f"{i:04d}.text.txt").write_text(f"a photo of thing {i}")
        (ta / f"{i:04d}.text.txt").write_text(f"the sound of thing {i}")
        wav = io.BytesIO()
        with wave.open(wav, "wb") as w:
            w.setnchannels(2)
            w.setsampwidth(2)
            w.setframerate(8000)
            w.writeframes((rng.standard_normal(2 * 2000) * 3000).astype("<i2").tobytes())
        (ta / f"{i:04d}.audio.wav").write_bytes(wav.getvalue())
    build = load_script("tools/build_multitask_dataset.py")
    for raw, task in ((vt, "vision_text"), (ta, "text_audio")):
        assert build.main(["--input", str(raw), "--output", str(tmp_path / task), "--workload", "tiny-clip",
                           "--task", task, "--samples-per-shard", "4", "--quiet"]) == 0
    save = tmp_path / "ckpt"
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hist = []
        rc = pretrain_multitask.main([
            "--workload", "tiny-clip", "--tasks", "vision_text,text_audio", "--spindle-planner", "wavefront",
            "--data-path", f"vision_text={tmp_path / 'vision_text'}",
            "--data-path", f"text_audio={tmp_path / 'text_audio'}",
            "--task-sampling-weights", "vision_text=1,text_audio=0.5", "--task-loss-weights", "text_audio=2",
            "--test-data-path", f"vision_text={tmp_path / 'vision_text'}", f"text_audio={tmp_path / 'text_audio'}",
            "--eval-iters", "1", "--train-iters", "4", "--log-interval", "1", "--save", str(save)], history=hist)
    finally:
        torch.set_num_threads(torch_threads)
    assert rc == 0
    out = capsys.readouterr().out
    assert "vision_text loss:" in out and "text_audio loss:" in out
    assert re.search(r" validation loss at iteration 4 on test set \| total loss value: \S+ \| "
                     r"text_audio loss value: \S+ \| vision_text loss value: \S+ \|", out)
    # the busiest rank's decoding per iteration, each field of its batches timed (one rank: all of both batches)
    data_line = next(line for line in out.splitlines() if line.startswith("data: decoding takes the busiest rank"))
    assert "text_audio/audio 8 x" in data_line and "the plan's predicted" in data_line, data_line
    assert all(np.isfinite(v) for r in hist for v in r.losses.values())
    # text_audio sits out some iterations (weight 0.5); vision_text always counts, with the task loss weight
    assert all(r.weights["vision_text"] == 1.0 for r in hist)
    assert [r.weights["text_audio"] for r in hist] == [2.0, 0.0, 0.0, 2.0]  # drawn from (seed, iteration)
    pos = load_checkpoint(save).data_position
    taken = 2
    assert pos["iteration"] == 4
    assert pos["tasks"]["vision_text"] == {"epoch": 1, "offset": 6, "size": 10, "batch_size": 4}
    assert pos["tasks"]["text_audio"]["epoch"] * 10 + pos["tasks"]["text_audio"]["offset"] == 8 * taken
    # vision_text as a blend of two datasets, 3:1: its batches of 4 take 3 samples from the first, 1 from the
    # second; the checkpoint keeps each part's place
    shutil.copytree(tmp_path / "vision_text", tmp_path / "vision_text_b")
    blended = tmp_path / "blended"
    assert pretrain_multitask.main([
        "--workload", "tiny-clip", "--tasks", "vision_text,text_audio", "--spindle-planner", "wavefront",
        "--data-path", f"vision_text=3:{tmp_path / 'vision_text'}", f"vision_text=1:{tmp_path / 'vision_text_b'}",
        f"text_audio={tmp_path / 'text_audio'}", "--train-iters", "4", "--save", str(blended)]) == 0
    parts = load_checkpoint(blended).data_position["tasks"]["vision_text"]["parts"]
    assert [(p["epoch"], p["offset"], p["size"]) for p in parts] == [(1, 2, 10), (0, 4, 10)]
    assert [p["weight"] for p in parts] == [0.75, 0.25]
    capsys.readouterr()
    from tools.checkpoint import inspect_checkpoint

    assert inspect_checkpoint.main([str(blended), "--summary"]) == 0
    assert ("data position:\n  text_audio: epoch 3, sample 2 of 10\n  vision_text: blend, part 0 (0.75): epoch 1, "
            "sample 2 of 10; part 1 (0.25): epoch 0, sample 4 of 10\n") in capsys.readouterr().out
    # a test set for one task of two is refused before anything runs
    with pytest.raises(SystemExit):
        pretrain_multitask.main(["--workload", "tiny-clip", "--tasks", "vision_text,text_audio",
                                 "--data-path", f"vision_text={tmp_path / 'vision_text'}",
                                 f"text_audio={tmp_path / 'text_audio'}", "--train-iters", "1",
                                 "--test-data-path", f"vision_text={tmp_path / 'vision_text'}"])
    assert "the test evaluation has no data for task(s) ['text_audio']" in capsys.readouterr().err
    # a validation share that rounds to no sample of a small dataset is named
    with pytest.raises(SystemExit):
        pretrain_multitask.main(["--workload", "tiny-clip", "--tasks", "vision_text,text_audio",
                                 "--data-path", f"vision_text={tmp_path / 'vision_text'}",
                                 f"text_audio={tmp_path / 'text_audio'}", "--train-iters", "1", "--split", "19,1"])
    assert ("validation has no data for task(s) ['text_audio', 'vision_text'] (--split 19,1 leaves text_audio (10 "
            "samples), vision_text (10 samples) no validation sample)") in capsys.readouterr().err
