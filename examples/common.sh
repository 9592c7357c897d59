# Shared by the launch scripts in examples/ (sourced, not run). Defines, from the environment:
#
#   LAUNCHER        how to start torchrun: $TORCHRUN if set; else $PYTHON -m torch.distributed.run if PYTHON is
#                   set; else the project's virtualenv (<repo>/.venv/bin/python -m torch.distributed.run) if it
#                   exists; else `torchrun` from PATH.
#   PRECISION_ARGS  from PRECISION = bf16 | fp16 | fp32. Default: bf16 when `nvidia-smi -L` lists a GPU, else
#                   fp32 (so a CPU machine can dry-run the GPU scripts). bf16 and fp16 need GPUs.
#   DATA_ARGS       --mock-data (with MOCK_DATA_SAMPLES samples per task) unless the script's arguments contain
#                   a --data-path, which then replaces the mock data instead of conflicting with it.
#
# Multi-node runs: every node must reach the others on the interface the collectives use. Where hosts have
# several interfaces (or share a hostname), name it: GLOO_SOCKET_IFNAME=<if> for gloo (CPU) and
# NCCL_SOCKET_IFNAME=<if> for NCCL's bootstrap; without it gloo may pick an address the other nodes cannot
# reach, and rank 0 waits forever. The checkpoint folder (--save/--load, CHECKPOINT_PATH) must be on a
# filesystem every node shares at the same path (NFS, Lustre, ...): pretrain_multitask.py checks it at start.

_COMMON_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT_DIR="$(dirname "$_COMMON_DIR")"

if [ -n "${TORCHRUN:-}" ]; then
    LAUNCHER=("$TORCHRUN")
elif [ -n "${PYTHON:-}" ]; then
    LAUNCHER=("$PYTHON" -m torch.distributed.run)
elif [ -x "$ROOT_DIR/.venv/bin/python" ]; then
    LAUNCHER=("$ROOT_DIR/.venv/bin/python" -m torch.distributed.run)
elif command -v torchrun >/dev/null 2>&1; then
    LAUNCHER=(torchrun)
else
    echo "error: no $ROOT_DIR/.venv (make install) and no torchrun on PATH; set PYTHON or TORCHRUN" >&2
    exit 2
fi

if [ -z "${PRECISION:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        PRECISION=bf16
    else
        PRECISION=fp32
    fi
fi
case "$PRECISION" in
    bf16) PRECISION_ARGS=(--bf16) ;;
    fp16) PRECISION_ARGS=(--fp16) ;;
    fp32) PRECISION_ARGS=() ;;
    *) echo "error: PRECISION must be bf16, fp16 or fp32, got '$PRECISION'" >&2; exit 2 ;;
esac

DATA_ARGS=(--mock-data --mock-data-samples "${MOCK_DATA_SAMPLES:-100000}")
for _arg in "$@"; do
    case "$_arg" in
        --data-path|--data-path=*) DATA_ARGS=() ;;
    esac
done
