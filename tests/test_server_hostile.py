"""A hostile client against the server: every limit is a 400 naming its field, answered before any
work starts, while /health keeps answering; local files stay unread unless a folder is allowed; SIGTERM
ends a server with a request in flight. In-process servers on loopback (test_server's ``serving``),
subprocess servers where signals or memory are checked."""

import base64
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest
from click.testing import CliRunner
from PIL import Image

from mlx_dgemma.server.__main__ import main
from mlx_dgemma.validate import MAX_STEPS

from .test_server import CONTEXT, MODEL_ID, SORT, chat, health, raw_post, serving, short_context  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
BIG = 7990  # a 7990x7990 PNG: 64 MB of pixels in 62 KB of file


def png(width: int, height: int) -> bytes:
    """A valid all-black greyscale PNG of any size, small on the wire (its rows compress to nothing)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = zlib.compress(bytes((width + 1) * height), 9)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
        + chunk(b"IDAT", rows)
        + chunk(b"IEND", b"")
    )


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def big_png():
    return png(BIG, BIG)


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("allowed")
    Image.new("RGB", (8, 8)).save(folder / "ok.png")
    return folder


@pytest.fixture(scope="module")
def server(demo):
    with serving(*demo, max_request_bytes=4 << 20) as url:
        yield url


@pytest.fixture(scope="module")
def allowing_server(demo, image_dir):
    with serving(*demo, image_dir=image_dir) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=60)


def post(server, body, path="/v1/chat/completions", timeout=10):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    start = time.monotonic()
    status, reply = raw_post_timeout(server, path, data, timeout)
    return status, reply.get("error", reply), time.monotonic() - start


def raw_post_timeout(server, path, data, timeout):
    request = urllib.request.Request(server + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def ask(content, **extra) -> dict:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": content}], **extra}


def health_while(server, body, path="/v1/chat/completions") -> tuple[tuple, float]:
    """The hostile ``body``'s answer, and the slowest /health seen while it was in flight."""
    with ThreadPoolExecutor(1) as pool:
        hostile = pool.submit(post, server, body, path, 60)
        slowest = 0.0
        while not hostile.done():
            start = time.monotonic()
            health(server)
            slowest = max(slowest, time.monotonic() - start)
            time.sleep(0.02)
        return hostile.result(), slowest


def assert_still_serving(client):
    assert chat(client, SORT, seed=3).choices[0].message.content == "17 23 42 61 85"


# -- 1. steps ---------------------------------------------------------------------------------------


def test_steps_are_bounded_by_the_servers_limit(server, client):
    status, error, took = post(server, ask(SORT, steps=1_000_000_000))
    assert status == 400 and error["param"] == "steps" and took < 1
    assert error["message"] == f"steps must be an integer from 1 to {MAX_STEPS}, got 1000000000"
    assert_still_serving(client)


def test_max_steps_is_the_servers_not_the_checkpoints(demo):
    """The demo's max_denoising_steps is 24, its default; a server allowing 30 runs 30 and refuses 31."""
    assert demo[0].generation_config.max_denoising_steps == 24
    with serving(*demo, max_steps=30) as url:
        status, reply, _ = post(url, ask(SORT, steps=30, seed=3, max_tokens=8))
        assert status == 200, reply
        status, error, _ = post(url, ask(SORT, steps=31))
        assert status == 400 and error["param"] == "steps"
        assert error["message"] == "steps must be an integer from 1 to 30, got 31"


# -- 2. big images ----------------------------------------------------------------------------------


def test_many_big_images_are_refused_from_their_headers(server, client, big_png):
    parts = [{"type": "text", "text": SORT}] + [image_part(data_url(big_png))] * 2
    (status, error, took), slowest = health_while(server, ask(parts))
    assert status == 400 and error["param"] == "messages" and took < 1
    assert error["message"] == (
        f"the request's images are {2 * BIG * BIG} pixels together, more than the {1 << 24} accepted; scale them down"
    )
    assert slowest < 1
    status, error, took = post(server, ask([image_part(data_url(png(8, 8)))] * 9))
    assert status == 400 and error["param"] == "messages" and took < 1
    assert error["message"] == "the request has 9 or more images, more than the 8 accepted"
    assert_still_serving(client)


# -- 3. host files ----------------------------------------------------------------------------------

REFUSED = "is not an image file that may be read here; send the image as a data URL"


def test_local_image_paths_are_refused_by_default(server, image_dir):
    for url in (str(image_dir / "ok.png"), f"file://{image_dir / 'ok.png'}", "/etc/passwd"):
        status, error, _ = post(server, ask([image_part(url)]))
        assert status == 400 and error["param"] == "messages"
        assert error["message"] == "messages[0]: local image paths are not read here; send the image as a data URL"


def test_an_allowed_folder_reads_only_its_regular_files_with_one_refusal(allowing_server, image_dir, tmp_path):
    fifo = image_dir / "fifo.png"
    if not fifo.exists():
        os.mkfifo(fifo)
    (image_dir / "notes.png").write_text("not a picture")
    outside = tmp_path / "secret.png"
    Image.new("RGB", (8, 8)).save(outside)
    link = image_dir / "link.png"
    if not link.is_symlink():
        link.symlink_to(outside)
    (image_dir / "sub").mkdir(exist_ok=True)
    bad = [
        str(image_dir / "missing.png"),
        str(image_dir / "sub"),
        str(fifo),
        str(link),
        str(outside),
        "/dev/zero",
        "/etc/passwd",
        f"{image_dir}/../{tmp_path.name}/secret.png",
        f"file://{fifo}",
        str(image_dir / "notes.png"),
        f"{image_dir}/ok.png\x00.txt",
        "ok.png/..",
    ]
    for url in bad:
        status, error, took = post(allowing_server, ask([image_part(url)]), timeout=5)  # a FIFO never blocks
        assert status == 400 and error["param"] == "messages", url
        assert error["message"] == f"messages[0]: {url[:80]!r} {REFUSED}", url
    # A regular image under the folder is read (the demo's template then writes no placeholder for it).
    for url in (str(image_dir / "ok.png"), f"file://{image_dir / 'ok.png'}", "ok.png", "sub/../ok.png"):
        status, error, _ = post(allowing_server, ask([image_part(url)]))
        assert status == 400 and error["message"].startswith("the chat template wrote 0 image placeholders"), url


# -- 4. event-loop stalls ---------------------------------------------------------------------------


def nested_arrays(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "maxItems": 2, "items": schema}
    return schema


PAST_CONTEXT = f"takes the template past the model's context of {CONTEXT} positions"
TOO_LONG = f"characters: more than the model's context of {CONTEXT} tokens can hold (at most "  # (not tokenized)


@pytest.mark.parametrize(
    "body, path, param, message",
    [
        (ask(SORT, template="{{fill:4}}" * 300_000), "/v1/chat/completions", "template", TOO_LONG),
        (ask("sort: 1 2 " * 300_000), "/v1/chat/completions", "messages", TOO_LONG),
        ({"model": MODEL_ID, "prompt": "sort: 1 2 " * 300_000}, "/v1/completions", "prompt", TOO_LONG),
    ],
    ids=["template", "messages", "prompt"],
)
def test_costly_templates_and_text_are_refused_while_health_answers(server, client, body, path, param, message):
    (status, error, took), slowest = health_while(server, body, path)
    assert status == 400 and error["param"] == param and message in error["message"], error
    assert took < 1 and slowest < 1
    assert_still_serving(client)


def test_bodies_are_parsed_off_the_event_loop(server, client, monkeypatch):
    """A body's JSON is parsed (and scanned for NaN) on the prepare threads: while one parse is held,
    /health answers (on the loop, the held parse would hold it too)."""
    from mlx_dgemma.server import body as body_module

    entered, release, threads = threading.Event(), threading.Event(), []

    def held_parse(body):
        threads.append(threading.current_thread().name)
        entered.set()
        assert release.wait(30)
        return parse_body(body)

    parse_body = body_module.parse_body
    monkeypatch.setattr(body_module, "parse_body", held_parse)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(post, server, ask(SORT, seed=3, max_tokens=8), "/v1/chat/completions", 60)
        try:
            assert entered.wait(30)
            assert health(server)["status"] == "ok"  # (urllib's timeout: 10 s)
            assert not held.done()
        finally:
            release.set()
        status, reply, _ = held.result()
    assert status == 200, reply
    assert len(threads) == 1 and threads[0].startswith("mlx-dgemma-prepare"), threads
    monkeypatch.undo()
    assert_still_serving(client)


# -- 6. what gave 500s ------------------------------------------------------------------------------

UNICODE = "holds text that is not valid Unicode"


@pytest.mark.parametrize(
    "body, param, message",
    [
        (b"[" * 100_000 + b"]" * 100_000, None, "not valid JSON: maximum recursion depth"),
        (b'{"model": "demo", "seed": ' + b"9" * 5000 + b"}", None, "not valid JSON: Exceeds the limit"),
        (ask(SORT, template="{{fill:4}}\ud800"), "template", UNICODE),
        (ask("sort \ud800"), "messages", UNICODE),
        ({"model": MODEL_ID, "prompt": "sort \ud800"}, "prompt", UNICODE),
        ({**ask(SORT), "model": "demo\ud800"}, "model", UNICODE),
        (
            ask(SORT, tools=[{"type": "function", "function": {"name": "get", "parameters": "a string"}}]),
            "tools",
            "each tool must be",
        ),
        (
            ask(SORT, tools=[{"type": "function", "function": {"name": "get", "parameters": ["a", "list"]}}]),
            "tools",
            "each tool must be",
        ),
        (
            ask(
                SORT,
                tools=[{"type": "function", "function": {"name": "get"}}],
                tool_choice={"type": "function", "function": "get"},
            ),
            "tool_choice",
            "tool_choice must be",
        ),
        (
            ask(
                SORT,
                response_format={
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10**400}}},
                    },
                },
            ),
            "response_format",
            "number out of range",
        ),
    ],
    ids=[
        "deep",
        "digits",
        "surrogate-template",
        "surrogate-message",
        "surrogate-prompt",
        "surrogate-model",
        "parameters-string",
        "parameters-list",
        "choice-string",
        "huge-minimum",
    ],
)
def test_bodies_that_gave_500s_are_400s(server, client, body, param, message):
    if isinstance(body, dict):  # (json.dumps writes lone surrogates as \ud800 escapes, as a hostile client would)
        body = json.dumps(body).encode()
    path = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
    status, error, took = post(server, body, path)
    assert status == 400 and error["param"] == param and message in error["message"], error
    assert took < 1
    assert_still_serving(client)


def schema_body(schema: dict) -> dict:
    return ask(SORT, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})


@pytest.mark.parametrize(
    "body, param, message",
    [
        (schema_body({"const": float("nan")}), "response_format.json_schema.schema.const", "not JSON"),  # (sent as NaN)
        (schema_body({"enum": list(range(100_000))}), "response_format", "has 100000 values, more than the 10000"),
        (
            schema_body({"type": "object", "properties": {"k" * 3_000_000: {"type": "null"}}}),
            "response_format",
            TOO_LONG,
        ),
    ],
    ids=["nan", "huge-enum", "long-key"],
)
def test_schemas_that_cannot_be_enforced_are_400s(server, client, body, param, message):
    (status, error, took), slowest = health_while(server, body)
    assert status == 400 and error["param"] == param and message in error["message"], error
    assert took < 1 and slowest < 1
    assert_still_serving(client)


def function(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


SORT_TOOL = function("sort", {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"}}}})
BAD_REF = function(
    "lookup",
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/Nope"}}}}},
)
LONG_ENUM = function("pick", {"type": "object", "properties": {"x": {"enum": list(range(10_001))}}})
LOOKUP = {"type": "function", "function": {"name": "lookup"}}


@pytest.mark.parametrize(
    "tool_choice", ["required", "auto", "none", {"type": "function", "function": {"name": "sort"}}]
)
def test_tools_of_one_name_are_refused(server, client, tool_choice):
    """A call names the tool it is to: two tools of one name make it ambiguous, whatever tool_choice says."""
    status, error, _ = post(server, ask(SORT, tools=[SORT_TOOL, BAD_REF, SORT_TOOL], tool_choice=tool_choice))
    assert status == 400 and error["param"] == "tools", error
    assert error["message"].startswith("tools holds 2 tools named 'sort'; each tool needs a name of its own"), error
    assert_still_serving(client)


@pytest.mark.parametrize(
    "tools, tool_choice, message",
    [
        ([SORT_TOOL, BAD_REF], "required", "tool 'lookup': the schema cannot be enforced: Pointer '/$defs/Nope' "),
        ([SORT_TOOL, BAD_REF], LOOKUP, "tool 'lookup': the schema cannot be enforced: Pointer '/$defs/Nope' "),
        ([LONG_ENUM, SORT_TOOL], "required", "tool 'pick': enum at $.properties.x has 10001 values, more than the "),
    ],
    ids=["bad-ref-required", "bad-ref-named", "long-enum-required"],
)
def test_a_tools_schema_error_names_the_tool_and_the_path_inside_it(server, client, tools, tool_choice, message):
    """A forced call to any of several tools is generated under one schema of all their calls; its error
    is put in the terms of the tool it is about, never of that union's /anyOf/1/properties/arguments."""
    status, error, _ = post(server, ask(SORT, tools=tools, tool_choice=tool_choice))
    assert status == 400 and error["param"] == "tools", error
    assert error["message"].startswith(message) and "anyOf" not in error["message"], error
    assert_still_serving(client)


@pytest.mark.parametrize(
    "body, schema",
    [
        (schema_body({"type": "object", "properties": {"a": {"type": "null"}}, "required": ["a", "b"]}), None),
        (
            ask(
                SORT,
                tools=[
                    {
                        "type": "function",
                        "function": {
                            "name": "get",
                            "parameters": {"type": "object", "properties": {}, "required": ["city"]},
                        },
                    }
                ],
                tool_choice="required",
            ),
            {"type": "object", "properties": {}, "required": ["city"]},
        ),
        (schema_body({"type": "string", "enum": ["a", 1]}), None),
        (schema_body(nested_arrays(19)), None),
        (
            ask(
                SORT,
                tools=[
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": nested_arrays(19)}, "required": ["a"]},
                        },
                    }
                ],
                tool_choice="required",
            ),
            {"type": "object", "properties": {"a": nested_arrays(19)}, "required": ["a"]},
        ),
    ],
    ids=["required-not-a-property", "tool-required", "enum-of-two-types", "nested-arrays", "tool-nested-arrays"],
)
def test_schemas_no_canvas_template_takes_are_answered_by_their_grammar(server, client, body, schema):
    """A required key that is no property (any value, as JSON Schema says), an enum whose values are
    not all of its type (the ones that are), arrays nested past what a canvas holds: each answer
    validates, and the server stays responsive meanwhile."""
    (status, reply, took), slowest = health_while(server, body)
    assert status == 200 and slowest < 1, reply
    message = reply["choices"][0]["message"]
    if schema is None:
        schema, answer = body["response_format"]["json_schema"]["schema"], json.loads(message["content"])
    else:
        answer = json.loads(message["tool_calls"][0]["function"]["arguments"])
    jsonschema.validate(answer, schema)
    assert_still_serving(client)


# -- 7. CLI flags -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--port", "70000"], "70000 is not in the range 1<=x<=65535"),
        (["--port", "0"], "0 is not in the range 1<=x<=65535"),
        (["--max-images", "-1"], "-1 is not in the range x>=0"),
        (["--max-image-pixels", "0"], "0 is not in the range x>=1"),
        (["--shutdown-grace", "-1"], "-1.0 is not in the range x>=0"),
        (["--allowed-image-dir", "/nowhere"], "'/nowhere' does not exist"),
        (["--max-steps", "0"], f"0 is not in the range 1<=x<={MAX_STEPS}"),
        (["--max-steps", str(MAX_STEPS + 1)], f"{MAX_STEPS + 1} is not in the range 1<=x<={MAX_STEPS}"),
    ],
)
def test_bad_server_flags_exit_before_loading(flags, message):
    result = CliRunner().invoke(main, flags)
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


# -- 8, 9. max_tokens and the context -----------------------------------------------------------------


def test_default_max_tokens_is_cut_to_whole_canvases(short_context):  # noqa: F811
    model, tokenizer = short_context
    ids = [tokenizer.bos_token_id] + tokenizer.encode("sort: 3 1 2 ", add_special_tokens=False) * 100
    ids = ids[:980]  # 44 positions left of the 1024-token context: one 32-token canvas fits
    with serving(model, tokenizer) as server:
        status, reply, _ = post(server, {"model": MODEL_ID, "prompt": ids}, "/v1/completions")
        assert status == 200, reply
        assert 0 < reply["usage"]["completion_tokens"] <= 32
        status, error, _ = post(server, {"model": MODEL_ID, "prompt": ids, "max_tokens": 40}, "/v1/completions")
    assert status == 400 and error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
    assert error["message"].endswith("ask for at most 32")


@pytest.mark.parametrize("num_predict", [50_000_000, 10**12])
def test_an_infills_num_predict_past_the_context_is_refused_at_once(server, client, demo, num_predict):
    """A hole is generated whole: Ollama's num_predict, elsewhere a cap, is a 400 naming its bound here
    (cut to the context instead, it was a hole of 32,000 positions: minutes on a released model)."""
    body = {
        "model": MODEL_ID,
        "prompt": "sort: 42 ",
        "suffix": " 85",
        "stream": False,
        "options": {"num_predict": num_predict},
    }
    status, error, _ = post(server, body, "/api/generate")
    assert status == 400, error
    model, tokenizer = demo
    prompt, suffix = len(tokenizer.encode("sort: 42 ")), len(tokenizer.encode(" 85", add_special_tokens=False))
    canvas = model.config.canvas_length
    room = (CONTEXT - prompt) // canvas * canvas - suffix  # whole canvases after the prompt, less the suffix
    assert error == (
        f"options.num_predict is {num_predict}, but the model's context of {CONTEXT} leaves room for at "
        f"most {room} before the {suffix}-token suffix after the {prompt}-token prompt"
    )
    assert_still_serving(client)


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_a_seed_out_of_range_is_refused_by_name(server, seed):
    status, error, _ = post(server, {**ask(SORT), "seed": seed})
    assert status == 400 and error["param"] == "seed", error
    assert error["message"] == f"seed must be an integer from 0 to 2**64 - 1, got {seed}"


# -- 10. OpenAI parameters the server does not honour ------------------------------------------------


@pytest.mark.parametrize(
    "key, value",
    [
        ("echo", True),
        ("best_of", 2),
        ("logit_bias", {"17": 5}),
        ("presence_penalty", 0.5),
        ("frequency_penalty", 1),
        ("top_p", "1"),
        ("suffix", "end"),
        ("top_logprobs", 3),
        ("functions", [{"name": "f"}]),
        ("echo", 0),
    ],
)
def test_unhonoured_openai_parameters_are_refused_by_name(server, key, value):
    status, error, _ = post(server, {**ask(SORT), key: value})
    assert status == 400 and error["param"] == key and key in error["message"], error


def test_their_off_defaults_and_harmless_ones_are_accepted(client):
    reply = chat(
        client,
        SORT,
        seed=3,
        n=1,
        logprobs=False,
        presence_penalty=0,
        frequency_penalty=0.0,
        top_p=1,
        user="someone",
        store=False,
        metadata={"k": "v"},
        parallel_tool_calls=True,
        extra_body={"echo": False, "best_of": 1, "logit_bias": {}, "suffix": ""},
    )
    assert reply.choices[0].message.content == "17 23 42 61 85"


# -- 5 and memory: subprocess servers -----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subprocess:
    """``python -m mlx_dgemma.server`` on a free loopback port, its stderr in a file."""

    def __init__(self, tmp_path: Path, *flags: str):
        self.url = f"http://127.0.0.1:{(port := free_port())}"
        self.log = tmp_path / "server.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlx_dgemma.server", "--port", str(port), "--log-level", "warning", *flags],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("w"),
        )
        deadline = time.monotonic() + 60
        while True:
            assert self.process.poll() is None and time.monotonic() < deadline, self.log.read_text()
            try:
                health(self.url)
                return
            except OSError:
                time.sleep(0.1)

    def wait(self, timeout: float) -> float:
        start = time.monotonic()
        try:
            self.process.wait(timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        return time.monotonic() - start


LONG = {"messages": [{"role": "user", "content": SORT}], "template": "{{fill:900}}"}  # ~6 s


def in_flight(server: Subprocess):
    """``LONG`` posted from a thread; returns once the worker runs it, and the thread's answer box."""
    answer = {}

    def send():
        try:
            answer["status"], answer["body"] = raw_post_timeout(
                server.url, "/v1/chat/completions", json.dumps(LONG).encode(), 60
            )
        except OSError as e:  # (a server that exits at once drops the connection)
            answer["dropped"] = e

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while health(server.url)["active"] == 0:
        assert time.monotonic() < deadline and not answer, answer
        time.sleep(0.05)
    return thread, answer


def test_sigterm_ends_a_long_request_with_503_and_exits(tmp_path):
    server = Subprocess(tmp_path, "--shutdown-grace", "0.5")
    thread, answer = in_flight(server)
    server.process.send_signal(signal.SIGTERM)
    assert server.wait(10) < 5, server.log.read_text()
    thread.join(5)
    assert answer["status"] == 503 and "shutting down" in answer["body"]["error"]["message"]


def test_a_second_signal_exits_at_once(tmp_path):
    server = Subprocess(tmp_path, "--shutdown-grace", "60")
    in_flight(server)
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert server.process.poll() is None  # in its grace period
    server.process.send_signal(signal.SIGTERM)
    assert server.wait(10) < 2


RSS_BOUND = 512 << 20  # bytes; see the test's docstring


def peak_rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) << 10


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_hostile_requests_keep_the_servers_memory_bounded(tmp_path, big_png):
    """The demo server peaks below 100 MiB through these cases (they are refused from headers and
    lengths). The most a server may decode at once is two requests of --max-image-pixels (2^24
    pixels: 48 MiB as RGB, a few copies while converted and resized, ~200 MiB each): 512 MiB holds
    that. The unbounded server decoded every image at full size: 3.4 GB on twelve 7990x7990 PNGs."""
    server = Subprocess(tmp_path, "--max-request-bytes", str(8 << 20))
    chats = [
        ask([image_part(data_url(big_png))] * 12),
        ask([image_part(data_url(big_png))]),
        ask([image_part(data_url(png(4096, 4096)))]),
        ask([image_part(data_url(png(10_000, 10_000)))]),
        ask(SORT, steps=10**9),
        ask(SORT, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": nested_arrays(19)}}),
        ask("sort: 1 2 " * 400_000),
    ]
    # Infill holes past the context: 150M positions took 2.4 GB before their 400, 10^12 a MemoryError.
    infills = [{"prompt": "sort: 42 ", "suffix": " 85", "max_tokens": n} for n in (150_000_000, 10**12)]
    try:
        bodies = [("/v1/chat/completions", {k: v for k, v in body.items() if k != "model"}) for body in chats]
        bodies += [("/v1/completions", body) for body in infills]  # (the server serves the demo's id)
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda job: post(server.url, job[1], job[0], timeout=60), bodies * 3))
        assert all(status == 400 for status, _, _ in answers), answers
        peak = peak_rss(server.process.pid)
        print(f"peak RSS {peak / 2**20:.0f} MiB")
        assert peak < RSS_BOUND
        assert "DecompressionBombWarning" not in server.log.read_text()
    finally:
        server.process.send_signal(signal.SIGTERM)
        server.wait(10)


# A schema llguidance gives up on in the worker's first steps (its lexer's limit on the pattern), once
# the model writes the optional key that the shortest answer, checked at admission, leaves out.
GIVES_UP = {
    "type": "object",
    "properties": {"q": {"type": "string", "maxLength": 5000, "pattern": r"^(?:\S+\s+){0,99}\S+$"}},
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "path, body, param",
    [
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": GIVES_UP}}},
            "response_format",
        ),
        (
            "/v1/responses",
            {"input": "hello", "text": {"format": {"type": "json_schema", "name": "x", "schema": GIVES_UP}}},
            "text.format",
        ),
        (
            "/v1/messages",
            {
                "max_tokens": 64,
                "tools": [{"name": "f", "input_schema": GIVES_UP}],
                "tool_choice": {"type": "tool", "name": "f"},
            },
            None,
        ),  # (Anthropic's error shape names no field)
        ("/api/chat", {"format": GIVES_UP, "stream": False}, None),  # (Ollama's error is its message alone)
    ],
)
def test_a_row_that_fails_in_the_worker_ends_alone(server, client, path, body, param):
    """A 400 naming the API's schema field in one line, while a request beside it is answered as alone."""
    with ThreadPoolExecutor(1) as pool:
        healthy = pool.submit(assert_still_serving, client)
        status, error, _ = post(server, {**ask("hello"), **body}, path, 60)
        healthy.result(timeout=60)
    message = error.get("message") or error.get("error", {}).get("message") if isinstance(error, dict) else error
    assert status == 400 and "llguidance gave up on the schema mid-answer" in str(message), error
    assert "\n" not in str(message) and (param is None or error.get("param") == param), error


# A schema llguidance gives up on at its first character: within its shortest answer, so at admission.
GIVES_UP_AT_ONCE = {"type": "string", "maxLength": 5000, "pattern": r"^(?:\S+\s+){0,99}\S+$"}


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/api/chat", {"format": GIVES_UP_AT_ONCE, "stream": True}, None),  # (Ollama's error is its message alone)
        (
            "/v1/chat/completions",
            {
                "stream": True,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": GIVES_UP_AT_ONCE}},
            },
            "response_format",
        ),
        (
            "/v1/responses",
            {
                "input": "hello",
                "stream": True,
                "text": {"format": {"type": "json_schema", "name": "x", "schema": GIVES_UP_AT_ONCE}},
            },
            "text.format",
        ),
        (
            "/v1/messages",
            {
                "max_tokens": 64,
                "stream": True,
                "tools": [
                    {
                        "name": "f",
                        "input_schema": {"type": "object", "required": ["s"], "properties": {"s": GIVES_UP_AT_ONCE}},
                    }
                ],
                "tool_choice": {"type": "tool", "name": "f"},
            },
            None,
        ),  # (Anthropic's error shape names no field)
    ],
)
def test_a_schema_llguidance_gives_up_on_at_once_is_a_400_before_any_stream(server, client, path, body, param):
    """Streamed, the 400 comes instead of the stream (not a 200 and an error event): one JSON error in
    one line, naming the API's schema field, and the server answers the next request."""
    request = urllib.request.Request(
        server + path, data=json.dumps({**ask("hello"), **body}).encode(), headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=60).read()
    assert caught.value.code == 400 and "text/event-stream" not in caught.value.headers.get("Content-Type", "")
    error = json.loads(caught.value.read())
    error = error.get("error", error)
    message = error.get("message", error) if isinstance(error, dict) else error
    assert "llguidance gave up on it" in str(message) and "\n" not in str(message), error
    assert param is None or error.get("param") == param, error
    assert_still_serving(client)


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/v1/chat/completions", {"freeze_after": 2147483648}, "freeze_after must be an integer from 0 to 512"),
        (
            "/api/chat",
            {"options": {"freeze_after": 2147483648}, "stream": False},
            "options.freeze_after must be an integer from 0 to 512",
        ),
        ("/v1/messages", {"max_tokens": 8, "freeze_after": 10**30}, "freeze_after must be an integer from 0 to 512"),
    ],
)
def test_freeze_after_is_bounded_by_the_field_sent(server, client, path, body, message):
    status, error, _ = post(server, {**ask("hello"), **body}, path)
    assert status == 400 and message in json.dumps(error), error
    assert_still_serving(client)


LONG_TEXT = "x" * (2 << 20)  # (the server's body limit here is 4 MiB)
TOOL = {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"policy": LONG_TEXT}, "policy", "policy must be one of "),
        (
            {"response_format": {"type": LONG_TEXT}},
            "response_format",
            "response_format type must be text, json_object or json_schema, got ",
        ),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": LONG_TEXT}}},
            "tool_choice",
            "tool_choice must be 'none', 'auto', 'required' or name one of the tools, got ",
        ),
        ({"draft_length": int("9" * 4000)}, "draft_length", "draft_length must be an integer from 1 to the model's "),
    ],
    ids=["policy", "response-format-type", "tool-choice-name", "draft-length"],
)
def test_an_error_shows_a_short_cut_of_the_value(server, caplog, body, param, message):
    """A value of megabytes comes back (and goes to the log) as its first few dozen characters."""
    caplog.set_level(logging.INFO, logger="mlx_dgemma.server")
    status, error, _ = post(server, {**ask(SORT), **body})
    assert status == 400 and error["param"] == param and error["message"].startswith(message), error["message"][:300]
    assert len(error["message"]) < 300 and ("'xxx" in error["message"] or "999" in error["message"])
    (logged,) = [r.getMessage() for r in caplog.records if "refused with 400" in r.getMessage()]
    assert len(logged) < 400 and error["message"] in logged


@pytest.mark.parametrize(
    "body, message",
    [
        ({"temperature": 1e-308}, "temperature must be 0 or a finite number from 0.0001 to 2, got 1e-308"),
        ({"schedule_scale": 1e308}, "schedule_scale 1e+308: the temperature schedule they make cannot be used ("),
        ({"temp_min": 0.5, "temp_max": 0.25}, "temp_min 0.5, temp_max 0.25: the temperature schedule they make cannot"),
    ],
    ids=["temperature", "schedule-scale", "temp-min-over-max"],
)
def test_numeric_options_name_their_bound_and_the_field_sent(server, body, message):
    status, error, _ = post(server, {**ask(SORT), **body})
    assert status == 400 and error["param"] == next(iter(body)) and error["message"].startswith(message), error
