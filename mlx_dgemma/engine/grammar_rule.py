"""``GrammarRule``: decoding under a grammar (grammar.py), greedy or sampled, one token at a time (the
engine's autoregressive rows) or verifying a draft (drafting.verify_rounds).

``max_tokens`` bounds a structured answer as any other, and the answer still ends valid: the rule
holds at every token a way to finish that fits the room left (the closing path: forced tokens,
closing quotes and brackets, the shortest values, each token taken by llguidance) and takes the
model's token only where a closing path after it that fits is found, within a bounded count of
matcher operations; else it takes the held path's next token. A budget shorter than the schema's
closing path from the start is refused before any forward.
"""

from __future__ import annotations

import llguidance
import mlx.core as mx
import numpy as np

from ..errors import TemplateError
from ..structured.closing import CLOSING_CAP, Operations, closing_path, closing_table, first_closing_path, whole_json
from ..structured.distinct_keys import KeyTracker
from ..structured.grammar import Grammar, allowed_tokens, single_line
from .filters import sampling_probs

CLOSING_SLACK = 64  # tokens past the closing path from the start...
WALK_OPERATIONS = 16  # ...at this many matcher operations each: what a walk mid-answer may take
# Digits in a row the rule lets the model write: Python's JSON reader (the openai client's .parse,
# jsonschema) refuses an integer of over 4,300 digits, though JSON sets no bound. Past this many, the
# tokens that would add digits are masked wherever the grammar allows another.
MAX_DIGITS = 4096


def masked_probs(logits: np.ndarray, allowed: np.ndarray, temperature: float, filters: tuple = ()) -> np.ndarray:
    """The distribution to draw from over the ``allowed`` tokens only: the masked logits tempered and
    filtered (``filters.sampling_probs``: top-p, top-k, min-p) as every other draw is."""
    masked = mx.array(np.where(allowed, logits, -np.inf).astype(np.float32))
    return np.array(sampling_probs(masked, temperature, *filters), dtype=np.float64)


class GrammarRule:
    """Decoding under a grammar up to its end or ``max_tokens`` (a rules.Rule, and
    ``step`` for one token at a time): greedy, or sampled at ``temperature`` through ``rng`` with the
    sampling ``filters`` (top_p, top_k, min_p) applied after the mask.

    The rule holds at every token a closing path from where the answer is that fits the room left,
    each of its tokens taken by llguidance (the one from the start is checked at admission). The
    model's token is taken only where a closing path after it is found that fits the room after it:
    the path held, where the token leaves it valid, else one walked from after the token within
    ``operations_limit`` matcher operations (a bounded cost per token). Otherwise the held path's
    next token is taken instead. So an answer that fits its budget at the start always ends valid.
    No token that would close a key its object already has is allowed (``keys``: distinct_keys.py),
    in the mask, in a proposal, or on a closing path."""

    def __init__(
        self, grammar: Grammar, vocab: int, max_tokens: int, temperature: float = 0.0, rng=None, filters: tuple = ()
    ):
        self.matcher = grammar.matcher()
        if self.matcher.is_error():
            raise TemplateError(f"the schema cannot be enforced: {single_line(self.matcher.get_error())}")
        self.vocab, self.max_tokens = vocab, max_tokens
        self.temperature, self.rng, self.filters = temperature, rng, filters
        self.eos = grammar.tokenizer.eos_token
        self.table, self.examples = closing_table(grammar, vocab), grammar.examples
        self.path = first_closing_path(grammar, vocab)  # None: no end within CLOSING_CAP
        self.operations_limit = WALK_OPERATIONS * (len(self.path or ()) + CLOSING_SLACK)
        self.most_operations = 0  # the most matcher operations one token's closing path took
        self.stops = np.zeros(vocab, dtype=bool)
        self.stops[[i for i in grammar.tokenizer.eos_tokens if i < vocab]] = True
        self.output: list[int] = []
        self.digits = 0  # the answer's trailing digits
        self.longest_digits = int(self.table.digits.max())  # (the most one token adds)
        self.done = False
        self.keys = KeyTracker()  # the keys of the answer's open objects: none is written twice
        self._allowed: np.ndarray | None = None  # the grammar's mask now, once computed
        self._distinct: np.ndarray | None = None  # ...less the tokens that would repeat a key

    @property
    def room(self) -> int:
        return self.max_tokens - len(self.output)

    @property
    def finished(self) -> bool:
        """Whether the grammar reached its end (its answer is whole)."""
        return self.matcher.is_stopped()

    def known(self, n: int) -> list[int]:
        """The tokens the grammar forces next (a key, a bracket), at most ``n``."""
        return [] if self.done else self.matcher.compute_ff_tokens()[:n]

    def _mask(self) -> np.ndarray:
        if self._allowed is None:
            self._allowed = allowed_tokens(self.matcher, self.vocab)
        if self._distinct is None:
            self._distinct = self.table.distinct(self._allowed, self.keys)
        if self.digits + self.longest_digits > MAX_DIGITS:
            fewer = self._distinct & (self.digits + self.table.digits <= MAX_DIGITS)
            if fewer.any():
                return fewer
        return self._distinct

    def _emit(self, token: int) -> int:
        """Take ``token``, or where llguidance gives up after it, the first token of a closing path
        walked from here; a ``TemplateError`` where none is found or llguidance refuses a token its
        mask allowed (an invalid answer is never ended as if whole)."""
        after = self.matcher.deep_copy()
        if not after.consume_token(token):
            reason = single_line(after.get_error().partition("\n")[0])  # (the rest is llguidance's state dump)
            raise TemplateError(
                f"llguidance gave up on the schema mid-answer ({reason}); simplify the schema's patterns"
            )
        mask = None if after.is_stopped() or after.is_error() else allowed_tokens(after, self.vocab)
        if self._gave_up(after, mask, token):
            if not (path := self._walk(self.matcher, cap=self.room)):
                raise TemplateError(
                    "llguidance gave up on the schema mid-answer (its lexer's limit on a pattern), "
                    "so no valid answer can be written; simplify the schema's patterns"
                )
            token, self.path, mask = path[0], path[1:], None
            after = self.matcher.deep_copy()
            after.consume_token(token)
        text = self.table.tokenizer.decode_bytes([token])
        trailing = len(text) - len(text.rstrip(b"0123456789"))
        self.digits = self.digits + trailing if text and trailing == len(text) else trailing
        self.matcher, self._allowed, self._distinct = after, mask, None
        self.keys.feed(text)
        self.output.append(token)
        self.done = self.matcher.is_stopped() or len(self.output) >= self.max_tokens
        return token

    def _gave_up(self, after: llguidance.LLMatcher, mask: np.ndarray | None, token: int) -> bool:
        """Whether llguidance, ``token`` taken (``after``, allowing ``mask``), gave up: an error, or only
        the end allowed though the answer is not whole JSON (its lexer gave up on a pattern mid-string)."""
        if self.stops[token]:
            return False
        if after.is_error():
            return True
        ends_only = mask is None or not (mask & ~self.stops).any()
        return ends_only and not whole_json(self.table.tokenizer.decode_bytes(self.output + [token]))

    def _guarded(self, token: int) -> int:
        """``token``, or the held closing path's next one where no closing path after ``token`` that fits
        the room after it is found."""
        if self.path is None:
            return token
        if self.path and token == self.path[0]:
            self.path = self.path[1:]
            return token
        operations = Operations(self.operations_limit)
        path = self._path_after(token, self.room - 1, operations)
        self.most_operations = max(self.most_operations, operations.count)
        if path is not None:
            self.path = path
            return token
        token, self.path = self.path[0], self.path[1:]
        return token

    def _path_after(self, token: int, room: int, operations: Operations) -> list[int] | None:
        """A closing path after ``token`` of at most ``room`` tokens: the one held where it still ends
        the answer from there (a character inside a string, mostly), else one walked afresh."""
        after = self.matcher.deep_copy()
        operations.spend()
        if not after.consume_token(token) or after.is_error():
            return None
        if self.stops[token]:
            return [] if after.is_stopped() else None
        keys = self.keys.copy()
        keys.feed(self.table.text(token))
        if len(self.path) <= room:
            held = after.deep_copy()
            operations.spend()
            if (
                held.consume_tokens(self.path)
                and held.is_stopped()
                and not held.is_error()
                and not keys.repeats(self.table.tokenizer.decode_bytes(self.path))
            ):
                return list(self.path)
        return self._walk(after, token, room, operations, keys)

    def _walk(
        self,
        matcher: llguidance.LLMatcher,
        token: int | None = None,
        cap: int = CLOSING_CAP,
        operations: Operations | None = None,
        keys: KeyTracker | None = None,
    ) -> list[int] | None:
        written = self.table.tokenizer.decode_bytes(self.output + ([] if token is None else [token]))
        try:
            path = closing_path(
                matcher,
                self.table,
                self.eos,
                cap,
                self.examples,
                written,
                operations or Operations(self.operations_limit),
                self.keys if keys is None else keys,
            )
        except TemplateError:  # llguidance gave up on the way out from here
            return None
        return path if path is None or len(path) <= cap else None

    def _choose(self, logits: np.ndarray) -> int:
        allowed = self._mask()
        if not self.temperature:
            return int(np.where(allowed, logits, -np.inf).argmax())
        probs = masked_probs(logits, allowed, self.temperature, self.filters)
        return int(self.rng.categorical(mx.array(probs[None], dtype=mx.float32))[0].item())

    def step(self, logits: mx.array) -> int | None:
        """The next token after ``logits`` [V] (None: the grammar is done)."""
        if self.done:
            return None
        return self._emit(self._guarded(self._choose(np.array(logits.reshape(-1).astype(mx.float32)))))

    def follow(self, logits: mx.array, proposed: list[int], q: mx.array | None = None) -> tuple[int, int | None]:
        """As ``GreedyRule.follow``, each row's logits masked by the grammar after the tokens kept so
        far. Sampled, a proposal drawn from ``q`` is kept with probability min(1, p/q) and a rejection
        draws from max(0, p − q) normalised, p the masked target: the output is distributed as
        constrained autoregressive sampling."""
        rows = np.array(logits.astype(mx.float32))
        qs = None if q is None else np.array(q.astype(mx.float32))
        for j in range(rows.shape[0]):
            if self.done:
                return j, None
            proposal = proposed[j] if j < len(proposed) else None
            token = self._emit(
                self._guarded(self._decide(rows[j], proposal, None if qs is None or proposal is None else qs[j]))
            )
            if self.done:
                return j + (token == proposal), None
            if token != proposal:
                return j, token
        raise AssertionError("more proposals than rows")

    def _decide(self, logits: np.ndarray, proposal: int | None, q: np.ndarray | None) -> int:
        if not self.temperature or q is None:
            return self._choose(logits)
        p = masked_probs(logits, self._mask(), self.temperature, self.filters)
        keep = min(1.0, p[proposal] / max(float(q[proposal]), 1e-30))
        if self.rng.categorical(mx.array([[1 - keep, keep]], dtype=mx.float32))[0].item():
            return proposal
        residual = np.maximum(p - q, 0.0)
        draw = residual / residual.sum() if residual.sum() > 1e-12 else p
        return int(self.rng.categorical(mx.array(draw[None], dtype=mx.float32))[0].item())
