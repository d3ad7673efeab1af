"""An answer's stop strings and held strings (a tool call's opening), found as its text grows: each
string reads each new character once (Knuth–Morris–Pratt), so sixteen long stop strings cost time
linear in the answer, however many rounds it comes in."""

from __future__ import annotations


class Needle:
    """One string matched against a text given in pieces. ``state`` is the length of the longest
    proper prefix of the string that the text so far ends with; ``compared`` counts the characters
    compared, borders included."""

    def __init__(self, string: str):
        self.string = string
        self.border = [0]  # border[i]: the longest proper prefix of string[:i + 1] that it ends with
        self.state = 0
        self.compared = 0

    def step(self, char: str) -> bool:
        """Read ``char``; whether the text now ends with the whole string."""
        string, state = self.string, self.state
        while state and string[state] != char:
            state = self._border(state - 1)
            self.compared += 1
        self.compared += 1
        if string[state] == char:
            state += 1
        if state == len(string):
            self.state = self._border(state - 1)
            return True
        self.state = state
        return False

    def _border(self, i: int) -> int:
        """``border[i]``, built as far as the text has reached (never past it: a string longer than the
        answer costs no more than the answer)."""
        border, string = self.border, self.string
        while len(border) <= i:
            j, k = len(border), border[-1]
            while k and string[j] != string[k]:
                k = border[k - 1]
                self.compared += 1
            self.compared += 1
            border.append(k + (string[j] == string[k]))
        return border[i]

    def ending(self, text: str, end: int) -> int:
        """The longest proper prefix of the string that ``text[:end]`` ends with (read afresh)."""
        needle = Needle(self.string)
        for char in text[max(0, end - len(self.string) + 1) : end]:
            needle.step(char)
        self.compared += needle.compared
        return needle.state


class StopStrings:
    """The stop strings and held strings in one answer's text, read as it grows (``read``): where the
    first stop string starts (the answer ends there), and how much of the text may go out
    (``sendable``: not past a held string, nor the end that might begin one of either)."""

    def __init__(self, stop: list[str], hold: list[str]):
        self.stop = [Needle(s) for s in stop]
        self.hold = [Needle(s) for s in hold]
        self.read_to = 0  # characters of the text read
        self.held_at: int | None = None  # where the first held string starts
        self.held_keep = 0  # of the text before it, how much may go out

    def read(self, text: str) -> tuple[int, str] | None:
        """Read ``text`` past what was read before (the text so far; earlier pieces unchanged, though
        cut short at the end); the first stop string in it as (where it starts, the string), the
        earliest start first and among those the one given first."""
        found: tuple[int, int] | None = None  # (start, index in stop)
        for end in range(self.read_to, len(text)):
            char = text[end]
            for index, needle in enumerate(self.stop):
                if needle.step(char):
                    start = end + 1 - len(needle.string)
                    found = min(found or (start, index), (start, index))
            for needle in self.hold:
                if needle.step(char) and (start := end + 1 - len(needle.string)) < (
                    len(text) if self.held_at is None else self.held_at
                ):
                    self.held_at = start
                    self.held_keep = start - max(n.ending(text, start) for n in self.stop + self.hold)
        self.read_to = max(self.read_to, len(text))
        return None if found is None else (found[0], self.stop[found[1]].string)

    def sendable(self) -> int:
        """How much of the text read may go out."""
        if self.held_at is not None:
            return self.held_keep
        return self.read_to - max((n.state for n in self.stop + self.hold), default=0)

    @property
    def compared(self) -> int:
        return sum(n.compared for n in self.stop + self.hold)
