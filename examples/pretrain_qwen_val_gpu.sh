#!/bin/bash
# QWen-VAL (vision, audio and language tasks on a Qwen LLM backbone with modality encoders) on 4-8 nodes
# of 8 GPUs.
#
# Run the same command on every node:
#   NUM_NODES=4 NODE_RANK=<0..3> MASTER_ADDR=<node 0 address> bash examples/pretrain_qwen_val_gpu.sh \
#       [--data-path TASK=PATH ...] [extra pretrain_multitask.py flags]
#
# Without --data-path flags it trains on mock data. Flags given on the command line come last and override.
# Staged recipes freeze modules from a converted checkpoint (tools/checkpoint/convert.py), e.g. Qwen-VL's first
# stage: --freeze llm --pretrained-checkpoint /ckpt/qwen-val-init (the planner plans for what is frozen).
#
# Environment: GPUS_PER_NODE (8), NUM_NODES, NODE_RANK, MASTER_ADDR, MASTER_PORT (6000), GPU_TYPE (A800-80GB),
# CHECKPOINT_PATH, TENSORBOARD_LOGS_PATH, PRECISION (bf16 | fp16 | fp32; default bf16 when a GPU is visible,
# else fp32, so the script also dry-runs on a CPU machine), PYTHON / TORCHRUN (default: the repository's .venv,
# else torchrun from PATH). See examples/common.sh.
#
# Several nodes: CHECKPOINT_PATH must be on a filesystem shared by all nodes (checked at start), and where a host
# has several network interfaces name the one the nodes reach each other on: NCCL_SOCKET_IFNAME=<if> (and
# GLOO_SOCKET_IFNAME=<if> for gloo).

set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$SCRIPT_DIR/common.sh" "$@"  # ROOT_DIR, LAUNCHER, PRECISION_ARGS, DATA_ARGS

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_NODES=${NUM_NODES:-4}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}

if [ "$NUM_NODES" -lt 4 ] || [ "$NUM_NODES" -gt 8 ]; then
    echo "error: NUM_NODES must be 4..8 for QWen-VAL, got $NUM_NODES" >&2
    exit 2
fi

CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/qwen_val_${NUM_NODES}n}
TENSORBOARD_LOGS_PATH=${TENSORBOARD_LOGS_PATH:-$CHECKPOINT_PATH/tensorboard}
GPU_TYPE=${GPU_TYPE:-A800-80GB}

export CUDA_DEVICE_MAX_CONNECTIONS=1

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE"
    --nnodes "$NUM_NODES"
    --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR"
    --master-port "$MASTER_PORT"
)

MODEL_ARGS=(
    --workload qwen-val
    # Megatron's attention backend: auto is Transformer Engine's choice where TE is installed, else megatron-core's
    # local spec; the plan charges the one that runs (flash | fused | unfused need TE; local never uses it)
    --attention-backend auto
)

SPINDLE_ARGS=(
    --gpus-per-node "$GPUS_PER_NODE"
    --gpu-type "$GPU_TYPE"
    --spindle-planner cpsat
    --spindle-solver-time-limit 120
    --spindle-solver-workers 8
    --spindle-placement spindle
    # Megatron's overlap flags, our defaults (--no-overlap-...: off): gradient buckets reduced during the
    # backward, the distributed optimizer's weight all-gather during the next forward
    --overlap-grad-reduce
    --overlap-param-gather
)

TRAINING_ARGS=(
    --train-iters 10000
    --lr 1e-4
    --min-lr 1e-6
    --lr-warmup-iters 200
    --lr-decay-style cosine
    --weight-decay 0.1
    --adam-beta2 0.95
    --adam-eps 1e-8
    --seed 1234
    # every rank collects garbage at the same iterations instead of stalling alone mid-step (Megatron's flags)
    --manual-gc
    --manual-gc-interval 100
    "${PRECISION_ARGS[@]}"
)

CHECKPOINT_ARGS=(
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --save-interval 1000
)

LOGGING_ARGS=(
    --log-interval 10
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

"${LAUNCHER[@]}" "${DISTRIBUTED_ARGS[@]}" "$ROOT_DIR/pretrain_multitask.py" \
    "${MODEL_ARGS[@]}" \
    "${SPINDLE_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${CHECKPOINT_ARGS[@]}" \
    "${LOGGING_ARGS[@]}" \
    "$@"
