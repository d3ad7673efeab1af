"""MLX's fused attention against the CPU kernel (two BLAS products around a numpy softmax), for a
256-position canvas over growing key counts, and MLX's tanh GELU against the CPU kernel's numpy one
over growing sizes: why the CPU kernels compute them that way.

    python benchmarks/attention_cpu.py            # shapes of the 70M benchmark checkpoint's layers
"""

import argparse

from mlx_dgemma import fast_blas

fast_blas.load()
import mlx.core as mx  # noqa: E402
from timing import best_ms  # noqa: E402

from mlx_dgemma.model import kernels  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, nargs="+", default=[64, 320, 512, 1279, 2304, 8448])
    p.add_argument("--queries", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gelu-elements", type=int, nargs="+", default=[8192, 65536, 262144])
    a = p.parse_args()
    print(f"BLAS: {fast_blas.describe()}")
    print(f"{'keys':>6} {'mlx ms':>8} {'cpu kernel ms':>14} {'ratio':>6}")
    for K in a.keys:
        q = mx.random.normal((1, a.heads, a.queries, a.head_dim))
        k = mx.random.normal((1, a.kv_heads, K, a.head_dim))
        v = mx.random.normal((1, a.kv_heads, K, a.head_dim))
        mx.eval(q, k, v)
        fused = best_ms(lambda: mx.eval(kernels.MLX.attention(q, k, v, None)), a.repeats)
        ours = best_ms(lambda: mx.eval(kernels.CPU.attention(q, k, v, None)), a.repeats)
        print(f"{K:>6} {fused:>8.1f} {ours:>14.1f} {fused / ours:>5.2f}x")
    print(f"\n{'GELU elements':>13} {'mlx ms':>8} {'cpu kernel ms':>14} {'ratio':>6}")
    for n in a.gelu_elements:
        x = mx.random.normal((n // 1024, 1024))
        mx.eval(x)
        plain = best_ms(lambda: mx.eval(kernels.MLX.gelu(x)), a.repeats)
        ours = best_ms(lambda: mx.eval(kernels.CPU.gelu(x)), a.repeats)
        print(f"{n:>13} {plain:>8.2f} {ours:>14.2f} {plain / ours:>5.2f}x")


if __name__ == "__main__":
    main()
