"""The server's prompt cache: longest stored prefix, copies, least recently used first out; the batched
engine taking a row whose prompt prefix is already encoded."""

import copy

import mlx.core as mx
import pytest

from mlx_dgemma import generate, load
from mlx_dgemma.engine.batch import BatchGenerator
from mlx_dgemma.generate import DEMO_MODEL, prefill, prompt_ids
from mlx_dgemma.server.prompt_cache import PromptCache

from .test_batch import job


def encoded(model, ids):
    cache = model.make_cache()
    model.encode(mx.array(ids), cache)
    return cache


def test_a_stored_cache_forgets_the_positions_after_its_key():
    model, _ = load(DEMO_MODEL)
    store = PromptCache(max_size=2)
    ids = [2, 5, 10, 11, 12]
    longer = encoded(model, ids + [13, 14])
    store.insert(ids, longer)
    cache, hit = store.fetch(ids + [20])
    assert hit == len(ids) and cache.offset == len(ids) and longer.offset == len(ids) + 2
    step = mx.array([[20]])
    want = model.next_token_logits(step, encoded(model, ids))
    assert float(mx.abs(model.next_token_logits(step, cache) - want).max() / mx.abs(want).max()) <= 1e-5
    with pytest.raises(ValueError, match="a cache of 3 positions cannot be stored for 5 ids"):
        store.insert(ids, encoded(model, ids[:3]))


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


@pytest.mark.parametrize("policy", ["reference", "ar", "verified"])
def test_a_row_with_a_prefilled_prefix_answers_as_alone(policy):
    model, tokenizer = load(DEMO_MODEL)
    prompts = [prompt_ids(tokenizer, p) for p in ("sort: 42 17 85 23 61", "reverse: kayak7", "add: 17 25")]
    engine = BatchGenerator(model, tokenizer)
    uids = []
    for i, ids in enumerate(prompts):
        cache = None
        if i != 1:  # rows 0 and 2 bring a cache holding all but the last 1 / 6 prompt ids; row 1 none
            cache = model.make_cache()
            prefill(model, mx.array(ids[: len(ids) - (1 if i == 0 else 6)]), cache)
        uids.append(engine.insert(job(model, tokenizer, ids, 64, seed=i, policy=policy), cache))
    texts = dict.fromkeys(uids, "")
    while len(engine):
        for response in engine.next():
            texts[response.uid] += response.text
    assert list(texts.values()) == [
        generate(model, tokenizer, ids, max_tokens=64, seed=i, policy=policy) for i, ids in enumerate(prompts)
    ]


@pytest.mark.parametrize("policy", ["ar", "verified"])
def test_a_template_row_starts_from_its_prefilled_prefix(policy):
    """A template decoded autoregressively or verified, from a prefix it brings: the prefix is used,
    not encoded again, and the answer is the one without it."""
    model, tokenizer = load(DEMO_MODEL)
    ids = prompt_ids(tokenizer, "json: name=ada age=36 city=rome")
    template = '{"name": "{{fill:6}}", "age": {{fill:3}}}'
    cache = model.make_cache()
    prefill(model, mx.array(ids[:-4]), cache)
    engine = BatchGenerator(model, tokenizer)
    from mlx_dgemma.structured.template import parse_template

    uid = engine.insert(
        job(model, tokenizer, ids, seed=1, policy=policy, template=parse_template(tokenizer, template)), cache
    )
    text = ""
    while len(engine):
        text += "".join(r.text for r in engine.next() if r.uid == uid)
    assert cache.offset > len(ids)  # the answer went on after the prefix it was given
    assert text == generate(model, tokenizer, ids, seed=1, policy=policy, template=template, chat_template=False)


def test_an_auto_row_hands_back_its_prompt_as_every_row_does():
    """auto rows run in the engine with the others: the callback sees the whole prompt encoded, the
    prefix a prompt cache keeps (a second turn's prompt starts with it)."""
    model, tokenizer = load(DEMO_MODEL)
    ids = prompt_ids(tokenizer, "reverse: kayak7")
    handed = []
    engine = BatchGenerator(model, tokenizer)
    engine.insert(
        job(model, tokenizer, ids, 8, seed=0, policy="auto"), on_prefilled=lambda c: handed.append(copy.deepcopy(c))
    )
    while len(engine):
        engine.next()
    assert len(handed) == 1 and handed[0].offset == len(ids)
    step = mx.array([[5]])
    want = model.next_token_logits(step, encoded(model, ids))
    assert float(mx.abs(model.next_token_logits(step, handed[0]) - want).max() / mx.abs(want).max()) <= 1e-5


def test_a_prompt_cache_must_leave_the_prompt_an_id_and_cannot_come_with_images():
    model, tokenizer = load(DEMO_MODEL)
    ids = prompt_ids(tokenizer, "sort: 3 1 2")
    whole = model.make_cache()
    prefill(model, mx.array(ids), whole)
    with pytest.raises(ValueError, match=f"holds {len(ids)} ids of a {len(ids)}-id prompt; at least its last id"):
        generate(model, tokenizer, ids, prompt_cache=whole)
    with pytest.raises(
        ValueError, match="give the images and videos or a prompt cache that already holds them, not both"
    ):
        generate(model, tokenizer, ids, prompt_cache=model.make_cache(), images=["x.png"])


def test_the_engine_hands_back_each_fresh_prompt_unpadded():
    """Prompts of different lengths prefilled in one padded forward: each row's cache handed to
    ``on_prefilled`` holds its prompt alone, without padding, as a prompt cache would store it."""
    model, tokenizer = load(DEMO_MODEL)
    prompts = [prompt_ids(tokenizer, p) for p in ("sort: 42 17 85 23 61", "reverse: kayak7", "json: name=ada age=36")]
    assert len({len(ids) for ids in prompts}) == 3
    engine = BatchGenerator(model, tokenizer)
    handed = {}
    for i, ids in enumerate(prompts):
        engine.insert(
            job(model, tokenizer, ids, 8, seed=i), on_prefilled=lambda c, i=i: handed.setdefault(i, copy.deepcopy(c))
        )
    engine.next()
    step = mx.array([[7]])
    for i, ids in enumerate(prompts):
        cache = handed[i]
        assert not cache.padded and cache.offset == len(ids) and cache.lengths.tolist() == [len(ids)]
        alone = model.make_cache()
        prefill(model, mx.array(ids), alone)
        got, want = model.next_token_logits(step, cache), model.next_token_logits(step, alone)
        assert float(mx.abs(got - want).max() / mx.abs(want).max()) <= 1e-5
