"""Request bodies as body.py reads them: a body of many values, read by the pure-Python reader, gives
what Python's C reader gives, refuses what it refuses, and stops at the bound on arrays and objects;
a reply written a piece at a time is starlette's JSONResponse's."""

import json

import pytest
from starlette.responses import JSONResponse

from mlx_dgemma.server.api import BadRequest
from mlx_dgemma.server.body import (
    FAST_VALUES,
    MAX_CONTAINERS,
    NotJson,
    TooManyContainers,
    json_reply,
    loads,
    parse_body,
)

SAMPLE = (
    '{"text": "caf\\u00e9 \\"q\\" \\ud83d\\ude00 \\n", "n": [0, -12, 3.5, -1e-7, 2E+3, 123456789012345678901], '
    '"flags": [true, false, null], "nested": {"a": [[], {}, [{"b": ""}]]}, "x": NaN, "y": -Infinity}'
)


def many(item: str, count: int = FAST_VALUES + 1) -> bytes:
    return ('{"items": [' + ", ".join([item] * count) + "]}").encode()


def test_a_body_of_many_values_reads_as_pythons_reader_reads_it():
    body = many(SAMPLE, FAST_VALUES // 8)
    assert body.count(b",") > FAST_VALUES  # (the pure-Python reader's)
    read = loads(body)
    assert read == json.loads(body, parse_constant=NotJson)
    assert isinstance(read["items"][0]["x"], NotJson) and read["items"][0]["y"] == "-Infinity"
    assert loads(SAMPLE.encode()) == read["items"][0]  # (the C reader's)


@pytest.mark.parametrize(
    "tail, error",
    [
        ("[1, 2", ValueError),  # cut short
        ("[1 2]", ValueError),
        ('["\\x"]', ValueError),  # a bad escape
        ("[" + "9" * 5000 + "]", ValueError),  # past Python's digits for an integer
        ("[" * 5000 + "]" * 5000, RecursionError),
    ],
)
def test_a_body_of_many_values_is_refused_as_pythons_reader_refuses_it(tail, error):
    body = many("0")[:-1] + b', "bad": ' + tail.encode() + b"}"
    with pytest.raises(error):
        json.loads(body)
    with pytest.raises(error):
        loads(body)


def test_arrays_and_objects_past_the_bound_are_refused_with_413():
    assert len(loads(many("[]", MAX_CONTAINERS - 2))["items"]) == MAX_CONTAINERS - 2  # with the body and items
    with pytest.raises(TooManyContainers):
        loads(many("{}", MAX_CONTAINERS - 1))
    with pytest.raises(BadRequest) as caught:
        parse_body(many("[]", MAX_CONTAINERS))
    assert caught.value.status == 413
    assert str(caught.value) == f"the request body holds more than {MAX_CONTAINERS} arrays and objects; send fewer"


def test_a_body_in_utf16_reads_as_pythons_reader_reads_it():
    body = many('"é"').decode().encode("utf-16")
    assert loads(body) == json.loads(body)


def test_a_reply_written_in_pieces_is_starlettes():
    content = {
        "object": "list",
        "data": [{"index": i, "embedding": [0.1 * i, -2.5e-8, 3.0]} for i in range(3)],
        "text": 'café "q" 😀\n',
        "empty": [],
        "nested": [[], [[1, 2], {"a": None}], {}],
        "flag": True,
        "top": {"é": -0.5},
    }
    assert json_reply(content).body == JSONResponse(content).body
    with pytest.raises(ValueError):
        json_reply({"data": [[float("nan")]]})
