"""benchmarks/gpu_validate.sh: the CPU dry run goes through every step the GPU run takes (no timing asserted), and
benchmarks/gpu_env.sh / gpu_wheels.sh, which bring megatron-core to a GPU machine without network."""

import json
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_validate_dry_run_measures_and_estimates_every_point(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path / "out")}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_validate.sh"), "--dry-run"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "out" / "gpu_validate.json").read_text())  # $OUT wins over the default
    assert doc["meta"]["dry_run"] and doc["meta"]["gpu_type"] == "CPU" and not doc["skipped"]
    names = [p["point"] for p in doc["points"]]
    assert any(n.startswith("gemm") for n in names)
    assert [n for n in names if n.startswith("copy")] == ["copy 1 MiB", "copy 4 MiB"]  # a large one, then back to back
    for model in ("encoder", "llm"):
        assert {f"{model} layer mb{b} {phase}" for b in ((2,) if model == "encoder" else (1,))
                for phase in ("forward", "backward")} <= set(names)
    assert all(p["measured"] > 0 and p["model"] > 0 for p in doc["points"])
    host = [p for p in doc["points"] if p["point"].startswith("host floor")]
    assert len(host) == 2 and all(p["aten_ops"] > 100 and p["us_per_aten_op"] > 0 for p in host)
    assert "model/meas" in proc.stdout and "aten ops," in proc.stdout
    # GEMMs timed as runs of calls (the CPU's loop; a CUDA graph on a GPU), one call alone kept beside
    gemms = [p for p in doc["points"] if p["point"].startswith("gemm")]
    assert all(p["timing"].endswith("calls in a loop") and p["single_call_ms"] > 0 for p in gemms)
    assert all(abs(2.0 * 64**3 / p["call_ms"] / 1e9 - p["measured"]) < 1e-9 for p in gemms[:1])
    assert "gemm timing: " in proc.stdout
    # the unfused attention's batched GEMMs, timed the same way: the six in megatron-core's layout, QK^T and PV
    # contiguous, and again at the tokens rounded up to a multiple of 8; its softmax and the LayerNorm beside
    bmm = [p["point"] for p in doc["points"] if p["point"].startswith("bmm")]
    assert bmm == [f"bmm tiny {p} megatron 4x{s}" for p, s in (("qk", "17x17x16"), ("pv", "17x16x17"),
                                                               ("dq", "17x16x17"), ("dk", "17x16x17"),
                                                               ("dp", "17x17x16"), ("dv", "17x16x17"))] + [
        "bmm tiny qk contiguous 4x17x17x16", "bmm tiny pv contiguous 4x17x16x17",
        "bmm tiny qk contiguous 4x24x24x16", "bmm tiny pv contiguous 4x24x16x24"]
    memory = [p for p in doc["points"] if p["unit"] == "GB/s" and not p["point"].startswith("copy")]
    assert [p["point"] for p in memory] == ["softmax fp32 tiny 4x17x17", "layernorm forward tiny 68x64",
                                            "layernorm backward tiny 68x64"]
    assert all(p["timing"].endswith("calls in a loop") for p in memory)
    # then the runtime trains under torchrun on the same device (fp32 and gloo in the dry run)
    assert "training runs passed" in proc.stdout
    assert "iteration        2/       2" in (tmp_path / "out" / "gpu_train_smoke.log").read_text()
    runs = json.loads((tmp_path / "out" / "gpu_train.json").read_text())
    assert set(runs) == {"smoke", "vlm"} and runs["vlm"]["iterations"] == 4
    assert all(r["measured_ms"] > 0 and r["predicted_ms"] > 0 for r in runs.values())


def test_gpu_breakdown_dry_run_trains_on_the_analytic_and_the_profiled_plan(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_breakdown.sh"), "--dry-run", "--out-dir",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads((tmp_path / "gpu_breakdown.json").read_text())
    assert set(runs) == {"analytic", "profiled"}
    assert runs["analytic"]["iterations"] == 5 and runs["profiled"]["iterations"] == 4
    # the second plan came from the profile just taken, so its prediction differs from the analytic one
    assert runs["profiled"]["predicted_ms"] != runs["analytic"]["predicted_ms"]
    assert json.loads((tmp_path / "profile.json").read_text())["gpu"] == "CPU"
    # a first profile, before the training, held against the later one MetaOp by MetaOp
    assert json.loads((tmp_path / "profile_first.json").read_text())["gpu"] == "CPU"
    assert (tmp_path / "profile_compare.txt").read_text().splitlines()[-1].startswith("largest disagreement: ")
    log = (tmp_path / "breakdown_profiled.log").read_text()
    assert "measured wave time forward/backward" in log and "optimizer-inner-step" in log  # --timing-log-level 2
    # the analytic plan's last iteration ran under the PyTorch profiler, each slice's phases in named ranges
    analytic = (tmp_path / "breakdown_analytic.log").read_text()
    assert "[profile] rank 0, iterations 4 to 4, by host time:" in analytic
    assert "iterations 4 to 4, by slice" in analytic
    slices = {m.group(1) for m in re.finditer(r"^(forward|backward) w\d+:\S+ +1 +\d+\.\d+ +\d+\.\d+$", analytic, re.M)}
    assert slices == {"forward", "backward"}
    # then the operations one step dispatches, counted and timed
    ops = json.loads((tmp_path / "host_ops.json").read_text())
    assert ops["device"] == "cpu" and set(ops["steps"]) == {
        "plain PyTorch (fp32)", "runtime (float32)", "runtime (bfloat16)", "runtime (bfloat16, ZeRO-1)",
        "runtime (bfloat16, ZeRO-3)"}
    assert all(s > 0 for s in ops["seconds_per_step"].values())


def _session_stand_ins(folder: Path, validate_rc: int) -> Path:
    """Stand-ins for gpu_validate.sh and gpu_breakdown.sh: each writes its arguments and whether OUT was set into
    its own file in --out-dir, and exits (validate with ``validate_rc``)."""
    folder.mkdir()
    body = ('out=; args="$*"; while [[ $# -gt 0 ]]; do [[ "$1" == --out-dir ]] && out="$2"; shift; done\n'
            'echo "$args OUT=${OUT:-unset}" > "$out/{name}.txt"\nexit {rc}\n')
    for name, rc in (("gpu_validate", validate_rc), ("gpu_breakdown", 0)):
        (folder / f"{name}.sh").write_text(body.replace("{name}", name).replace("{rc}", str(rc)))
    return folder


def _session(tmp_path: Path, scripts: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    import tarfile

    env = {**os.environ, "SCRIPTS": str(scripts), "OUT": str(tmp_path / "out")}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), *args], env=env,
                          capture_output=True, text=True, timeout=60)
    with tarfile.open(tmp_path / "out" / "gpu_session.tgz") as tar:
        files = {Path(m.name).name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}
    return proc, files


def test_gpu_session_runs_both_scripts_into_one_archive(tmp_path):
    proc, files = _session(tmp_path, _session_stand_ins(tmp_path / "ok", 0), "--gpu-type", "H100")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(files) == {"gpu_validate.txt", "gpu_breakdown.txt"}
    # options passed to both, each writing into the working folder, not into $OUT
    assert all(f.startswith("--gpu-type H100 --out-dir ") and f.rstrip().endswith("OUT=unset")
               for f in files.values())
    assert sorted(os.listdir(tmp_path / "out")) == ["gpu_session.tgz"]
    # a failed validation is the exit status, and the breakdown still runs and is packed
    proc, files = _session(tmp_path, _session_stand_ins(tmp_path / "failing", 3), "--dry-run")
    assert proc.returncode == 3 and set(files) == {"gpu_validate.txt", "gpu_breakdown.txt"}
    # too little of the budget left: the breakdown is not started, the validation's files are packed
    proc, files = _session(tmp_path, _session_stand_ins(tmp_path / "short", 0), "--budget", "0")
    assert proc.returncode == 0 and set(files) == {"gpu_validate.txt"} and "not run" in proc.stdout
    bad = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), "--budget", "soon"],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--budget" in bad.stderr


def _probe_wheel(folder: Path) -> Path:
    """A pure-Python wheel of one module, ``spindle_gpu_probe`` (VALUE = 42), built by hand: no network, no build."""
    import zipfile

    folder.mkdir(parents=True)
    path = folder / "spindle_gpu_probe-1.0-py3-none-any.whl"
    info = "spindle_gpu_probe-1.0.dist-info"
    files = {"spindle_gpu_probe.py": "VALUE = 42\n",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: spindle-gpu-probe\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def _gpu_env(tmp_path: Path, wheels: Path, module: str, python: Path | None = None) -> subprocess.CompletedProcess:
    """benchmarks/gpu_env.sh's setup for ``module`` in a shell (with ``python`` as $PYTHON, else its default), then
    the module imported with the path it set."""
    script = (f'ROOT="{ROOT}"; source "{ROOT}/benchmarks/gpu_env.sh"; gpu_env_setup probe.sh {module}; '
              f'"$PYTHON" -c "import {module}; print({module}.VALUE)"')
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env.update(WHEELS=str(wheels), TMPDIR=str(tmp_path), PYTHONPATH="", **({"PYTHON": str(python)} if python else {}))
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120)


def test_gpu_env_installs_the_carried_wheels_where_the_interpreter_lacks_a_module(tmp_path):
    """The GPU machine's image has no megatron-core and no network: the scripts install the wheels of .whl
    (benchmarks/gpu_wheels.sh) into a folder of their own, leaving the interpreter's packages as they are."""
    wheels = _probe_wheel(tmp_path / "whl").parent
    proc = _gpu_env(tmp_path, wheels, "spindle_gpu_probe")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == "42"
    assert "lacks spindle_gpu_probe" in proc.stdout
    assert (tmp_path / "spindle-gpu-site" / "spindle_gpu_probe.py").is_file()


def test_gpu_env_names_the_missing_module_and_the_fix_in_one_line(tmp_path):
    (tmp_path / "whl").mkdir()
    proc = _gpu_env(tmp_path, tmp_path / "whl", "spindle_gpu_probe")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "cannot import spindle_gpu_probe" in proc.stderr and "benchmarks/gpu_wheels.sh" in proc.stderr


def test_gpu_wheels_rejects_a_bad_python_version_before_downloading(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_wheels.sh"), "--python-version", "twelve",
                           "--dest", str(tmp_path / "whl")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "--python-version must look like 3.12" in proc.stderr
    assert not (tmp_path / "whl").exists()


def test_gpu_env_unpacks_the_wheels_where_the_interpreter_has_no_pip(tmp_path):
    import venv

    venv.EnvBuilder(with_pip=False).create(tmp_path / "nopip")
    wheels = _probe_wheel(tmp_path / "whl").parent
    proc = _gpu_env(tmp_path, wheels, "spindle_gpu_probe", python=tmp_path / "nopip" / "bin" / "python")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == "42"


def test_a_failing_measurement_step_keeps_the_others_and_is_reported(tmp_path, monkeypatch, capsys):
    """A GPU session is rare: one step that breaks there (a kernel missing on that GPU, say) must not cost the
    others' measurements. The run still writes every other point, names the failure, and exits non-zero."""
    from script_loader import load_script

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    script = load_script("benchmarks/gpu_validate.py")

    def broken_copy(*args):
        yield from ()
        raise RuntimeError("no such kernel on this device")

    monkeypatch.setattr(script, "copy_point", broken_copy)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert script.main(["--device", "cpu", "--dry-run", "--out-dir", str(tmp_path)]) == 1
    doc = json.loads((tmp_path / "gpu_validate.json").read_text())
    assert doc["failed"] == {"copy": "RuntimeError: no such kernel on this device"}
    names = [p["point"] for p in doc["points"]]
    assert any(n.startswith("gemm") for n in names) and any("layer" in n for n in names)
    assert not any(n.startswith("copy") for n in names)
    assert "FAILED copy: RuntimeError" in (tmp_path / "gpu_validate.txt").read_text()
    assert "Traceback" in capsys.readouterr().err  # the step's traceback is shown: what to fix
