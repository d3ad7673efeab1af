"""The server's OpenAI replies against OpenAI's published OpenAPI document (the schemas of its
responses, tests/data/openai_openapi: source and licence there): chat and completions, whole and
streamed, embeddings, models, Responses and its stream's events, and errors, from a real uvicorn
server on the demo model. The official ``openai`` client reads the same replies into its types."""

import json
import urllib.error
import urllib.request
from pathlib import Path

import jsonschema
import openai
import pytest

from .test_server import MODEL_ID, SORT, WEATHER, serving

NAMES = {"properties", "patternProperties"}  # keywords whose keys are names, not keywords


def with_nulls(schema, names: bool = False):
    """OpenAPI 3.0's ``nullable: true`` (which the document still uses) as JSON Schema says it: null or the rest."""
    if isinstance(schema, list):
        return [with_nulls(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    if names:
        return {name: with_nulls(s) for name, s in schema.items()}
    converted = {k: with_nulls(v, k in NAMES) for k, v in schema.items() if k != "nullable"}
    return {"anyOf": [{"type": "null"}, converted]} if schema.get("nullable") is True else converted


DOCUMENT = with_nulls(json.loads((Path(__file__).parent / "data" / "openai_openapi" / "schemas.json").read_text()))


# ResponseStreamEvent's members by their type
EVENTS = {
    DOCUMENT["components"]["schemas"][name]["properties"]["type"]["enum"][0]: name
    for name in (
        ref["$ref"].rsplit("/", 1)[1] for ref in DOCUMENT["components"]["schemas"]["ResponseStreamEvent"]["anyOf"]
    )
}


def check(reply: dict, schema: str) -> None:
    """``reply`` validates against the document's ``schema`` (its references resolved in the document)."""
    validator = jsonschema.Draft202012Validator({**DOCUMENT, "$ref": f"#/components/schemas/{schema}"})
    error = jsonschema.exceptions.best_match(validator.iter_errors(reply))
    assert error is None, f"{schema} at {list(error.absolute_path)}: {error.message[:300]}"


@pytest.fixture(scope="module")
def server(demo):
    with serving(*demo) as url:
        yield url


def call(server: str, path: str, body: dict | None = None) -> tuple[int, dict | list]:
    """The status and JSON body of a GET (no body) or POST; a streamed reply as its list of events."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            text = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    if body is None or not body.get("stream"):
        return status, json.loads(text)
    events = [line.removeprefix("data: ") for line in text.split("\n") if line.startswith("data: ")]
    return status, [json.loads(event) for event in events if event != "[DONE]"]


def chat_body(**kwargs) -> dict:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": SORT}], "max_tokens": 16, "seed": 3, **kwargs}


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"logprobs": True, "top_logprobs": 2},
        {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 64},
        {"n": 2},
    ],
    ids=["plain", "logprobs", "tool-call", "n"],
)
def test_chat_replies_follow_the_document(server, options):
    status, reply = call(server, "/v1/chat/completions", chat_body(**options))
    assert status == 200
    check(reply, "CreateChatCompletionResponse")
    status, chunks = call(
        server, "/v1/chat/completions", chat_body(stream=True, stream_options={"include_usage": True}, **options)
    )
    assert status == 200 and chunks
    for chunk in chunks:
        check(chunk, "CreateChatCompletionStreamResponse")


@pytest.mark.parametrize("options", [{}, {"echo": True, "logprobs": 2}, {"prompt": [SORT, "reverse: abc"]}])
def test_completions_replies_follow_the_document(server, options):
    body = {"model": MODEL_ID, "prompt": SORT, "max_tokens": 16, "seed": 3, **options}
    status, reply = call(server, "/v1/completions", body)
    assert status == 200
    check(echoed(reply), "CreateCompletionResponse")
    status, chunks = call(server, "/v1/completions", {**body, "stream": True})
    assert status == 200 and chunks
    for chunk in chunks:
        check(echoed(chunk), "CreateCompletionResponse")


def echoed(reply: dict) -> dict:
    """``reply`` as the document types it: with echo, the prompt's first token has no log-probability (nothing
    precedes it), null as OpenAI's own API answers, where the document says a number. Checked null, then left out."""
    for choice in reply["choices"]:
        logprobs = choice.get("logprobs")
        if logprobs and logprobs["token_logprobs"] and logprobs["token_logprobs"][0] is None:
            assert logprobs["tokens"][0] == "<bos>" and logprobs["text_offset"][0] == 0
            logprobs = {key: values[1:] for key, values in logprobs.items() if isinstance(values, list)}
            choice["logprobs"] = logprobs
    return reply


def test_embeddings_and_models_follow_the_document(server):
    status, reply = call(server, "/v1/embeddings", {"model": MODEL_ID, "input": [SORT, "reverse: abc"]})
    assert status == 200
    check(reply, "CreateEmbeddingResponse")
    status, models = call(server, "/v1/models")
    assert status == 200
    check(models, "ListModelsResponse")
    status, model = call(server, f"/v1/models/{MODEL_ID}")
    assert status == 200 and model == models["data"][0]
    check(model, "Model")


@pytest.mark.parametrize(
    "options", [{}, {"tools": [{"type": "function", **WEATHER["function"]}]}], ids=["plain", "tools"]
)
def test_responses_replies_follow_the_document(server, options):
    body = {"model": MODEL_ID, "input": SORT, "max_output_tokens": 16, **options}
    status, reply = call(server, "/v1/responses", body)
    assert status == 200
    check(reply, "Response")
    status, events = call(server, "/v1/responses", {**body, "stream": True})
    assert status == 200 and events
    for event in events:
        assert event["type"] in EVENTS, f"{event['type']} is not an event of the document's ResponseStreamEvent"
        check(event, EVENTS[event["type"]])  # (the union's errors say no more than "none of them")
        check(event, "ResponseStreamEvent")
    check(events[-1]["response"], "Response")


@pytest.mark.parametrize(
    "path, body, status",
    [
        ("/v1/chat/completions", chat_body(temperature=-1), 400),
        ("/v1/chat/completions", {"model": MODEL_ID, "messages": [{"role": "wizard", "content": SORT}]}, 400),
        ("/v1/completions", {"model": MODEL_ID, "prompt": SORT, "max_tokens": -1}, 400),
        ("/v1/models/gpt-nothing", None, 404),
        ("/v1/nowhere", None, 404),
    ],
    ids=["temperature", "role", "max-tokens", "unknown-model", "unknown-route"],
)
def test_errors_follow_the_document(server, path, body, status):
    got, reply = call(server, path, body)
    assert got == status
    check(reply, "ErrorResponse")


@pytest.mark.parametrize("role", ["wizard", "asistant", "function"])
def test_an_unknown_role_is_refused_by_name(server, role):
    status, reply = call(server, "/v1/chat/completions", {**chat_body(), "messages": [{"role": role, "content": SORT}]})
    assert status == 400 and reply["error"]["param"] == "messages"
    assert f"messages[0].role '{role}' is not a role" in reply["error"]["message"]


def test_the_official_client_retrieves_the_model_and_reads_responses_usage(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=60)
    model = client.models.retrieve(MODEL_ID)
    assert (model.id, model.object) == (MODEL_ID, "model")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-nothing")
    response = client.responses.create(model=MODEL_ID, input=SORT, max_output_tokens=16)
    usage = response.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert isinstance(usage.input_tokens_details.cached_tokens, int)
    assert isinstance(usage.input_tokens_details.cache_write_tokens, int)
    assert isinstance(usage.output_tokens_details.reasoning_tokens, int)
    chat = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": SORT}], max_tokens=16)
    assert chat.choices[0].message.refusal is None and chat.system_fingerprint is None
