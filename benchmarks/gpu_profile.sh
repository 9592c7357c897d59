#!/usr/bin/env bash
# Profile one encoder MetaOp and the LLM MetaOp of a realistic workload on a GPU machine and print the achieved
# TFLOP/s (analytic FLOPs of AnalyticCostModel.flops / measured seconds, per device).
#
#   benchmarks/gpu_profile.sh                      # qwen-val task "vl": vl/vision (ViT-bigG) and vl/llm (Qwen-7B)
#   benchmarks/gpu_profile.sh --nproc 8            # same under torchrun on 8 GPUs (adds tp = 2, 4, 8 points)
#   benchmarks/gpu_profile.sh --device cpu         # dry run of the same steps on tiny-vlm on the CPU
#
# Options: --device cuda|cpu (default cuda), --nproc N (ranks; default 1), --out-dir DIR (default .),
#          --layers L (operators timed per MetaOp; default 1). Env: PYTHON (interpreter), GPU_TYPE (built-in
#          node type when the device name is not recognised), EXTRA_ARGS (more tools/profile_metaops.py flags),
#          WHEELS (wheels to install where the interpreter lacks megatron-core: benchmarks/gpu_env.sh).
# Writes DIR/gpu_profile.json (a profile the planner can load with --spindle-profile) and DIR/gpu_profile.log.
set -euo pipefail

DEVICE=cuda
NPROC=1
OUT_DIR=.
LAYERS=1
while [[ $# -gt 0 ]]; do
    case "$1" in
        --device) DEVICE="$2"; shift 2 ;;
        --nproc) NPROC="$2"; shift 2 ;;
        --out-dir) OUT_DIR="$2"; shift 2 ;;
        --layers) LAYERS="$2"; shift 2 ;;
        -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "gpu_profile.sh: unknown option $1" >&2; exit 2 ;;
    esac
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benchmarks/gpu_env.sh
source "$ROOT/benchmarks/gpu_env.sh"
gpu_env_setup gpu_profile.sh torch megatron.core yaml
mkdir -p "$OUT_DIR"
OUT="$OUT_DIR/gpu_profile.json"
LOG="$OUT_DIR/gpu_profile.log"

if [[ "$DEVICE" == cuda ]]; then
    # informative only: a query the driver refuses must not end the run (set -e)
    command -v nvidia-smi >/dev/null && { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true; }
    WORKLOAD=qwen-val
    TASKS=vl
    METAOPS="vl/vision,vl/llm"
    # Target: one 8-GPU node; dp up to 8 is emulated on each rank (B/dp samples), tp needs real ranks.
    ARGS=(--num-gpus 8 --gpus-per-node 8 --bf16 --profile-max-n 8 --profile-warmup 3 --profile-repeats 10)
    [[ -n "${GPU_TYPE:-}" ]] && ARGS+=(--gpu-type "$GPU_TYPE")
elif [[ "$DEVICE" == cpu ]]; then
    WORKLOAD=tiny-vlm
    TASKS=caption
    METAOPS="caption/vision,caption/llm"
    ARGS=(--num-gpus 2 --profile-warmup 1 --profile-repeats 2)
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # oversubscribed CPU threads make timings meaningless
else
    echo "gpu_profile.sh: --device must be cuda or cpu" >&2
    exit 2
fi

if [[ "$NPROC" -gt 1 ]]; then
    LAUNCH=("$(dirname "$PYTHON")/torchrun" --standalone --nproc-per-node "$NPROC")
else
    LAUNCH=("$PYTHON")
fi

echo "gpu_profile: $WORKLOAD [$TASKS] MetaOps $METAOPS on $DEVICE x $NPROC, $LAYERS layer(s) per MetaOp"
# shellcheck disable=SC2086
"${LAUNCH[@]}" "$ROOT/tools/profile_metaops.py" --workload "$WORKLOAD" --tasks "$TASKS" --device "$DEVICE" \
    --profile-metaops "$METAOPS" --profile-layers "$LAYERS" --no-profile-cache --report-tflops \
    --out "$OUT" "${ARGS[@]}" ${EXTRA_ARGS:-} 2>&1 | grep -v -e "warnings.warn" -e "UserWarning" | tee "$LOG"

"$PYTHON" - "$OUT" <<'PY'
import json
import sys

doc = json.load(open(sys.argv[1]))
peak = doc["cluster"]["gpu"]["peak_flops"]
print(f"\nachieved TFLOP/s per device on {doc['hardware']['device']['name']} "
      f"(peak {peak / 1e12:.0f} TFLOP/s for {doc['gpu']}):")
print(f"  {'MetaOp':<16}{'tp':>4}{'dp':>4}{'samples':>9}{'ms/op':>10}{'TFLOP/s':>10}{'of peak':>9}")
batch = {}
for m in doc["measurements"]:
    tflops = m["flops"] / (m["tp"] * m["dp"]) / m["compute_seconds"] / 1e12
    share = 100 * tflops * 1e12 / peak
    print(f"  {m['metaop']:<16}{m['tp']:>4}{m['dp']:>4}{'B/' + str(m['dp']):>9}"
          f"{m['compute_seconds'] * 1e3:>10.2f}{tflops:>10.3g}{share:>8.2g}%")
PY
