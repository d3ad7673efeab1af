"""The CPU work split over the cores other work leaves free (cpu_threads.py) against every core, on
a quiet machine and beside a process that keeps one core busy.

The bundled demo model answers fresh instances of its four tasks (tasks.py evaluation split) under
one policy. The two settings take turns on each instance, in an order drawn per instance, so a burst
of load falls on both. Per setting: answer tokens per second (summed over the instances). Then the
ratio of the totals, and the median over instances of one answer's tok/s against the other's.

    python benchmarks/busy_threads.py [-n 20] [--policy fast]
"""

import argparse
import random
import statistics
import time

from mlx_dgemma import fast_blas

fast_blas.load()
from mlx_dgemma import cpu_threads  # noqa: E402
from mlx_dgemma.api import stream_generate  # noqa: E402
from mlx_dgemma.demo import DEMO_MODEL  # noqa: E402
from mlx_dgemma.demo.eval import one_core_busy  # noqa: E402
from mlx_dgemma.demo.scores import MIXED, tasked_instances  # noqa: E402
from mlx_dgemma.loader import load  # noqa: E402


def answer_rate(model, tokenizer, prompt: str, seed: int, policy: str) -> tuple[float, int]:
    """One answer's tok/s and its tokens."""
    start = time.perf_counter()
    responses = list(stream_generate(model, tokenizer, prompt, seed=seed, policy=policy))
    return responses[-1].generation_tokens / (time.perf_counter() - start), responses[-1].generation_tokens


def compare(model, tokenizer, n: int, seed: int, policy: str) -> None:
    every_core = cpu_threads.usable_cores()
    settings = {"free cores": None, "every core": every_core}
    seconds, tokens, rates = {s: 0.0 for s in settings}, {s: 0 for s in settings}, {s: [] for s in settings}
    order = random.Random(seed)
    for i, (_, prompt) in enumerate(tasked_instances(MIXED, n, seed)):
        for name in order.sample(list(settings), len(settings)):
            threads = settings[name]
            if threads is None:
                rate, count = answer_rate(model, tokenizer, prompt, seed + i, policy)
            else:
                with cpu_threads.pinned(threads):
                    rate, count = answer_rate(model, tokenizer, prompt, seed + i, policy)
            rates[name].append(rate)
            tokens[name] += count
            seconds[name] += count / rate
    for name in settings:
        print(f"  {name:<11} {tokens[name] / seconds[name]:8.1f} tok/s")
    total = (tokens["free cores"] / seconds["free cores"]) / (tokens["every core"] / seconds["every core"])
    paired = statistics.median(a / b for a, b in zip(rates["free cores"], rates["every core"]))
    print(f"  free cores / every core: {total:.2f}x by total, {paired:.2f}x answer by answer (median)")
    print(f"  threads the free cores gave at the end: {cpu_threads.free_cores()} of {every_core}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=20, help="instances (the four tasks in turn)")
    p.add_argument("--policy", default="fast")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(f"BLAS: {fast_blas.describe()}; policy {a.policy}, {a.n} instances")
    model, tokenizer = load(DEMO_MODEL)
    for _, prompt in tasked_instances(MIXED, 4, a.seed + 1):  # warm-up: kernels for every shape
        answer_rate(model, tokenizer, prompt, a.seed, a.policy)
    print("quiet")
    compare(model, tokenizer, a.n, a.seed, a.policy)
    print("beside a process that keeps one core busy")
    with one_core_busy():
        compare(model, tokenizer, a.n, a.seed, a.policy)


if __name__ == "__main__":
    main()
