#!/usr/bin/env bash
# The GPU run (an NVIDIA H200 with mlx-cuda-13), its steps by name:
#   parity     the parity tests on CUDA against the transformers reference on CUDA (DGEMMA_TEST_DEVICE=gpu);
#   answers    the demo's answers under every policy, alone and batched, on the GPU against MLX's CPU
#              (benchmarks/golden_answers.py; float32 products in TF32, as a user's MLX computes them there);
#   full       benchmarks/full_scale.py at 30 layers, bfloat16, random weights made in GPU memory;
#   full-4bit  the same at 4 bits (mixed recipe), quantized in GPU memory;
#              each printing AR tok/s, step ms at 16..256 positions, a verified round and the crossover,
#              beside what policy.py predicts for --device (default H200);
#   reference  benchmarks/reference_speed.py --mlx: the transformers reference on CUDA at the same
#              shapes in bfloat16, in the same rows, beside MLX's and MLX's speed-up;
#   profile, profile-4bit
#              benchmarks/profile_step.py: a 256-position step, a verifying pass of 32 and an AR token
#              by layer and part, in bfloat16 and at 4 bits.
#
#   benchmarks/gpu_suite.sh [--device H200] [--dry-run] [--only STEP,STEP...]
#
# --only runs the steps named (e.g. two calls, each under a 10-minute limit: --only parity,full,full-4bit
# then --only reference,profile,profile-4bit).
#
# MLX for CUDA comes from /tmp/site when benchmarks/device_wheels.sh installed it there (it goes first on
# PYTHONPATH; DEVELOPERS.md); otherwise the installed mlx is used. --dry-run: the same steps on the CPU
# in under a minute, to check the script where there is no GPU (tests/test_full_scale.py runs it): the
# parity tests collected, not run (the CPU suite runs them), the answers CPU against CPU, full_scale on a
# small model of the released layout (2 layers, widths of the pattern preset x 8, unquantized in
# float32), the reference and the profile at the small "many-experts" preset's shapes. Exits non-zero if
# any step failed; every step runs regardless.
set -uo pipefail
cd "$(dirname "$0")/.."

steps="parity,answers,full,full-4bit,reference,profile,profile-4bit"
dry_run=0
device=H200
only=$steps
while (($#)); do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --device) device="$2"; shift ;;
        --only) only="$2"; shift ;;
        *) echo "usage: $0 [--device NAME] [--dry-run] [--only STEP,STEP...]" >&2; exit 2 ;;
    esac
    shift
done
for name in ${only//,/ }; do
    [[ ",$steps," == *",$name,"* ]] || { echo "gpu_suite: no step '$name' (the steps: $steps)" >&2; exit 2; }
done

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ((dry_run)); then
    export DGEMMA_TEST_DEVICE=cpu
    layers=2
    unquantized=float32  # MLX's CPU matmuls are fast in float32 only
    forwards=(--prompt 8 --canvas 16 --draft-length 8 --repeats 1)
    shape=("${forwards[@]}" --ar-tokens 2 --steps 1)
    runs=(--width 8 "${shape[@]}")
    parity_only=(--collect-only)
    answers=(-n 1) accelerator=cpu
    torch_device=cpu
    small=(--preset many-experts) small_name="preset many-experts"  # the reference and the profile: seconds, not minutes
    parity_limit=300 run_limit=300 reference_limit=300
else
    [[ -d /tmp/site ]] && export PYTHONPATH="/tmp/site:$PYTHONPATH"
    export DGEMMA_TEST_DEVICE=gpu
    layers=30
    unquantized=bfloat16
    forwards=(--prompt 64 --canvas 256 --draft-length 32 --repeats 2)
    shape=("${forwards[@]}" --ar-tokens 16 --steps 8)
    runs=("${shape[@]}" --warmup)
    parity_only=()
    answers=(-n 3) accelerator=gpu
    torch_device=cuda
    small=(--layers "$layers") small_name="$layers layers"
    parity_limit=240 run_limit=150 reference_limit=300  # the reference step makes both models
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
step() {  # step KEY NAME LIMIT COMMAND...: run it under a time limit (if --only names KEY), note a failure and go on
    local key="$1" name="$2" limit="$3"
    shift 3
    [[ ",$only," == *",$key,"* ]] || return 0
    echo "=== $name"
    local start=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
    ((rc == 0)) || failed+=("$name (exit $rc)")
}

step parity "parity tests (DGEMMA_TEST_DEVICE=$DGEMMA_TEST_DEVICE)" "$parity_limit" \
    python3 -m pytest -q -p no:cacheprovider "${parity_only[@]}" tests/test_model_parity.py tests/test_ar_parity.py \
    tests/test_sampler_replay.py tests/test_device_paths.py
answers_dir=$(mktemp -d)
trap 'rm -rf "$answers_dir"' EXIT
step answers "demo answers: $accelerator against cpu" "$run_limit" bash -c \
    'python3 benchmarks/golden_answers.py "${@:2}" --device cpu "$1/cpu.json" &&
     python3 benchmarks/golden_answers.py "${@:2}" --device "$0" "$1/accelerator.json" \
        --against "$1/cpu.json"' "$accelerator" "$answers_dir" "${answers[@]}"
step full "full_scale: $layers layers, $unquantized" "$run_limit" \
    python3 benchmarks/full_scale.py --in-memory --layers "$layers" --recipe none --dtype "$unquantized" \
    "${runs[@]}" --sweep --predict-device "$device"
step full-4bit "full_scale: $layers layers, mixed 4-bit" "$run_limit" \
    python3 benchmarks/full_scale.py --in-memory --layers "$layers" --recipe mixed --bits 4 "${runs[@]}" \
    --sweep --predict-device "$device"
step reference "reference beside MLX: $small_name, $unquantized" "$reference_limit" \
    python3 benchmarks/reference_speed.py "${small[@]}" --dtype "$unquantized" --device "$torch_device" \
    "${shape[@]}" --mlx
step profile "profile by layer and part: $small_name, $unquantized" "$run_limit" \
    python3 benchmarks/profile_step.py "${small[@]}" --dtype "$unquantized" --recipe none "${forwards[@]}"
step profile-4bit "profile by layer and part: $small_name, mixed 4-bit" "$run_limit" \
    python3 benchmarks/profile_step.py "${small[@]}" --recipe mixed --bits 4 "${forwards[@]}"

if ((${#failed[@]})); then
    printf 'gpu_suite: FAILED: %s\n' "${failed[@]}"
    exit 1
fi
echo "gpu_suite: all steps passed"
