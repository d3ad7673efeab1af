"""Expert dispatch on the CPU: one BLAS product per expert against gather_mm, by canvas width.

    python benchmarks/expert_dispatch.py mlx_dgemma/demo
    python benchmarks/expert_dispatch.py CK            # e.g. the 70M checkpoint compare_mlx_vlm.py saves

Times a whole ``denoise`` forward (best of a few) after a 50-token prefix with each dispatch forced,
so the crossover behind ``kernels.SEGMENT_MIN_ROWS`` can be re-measured on another CPU.
"""

import sys

from mlx_dgemma import fast_blas

fast_blas.load()
import mlx.core as mx  # noqa: E402
from timing import best_ms  # noqa: E402

from mlx_dgemma import load  # noqa: E402
from mlx_dgemma.generate import DEMO_MODEL  # noqa: E402
from mlx_dgemma.model import kernels  # noqa: E402


def step_ms(model, cache, width: int, reps: int) -> float:
    canvas = mx.random.randint(0, model.config.vocab_size, (1, width))
    return best_ms(lambda: mx.eval(model.denoise(canvas, cache)), reps)


def main(path: str) -> None:
    model, _ = load(path)
    cfg = model.config
    cache = model.make_cache()
    model.encode(mx.array([[2] + list(range(10, 60))]), cache)
    reps = 20 if cfg.hidden_size < 256 else 5
    saved = kernels.SEGMENT_MIN_ROWS
    print(f"{'width':>6} {'rows/expert':>12} {'per-expert BLAS':>16} {'gather_mm':>10} {'ratio':>6}")
    for width in [1, 4, 8, 16, 32, 64, 128, 256]:
        if width > cfg.canvas_length:
            break
        kernels.SEGMENT_MIN_ROWS = 0
        segments = step_ms(model, cache, width, reps)
        kernels.SEGMENT_MIN_ROWS = 10**9
        gather = step_ms(model, cache, width, reps)
        rows = width * cfg.top_k_experts / cfg.num_experts
        print(f"{width:6d} {rows:12.1f} {segments:13.2f} ms {gather:7.2f} ms {gather / segments:6.2f}")
    kernels.SEGMENT_MIN_ROWS = saved


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(DEMO_MODEL))
