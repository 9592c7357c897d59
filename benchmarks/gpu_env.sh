# Sourced by the GPU scripts (gpu_validate.sh, gpu_profile.sh, gpu_breakdown.sh): the interpreter and its import
# path; the training run and the failure report that gpu_validate.sh and gpu_breakdown.sh share.
#
# gpu_env_setup SCRIPT MODULE... sets PYTHON (unless set: the repository's .venv, else python3) and puts the
# repository on PYTHONPATH. Where that interpreter cannot import a MODULE (a GPU machine's image has torch but not
# megatron-core, and no network), it installs the wheels in WHEELS (default: .whl at the repository root, filled by
# benchmarks/gpu_wheels.sh on a machine that reaches PyPI) into a folder of its own (with pip, or unpacked where the
# interpreter has none) and puts that on PYTHONPATH too.
# Anything still missing ends the script with one line that says what to do. Needs ROOT (the repository).
#
# gpu_script_options SCRIPT "$@" parses the options gpu_validate.sh and gpu_breakdown.sh share: --dry-run
# (DEVICE=cpu, else cuda), --gpu-type X (GPU_TYPE, empty: detected), --out-dir DIR (OUT_DIR, default $OUT), -h.

gpu_script_options() {
    local script="$1"
    shift
    DEVICE=cuda GPU_TYPE= OUT_DIR="${OUT:-}"
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --dry-run) DEVICE=cpu; shift ;;
            --gpu-type) GPU_TYPE="$2"; shift 2 ;;
            --out-dir) OUT_DIR="$2"; shift 2 ;;
            -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
            *) echo "$script: unknown option $1" >&2; exit 2 ;;
        esac
    done
}

gpu_env_setup() {
    local script="$1"
    shift
    if [[ -z "${PYTHON:-}" ]]; then
        if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
    fi
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    local wheels="${WHEELS:-$ROOT/.whl}" missing
    missing="$(_gpu_env_missing "$@")"
    if [[ -n "$missing" ]] && compgen -G "$wheels/*.whl" >/dev/null; then
        local site="${TMPDIR:-/tmp}/spindle-gpu-site" log
        echo "$script: $PYTHON lacks $missing; installing the wheels of $wheels into $site"
        if ! "$PYTHON" -m pip --version >/dev/null 2>&1; then
            # no pip in that interpreter: a wheel is a zip of what goes into site-packages
            log="$("$PYTHON" - "$site" "$wheels"/*.whl 2>&1 <<'PY'
import sys
import zipfile

for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])
PY
)" || { echo "$script: the wheels of $wheels do not unpack: $(tail -n 1 <<<"$log")" >&2; exit 1; }
        elif ! log="$("$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target "$site" "$wheels"/*.whl 2>&1)"; then
            local version
            version="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
            echo "$script: the wheels of $wheels do not install for $PYTHON ($(tail -n 1 <<<"$log")); fetch" \
                 "them for its Python: benchmarks/gpu_wheels.sh --python-version $version" >&2
            exit 1
        fi
        export PYTHONPATH="$PYTHONPATH:$site"
        missing="$(_gpu_env_missing "$@")"
    fi
    if [[ -n "$missing" ]]; then
        echo "$script: $PYTHON cannot import $missing; run benchmarks/gpu_wheels.sh where PyPI is reachable and" \
             "bring $wheels along (the device tool: carry=[\".whl\"])" >&2
        exit 1
    fi
}

# The modules of "$@" that $PYTHON cannot import, space-separated (empty when all import).
_gpu_env_missing() {
    "$PYTHON" - "$@" <<'PY'
import importlib
import sys

missing = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ImportError:
        missing.append(name)
print(" ".join(missing))
PY
}

# The end of a log without Python's warnings: what a failed step shows.
gpu_log_tail() {
    grep -v -e "warnings.warn" -e "UserWarning" "$1" | tail -n 25
}

# gpu_train SCRIPT NAME LIMIT LOG SUMMARY FLAGS...: pretrain_multitask.py under torchrun, one process, mock data,
# the wavefront planner (the GPU image has no ortools), seed 1234 and FLAGS, stopped after LIMIT seconds, its output
# in LOG; the run is added to the JSON file SUMMARY under NAME (benchmarks/train_log_summary.py). A failure prints
# the end of LOG. Returns the run's exit status. Needs ROOT and PYTHON (gpu_env_setup).
gpu_train() {
    local script="$1" name="$2" limit="$3" log="$4" summary="$5" rc
    shift 5
    echo "[$script] training run $name: $* ..."
    timeout "$limit" "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 \
        "$ROOT/pretrain_multitask.py" --mock-data --spindle-planner wavefront --seed 1234 "$@" > "$log" 2>&1 \
        && rc=0 || rc=$?
    "$PYTHON" "$ROOT/benchmarks/train_log_summary.py" "$log" --name "$name" --json "$summary" || true
    if [[ "$rc" -ne 0 ]]; then
        echo "[$script] training run $name FAILED (exit $rc); the end of $log:"
        gpu_log_tail "$log"
    fi
    return "$rc"
}
