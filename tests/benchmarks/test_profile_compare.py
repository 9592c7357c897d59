"""benchmarks/profile_compare.py: two profiles of one workload and GPU, MetaOp by MetaOp."""

import json

from script_loader import load_script

COMPARE = load_script("benchmarks/profile_compare.py")


def _profile(path, seconds: dict[str, float], workload="clip-4", gpu="H100"):
    path.write_text(json.dumps({"workload": workload, "gpu": gpu, "measurements": [
        {"metaop": m, "tp": 1, "dp": 1, "compute_seconds": s} for m, s in seconds.items()]}))
    return path


def test_the_configs_both_measured_and_the_largest_disagreement(tmp_path, capsys):
    first = _profile(tmp_path / "a.json", {"t/vision": 0.0155, "t/text": 0.0041, "t/only_first": 0.001})
    second = _profile(tmp_path / "b.json", {"t/vision": 0.0055, "t/text": 0.0042})
    out = tmp_path / "cmp.txt"
    assert COMPARE.main([str(first), str(second), "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:-1]] == ["t/vision", "t/text"]
    assert lines[1].split()[-3:] == ["15.500", "5.500", "0.35"]
    assert lines[-1] == "largest disagreement: 2.82x (t/vision, tp 1 dp 1) over 2 configs"
    assert out.read_text().splitlines() == lines


def test_profiles_that_cannot_be_compared_are_one_line_and_exit_1(tmp_path, capsys):
    a = _profile(tmp_path / "a.json", {"t/x": 0.001})
    for other, word in ((_profile(tmp_path / "b.json", {"t/x": 0.001}, gpu="A100-80GB"), "gpus"),
                        (_profile(tmp_path / "c.json", {"t/y": 0.001}), "no measured config in common")):
        assert COMPARE.main([str(a), str(other)]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and word in err
    (tmp_path / "bad.json").write_text("{")
    assert COMPARE.main([str(a), str(tmp_path / "bad.json")]) == 1
    assert "not a readable profile" in capsys.readouterr().err
