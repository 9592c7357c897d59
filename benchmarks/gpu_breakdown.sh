#!/usr/bin/env bash
# Where Multitask-CLIP-4's iteration time goes on one GPU (issue 13, after gpu_validate.sh measured 3.5x the
# prediction): the runtime trains it at global batch 128 with per-wave and per-phase timers (--timing-log-level 2,
# CUDA synchronised after each wave) on the analytic plan, its last two iterations under the PyTorch profiler
# (--profile --use-pytorch-profiler: tables of the costliest operators by host and by device time end that log);
# then tools/profile_metaops.py measures every MetaOp on this GPU and the runtime trains again on the plan made
# from that profile (--spindle-profile), so the prediction from measured scaling curves meets the measured
# iteration too; last, benchmarks/host_ops.py counts the operations one step dispatches and times them. A first
# profile, taken before anything else runs, is held against the later one (benchmarks/profile_compare.py). At
# most 8 minutes.
#
#   benchmarks/gpu_breakdown.sh                     # CUDA, GPU type detected from the device name
#   benchmarks/gpu_breakdown.sh --gpu-type H100
#   benchmarks/gpu_breakdown.sh --dry-run           # tiny-clip on the CPU, a few iterations
#
# Options: --dry-run, --gpu-type X, --out-dir DIR (default: $OUT when set, else benchmarks/out/gpu_breakdown).
# Env: PYTHON, WHEELS (benchmarks/gpu_env.sh). Writes DIR/breakdown_{analytic,profiled}.log, DIR/profile.json,
# DIR/profile.log, DIR/profile_first.{json,log}, DIR/profile_compare.txt, DIR/gpu_breakdown.json (both runs'
# measured and predicted iteration times) and DIR/host_ops.{txt,json,log}.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benchmarks/gpu_env.sh
source "$ROOT/benchmarks/gpu_env.sh"
gpu_script_options gpu_breakdown.sh "$@"  # DEVICE, GPU_TYPE, OUT_DIR
gpu_env_setup gpu_breakdown.sh torch megatron.core yaml
OUT_DIR="${OUT_DIR:-$ROOT/benchmarks/out/gpu_breakdown}"
mkdir -p "$OUT_DIR"
rm -f "$OUT_DIR/gpu_breakdown.json"

if [[ "$DEVICE" == cuda ]]; then
    if [[ -z "$GPU_TYPE" ]]; then
        # gpu_validate.py's detection (a namespace import: benchmarks/ is no package)
        GPU_TYPE="$(PYTHONPATH="$ROOT/benchmarks:$PYTHONPATH" "$PYTHON" -c \
            'import torch, gpu_validate; print(gpu_validate.detect_gpu_type(torch))')"
    fi
    WORKLOAD=(--workload clip-4 --global-batch-size 128 --bf16)
    TRAIN=(--train-iters 8 --log-interval 2 --log-throughput --num-workers 4)
    # two more iterations on the analytic plan, under the PyTorch profiler (the log's last interval)
    PROFILED_ITERATIONS=(--train-iters 10 --profile-step-start 8 --profile-step-end 10)
    PROFILE=(--profile-warmup 2 --profile-repeats 5)
    # one task of two small host-bound towers (12 layers each), at its share of the global batch 128
    HOST_OPS=(--workload clip-4 --tasks audio_thermal --global-batch-size 32 --device cuda --timed-steps 5)
    LIMIT_TRAIN=120 LIMIT_PROFILE=180 LIMIT_OPS=150
else
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # oversubscribed CPU threads make timings meaningless
    GPU_TYPE=CPU
    WORKLOAD=(--workload tiny-clip)
    TRAIN=(--train-iters 4 --log-interval 2)
    PROFILED_ITERATIONS=(--train-iters 5 --profile-step-start 4 --profile-step-end 5)
    PROFILE=(--profile-warmup 1 --profile-repeats 2)
    HOST_OPS=(--workload tiny-clip --device cpu --warmup 1 --timed-steps 1)
    LIMIT_TRAIN=180 LIMIT_PROFILE=180 LIMIT_OPS=120
fi
COMMON=(--gpus-per-node 1 --gpu-type "$GPU_TYPE")

FAILED=0
train() {  # NAME (of the plan) FLAGS...
    local name="$1"
    shift
    gpu_train gpu_breakdown "$name" "$LIMIT_TRAIN" "$OUT_DIR/breakdown_$name.log" "$OUT_DIR/gpu_breakdown.json" \
        --timing-log-level 2 "${COMMON[@]}" "${WORKLOAD[@]}" "${TRAIN[@]}" "$@" || FAILED=$?
}

profile() {  # NAME: every MetaOp measured into OUT_DIR/NAME.json (log NAME.log); a failure ends the script
    set +e
    timeout "$LIMIT_PROFILE" "$PYTHON" "$ROOT/tools/profile_metaops.py" "${COMMON[@]}" "${WORKLOAD[@]}" \
        --device "$DEVICE" --num-gpus 1 --profile-max-n 1 --profile-layers 1 --no-profile-cache "${PROFILE[@]}" \
        --out "$OUT_DIR/$1.json" > "$OUT_DIR/$1.log" 2>&1
    local rc=$?
    set -e
    if [[ "$rc" -ne 0 ]]; then
        echo "[gpu_breakdown] profiling FAILED (exit $rc); the end of $OUT_DIR/$1.log:"
        gpu_log_tail "$OUT_DIR/$1.log"
        exit "$rc"
    fi
}

# a profile on the GPU as the script finds it, to hold against the one taken after the training run: two H100
# profiles disagreed 2.8x on the largest layer before the profiler warmed the GPU itself (fortieth session)
echo "[gpu_breakdown] profiling every MetaOp on $DEVICE, first thing ..."
profile profile_first
train analytic --profile --use-pytorch-profiler "${PROFILED_ITERATIONS[@]}"
echo "[gpu_breakdown] profiling every MetaOp on $DEVICE ..."
profile profile
"$PYTHON" "$ROOT/benchmarks/profile_compare.py" "$OUT_DIR/profile_first.json" "$OUT_DIR/profile.json" \
    --out "$OUT_DIR/profile_compare.txt" | tail -n 1 || FAILED=$?
train profiled --spindle-profile "$OUT_DIR/profile.json"
# the operations one step dispatches (the runtime's own, the model's, the optimizer's) and, timed, the host's
# time per operation where the step is host-bound
echo "[gpu_breakdown] counting a step's host operations on $DEVICE ..."
timeout "$LIMIT_OPS" "$PYTHON" "$ROOT/benchmarks/host_ops.py" "${HOST_OPS[@]}" --out-dir "$OUT_DIR" \
    > "$OUT_DIR/host_ops.log" 2>&1 && rc=0 || rc=$?
if [[ "$rc" -ne 0 ]]; then
    echo "[gpu_breakdown] host_ops FAILED (exit $rc); the end of $OUT_DIR/host_ops.log:"
    gpu_log_tail "$OUT_DIR/host_ops.log"
    FAILED=$rc
fi
exit "$FAILED"
