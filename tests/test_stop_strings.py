"""Stop strings and held strings read as an answer grows (server/stop_strings.py): the same pieces
sent, the same cut and the same stop string as searching the whole text again each round (the
server's earlier way, kept here as the reference), in characters compared linear in the text."""

import random

import pytest

from mlx_dgemma.server.stop_strings import StopStrings


def find_any(text: str, needles: list[str], start: int = 0) -> int | None:
    found = [i for n in needles if n and (i := text.find(n, start)) >= 0]
    return min(found) if found else None


def sendable(text: str, held: list[str]) -> int:
    end = len(text) if (found := find_any(text, held)) is None else found
    keep = end
    for needle in held:
        for k in range(min(len(needle) - 1, end), 0, -1):
            if text.endswith(needle[:k], 0, end):
                keep = min(keep, end - k)
                break
    return keep


def searched_whole(pieces, stop, hold, tail=""):
    """The pieces a client gets and the stop string that ended the answer, searching the whole text
    each round."""
    text, sent, out = "", 0, []
    for i, piece in enumerate(pieces):
        text += piece
        finish = i == len(pieces) - 1
        if finish and tail and text.endswith(tail):
            text = text[: -len(tail)]
        stop_sequence = None
        if (cut := find_any(text, stop)) is not None:
            stop_sequence = next(n for n in stop if text.startswith(n, cut))
            text, finish = text[:cut], True
        end = len(text) if finish else sendable(text, stop + hold)
        out.append(text[sent:end])
        sent = max(sent, end)
        if finish:
            return out, stop_sequence


def read_as_it_grows(pieces, stop, hold, tail=""):
    """The same as the scheduler reads it now (``StopStrings``)."""
    strings = StopStrings(stop, hold)
    text, sent, out = "", 0, []
    for i, piece in enumerate(pieces):
        text += piece
        finish = i == len(pieces) - 1
        if finish and tail and text.endswith(tail):
            text = text[: -len(tail)]
        stop_sequence = None
        if (found := strings.read(text)) is not None:
            cut, stop_sequence = found
            text, finish = text[:cut], True
        end = len(text) if finish else strings.sendable()
        out.append(text[sent:end])
        sent = max(sent, end)
        if finish:
            return out, stop_sequence


@pytest.mark.parametrize(
    "pieces, stop, hold",
    [
        (["ab", "cSTOPd"], ["STOP"], []),  # inside one piece
        (["abST", "O", "Pcd"], ["STOP"], []),  # across piece boundaries, its start held back meanwhile
        (["STOPab"], ["STOP"], []),  # at the very start
        (["abc", "dSTOP"], ["STOP"], []),  # at the very end
        (["abcd", "ef"], ["abcdef", "cd"], []),  # overlapping: the earlier start wins once both are whole
        (["ab", "cdef"], ["cd", "abcdef"], []),
        (["xx", "aab"], ["ab", "aab"], []),  # two starting at once: the one given first
        (["ST", "xSTOP"], ["STOP"], []),  # a held-back start that was not the stop goes out later
        (["one <tool", "_call> two", " STOP"], ["STOP"], ["<tool_call>"]),  # text waits from a held string on
        (["a <to", "x <tool_call>"], [], ["<tool_call>"]),
        (["aaaa", "aaab"], ["aaaab"], []),  # a repeated prefix: the border, not a fresh start
        (["the answer<suf", "fix>"], ["fix"], []),  # a stop inside the infill's suffix, cut off at the end
    ],
    ids=[
        "inside",
        "across",
        "start",
        "end",
        "overlap",
        "overlap-reversed",
        "same-start",
        "false-start",
        "held",
        "held-late",
        "border",
        "tail",
    ],
)
def test_crafted_cases_match_searching_the_whole_text(pieces, stop, hold):
    tail = "<suffix>" if pieces[-1].endswith("fix>") else ""
    assert read_as_it_grows(pieces, stop, hold, tail) == searched_whole(pieces, stop, hold, tail)


def test_random_pieces_match_searching_the_whole_text():
    rng = random.Random(0)
    for _ in range(3000):

        def word(length):
            return "".join(rng.choice("abc") for _ in range(length))

        text = word(rng.randint(0, 40))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] or [""]
        stop = [word(rng.randint(1, 5)) for _ in range(rng.randint(0, 4))]
        hold = [word(rng.randint(1, 5)) for _ in range(rng.randint(0, 2))]
        tail = text[-rng.randint(0, 4) :] if rng.random() < 0.2 else ""
        case = (pieces, stop, hold, tail)
        assert read_as_it_grows(*case) == searched_whole(*case), case


@pytest.mark.parametrize("length", [10_000, 20_000])
def test_characters_compared_are_linear_in_the_text(length):
    """Sixteen stop strings of 3,000 characters that every window almost matches, over a text read
    in 4-character pieces: each string compares each character at most twice, and builds its borders
    in at most twice the characters it reached (Knuth–Morris–Pratt), so at most 4 x 16 per character.
    Searching the whole text each round compared the held-back ends again every round: 3,000 x 3,000
    per string per round."""
    stop = ["a" * 2999 + chr(ord("b") + i) for i in range(16)]
    strings = StopStrings(stop, ["<tool_call>"])
    text = ""
    while len(text) < length:
        text += "aaaa"
        assert strings.read(text) is None
        assert strings.sendable() == len(text) - min(len(text), 2999)
    assert len(text) * 17 <= strings.compared <= 4 * len(text) * 17
