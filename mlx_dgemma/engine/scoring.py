"""The encoder's log-probabilities of a token sequence: the encoder is a causal LM, so one forward over
the tokens gives, at each position, the distribution of the next token (``model.next_token_logits``'s
head, at every position). ``Scorer`` takes a sequence piece by piece (a prompt, then each commit of an
answer) through a cache of its own, and gives each token its log-probability given the tokens before
it and the most likely tokens at its place. The first token of a sequence has none (nothing precedes it).

These are the encoder's numbers, at temperature 1 and before any filter: under autoregressive decoding
(and verified drafting, whose exact sampling keeps the encoder's distribution) the distribution the
tokens were drawn from; under the diffusion policies the tokens were drawn by the denoiser, and these
are what the encoder makes of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from ..errors import OptionError
from ..options import PREFILL_STEP_SIZE

MAX_TOP_LOGPROBS = 20  # most likely tokens given per position, at most (OpenAI's bound on chat's top_logprobs)
HEAD_ROWS = 256  # positions whose logits [rows, vocabulary] are computed at a time (a 262k vocabulary: 256 MB)


@dataclass
class TokenLogprob:
    """One token's log-probability given the tokens before it (None: the sequence's first token), and
    the ``top`` most likely tokens at its place as (id, log-probability), most likely first."""

    token: int
    logprob: float | None
    top: list[tuple[int, float]] = field(default_factory=list)


def log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


class Scorer:
    """The log-probabilities of a sequence given piece by piece (``add``), each token's given every
    token added before it; ``top`` most likely tokens per position (0 to ``MAX_TOP_LOGPROBS``)."""

    def __init__(self, model, top: int = 0, step_size: int = PREFILL_STEP_SIZE):
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise OptionError(f"top must be from 0 to {MAX_TOP_LOGPROBS}, got {top}")
        self.model, self.top, self.step_size = model, top, step_size
        self.cache = model.make_cache()
        self.last: mx.array | None = None  # the log-probabilities [1, V] of the token after those added

    def add(self, ids, **vision_inputs) -> list[TokenLogprob]:
        """Encode ``ids`` after what was added; their log-probabilities. ``vision_inputs``: the images of
        a prompt's ids (``model.encode``'s), encoded in one forward as the engine does."""
        ids = [int(i) for i in ids]
        step = len(ids) if vision_inputs else self.step_size
        scored: list[TokenLogprob] = []
        for start in range(0, len(ids), step):
            chunk = ids[start : start + step]
            hidden = self.model.encode(mx.array([chunk]), self.cache, return_hidden=True, **vision_inputs)[0]
            for a in range(0, len(chunk), HEAD_ROWS):
                rows = log_softmax(self.model.head(hidden[a : a + HEAD_ROWS]))  # predicting chunk[a + 1 : a + 1 + r]
                targets = chunk[a : a + len(rows)]
                if self.last is None:  # the sequence's first token
                    scored.append(TokenLogprob(targets[0], None))
                    predictors, targets = rows[:-1], targets[1:]
                else:
                    predictors = mx.concatenate([self.last, rows[:-1]])
                self.last = rows[-1:]
                scored += self._picked(predictors, targets)
            mx.eval(self.cache.state(), self.last)
        return scored

    def _picked(self, logprobs: mx.array, targets: list[int]) -> list[TokenLogprob]:
        """Each row's log-probability of its target, and its ``top`` most likely tokens."""
        if not targets:
            return []
        chosen = mx.take_along_axis(logprobs, mx.array(targets)[:, None], axis=-1)[:, 0]
        if not self.top:
            return [TokenLogprob(t, lp) for t, lp in zip(targets, chosen.tolist())]
        best = mx.argpartition(-logprobs, kth=self.top - 1, axis=-1)[:, : self.top]
        values = mx.take_along_axis(logprobs, best, axis=-1)
        out = []
        for t, lp, ids, lps in zip(targets, chosen.tolist(), best.tolist(), values.tolist()):
            out.append(TokenLogprob(t, lp, sorted(zip(ids, lps), key=lambda pair: -pair[1])))
        return out


def sequence_logprobs(model, ids, top: int = 0, step_size: int = PREFILL_STEP_SIZE) -> list[TokenLogprob]:
    """The log-probabilities of every token of ``ids`` (the first: None) in one pass."""
    return Scorer(model, top, step_size).add(ids)
