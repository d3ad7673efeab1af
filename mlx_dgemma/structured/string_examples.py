"""Short strings a schema's string constraints accept: the shortest match of each ``pattern`` (and of
each ``patternProperties`` key, and of each alternative of a pattern that is one alternation), and a few values of each format llguidance checks itself. A closing
path (grammar.py) tries them where a string cannot end yet: a pattern such as
``^[A-Z0-9_]+(_DEVICE|_LAYOUT)$`` is not closed by always taking the narrowest next character, but is
by writing ``0_DEVICE``. Each example is built from the pattern's parse tree in linear time (it is
never matched by a backtracking engine: a schema is the client's input) and is checked against the
grammar where it is tried, so one that is wrong is only not taken.
"""

from __future__ import annotations

import re
import string
import warnings
from dataclasses import dataclass
from re import _constants as sre, _parser as sre_parse

# Characters a class is matched with, in the order tried: none needs escaping in JSON.
CHARACTERS = (
    "a0A"
    + string.ascii_lowercase[1:]
    + string.digits[1:]
    + string.ascii_uppercase[1:]
    + "-_.:/ "
    + "".join(c for c in string.punctuation if c not in '"\\-_.:/')
)
FORMATS = {  # shortest first; the grammar keeps the ones llguidance's own format accepts
    "email": ["a@a.aa", "a@example.com"],
    "hostname": ["a", "example.com"],
    "ipv4": ["0.0.0.0"],
    "ipv6": ["::", "::1"],
    "uuid": ["00000000-0000-0000-0000-000000000000"],
    "uri": ["a:", "a:a", "http://a"],
    "duration": ["P0D", "PT0S"],
}
MAX_EXAMPLE = 256  # characters; a pattern whose shortest match is longer gives no example
MAX_PATTERNS = 256  # patterns read from one schema


class _Unsupported(Exception):
    pass


def shortest_match(pattern: str) -> str | None:
    """A shortest string ``pattern`` matches (searched, as JSON Schema reads a pattern), or None where
    the pattern uses what this does not follow (backreferences, lookarounds, word boundaries, case
    folding) or Python cannot read it. The string is built from the pattern's parse tree, each node
    once and no string past ``MAX_EXAMPLE``, so the work is linear in the pattern: it is never matched
    against the pattern (Python's backtracking takes exponential time on patterns such as
    ``^(a?){30}a{30}$``); llguidance checks it where it is tried."""
    with warnings.catch_warnings():  # (Python's warnings on what a later version will read otherwise)
        warnings.simplefilter("ignore")
        try:
            parsed = sre_parse.parse(pattern)
            if parsed.state.flags & _FOLDING:
                return None
            return _sequence(parsed).text
        except (re.error, _Unsupported, RecursionError, OverflowError, ValueError):
            return None


def branch_matches(pattern: str) -> list[str]:
    """A shortest match of each alternative of ``pattern`` where the whole pattern is one alternation
    (``^test|acceptance|production$``): a string that has started otherwise than the shortest match
    may still end as another alternative's match (``e`` then ``acceptance``). Empty otherwise, or
    where ``shortest_match`` would give None."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            parsed = sre_parse.parse(pattern)
            if parsed.state.flags & _FOLDING or len(parsed) != 1 or parsed[0][0] is not sre.BRANCH:
                return []
            found = []
            for branch in parsed[0][1][1]:
                try:
                    found.append(_sequence(branch).text)
                except _Unsupported:
                    continue
            return found
        except (re.error, _Unsupported, RecursionError, OverflowError, ValueError):
            return []


def string_examples(schema) -> list[str]:
    """The examples of every string constraint in ``schema`` (rewritten: schema_rewrite.rewrite), shortest
    first, each once."""
    found: dict[str, None] = {}
    patterns = 0
    stack = [schema]
    while stack and patterns < MAX_PATTERNS:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        given = [node.get("pattern")] + list(
            node.get("patternProperties", {}) if isinstance(node.get("patternProperties"), dict) else []
        )
        for pattern in given:
            if isinstance(pattern, str):
                patterns += 1
                if (example := shortest_match(pattern)) is not None:
                    found[example] = None
                    found.update(dict.fromkeys(branch_matches(pattern)))
        if isinstance(node.get("format"), str):  # (a dict where "format" names a property)
            found.update(dict.fromkeys(FORMATS.get(node["format"], [])))
        stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
    return sorted(found, key=len)


@dataclass(frozen=True)
class _Piece:
    """The shortest text of part of a pattern, and whether it holds a start anchor (nothing may come
    before it) or an end anchor (nothing may come after it)."""

    text: str = ""
    start: bool = False
    end: bool = False

    def then(self, other: _Piece) -> _Piece:
        if (other.start and self.text) or (self.end and other.text):
            raise _Unsupported("an anchor inside the text")
        if len(self.text) + len(other.text) > MAX_EXAMPLE:
            raise _Unsupported("longer than MAX_EXAMPLE")
        return _Piece(self.text + other.text, self.start or other.start, self.end or other.end)

    def times(self, count: int) -> _Piece:
        if count == 0:
            return _Piece()
        if count > 1 and self.text and (self.start or self.end):
            raise _Unsupported("an anchor inside the text")
        if len(self.text) * count > MAX_EXAMPLE:  # (worked out before the text is built)
            raise _Unsupported("longer than MAX_EXAMPLE")
        return _Piece(self.text * count, self.start, self.end)


_FOLDING = sre.SRE_FLAG_IGNORECASE | sre.SRE_FLAG_LOCALE  # (a class's members would be case-folded)
_STARTS = (sre.AT_BEGINNING, sre.AT_BEGINNING_STRING)
_ENDS = (sre.AT_END, sre.AT_END_STRING)
_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT)  # (possessive ones and atomic groups give back nothing: not followed)


def _sequence(items) -> _Piece:
    piece = _Piece()
    for op, arg in items:
        piece = piece.then(_node(op, arg))
    return piece


def _node(op, arg) -> _Piece:
    if op is sre.LITERAL:
        return _Piece(chr(arg))
    if op is sre.NOT_LITERAL:
        return _Piece(next(c for c in CHARACTERS if ord(c) != arg))
    if op is sre.ANY:
        return _Piece(CHARACTERS[0])
    if op is sre.IN:
        return _Piece(_member(arg))
    if op is sre.AT and arg in _STARTS + _ENDS:
        return _Piece(start=arg in _STARTS, end=arg in _ENDS)
    if op is sre.BRANCH:
        choices = []
        for branch in arg[1]:
            try:
                choices.append(_sequence(branch))
            except _Unsupported:
                continue
        if not choices:
            raise _Unsupported("no branch")
        return min(choices, key=lambda p: (len(p.text), p.start + p.end))
    if op is sre.SUBPATTERN:
        if arg[1] & _FOLDING:
            raise _Unsupported("case folding")
        return _sequence(arg[3])
    if op in _REPEATS:
        low, _, item = arg
        return _sequence(item).times(low) if low else _Piece()
    raise _Unsupported(op)


def _member(items) -> str:
    """A character of the class ``items``: the first of ``CHARACTERS`` in it, else its first literal."""
    negated = bool(items) and items[0][0] is sre.NEGATE
    for c in CHARACTERS:
        if _in_class(c, items) != negated:
            return c
    if not negated:
        for op, arg in items:
            low = arg if op is sre.LITERAL else arg[0] if op is sre.RANGE else None
            if low is not None and chr(low).isprintable() and chr(low) not in '"\\':
                return chr(low)
    raise _Unsupported("class")


_CATEGORIES = {
    sre.CATEGORY_DIGIT: str.isdigit,
    sre.CATEGORY_NOT_DIGIT: lambda c: not c.isdigit(),
    sre.CATEGORY_SPACE: str.isspace,
    sre.CATEGORY_NOT_SPACE: lambda c: not c.isspace(),
    sre.CATEGORY_WORD: lambda c: c.isalnum() or c == "_",
    sre.CATEGORY_NOT_WORD: lambda c: not (c.isalnum() or c == "_"),
}


def _in_class(c: str, items) -> bool:
    code = ord(c)
    for op, arg in items:
        if op is sre.NEGATE:
            continue
        if op is sre.LITERAL and code == arg:
            return True
        if op is sre.RANGE and arg[0] <= code <= arg[1]:
            return True
        if op is sre.CATEGORY:
            test = _CATEGORIES.get(arg)
            if test is None:
                raise _Unsupported(arg)
            if test(c):
                return True
        if op not in (sre.LITERAL, sre.RANGE, sre.CATEGORY):
            raise _Unsupported(op)
    return False


MANY = 1 << 32  # a count of matches past any minProperties a schema can ask for


def match_count(pattern: str) -> int | None:
    """How many strings ``pattern`` matches at most (searched, as JSON Schema reads a pattern: only
    one anchored at both ends, or an alternation of such, matches finitely many), counted on its
    parse tree (an alternation's branches summed, so overlapping ones count twice), at most
    ``MANY``; None where it matches without bound or uses what this does not follow."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            parsed = sre_parse.parse(pattern)
            if parsed.state.flags & _FOLDING:
                return None
            items = list(parsed)
            while len(items) == 1 and items[0][0] is sre.SUBPATTERN and not items[0][1][1] & _FOLDING:
                items = list(items[0][1][3])
            if len(items) == 1 and items[0][0] is sre.BRANCH:
                return min(MANY, sum(_anchored_count(list(branch)) for branch in items[0][1][1]))
            return _anchored_count(items)
        except (re.error, _Unsupported, RecursionError, OverflowError, ValueError):
            return None


def _anchored_count(items: list) -> int:
    if len(items) < 2 or (items[0][0], items[-1][0]) != (sre.AT, sre.AT):
        raise _Unsupported("not anchored at both ends")
    if items[0][1] not in _STARTS or items[-1][1] not in _ENDS:
        raise _Unsupported("not anchored at both ends")
    return _count_sequence(items[1:-1])


def _count_sequence(items) -> int:
    count = 1
    for op, arg in items:
        count = min(MANY, count * _count_node(op, arg))
    return count


def _count_node(op, arg) -> int:
    if op is sre.LITERAL:
        return 1
    if op is sre.IN and not (arg and arg[0][0] is sre.NEGATE):
        count = 0
        for kind, value in arg:
            if kind is sre.LITERAL:
                count += 1
            elif kind is sre.RANGE:
                count += value[1] - value[0] + 1
            else:
                raise _Unsupported(kind)  # (a category: \d may be any Unicode digit)
        return count
    if op is sre.BRANCH:
        return min(MANY, sum(_count_sequence(branch) for branch in arg[1]))
    if op is sre.SUBPATTERN:
        if arg[1] & _FOLDING:
            raise _Unsupported("case folding")
        return _count_sequence(arg[3])
    if op in _REPEATS:
        low, high, item = arg
        each = _count_sequence(item)
        if each == 0:
            return 0 if low else 1
        if high is sre.MAXREPEAT or high == sre.MAXREPEAT:
            raise _Unsupported("unbounded")
        if each == 1:  # (one text, repeated: a length each)
            return min(MANY, high - low + 1)
        power = 1
        for _ in range(min(low, 64)):  # (2**64 is past MANY)
            power = min(MANY, power * each)
        total = 0
        for _ in range(low, high + 1):
            total = min(MANY, total + power)
            if total >= MANY:
                break
            power = min(MANY, power * each)
        return total
    raise _Unsupported(op)
