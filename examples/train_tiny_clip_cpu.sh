#!/bin/bash
# Train the tiny Multitask-CLIP (4 contrastive tasks, 4 towers) on CPU with 2 gloo processes.
#
#   bash examples/train_tiny_clip_cpu.sh [extra pretrain_multitask.py flags]
#
# Mock data unless a --data-path TASK=PATH is given (then give one per task: they replace the mock data).
# Any flag given on the command line is appended last and so overrides the ones below (e.g. --train-iters 40).
#
# Environment: CHECKPOINT_PATH (default: ./checkpoints/tiny_clip_cpu), TENSORBOARD_LOGS_PATH, NPROC_PER_NODE
# (default 2), TRAIN_ITERS (default 10), MASTER_PORT (default: random), PRECISION (default fp32: bf16 and fp16
# need GPUs), PYTHON / TORCHRUN (default: the repository's .venv, else torchrun from PATH); see examples/common.sh.

set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PRECISION=${PRECISION:-fp32}
MOCK_DATA_SAMPLES=${MOCK_DATA_SAMPLES:-64}
source "$SCRIPT_DIR/common.sh" "$@"  # ROOT_DIR, LAUNCHER, PRECISION_ARGS, DATA_ARGS

CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/tiny_clip_cpu}
TENSORBOARD_LOGS_PATH=${TENSORBOARD_LOGS_PATH:-$CHECKPOINT_PATH/tensorboard}
NPROC_PER_NODE=${NPROC_PER_NODE:-2}
TRAIN_ITERS=${TRAIN_ITERS:-10}
# below Linux's default ephemeral range (32768-60999), where the ranks' own connections could hold the port
MASTER_PORT=${MASTER_PORT:-$(( 20000 + RANDOM % 12000 ))}

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

DISTRIBUTED_ARGS=(
    --nproc-per-node "$NPROC_PER_NODE"
    --nnodes 1
    --master-addr 127.0.0.1
    --master-port "$MASTER_PORT"
)

MODEL_ARGS=(
    --workload tiny-clip
)

SPINDLE_ARGS=(
    --spindle-planner wavefront
    --gpu-type CPU
    --gpus-per-node "$NPROC_PER_NODE"
)

TRAINING_ARGS=(
    --train-iters "$TRAIN_ITERS"
    --lr 2e-3
    --min-lr 2e-4
    --lr-warmup-iters 2
    --lr-decay-style cosine
    --weight-decay 0.01
    --seed 1234
    "${PRECISION_ARGS[@]}"
)

CHECKPOINT_ARGS=(
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --save-interval 5
)

LOGGING_ARGS=(
    --log-interval 1
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
