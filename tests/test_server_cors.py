"""Browsers calling the server from a page of another origin (CORS), through a real uvicorn server:
a preflight ``OPTIONS`` and a simple cross-origin request on every API, from an allowed origin and a
refused one."""

import http.client
import json
from urllib.parse import urlsplit

import pytest

from .test_server import serving

ALLOWED = "https://app.example"
REFUSED = "https://elsewhere.example"
ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/api/chat", "/api/generate"]


@pytest.fixture(scope="module")
def servers(demo):
    """A server open to every origin (the default) and one open to ``ALLOWED`` alone."""
    with serving(*demo) as anyone, serving(*demo, allowed_origins=[ALLOWED]) as one:
        yield anyone, one


def call(server: str, method: str, path: str, headers: dict, body: dict | None = None):
    """Status, headers (lowercase names) and body of one request as a browser sends it."""
    connection = http.client.HTTPConnection(urlsplit(server).netloc, timeout=60)
    data = None if body is None else json.dumps(body)
    connection.request(
        method,
        path,
        body=data,
        headers={**headers, **({"Content-Type": "application/json"} if body is not None else {})},
    )
    response = connection.getresponse()
    answer = response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    connection.close()
    return answer


def preflight(server: str, path: str, origin: str):
    return call(
        server,
        "OPTIONS",
        path,
        {
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type, authorization",
        },
    )


@pytest.mark.parametrize("path", ROUTES)
def test_a_preflight_is_answered_on_every_route(servers, path):
    anyone, one = servers
    status, headers, _ = preflight(anyone, path, REFUSED)
    assert status == 200 and headers["access-control-allow-origin"] == "*"
    assert "POST" in headers["access-control-allow-methods"]
    assert {"content-type", "authorization"} <= set(headers["access-control-allow-headers"].split(", "))

    status, headers, _ = preflight(one, path, ALLOWED)
    assert status == 200 and headers["access-control-allow-origin"] == ALLOWED
    status, headers, _ = preflight(one, path, REFUSED)
    assert status == 400 and "access-control-allow-origin" not in headers


@pytest.mark.parametrize("path", ROUTES)
def test_a_cross_origin_reply_carries_the_headers_on_every_route(servers, path):
    """An empty body's reply (a refusal in each API's shape; Ollama's chat and generate answer it as a
    model load) carries them as an answer does: a page reads both. A refused origin's request is still answered (the browser keeps the reply from
    the page), without them."""
    anyone, one = servers
    status, headers, _ = call(anyone, "POST", path, {"Origin": REFUSED}, {})
    assert headers["access-control-allow-origin"] == "*"
    answer = call(one, "POST", path, {"Origin": ALLOWED}, {})
    assert answer[0] == status and answer[1]["access-control-allow-origin"] == ALLOWED
    assert "Origin" in answer[1]["vary"]
    answer = call(one, "POST", path, {"Origin": REFUSED}, {})
    assert answer[0] == status and "access-control-allow-origin" not in answer[1]


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_to_an_allowed_origin_carries_the_headers(servers, stream):
    _, one = servers
    body = {
        "messages": [{"role": "user", "content": "sort: 42 17 85 23 61"}],
        "max_tokens": 4,
        "seed": 3,
        "stream": stream,
    }
    status, headers, answer = call(one, "POST", "/v1/chat/completions", {"Origin": ALLOWED}, body)
    assert status == 200 and headers["access-control-allow-origin"] == ALLOWED
    assert b"17" in answer
    status, headers, _ = call(one, "GET", "/v1/models", {"Origin": REFUSED})
    assert status == 200 and "access-control-allow-origin" not in headers
