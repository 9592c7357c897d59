#!/usr/bin/env bash
# Measure the cost model's calibration points on one GPU and print them against tools/estimate.py (issue 13, GPU):
# bf16 GEMMs, an HBM copy, FlashAttention-2 fwd + bwd, and the runtime's megatron-core layers (Transformer Engine
# when it imports): a ViT-H encoder layer at micro-batches 8 / 32 / 64 and a Llama-3-8B-sized LLM layer at 1 / 2 / 4,
# and the host's launch floor (the same layers at tiny shapes, benchmarks/host_floor.py); then a training smoke run
# of the runtime (tiny-clip, one process under torchrun: NCCL and bf16, at most 120 s).
# Well under 9 minutes on an H200 or an A100-class GPU (measurements: budget 420 s, then they skip the rest).
#
# NOTE: it has never run on a GPU yet; only the CPU dry run (tests/tools/test_gpu_validate.py) has. When a GPU machine
# is at hand, run it and commit its output to benchmarks/results/.
#
#   benchmarks/gpu_validate.sh                      # CUDA, GPU type detected from the device name
#   benchmarks/gpu_validate.sh --gpu-type H100      # when the name is not recognised
#   benchmarks/gpu_validate.sh --dry-run            # tiny shapes on the CPU, a few iterations
#
# Options: --dry-run, --gpu-type X, --out-dir DIR (default: $OUT when set, else benchmarks/out/gpu_validate).
# Env: PYTHON (interpreter), WHEELS (default .whl). Writes DIR/gpu_validate.json, DIR/gpu_validate.txt,
# DIR/gpu_validate.log and DIR/gpu_train_smoke.log.
#
# Where the interpreter lacks megatron-core (this workplace's GPU image, which has no network), it installs the
# wheels of .whl first (benchmarks/gpu_env.sh): run benchmarks/gpu_wheels.sh here beforehand and carry .whl, i.e.
# the device tool's run(command="benchmarks/gpu_validate.sh", carry=[".whl"], timeout_s=590).
set -euo pipefail

DEVICE=cuda
ARGS=()
OUT_DIR="${OUT:-}"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) DEVICE=cpu; shift ;;
        --gpu-type) ARGS+=(--gpu-type "$2"); shift 2 ;;
        --out-dir) OUT_DIR="$2"; shift 2 ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "gpu_validate.sh: unknown option $1" >&2; exit 2 ;;
    esac
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benchmarks/gpu_env.sh
source "$ROOT/benchmarks/gpu_env.sh"
gpu_env_setup gpu_validate.sh torch megatron.core yaml
OUT_DIR="${OUT_DIR:-$ROOT/benchmarks/out/gpu_validate}"
mkdir -p "$OUT_DIR"

if [[ "$DEVICE" == cuda ]]; then
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
    ARGS+=(--device cuda)
else
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # oversubscribed CPU threads make timings meaningless
    ARGS+=(--device cpu --dry-run)
fi

"$PYTHON" "$ROOT/benchmarks/gpu_validate.py" --out-dir "$OUT_DIR" "${ARGS[@]}" 2>&1 \
    | grep -v -e "warnings.warn" -e "UserWarning" | tee "$OUT_DIR/gpu_validate.log"

# The runtime's own path on this device: plan, build, train tiny-clip on mock data under torchrun (one process;
# NCCL and bf16 on a GPU, gloo and fp32 in the dry run). The measurements above are written already; a failure
# here is reported and ends the script non-zero. The wavefront planner: the GPU image has no ortools.
SMOKE_LOG="$OUT_DIR/gpu_train_smoke.log"
SMOKE=(--workload tiny-clip --mock-data --spindle-planner wavefront --gpus-per-node 1 --log-interval 2 --seed 1234)
if [[ "$DEVICE" == cuda ]]; then
    SMOKE+=(--train-iters 10 --bf16); SMOKE_LIMIT=120
else
    SMOKE+=(--train-iters 2 --gpu-type CPU); SMOKE_LIMIT=180
fi
echo "[gpu_validate] training smoke: tiny-clip, one process on $DEVICE, ${SMOKE[*]:2} ..."
set +e
timeout "$SMOKE_LIMIT" "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 \
    "$ROOT/pretrain_multitask.py" "${SMOKE[@]}" > "$SMOKE_LOG" 2>&1
SMOKE_RC=$?
set -e
grep -e "total loss" "$SMOKE_LOG" | sed -e 's/ | number of.*//' | tail -n 2 || true
if [[ "$SMOKE_RC" -ne 0 ]]; then
    echo "[gpu_validate] training smoke FAILED (exit $SMOKE_RC); the end of $SMOKE_LOG:"
    grep -v -e "warnings.warn" -e "UserWarning" "$SMOKE_LOG" | tail -n 25
    exit "$SMOKE_RC"
fi
echo "[gpu_validate] training smoke passed (log: $SMOKE_LOG)"
