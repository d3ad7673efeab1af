"""Browsers calling the server from a page of another origin (CORS), through a real uvicorn server:
a preflight ``OPTIONS`` and a simple cross-origin request on every API, from a local origin, an allowed
one and a refused one; and a DNS-rebinding page, whose ``Host`` is its own name."""

import http.client
import json
from urllib.parse import urlsplit

import pytest

from mlx_dgemma.engine.batch import BatchGenerator
from mlx_dgemma.server.origins import host_local, is_loopback, origin_allowed

from .test_server import SORT, serving

ALLOWED = "https://app.example"
REFUSED = "https://elsewhere.example"
LOCAL = "http://localhost:5173"
ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/api/chat", "/api/generate"]


class CountingEngine(BatchGenerator):
    """The worker's engine, counting the requests it is given (``inserted``, shared by every instance)."""

    inserted = 0

    def insert(self, *args, **kwargs):
        CountingEngine.inserted += 1
        return super().insert(*args, **kwargs)


@pytest.fixture(scope="module")
def servers(demo):
    """A server with the default origins (local ones), one open to every origin (``*``, the opt-in) and one
    open to ``ALLOWED`` besides the local ones."""
    with (
        serving(*demo, engine=CountingEngine) as default,
        serving(*demo, allowed_origins=["*"]) as anyone,
        serving(*demo, allowed_origins=[ALLOWED]) as one,
    ):
        yield default, anyone, one


def call(server: str, method: str, path: str, headers: dict, body: dict | None = None):
    """Status, headers (lowercase names) and body of one request as a browser sends it (JSON, unless
    ``headers`` names another Content-Type)."""
    connection = http.client.HTTPConnection(urlsplit(server).netloc, timeout=60)
    data = None if body is None else json.dumps(body)
    connection.request(
        method,
        path,
        body=data,
        headers={**({"Content-Type": "application/json"} if body is not None else {}), **headers},
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
    default, anyone, one = servers
    status, headers, _ = preflight(anyone, path, REFUSED)
    assert status == 200 and headers["access-control-allow-origin"] == "*"
    assert "POST" in headers["access-control-allow-methods"]
    assert {"content-type", "authorization"} <= set(headers["access-control-allow-headers"].split(", "))

    status, headers, _ = preflight(one, path, ALLOWED)
    assert status == 200 and headers["access-control-allow-origin"] == ALLOWED
    status, headers, _ = preflight(one, path, LOCAL)
    assert status == 200 and headers["access-control-allow-origin"] == LOCAL
    status, headers, _ = preflight(one, path, REFUSED)
    assert status == 403 and "access-control-allow-origin" not in headers

    for origin in ("http://127.0.0.1:8080", "https://[::1]:3000", "http://0.0.0.0", "http://localhost"):
        status, headers, _ = preflight(default, path, origin)
        assert status == 200 and headers["access-control-allow-origin"] == origin
    for origin in (REFUSED, "null", "http://localhost.elsewhere.example", "ftp://localhost"):
        status, headers, body = preflight(default, path, origin)
        assert status == 403 and "access-control-allow-origin" not in headers
        assert origin in body.decode() and "--allowed-origins" in body.decode()


@pytest.mark.parametrize("path", ROUTES)
def test_a_cross_origin_reply_carries_the_headers_on_every_route(servers, path):
    """An empty body's reply (a refusal in each API's shape; Ollama's chat and generate answer it as a
    model load) carries them as an answer does: a page reads both. A refused origin's request is a 403,
    in the API's error shape."""
    default, anyone, one = servers
    status, headers, _ = call(anyone, "POST", path, {"Origin": REFUSED}, {})
    assert headers["access-control-allow-origin"] == "*"
    answer = call(one, "POST", path, {"Origin": ALLOWED}, {})
    assert answer[0] == status and answer[1]["access-control-allow-origin"] == ALLOWED
    assert "Origin" in answer[1]["vary"]
    answer = call(default, "POST", path, {"Origin": LOCAL}, {})
    assert answer[0] == status and answer[1]["access-control-allow-origin"] == LOCAL
    status, headers, body = call(one, "POST", path, {"Origin": REFUSED}, {})
    assert status == 403 and "access-control-allow-origin" not in headers
    error = json.loads(body)["error"]
    assert REFUSED in (error if isinstance(error, str) else error["message"])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat"])
def test_a_foreign_page_generates_nothing(servers, path):
    """A page elsewhere sends what a browser sends without a preflight (a "simple" text/plain POST), a
    whole request; the default server refuses it before the worker is given anything. The same request
    from a local page is answered."""
    default, _, _ = servers
    body = {"model": "demo", "messages": [{"role": "user", "content": SORT}], "max_tokens": 4, "stream": False}
    before = CountingEngine.inserted
    for origin in (REFUSED, "null"):
        status, headers, _ = call(default, "POST", path, {"Origin": origin, "Content-Type": "text/plain"}, body)
        assert status == 403 and "access-control-allow-origin" not in headers
    assert CountingEngine.inserted == before
    status, headers, answer = call(default, "POST", path, {"Origin": LOCAL, "Content-Type": "text/plain"}, body)
    assert status == 200 and headers["access-control-allow-origin"] == LOCAL and b"17" in answer
    assert CountingEngine.inserted == before + 1


@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/health")])
def test_a_rebinding_host_is_refused(servers, method, path):
    """A DNS-rebinding page (its own name, resolved to 127.0.0.1) is same-origin: a GET carries no
    ``Origin``. Its ``Host`` is its name, which a loopback server refuses, even open to every origin."""
    default, anyone, _ = servers
    port = urlsplit(default).port
    body = {"messages": [{"role": "user", "content": SORT}], "max_tokens": 4} if method == "POST" else None
    before = CountingEngine.inserted
    for server in (default, anyone):
        for host in ("rebind.example", f"rebind.example:{urlsplit(server).port}", "127.0.0.1.nip.io"):
            status, _, answer = call(server, method, path, {"Host": host}, body)
            assert status == 403 and host in answer.decode(), (server, host)
    assert CountingEngine.inserted == before
    for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "app.localhost"):
        status, _, _ = call(default, "GET", "/v1/models", {"Host": host})
        assert status == 200, host


def test_which_hosts_and_origins_are_local():
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.168.1.4", "example.com"]))
    local = ["localhost:8080", "127.0.0.1", "[::1]:80", "10.0.0.4:8080", "0.0.0.0:1", "LOCALHOST.", "a.localhost"]
    assert all(map(host_local, local))
    assert not any(map(host_local, ["example.com", "localhost.example.com:8080", "8.8.8.8", "[2606:4700::1111]:80"]))
    assert origin_allowed("https://localhost:3000", []) and not origin_allowed("https://localhost:3000/x", [])
    assert not origin_allowed(ALLOWED, []) and origin_allowed(ALLOWED, [ALLOWED]) and origin_allowed(REFUSED, ["*"])


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_to_an_allowed_origin_carries_the_headers(servers, stream):
    _, _, one = servers
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
    assert status == 403 and "access-control-allow-origin" not in headers
