"""Quantized products on the CPU: the kernel seam (dequantize, then BLAS) against MLX's own quantized
kernels, side by side on one model with the released text shapes and random weights made in memory.

    python benchmarks/quantized_cpu.py [--layers 1] [--bits 4] [--group-size 64] [--positions 256]

Times one ``denoise`` forward of a canvas of ``--positions`` after a 16-token prefix with each path
(MLX's: ``quantized_matmul`` / ``gather_qmm``; the seam's: kernels.CPU), and prints both, their
ratio, the largest logit difference and the BLAS in use. Every module with a quantized form is
quantized uniformly at ``--bits``.
"""

import argparse
import time
from dataclasses import replace

from mlx_dgemma import fast_blas

fast_blas.load()
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402

from mlx_dgemma import kernels  # noqa: E402
from mlx_dgemma.model import DiffusionGemma  # noqa: E402
from mlx_dgemma.policy import RELEASED  # noqa: E402


def random_quantized_model(layers: int, bits: int, group_size: int) -> DiffusionGemma:
    """The released text shapes at ``layers`` layers, random bf16 weights quantized in memory."""
    model = DiffusionGemma(replace(RELEASED, num_hidden_layers=layers, layer_types=RELEASED.layer_types[:layers]))
    for i, (name, value) in enumerate(tree_flatten(model.parameters())):
        weight = 0.02 * mx.random.normal(value.shape, key=mx.random.key(i))
        model.update(tree_unflatten([(name, weight.astype(mx.bfloat16))]))
    nn.quantize(model, group_size=group_size, bits=bits,
                class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0)
    mx.eval(model.parameters())
    model.use_kernels(kernels.CPU)
    return model


def forward_s(model, cache, canvas, kernels_: kernels.Kernels) -> tuple[float, mx.array]:
    with model.kernels_in_use(kernels_):
        start = time.perf_counter()
        logits = model.denoise(canvas, cache)
        mx.eval(logits)
        return time.perf_counter() - start, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--positions", type=int, default=256)
    args = parser.parse_args()
    model = random_quantized_model(args.layers, args.bits, args.group_size)
    vocab = model.config.vocab_size
    cache = model.make_cache()
    model.encode(mx.random.randint(0, vocab, (1, 16), key=mx.random.key(1)), cache)
    mx.eval(cache.state)
    canvas = mx.random.randint(0, vocab, (1, args.positions), key=mx.random.key(2))
    forward_s(model, cache, canvas, kernels.CPU)  # warm-up of the seam's shapes
    seam, seam_logits = forward_s(model, cache, canvas, kernels.CPU)
    own, own_logits = forward_s(model, cache, canvas, kernels.MLX)
    diff = mx.abs(seam_logits - own_logits).max().item()
    print(f"released shapes, {args.layers} layer(s), {args.bits}-bit group {args.group_size}, "
          f"{args.positions}-position denoise after 16 tokens; BLAS: {fast_blas.describe()}")
    print(f"MLX quantized kernels: {own:.2f} s  seam (dequantize + BLAS): {seam:.2f} s  "
          f"ratio {own / seam:.1f}x  max |logit difference| {diff:.3g}")


if __name__ == "__main__":
    main()
