"""The decoding rules: what "the next token" is wherever the encoder decides tokens, one at a time
(the engine's autoregressive rows) or verifying a draft (drafting.verify_rounds). Every rule is a
``Rule``: ``GreedyRule`` and ``SampledRule`` decode freely up to a stop id or a token budget;
``TemplateRule`` forces a template's text and decodes its holes; ``GrammarRule`` (grammar_rule.py)
keeps each token among those a grammar allows. ``rule_for`` is the one place a row's rule is chosen.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx
import numpy as np

from .filters import sampling_probs
from .grammar_rule import GrammarRule
from .sampler import Random


class Rule(Protocol):
    """Decides an answer's tokens: ``output`` holds those decided, ``done`` says the answer is whole,
    ``room`` how many more may come."""

    output: list[int]

    @property
    def done(self) -> bool: ...

    @property
    def room(self) -> int: ...

    def known(self, n: int) -> list[int]:
        """Up to ``n`` tokens that follow the last decision whatever the model predicts."""
        ...

    def follow(self, logits: mx.array, proposed: list[int], q: mx.array | None = None) -> tuple[int, int | None]:
        """Decide along ``logits`` [n, V] while the decisions equal ``proposed`` (see ``GreedyRule.follow``)."""
        ...


class GreedyRule:
    """Greedy decoding up to a stop id or ``max_tokens``."""

    def __init__(self, stop_ids, max_tokens: int):
        self.stop_ids, self.max_tokens = set(stop_ids), max_tokens
        self.output: list[int] = []
        self.done = False

    @property
    def room(self) -> int:
        """Most tokens still to come."""
        return self.max_tokens - len(self.output)

    def known(self, n: int) -> list[int]:
        """Tokens that will follow the last decision whatever the model predicts (none when free)."""
        return []

    def _emit(self, token: int) -> None:
        self.output.append(token)
        self.done = token in self.stop_ids or len(self.output) >= self.max_tokens

    def follow(self, logits: mx.array, proposed: list[int], q: mx.array | None = None) -> tuple[int, int | None]:
        """Decide along ``logits`` [n, V] (row j: the prediction after the j-th fed token) while the
        decisions equal ``proposed`` [n − 1]. Returns (proposals accepted, the next known token or
        None when decoding is done: then a stop id that was a proposal counts as accepted)."""
        for j, token in enumerate(np.array(logits.argmax(-1)).tolist()):
            self._emit(token)
            agrees = j < len(proposed) and token == proposed[j]
            if self.done:
                return j + agrees, None
            if not agrees:
                return j, token
        raise AssertionError("more proposals than rows")


class SampledRule(GreedyRule):
    """Sampling at ``temperature`` through the ``filters`` (top_p, top_k, min_p:
    ``filters.sampling_probs``); with a draft, speculative rejection sampling against the draft's
    distribution ``q`` [n − 1, V] of the proposed tokens, exact for the filtered target."""

    def __init__(self, stop_ids, max_tokens: int, temperature: float, rng: Random, filters: tuple = ()):
        super().__init__(stop_ids, max_tokens)
        self.temperature, self.rng, self.filters = temperature, rng, tuple(filters)

    @staticmethod
    def acceptance(p: mx.array, q: mx.array) -> mx.array:
        """Probability of keeping a draft token drawn from q where the target gives it p."""
        return mx.minimum(1.0, p / q)

    @staticmethod
    def residual(p: mx.array, q: mx.array) -> mx.array:
        """What to draw from after a rejection: max(0, p − q) normalised (p where that is all zero,
        which happens only where p ≤ q everywhere, i.e. p = q, and then nothing is rejected)."""
        residual = mx.maximum(p - q, 0.0)
        mass = residual.sum(-1, keepdims=True)
        return mx.where(mass > 1e-12, residual / mx.maximum(mass, 1e-30), p)

    def follow(self, logits, proposed, q=None):
        p = sampling_probs(logits, self.temperature, *self.filters)
        n = len(proposed)
        accept = resampled = None
        if n:
            rows, idx = mx.arange(n), mx.array(proposed)
            keep = self.acceptance(p[rows, idx], q[rows, idx])
            # A Bernoulli draw is a categorical over (reject, accept): every draw goes through ``rng``.
            accept = self.rng.categorical(mx.stack([1 - keep, keep], axis=-1))
            resampled = self.rng.categorical(self.residual(p[:n], q))
        bonus = self.rng.categorical(p[n : n + 1])
        mx.eval(accept, resampled, bonus)
        for j in range(n):
            if accept[j].item():
                self._emit(proposed[j])
                if self.done:
                    return j + 1, None
                continue
            self._emit(resampled[j].item())
            return j, None if self.done else self.output[-1]
        self._emit(bonus[0].item())
        return n, None if self.done else self.output[-1]


class TemplateRule:
    """A template decoded autoregressively: literal tokens forced, each hole decoded greedily among the
    tokens its class allows until the model predicts the text that follows it (the rest of the hole is
    padding, as in a canvas, and is not fed to the model). ``output`` is aligned with the template."""

    def __init__(self, template, tokenizer, vocab: int, end_of_turn: int | None):
        from ..structured.template import token_classes

        self.pad = tokenizer.pad_token_id
        self.classes = token_classes(tokenizer, vocab)
        self.tokens = list(template.tokens) + ([end_of_turn] if end_of_turn is not None else [])
        self.holes = dict(template.holes)
        self.output: list[int] = []
        self.position = 0  # next template position to decide
        self.chosen: list[int] = []  # the open hole's tokens so far

    @property
    def done(self) -> bool:
        return self.position >= len(self.tokens)

    @property
    def room(self) -> int:
        return len(self.tokens) - self.position

    def known(self, n: int) -> list[int]:
        out, i = [], self.position
        while i < len(self.tokens) and i not in self.holes and len(out) < n:
            out.append(self.tokens[i])
            i += 1
        return out

    def step(self, logits: mx.array) -> int | None:
        """The next token to feed, given the logits after the last fed one (None: the template is done)."""
        from ..structured.template import FREE

        scores = None
        while not self.done:
            if self.position not in self.holes:
                token = self.tokens[self.position]
                self.output.append(token)
                self.position += 1
                return token
            hole = self.holes[self.position]
            if scores is None:
                scores = np.array(logits.reshape(-1).astype(mx.float32))
            j = len(self.chosen)
            end = self.position + hole.size
            following = self.tokens[end] if end < len(self.tokens) else None
            if hole.kind == "choice":
                allowed = np.zeros_like(scores, dtype=bool)
                live = [c for c in hole.choices if c[:j] == self.chosen]
                allowed[[c[j] for c in live if len(c) > j]] = True
                finished = any(len(c) == j for c in live)
            else:
                allowed = self.classes[hole.kind]
                finished = j >= hole.required and following not in (None, FREE) and int(scores.argmax()) == following
            if finished or not allowed.any():
                self._close(hole.size)
                continue
            token = int(np.where(allowed, scores, -np.inf).argmax())
            self.chosen.append(token)
            if len(self.chosen) == hole.size:
                self._close(hole.size)
            return token
        return None

    def _close(self, size: int) -> None:
        self.output += self.chosen + [self.pad] * (size - len(self.chosen))
        self.position += size
        self.chosen = []

    def follow(self, logits, proposed, q=None):
        for j in range(logits.shape[0]):
            token = self.step(logits[j])
            agrees = j < len(proposed) and token == proposed[j]
            if token is None or self.done:
                return j + agrees, None
            if not agrees:
                return j, token
        raise AssertionError("more proposals than rows")


def rule_for(row, tokenizer, vocab: int) -> Rule | None:
    """The rule of an engine row (rows.Row) that the encoder decodes: its template's or its grammar's;
    for free text, greedy or sampled at the row's temperature (None: a free autoregressive row,
    whose tokens are drawn on the device)."""
    job = row.job
    if job.grammar is not None:
        return GrammarRule(job.grammar, vocab, row.remaining, row.temperature, job.rng, row.plan.settings.filters)
    if job.template is not None:
        return TemplateRule(job.template, tokenizer, vocab, job.end_of_turn)
    if row.plan.mode != "verified":
        return None
    if row.temperature:
        return SampledRule(job.stop_ids, row.remaining, row.temperature, job.rng, row.plan.settings.filters)
    return GreedyRule(job.stop_ids, row.remaining)


def stopped(job, rule: Rule | None, tokens: list[int]) -> bool:
    """Whether an answer ended by itself: a template's layout is whole, a grammar reached its end,
    or the last token is a stop id."""
    if job.grammar is not None and rule is not None and rule.finished:
        return True
    return job.template is not None or bool(tokens) and tokens[-1] in job.stop_ids
