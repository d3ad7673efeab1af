"""Timing shared by the benchmarks (each runs as ``python benchmarks/NAME.py``, which puts this
folder on the import path)."""

import time


def best_ms(fn, repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn`` in milliseconds, after one call to warm up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3
