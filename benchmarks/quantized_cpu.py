"""Quantized products on the CPU: the kernel seam (numpy dequantization, then BLAS) against MLX's own
quantized kernels, side by side at the released text shapes.

    python benchmarks/quantized_cpu.py [--bits 4] [--positions 256] [--mlx-rows 512]
    python benchmarks/quantized_cpu.py --forward [--layers 1]      # also a whole denoise, seam only
    python benchmarks/quantized_cpu.py --only expert               # some products only

Every quantized product of one ``--positions``-position denoising forward of
google/diffusiongemma-26B-A4B-it under the ``mixed`` recipe (attention, router, dense MLP and the
tied embedding at 8 bits; experts and the self-conditioning MLP at ``--bits``; group 64) is timed
with bfloat16 activations, as the model runs it, through each path: the seam on the whole weight,
MLX's ``quantized_matmul`` on its first ``--mlx-rows`` output rows (its time grows linearly with
them; the whole 262144-row head would take hours), scaled to the whole weight. Experts get the rows
top-8 routing gives them on average. It prints each product, the forward and one layer composed
from them (count × time), their ratio, the largest difference of the two paths' outputs on the
rows all computed, and the BLAS in use. MLX's kernel is also timed on float32 activations, where it is
~10x faster and exact (on bfloat16 ones it accumulates in bfloat16: ~10% error on these products);
the errors are measured against that float32 output.
"""

import argparse
import time
from dataclasses import dataclass, replace

from mlx_dgemma import fast_blas

fast_blas.load()
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402

from mlx_dgemma.engine.policy import RELEASED  # noqa: E402
from mlx_dgemma.model import kernels  # noqa: E402
from mlx_dgemma.model.config import FULL  # noqa: E402
from mlx_dgemma.model.diffusion_gemma import DiffusionGemma  # noqa: E402

SENSITIVE_BITS = 8  # the mixed recipe's attention, router, dense MLP and embedding
GROUP = 64


@dataclass(frozen=True)
class Product:
    name: str
    outputs: int  # rows of the weight [outputs, inputs] (of [inputs, outputs] when not transposed)
    inputs: int
    bits: int
    rows: int  # activation rows
    count: int  # how many per forward
    per_layer: bool = True
    transpose: bool = True


def forward_products(bits: int, positions: int, cfg=RELEASED) -> list[Product]:
    H, layers = cfg.hidden_size, cfg.num_hidden_layers
    full = sum(t == FULL for t in cfg.layer_types)
    sliding = layers - full
    q_sliding, kv_sliding = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    q_full, kv_full = (
        cfg.num_attention_heads * cfg.global_head_dim,
        cfg.num_global_key_value_heads * cfg.global_head_dim,
    )
    expert_rows = max(1, round(positions * cfg.top_k_experts / cfg.num_experts))
    s, e = SENSITIVE_BITS, bits
    return [
        Product("q sliding", q_sliding, H, s, positions, sliding),
        Product("k, v sliding", kv_sliding, H, s, positions, 2 * sliding),
        Product("o sliding", H, q_sliding, s, positions, sliding),
        Product("q full", q_full, H, s, positions, full),
        Product("k full (= v)", kv_full, H, s, positions, full),
        Product("o full", H, q_full, s, positions, full),
        Product("router", cfg.num_experts, H, s, positions, layers),
        Product("dense gate, up", cfg.intermediate_size, H, s, positions, 2 * layers),
        Product("dense down", H, cfg.intermediate_size, s, positions, layers),
        Product(
            f"expert gate_up ({expert_rows} rows)",
            2 * cfg.moe_intermediate_size,
            H,
            e,
            expert_rows,
            cfg.num_experts * layers,
        ),
        Product(
            f"expert down ({expert_rows} rows)", H, cfg.moe_intermediate_size, e, expert_rows, cfg.num_experts * layers
        ),
        Product("self-cond. gate, up", cfg.intermediate_size, H, e, positions, 2, per_layer=False),
        Product("self-cond. down", H, cfg.intermediate_size, e, positions, 1, per_layer=False),
        Product("head", cfg.vocab_size, H, s, positions, 1, per_layer=False),
        Product("soft embedding", cfg.vocab_size, H, s, positions, 1, per_layer=False, transpose=False),
    ]


def best_s(fn, repeats: int = 2) -> tuple[float, mx.array]:
    out = fn()
    mx.eval(out)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        mx.eval(out)
        best = min(best, time.perf_counter() - start)
    return best, out


def time_product(p: Product, mlx_rows: int, key: int) -> tuple[float, float, float, float, float]:
    """Seconds through the seam, through MLX's kernel on bfloat16 activations (as the model calls it)
    and on float32 ones (both scaled to the whole weight); and the relative differences of the seam's
    and of MLX's bfloat16 outputs from MLX's float32 ones, on the rows all three computed."""
    weight = (0.02 * mx.random.normal((p.outputs, p.inputs), key=mx.random.key(key))).astype(mx.bfloat16)
    q = mx.quantize(weight, GROUP, p.bits)
    width = p.inputs if p.transpose else p.outputs  # the activations' last axis
    x = mx.random.normal((p.rows, width), key=mx.random.key(key + 1)).astype(mx.bfloat16)
    mx.eval(q, x)
    seam_s, seam = best_s(lambda: kernels.CPU.quantized_matmul(x, *q, p.transpose, GROUP, p.bits, "affine"))
    n = min(mlx_rows, p.outputs)
    part = [a[:n] for a in q]
    xs = x if p.transpose else x[:, :n]
    xf = xs.astype(mx.float32)
    mx.eval(part, xs, xf)
    scale = p.outputs / n
    bf16_s, bf16 = best_s(lambda: kernels.MLX.quantized_matmul(xs, *part, p.transpose, GROUP, p.bits, "affine"), 1)
    f32_s, f32 = best_s(lambda: kernels.MLX.quantized_matmul(xf, *part, p.transpose, GROUP, p.bits, "affine"), 1)
    if p.transpose:
        shared = seam[:, :n]
    else:  # a partial sum over the first n rows of the weight, through the seam again
        shared = kernels.CPU.quantized_matmul(xs, *part, False, GROUP, p.bits, "affine")

    def relative(a: mx.array) -> float:
        return (mx.abs(a.astype(mx.float32) - f32).max() / mx.abs(f32).max()).item()

    return seam_s, bf16_s * scale, f32_s * scale, relative(shared), relative(bf16)


def compare_products(bits: int, positions: int, mlx_rows: int, only: str | None = None) -> None:
    products = [p for p in forward_products(bits, positions) if only is None or only in p.name]
    print(
        f"released shapes, mixed recipe (experts and self-conditioning at {bits} bits, the rest at "
        f"{SENSITIVE_BITS}), group {GROUP}, {positions} positions, bfloat16 activations; BLAS: {fast_blas.describe()}"
    )
    print(
        f"{'product':<28}{'count':>6}{'seam ms':>10}{'MLX ms':>12}{'ratio':>8}{'MLX f32 ms':>12}{'ratio':>8}"
        f"{'seam err':>10}{'MLX err':>10}"
    )
    layers = RELEASED.num_hidden_layers
    forward, layer = [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
    worst = [0.0, 0.0]
    for i, p in enumerate(products):
        seam_s, bf16_s, f32_s, seam_err, bf16_err = time_product(p, mlx_rows, 2 * i)
        worst = [max(worst[0], seam_err), max(worst[1], bf16_err)]
        print(
            f"{p.name:<28}{p.count:>6}{seam_s * 1e3:>10.1f}{bf16_s * 1e3:>12.1f}{bf16_s / seam_s:>7.1f}x"
            f"{f32_s * 1e3:>12.1f}{f32_s / seam_s:>7.1f}x{seam_err:>10.1e}{bf16_err:>10.1e}",
            flush=True,
        )
        for path, t in enumerate((seam_s, bf16_s, f32_s)):
            forward[path] += p.count * t
            layer[path] += p.count / layers * t if p.per_layer else 0.0
    for what, (seam, bf16, f32) in (
        (f"one {positions}-position forward", forward),
        ("one layer (its products)", layer),
    ):
        print(
            f"{what}: seam {seam:.1f} s; MLX {bf16:.1f} s ({bf16 / seam:.1f}x the seam's time); "
            f"MLX on float32 activations {f32:.1f} s ({f32 / seam:.1f}x)"
        )
    print(
        f"largest error against MLX's kernel on float32 activations (relative to the largest output): "
        f"seam {worst[0]:.1e} (its bfloat16 output's rounding), MLX on bfloat16 activations {worst[1]:.1e}"
    )


# --- a whole forward, seam only ------------------------------------------------------------------


def random_quantized_model(layers: int, bits: int, group_size: int) -> DiffusionGemma:
    """The released text shapes at ``layers`` layers, random bf16 weights quantized in memory."""
    model = DiffusionGemma(replace(RELEASED, num_hidden_layers=layers, layer_types=RELEASED.layer_types[:layers]))
    for i, (name, value) in enumerate(tree_flatten(model.parameters())):
        weight = 0.02 * mx.random.uniform(-1.7, 1.7, value.shape, key=mx.random.key(i))
        model.update(tree_unflatten([(name, weight.astype(mx.bfloat16))]))
    nn.quantize(
        model,
        group_size=group_size,
        bits=bits,
        class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0,
    )
    mx.eval(model.parameters())
    model.use_kernels(kernels.CPU)
    return model


def seam_forward(layers: int, bits: int, positions: int) -> None:
    model = random_quantized_model(layers, bits, GROUP)
    vocab = model.config.vocab_size
    cache = model.make_cache()
    model.encode(mx.random.randint(0, vocab, (1, 16), key=mx.random.key(1)), cache)
    mx.eval(cache.state())
    canvas = mx.random.randint(0, vocab, (1, positions), key=mx.random.key(2))
    seconds, _ = best_s(lambda: model.denoise(canvas, cache), 1)
    print(
        f"whole denoise through the seam, {layers} layer(s) at {bits} bits (everything), {positions} positions "
        f"after 16 tokens: {seconds:.1f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, default=4, choices=kernels.NUMPY_DEQUANTIZED_BITS + (3, 5, 6))
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--mlx-rows", type=int, default=512, help="output rows MLX's kernel is timed on")
    parser.add_argument("--only", help="only the products whose name holds this (their totals are partial)")
    parser.add_argument("--forward", action="store_true", help="also time a whole denoise through the seam")
    parser.add_argument("--layers", type=int, default=1, help="layers of that denoise")
    args = parser.parse_args()
    compare_products(args.bits, args.positions, args.mlx_rows, args.only)
    if args.forward:
        seam_forward(args.layers, args.bits, args.positions)


if __name__ == "__main__":
    main()
