"""The short strings a closing path tries where a string cannot end yet (string_examples.py): each a
shortest match of its pattern, with the length worked out by hand from the pattern."""

import re
import tracemalloc
import warnings

import pytest

from mlx_dgemma.structured.string_examples import FORMATS, branch_matches, shortest_match, string_examples


@pytest.mark.parametrize(
    "pattern, length",
    [
        ("^[A-Z0-9_]+(_CONTROLLER|_DEVICE|_LAYOUT)$", 1 + len("_DEVICE")),
        (r"v1\.0\.\d+", len("v1.0.0")),
        (r"^\d{4}-\d{2}-\d{2}$", 10),
        (r"10\..+/.+", len("10.x/x")),
        (r"^[^\s@]+@[^\s@]+\.[a-z]{2,}$", len("x@x.xx")),
        ("^(http)|(https)://(.*)$", len("http")),
        (r"^[\u00c0-\u00d6]+$", 1),  # no ASCII character is in the class
        ("a{3,}b*?c?", 3),
    ],
)
def test_a_pattern_gives_a_shortest_string_it_matches(pattern, length):
    example = shortest_match(pattern)
    assert re.search(pattern, example) and len(example) == length
    assert '"' not in example and "\\" not in example


@pytest.mark.parametrize(
    "pattern",
    [
        r"(a)\1",
        "(",
        "[z-a]",
        "x" * 300,
        "(?=a)a",
        r"a\bb",
        "(?i)[^a]",
        "(?i:[^a])",
        "a*+a",
        "(?>a*)a",
        "a^b",
        "a$b",
        "(a|$)b",
        "(^x){2}",
    ],
)
def test_what_is_not_followed_or_not_a_pattern_gives_none(pattern):
    assert shortest_match(pattern) is None


@pytest.mark.parametrize(
    "pattern, example", [("^a|b$", "a"), ("(a$)*x", "x"), ("(^){2}x", "x"), ("x$y?", "x"), ("^$", ""), ("(^a)", "a")]
)
def test_anchors_inside_a_pattern_are_followed(pattern, example):
    assert shortest_match(pattern) == example and re.search(pattern, example)


def test_a_pattern_that_backtracks_exponentially_gives_its_example_without_being_matched(monkeypatch):
    # Python's re takes 2**n steps to match a**n against this pattern (seconds at n = 26, holding the
    # GIL); the example is built from the parse tree, and no re function that matches is called.
    def matched(*args, **kwargs):
        raise AssertionError("the pattern was matched with re")

    for name in ("search", "match", "fullmatch", "compile"):
        monkeypatch.setattr(re, name, matched)
    assert shortest_match("^(a?){60}a{60}$") == "a" * 60


@pytest.mark.parametrize("depth, count", [(4, 110), (5, 256)])
def test_a_nested_counted_repetition_is_measured_before_it_is_built(depth, count):
    # a{110} nested four deep is 110**4 characters (146 MB) if built; the example is refused once its
    # length passes MAX_EXAMPLE (256 characters), so nothing much larger is ever allocated.
    pattern = "^" + "(?:" * depth + "a" + f"{{{count}}})" * depth + "$"
    tracemalloc.start()
    try:
        assert shortest_match(pattern) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_every_string_constraint_of_a_schema_gives_its_examples_shortest_first():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "pattern": "^x{5}$"},
            "b": {"anyOf": [{"type": "string", "format": "ipv4"}, {"items": {"type": "string", "pattern": "^yy$"}}]},
        },
        "patternProperties": {"^z-[0-9]$": {}},
    }
    assert string_examples(schema) == sorted(["xxxxx", "yy", "z-0", *FORMATS["ipv4"]], key=len)


def test_properties_named_as_keywords_are_read_as_properties():
    schema = {
        "type": "object",
        "properties": {"format": {"type": "string", "pattern": "^q$"}, "pattern": {"type": "integer"}},
    }
    assert string_examples(schema) == ["q"]


def test_a_pattern_python_warns_about_gives_its_example_quietly():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert shortest_match("[[a]") == "a"


@pytest.mark.parametrize(
    "pattern, matches",
    [
        ("^test|acceptance|production$", ["test", "acceptance", "production"]),
        ("(^test|acceptance|production$)", []),  # not one alternation at the top: only the shortest match
        ("^a|b[0-9]{2}|(?=x)y$", ["a", "b00"]),  # (a lookahead is not followed: that branch gives none)
    ],
)
def test_each_alternative_of_a_top_level_alternation_gives_its_own_match(pattern, matches):
    assert branch_matches(pattern) == matches
    for match in matches:
        assert re.search(pattern, match)
