"""Ollama's API, OpenAI's Responses API, Anthropic's Messages API and ``suffix`` infill on the server,
each driven by its official client (``ollama``, ``openai``, ``anthropic``) against a real uvicorn server
serving the bundled demo model; images on a random checkpoint with a vision tower."""

import base64
import io
import json
import re
import shutil
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import anthropic
import jsonschema
import ollama
import openai
import pytest
from mlx.utils import tree_flatten

from mlx_dgemma import generate, infill, stream_generate
from mlx_dgemma.server.ollama import digest

from .test_server import CONTEXT, MAX_BODY, MODEL_ID, PERSON, SORT, WEATHER, health, raw_post, serving
from .test_server_images import PROMPT, vision_model  # noqa: F401 (a fixture)
from .test_vision import PICTURES, C

ANSWER = "17 23 42 61 85"  # the demo model's answer to SORT at seed 3
# A template that writes Gemma 4's call syntax into the answer, as a tool-trained checkpoint does.
CALL = 'Sure. <|tool_call>call:get_weather{city:<|"|>{{fill:6}}<|"|>,days:3}<tool_call|>'
PREFIX = "<bos><|turn>user\nsort: 42 17 85 23 61<turn|>\n<|turn>model\n<|channel>thought\n<channel|>17 "
ANTHROPIC_WEATHER = {
    "name": "get_weather",
    "description": WEATHER["function"]["description"],
    "input_schema": WEATHER["function"]["parameters"],
}
RESPONSES_WEATHER = {"type": "function", **{k: WEATHER["function"][k] for k in ("name", "description", "parameters")}}


@pytest.fixture(scope="module")
def server(demo):
    with serving(*demo, max_request_bytes=MAX_BODY) as url:
        yield url


@pytest.fixture(scope="module")
def ollama_client(server):
    return ollama.Client(host=server, timeout=60)


@pytest.fixture(scope="module")
def openai_client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def anthropic_client(server):
    return anthropic.Anthropic(base_url=server, api_key="none", max_retries=0, timeout=60)


def user(text):
    return [{"role": "user", "content": text}]


# -- Ollama -----------------------------------------------------------------------------------------


def ollama_chat(client, text=SORT, seed=3, **kwargs):
    options = {"seed": seed, "num_predict": 64, **kwargs.pop("options", {})}
    return client.chat(**{"model": MODEL_ID, "messages": user(text), "options": options, **kwargs})


def test_the_digest_is_the_checkpoints(demo, tmp_path):
    """Stable across loads of one checkpoint; another config, or other weights of the same shapes (a
    fine-tune), another digest."""
    from mlx_dgemma import load
    from mlx_dgemma.generate import DEMO_MODEL

    model = demo[0]
    assert digest(load(DEMO_MODEL)[0]) == digest(model)
    folder = shutil.copytree(DEMO_MODEL, tmp_path / "demo")
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 1024
    (folder / "config.json").write_text(json.dumps(config))
    assert digest(load(folder)[0]) != digest(model)
    tuned = load(DEMO_MODEL)[0]
    name, weight = max(tree_flatten(tuned.parameters()), key=lambda item: item[1].size)
    tuned.load_weights([(name, weight + 0.01)], strict=False)
    assert digest(tuned) != digest(model)


def test_ollama_lists_and_shows_the_model(ollama_client, demo):
    (model,) = ollama_client.list().models
    assert model.model == f"{MODEL_ID}:latest" and model.size > 0 and model.details.format == "safetensors"
    assert re.fullmatch("[0-9a-f]{64}", model.digest) and model.digest == digest(demo[0])
    (loaded,) = ollama_client.ps().models  # the model in memory, for as long as the server runs
    assert (loaded.model, loaded.digest, loaded.size) == (model.model, model.digest, model.size)
    assert loaded.context_length == CONTEXT and loaded.expires_at.year > 2100
    for name in (f"{MODEL_ID}:latest", MODEL_ID):  # Ollama's name:tag, and the name alone
        reply = ollama_chat(ollama_client, model=name)
        assert reply.message.content == ANSWER and reply.model == name
    with pytest.raises(ollama.ResponseError) as caught:
        ollama_chat(ollama_client, model=f"{MODEL_ID}:7b")
    assert caught.value.status_code == 404
    shown = ollama_client.show(f"{MODEL_ID}:latest")
    # The demo's template writes no tools or images, and has Gemma 4's thinking switch.
    assert set(shown.capabilities) == {"completion", "insert", "thinking"}
    assert shown.modelinfo["gemma4.context_length"] == demo[0].config.max_position_embeddings
    assert ollama_client._client.get("/api/version").json()["version"]
    with pytest.raises(ollama.ResponseError) as caught:
        ollama_client.show("llama3")
    assert caught.value.status_code == 404 and "llama3" in caught.value.error


def test_ollama_chat_streamed_equals_whole_and_generate(ollama_client, demo):
    model, tokenizer = demo
    whole = ollama_chat(ollama_client)
    assert whole.message.content == ANSWER == generate(model, tokenizer, SORT, max_tokens=64, seed=3)
    assert whole.done and whole.done_reason == "stop" and whole.message.role == "assistant"
    assert whole.prompt_eval_count == len(tokenizer.apply_chat_template(user(SORT), tokenize=True))
    assert 0 < whole.eval_count <= 64
    chunks = list(ollama_chat(ollama_client, stream=True))
    assert "".join(c.message.content for c in chunks) == ANSWER
    assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].eval_count == whole.eval_count


def test_ollama_generate_through_the_chat_template_and_raw(ollama_client, demo):
    _, tokenizer = demo
    reply = ollama_client.generate(model=MODEL_ID, prompt=SORT, options={"seed": 3, "num_predict": 64})
    assert reply.response == ANSWER and reply.done_reason == "stop"
    streamed = "".join(
        c.response
        for c in ollama_client.generate(
            model=MODEL_ID, prompt=SORT, options={"seed": 3, "num_predict": 64}, stream=True
        )
    )
    assert streamed == ANSWER
    raw = tokenizer.apply_chat_template(user(SORT), tokenize=False)
    assert ollama_client.generate(model=MODEL_ID, prompt=raw, raw=True, options={"seed": 3}).response == ANSWER
    # Nothing to generate: Ollama's way of loading the model.
    assert ollama_client.generate(model=MODEL_ID).done_reason == "load"


def test_ollama_format_schema_and_json(ollama_client):
    reply = ollama_chat(ollama_client, "json: name=ada age=36", seed=2, format=PERSON)
    assert json.loads(reply.message.content) == {"name": "ada", "age": 36}
    for text in ("json: name=bo age=7", "sort: 5 3 9"):
        jsonschema.validate(json.loads(ollama_chat(ollama_client, text, seed=2, format=PERSON).message.content), PERSON)
        assert isinstance(json.loads(ollama_chat(ollama_client, text, seed=2, format="json").message.content), dict)


def test_ollama_takes_an_editors_stop_strings(ollama_client):
    stop = [" 42", "<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<|endoftext|>", "\n\n", "```", "</code>"]
    assert ollama_chat(ollama_client, options={"stop": stop}).message.content == ANSWER[: ANSWER.index(" 42")]


def test_ollama_takes_sixteen_long_stop_strings(ollama_client):
    """Sixteen stop strings of 3,000 characters (each read once per character of the answer): none
    occurs, and the answer is whole; the last one occurs, and it ends the answer, streamed or not."""
    stop = ["7" * 2999 + chr(ord("a") + i) for i in range(15)]
    assert ollama_chat(ollama_client, options={"stop": stop + ["9" * 3000]}).message.content == ANSWER
    cut = ANSWER[: ANSWER.index(" 42")]
    assert ollama_chat(ollama_client, options={"stop": stop + [" 42"]}).message.content == cut
    chunks = ollama_chat(ollama_client, options={"stop": stop + [" 42"]}, stream=True)
    assert "".join(c.message.content for c in chunks) == cut


def test_ollama_tool_call(ollama_client):
    for stream in (False, True):
        reply = ollama_chat(
            ollama_client, "weather in oslo", seed=0, tools=[WEATHER], options={"template": CALL}, stream=stream
        )
        chunks = list(reply) if stream else [reply]
        assert "".join(c.message.content for c in chunks) == "Sure. "
        (call,) = [call for c in chunks for call in c.message.tool_calls or []]
        assert call.function.name == "get_weather" and call.function.arguments["days"] == 3
        assert isinstance(call.function.arguments["city"], str)
    # Each call has an id (the ollama client's model leaves it out; Ollama's API has it).
    raw = ollama_client._client.post(
        "/api/chat",
        json={
            "model": MODEL_ID,
            "messages": user("weather in oslo"),
            "tools": [WEATHER],
            "stream": False,
            "options": {"seed": 0, "template": CALL},
        },
    ).json()
    (call,) = raw["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["function"]["index"] == 0


def test_ollama_errors(ollama_client):
    for kwargs, status, message in [
        ({"model": "llama3"}, 404, "the model \"llama3\" does not exist; this server serves 'demo'"),
        ({"options": {"num_predict": 0}}, 400, "options.num_predict must be at least 1, got 0"),
        (
            {"options": {"temperature": 5}},
            400,
            "options.temperature must be 0 or a finite number from 0.0001 to 2, got 5",
        ),
        ({"options": {"stop": ["x"] * 17}}, 400, "options.stop must be a non-empty string or a list of at most 16"),
        ({"format": {"type": "string", "not": {"pattern": "[a-z]+"}}}, 400, '"not"'),
        ({"messages": user("sort: 1 2 " * (CONTEXT // 8))}, 400, "does not fit the model's context"),
    ]:
        with pytest.raises(ollama.ResponseError) as caught:
            ollama_client.chat(**{"model": MODEL_ID, "messages": user(SORT), **kwargs})
        assert caught.value.status_code == status and message in caught.value.error, caught.value.error
    assert ollama_chat(ollama_client).message.content == ANSWER  # still serving


# -- OpenAI Responses ---------------------------------------------------------------------------------


def respond(client, prompt=SORT, seed=3, **kwargs):
    return client.responses.create(
        **{"model": MODEL_ID, "input": prompt, "max_output_tokens": 64, "extra_body": {"seed": seed}, **kwargs}
    )


def test_responses_streamed_equals_whole_and_generate(openai_client, demo):
    model, tokenizer = demo
    whole = respond(openai_client)
    assert whole.output_text == ANSWER and whole.status == "completed"
    assert whole.usage.input_tokens == len(tokenizer.apply_chat_template(user(SORT), tokenize=True))
    events = list(respond(openai_client, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    assert events[-1].response.output_text == ANSWER
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # Items and instructions go through the chat template as messages do.
    items = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "input_text", "text": SORT}]},
    ]
    expected = generate(model, tokenizer, SORT, max_tokens=64, seed=3, system_prompt="be brief")
    assert respond(openai_client, items[1:], instructions="be brief").output_text == expected
    assert respond(openai_client, items).output_text == expected


def test_responses_max_output_tokens_is_incomplete(openai_client):
    reply = respond(openai_client, "sort: 93 12 55 71 38 64 20 89 47 5 77 31", seed=0, max_output_tokens=3)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 3


def test_responses_json_schema(openai_client):
    text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON}}
    assert json.loads(respond(openai_client, "json: name=ada age=36", seed=2, text=text).output_text) == {
        "name": "ada",
        "age": 36,
    }
    jsonschema.validate(json.loads(respond(openai_client, "sort: 5 3 9", seed=2, text=text).output_text), PERSON)


def test_responses_function_call(openai_client):
    forced = {"type": "function", "name": "get_weather"}
    whole = respond(openai_client, "weather in paris for 3 days", seed=0, tools=[RESPONSES_WEATHER], tool_choice=forced)
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    events = list(
        respond(
            openai_client,
            "weather in paris for 3 days",
            seed=0,
            tools=[RESPONSES_WEATHER],
            tool_choice=forced,
            stream=True,
        )
    )
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments and events[-1].response.output[0].arguments == call.arguments
    # The call's result goes back as items.
    history = [
        {"role": "user", "content": "weather in paris for 3 days"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    assert respond(openai_client, history, seed=0).status == "completed"


def test_responses_errors(openai_client):
    for kwargs, error, param, message in [
        ({"model": "gpt-4o"}, openai.NotFoundError, "model", "does not exist"),
        ({"max_output_tokens": 0}, openai.BadRequestError, "max_output_tokens", "max_output_tokens must be at least 1"),
        (
            {
                "text": {
                    "format": {"type": "json_schema", "name": "x", "schema": {"type": "string", "not": {"const": "a"}}}
                }
            },
            openai.BadRequestError,
            "text.format",
            '"not"',
        ),
        ({"previous_response_id": "resp_1"}, openai.BadRequestError, "previous_response_id", "stores no responses"),
        ({"tools": [{"type": "web_search"}]}, openai.BadRequestError, "tools", "each tool must be"),
        (
            {"input": [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "input_file"}]}]},
            openai.BadRequestError,
            "input",
            "input[1]: content of type input_file is not supported",
        ),
    ]:
        with pytest.raises(error) as caught:
            openai_client.responses.create(**{"model": MODEL_ID, "input": SORT, "instructions": "x", **kwargs})
        body = caught.value.body
        assert body["param"] == param and message in body["message"], body
        assert body["type"] == "invalid_request_error"


# -- Anthropic Messages -------------------------------------------------------------------------------


def message(client, text=SORT, seed=3, **kwargs):
    return client.messages.create(
        **{"model": MODEL_ID, "messages": user(text), "max_tokens": 64, "extra_body": {"seed": seed}, **kwargs}
    )


def test_messages_streamed_equals_whole_and_generate(anthropic_client, demo):
    model, tokenizer = demo
    whole = message(anthropic_client)
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text == ANSWER
    assert whole.stop_reason == "end_turn" and whole.role == "assistant"
    prompt = len(tokenizer.apply_chat_template(user(SORT), tokenize=True))
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == prompt
    with anthropic_client.messages.stream(
        model=MODEL_ID, messages=user(SORT), max_tokens=64, extra_body={"seed": 3}
    ) as stream:
        assert "".join(stream.text_stream) == ANSWER
        final = stream.get_final_message()
    assert final.content[0].text == ANSWER and final.usage.output_tokens == whole.usage.output_tokens
    expected = generate(model, tokenizer, SORT, max_tokens=64, seed=3, system_prompt="be brief")
    system = [{"type": "text", "text": "be brief"}]
    assert message(anthropic_client, system=system).content[0].text == expected
    blocks = [{"type": "text", "text": SORT}]
    assert message(anthropic_client, blocks, system="be brief").content[0].text == expected


def test_messages_stop_sequences_and_max_tokens(anthropic_client):
    cut = message(anthropic_client, stop_sequences=[" 42"])
    assert cut.content[0].text == ANSWER[: ANSWER.index(" 42")]
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == " 42"
    short = message(anthropic_client, "sort: 93 12 55 71 38 64 20 89 47 5 77 31", seed=0, max_tokens=3)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_messages_json_schema_through_a_forced_tool(anthropic_client):
    # Anthropic's way to structured output: a tool whose input schema is the answer's.
    person = {"name": "person", "input_schema": PERSON}
    reply = message(
        anthropic_client,
        "json: name=ada age=36",
        seed=2,
        tools=[person],
        tool_choice={"type": "tool", "name": "person"},
    )
    (block,) = reply.content
    assert block.type == "tool_use" and reply.stop_reason == "tool_use"
    jsonschema.validate(block.input, PERSON)


def test_messages_tool_use(anthropic_client):
    kwargs = dict(tools=[ANTHROPIC_WEATHER], tool_choice={"type": "any"})
    whole = message(anthropic_client, "weather in paris for 3 days", seed=0, **kwargs)
    (block,) = whole.content
    assert block.type == "tool_use" and block.name == "get_weather" and whole.stop_reason == "tool_use"
    jsonschema.validate(block.input, WEATHER["function"]["parameters"])
    with anthropic_client.messages.stream(
        model=MODEL_ID, messages=user("weather in paris for 3 days"), max_tokens=64, extra_body={"seed": 0}, **kwargs
    ) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", block.input)]
    assert final.stop_reason == "tool_use"
    # A call in the answer's own text is parsed too; its result goes back as a tool_result block.
    parsed = message(
        anthropic_client, "weather in oslo", seed=0, tools=[ANTHROPIC_WEATHER], extra_body={"seed": 0, "template": CALL}
    )
    assert [b.type for b in parsed.content] == ["text", "tool_use"] and parsed.content[0].text == "Sure. "
    history = user("weather in oslo") + [
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": block.id, "name": block.name, "input": block.input}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "sunny"}]},
    ]
    assert anthropic_client.messages.create(model=MODEL_ID, messages=history, max_tokens=8).stop_reason


def test_messages_errors(anthropic_client):
    for kwargs, error, message_part in [
        ({"model": "claude-sonnet-4"}, anthropic.NotFoundError, "does not exist"),
        ({"max_tokens": 0}, anthropic.BadRequestError, "max_tokens must be at least 1"),
        ({"stop_sequences": ["a"] * 17}, anthropic.BadRequestError, "stop_sequences must be"),
        ({"extra_body": {"top_k": -1}}, anthropic.BadRequestError, "top_k must be at least 0, got -1"),
        (
            {"messages": user("hi") + [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            anthropic.BadRequestError,
            "messages[1]: content of type document is not supported",
        ),
    ]:
        with pytest.raises(error) as caught:
            anthropic_client.messages.create(
                **{"model": MODEL_ID, "messages": user(SORT), "max_tokens": 8, "system": "x", **kwargs}
            )
        body = caught.value.body
        assert body["type"] == "error" and message_part in body["error"]["message"], body
        assert body["error"]["type"] == (
            "not_found_error" if error is anthropic.NotFoundError else "invalid_request_error"
        )


def test_messages_count_tokens(anthropic_client, demo):
    _, tokenizer = demo
    system, history = "be brief", user(SORT) + [{"role": "assistant", "content": ANSWER}] + user("reverse: kayak")
    counted = anthropic_client.messages.count_tokens(model=MODEL_ID, system=system, messages=history)
    prompt = tokenizer.apply_chat_template([{"role": "system", "content": system}] + history, tokenize=True)
    assert counted.input_tokens == len(prompt)
    answered = message(anthropic_client, system=system, messages=history)
    assert answered.usage.input_tokens + answered.usage.cache_read_input_tokens == counted.input_tokens
    with pytest.raises(anthropic.NotFoundError) as caught:
        anthropic_client.messages.count_tokens(model="claude-sonnet-4", messages=user(SORT))
    assert caught.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_client.messages.count_tokens(model=MODEL_ID, messages=[])
    assert caught.value.body["error"]["message"] == "messages must be a non-empty list"


def test_messages_stream_usage_first_agrees_with_last(anthropic_client):
    for _ in range(2):  # the second time the prompt cache holds all but the prompt's last token
        with anthropic_client.messages.stream(
            model=MODEL_ID, messages=user(SORT), max_tokens=64, extra_body={"seed": 3}
        ) as stream:
            events = list(stream)
        first = next(e for e in events if e.type == "message_start").message.usage
        last = next(e for e in events if e.type == "message_delta").usage
        assert (first.input_tokens, first.cache_read_input_tokens) == (last.input_tokens, last.cache_read_input_tokens)
        assert first.output_tokens == 0 < last.output_tokens
    assert last.cache_read_input_tokens > 0


def test_an_answer_padded_to_the_limit_is_whole_in_every_api(demo, ollama_client, openai_client, anthropic_client):
    """Greedy AR on the demo writes this answer, then padding up to max_tokens: the engine's
    finish is "length" (max_tokens tokens), but the answer is whole, and the APIs count no padding."""
    model, tokenizer = demo
    text, limit, options = "What is the capital of France?", 32, {"policy": "ar", "seed": 0}
    responses = list(stream_generate(model, tokenizer, text, limit, **options))
    tokens = [t for r in responses for t in r.tokens]
    assert responses[-1].finish_reason == "length" and len(tokens) == limit and tokens[-1] == tokenizer.pad_token_id
    answer_tokens = sum(t != tokenizer.pad_token_id for t in tokens)
    answer = "".join(r.text for r in responses)
    chat = openai_client.chat.completions.create(
        model=MODEL_ID, messages=user(text), max_tokens=limit, extra_body=options
    )
    assert (chat.choices[0].message.content, chat.choices[0].finish_reason) == (answer, "stop")
    assert chat.usage.completion_tokens == answer_tokens < limit
    response = respond(openai_client, text, max_output_tokens=limit, extra_body=options)
    assert (response.output_text, response.status, response.usage.output_tokens) == (answer, "completed", answer_tokens)
    reply = message(anthropic_client, text, max_tokens=limit, extra_body=options)
    assert (reply.stop_reason, reply.usage.output_tokens) == ("end_turn", answer_tokens)
    ollama = ollama_chat(ollama_client, text, options={"num_predict": limit, **options})
    assert (ollama.done_reason, ollama.eval_count) == ("stop", answer_tokens)
    # Cut by the limit, it is "length", and all max_tokens tokens are counted.
    cut = openai_client.chat.completions.create(model=MODEL_ID, messages=user(text), max_tokens=3, extra_body=options)
    assert (cut.choices[0].finish_reason, cut.usage.completion_tokens) == ("length", 3)


def test_unknown_routes_answer_in_their_apis_error_shape(server):
    def get(path):
        try:
            with urllib.request.urlopen(server + path, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    assert get("/api/pull") == (404, {"error": "no route GET /api/pull"})
    assert get("/api/chat") == (405, {"error": "/api/chat does not take GET; send POST"})
    assert get("/v1/messages/batches") == (
        404,
        {"type": "error", "error": {"type": "not_found_error", "message": "no route GET /v1/messages/batches"}},
    )
    assert get("/v1/messages") == (
        405,
        {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": "/v1/messages does not take GET; send POST"},
        },
    )
    status, body = get("/v1/audio/speech")
    assert status == 404 and body["error"]["message"] == "no route GET /v1/audio/speech"
    status, body = get("/v1/embeddings")
    assert status == 405 and body["error"]["message"] == "/v1/embeddings does not take GET; send POST"


@pytest.mark.parametrize(
    "path, shape",
    [
        ("/api/chat", lambda body: body["error"]),
        ("/api/generate", lambda body: body["error"]),
        ("/v1/responses", lambda body: body["error"]["message"]),
        ("/v1/messages", lambda body: body["type"] == "error" and body["error"]["message"]),
    ],
)
def test_malformed_and_oversized_bodies_in_each_shape(server, path, shape):
    status, body = raw_post(server, path, b'{"model": "demo", "messages": [')
    assert status == 400 and "not valid JSON" in shape(body), body
    status, body = raw_post(server, path, json.dumps({"prompt": "x" * MAX_BODY}).encode())
    assert status == 413 and shape(body).endswith(
        f"over the server's limit of {MAX_BODY} bytes; send less, or start the server with a larger --max-request-bytes"
    ), body
    if path == "/v1/messages":
        assert body["error"]["type"] == "request_too_large"


# -- infill through suffix ----------------------------------------------------------------------------


@pytest.mark.parametrize("suffix, max_fill", [(" 85", 8), (" 61 85", 40)])  # one canvas; a fill over two
def test_suffix_fills_the_middle_as_infill_does(ollama_client, openai_client, demo, suffix, max_fill):
    model, tokenizer = demo
    expected = infill(model, tokenizer, PREFIX, suffix, max_fill=max_fill, seed=1)
    assert suffix not in expected
    completion = openai_client.completions.create(
        model=MODEL_ID, prompt=PREFIX, suffix=suffix, max_tokens=max_fill, seed=1
    )
    assert completion.choices[0].text == expected
    streamed = openai_client.completions.create(
        model=MODEL_ID, prompt=PREFIX, suffix=suffix, max_tokens=max_fill, seed=1, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == expected
    options = {"seed": 1, "num_predict": max_fill}
    assert ollama_client.generate(model=MODEL_ID, prompt=PREFIX, suffix=suffix, options=options).response == expected
    assert (
        "".join(
            c.response
            for c in ollama_client.generate(model=MODEL_ID, prompt=PREFIX, suffix=suffix, options=options, stream=True)
        )
        == expected
    )


def test_suffix_errors(openai_client, ollama_client):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.completions.create(model=MODEL_ID, prompt=PREFIX, suffix=" 85", max_tokens=CONTEXT)
    assert caught.value.body["param"] == "max_tokens" and caught.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.completions.create(model=MODEL_ID, prompt=PREFIX, suffix=" 85" * CONTEXT)
    assert caught.value.body["param"] == "suffix" and caught.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.completions.create(
            model=MODEL_ID, prompt=PREFIX, suffix=" 85", extra_body={"response_format": {"type": "json_object"}}
        )
    assert caught.value.body["param"] == "suffix"
    with pytest.raises(ollama.ResponseError, match="leave out suffix and raw"):
        ollama_client.generate(model=MODEL_ID, prompt=PREFIX, suffix=" 85", images=[b"\x89PNG"])


# -- all four at once ---------------------------------------------------------------------------------


def test_a_mix_of_the_four_apis_is_answered_as_each_alone(ollama_client, openai_client, anthropic_client, server):
    asks = [
        lambda: ollama_chat(ollama_client, "reverse: kayak7", seed=1).message.content,
        lambda: respond(openai_client, "add: 17 + 25", seed=2).output_text,
        lambda: message(anthropic_client, "sort: 9 71 33 48", seed=3).content[0].text,
        lambda: (
            openai_client.chat.completions.create(
                model=MODEL_ID, messages=user("json: name=li age=7"), seed=4, max_tokens=64
            )
            .choices[0]
            .message.content
        ),
        lambda: (
            ollama_client.generate(
                model=MODEL_ID, prompt=PREFIX, suffix=" 85", options={"seed": 5, "num_predict": 8}
            ).response
        ),
        lambda: (
            openai_client.completions.create(model=MODEL_ID, prompt=PREFIX, suffix=" 61 85", max_tokens=8, seed=6)
            .choices[0]
            .text
        ),
        lambda: (
            respond(
                openai_client,
                "json: name=ada age=36",
                seed=7,
                text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}},
            ).output_text
        ),
        lambda: message(anthropic_client, "reverse: hello", seed=8).content[0].text,
    ]
    start = health(server)["rounds"]
    alone = [ask() for ask in asks]
    middle = health(server)["rounds"]
    with ThreadPoolExecutor(len(asks)) as pool:
        together = [f.result(timeout=60) for f in [pool.submit(ask) for ask in asks]]
    assert together == alone
    assert health(server)["rounds"] - middle < middle - start  # their canvases shared the engine's rounds


# -- images on a checkpoint with a vision tower ---------------------------------------------------------


@pytest.fixture(scope="module")
def vision_server(vision_model):  # noqa: F811 (the fixture imported above)
    with serving(*vision_model, model_id="vision") as url:
        yield url


def png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def test_an_image_through_each_api_is_answered_as_generate_answers_it(vision_server, vision_model):  # noqa: F811
    model, tokenizer = vision_model
    expected = generate(model, tokenizer, PROMPT, max_tokens=2 * C, seed=5, images=[PICTURES[0]])
    picture = png(PICTURES[0])
    encoded = base64.b64encode(picture).decode()
    client = ollama.Client(host=vision_server, timeout=60)
    options = {"seed": 5, "num_predict": 2 * C}
    assert "vision" in client.show("vision").capabilities
    chat = client.chat(
        model="vision", messages=[{"role": "user", "content": PROMPT, "images": [picture]}], options=options
    )
    assert chat.message.content == expected
    assert client.generate(model="vision", prompt=PROMPT, images=[encoded], options=options).response == expected
    with pytest.raises(ollama.ResponseError, match="images: the image data is not an image Pillow can read"):
        client.generate(model="vision", prompt=PROMPT, images=["aGVsbG8="])
    responses = openai.OpenAI(base_url=vision_server + "/v1", api_key="none", max_retries=0)
    content = [
        {"type": "input_image", "image_url": "data:image/png;base64," + encoded},
        {"type": "input_text", "text": PROMPT},
    ]
    assert (
        responses.responses.create(
            model="vision",
            input=[{"role": "user", "content": content}],
            max_output_tokens=2 * C,
            extra_body={"seed": 5},
        ).output_text
        == expected
    )
    messages = anthropic.Anthropic(base_url=vision_server, api_key="none", max_retries=0)
    blocks = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": encoded}},
        {"type": "text", "text": PROMPT},
    ]
    reply = messages.messages.create(
        model="vision", messages=[{"role": "user", "content": blocks}], max_tokens=2 * C, extra_body={"seed": 5}
    )
    assert reply.content[0].text == expected
    with pytest.raises(anthropic.BadRequestError, match="not an image Pillow can read"):
        messages.messages.create(
            model="vision",
            max_tokens=8,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGVsbG8="}}
                    ],
                }
            ],
        )
