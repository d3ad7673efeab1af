"""Ours against mlx-vlm 0.7.10 on the very same random checkpoint, prompt and settings.

Both engines run the reference's entropy-bound sampler (tokens sampled at the schedule
temperature: mlx-vlm's `temperature=1.0` on already-tempered logits), the full 256 canvas, a fixed
number of steps (random weights never converge and the EOS id is unreachable, so no early stop),
fp32, and the same BLAS (OpenBLAS preloaded for both). Runs alternate, so both see the same
machine noise; the ratios are what to read.

Set-up: a separate venv for the peer, and the project's mlx-vlm runner script (--peer-script):
    python3 -m venv .peer-venv && .peer-venv/bin/pip install "mlx[cpu]==0.32.4" mlx-lm==0.32.2 mlx-vlm==0.7.10
Run (nothing else on the machine):
    python benchmarks/compare_mlx_vlm.py --peer-python .peer-venv/bin/python --peer-script PATH --rounds 3 --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"


def run_ours(checkpoint: Path, prompt_ids: list[int], max_tokens: int, steps: int, policy: str) -> dict:
    """One timed generation with our engine (after a short warm-up), as JSON."""
    import mlx.core as mx

    from mlx_dgemma import fast_blas, load, stream_generate

    model, tokenizer = load(checkpoint)
    warm = list(stream_generate(model, tokenizer, prompt_ids, 64, steps=2, seed=0))  # noqa: F841
    mx.reset_peak_memory()
    start = time.perf_counter()
    responses = list(stream_generate(model, tokenizer, prompt_ids, max_tokens, steps=steps, seed=3, policy=policy))
    wall = time.perf_counter() - start
    last = responses[-1]
    prompt_s = last.prompt_tokens / last.prompt_tps
    generation_s = wall - prompt_s
    total_steps = sum(r.steps for r in responses)
    return {
        "impl": "mlx-dgemma",
        "blas": fast_blas.describe(),
        "generated_tokens": last.generation_tokens,
        "denoising_steps": total_steps,
        "generation_seconds": generation_s,
        "tok_per_s": last.generation_tokens / generation_s,
        "ms_per_decoder_step": 1000 * generation_s / total_steps,
        "mlx_peak_memory_mb": mx.get_peak_memory() / 2**20,
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def subprocess_json(cmd: list[str], env: dict) -> dict:
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out[out.index("{") :])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peer-python", default=".peer-venv/bin/python")
    p.add_argument("--checkpoint", type=Path, default=Path("/tmp/dgemma-compare-ck"))
    p.add_argument("--peer-script", type=Path, help="The runner of mlx-vlm's DiffusionGemma engine (bench_mlx_vlm.py)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--policy", default="reference")
    p.add_argument("--out", type=Path)
    p.add_argument("--ours-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--prompt-ids", help=argparse.SUPPRESS)
    a = p.parse_args()

    if a.ours_only:
        print(json.dumps(run_ours(a.checkpoint, json.loads(a.prompt_ids), a.max_tokens, a.steps, a.policy)))
        return

    if a.peer_script is None or not a.peer_script.is_file():
        p.error("--peer-script: give the path of the mlx-vlm runner script (bench_mlx_vlm.py)")
    from mlx_dgemma.fast_blas import kernel_family

    # Same library and the same kernels for both (Debian's OpenBLAS would pick SSE3 ones on its own).
    env = dict(os.environ, LD_PRELOAD=OPENBLAS, HF_HUB_OFFLINE="1")
    if family := kernel_family():
        env.setdefault("OPENBLAS_CORETYPE", family)
    peer = [
        a.peer_python,
        str(a.peer_script),
        "--temperature",
        "1.0",
        "--full-canvas",
        "--steps",
        str(a.steps),
        "--max-tokens",
        str(a.max_tokens),
    ]
    if not (a.checkpoint / "model.safetensors").exists():
        subprocess_json(
            peer + ["--save-dir", str(a.checkpoint), "--warmup", "0", "--max-tokens", "64", "--steps", "1"], env
        )
    results: dict[str, list[dict]] = {"mlx-vlm": [], "mlx-dgemma": []}
    prompt_ids = None
    for round_ in range(a.rounds):
        theirs = subprocess_json(peer + ["--load-dir", str(a.checkpoint)], env)
        prompt_ids = theirs["prompt_ids"]
        ours = subprocess_json(
            [
                sys.executable,
                __file__,
                "--ours-only",
                "--checkpoint",
                str(a.checkpoint),
                "--prompt-ids",
                json.dumps(prompt_ids),
                "--steps",
                str(a.steps),
                "--max-tokens",
                str(a.max_tokens),
                "--policy",
                a.policy,
            ],
            env,
        )
        results["mlx-vlm"].append(theirs)
        results["mlx-dgemma"].append(ours)
        print(
            f"round {round_ + 1}: mlx-vlm {theirs['tok_per_s']:.2f} tok/s, {theirs['ms_per_decoder_step']:.0f} ms/step"
            f" | ours {ours['tok_per_s']:.2f} tok/s, {ours['ms_per_decoder_step']:.0f} ms/step",
            flush=True,
        )

    def med(impl, key):
        return statistics.median(r[key] for r in results[impl])

    print(
        f"\nsame checkpoint ({a.checkpoint}), {a.max_tokens} tokens, {a.steps} steps/canvas, fp32, "
        f"BLAS {OPENBLAS} ({env.get('OPENBLAS_CORETYPE', 'auto')} kernels), medians of {a.rounds} alternated rounds"
    )
    print(f"{'':12} {'tok/s':>8} {'ms/step':>9} {'MLX peak MB':>12} {'max RSS MB':>11}")
    for impl in results:
        print(
            f"{impl:12} {med(impl, 'tok_per_s'):8.2f} {med(impl, 'ms_per_decoder_step'):9.0f} "
            f"{med(impl, 'mlx_peak_memory_mb'):12.0f} {med(impl, 'max_rss_mb'):11.0f}"
        )
    print(f"ratio (ours / mlx-vlm): {med('mlx-dgemma', 'tok_per_s') / med('mlx-vlm', 'tok_per_s'):.2f}x tokens/s")
    if a.out:
        a.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
