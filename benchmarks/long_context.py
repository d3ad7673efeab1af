"""Long context on this machine, on a checkpoint with the released attention layout and tiny experts
(checkpoint_tools.synthetic_checkpoint.LONG_CONTEXT, float32): per prefix and KV width, prefill time
and peak memory against the memory check's plan, a denoising step, an AR token and a verifying pass
against the roofline's prediction, and what ``auto`` picks there; a 32K-token prompt answered under
reference, ar and verified at 8 and 4 bits; the prompt cache reusing that prefix; attention over a
quantized prefix dequantized against MLX's quantized products; and the roofline's predictions for the
released model at 4K-256K on the README's devices.

    python benchmarks/long_context.py                                   # ≈ 10 minutes on 2 cores
    python benchmarks/long_context.py --prefixes 1024 2048 --prefill-limit 1024 --keys 1024 --repeats 1

Prefixes past ``--prefill-limit`` (``--float-prefill-limit`` for the unquantized cache) are not encoded
(a full-attention prefill is quadratic): their caches are filled with random K/V of the right shapes,
and only their steps and tokens are timed. The answers are to the longest prompt encoded, from its
prefilled caches (a prompt cache holding all but its last token).
"""

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # checkpoint_tools/ and mlx_dgemma/ of this checkout

from mlx_dgemma import fast_blas  # noqa: E402

fast_blas.load()
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from timing import best_ms  # noqa: E402

from checkpoint_tools.synthetic_checkpoint import write_long_context  # noqa: E402
from mlx_dgemma import generate, load  # noqa: E402
from mlx_dgemma.engine.policy import AutoPlanner, cached_profile, predict  # noqa: E402
from mlx_dgemma.engine.policy.roofline import forward_cost  # noqa: E402
from mlx_dgemma.engine.resolve import generation_config  # noqa: E402
from mlx_dgemma.generate import prefill  # noqa: E402
from mlx_dgemma.loader import weight_files  # noqa: E402
from mlx_dgemma.memory import memory_need  # noqa: E402
from mlx_dgemma.model import kernels  # noqa: E402
from mlx_dgemma.options import KVQuantization  # noqa: E402
from mlx_dgemma.safetensors_io import read_header  # noqa: E402

README_DEVICES = ("M1 Max", "M2 Ultra", "M4 Max", "M5 Max", "RTX 4090", "H100")
DRAFT = 8  # the verifying pass timed: an encoder pass over a draft of this many tokens
FILL_CHUNK = 16384


def quantization(bits):
    return None if bits is None else KVQuantization(bits, 64, 0)


def fill(model, cache, prefix: int) -> None:
    """Random K/V of each layer's shape for ``prefix`` positions, appended in chunks (so that the
    sliding layers drop what falls out of their window): a cache to time steps at, not a prompt's."""
    cfg = model.config
    for start in range(0, prefix, FILL_CHUNK):
        n = min(FILL_CHUNK, prefix - start)
        for i, layer in enumerate(cache.layers):
            shape = (1, cfg.layer_kv_heads(i), n, cfg.layer_head_dim(i))
            keys = mx.random.normal(shape, key=mx.random.key(2 * start + i))
            layer.update_and_fetch(keys, mx.random.normal(shape, key=mx.random.key(2 * start + i + 1)))
        mx.eval(cache.state())


def device_peaks(repeats: int) -> tuple[float, float]:
    """This CPU's float32 matmul FLOP/s and copy bandwidth (bytes read and written per second)."""
    a = mx.random.normal((2048, 2048))
    big = mx.random.normal((64 * 2**20,))  # 256 MB
    mx.eval(a, big)
    flops = 2 * 2048**3 / (best_ms(lambda: mx.eval(a @ a), repeats) / 1e3)
    bandwidth = 2 * big.nbytes / (best_ms(lambda: mx.eval(big * 1.0), repeats) / 1e3)
    return flops, bandwidth


def roofline_s(cfg, tokens: int, prefix: int, denoise: bool, flops: float, bandwidth: float, logits=None) -> float:
    cost = forward_cost(cfg, tokens, prefix, 32, denoise, logits)
    return max(cost.flops / flops, cost.bytes / bandwidth)


def times(model, cache, repeats: int) -> dict:
    """A denoising step over the whole canvas (laid out once, as the sampler does), an AR token and
    a verifying pass, each the best of ``repeats`` (ms)."""
    cfg = model.config
    C = cfg.canvas_length
    canvas = mx.random.randint(3, cfg.vocab_size, (1, C), key=mx.random.key(1))
    view = cache.canvas_view(C)
    draft = mx.random.randint(3, cfg.vocab_size, (1, DRAFT), key=mx.random.key(2))

    def ar_token():
        mx.eval(model.next_token_logits(canvas[:, :1], cache))
        cache.trim(1)

    def verify():
        model.head(model.encode(draft, cache, return_hidden=True))[0].argmax(-1).tolist()
        cache.trim(DRAFT)

    return {
        "step_ms": best_ms(lambda: mx.eval(model.denoise(canvas, view)), repeats),
        "ar_ms": best_ms(ar_token, repeats),
        "verify_ms": best_ms(verify, repeats),
    }


def auto_pick(model, tokenizer, profile, prefix: int) -> str:
    planner = AutoPlanner(generation_config(model, tokenizer), model.config.canvas_length, profile)
    return planner.choose(model.config.canvas_length, prompt=[0] * prefix).predicted[0]


def prompt(prefix: int) -> list[int]:
    return np.random.default_rng(prefix).integers(3, 300, prefix).tolist()


def per_prefix(model, tokenizer, folder: Path, a, peaks) -> tuple[list[dict], dict]:
    """The rows, and the prefilled caches of the longest prefix encoded per quantized width."""
    cfg = model.config
    tensors = {k: v for f in weight_files(folder) for k, v in read_header(f).items()}
    profile = cached_profile(model)
    rows, kept = [], {}
    for prefix in a.prefixes:
        for bits in a.kv:
            q = quantization(bits)
            cache = model.make_cache(None, q)
            mx.reset_peak_memory()
            start = time.perf_counter()
            if prefix <= (a.prefill_limit if bits else a.float_prefill_limit):
                prefill(model, mx.array(prompt(prefix)), cache)
                prefill_s = time.perf_counter() - start
            else:
                fill(model, cache, prefix)
                prefill_s = None
            row = {
                "prefix": prefix,
                "kv_bits": bits or 32,
                "prefill_s": prefill_s,
                "prefill_peak_mb": mx.get_peak_memory() / 1e6 if prefill_s is not None else None,
                "plan_mb": memory_need(cfg, tensors, prefix + cfg.canvas_length, kv_bits=bits).total / 1e6,
                "kv_mb": cache.nbytes / 1e6,
            }
            mx.reset_peak_memory()
            row.update(times(model, cache, a.repeats))
            row["step_peak_mb"] = mx.get_peak_memory() / 1e6
            F, B = peaks
            row["step_roofline_ms"] = 1e3 * roofline_s(cfg, cfg.canvas_length, prefix, True, F, B)
            row["ar_roofline_ms"] = 1e3 * roofline_s(cfg, 1, prefix, False, F, B)
            row["verify_roofline_ms"] = 1e3 * roofline_s(cfg, DRAFT, prefix, False, F, B, logits=DRAFT)
            at = profile.at_prefix(prefix)
            row["step_auto_ms"] = 1e3 * at.step_s(cfg.canvas_length)
            row["ar_auto_ms"] = 1e3 * at.ar_token_s
            row["auto"] = auto_pick(model, tokenizer, at, prefix)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if bits and prefill_s is not None:
                kept[bits] = prefix, cache
    return rows, kept


def answers(model, tokenizer, kept: dict, tokens: int) -> list[dict]:
    """The longest prompt encoded (and one more token) under reference, ar and verified at each
    quantized width, from its prefilled cache; and the prompt cache's saving: that cache and one
    canvas of new tokens against encoding them all."""
    import copy

    cfg = model.config
    rows = []
    for bits, (prefix, cache) in kept.items():
        ids = prompt(prefix) + [5]
        new = np.random.default_rng(1).integers(3, 300, cfg.canvas_length).tolist()
        reused = copy.deepcopy(cache)
        start = time.perf_counter()
        prefill(model, mx.array([5] + new), reused)
        cached_s = time.perf_counter() - start
        texts = {}
        for policy in ("reference", "ar", "verified"):
            mx.reset_peak_memory()
            start = time.perf_counter()
            texts[policy] = generate(
                model,
                tokenizer,
                ids,
                max_tokens=tokens,
                seed=0,
                policy=policy,
                kv_bits=bits,
                quantized_kv_start=0,
                prompt_cache=copy.deepcopy(cache),
            )
            rows.append(
                {
                    "prompt": len(ids),
                    "kv_bits": bits,
                    "policy": policy,
                    "chars": len(texts[policy]),
                    "seconds": time.perf_counter() - start,
                    "peak_mb": mx.get_peak_memory() / 1e6,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        rows.append(
            {
                "prompt": len(ids),
                "kv_bits": bits,
                "verified_is_ar": texts["verified"] == texts["ar"],
                "cached_prefix_plus_canvas_s": cached_s,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def quantized_attention(keys: int, repeats: int) -> list[dict]:
    """A canvas of 256 queries of two 512-wide heads over ``keys`` quantized keys: dequantized then the
    CPU kernel (what cache.py does) against MLX's quantized products around a softmax."""
    q, k, v = (
        mx.random.normal(s, key=mx.random.key(i))
        for i, s in enumerate([(1, 2, 256, 512), (1, 2, keys, 512), (1, 2, keys, 512)])
    )
    rows = [
        {
            "keys": keys,
            "kv_bits": 32,
            "dequantized_ms": best_ms(lambda: mx.eval(kernels.CPU.attention(q, k, v, None)), repeats),
        }
    ]
    for bits in (8, 4):
        kq, vq = mx.quantize(k, 64, bits), mx.quantize(v, 64, bits)
        mx.eval(kq, vq)

        def dequantized():
            mx.eval(kernels.CPU.attention(q, mx.dequantize(*kq, 64, bits), mx.dequantize(*vq, 64, bits), None))

        def products():
            scores = mx.quantized_matmul(q, *kq, transpose=True, group_size=64, bits=bits)
            mx.eval(
                mx.quantized_matmul(
                    mx.softmax(scores, axis=-1, precise=True), *vq, transpose=False, group_size=64, bits=bits
                )
            )

        rows.append(
            {
                "keys": keys,
                "kv_bits": bits,
                "dequantized_ms": best_ms(dequantized, repeats),
                "quantized_products_ms": best_ms(products, repeats),
            }
        )
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def released_predictions(prefixes) -> list[dict]:
    """The roofline for the released model on the README's devices: AR and diffusion (16 steps per
    canvas) tok/s per prefix, and what auto would pick from that profile."""
    from mlx_dgemma.engine.policy import RELEASED
    from mlx_dgemma.model.config import GenerationConfig

    rows = []
    for device in README_DEVICES:
        for prefix in prefixes:
            p = predict(device, prefix=prefix)
            gen = GenerationConfig.from_dict({"max_denoising_steps": 64}, RELEASED)  # a prior of 16 steps
            planner = AutoPlanner(gen, 256, p)
            pick = planner.choose(256, prompt=[0] * prefix).predicted[0]
            rows.append(
                {
                    "device": device,
                    "prefix": prefix,
                    "ar_tok_s": p.ar_tok_s,
                    "diffusion_tok_s": p.diffusion_tok_s(16),
                    "speedup": p.diffusion_tok_s(16) / p.ar_tok_s,
                    "auto": pick,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefixes", type=int, nargs="+", default=[1024, 8192, 32768, 131072])
    p.add_argument("--prefill-limit", type=int, default=32768, help="longest prefix encoded; longer ones are filled")
    p.add_argument("--float-prefill-limit", type=int, default=8192, help="the same, for the unquantized cache")
    p.add_argument(
        "--kv",
        type=lambda s: None if s == "none" else int(s),
        nargs="+",
        default=[None, 8, 4],
        help="KV widths: none (the model's float32), 8, 4",
    )
    p.add_argument("--answer-tokens", type=int, help="tokens of each answer [default: a canvas]")
    p.add_argument("--keys", type=int, default=8192, help="keys of the quantized-attention comparison (0: none)")
    p.add_argument("--released", type=int, nargs="*", default=[4096, 32768, 131072, 262144])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--work-dir", type=Path, help="where the checkpoint is written [default: a temporary folder]")
    p.add_argument("--json", type=Path, help="write every figure here")
    a = p.parse_args()
    print(
        f"mlx {mx.__version__}, {fast_blas.describe()}, {os.cpu_count()} cores, {platform.processor()}, "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_long_context((a.work_dir or Path(tmp)) / "long-context")
        model, tokenizer = load(folder)
        peaks = device_peaks(a.repeats)
        print(json.dumps({"matmul_gflops": peaks[0] / 1e9, "copy_gb_s": peaks[1] / 1e9}), flush=True)
        out = {"peaks": peaks}
        out["prefixes"], kept = per_prefix(model, tokenizer, folder, a, peaks)
        out["answers"] = answers(model, tokenizer, kept, a.answer_tokens or model.config.canvas_length)
        out["attention"] = quantized_attention(a.keys, a.repeats) if a.keys else []
        out["released"] = released_predictions(a.released)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
