#!/usr/bin/env bash
# A GPU session in one device call: benchmarks/gpu_validate.sh, then benchmarks/gpu_breakdown.sh, both writing into
# one working folder that is packed into one archive, DIR/gpu_session.tgz, after each script. The device tool
# returns at most 8 files of a call, and the two scripts write about 20 (the fortieth session lost the
# breakdown's profile and host_ops files to that limit and spent a second call on them); the archive after the
# first script keeps its results should the second run past the call's limit.
#
#   benchmarks/gpu_session.sh                       # CUDA, GPU type detected from the device name
#   benchmarks/gpu_session.sh --gpu-type H100       # when the name is not recognised
#   benchmarks/gpu_session.sh --dry-run             # both scripts on the CPU (tiny shapes)
#
# Options: --dry-run, --gpu-type X, --out-dir DIR (default: $OUT when set, else benchmarks/out/gpu_session),
# --budget SECONDS (default 570: the breakdown is stopped where it would run past it, so that the archive is
# written before a device call of 600 s ends). Env: PYTHON, WHEELS (benchmarks/gpu_env.sh); SCRIPTS, the folder
# of the two scripts (default benchmarks/; the tests put stand-ins there).
# With the device tool, after benchmarks/gpu_wheels.sh here: run(command="benchmarks/gpu_session.sh",
# carry=[".whl"], timeout_s=600); then unpack DIR/gpu_session.tgz into benchmarks/results/gpu/<gpu>/.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SCRIPTS="${SCRIPTS:-$ROOT/benchmarks}"
START=$SECONDS
BUDGET=570
PASS=()
OUT_DIR="${OUT:-$ROOT/benchmarks/out/gpu_session}"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) PASS+=(--dry-run); shift ;;
        --gpu-type) PASS+=(--gpu-type "$2"); shift 2 ;;
        --out-dir) OUT_DIR="$2"; shift 2 ;;
        --budget) BUDGET="$2"; shift 2 ;;
        -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "gpu_session.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
if [[ ! "$BUDGET" =~ ^[0-9]+$ ]]; then
    echo "gpu_session.sh: --budget must be whole seconds, got '$BUDGET'" >&2
    exit 2
fi
mkdir -p "$OUT_DIR"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_session.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

pack() {  # the working folder as it stands, written beside and moved in (a kill leaves the last whole archive)
    tar czf "$OUT_DIR/gpu_session.tgz.part" -C "$WORK" .
    mv "$OUT_DIR/gpu_session.tgz.part" "$OUT_DIR/gpu_session.tgz"
    echo "[gpu_session] packed $(find "$WORK" -type f | wc -l) file(s) into $OUT_DIR/gpu_session.tgz"
}

RC=0
# OUT is unset for the scripts: their --out-dir is the working folder
env -u OUT bash "$SCRIPTS/gpu_validate.sh" "${PASS[@]}" --out-dir "$WORK" || RC=$?
echo "[gpu_session] gpu_validate.sh exit $RC after $((SECONDS - START)) s"
pack
LEFT=$((BUDGET - (SECONDS - START)))
if [[ "$LEFT" -lt 60 ]]; then
    echo "[gpu_session] $LEFT s of the budget left: gpu_breakdown.sh not run"
    exit "$RC"
fi
BREAKDOWN_RC=0
env -u OUT timeout "$LEFT" bash "$SCRIPTS/gpu_breakdown.sh" "${PASS[@]}" --out-dir "$WORK" \
    || BREAKDOWN_RC=$?
if [[ "$BREAKDOWN_RC" -eq 124 ]]; then
    echo "[gpu_session] gpu_breakdown.sh stopped at the budget ($BUDGET s); what it wrote is packed"
fi
echo "[gpu_session] gpu_breakdown.sh exit $BREAKDOWN_RC after $((SECONDS - START)) s"
pack
[[ "$RC" -ne 0 ]] && exit "$RC"
exit "$BREAKDOWN_RC"
