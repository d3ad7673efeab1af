"""Embeddings (mlx_dgemma/engine/embeddings.py): a text's vector is the mean of the encoder's final-normed states
over its tokens but the leading <bos>, at unit length; texts embedded together give each the vector it
gives alone, in the order given, however they are grouped into forwards and chunked."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_dgemma import load
from mlx_dgemma.engine.embeddings import embed, forwards

from .test_batch import BOUND, prompts_of, relative

# Longer than the pattern preset's sliding window (41 > its window), a text of <bos> alone, equal lengths.
LENGTHS = [9, 41, 1, 23, 2, 23]


@pytest.fixture(scope="module", params=["demo", "pattern", "mixed"])
def model(request, checkpoints):
    from mlx_dgemma.generate import DEMO_MODEL

    return load(DEMO_MODEL if request.param == "demo" else checkpoints(request.param))


def rows_of(model, tokenizer, seed=0):
    """Texts of ``LENGTHS`` tokens, <bos> first."""
    return [[tokenizer.bos_token_id] + p[:-1] for p in prompts_of(model, LENGTHS, seed)]


def test_a_batch_gives_each_text_the_vector_it_gives_alone(model):
    model, tokenizer = model
    rows = rows_of(model, tokenizer)
    batch = embed(model, rows, tokenizer.bos_token_id)
    assert batch.shape == (len(rows), model.config.hidden_size) and batch.dtype == np.float32
    for i, row in enumerate(rows):
        assert relative(batch[i], embed(model, [row], tokenizer.bos_token_id)[0]) <= BOUND


def test_the_vector_is_the_mean_final_normed_state_after_bos_at_unit_length(model):
    model, tokenizer = model
    for row in rows_of(model, tokenizer, seed=1):
        hidden = np.array(model.encode(mx.array([row]), model.make_cache(), return_hidden=True)[0], np.float64)
        mean = hidden[1:].mean(axis=0) if len(row) > 1 else hidden[0]
        got = embed(model, [row], tokenizer.bos_token_id)[0]
        assert relative(got, mean / np.linalg.norm(mean)) <= BOUND
        assert abs(np.linalg.norm(np.asarray(got, np.float64)) - 1) <= BOUND


def test_chunked_forwards_give_the_vectors_of_one_forward(model):
    model, tokenizer = model
    rows = rows_of(model, tokenizer, seed=2)
    whole = embed(model, rows, tokenizer.bos_token_id)
    chunked = embed(model, rows, tokenizer.bos_token_id, step_size=16)  # the 41-token text in 3 chunks
    assert relative(chunked, whole) <= BOUND


def test_forwards_hold_each_text_once_within_the_step():
    """Every text in exactly one forward, a forward's padded positions within the step (a text longer
    than the step alone)."""
    lengths = [5, 300, 7, 7, 64, 2, 129, 1]
    for step in (16, 64, 128, 2048):
        groups = forwards(lengths, step)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for group in groups:
            longest = max(lengths[i] for i in group)
            assert len(group) * longest <= step or len(group) == 1
