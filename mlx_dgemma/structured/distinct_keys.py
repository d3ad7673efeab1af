"""Distinct keys: no object of a grammar's answer writes a key twice. llguidance writes each of an
object's ``properties`` at most once but lets a key of ``additionalProperties`` or
``patternProperties`` repeat (``{"a": 1, "a": 2}``, which every JSON reader parses to one key, the
other value lost). ``KeyTracker`` follows the answer's bytes as they are written, knowing the keys of
each open object and the key being written, so that a token which would close a key already in its
object is masked (``drop_repeats``) wherever a grammar decides a token: the rule's mask, and the
closing path's walk. Keys are compared as JSON reads them (``"\\u0061"`` is ``"a"``).
"""

from __future__ import annotations

import json

import numpy as np

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN, _CLOSE = frozenset(b"{["), frozenset(b"}]")


class KeyTracker:
    """Where an answer is in its JSON: per open container, an object's keys (a frozenset) or None (an
    array); whether a string is open, and whether it is a key (then ``key``, its bytes so far)."""

    __slots__ = ("stack", "in_string", "in_key", "escaped", "expects_key", "key", "names")

    def __init__(self):
        self.stack: list[frozenset | None] = []
        self.names: list[tuple[bytes, ...]] = []  # each object's keys as written, for the walk's choices
        self.in_string = self.in_key = self.escaped = self.expects_key = False
        self.key = b""

    def copy(self) -> KeyTracker:
        other = KeyTracker.__new__(KeyTracker)
        other.stack, other.names = list(self.stack), list(self.names)
        other.in_string, other.in_key, other.escaped = self.in_string, self.in_key, self.escaped
        other.expects_key, other.key = self.expects_key, self.key
        return other

    def feed(self, text: bytes) -> bool:
        """Follow ``text``; False (the state then past the repeat) where it closes a key already in its
        object."""
        distinct = True
        for byte in text:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif byte == _BACKSLASH:
                    self.escaped = True
                elif byte == _QUOTE:
                    self.in_string = False
                    if self.in_key:
                        distinct = self._close_key() and distinct
                    continue
                if self.in_key:
                    self.key += bytes((byte,))
            elif byte == _QUOTE:
                self.in_string, self.in_key = True, self.expects_key
                self.expects_key, self.key = False, b""
            elif byte in _OPEN:
                self.stack.append(frozenset() if byte == ord("{") else None)
                self.names.append(())
                self.expects_key = byte == ord("{")
            elif byte in _CLOSE:
                if self.stack:
                    self.stack.pop()
                    self.names.pop()
                self.expects_key = False
            elif byte == ord(","):
                self.expects_key = bool(self.stack) and self.stack[-1] is not None
        return distinct

    def _close_key(self) -> bool:
        self.in_key = False
        if not self.stack or self.stack[-1] is None:
            return True
        name = _read_key(self.key)
        if name in self.stack[-1]:
            return False
        self.stack[-1] = self.stack[-1] | {name}
        self.names[-1] = self.names[-1] + (self.key,)
        return True

    def repeats(self, text: bytes) -> bool:
        """Whether writing ``text`` next closes a key already in its object."""
        return not self.copy().feed(text)

    def continuing(self) -> set[int]:
        """Inside a key: the next bytes of the open object's keys that begin with the key so far (a
        walk that writes one of them heads for a key already written)."""
        if not self.in_key or not self.names:
            return set()
        n = len(self.key)
        return {name[n] for name in self.names[-1] if len(name) > n and name.startswith(self.key)}

    @property
    def watching(self) -> bool:
        """Whether any token could close a repeated key here: some open object has a key."""
        return any(keys for keys in self.stack)


def _read_key(raw: bytes):
    try:
        return json.loads(b'"' + raw + b'"')
    except ValueError:
        return raw


def quote_counts(texts: list[bytes]) -> np.ndarray:
    """Per token, how many ``"`` its text holds (a token with none never closes a key)."""
    return np.array([text.count(b'"') for text in texts], dtype=np.int64)


def drop_repeats(allowed: np.ndarray, keys: KeyTracker, quotes: np.ndarray, text_of) -> np.ndarray:
    """``allowed`` less the tokens that would close a key already in its object (``quotes``: each
    token's count of ``"``; ``text_of``: a token's bytes). Only tokens that can close a key are
    followed: one with a quote inside a key, one with two outside (it opens a key and closes it)."""
    least = 1 if keys.in_key else 2 if keys.watching else 4  # (4: a token that opens an object and repeats a key)
    candidates = np.flatnonzero(allowed & (quotes >= least))
    if not len(candidates):
        return allowed
    repeated = [t for t in candidates.tolist() if keys.repeats(text_of(t))]
    if not repeated:
        return allowed
    out = allowed.copy()
    out[repeated] = False
    return out
