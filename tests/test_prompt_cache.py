"""The server's prompt cache: longest stored prefix, copies, least recently used first out."""

import mlx.core as mx

from mlx_dgemma import load
from mlx_dgemma.generate import DEMO_MODEL
from mlx_dgemma.server.prompt_cache import PromptCache


def encoded(model, ids):
    cache = model.make_cache()
    model.encode(mx.array(ids), cache)
    return cache


def test_longest_prefix_is_fetched_as_a_copy_and_lru_evicts():
    model, _ = load(DEMO_MODEL)
    store = PromptCache(max_size=2)
    short, long = [2, 5, 10], [2, 5, 10, 11, 12]
    store.insert(short, encoded(model, short))
    store.insert(long, encoded(model, long))
    cache, hit = store.fetch(long + [13])
    assert hit == 5 and cache.offset == 5
    model.encode(mx.array([13]), cache)  # a copy: the stored entry still holds 5 positions
    assert store.fetch(long + [13])[0].offset == 5
    assert store.fetch(long)[1] == 3  # a prompt needs one position of its own: not the whole entry
    assert store.fetch([2, 6, 10, 11]) == (None, 0)
    store.insert([2, 7], encoded(model, [2, 7]))  # full: the least recently used (long) goes
    assert store.fetch(long + [13])[1] == 3 and len(store) == 2
    disabled = PromptCache(0)
    disabled.insert(short, encoded(model, short))
    assert len(disabled) == 0 and disabled.fetch(long) == (None, 0)
