"""Hostile bodies through every API the server speaks: nested shapes of the wrong kind, NaN, images whose
chunks inflate, infill holes past the context. Each is a 4xx in the API's own error shape naming the
field the client sent, answered before any work starts; the server keeps answering. A mutation pass
puts hostile values at every path of a valid body of each API and finds no 5xx."""

import base64
import copy
import io
import json
import struct
import urllib.error
import urllib.request
import zlib

import pytest
from PIL import Image

from mlx_dgemma import infill
from mlx_dgemma.model.images import ImageError, load_image
from mlx_dgemma.structured.template import TemplateError

from .test_server import CONTEXT, MODEL_ID, SORT, serving
from .test_server_hostile import post, raw_post_timeout


@pytest.fixture(scope="module")
def server(demo):
    with serving(*demo) as url:
        yield url


def still_serving(server):
    status, reply = raw_post_timeout(
        server,
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": SORT}], "seed": 3}).encode(),
        60,
    )
    assert status == 200 and reply["choices"][0]["message"]["content"] == "17 23 42 61 85"


# -- infill: the hole is sized against the context before it is built --------------------------------


@pytest.mark.parametrize("max_tokens", [CONTEXT, 150_000_000, 10**12])
def test_an_infill_past_the_context_is_refused_before_its_hole_is_built(server, max_tokens):
    body = {"model": MODEL_ID, "prompt": "sort: 42 ", "suffix": " 85", "max_tokens": max_tokens}
    status, error, took = post(server, body, "/v1/completions")
    assert status == 400 and error["param"] == "max_tokens" and error["code"] == "context_length_exceeded", error
    assert error["message"].startswith(f"max_tokens is {max_tokens}, but the model's context of {CONTEXT} leaves room")
    assert took < 1


def test_infill_through_the_api_is_refused_before_its_hole_is_built(demo):
    model, tokenizer = demo
    with pytest.raises(TemplateError, match=f"past the model's context of {CONTEXT} positions; ask for at most"):
        infill(model, tokenizer, "sort: 42 ", " 85", max_fill=10**12)


def test_a_suffix_that_leaves_no_room_for_a_fill_names_the_suffix(server):
    body = {"model": MODEL_ID, "prompt": "sort: 42 ", "suffix": " 85" * CONTEXT}
    status, error, _ = post(server, body, "/v1/completions")
    assert status == 400 and error["param"] == "suffix" and error["code"] == "context_length_exceeded", error


# -- images whose chunks inflate past Pillow's bound --------------------------------------------------


def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def inflating_png(kind: bytes, before_pixels: bool) -> bytes:
    """A 1x1 PNG whose ``kind`` chunk (zTXt or iCCP) inflates to 8 MiB, past Pillow's MAX_TEXT_CHUNK;
    it is read with the header (before the pixels) or when the pixels are decoded (after them)."""
    buffer = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buffer, "PNG")
    plain = buffer.getvalue()
    bomb = chunk(kind, b"k\x00\x00" + zlib.compress(b"a" * (8 << 20), 9))
    at = 33 if before_pixels else plain.index(b"IEND") - 4  # after IHDR, or before IEND
    return plain[:at] + bomb + plain[at:]


BOMBS = [(kind, before) for kind in (b"zTXt", b"iCCP") for before in (True, False)]
NOT_AN_IMAGE = "is not an image Pillow can read"


@pytest.mark.parametrize(
    "kind, before_pixels", BOMBS, ids=[f"{k.decode()}-{'header' if b else 'pixels'}" for k, b in BOMBS]
)
def test_an_image_whose_chunk_inflates_is_an_image_error(kind, before_pixels):
    with pytest.raises(ImageError, match=f"^the image data {NOT_AN_IMAGE}"):
        load_image(inflating_png(kind, before_pixels))


@pytest.mark.parametrize("kind", [b"zTXt", b"iCCP"], ids=["zTXt", "iCCP"])
def test_an_image_whose_chunk_inflates_is_refused_by_every_api(server, kind):
    """(The demo's chat template writes no image placeholder, so only what its header holds is read.)"""
    data = base64.b64encode(inflating_png(kind, before_pixels=True)).decode()
    url = "data:image/png;base64," + data
    cases = [
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}],
                    }
                ]
            },
        ),
        (
            "/v1/responses",
            {
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_text", "text": "x"}, {"type": "input_image", "image_url": url}],
                    }
                ]
            },
        ),
        (
            "/v1/messages",
            {
                "max_tokens": 8,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
                            {"type": "text", "text": "x"},
                        ],
                    }
                ],
            },
        ),
        ("/api/chat", {"stream": False, "messages": [{"role": "user", "content": "x", "images": [data]}]}),
        ("/api/generate", {"stream": False, "prompt": "x", "images": [data]}),
    ]
    for path, body in cases:
        status, error, took = post(server, body, path)
        message = error if isinstance(error, str) else error["message"]
        assert status == 400 and NOT_AN_IMAGE in message and took < 1, (path, error)
    still_serving(server)


# -- NaN, nested shapes, and the field the client sent ------------------------------------------------


def body_error(reply) -> tuple[str, str | None]:
    """The message and param of an error in any API's shape (Anthropic's and Ollama's have no param)."""
    error = reply.get("error", reply)
    return (error, None) if isinstance(error, str) else (error["message"], error.get("param"))


@pytest.mark.parametrize(
    "path, body, param, message",
    [
        (
            "/v1/responses",
            {"input": SORT, "metadata": {"a": float("nan")}},
            "metadata.a",
            "metadata.a is NaN, which is not JSON; send a number or null",
        ),
        (
            "/v1/responses",
            {"input": SORT, "parallel_tool_calls": float("nan")},
            "parallel_tool_calls",
            "parallel_tool_calls is NaN",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": SORT}], "user": float("-inf")},
            "user",
            "user is -Infinity",
        ),
        (
            "/api/generate",
            {"prompt": "x", "stream": False, "options": {"temperature": float("nan")}},
            None,
            "options.temperature is NaN, which is not JSON",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": float("inf")}]}]},
            "messages[0].content[0].text",
            "messages[0].content[0].text is Infinity",
        ),
        (
            "/v1/responses",
            {
                "input": [
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": 5}]},
                ]
            },
            "input",
            "input[1].output must be a string or a list of parts",
        ),
        (
            "/v1/responses",
            {"input": SORT, "instructions": "\ud800"},
            "instructions",
            "instructions holds text that is not valid Unicode",
        ),
        (
            "/v1/messages",
            {
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "hi"}],
                "tool_choice": {"type": []},
                "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            },
            None,
            'tool_choice type must be "auto", "any", "tool" or "none", got []',
        ),
        (
            "/v1/messages",
            {
                "max_tokens": 8,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "x", "content": [{"type": "image", "source": {}}]}
                        ],
                    }
                ],
            },
            None,
            "messages[0]: a tool_result's content must be a string or a list of text blocks",
        ),
        (
            "/v1/messages",
            {"max_tokens": 8, "system": "\ud800", "messages": [{"role": "user", "content": "hi"}]},
            None,
            "system holds text that is not valid Unicode",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": SORT}], "max_completion_tokens": CONTEXT},
            "max_completion_tokens",
            f"max_completion_tokens of {CONTEXT} takes",
        ),
        (
            "/v1/messages",
            {"max_tokens": CONTEXT, "messages": [{"role": "user", "content": SORT}]},
            None,
            f"max_tokens of {CONTEXT} takes",
        ),
        ("/api/generate", {"prompt": 5, "stream": False}, None, "prompt must be a string"),
        ("/api/generate", {"prompt": "x", "system": ["a"], "stream": False}, None, "system must be a string"),
        (
            "/v1/messages/count_tokens",
            {"system": "\ud800", "messages": [{"role": "user", "content": "hi"}]},
            None,
            "system holds text that is not valid Unicode",
        ),
        (
            "/v1/messages/count_tokens",
            {
                "system": "be brief",
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "yo"},
                    {"role": 5, "content": "x"},
                ],
            },
            None,
            "messages[2] must be an object with a role",
        ),
    ],
    ids=[
        "nan-metadata",
        "nan-parallel",
        "inf-user",
        "nan-ollama-option",
        "inf-deep",
        "call-output-text",
        "instructions",
        "anthropic-tool-choice",
        "tool-result-image",
        "anthropic-system",
        "max-completion-tokens",
        "anthropic-max-tokens",
        "ollama-prompt",
        "ollama-system",
        "count-tokens-system",
        "count-tokens-index",
    ],
)
def test_hostile_fields_are_named_as_the_client_sent_them(server, path, body, param, message):
    # (json.dumps writes NaN, -Infinity and lone surrogates as a hostile client would)
    status, reply = raw_post_timeout(server, path, json.dumps(body).encode(), 10)
    got, got_param = body_error(reply)
    assert status == 400 and got.startswith(message) and got_param == param, reply


# -- every path of a valid body, each API ------------------------------------------------------------

VALID = [
    (
        "/v1/chat/completions",
        {
            "model": MODEL_ID,
            "messages": [{"role": "user", "content": SORT}],
            "max_tokens": 4,
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
                    },
                }
            ],
            "response_format": {"type": "text"},
            "stop": ["x"],
            "seed": 1,
            "temperature": 0.5,
        },
    ),
    ("/v1/completions", {"model": MODEL_ID, "prompt": "sort: 42 ", "suffix": " 85", "max_tokens": 4, "seed": 1}),
    (
        "/v1/responses",
        {
            "model": MODEL_ID,
            "instructions": "be brief",
            "max_output_tokens": 4,
            "metadata": {"k": "v"},
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": SORT}]},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "ok"}]},
            ],
            "text": {"format": {"type": "text"}},
            "tools": [{"type": "function", "name": "f"}],
            "tool_choice": {"type": "function", "name": "f"},
        },
    ),
    (
        "/v1/messages",
        {
            "model": MODEL_ID,
            "max_tokens": 4,
            "system": [{"type": "text", "text": "be brief"}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": SORT}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"a": "b"}}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "ok"}]}
                    ],
                },
            ],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "auto"},
            "stop_sequences": ["x"],
        },
    ),
    (
        "/api/chat",
        {
            "model": MODEL_ID,
            "stream": False,
            "messages": [{"role": "user", "content": SORT}],
            "options": {"num_predict": 4, "seed": 1, "stop": ["x"]},
            "format": {"type": "string"},
        },
    ),
    (
        "/api/generate",
        {
            "model": MODEL_ID,
            "stream": False,
            "prompt": "sort: 42 ",
            "suffix": " 85",
            "system": "s",
            "options": {"num_predict": 4},
        },
    ),
]
HOSTILE = [None, 5, -1, 1e308, float("nan"), True, "", "x", [], [5], {}, {"type": []}, [{"text": 5}]]


def paths(value, prefix=()):
    """Every path into a JSON value, containers included."""
    yield prefix
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        yield from paths(item, (*prefix, key))


def replaced(body, path, value):
    body = copy.deepcopy(body)
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return body


def answer(server, path, body) -> tuple[int, bytes]:
    """The status and raw reply (a stream's lines, or a 500's plain text, are no one JSON value)."""
    request = urllib.request.Request(
        server + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def is_error_shape(reply: bytes) -> bool:
    try:
        message, _ = body_error(json.loads(reply))
    except (ValueError, KeyError, TypeError, AttributeError):
        return False
    return isinstance(message, str) and "\n" not in message and len(message) < 1000


@pytest.mark.slow
@pytest.mark.parametrize("path, body", VALID, ids=[path for path, _ in VALID])
def test_no_hostile_value_at_any_path_gives_a_server_error(server, path, body):
    status, reply = answer(server, path, body)
    assert status == 200, reply  # the unmutated body is answered
    failures = []
    for where in list(paths(body))[1:]:
        for value in HOSTILE:
            status, reply = answer(server, path, replaced(body, where, value))
            if status >= 500 or (status >= 400 and not is_error_shape(reply)):
                failures.append((where, value, status, reply[:200]))
    assert not failures, failures[:5]
