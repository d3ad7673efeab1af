"""The encoder's log-probabilities (scoring.py) against the transformers reference's log_softmax of its
encoder's next-token logits, on random checkpoints: whole, in pieces through the cache, in small
prefill chunks, with the most likely tokens."""

import numpy as np
import pytest
import torch

from checkpoint_tools.random_checkpoint import PRESETS
from mlx_dgemma import load
from mlx_dgemma.engine.scoring import MAX_TOP_LOGPROBS, Scorer, sequence_logprobs

from .reference import load_reference
from .test_ar_parity import reference_next_token_logits
from .test_model_parity import FP32_BOUND


def reference_logprobs(path, ids: list[int]) -> np.ndarray:
    """log_softmax [T, V] of the reference encoder's next-token logits at every position."""
    logits = reference_next_token_logits(load_reference(path), np.array([ids]))[0]
    return torch.log_softmax(torch.as_tensor(logits), dim=-1).numpy()


def bound(expected: np.ndarray, logits_scale: float) -> float:
    # log_softmax moves each entry by at most twice the largest change of a logit (the entry's own and
    # the log-sum-exp's), and the logits agree to FP32_BOUND of their largest magnitude.
    return 2 * FP32_BOUND * logits_scale


@pytest.mark.parametrize("preset", ["small", "mixed"])
def test_logprobs_match_reference(checkpoints, preset):
    path = checkpoints(preset)
    model, _ = load(path)
    sizes = PRESETS[preset]
    ids = np.random.default_rng(5).integers(3, sizes["vocab_size"], size=2 * sizes["sliding_window"] + 7).tolist()
    expected = reference_logprobs(path, ids)
    logits = reference_next_token_logits(load_reference(path), np.array([ids]))[0]
    tolerance = bound(expected, float(np.abs(logits).max()))
    want = [expected[t - 1, ids[t]] for t in range(1, len(ids))]

    whole = sequence_logprobs(model, ids, top=3)
    pieces = Scorer(model, top=3, step_size=5)  # chunked prefill, then pieces as commits come
    pieced = pieces.add(ids[:9]) + pieces.add(ids[9:10]) + pieces.add(ids[10:31]) + pieces.add(ids[31:])
    for got in (whole, pieced):
        assert [g.token for g in got] == ids
        assert got[0].logprob is None and got[0].top == []
        err = np.abs(np.array([g.logprob for g in got[1:]]) - want).max()
        assert err <= tolerance, f"{preset}: max|Δ logprob| = {err:.2e} > {tolerance:.2e}"
        for t, g in enumerate(got[1:], start=1):
            top_ids = [i for i, _ in g.top]
            top_values = np.array([v for _, v in g.top])
            assert len(set(top_ids)) == 3 and list(top_values) == sorted(top_values, reverse=True)
            assert np.abs(top_values - expected[t - 1, top_ids]).max() <= tolerance
            # the three most likely, up to ties within the tolerance
            assert top_values[-1] >= np.sort(expected[t - 1])[-3] - 2 * tolerance
            if g.token == top_ids[0]:  # a greedy token is its own top entry, to the bit
                assert g.logprob == top_values[0]


def test_top_is_bounded(demo):
    model, _ = demo
    with pytest.raises(ValueError, match=f"top must be from 0 to {MAX_TOP_LOGPROBS}, got 21"):
        Scorer(model, top=21)
    assert [g.top for g in sequence_logprobs(model, [2, 300, 301])] == [[], [], []]
