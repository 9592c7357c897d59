import copy
import io
import json
import os
import shutil
import tarfile
import threading
import time
import wave

import numpy as np
import pytest
import torch
from PIL import Image
from recording_dataset import RecordingDataset
from script_loader import load_script

from megatron_spindle.data.datasets import (
    ConcatTaskDataset,
    MockTaskDataset,
    MultiTaskDataLoader,
    ShardedTaskDataset,
    build_datasets,
    collate,
    open_task_dataset,
    read_batch,
    task_fields,
)
from megatron_spindle.data.decode import decode_image, log_mel_features, read_wav
from megatron_spindle.data.mock import IGNORE_INDEX, mock_batch
from megatron_spindle.data.sampler import MultiTaskSampler, epoch_permutation
from megatron_spindle.data.shards import DatasetError
from megatron_spindle.data.tokenizer import BOS, EOS, PAD, ByteTokenizer
from megatron_spindle.graph.workload import load_workload

build_multitask_dataset = load_script("tools/build_multitask_dataset.py")


@pytest.fixture(scope="module")
def clip():
    return load_workload("tiny-clip")


def test_tokenizer_is_byte_level_and_capped():
    tok = ByteTokenizer(300)
    ids = tok.encode("héllo", 10)
    assert ids[0] == BOS and ids.tolist().count(EOS) == 1 and ids[-1] == PAD
    assert tok.decode(ids) == "héllo"
    small = ByteTokenizer(16)
    ids = small.encode("a long sentence that is cut", 6)
    assert ids.tolist()[-1] == EOS and len(ids) == 6 and int(ids.max()) < 16
    assert torch.equal(small.encode("same"), small.encode("same"))
    with pytest.raises(ValueError):
        ByteTokenizer(3)


def test_sampler_is_deterministic_covers_epochs_and_restores_position():
    sizes, bs = {"a": 10, "b": 7}, {"a": 4, "b": 3}
    s1 = MultiTaskSampler(sizes, bs, seed=3)
    first = [s1.next() for _ in range(5)]
    # epoch 0 of 'a' is a permutation of all 10 samples, in 4+4+2(+2 of epoch 1)
    seen = first[0].indices["a"] + first[1].indices["a"] + first[2].indices["a"][:2]
    assert sorted(seen) == list(range(10))
    state = json.loads(json.dumps(s1.state_dict()))
    rest = [s1.next().indices for _ in range(4)]
    s2 = MultiTaskSampler(sizes, bs, seed=3)
    s2.load_state_dict(state)
    assert [s2.next().indices for _ in range(4)] == rest
    other = MultiTaskSampler(sizes, bs, seed=4)
    assert [other.next().indices for _ in range(5)] != [b.indices for b in first]
    with pytest.raises(ValueError, match="dataset of 10 samples"):
        MultiTaskSampler({"a": 11, "b": 7}, bs, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="--seed 3"):
        MultiTaskSampler(sizes, bs, seed=5).load_state_dict(state)
    # the order is kept as 4-byte indices, the same order as before (saved positions resume onto the same samples)
    assert first[0].indices["a"] == [3, 5, 2, 7] and first[0].indices["b"] == [1, 3, 2]
    assert epoch_permutation(10, 3, "a", 0).dtype == torch.int32


def test_sampling_weights_set_participation():
    s = MultiTaskSampler({"a": 50, "b": 50}, {"a": 2, "b": 2}, seed=0, sampling_weights={"a": 1.0, "b": 0.25})
    active_b = 0
    for _ in range(200):
        before = dict(s.state_dict()["tasks"]["b"])
        mb = s.next()
        assert mb.active["a"]
        after = s.state_dict()["tasks"]["b"]
        assert (before != after) == mb.active["b"]  # sitting out keeps the position
        active_b += mb.active["b"]
    assert 25 < active_b < 75
    with pytest.raises(ValueError, match="unknown task"):
        MultiTaskSampler({"a": 5}, {"a": 1}, sampling_weights={"z": 1.0})
    with pytest.raises(ValueError, match="must be > 0"):
        MultiTaskSampler({"a": 5}, {"a": 1}, sampling_weights={"a": 0.0})


def test_mock_dataset_wraps_mock_batches(clip):
    ds = MockTaskDataset(clip, "vision_text", size=12, seed=1)
    one = copy.deepcopy(clip)
    one.task("vision_text").batch_size = 1
    s = ds[6]
    ref = mock_batch(one, "vision_text", 6, 1)
    assert torch.equal(s["vision"], ref.inputs["vision"][0]) and torch.equal(s["text"], ref.inputs["text"][0])
    assert not torch.equal(ds[5]["vision"], s["vision"]) and torch.equal(ds[6]["vision"], s["vision"])
    assert s["vision"].shape == (3, 16, 16) and s["text"].shape == (12,) and int(s["text"].max()) < 128
    batch = collate(clip, "vision_text", [ds[i] for i in range(4)])
    assert batch.global_batch_size == 4 and batch.inputs["vision"].shape == (4, 3, 16, 16)
    assert batch.shard(1, 2).inputs["text"].shape == (2, 12)
    moved = batch.shard(1, 2).to("cpu")  # the engine moves the shard it runs to its device
    assert moved.dp == 2 and torch.equal(moved.inputs["vision"], batch.inputs["vision"][2:])


def test_lm_text_field_gives_shifted_labels():
    w = load_workload("tiny-vlm")
    t = next(t for t in w.tasks if t.loss and t.loss.kind == "lm")
    fields = task_fields(w, t.name)
    lm = next(f for f in fields.values() if f.lm)
    ds = MockTaskDataset(w, t.name, size=t.batch_size, seed=0)
    b = collate(w, t.name, [ds[i] for i in range(t.batch_size)])
    one = copy.deepcopy(w)
    one.task(t.name).batch_size = 1
    ref = mock_batch(one, t.name, 2, 0)
    assert torch.equal(b.inputs[lm.module][2], ref.inputs[lm.module][0]) and torch.equal(b.labels[2], ref.labels[0])
    assert b.labels.shape == b.inputs[lm.module].shape == (t.batch_size, lm.shape[0] - 1)
    pad = {k: v.clone() for k, v in ds[0].items()}
    pad[lm.module][-3:] = PAD
    b = collate(w, t.name, [pad] * t.batch_size)
    assert (b.labels[:, -3:] == IGNORE_INDEX).all() and b.num_label_tokens == t.batch_size * (lm.shape[0] - 4)


def _wav_bytes(x: np.ndarray, rate=16000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def _png_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def test_decoders():
    img = decode_image(_png_bytes(np.full((20, 30, 3), 255, np.uint8)), 16, 3)
    assert img.shape == (3, 16, 16) and torch.allclose(img, torch.ones_like(img))
    gray = decode_image(_png_bytes(np.zeros((8, 8), np.uint8)), 4, 1)
    assert gray.shape == (1, 4, 4) and float(gray.max()) == -1.0
    t = np.arange(16000) / 16000
    low, high = np.sin(2 * np.pi * 200 * t), np.sin(2 * np.pi * 6000 * t)
    wl, rate = read_wav(_wav_bytes(low))
    assert rate == 16000 and abs(float(wl.abs().max()) - 1.0) < 1e-3
    fl = log_mel_features(wl, rate, 16, 60)
    fh = log_mel_features(read_wav(_wav_bytes(high))[0], rate, 16, 60)
    assert fl.shape == (16, 60)
    assert int(fl[:, 10].argmax()) < int(fh[:, 10].argmax())  # low tone in lower bands than high tone
    short = log_mel_features(wl[:100], rate, 16, 60)
    assert short.shape == (16, 60) and float(short[:, -1].max()) == pytest.approx(np.log(1e-6))


def _write_raw(folder, n=7):
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(n):
        key = f"s{i:03d}"
        (folder / f"{key}.vision.png").write_bytes(_png_bytes(rng.integers(0, 255, (24, 24, 3), dtype=np.uint8)))
        (folder / f"{key}.text.txt").write_text(f"caption number {i}")
        (folder / f"{key}.audio.wav").write_bytes(_wav_bytes(rng.standard_normal(3000) * 0.1))
        np.save(folder / f"{key}.depth.npy", rng.standard_normal((1, 16, 16)).astype(np.float32))


def test_shards_round_trip_through_the_build_tool(clip, tmp_path, capsys):
    raw = tmp_path / "raw"
    _write_raw(raw)
    # vision_text: build, then read back the same tensors as decoding the raw files directly
    vt = tmp_path / "vt"
    vt_raw = tmp_path / "vt_raw"
    vt_raw.mkdir()
    for p in raw.iterdir():
        if ".vision." in p.name or ".text." in p.name:
            (vt_raw / p.name).write_bytes(p.read_bytes())
    assert build_multitask_dataset.main(["--input", str(vt_raw), "--output", str(vt), "--workload", "tiny-clip",
                                         "--task", "vision_text", "--samples-per-shard", "3"]) == 0
    out = capsys.readouterr().out
    assert "[build] 7/7 samples, 3 shard(s)" in out and "wrote 7 samples in 3 shard(s)" in out
    ds = ShardedTaskDataset(clip, "vision_text", vt)
    assert len(ds) == 7
    with tarfile.open(vt / "shard-000000.tar") as tar:  # plain tars, WebDataset member names
        assert tar.getnames()[:3] == ["s000.text.txt", "s000.vision.png", "s001.text.txt"]
    for i in (0, 4, 6):
        s = ds[i]
        key = f"s{i:03d}"
        assert torch.equal(s["vision"], decode_image((raw / f"{key}.vision.png").read_bytes(), 16, 3))
        assert torch.equal(s["text"], ByteTokenizer(128).encode(f"caption number {i}", 12))
    # one field: only its bytes are read
    assert list(ds.reader.read(4, ["text"])) == ["text"] and list(ds.get(4, ["text"])) == ["text"]
    assert torch.equal(ds.get(4, ["text"])["text"], ds[4]["text"])
    # audio + npy: audio_depth
    ad = tmp_path / "ad"
    ad_raw = tmp_path / "ad_raw"
    ad_raw.mkdir()
    for p in raw.iterdir():
        if ".audio." in p.name or ".depth." in p.name:
            (ad_raw / p.name).write_bytes(p.read_bytes())
    build_multitask_dataset.main(["--input", str(ad_raw), "--output", str(ad), "--workload", "tiny-clip",
                                  "--task", "audio_depth", "--quiet"])
    ds = ShardedTaskDataset(clip, "audio_depth", ad)
    s = ds[2]
    wav, rate = read_wav((raw / "s002.audio.wav").read_bytes())
    assert torch.equal(s["audio"], log_mel_features(wav, rate, 16, 64))
    assert torch.equal(s["depth"], torch.from_numpy(np.load(raw / "s002.depth.npy")))
    # --store-decoded: the same samples, loaded as arrays (every field of audio_depth, the text of vision_text)
    for task, src, built, names in (("audio_depth", ad_raw, ad, []), ("vision_text", vt_raw, vt, ["text"])):
        decoded = tmp_path / f"{task}_decoded"
        build_multitask_dataset.main(["--input", str(src), "--output", str(decoded), "--workload", "tiny-clip",
                                      "--task", task, "--quiet", "--store-decoded", *names])
        want, got = ShardedTaskDataset(clip, task, built), ShardedTaskDataset(clip, task, decoded)
        assert {m: e for m, e in got.index.fields.items() if e == "npy"}.keys() == set(names or want.fields)
        for i in range(len(want)):
            assert all(torch.equal(got[i][m], want[i][m]) and got[i][m].dtype == want[i][m].dtype for m in want.fields)
    # the loader over shards + mock gives batches of each task's batch size
    datasets = {"vision_text": ShardedTaskDataset(clip, "vision_text", vt),
                "audio_depth": ShardedTaskDataset(clip, "audio_depth", ad)}
    # decoding threads and next-iteration prefetch give the very same batches (with sampling weights too)
    plain = MultiTaskDataLoader(clip, datasets, seed=3, sampling_weights={"audio_depth": 0.5})
    threaded = MultiTaskDataLoader(clip, datasets, seed=3, sampling_weights={"audio_depth": 0.5}, num_workers=3)
    for _ in range(5):
        assert plain.advance() == threaded.advance()
        for task in ("vision_text", "audio_depth"):
            a, b = plain.batch(task), threaded.batch(task)
            assert all(torch.equal(a.inputs[m], b.inputs[m]) for m in a.inputs)
    assert set(threaded._ahead) == {"vision_text", "audio_depth"}  # the next iteration is being prepared
    threaded.close()
    loader = MultiTaskDataLoader(clip, datasets, seed=0)
    loader.advance()
    assert loader.batch_fn(clip, "vision_text", 0).inputs["vision"].shape == (4, 3, 16, 16)
    assert loader.batch("audio_depth").inputs["audio"].shape == (8, 16, 64)
    with pytest.raises(RuntimeError, match="engine asked for step 5"):
        loader.batch_fn(clip, "vision_text", 5)


def test_build_tool_and_dataset_errors(clip, tmp_path, capsys, monkeypatch):
    raw = tmp_path / "raw"
    _write_raw(raw, n=2)
    out = tmp_path / "out"
    # missing field for the task
    with pytest.raises(SystemExit) as e:
        build_multitask_dataset.main(["--input", str(raw), "--output", str(out), "--workload", "tiny-clip",
                                      "--task", "vision_text"])
    assert e.value.code != 0
    assert "expected ['text', 'vision']" in capsys.readouterr().err and not out.exists()
    # corrupt image, reported by file name; nothing written
    only = tmp_path / "only"
    only.mkdir()
    (only / "a.vision.png").write_bytes(b"not a png")
    (only / "a.text.txt").write_text("x")
    with pytest.raises(SystemExit):
        build_multitask_dataset.main(["--input", str(only), "--output", str(out), "--workload", "tiny-clip",
                                      "--task", "vision_text"])
    err = capsys.readouterr().err
    assert "a.vision.png: not a readable image" in err and not out.exists()
    assert not any(p.name.startswith(".out") for p in tmp_path.iterdir())
    # --store-decoded: only with the workload's decoding, only the task's fields
    with pytest.raises(SystemExit):
        build_multitask_dataset.main(["--input", str(raw), "--output", str(out), "--store-decoded"])
    assert "--store-decoded needs --workload and --task" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_multitask_dataset.main(["--input", str(only), "--output", str(out), "--workload", "tiny-clip",
                                      "--task", "vision_text", "--store-decoded", "audio"])
    assert "task 'vision_text' has no field(s) ['audio']" in capsys.readouterr().err and not out.exists()
    # existing output is kept without --overwrite
    (only / "a.vision.png").write_bytes(_png_bytes(np.zeros((4, 4, 3), np.uint8)))
    build_multitask_dataset.main(["--input", str(only), "--output", str(out), "--quiet"])
    with pytest.raises(SystemExit):
        build_multitask_dataset.main(["--input", str(only), "--output", str(out)])
    assert "already exists" in capsys.readouterr().err and (out / "index.json").exists()
    # dataset-side errors
    with pytest.raises(DatasetError, match="does not exist"):
        ShardedTaskDataset(clip, "vision_text", tmp_path / "nope")
    with pytest.raises(DatasetError, match="has no index.json"):
        ShardedTaskDataset(clip, "vision_text", raw)
    with pytest.raises(DatasetError, match=r"has no field\(s\) \['depth'\]"):
        ShardedTaskDataset(clip, "vision_depth", out)
    shard = next(out.glob("shard-*.tar"))
    intact = shard.read_bytes()
    shard.write_bytes(intact[:-10])
    with pytest.raises(DatasetError, match="truncated or rewritten"):
        ShardedTaskDataset(clip, "vision_text", out)
    # the shards are checked once per node (the process printing the errors every rank makes alike); another
    # process finds the damage when it opens the shard
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(DatasetError, match="truncated or rewritten"):
        ShardedTaskDataset(clip, "vision_text", out, check_files=True)
    damaged = ShardedTaskDataset(clip, "vision_text", out)
    with pytest.raises(DatasetError, match=f"shard {shard.name} has {len(intact) - 10} bytes.*truncated"):
        damaged.get(0)
    shard.unlink()
    with pytest.raises(DatasetError, match=f"shard {shard.name} is missing"):
        damaged.get(0)
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(DatasetError, match=f"shard {shard.name} is missing"):
        ShardedTaskDataset(clip, "vision_text", out)
    shard.write_bytes(intact)
    shape = task_fields(clip, "vision_text")["vision"].shape
    assert tuple(ShardedTaskDataset(clip, "vision_text", out).get(0)["vision"].shape) == shape
    with pytest.raises(DatasetError, match=r"no --data-path for task\(s\)"):
        build_datasets(clip, {"vision_text": str(out)}, mock=False)
    with pytest.raises(DatasetError, match="unknown task"):
        build_datasets(clip, {"nope": str(out)}, mock=False)


def test_pinned_batches_are_the_same_batches_in_page_locked_memory(clip, monkeypatch):
    """``pin_memory`` (the trainer's on a GPU; CPU-only torch cannot pin, so pinning is recorded here): every batch
    the loader hands out, those its workers prepared ahead too, went through ``Tensor.pin_memory``."""
    pinned: set[int] = set()
    alive = []  # the pinned tensors stay referenced, so no other tensor can reuse one of their ids

    def fake_pin(t):
        out = t.clone()
        pinned.add(id(out))
        alive.append(out)
        return out

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    datasets = build_datasets(clip, None, mock=True, seed=1, mock_size=16)
    plain = MultiTaskDataLoader(clip, datasets, seed=3)
    pinning = MultiTaskDataLoader(clip, datasets, seed=3, num_workers=2, pin_memory=True)
    for _ in range(3):
        assert plain.advance() == pinning.advance()
        for task in sorted(datasets):
            a, b = plain.batch(task), pinning.batch(task)
            assert a.inputs.keys() == b.inputs.keys() and all(torch.equal(a.inputs[m], b.inputs[m]) for m in a.inputs)
            assert all(id(x) in pinned for x in b.inputs.values())
            assert (b.labels is None) == (a.labels is None) and (b.labels is None or id(b.labels) in pinned)
            assert not any(id(x) in pinned for x in a.inputs.values())
    pinning.close()


def test_a_partial_batch_reads_and_holds_only_the_rows_and_fields_named():
    """``read_batch`` with a need (the rows a rank's slices read, per raw field) decodes each needed row once with
    the fields it is read for; its micro-batches and DP shards equal the whole batch's where they hold the rows,
    and leave a field out of a shard they hold only in part. An LM field read in part has no token count."""
    w = load_workload("tiny-vlm")
    t = next(t for t in w.tasks if t.loss and t.loss.kind == "lm")
    lm, other = sorted(task_fields(w, t.name), key=lambda m: not task_fields(w, t.name)[m].lm)
    B = t.batch_size
    ds = RecordingDataset(MockTaskDataset(w, t.name, size=3 * B, seed=2))
    indices = list(range(B, 2 * B))
    whole = read_batch(w, t.name, ds, indices)
    assert whole.rows == {} and whole.num_label_tokens > 0 and len(ds.reads) == B
    # rank 1 of DP 2 over 2 micro-batches: rows [B/4, B/2) and [3B/4, B); the LM text of every row
    q = B // 4
    need = {other: [(q, 2 * q), (3 * q, 4 * q)], lm: None}
    ds.reads.clear()
    part = read_batch(w, t.name, ds, indices, need)
    assert sorted(ds.reads) == [(B + r, tuple(sorted((lm, other))) if q <= r % (2 * q) else (lm,)) for r in range(B)]
    assert part.rows == {other: tuple(range(q, 2 * q)) + tuple(range(3 * q, 4 * q))}
    assert part.num_label_tokens == whole.num_label_tokens
    for j in range(2):
        mp, mw = part.micro(j, 2), whole.micro(j, 2)
        assert mp.rows == {other: tuple(range(q, 2 * q))}
        mine, theirs = mp.shard(1, 2), mp.shard(0, 2)
        assert sorted(mine.inputs) == sorted((lm, other)) and list(theirs.inputs) == [lm]  # the other: in part
        for m, x in mine.inputs.items():
            assert torch.equal(x, mw.shard(1, 2).inputs[m])
        assert torch.equal(mine.labels, mw.shard(1, 2).labels) and torch.equal(theirs.labels, mw.shard(0, 2).labels)
        assert mine.num_label_tokens == whole.num_label_tokens  # the global count
    # the LM text in part: the shard's labels are there, their count is not known
    ds.reads.clear()
    lm_part = read_batch(w, t.name, ds, indices, {lm: [(0, 2 * q)]})
    assert lm_part.num_label_tokens == -1 and len(ds.reads) == 2 * q and lm_part.label_rows == tuple(range(2 * q))
    assert torch.equal(lm_part.shard(0, 2).labels, whole.shard(0, 2).labels) and lm_part.shard(1, 2).labels is None
    assert read_batch(w, t.name, ds, indices, {}).inputs == {}
    with pytest.raises(ValueError, match="has no raw field"):
        read_batch(w, t.name, ds, indices, {"nope": None})


def test_the_loader_reads_only_what_it_is_told(clip):
    """``read_only`` (the trainer passes the engine's ``batch_needs``): the loader's batches, those its workers
    prepare ahead too, hold the needed rows of the needed fields, equal to the whole batches there; a task the
    needs name with nothing is not read at all, one they do not name is read whole."""
    datasets = {t: RecordingDataset(ds) for t, ds in build_datasets(clip, None, mock=True, seed=1, mock_size=16).items()}
    tasks = sorted(datasets)
    whole = MultiTaskDataLoader(clip, {t: ds.dataset for t, ds in datasets.items()}, seed=3)
    part = MultiTaskDataLoader(clip, datasets, seed=3, num_workers=2)
    field = sorted(task_fields(clip, tasks[0]))[0]
    part.read_only({tasks[0]: {field: [(0, 2)]}, tasks[1]: {}})
    for _ in range(3):
        mb = whole.advance()
        assert part.advance() == mb
        for t in tasks:
            a, b = whole.batch(t), part.batch(t)
            if t == tasks[0]:
                assert list(b.inputs) == [field] and b.rows == {field: (0, 1)}
                assert torch.equal(b.inputs[field], a.inputs[field][:2])
            elif t == tasks[1]:
                assert b.inputs == {}
            else:
                assert all(torch.equal(a.inputs[m], b.inputs[m]) for m in a.inputs) and b.rows == {}
    reads = {t: ds.reads for t, ds in datasets.items()}
    # 2 rows in each of 3 iterations, and the 4th's once its batch is prepared ahead
    assert len(reads[tasks[0]]) in (3 * 2, 4 * 2) and {f for _, f in reads[tasks[0]]} == {(field,)}
    assert reads[tasks[1]] == []
    part.close()


def test_the_index_is_a_memory_mapped_table_and_version_1_still_reads(clip, tmp_path, capsys):
    """Version 2: index.json names the shards, samples.npy (memory-mapped) where each sample's fields are; a key
    comes from its tar header (an error names the sample). A version-1 index (every sample in the JSON) reads to
    the same samples. A table that does not match its index is refused by name."""
    raw = tmp_path / "raw"
    _write_raw(raw, n=5)
    (raw / "s003.vision.png").write_bytes(b"not a png")  # built without --workload: not decoded until training
    for p in raw.glob("*.audio.*"):
        p.unlink()
    for p in raw.glob("*.depth.*"):
        p.unlink()
    out = tmp_path / "vt"
    build_multitask_dataset.main(["--input", str(raw), "--output", str(out), "--quiet", "--samples-per-shard", "2"])
    index = json.loads((out / "index.json").read_text())
    assert index["version"] == 2 and "samples" not in index and index["num_samples"] == 5
    ds = ShardedTaskDataset(clip, "vision_text", out)
    assert isinstance(ds.index.table, np.memmap) and ds.index.table.shape == (5, 5)
    assert [ds.reader.key(i) for i in range(5)] == [f"s{i:03d}" for i in range(5)]
    with pytest.raises(DatasetError, match="sample 's003' field 'vision': not a readable image"):
        ds[3]
    # the same dataset with a version-1 index
    v1 = tmp_path / "v1"
    shutil.copytree(out, v1)
    shard, where = zip(*(ds.index.location(i) for i in range(5)))
    samples = [[f"s{i:03d}", shard[i], {f: list(where[i][f]) for f in ds.index.fields}] for i in range(5)]
    (v1 / "samples.npy").unlink()
    (v1 / "index.json").write_text(json.dumps({**index, "version": 1, "samples": samples}))
    old = ShardedTaskDataset(clip, "vision_text", v1)
    assert old.index.keys == [f"s{i:03d}" for i in range(5)]
    for i in (0, 4):
        assert all(torch.equal(old[i][m], ds[i][m]) for m in ("vision", "text"))
    # a table that is not the index's
    np.save(out / "samples.npy", np.zeros((4, 5), dtype=np.int64))
    with pytest.raises(DatasetError, match=r"samples.npy: int64 \[4, 5\], index.json says int64 \[5, 5\]"):
        ShardedTaskDataset(clip, "vision_text", out)
    (out / "samples.npy").unlink()
    with pytest.raises(DatasetError, match="has no samples.npy"):
        ShardedTaskDataset(clip, "vision_text", out)


def test_a_prefetched_batch_is_split_over_all_the_workers(clip):
    """A task's next batch is decoded in chunks on every worker (one heavy front end is not left to one thread),
    then stacked: the same batch as read without workers."""
    threads: list[str] = []

    class Slow:
        def __init__(self, dataset):
            self.dataset, self.task = dataset, dataset.task

        def __len__(self):
            return len(self.dataset)

        def get(self, i, fields=None):
            threads.append(threading.current_thread().name)
            time.sleep(0.02)  # long enough that every worker takes a chunk
            return self.dataset.get(i, fields)

    datasets = build_datasets(clip, None, mock=True, seed=1, mock_size=16)
    plain = MultiTaskDataLoader(clip, datasets, seed=3)
    threaded = MultiTaskDataLoader(clip, {t: Slow(ds) for t, ds in datasets.items()}, seed=3, num_workers=3)
    ahead = []
    for it in range(3):
        plain.advance()
        threads.clear()
        threaded.advance()  # from iteration 1 on, it starts preparing the next iteration's batch
        if it:
            threaded._ahead["text_audio"].result()
            ahead.append(list(threads))  # the reads of that preparation alone
        a, b = plain.batch("text_audio"), threaded.batch("text_audio")
        assert all(torch.equal(a.inputs[m], b.inputs[m]) for m in a.inputs)
    assert [len(reads) for reads in ahead] == [8, 8]  # text_audio's batch of 8
    assert all(len(set(reads)) == 3 for reads in ahead), ahead
    threaded.close()


def _tar(path, members):
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_webdataset_shards_build_the_same_dataset_as_a_folder(clip, tmp_path, capsys):
    """WebDataset input (img2dataset's ``<key>.jpg`` / ``<key>.txt`` / ``<key>.json`` members in several .tar
    shards), with --field-map naming each suffix's field and the rest left out: the same samples as the folder
    of ``<key>.<field>.<ext>`` files; mistakes are named."""
    raw = tmp_path / "raw"
    _write_raw(raw, n=6)

    def members(keys, skip=()):
        out = []
        for k in keys:
            out += [(f"{k}.png", (raw / f"{k}.vision.png").read_bytes()),
                    (f"{k}.json", b'{"url": "x"}'), (f"{k}.txt", (raw / f"{k}.text.txt").read_bytes())]
        return [m for m in out if m[0] not in skip]

    wds = tmp_path / "wds"
    wds.mkdir()
    _tar(wds / "00000.tar", members(["s000", "s001", "s002"]))
    _tar(wds / "00001.tar", members(["s003", "s004"]))
    folder = tmp_path / "folder"
    folder.mkdir()
    for p in raw.glob("*"):
        if (".vision." in p.name or ".text." in p.name) and not p.name.startswith("s005"):
            shutil.copy(p, folder / p.name)
    common = ["--workload", "tiny-clip", "--task", "vision_text", "--quiet"]
    build_multitask_dataset.main(["--input", str(wds), "--output", str(tmp_path / "a"), "--field-map", "png=vision",
                                  "txt=text", *common])
    assert "wrote 5 samples in 1 shard(s)" in capsys.readouterr().out
    build_multitask_dataset.main(["--input", str(folder), "--output", str(tmp_path / "b"), *common])
    a, b = (ShardedTaskDataset(clip, "vision_text", tmp_path / x) for x in "ab")
    assert [a.reader.key(i) for i in range(5)] == [b.reader.key(i) for i in range(5)] == [f"s{i:03d}" for i in range(5)]
    for i in range(5):
        assert all(torch.equal(a[i][m], b[i][m]) for m in ("vision", "text"))
    # shards named one by one (a part of the corpus: here its second shard alone), then the mistakes, by name
    one = ["--input", str(wds / "00001.tar"), "--output", str(tmp_path / "c")]
    build_multitask_dataset.main([*one, "--field-map", "png=vision,txt=text", *common])
    assert len(ShardedTaskDataset(clip, "vision_text", tmp_path / "c")) == 2
    build_multitask_dataset.main(["--input", str(wds / "00000.tar"), str(wds / "00001.tar"), "--output",
                                  str(tmp_path / "e"), "--field-map", "png=vision", "txt=text", *common])
    e = ShardedTaskDataset(clip, "vision_text", tmp_path / "e")
    assert len(e) == 5 and all(torch.equal(e[4][m], b[4][m]) for m in ("vision", "text"))
    d = ["--output", str(tmp_path / "d")]

    def fails(argv, words):
        with pytest.raises(SystemExit):
            build_multitask_dataset.main(argv + d)
        assert words in capsys.readouterr().err, words
        assert not (tmp_path / "d").exists()

    fails([*one[:2], *common], "is not <key>.<field>.<ext> (give --field-map")
    fails([*one[:2], "--field-map", "png"], "'png' is not SUFFIX=FIELD")
    fails(["--input", str(folder), "--field-map", "png=vision"], "--field-map is for WebDataset .tar input")
    fails(["--input", str(folder), str(wds / "00000.tar")], "is a folder of raw files: give one such folder")
    mapped = ["--input", str(wds), "--field-map", "png=vision", "txt=text"]
    _tar(wds / "00002.tar", members(["s005"], skip=("s005.txt",)))
    fails([*mapped, *common], "sample 's005' has fields ['vision'], expected ['text', 'vision']")
    _tar(wds / "00002.tar", members(["s001"]))
    fails(mapped, "00002.tar:s001.png: sample 's001' appears twice")
    (wds / "notes.md").write_text("x")
    fails(mapped, "holds both .tar shards and other files (notes.md)")


def test_parts_built_separately_read_as_one_dataset(clip, tmp_path):
    """A task given several shard folders (parts of a corpus built at once, one build per part) reads them in
    order as one dataset: the samples of one build of the whole, the loader's batches too."""
    raw = tmp_path / "raw"
    _write_raw(raw, n=7)
    parts = [tmp_path / "p0", tmp_path / "p1"]
    for part in parts + [tmp_path / "whole"]:
        part.with_name(part.name + "_raw").mkdir()
    for p in raw.iterdir():
        if ".vision." in p.name or ".text." in p.name:  # samples 0-3 in part 0, 4-6 in part 1
            for folder in ("whole_raw", "p1_raw" if int(p.name[1:4]) >= 4 else "p0_raw"):
                shutil.copy(p, tmp_path / folder / p.name)
    for out in parts + [tmp_path / "whole"]:
        build_multitask_dataset.main(["--input", str(out.with_name(out.name + "_raw")), "--output", str(out),
                                      "--quiet"])
    joined = open_task_dataset(clip, "vision_text", [str(p) for p in parts])
    whole = open_task_dataset(clip, "vision_text", tmp_path / "whole")
    assert isinstance(joined, ConcatTaskDataset) and isinstance(whole, ShardedTaskDataset)
    assert len(joined) == len(whole) == 7 and [len(p) for p in joined.parts] == [4, 3]
    for i in range(7):
        assert all(torch.equal(joined[i][m], whole[i][m]) for m in ("vision", "text"))
    assert list(joined.get(5, ["text"])) == ["text"]
    with pytest.raises(IndexError):
        joined.get(7)


def test_a_dataset_of_many_shards_stays_within_the_open_file_limit(tmp_path):
    """A sampler visits every shard of a large dataset; the reader keeps at most ``MAX_OPEN`` of them open (it
    held one descriptor per shard and failed with 'Too many open files' past the process's limit), also with
    several threads reading at once."""
    import resource
    from concurrent.futures import ThreadPoolExecutor

    from megatron_spindle.data.shards import ShardReader, ShardWriter, read_index

    writer = ShardWriter(tmp_path / "many", samples_per_shard=1)
    for i in range(200):
        writer.write(f"k{i:04d}", {"text": ("txt", f"caption {i}".encode())})
    writer.close()
    reader = ShardReader(read_index(tmp_path / "many"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + ShardReader.MAX_OPEN + 20, hard))  # < 200 more
    try:
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda i: reader.read(i)["text"][1], range(200)))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert got == [f"caption {i}".encode() for i in range(200)]
    assert len(reader._open) <= ShardReader.MAX_OPEN and reader.key(3) == "k0003"
    reader.close()


@pytest.mark.multiproc
def test_build_workers_write_the_same_shards(tmp_path, capsys):
    """--workers 2 (spawned processes, as Megatron-LM's preprocess_data.py --workers) checks and encodes the
    samples in parallel: the same shards and index, byte for byte, as one process; a bad file found by a worker is
    named and nothing is written."""
    raw = tmp_path / "raw"
    _write_raw(raw, n=9)
    for p in raw.glob("*"):
        if ".depth." in p.name or ".audio." in p.name:
            p.unlink()
    common = ["--workload", "tiny-clip", "--task", "vision_text", "--quiet", "--store-decoded", "text",
              "--samples-per-shard", "4"]
    for workers in (1, 2):
        build_multitask_dataset.main(["--input", str(raw), "--output", str(tmp_path / f"w{workers}"),
                                      "--workers", str(workers), *common])
    one, two = tmp_path / "w1", tmp_path / "w2"
    assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in two.iterdir())
    assert all((one / p.name).read_bytes() == (two / p.name).read_bytes() for p in one.iterdir())
    (raw / "s006.vision.png").write_bytes(b"not a png")
    with pytest.raises(SystemExit):
        build_multitask_dataset.main(["--input", str(raw), "--output", str(tmp_path / "bad"), "--workers", "2",
                                      *common])
    assert "s006.vision.png: not a readable image" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists() and not any(p.name.startswith(".bad") for p in tmp_path.iterdir())
