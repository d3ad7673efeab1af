"""The short strings a closing path tries where a string cannot end yet (string_examples.py): each a
shortest match of its pattern, with the length worked out by hand from the pattern."""

import re
import warnings

import pytest

from mlx_dgemma.string_examples import FORMATS, shortest_match, string_examples


@pytest.mark.parametrize("pattern, length", [
    ("^[A-Z0-9_]+(_CONTROLLER|_DEVICE|_LAYOUT)$", 1 + len("_DEVICE")),
    (r"v1\.0\.\d+", len("v1.0.0")),
    (r"^\d{4}-\d{2}-\d{2}$", 10),
    (r"10\..+/.+", len("10.x/x")),
    (r"^[^\s@]+@[^\s@]+\.[a-z]{2,}$", len("x@x.xx")),
    ("^(http)|(https)://(.*)$", len("http")),
    (r"^[\u00c0-\u00d6]+$", 1),  # no ASCII character is in the class
    ("a{3,}b*?c?", 3),
])
def test_a_pattern_gives_a_shortest_string_it_matches(pattern, length):
    example = shortest_match(pattern)
    assert re.search(pattern, example) and len(example) == length
    assert '"' not in example and "\\" not in example


@pytest.mark.parametrize("pattern", [r"(a)\1", "(", "[z-a]", "x" * 300])
def test_what_is_not_followed_or_not_a_pattern_gives_none(pattern):
    assert shortest_match(pattern) is None


def test_every_string_constraint_of_a_schema_gives_its_examples_shortest_first():
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "^x{5}$"},
        "b": {"anyOf": [{"type": "string", "format": "ipv4"}, {"items": {"type": "string", "pattern": "^yy$"}}]}},
        "patternProperties": {"^z-[0-9]$": {}}}
    assert string_examples(schema) == sorted(["xxxxx", "yy", "z-0", *FORMATS["ipv4"]], key=len)


def test_properties_named_as_keywords_are_read_as_properties():
    schema = {"type": "object", "properties": {"format": {"type": "string", "pattern": "^q$"},
                                               "pattern": {"type": "integer"}}}
    assert string_examples(schema) == ["q"]


def test_a_pattern_python_warns_about_gives_its_example_quietly():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert shortest_match("[[a]") == "a"
