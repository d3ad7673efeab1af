#!/usr/bin/env bash
# The GPU run, in one go (under 10 minutes on an NVIDIA H200 with mlx-cuda-13):
#   1. the parity tests on CUDA against the transformers reference on CUDA (DGEMMA_TEST_DEVICE=gpu);
#   2. the demo's answers under every policy, alone and batched, on the GPU against MLX's CPU
#      (benchmarks/golden_answers.py; float32 products in TF32, as a user's MLX computes them there);
#   3. benchmarks/full_scale.py at 30 layers, bfloat16, random weights made in GPU memory;
#   4. the same at 4 bits (mixed recipe), quantized in GPU memory;
# each printing AR tok/s, step ms at 16..256 positions, a verified round and the crossover, beside
# what policy.py predicts for --device (default H200).
#
#   benchmarks/gpu_suite.sh [--device H200] [--dry-run]
#
# MLX for CUDA comes from /tmp/site when benchmarks/device_wheels.sh installed it there (it goes first on
# PYTHONPATH; DEVELOPERS.md); otherwise the installed mlx is used. --dry-run: the same steps on the
# CPU in seconds, to check the script where there is no GPU (tests/test_full_scale.py runs it): the parity
# tests collected, not run (the CPU suite runs them), and a small model of the released layout (2 layers,
# widths of the pattern preset x 8) for every benchmark. Exits non-zero if any step failed; every step
# runs regardless.
set -uo pipefail
cd "$(dirname "$0")/.."

dry_run=0
device=H200
while (($#)); do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --device) device="$2"; shift ;;
        *) echo "usage: $0 [--device NAME] [--dry-run]" >&2; exit 2 ;;
    esac
    shift
done

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ((dry_run)); then
    export DGEMMA_TEST_DEVICE=cpu
    layers=2
    unquantized=float32  # MLX's CPU matmuls are fast in float32 only
    runs=(--width 8 --prompt 8 --ar-tokens 2 --steps 1 --canvas 16 --draft-length 8 --repeats 1)
    parity_only=(--collect-only)
    answers=(-n 1) accelerator=cpu
    parity_limit=300 run_limit=300
else
    [[ -d /tmp/site ]] && export PYTHONPATH="/tmp/site:$PYTHONPATH"
    export DGEMMA_TEST_DEVICE=gpu
    layers=30
    unquantized=bfloat16
    runs=(--prompt 64 --ar-tokens 16 --steps 8 --canvas 256 --draft-length 32 --warmup --repeats 2)
    parity_only=()
    answers=(-n 3) accelerator=gpu
    parity_limit=240 run_limit=150
fi

python3 - "$dry_run" <<'EOF' || exit 1
import sys
import mlx.core as mx
print(f"gpu_suite: mlx {mx.__version__}, default device {mx.default_device()}")
if sys.argv[1] == "0" and not mx.is_available(mx.gpu):
    sys.exit("gpu_suite: MLX sees no GPU (install mlx-cuda-13, or pass --dry-run)")
EOF
((dry_run)) || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

failed=()
step() {  # step NAME LIMIT COMMAND...: run it under a time limit, note a failure and go on
    local name="$1" limit="$2"
    shift 2
    echo "=== $name"
    local start=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
    ((rc == 0)) || failed+=("$name (exit $rc)")
}

step "parity tests (DGEMMA_TEST_DEVICE=$DGEMMA_TEST_DEVICE)" "$parity_limit" \
    python3 -m pytest -q -p no:cacheprovider "${parity_only[@]}" tests/test_model_parity.py tests/test_ar_parity.py \
    tests/test_sampler_replay.py tests/test_device_paths.py
answers_dir=$(mktemp -d)
trap 'rm -rf "$answers_dir"' EXIT
step "demo answers: $accelerator against cpu" "$run_limit" bash -c \
    'python3 benchmarks/golden_answers.py "${@:2}" --device cpu "$1/cpu.json" &&
     python3 benchmarks/golden_answers.py "${@:2}" --device "$0" "$1/accelerator.json" \
        --against "$1/cpu.json"' "$accelerator" "$answers_dir" "${answers[@]}"
step "full_scale: $layers layers, $unquantized" "$run_limit" \
    python3 benchmarks/full_scale.py --in-memory --layers "$layers" --recipe none --dtype "$unquantized" \
    "${runs[@]}" --sweep --predict-device "$device"
step "full_scale: $layers layers, mixed 4-bit" "$run_limit" \
    python3 benchmarks/full_scale.py --in-memory --layers "$layers" --recipe mixed --bits 4 "${runs[@]}" \
    --sweep --predict-device "$device"

if ((${#failed[@]})); then
    printf 'gpu_suite: FAILED: %s\n' "${failed[@]}"
    exit 1
fi
echo "gpu_suite: all steps passed"
