import json
import threading

import pytest
import torch

from megatron_spindle.checkpointing import (
    LATEST_FILE,
    CheckpointError,
    UnitState,
    get_rng_state,
    iteration_dir,
    load_checkpoint,
    read_latest,
    save_checkpoint,
    set_rng_state,
    unit_owners,
)
from megatron_spindle.checkpointing import checkpoint as ckpt_mod


def _units(scale: float = 1.0, with_optim: bool = True) -> dict[str, UnitState]:
    g = torch.Generator().manual_seed(int(scale * 100))
    out = {}
    for unit, shapes in {"vision.layers.0": {"w": (4, 3), "b": (4,)}, "vision.head": {"proj": (2, 4)},
                         "text@t1.frontend": {"emb": (5, 4)}}.items():
        model = {f"{unit}.{k}": torch.randn(*s, generator=g) * scale for k, s in shapes.items()}
        optim = {k: {"exp_avg": torch.randn(v.shape, generator=g), "exp_avg_sq": torch.rand(v.shape, generator=g),
                     "step": 3.0} for k, v in model.items()} if with_optim else {}
        out[unit] = UnitState(model, optim)
    return out


def _expected(units):
    return {u: {k: tuple(v.shape) for k, v in s.model.items()} for u, s in units.items()}


def test_round_trip_with_optimizer_rng_and_position(tmp_path):
    units = _units()
    torch.manual_seed(5)
    rng = get_rng_state()
    before = torch.rand(3)
    save_checkpoint(tmp_path, 7, units, workload_name="w", workload_digest="abc",
                    data_position={"tasks": {"a": {"epoch": 1, "offset": 3}}}, plan={"format": "p"},
                    extra={"args": {"lr": 0.1}}, rng=rng, expected_units=list(units))
    assert read_latest(tmp_path) == 7
    assert (tmp_path / LATEST_FILE).read_text().strip() == "7"
    got = load_checkpoint(tmp_path, expected=_expected(units), workload_digest="abc")
    assert got.iteration == 7 and got.plan == {"format": "p"}
    assert got.data_position == {"tasks": {"a": {"epoch": 1, "offset": 3}}}
    assert got.metadata["extra"] == {"args": {"lr": 0.1}}
    for u, s in units.items():
        for k, v in s.model.items():
            assert torch.equal(got.units[u].model[k], v)
            assert torch.equal(got.units[u].optim[k]["exp_avg_sq"], s.optim[k]["exp_avg_sq"])
            assert got.units[u].optim[k]["step"] == 3.0
    set_rng_state(got.rng)
    assert torch.equal(torch.rand(3), before)
    # only some units
    part = load_checkpoint(tmp_path, units=["vision.head"])
    assert list(part.units) == ["vision.head"]
    # no leftovers
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([LATEST_FILE, "iter_0000007"])


def test_empty_folder_has_no_checkpoint_but_missing_folder_is_an_error(tmp_path):
    assert load_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_crash_before_latest_keeps_previous_checkpoint(tmp_path, monkeypatch):
    old = _units(1.0)
    save_checkpoint(tmp_path, 3, old)

    def crash(*a, **k):
        raise KeyboardInterrupt("killed between the files and the pointer")

    monkeypatch.setattr(ckpt_mod, "_update_latest", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 6, _units(2.0))
    assert read_latest(tmp_path) == 3
    got = load_checkpoint(tmp_path, expected=_expected(old))
    assert got.iteration == 3
    assert torch.equal(got.units["vision.head"].model["vision.head.proj"], old["vision.head"].model["vision.head.proj"])


def test_crash_while_writing_units_leaves_tmp_that_next_save_removes(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, _units(1.0))
    real = ckpt_mod._write_bytes
    calls = {"n": 0}

    def flaky(path, data):
        calls["n"] += 1
        if calls["n"] == 2:
            raise SystemExit("power cut")
        return real(path, data)

    monkeypatch.setattr(ckpt_mod, "_write_bytes", flaky)
    with pytest.raises(SystemExit):
        save_checkpoint(tmp_path, 2, _units(2.0))
    monkeypatch.setattr(ckpt_mod, "_write_bytes", real)
    assert (tmp_path / "iter_0000002.tmp").exists() and read_latest(tmp_path) == 1
    assert load_checkpoint(tmp_path).iteration == 1
    save_checkpoint(tmp_path, 2, _units(2.0))
    assert not (tmp_path / "iter_0000002.tmp").exists() and read_latest(tmp_path) == 2


def test_resave_same_iteration_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 4, _units(1.0))
    new = _units(3.0)
    save_checkpoint(tmp_path, 4, new)
    got = load_checkpoint(tmp_path)
    assert torch.equal(got.units["vision.head"].model["vision.head.proj"], new["vision.head"].model["vision.head.proj"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([LATEST_FILE, "iter_0000004"])


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path):
    units = _units()
    save_checkpoint(tmp_path, 1, units)
    exp = _expected(units)
    exp["vision.layers.0"]["vision.layers.0.w"] = (8, 3)
    with pytest.raises(CheckpointError, match=r"'vision.layers.0.w' has shape \(4, 3\) in the checkpoint but "
                                              r"the model expects \(8, 3\)"):
        load_checkpoint(tmp_path, expected=exp)
    exp = _expected(units)
    exp["audio.layers.0"] = {"audio.layers.0.w": (2, 2)}
    with pytest.raises(CheckpointError, match="no parameter unit 'audio.layers.0'"):
        load_checkpoint(tmp_path, expected=exp)
    exp = _expected(units)
    exp["vision.head"]["vision.head.bias"] = (2,)
    with pytest.raises(CheckpointError, match="'vision.head.bias' of unit 'vision.head' is missing"):
        load_checkpoint(tmp_path, expected=exp)
    exp = _expected(units)
    del exp["vision.layers.0"]["vision.layers.0.b"]
    with pytest.raises(CheckpointError, match="has tensor.*vision.layers.0.b.*the model does not"):
        load_checkpoint(tmp_path, expected=exp)


def test_corrupt_files_give_clear_errors(tmp_path):
    save_checkpoint(tmp_path, 1, _units())
    d = iteration_dir(tmp_path, 1)
    unit_file = d / "units" / "vision.head.pt"
    data = unit_file.read_bytes()
    unit_file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt: file units/vision.head.pt of unit 'vision.head' fails"):
        load_checkpoint(tmp_path)
    unit_file.unlink()
    with pytest.raises(CheckpointError, match="units/vision.head.pt of unit 'vision.head' is missing"):
        load_checkpoint(tmp_path)
    (d / "metadata.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="metadata.json is not valid JSON"):
        load_checkpoint(tmp_path)
    (d / "metadata.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CheckpointError, match="not a megatron-spindle checkpoint"):
        load_checkpoint(tmp_path)
    (tmp_path / LATEST_FILE).write_text("banana")
    with pytest.raises(CheckpointError, match="corrupt pointer file"):
        load_checkpoint(tmp_path)
    (tmp_path / LATEST_FILE).write_text("9")
    with pytest.raises(CheckpointError, match="iter_0000009 is missing"):
        load_checkpoint(tmp_path)


def test_workload_digest_mismatch_is_a_warning(tmp_path):
    save_checkpoint(tmp_path, 1, _units(), workload_name="a", workload_digest="111")
    with pytest.warns(UserWarning, match="made for workload 'a'"):
        got = load_checkpoint(tmp_path, workload_digest="222")
    assert got.warnings


def test_several_ranks_write_each_unit_once(tmp_path):
    units = _units()
    owners = unit_owners([([0, 1], ["vision.layers.0"]), ([1], ["vision.head", "text@t1.frontend"])])
    assert owners == {"vision.layers.0": 0, "vision.head": 1, "text@t1.frontend": 1}
    bar = threading.Barrier(2)
    errors = []

    def run(rank):
        try:
            mine = {u: s for u, s in units.items() if owners[u] == rank}
            save_checkpoint(tmp_path, 5, mine, rank=rank, world_size=2, barrier=bar.wait,
                            expected_units=list(units))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    got = load_checkpoint(tmp_path, expected=_expected(units))
    assert {u: m["rank"] for u, m in got.metadata["units"].items()} == owners
    assert (iteration_dir(tmp_path, 5) / "rng" / "rank_00001.pt").exists()


def test_missing_or_duplicate_unit_fails_and_keeps_latest(tmp_path):
    save_checkpoint(tmp_path, 1, _units())
    units = _units()
    with pytest.raises(CheckpointError, match=r"no rank wrote unit\(s\) \['vision.head'\]"):
        save_checkpoint(tmp_path, 2, {u: s for u, s in units.items() if u != "vision.head"},
                        expected_units=list(units))
    bar = threading.Barrier(2)
    results = {}

    def run(rank):
        try:
            save_checkpoint(tmp_path, 3, units, rank=rank, world_size=2, barrier=bar.wait)
            results[rank] = "ok"
        except CheckpointError as e:
            results[rank] = str(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert "written by both rank 0 and rank 1" in results[0]
    assert read_latest(tmp_path) == 1


def test_transformer_engine_spellings_load_as_the_local_spec_s(tmp_path):
    """A checkpoint whose pre-norms carry Transformer Engine's fused names (a TE run, or tools/checkpoint's
    --layer-names te) loads with the local spec's names, optimizer state included, and passes the shape check
    of a model that names them so (checkpointing/names.py: one name per tensor whatever the spec)."""
    from megatron_spindle.checkpointing.names import local_spelling, to_te_names

    unit = "llm.layers.0"
    local = {f"{unit}.input_layernorm.weight": torch.ones(4), f"{unit}.pre_mlp_layernorm.weight": torch.ones(4) * 2,
             f"{unit}.self_attention.linear_qkv.weight": torch.randn(12, 4)}
    optim = {k: {"exp_avg": v * 3, "exp_avg_sq": v * 4, "step": 2.0} for k, v in local.items()}
    te = UnitState(to_te_names(local), to_te_names(optim))
    assert f"{unit}.self_attention.linear_qkv.layer_norm_weight" in te.model
    assert f"{unit}.mlp.linear_fc1.layer_norm_weight" in te.model
    assert all(local_spelling(k) in local for k in te.model)
    save_checkpoint(tmp_path, 1, {unit: te}, expected_units=[unit])
    got = load_checkpoint(tmp_path, expected={unit: {k: tuple(v.shape) for k, v in local.items()}}).units[unit]
    assert sorted(got.model) == sorted(local) and sorted(got.optim) == sorted(local)
    assert all(torch.equal(got.model[k], v) and torch.equal(got.optim[k]["exp_avg"], v * 3) for k, v in local.items())
