"""Four prompts through ``batch_generate`` against four ``generate`` calls in sequence, on the bundled
demo model, per policy; both produce the same texts (checked), so total tokens/s is the comparison.

    python benchmarks/batch_speed.py --rounds 3            # nothing else running on the machine
"""

import argparse
import statistics
import time

from mlx_dgemma import batch_generate, fast_blas, generate, load
from mlx_dgemma.generate import DEMO_MODEL

PROMPTS = ["sort: 42 17 85 23 61", "reverse: planet", "add: 417 85", "json: name=ada age=36 city=rome"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEMO_MODEL))
    p.add_argument("--policy", nargs="+", default=["reference", "ar", "fast"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--prompts", nargs="+", default=PROMPTS, help="the prompts (default: one of each demo task)")
    a = p.parse_args()
    model, tokenizer = load(a.model)
    seeds = list(range(len(a.prompts)))
    print(f"{a.model}, {len(a.prompts)} prompts, {a.max_tokens} max tokens, {fast_blas.describe()}")
    print(f"{'policy':<10} {'sequential tok/s':>16} {'batched tok/s':>14} {'speed-up':>9}")
    for policy in a.policy:

        def sequential():
            return [
                generate(model, tokenizer, q, max_tokens=a.max_tokens, seed=s, policy=policy)
                for q, s in zip(a.prompts, seeds)
            ]

        def batched():
            return batch_generate(model, tokenizer, a.prompts, a.max_tokens, seeds=seeds, policy=policy).texts

        texts = sequential()
        assert batched() == texts, "batched and sequential texts differ"
        tokens = sum(len(tokenizer.encode(t)) for t in texts)
        rates = {"sequential": [], "batched": []}
        for _ in range(a.rounds):  # alternated, so both see the same machine
            for name, fn in (("sequential", sequential), ("batched", batched)):
                start = time.perf_counter()
                fn()
                rates[name].append(tokens / (time.perf_counter() - start))
        seq, bat = statistics.median(rates["sequential"]), statistics.median(rates["batched"])
        print(f"{policy:<10} {seq:>16.1f} {bat:>14.1f} {bat / seq:>8.2f}x")


if __name__ == "__main__":
    main()
