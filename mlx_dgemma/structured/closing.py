"""The closing path: the way out of a grammar state within a budget (forced tokens, closing quotes
and brackets, the shortest values, each token taken by llguidance). The rule (grammar_rule.py) holds
one at every token; the one from the grammar's start is the schema's shortest answer, which a
request's budget is checked against before any forward (``check_closing_room``,
``check_closing_fits``).
"""

from __future__ import annotations

import json
import string
import weakref
from dataclasses import dataclass

import llguidance
import numpy as np

from ..errors import TemplateError
from .grammar import Grammar, allowed_tokens, single_line

CLOSING_CAP = 8192  # tokens a closing path may take before it counts as endless


@dataclass(frozen=True)
class ClosingTable:
    """Per token of a vocabulary, what a closing path goes by: ``scores`` (closing brackets and quotes
    up, a zero, a number's shortest value after which JSON allows no digit, up; opening brackets
    down, they start more; separators a little down: an object's required keys need them, an
    array's ] beats them), ``marks``, the ids of single ASCII punctuation characters, ``same``,
    each id's first id with the same text (a walk that repeats a text repeats it under any id),
    ``closes``, the brackets each closes less those it opens, and ``digits``, each token's leading ASCII
    digits; ``tokenizer`` is whose vocabulary it is."""

    scores: np.ndarray
    marks: np.ndarray
    same: np.ndarray
    closes: np.ndarray
    digits: np.ndarray
    tokenizer: llguidance.LLTokenizer


_CLOSING_TABLES: dict[int, tuple] = {}


def closing_table(grammar: Grammar, vocab: int) -> ClosingTable:
    """The ``ClosingTable`` of ``grammar``'s tokenizer (built once per tokenizer)."""
    cached = _CLOSING_TABLES.get(id(grammar.tokenizer))
    if cached is not None and cached[0] is grammar.tokenizer and len(cached[1].scores) == vocab:
        return cached[1]
    weights = {
        ord("}"): 3.0,
        ord("]"): 3.0,
        ord('"'): 2.0,
        ord("0"): 1.0,
        ord("{"): -3.0,
        ord("["): -3.0,
        ord(","): -1.0,
    }
    scores, marks, same, closes, first = np.full(vocab, -10.0), [], np.arange(vocab), np.zeros(vocab), {}
    digits = np.zeros(vocab, dtype=np.int64)
    for i in range(vocab):
        if grammar.tokenizer.is_special_token(i) or not (text := grammar.tokenizer.decode_bytes([i])):
            continue
        scores[i] = sum(weights.get(b, -0.1) for b in text)
        same[i] = first.setdefault(text, i)
        closes[i] = text.count(b"}") + text.count(b"]") - text.count(b"{") - text.count(b"[")
        digits[i] = len(text) - len(text.lstrip(b"0123456789"))
        if len(text) == 1 and chr(text[0]) in string.punctuation:
            marks.append(i)
    table = ClosingTable(scores, np.array(marks, dtype=np.int64), same, closes, digits, grammar.tokenizer)
    _CLOSING_TABLES[id(grammar.tokenizer)] = (grammar.tokenizer, table)
    return table


def whole_json(text: bytes) -> bool:
    """Whether ``text`` is one whole JSON value."""
    try:
        json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False
    return True


class _Spent(Exception):
    pass


class Operations:
    """A count of the matcher operations a closing path's walk takes (a mask, or a token tried on a
    copy), against ``limit``: past it the walk gives up (``_Spent``)."""

    def __init__(self, limit: int | None = None):
        self.limit, self.count = limit, 0

    def spend(self, n: int = 1) -> None:
        self.count += n
        if self.limit is not None and self.count > self.limit:
            raise _Spent


def closing_path(
    matcher: llguidance.LLMatcher,
    table: ClosingTable,
    eos: int,
    cap: int = CLOSING_CAP,
    examples: tuple[tuple[int, ...], ...] = (),
    written: bytes = b"",
    operations: Operations | None = None,
) -> list[int] | None:
    """The tokens that take ``matcher`` (unchanged: a copy walks) to the grammar's end: forced ones,
    the end as soon as it is allowed, the first of ``examples`` (Grammar.examples) the grammar takes
    where a string cannot end yet, else ``_narrowest``'s pick. A token picked lately scores less
    (by ``REPEAT_PENALTY``, fading by ``REPEAT_FADE`` a token), so a walk caught in a loop tries the
    other ways out while one that closes a string every few tokens still closes it with a quote.
    None when the walk takes more than ``cap`` tokens or ``operations`` past their limit; a
    ``TemplateError`` when llguidance gives up on the schema on the way (it refuses a token its own
    mask allowed, or allows the end where the answer, ``written`` so far and the path, is not whole
    JSON: its lexer gave up on a pattern)."""
    try:
        return _walk_out(matcher, table, eos, cap, examples, written, operations or Operations())
    except _Spent:
        return None


def _walk_out(
    matcher, table: ClosingTable, eos: int, cap: int, examples, written: bytes, operations: Operations
) -> list[int] | None:
    walker, path, recent, seen = matcher.deep_copy(), [], np.zeros(len(table.scores)), {}
    quotes = table.scores == 2  # a lone quote: a string's end
    while not walker.is_stopped():
        operations.spend()
        forced = walker.compute_ff_tokens()
        if not forced:
            allowed = allowed_tokens(walker, len(table.scores))
            if allowed[eos]:
                if not whole_json(written + table.tokenizer.decode_bytes(path)):
                    raise TemplateError(
                        "the schema cannot be enforced: llguidance gave up on it (it allows the "
                        "answer to end inside a string); simplify its patterns"
                    )
                forced = [eos]
            elif examples and not (allowed & quotes).any():
                operations.spend(len(examples))
                forced = next((list(e) for e in examples if walker.validate_tokens(list(e)) == len(e)), [])
            if not forced:
                forced = [
                    _narrowest(
                        walker, np.where(allowed, table.scores - recent[table.same], -np.inf), table, seen, operations
                    )
                ]
                recent[table.same[forced[0]]] += REPEAT_PENALTY
        if len(path) + len(forced) > cap:
            return None
        if not all(walker.consume_token(t) for t in forced):
            reason = walker.get_error().split("\n")[0] if walker.is_error() else "it refused its own forced tokens"
            raise TemplateError(f"the schema cannot be enforced: llguidance gave up on it: {single_line(reason)}")
        path.extend(forced)
        recent *= REPEAT_FADE ** len(forced)
    return path


REPEAT_PENALTY = 1.0  # score a picked token loses on the closing path...
REPEAT_FADE = 0.8  # ...fading by this factor a token: one picked at every token loses 5 points
FORCED_WEIGHT = 1.0  # score a choice loses per bracket the tokens it forces open


def _narrowest(
    matcher: llguidance.LLMatcher,
    scores: np.ndarray,
    table: ClosingTable,
    seen: dict,
    operations: Operations,
    candidates: int = 6,
) -> int:
    """Of the ``candidates`` best-scored tokens and as many of the allowed punctuation marks (a comma that ends
    a number, the @ of an email), the one whose score is highest, less ``FORCED_WEIGHT`` for each
    bracket the tokens it forces open (a key that opens an array scores less than one that opens a
    string), after which a string can end, and
    after which ``matcher`` allows the fewest (in bits: a quote that closes a string beats a bracket
    inside it). What follows a token is looked up in ``seen`` by the tokens allowed now and the token
    (a walk through a long array meets the same choice at every item), else found on a copy."""
    best, best_key = -1, None
    quotes = table.scores == 2  # a lone quote: a string's end
    marks = table.marks[scores[table.marks] > -np.inf]
    now = np.isfinite(scores).tobytes()
    for token in _distinct(np.argsort(-scores, kind="stable"), table.same, candidates) + _distinct(
        marks[np.argsort(-scores[marks], kind="stable")], table.same, candidates
    ):
        if scores[token] == -np.inf:
            continue
        if (now, token) not in seen:
            operations.spend()
            after = matcher.deep_copy()
            if not after.consume_token(int(token)) or after.is_error():  # the mask allowed what llguidance gives up on
                seen[now, token] = np.inf
            elif after.is_stopped():
                seen[now, token] = None  # the grammar ends
            else:
                allowed = allowed_tokens(after, len(scores))
                in_string = (allowed & quotes).any() and (allowed & ~quotes).any()  # (a lone quote opens a key)
                seen[now, token] = (
                    np.log2(allowed.sum() + 1)
                    - 2 * in_string  # the string can end next
                    - FORCED_WEIGHT * table.closes[after.compute_ff_tokens()].sum()
                )
        width = seen[now, token]
        if width is None:
            return int(token)
        key = width - scores[token]
        if best_key is None or key < best_key:
            best, best_key = int(token), key
    return best


def _distinct(ranked: np.ndarray, same: np.ndarray, n: int) -> list[int]:
    """The first ``n`` of ``ranked`` with texts unlike those before (a text's other ids choose alike)."""
    texts: dict[int, int] = {}
    for token in ranked.tolist():
        if len(texts) == n:
            break
        texts.setdefault(int(same[token]), token)
    return list(texts.values())


def first_closing_path(grammar: Grammar, vocab: int) -> list[int] | None:
    """The closing path from the grammar's start, walked once per grammar (the server's default budget,
    the budget check and every row under it read it): the shorter of the walks on the grammar and on
    its required-only shape (the walk may write optional keys; that shape has none), the latter where
    the grammar takes it."""
    cached = _FIRST_PATHS.get(grammar)
    if cached is None:
        table, eos = closing_table(grammar, vocab), grammar.tokenizer.eos_token
        matcher = grammar.matcher()
        path = closing_path(matcher, table, eos, examples=grammar.examples)
        if grammar.shortest is not None:
            shortest = closing_path(
                llguidance.LLMatcher(grammar.tokenizer, grammar.shortest, log_level=0),
                table,
                eos,
                examples=grammar.examples,
            )
            if (
                shortest is not None
                and (path is None or len(shortest) < len(path))
                and all(matcher.consume_token(t) for t in shortest)
                and matcher.is_stopped()
            ):
                path = shortest
        cached = _FIRST_PATHS[grammar] = (path,)
    return None if cached[0] is None else list(cached[0])


_FIRST_PATHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def closing_length(grammar: Grammar, vocab: int) -> int | None:
    """The tokens of the schema's closing path from its start (its shortest answer, as the path finds
    it), or None past ``CLOSING_CAP``."""
    path = first_closing_path(grammar, vocab)
    return None if path is None else len(path)


_SHORTER = "lower its minLength or minItems, or make fewer of its keys required"


def check_closing_room(grammar: Grammar, vocab: int, room: int) -> None:
    """A ``TemplateError`` when the schema's closing path (grammar.py) takes more than ``room``, the tokens
    the model's context leaves after the prompt (or is not found within ``CLOSING_CAP`` tokens): then no
    ``max_tokens`` would keep the answer valid at its end."""
    shortest = _found_closing_length(grammar, vocab)
    if shortest > room:
        raise TemplateError(
            f"the schema's shortest answer takes {shortest} tokens, more than the {room} the model's "
            f"context leaves after the prompt, so no max_tokens fits it; {_SHORTER}, or shorten the "
            "prompt"
        )


def check_closing_fits(grammar: Grammar, vocab: int, max_tokens: int) -> None:
    """A ``TemplateError`` when the schema's closing path takes more than ``max_tokens`` (or is not found
    within ``CLOSING_CAP`` tokens): then nothing would keep the answer valid at its end."""
    shortest = _found_closing_length(grammar, vocab)
    if shortest > max_tokens:
        raise TemplateError(
            f"the schema's shortest answer takes {shortest} tokens, more than max_tokens {max_tokens}; "
            "raise max_tokens",
            option="max_tokens",
        )


def _found_closing_length(grammar: Grammar, vocab: int) -> int:
    shortest = closing_length(grammar, vocab)
    if shortest is None:
        raise TemplateError(
            f"the schema's shortest answer takes more than {CLOSING_CAP} tokens, the most an answer "
            f"is closed within, so no max_tokens fits it; {_SHORTER}"
        )
    return shortest
