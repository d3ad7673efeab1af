"""The distribution a token is drawn from, under every policy: ``sampling_probs`` tempers the logits
and applies the sampling filters; ``penalized`` applies the repetition penalties to autoregressive
logits first. Autoregressive tokens, verified drafting's target and draft, and
each position a denoising step draws all come from it (a rule that masks logits first, such as a
grammar's, calls it after masking).

The filters are mlx-lm's (``mlx_lm.sample_utils``), with its definitions and in its order: top-p
(the smallest set of most likely tokens whose mass reaches ``top_p``), then min-p (tokens at least
``min_p`` times as likely as the most likely one), then top-k (the ``top_k`` most likely). They
apply to the tempered distribution (as vLLM and transformers apply them; mlx-lm filters before it
tempers, which gives the same top-k but a different top-p and min-p at a temperature other than 1),
so that a filter keeps the tokens of the distribution that is actually sampled.
"""

from __future__ import annotations

import math

import mlx.core as mx

PENALTY_CONTEXT = 20  # mlx-lm's: the penalties look at the last 20 tokens (the prompt's included)


def filtering(top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> bool:
    """Whether these filters remove anything at all."""
    return top_p < 1 or top_k > 0 or min_p > 0


def sampling_probs(
    logits: mx.array, temperature: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0
) -> mx.array:
    """The distribution [..., V] (float32) to draw from after ``logits`` [..., V] (or log-probabilities):
    softmax(logits / temperature) with the filtered-out tokens at 0, renormalised. Temperature 0 puts
    all the mass on the argmax (greedy), whatever the filters; so does ``top_k`` 1 at any temperature."""
    logits = logits.astype(mx.float32)
    if not temperature:
        return (mx.arange(logits.shape[-1]) == logits.argmax(-1, keepdims=True)).astype(mx.float32)
    scaled = logits / temperature
    if not filtering(top_p, top_k, min_p):
        return mx.softmax(scaled, axis=-1, precise=True)
    log_probs = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
    if top_p < 1:
        log_probs = _top_p(log_probs, top_p)
    if min_p > 0:
        log_probs = mx.where(log_probs < log_probs.max(-1, keepdims=True) + math.log(min_p), -math.inf, log_probs)
    if 0 < top_k < logits.shape[-1]:
        dropped = mx.argpartition(-log_probs, kth=top_k - 1, axis=-1)[..., top_k:]
        log_probs = mx.put_along_axis(log_probs, dropped, mx.array(-math.inf, mx.float32), axis=-1)
    return mx.softmax(log_probs, axis=-1, precise=True)


def penalized(
    logits: mx.array, history: list[int], repetition: float = 1.0, presence: float = 0.0, frequency: float = 0.0
) -> mx.array:
    """``logits`` [1, V] with mlx-lm's penalties (``make_logits_processors``) for the tokens among the
    last ``PENALTY_CONTEXT`` of ``history``: a repeated token's logit divided by ``repetition`` (multiplied
    when negative), ``presence`` subtracted once, ``frequency`` once per occurrence."""
    tokens = history[-PENALTY_CONTEXT:]
    if not tokens:
        return logits
    index = mx.array(tokens)
    logits = logits.astype(mx.float32)
    if repetition != 1:
        chosen = logits[:, index]
        logits[:, index] = mx.where(chosen < 0, chosen * repetition, chosen / repetition)
    if presence:
        logits[:, index] -= presence
    if frequency:
        logits = logits.at[:, index].subtract(frequency)
    return logits


def _top_p(log_probs: mx.array, top_p: float) -> mx.array:
    """The most likely tokens whose mass reaches ``top_p`` (mlx-lm's ``apply_top_p``)."""
    ascending = mx.sort(log_probs, axis=-1)
    probs = mx.exp(ascending)
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = mass_above[..., :1] + probs[..., :1]
    dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(ascending, dropped, axis=-1)
    return mx.where(log_probs < threshold, -math.inf, log_probs)
