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
from .distinct_keys import KeyTracker, drop_repeats
from .grammar import Grammar, allowed_tokens, single_line

CLOSING_CAP = 8192  # tokens a closing path may take before it counts as endless


@dataclass(frozen=True)
class ClosingTable:
    """Per token of a vocabulary, what a closing path goes by: ``scores`` (closing brackets and quotes
    up, a zero, a number's shortest value after which JSON allows no digit, up; opening brackets
    down, they start more; separators a little down: an object's required keys need them, an
    array's ] beats them), ``marks``, the ids of single ASCII punctuation characters, ``same``,
    each id's first id with the same text (a walk that repeats a text repeats it under any id),
    ``closes``, the brackets each closes less those it opens, ``digits``, each token's leading ASCII
    digits, ``quotes``, its count of ``"`` (distinct_keys.drop_repeats), and ``first``, its first byte
    (-1: none); ``tokenizer`` is whose vocabulary it is."""

    scores: np.ndarray
    marks: np.ndarray
    same: np.ndarray
    closes: np.ndarray
    digits: np.ndarray
    quotes: np.ndarray
    first: np.ndarray
    tokenizer: llguidance.LLTokenizer

    def text(self, token: int) -> bytes:
        return self.tokenizer.decode_bytes([token])

    def distinct(self, allowed: np.ndarray, keys: KeyTracker) -> np.ndarray:
        """``allowed`` less the tokens that would close a key already in its object."""
        return drop_repeats(allowed, keys, self.quotes, self.text)


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
    digits, quotes, firsts = np.zeros(vocab, dtype=np.int64), np.zeros(vocab, dtype=np.int64), np.full(vocab, -1)
    for i in range(vocab):
        if grammar.tokenizer.is_special_token(i) or not (text := grammar.tokenizer.decode_bytes([i])):
            continue
        scores[i] = sum(weights.get(b, -0.1) for b in text)
        same[i] = first.setdefault(text, i)
        closes[i] = text.count(b"}") + text.count(b"]") - text.count(b"{") - text.count(b"[")
        digits[i] = len(text) - len(text.lstrip(b"0123456789"))
        quotes[i], firsts[i] = text.count(b'"'), text[0]
        if len(text) == 1 and chr(text[0]) in string.punctuation:
            marks.append(i)
    table = ClosingTable(
        scores, np.array(marks, dtype=np.int64), same, closes, digits, quotes, firsts, grammar.tokenizer
    )
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
    keys: KeyTracker | None = None,
) -> list[int] | None:
    """The tokens that take ``matcher`` (unchanged: a copy walks) to the grammar's end: forced ones,
    the end as soon as it is allowed, the first of ``examples`` (Grammar.examples) the grammar takes
    where a string cannot end yet, else ``_narrowest``'s pick. A token picked lately scores less
    (by ``REPEAT_PENALTY``, fading by ``REPEAT_FADE`` a token), so a walk caught in a loop tries the
    other ways out while one that closes a string every few tokens still closes it with a quote.
    No token closes a key already in its object (``keys``: where ``written`` left the answer's
    objects, distinct_keys.py), and inside a key one that heads for such a key scores less.
    None when the walk takes more than ``cap`` tokens, ``operations`` past their limit, or reaches a
    state where only a repeated key could follow; a ``TemplateError`` when llguidance gives up on the
    schema on the way (it refuses a token its own mask allowed, errs after one, or allows the end
    where the answer, ``written`` so far and the path, is not whole JSON: its lexer gave up on a
    pattern)."""
    if keys is None:
        keys = KeyTracker()
        keys.feed(written)
    try:
        return _walk_out(matcher, table, eos, cap, examples, written, operations or Operations(), keys.copy())
    except _Spent:
        return None


def _walk_out(
    matcher, table: ClosingTable, eos: int, cap: int, examples, written: bytes, operations: Operations, keys
) -> list[int] | None:
    walker, path, recent, seen = matcher.deep_copy(), [], np.zeros(len(table.scores)), {}
    quotes = table.scores == 2  # a lone quote: a string's end
    while not walker.is_stopped():
        operations.spend()
        forced = walker.compute_ff_tokens()
        _check_alive(walker)
        if len(path) + len(forced) > cap:
            return None
        if forced and keys.repeats(table.tokenizer.decode_bytes(forced)):
            return None  # the grammar forces a key already written: no way on from here
        if not forced:
            allowed = table.distinct(allowed_tokens(walker, len(table.scores)), keys)
            if not allowed.any():
                return None
            if allowed[eos]:
                if not whole_json(written + table.tokenizer.decode_bytes(path)):
                    raise TemplateError(
                        "the schema cannot be enforced: llguidance gave up on it (it allows the "
                        "answer to end inside a string); simplify its patterns"
                    )
                forced = [eos]
            elif examples and not (allowed & quotes).any():
                operations.spend(len(examples))
                forced = next(
                    (
                        list(e)
                        for e in examples
                        if walker.validate_tokens(list(e)) == len(e)
                        and not keys.repeats(table.tokenizer.decode_bytes(list(e)))
                    ),
                    [],
                )
            if not forced:
                scores = table.scores - recent[table.same]
                if heading := keys.continuing():
                    scores = scores - KEY_PENALTY * np.isin(table.first, list(heading))
                forced = [_narrowest(walker, np.where(allowed, scores, -np.inf), table, seen, operations)]
                recent[table.same[forced[0]]] += REPEAT_PENALTY
        if len(path) + len(forced) > cap:
            return None
        if not all(walker.consume_token(t) for t in forced):
            reason = walker.get_error().split("\n")[0] if walker.is_error() else "it refused its own forced tokens"
            raise TemplateError(f"the schema cannot be enforced: llguidance gave up on it: {single_line(reason)}")
        _check_alive(walker)
        keys.feed(table.tokenizer.decode_bytes(forced))
        path.extend(forced)
        recent *= REPEAT_FADE ** len(forced)
    return path


def _check_alive(walker: llguidance.LLMatcher) -> None:
    """A ``TemplateError`` where llguidance has given up on the grammar (its lexer's limits on a pattern)."""
    if walker.is_error():
        reason = walker.get_error().split("\n")[0]
        raise TemplateError(f"the schema cannot be enforced: llguidance gave up on it: {single_line(reason)}")


REPEAT_PENALTY = 1.0  # score a picked token loses on the closing path...
REPEAT_FADE = 0.8  # ...fading by this factor a token: one picked at every token loses 5 points
FORCED_WEIGHT = 1.0  # score a choice loses per bracket the tokens it forces open
KEY_PENALTY = 4.0  # score a token loses inside a key where it continues a key of its object


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
    the grammar takes it. Each walk's matcher has bounded lexer work (``WALK_FUELS``): a pattern that
    forces millions of characters (a{110} nested four deep) stops the walk past ``CLOSING_CAP`` tokens,
    within megabytes, where llguidance's default would build hundreds. A ``TemplateError`` where
    llguidance gives up on the grammar on the way, or on the path's first tokens taken as a row
    takes them (``_replay``)."""
    cached = _FIRST_PATHS.get(grammar)
    if cached is None:
        path = _walk_from_start(grammar, vocab)
        if grammar.shortest is not None:
            shortest = _walk_from_start(grammar, vocab, shortest=True)
            if shortest is not None and (path is None or len(shortest) < len(path)) and _ends(grammar, shortest):
                path = shortest
        if path is not None:
            _replay(grammar, path, vocab)
        cached = _FIRST_PATHS[grammar] = (path,)
    return None if cached[0] is None else list(cached[0])


def _walk_from_start(grammar: Grammar, vocab: int, shortest: bool = False) -> list[int] | None:
    """``closing_path`` from the start of the grammar (``shortest``: of its required-only shape), on a
    matcher with the first of ``WALK_FUELS``, then, where llguidance runs out of it, the next."""
    table = closing_table(grammar, vocab)
    for fuel in WALK_FUELS:
        try:
            return closing_path(
                grammar.matcher(fuel, shortest), table, grammar.tokenizer.eos_token, examples=grammar.examples
            )
        except TemplateError as e:
            if _OUT_OF_FUEL not in str(e) or fuel == WALK_FUELS[-1]:
                raise
    raise AssertionError("no fuel to walk with")


def _ends(grammar: Grammar, path: list[int]) -> bool:
    """Whether ``path`` takes the grammar from its start to its end."""
    matcher = grammar.matcher(WALK_FUELS[-1])
    return all(matcher.consume_token(t) for t in path) and matcher.is_stopped() and not matcher.is_error()


def _replay(grammar: Grammar, path: list[int], vocab: int) -> None:
    """A ``TemplateError`` where llguidance gives up within the first ``REPLAY_TOKENS`` tokens of
    ``path`` taken as a row takes them: on the grammar's own matcher, its mask computed before each
    (the walk takes an example or forced tokens whole, without the masks inside them, which are
    where its lexer runs past its limits on a pattern such as ^(?:\\S+\\s+){0,40}\\S+$)."""
    matcher = grammar.matcher()
    for i, token in enumerate(path[:REPLAY_TOKENS]):
        if not matcher.is_error():
            allowed_tokens(matcher, vocab)
        if matcher.is_error() or not matcher.consume_token(token) or matcher.is_error():
            reason = single_line(matcher.get_error().partition("\n")[0]) if matcher.is_error() else "a refused token"
            raise TemplateError(
                f"the schema cannot be enforced: llguidance gave up on it {i + 1} tokens into its shortest "
                f"answer ({reason}); simplify its patterns"
            )


REPLAY_TOKENS = 32  # tokens of the path from the start taken at admission as a row takes them

# Lexer work a walk from the start may take (llguidance's fuel, against its default of 1,000,000): first
# 30,000, past CLOSING_CAP tokens of forced characters on a one-byte vocabulary (~2.2 fuel and ~0.25 kB
# a character: a{110} nested four deep stops within ~7 MB); where that runs out, 200,000, for patterns
# whose lexer states cost much fuel and little memory (^(a?){60}a{60}$ walks within ~92,000 and 1.3 MB).
# The schemas of the tests otherwise walk within 4,000.
WALK_FUELS = (30_000, 200_000)
_OUT_OF_FUEL = "too many expressions constructed"  # (llguidance's words where its lexer fuel runs out)
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
