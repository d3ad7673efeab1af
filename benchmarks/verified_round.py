"""What a verified-drafting round costs against an AR token, on one prompt: a one-step draft, its
verifying encoder pass, the whole round, and one autoregressive token (best of ``--repeats`` each).

    python benchmarks/verified_round.py --length 32            # the bundled demo model
"""

import argparse

from mlx_dgemma import fast_blas

fast_blas.load()
import mlx.core as mx  # noqa: E402
from timing import best_ms  # noqa: E402

from mlx_dgemma import load  # noqa: E402
from mlx_dgemma.engine import drafting, rules  # noqa: E402
from mlx_dgemma.engine.sampler import MxRandom, SamplerSettings  # noqa: E402
from mlx_dgemma.generate import DEMO_MODEL  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEMO_MODEL))
    p.add_argument("--length", type=int, default=32, help="draft length")
    p.add_argument("--prefix", type=int, default=30)
    p.add_argument("--repeats", type=int, default=60)
    a = p.parse_args()
    model, _ = load(a.model)
    cfg = model.config
    ids = mx.random.randint(3, cfg.vocab_size, (1, a.prefix), key=mx.random.key(0))
    cache = model.make_cache()
    model.encode(ids, cache)
    mx.eval(cache.state())
    settings = drafting.DraftSettings(a.length, 1)
    row = drafting.DraftRow(cache, 5, rules.GreedyRule(set(), a.length), SamplerSettings(), MxRandom(0))
    tokens = mx.random.randint(3, cfg.vocab_size, (1, a.length), key=mx.random.key(1))

    def draft():
        mx.eval(drafting.draft(model, row, settings)[0])

    def verify():
        logits = model.head(model.encode(tokens, cache, return_hidden=True))[0]
        logits.argmax(-1).tolist()
        cache.trim(a.length)

    def whole_round():
        drafted, _ = drafting.draft(model, row, settings)
        logits = model.head(model.encode(drafted[None], cache, return_hidden=True))[0]
        mx.eval(drafted, logits)
        logits.argmax(-1).tolist()
        cache.trim(a.length)

    def ar_token():
        mx.eval(model.next_token_logits(ids[:, -1:], cache))
        cache.trim(1)

    print(f"{a.model}, drafts of {a.length} after {a.prefix} tokens, {fast_blas.describe()}")
    token = best_ms(ar_token, a.repeats)
    for name, fn in (("one-step draft", draft), ("verifying pass", verify), ("round", whole_round)):
        ms = best_ms(fn, a.repeats)
        print(f"{name:<15} {ms:7.2f} ms  {ms / token:5.2f} AR tokens")
    print(f"{'AR token':<15} {token:7.2f} ms")


if __name__ == "__main__":
    main()
