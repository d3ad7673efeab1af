"""Text embeddings from the model's own states: each text's mean final-normed hidden state of the causal
encoder (the states the tied head reads to predict the next token), over its tokens but a leading
``<bos>`` (the same state for every text), L2-normalized.

Texts are encoded together in left-padded rows, as the engine encodes prompts, sorted by length so
that rows of similar lengths share a forward; each row's vector is the one it gives alone, within
float32 rounding (tests/test_embeddings.py). A forward's rows are encoded ``step_size`` padded
positions at a time, so peak memory is one chunk's activations; ``embedding_steps`` yields after
each chunk, so that a server's worker can run generation steps in between.
"""

from __future__ import annotations

from collections.abc import Generator

import mlx.core as mx
import numpy as np

from ..options import PREFILL_STEP_SIZE


def forwards(lengths: list[int], step_size: int) -> list[list[int]]:
    """The texts (by index) each forward encodes: sorted by length, as many as keep a forward's padded
    positions (its rows times its longest) within ``step_size``; a longer text alone."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[i] <= step_size:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def embedding_steps(
    model, rows: list[list[int]], bos_token_id: int | None, step_size: int = PREFILL_STEP_SIZE
) -> Generator[None, None, np.ndarray]:
    """Embed ``rows`` (token ids, none empty), yielding after each evaluated chunk; returns their
    vectors, float32 [len(rows), hidden_size], in the order given."""
    vectors = np.zeros((len(rows), model.config.hidden_size), np.float32)
    for group in forwards([len(r) for r in rows], step_size):
        texts = [rows[i] for i in group]
        longest = max(map(len, texts))
        padding = [longest - len(t) for t in texts]
        ids = mx.array([[0] * p + t for p, t in zip(padding, texts)], dtype=mx.int32)
        # Positions pooled: each row's tokens after its padding and its leading <bos> (a text of <bos>
        # alone keeps it).
        first = mx.array([p + (t[0] == bos_token_id and len(t) > 1) for p, t in zip(padding, texts)])[:, None]
        cache = model.make_cache(padding)
        total = mx.zeros((len(texts), model.config.hidden_size), mx.float32)
        chunk = max(1, step_size // len(texts))
        for start in range(0, longest, chunk):
            hidden = model.encode(ids[:, start : start + chunk], cache, return_hidden=True).astype(mx.float32)
            pooled = (mx.arange(start, start + hidden.shape[1])[None] >= first)[..., None]
            total = total + mx.where(pooled, hidden, 0).sum(axis=1)
            mx.eval(total, cache.state())
            yield
        mean = total / (longest - first).astype(mx.float32)
        vectors[group] = np.array(mean / mx.linalg.norm(mean, axis=-1, keepdims=True))
    return vectors


def embed(model, rows: list[list[int]], bos_token_id: int | None, step_size: int = PREFILL_STEP_SIZE) -> np.ndarray:
    """``embedding_steps`` run to the end: the vectors of ``rows``, L2-normalized, float32 [N, hidden_size]."""
    steps = embedding_steps(model, rows, bos_token_id, step_size)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
