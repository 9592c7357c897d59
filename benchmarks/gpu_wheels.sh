#!/usr/bin/env bash
# Download, on a machine that reaches PyPI, the wheels the GPU scripts need and the GPU machine's image lacks, into
# .whl/ at the repository root (ignored by git). benchmarks/gpu_validate.sh and gpu_profile.sh install what lies
# there, without any network, where their interpreter cannot import megatron-core (benchmarks/gpu_env.sh). The device machines of our workplace have python3.12 with a CUDA torch, numpy,
# packaging and pyyaml, but no megatron-core (README.md, "Profiling, conversion, benchmarks"); nothing can be
# fetched there.
#
#   benchmarks/gpu_wheels.sh                        # for the GPU image's Python 3.12, Linux x86_64
#   benchmarks/gpu_wheels.sh --python-version 3.11  # for another interpreter (e.g. to try the install here)
#   benchmarks/gpu_wheels.sh --dest DIR
#
# Then carry .whl with the run, e.g. the device tool's run(command="benchmarks/gpu_validate.sh", carry=[".whl"]).
# Only megatron-core is fetched: its own requirements (torch, numpy, packaging) are on the image, and the GPU
# scripts import nothing of ours that needs ortools. Transformer Engine is left out (hundreds of MB); the layers
# then use megatron-core's local spec, as on CPU.
set -euo pipefail

PYTHON_VERSION=3.12
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.whl"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --python-version) PYTHON_VERSION="$2"; shift 2 ;;
        --dest) DEST="$2"; shift 2 ;;
        -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "gpu_wheels.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
if [[ ! "$PYTHON_VERSION" =~ ^3\.[0-9]+$ ]]; then
    echo "gpu_wheels.sh: --python-version must look like 3.12, got '$PYTHON_VERSION'" >&2
    exit 2
fi
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

# the pins of pyproject.toml, so the GPU run measures what the project runs
MEGATRON_CORE="$(grep -o '"megatron-core==[^"]*"' "$ROOT/pyproject.toml" | tr -d '"')"
[[ -n "$MEGATRON_CORE" ]] || { echo "gpu_wheels.sh: no megatron-core pin in pyproject.toml" >&2; exit 1; }

PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64; do
    PLATFORMS+=(--platform "$p")
done
# downloaded beside, then moved in: an interrupted download leaves DEST as it was
STAGE="$(mktemp -d "${TMPDIR:-/tmp}/gpu_wheels.XXXXXX")"
trap 'rm -rf "$STAGE"' EXIT
echo "downloading $MEGATRON_CORE for CPython $PYTHON_VERSION, Linux x86_64 ..."
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
    "${PLATFORMS[@]}" -d "$STAGE" "$MEGATRON_CORE"
mkdir -p "$DEST"
rm -f "$DEST"/megatron_core-*.whl  # one version only: two would stop the install
mv "$STAGE"/*.whl "$DEST"/
ls -l "$DEST"
du -sh "$DEST"
