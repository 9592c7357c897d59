#!/usr/bin/env bash
# Measure the cost model's calibration points on one GPU and print them against tools/estimate.py (issue 13, GPU):
# bf16 GEMMs, an HBM copy, FlashAttention-2 fwd + bwd, and the runtime's megatron-core layers (Transformer Engine
# when it imports): a ViT-B/16 layer at micro-batches 64 / 192, a ViT-H encoder layer at 8 / 32 / 64 and a
# Llama-3-8B-sized LLM layer at 1 / 2 / 4, and the host's launch floor (the same layers at tiny shapes,
# benchmarks/host_floor.py); then the runtime trains under torchrun, NCCL and bf16: tiny-clip (smoke, at most 90 s)
# and Multitask-CLIP-4 at global batch 128 (at most 120 s; its measured iteration time against the plan's prediction
# for this GPU), and tiny-vlm with dropout (at most 60 s); their peak memory against the plan's is in gpu_train.json.
# At most 9 minutes (measurements: budget 210 s, then they skip the rest; expected 1-2 min on an H200).
#
# Ran on one H200 in the twenty-ninth session and on one H100 in the fortieth (output in benchmarks/results/gpu/ and
# gpu/h100/, discussed in benchmarks/results/README.md); the CPU dry run is tested (tests/tools/test_gpu_validate.py).
# On a GPU machine, run it and commit its output to benchmarks/results/gpu/; benchmarks/gpu_session.sh runs it and
# gpu_breakdown.sh in one call and packs their ~20 files into one archive.
#
#   benchmarks/gpu_validate.sh                      # CUDA, GPU type detected from the device name
#   benchmarks/gpu_validate.sh --gpu-type H100      # when the name is not recognised
#   benchmarks/gpu_validate.sh --dry-run            # tiny shapes on the CPU, a few iterations
#
# Options: --dry-run, --gpu-type X, --out-dir DIR (default: $OUT when set, else benchmarks/out/gpu_validate).
# Env: PYTHON (interpreter), WHEELS (default .whl). Writes DIR/gpu_validate.json, DIR/gpu_validate.txt,
# DIR/gpu_validate.log, DIR/gpu_train_*.log and DIR/gpu_train.json.
#
# Where the interpreter lacks megatron-core (this workplace's GPU image, which has no network), it installs the
# wheels of .whl first (benchmarks/gpu_env.sh): run benchmarks/gpu_wheels.sh here beforehand and carry .whl, i.e.
# the device tool's run(command="benchmarks/gpu_validate.sh", carry=[".whl"], timeout_s=540).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benchmarks/gpu_env.sh
source "$ROOT/benchmarks/gpu_env.sh"
gpu_script_options gpu_validate.sh "$@"  # DEVICE, GPU_TYPE, OUT_DIR
ARGS=()
if [[ -n "$GPU_TYPE" ]]; then ARGS+=(--gpu-type "$GPU_TYPE"); fi
gpu_env_setup gpu_validate.sh torch megatron.core yaml
OUT_DIR="${OUT_DIR:-$ROOT/benchmarks/out/gpu_validate}"
mkdir -p "$OUT_DIR"

if [[ "$DEVICE" == cuda ]]; then
    # informative only: a query the driver refuses must not end the run (set -e)
    command -v nvidia-smi >/dev/null && { nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version \
        --format=csv || true; }
    ARGS+=(--device cuda)
else
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # oversubscribed CPU threads make timings meaningless
    ARGS+=(--device cpu --dry-run)
fi

rm -f "$OUT_DIR/gpu_validate.json"
set +e  # a failed measurement step is reported at the end; the training runs below still run
"$PYTHON" "$ROOT/benchmarks/gpu_validate.py" --out-dir "$OUT_DIR" "${ARGS[@]}" 2>&1 \
    | grep -v -e "warnings.warn" -e "UserWarning" | tee "$OUT_DIR/gpu_validate.log"
MEASURE_RC=${PIPESTATUS[0]}
set -e
if [[ ! -f "$OUT_DIR/gpu_validate.json" ]]; then
    echo "[gpu_validate] the measurements stopped before writing anything (exit $MEASURE_RC): see above"
    exit "$MEASURE_RC"
fi

# The runtime itself on this device: pretrain_multitask.py under torchrun, one process (NCCL and bf16 on a GPU,
# gloo and fp32 in the dry run), with the wavefront planner (the GPU image has no ortools). A smoke run of
# tiny-clip, then Multitask-CLIP-4's real towers at a small batch, whose measured iteration time is held against the
# plan's prediction for this GPU type (the performance model end to end). The measurements above are written
# already (a step that failed there is listed in them); a failure is reported and ends the script non-zero once
# both runs have run.
GPU_TYPE="$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["meta"]["gpu_type"])' \
    "$OUT_DIR/gpu_validate.json")"
TRAIN_FAILED=0
rm -f "$OUT_DIR/gpu_train.json"  # the runs below add to it: nothing of an earlier run in this folder stays
train_run() {  # NAME LIMIT_SECONDS FLAGS...
    local name="$1" limit="$2"
    shift 2
    gpu_train gpu_validate "$name" "$limit" "$OUT_DIR/gpu_train_$name.log" "$OUT_DIR/gpu_train.json" \
        --gpus-per-node 1 --gpu-type "$GPU_TYPE" "$@" || TRAIN_FAILED=$?
}
if [[ "$DEVICE" == cuda ]]; then
    train_run smoke 90 --workload tiny-clip --train-iters 10 --log-interval 2 --bf16
    # 4 data workers prepare the next iteration's mock batches during the step (the model has no data loading)
    train_run clip4 120 --workload clip-4 --global-batch-size 128 --train-iters 8 --log-interval 2 --bf16 \
        --log-throughput --num-workers 4
    # dropout on CUDA: the masks' generator states (models/dropout.py) on the device, Transformer Engine's
    # attention dropout where TE runs; gradients accumulated and reduced in bf16 over NCCL (--grad-reduce-in-bf16)
    train_run dropout 60 --workload tiny-vlm --train-iters 4 --log-interval 2 --bf16 --hidden-dropout 0.1 \
        --attention-dropout 0.1 --grad-reduce-in-bf16
else
    train_run smoke 180 --workload tiny-clip --train-iters 2 --log-interval 1
    train_run vlm 180 --workload tiny-vlm --train-iters 4 --log-interval 2 --num-workers 2 --grad-reduce-in-bf16
fi
if [[ "$TRAIN_FAILED" -ne 0 ]]; then
    exit "$TRAIN_FAILED"
fi
echo "[gpu_validate] training runs passed (logs and $OUT_DIR/gpu_train.json)"
if [[ "$MEASURE_RC" -ne 0 ]]; then
    echo "[gpu_validate] measurement step(s) FAILED: see FAILED in $OUT_DIR/gpu_validate.txt"
    exit "$MEASURE_RC"
fi
