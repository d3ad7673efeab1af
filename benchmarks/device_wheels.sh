#!/usr/bin/env bash
# The wheels a lent NVIDIA machine needs for benchmarks/gpu_suite.sh, carried in two calls under the
# 64 MiB a call may carry (the mlx-cuda-13 wheel alone is ~90 MB). DEVELOPERS.md has the whole recipe.
#
#   benchmarks/device_wheels.sh prepare         # here: .whl-1/ (~60 MB) and .whl/ (the rest), both git-ignored
#   benchmarks/device_wheels.sh stash           # device, call 1 (carry .whl-1): its part to /tmp
#   benchmarks/device_wheels.sh install         # device, call 2 (carry .whl): join, check, install in /tmp/site
#
# After install: PYTHONPATH=/tmp/site:$PWD (gpu_suite.sh sets it when /tmp/site exists).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON_VERSION=3.12
PACKAGES=(mlx==0.32.4 mlx-cuda-13==0.32.4 transformers==5.24.0 "llguidance>=1.9" regex mlx-lm)
SPLIT_BYTES=60000000

case "${1:-}" in
    prepare)
        rm -rf .whl .whl-1 && mkdir -p .whl .whl-1
        platforms=()
        for tag in manylinux_2_35 manylinux_2_31 manylinux_2_28 manylinux_2_17 manylinux2014; do
            platforms+=(--platform "${tag}_x86_64")
        done
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
            "${platforms[@]}" --platform any -d .whl "${PACKAGES[@]}"
        cuda=$(ls .whl/mlx_cuda_13-*.whl)
        (cd .whl && sha256sum "$(basename "$cuda")" > SHA256SUMS)
        head -c "$SPLIT_BYTES" "$cuda" > .whl-1/part
        tail -c +"$((SPLIT_BYTES + 1))" "$cuda" > .whl/part
        echo "$(basename "$cuda")" > .whl/part.name
        rm "$cuda"
        du -sh .whl .whl-1
        ;;
    stash)
        cp .whl-1/part /tmp/mlx-cuda-part-1
        echo "device_wheels: part 1 in /tmp ($(stat -c %s /tmp/mlx-cuda-part-1) bytes)"
        ;;
    install)
        [[ -f /tmp/mlx-cuda-part-1 ]] || { echo "device_wheels: no /tmp/mlx-cuda-part-1: run stash first" >&2; exit 1; }
        wheels=$(mktemp -d)
        cp .whl/*.whl "$wheels"/
        cat /tmp/mlx-cuda-part-1 .whl/part > "$wheels/$(cat .whl/part.name)"
        (cd "$wheels" && sha256sum -c "$OLDPWD/.whl/SHA256SUMS")
        python3 -m pip install -q --no-index --no-deps --target /tmp/site "$wheels"/*.whl
        # libmlx's RPATH is $ORIGIN/../../nvidia/...: the CUDA libraries torch brought
        nvidia=$(python3 -c "import os, torch; print(os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), 'nvidia'))")
        ln -sfn "$nvidia" /tmp/site/nvidia
        PYTHONPATH=/tmp/site python3 -c "import mlx.core as mx; print('device_wheels: mlx', mx.__version__, mx.default_device())"
        ;;
    *)
        echo "usage: $0 prepare | stash | install" >&2
        exit 2
        ;;
esac
