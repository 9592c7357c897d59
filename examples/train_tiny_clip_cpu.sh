#!/bin/bash
# Train the tiny Multitask-CLIP (4 contrastive tasks, 4 towers) on CPU with 2 gloo processes and mock data.
#
#   bash examples/train_tiny_clip_cpu.sh [extra pretrain_multitask.py flags]
#
# Environment: CHECKPOINT_PATH (default: ./checkpoints/tiny_clip_cpu), TENSORBOARD_LOGS_PATH,
# NPROC_PER_NODE (default 2), TRAIN_ITERS (default 10). Any flag given on the command line is appended last
# and so overrides the ones below (e.g. --train-iters 40 --data-path vision_text=data/vt ...).

set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT_DIR="$(dirname "$SCRIPT_DIR")"
PYTHON=${PYTHON:-python}
if [ -x "$ROOT_DIR/.venv/bin/python" ] && [ "$PYTHON" = python ]; then
    PYTHON="$ROOT_DIR/.venv/bin/python"
fi

CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/tiny_clip_cpu}
TENSORBOARD_LOGS_PATH=${TENSORBOARD_LOGS_PATH:-$CHECKPOINT_PATH/tensorboard}
NPROC_PER_NODE=${NPROC_PER_NODE:-2}
TRAIN_ITERS=${TRAIN_ITERS:-10}
MASTER_PORT=${MASTER_PORT:-$(( 20000 + RANDOM % 20000 ))}

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
)

DATA_ARGS=(
    --mock-data
    --mock-data-samples 64
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

"$PYTHON" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" "$ROOT_DIR/pretrain_multitask.py" \
    "${MODEL_ARGS[@]}" \
    "${SPINDLE_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${CHECKPOINT_ARGS[@]}" \
    "${LOGGING_ARGS[@]}" \
    "$@"
