"""Embeddings through the server: OpenAI's ``/v1/embeddings`` by the ``openai`` client (its base64 default
and floats), Ollama's ``/api/embed`` and ``/api/embeddings`` by the ``ollama`` client, and LiteLLM's
``litellm.embedding`` through its OpenAI provider, against a real uvicorn server on the bundled demo.
Each text's vector is the one the engine (mlx_dgemma/engine/embeddings.py) gives it alone, whichever API asked
and whatever else the request or the server was running; bad input is a one-line 4xx naming the field,
in the API's own shape."""

import base64
import json
import logging
import os
import threading
import time
import urllib.request

import numpy as np
import ollama
import openai
import pytest

from mlx_dgemma import generate
from mlx_dgemma.engine.embeddings import embed
from mlx_dgemma.server.embeddings import MAX_INPUTS, MAX_REQUEST_TOKENS

from .test_batch import BOUND, relative
from .test_server import CONTEXT, MODEL_ID, SORT, health, raw_post, serving, short_context  # noqa: F401 (a fixture)

TEXTS = [SORT, "reverse: planet", "add: 417 85", "json: name=ada age=36 city=rome"]


@pytest.fixture(scope="module")
def server(demo):
    with serving(*demo, log_level="info") as url:  # (statuses in uvicorn.access: see statuses)
        yield url


@pytest.fixture
def statuses():
    """The statuses of the requests the server answers meanwhile, read off its access log."""
    seen = []

    class Statuses(logging.Handler):
        def emit(self, record):
            seen.append(record.args[4])

    handler, access = Statuses(), logging.getLogger("uvicorn.access")
    level = access.level  # (each server started sets it: another module's may have started since)
    access.setLevel(logging.INFO)
    access.addHandler(handler)
    yield seen
    access.removeHandler(handler)
    access.setLevel(level)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=60)


def alone(demo, text) -> np.ndarray:
    """The engine's vector of ``text`` (or ids) embedded by itself, tokenized as the server tokenizes it."""
    model, tokenizer = demo
    ids = tokenizer.encode(text) if isinstance(text, str) else text
    return embed(model, [ids], tokenizer.bos_token_id)[0]


def check_alone(demo, vectors, texts) -> None:
    assert len(vectors) == len(texts)
    for vector, text in zip(vectors, texts):
        assert relative(np.asarray(vector, np.float32), alone(demo, text)) <= BOUND


def test_openai_embeddings_are_each_texts_alone_in_order_with_usage(demo, client):
    reply = client.embeddings.create(model=MODEL_ID, input=TEXTS)  # (base64 by the client's default)
    assert reply.object == "list" and reply.model == MODEL_ID
    assert [d.index for d in reply.data] == list(range(len(TEXTS)))
    check_alone(demo, [d.embedding for d in reply.data], TEXTS)
    tokens = sum(len(demo[1].encode(t)) for t in TEXTS)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == tokens


def test_floats_base64_and_token_ids_give_the_same_vectors(demo, client):
    ids = demo[1].encode(TEXTS[1])
    as_floats = client.embeddings.create(model=MODEL_ID, input=TEXTS[1], encoding_format="float").data[0].embedding
    # (asked for by name, base64 comes back as the text; the client decodes only its own default)
    text = client.embeddings.create(model=MODEL_ID, input=TEXTS[1], encoding_format="base64").data[0].embedding
    as_base64 = np.frombuffer(base64.b64decode(text), "<f4").tolist()
    from_ids = client.embeddings.create(model=MODEL_ID, input=ids, encoding_format="float").data[0].embedding
    listed = client.embeddings.create(model=MODEL_ID, input=[ids, TEXTS[0]], encoding_format="float")
    assert as_floats == as_base64 == from_ids  # one float32 vector, written exactly both ways
    check_alone(demo, [d.embedding for d in listed.data], [ids, TEXTS[0]])


def test_ollama_embed_and_embeddings(demo, server):
    client = ollama.Client(host=server, timeout=60)
    reply = client.embed(model=f"{MODEL_ID}:latest", input=TEXTS)
    assert reply.model == f"{MODEL_ID}:latest" and reply.prompt_eval_count == sum(len(demo[1].encode(t)) for t in TEXTS)
    check_alone(demo, reply.embeddings, TEXTS)
    one = client.embed(model=MODEL_ID, input=TEXTS[2]).embeddings[0]
    assert client.embeddings(model=MODEL_ID, prompt=TEXTS[2]).embedding == one  # (the same vector, as alone)
    check_alone(demo, [one], [TEXTS[2]])
    # No input (Ollama's way of loading a model) answers no embeddings.
    assert client.embed(model=MODEL_ID, input=[]).embeddings == []
    assert client.embeddings(model=MODEL_ID, prompt="").embedding == []


def test_ollama_cuts_a_text_past_the_context_unless_truncate_is_false(short_context):  # noqa: F811
    context = short_context[0].config.max_position_embeddings
    text = "sort: 42 17 85 23 61 " * (context // 8)
    ids = short_context[1].encode(text)
    assert len(ids) > context
    with serving(*short_context) as server:
        status, body = raw_post(server, "/api/embed", json.dumps({"model": MODEL_ID, "input": [text]}).encode())
        assert status == 200 and body["prompt_eval_count"] == context
        check_alone(short_context, body["embeddings"], [ids[:context]])
        status, body = raw_post(server, "/api/embed", json.dumps({"input": text, "truncate": False}).encode())
    assert status == 400 and body == {
        "error": f"input is {len(ids)} tokens, more than the model's context of "
        f"{context}; shorten it or leave truncate out"
    }


def test_litellms_embedding_call_with_no_4xx(demo, server, statuses):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # (it would fetch a price list at import)
    import litellm

    reply = litellm.embedding(model=f"openai/{MODEL_ID}", api_base=server + "/v1", api_key="none", input=TEXTS)
    check_alone(demo, [d["embedding"] for d in reply.data], TEXTS)
    assert reply.usage.prompt_tokens == sum(len(demo[1].encode(t)) for t in TEXTS)
    assert statuses and all(s < 400 for s in statuses), statuses


def test_embeddings_and_generation_at_once_each_give_what_they_give_alone(demo, client):
    """An embedding request runs on the worker between generation steps: the answer being generated and
    the vectors are each what they are alone."""
    answers = []
    chat = threading.Thread(
        target=lambda: answers.append(
            client.chat.completions.create(
                model=MODEL_ID, messages=[{"role": "user", "content": SORT}], max_tokens=64, seed=3
            )
            .choices[0]
            .message.content
        )
    )
    chat.start()
    many = [f"sort: {i} " + "42 17 85 23 61 " * 46 for i in range(6)]  # ~700 tokens: three forwards of two
    vectors = [d.embedding for d in client.embeddings.create(model=MODEL_ID, input=many).data]
    chat.join(timeout=120)
    assert answers == [generate(*demo, SORT, max_tokens=64, seed=3)]
    check_alone(demo, vectors, many)


def test_a_failed_embedding_is_a_500_and_generation_goes_on(demo, client, monkeypatch):
    from mlx_dgemma.server import scheduler

    def failing(*args):
        raise RuntimeError("out of memory\nat some place")
        yield

    monkeypatch.setattr(scheduler, "embedding_steps", failing)
    with pytest.raises(openai.InternalServerError) as failed:
        client.embeddings.create(model=MODEL_ID, input=TEXTS)
    assert failed.value.body["message"] == "embedding failed: out of memory"
    answer = (
        client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": SORT}], max_tokens=64, seed=3
        )
        .choices[0]
        .message.content
    )
    assert answer == generate(*demo, SORT, max_tokens=64, seed=3)


def test_a_client_that_goes_away_stops_its_embedding(server):
    before = health(server)
    # Four texts as long as the context: four forwards of four chunks each, seconds of work.
    body = json.dumps({"model": MODEL_ID, "input": [[2] * CONTEXT] * 4}).encode()
    request = urllib.request.Request(server + "/v1/embeddings", data=body, headers={"Content-Type": "application/json"})
    with pytest.raises(TimeoutError):
        urllib.request.urlopen(request, timeout=1)  # (it goes away after a second)
    deadline = time.monotonic() + 60
    while (now := health(server))["cancelled"] == before["cancelled"]:
        assert time.monotonic() < deadline, "the embedding was not cancelled"
        time.sleep(0.05)
    assert now["embedding"] == 0 and now["finished"] == before["finished"]


OPENAI_BAD = [
    ({"input": ""}, "input", "input must be a non-empty string, a list of them, token ids or a list of those, got ''"),
    ({"input": []}, "input", "input must be a non-empty string"),
    ({"input": 5}, "input", "got 5"),
    ({"input": ["a", {"text": "b"}]}, "input", "input[1] must be a non-empty string or a non-empty list of token ids"),
    ({"input": ["a"] * (MAX_INPUTS + 1)}, "input", f"input has {MAX_INPUTS + 1} texts, more than the {MAX_INPUTS}"),
    ({"input": [[2] * (CONTEXT + 1)]}, "input", f"input[0] is {CONTEXT + 1} tokens, more than the model's context"),
    (
        {"input": [[2] * CONTEXT] * (MAX_REQUEST_TOKENS // CONTEXT + 1)},
        "input",
        f"input's texts are more than {MAX_REQUEST_TOKENS} tokens together (by input[{MAX_REQUEST_TOKENS // CONTEXT}])",
    ),
    ({"input": [[2, 99999]]}, "input", "input[0] holds token id 99999, outside the vocabulary (0..347)"),
    ({"input": "x", "dimensions": 3}, "dimensions", "dimensions must be 128 (the model's width) or left out, got 3"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", 'encoding_format must be "float" or "base64"'),
]


@pytest.mark.parametrize("body, param, message", OPENAI_BAD)
def test_bad_openai_input_is_a_one_line_400_naming_the_field(server, body, param, message):
    status, reply = raw_post(server, "/v1/embeddings", json.dumps({"model": MODEL_ID, **body}).encode())
    error = reply["error"]
    assert status == 400 and error["param"] == param and message in error["message"], reply
    assert "\n" not in error["message"] and len(error["message"]) < 200


OLLAMA_BAD = [
    ("/api/embed", {"input": 5}, "input must be a string or a list of strings, got 5"),
    ("/api/embed", {"input": ["a", 1]}, "input must be a string or a list of strings"),
    ("/api/embed", {"input": "a", "truncate": "yes"}, "truncate must be true or false, got 'yes'"),
    ("/api/embed", {"input": "a", "options": [1]}, "options must be an object, got [1]"),
    ("/api/embeddings", {"prompt": ["a"]}, "prompt must be a string, got ['a']"),
]


@pytest.mark.parametrize("path, body, message", OLLAMA_BAD)
def test_bad_ollama_input_is_a_one_line_400_in_ollamas_shape(server, path, body, message):
    status, reply = raw_post(server, path, json.dumps({"model": MODEL_ID, **body}).encode())
    assert status == 400 and list(reply) == ["error"] and reply["error"].startswith(message), reply


@pytest.mark.parametrize("path", ["/v1/embeddings", "/api/embed", "/api/embeddings"])
def test_an_unknown_model_is_a_404(server, path):
    status, reply = raw_post(server, path, json.dumps({"model": "nope", "input": "a", "prompt": "a"}).encode())
    message = reply["error"]["message"] if path.startswith("/v1") else reply["error"]
    assert status == 404 and message.startswith('the model "nope" does not exist'), reply
