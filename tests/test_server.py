"""The OpenAI-compatible server on loopback, driven by the official ``openai`` client: a real uvicorn
server on a free port serving the bundled demo model."""

import base64
import contextlib
import copy
import io
import json
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import uvicorn
from PIL import Image

from mlx_dgemma import generate, load
from mlx_dgemma.engine.batch import BatchGenerator
from mlx_dgemma.engine.policy import PLANNERS
from mlx_dgemma.generate import DEMO_MODEL
from mlx_dgemma.server import Limits, Scheduler, Server, create_app
from mlx_dgemma.server.routes import ALLOWED_ORIGINS

MODEL_ID = "demo"
SORT = "sort: 42 17 85 23 61"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 999},
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "required": ["city", "days"],
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
        },
    },
}
MAX_BODY = 64 * 1024
CONTEXT = json.loads((DEMO_MODEL / "config.json").read_text())["text_config"]["max_position_embeddings"]


@pytest.fixture(scope="module")
def short_context(tmp_path_factory):
    """The demo with a context of 1024 (the same weights): a prompt that fills it encodes in a second."""
    folder = tmp_path_factory.mktemp("demo-1024") / "demo"
    shutil.copytree(DEMO_MODEL, folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 1024
    (folder / "config.json").write_text(json.dumps(config))
    return load(folder)


@contextlib.contextmanager
def serving(
    model,
    tokenizer,
    model_id: str = MODEL_ID,
    allowed_origins=ALLOWED_ORIGINS,
    log_level: str = "warning",
    statuses: list | None = None,
    engine=BatchGenerator,
    **server_options,
):
    """A real uvicorn server for ``model`` on a free loopback port: its base URL while it runs (``log_level``
    "info" logs every request's status to ``uvicorn.access``). Each answer's (path, status) is appended to
    ``statuses`` when given; ``engine`` makes the worker's engine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scheduler = Scheduler(model, tokenizer, prompt_cache_size=4, engine=engine)
    app = create_app(Server(model, tokenizer, model_id, scheduler, Limits(**server_options)), allowed_origins)
    if statuses is not None:
        app = recording(app, statuses)
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


def recording(app, statuses: list):
    """``app``, appending each answer's (path, status) to ``statuses``."""

    async def recorded(scope, receive, send):
        async def sent(message):
            if message["type"] == "http.response.start":
                statuses.append((scope["path"], message["status"]))
            await send(message)

        await app(scope, receive, sent if scope["type"] == "http" else send)

    return recorded


@pytest.fixture(scope="module")
def server(demo):
    with serving(*demo, max_request_bytes=MAX_BODY) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=60)


def chat(client, content, **kwargs):
    return client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": content}], **kwargs)


def raw_post(server, path, data: bytes):
    request = urllib.request.Request(server + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def health(server):
    with urllib.request.urlopen(server + "/health", timeout=10) as response:
        return json.loads(response.read())


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list()] == [MODEL_ID]
    assert health(server)["status"] == "ok"


def test_chat_streamed_equals_whole_and_generate(client, demo):
    model, tokenizer = demo
    whole = chat(client, SORT, seed=3, max_tokens=64)
    answer = whole.choices[0].message.content
    assert answer == "17 23 42 61 85"  # the demo model sorts this list right
    assert answer == generate(model, tokenizer, SORT, max_tokens=64, seed=3)  # the same draws in process
    assert whole.choices[0].finish_reason == "stop"
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": SORT}], tokenize=True)
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert 0 < whole.usage.completion_tokens <= 64

    chunks = list(chat(client, SORT, seed=3, max_tokens=64, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_streamed_equals_whole_and_chat(client, demo):
    _, tokenizer = demo
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "reverse: kayak7"}], tokenize=False
    )  # the chat's text
    whole = client.completions.create(model=MODEL_ID, prompt=prompt, seed=5, max_tokens=40)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model=MODEL_ID, prompt=prompt, seed=5, max_tokens=40, stream=True)
    )
    assert (
        whole.choices[0].text
        == streamed
        == chat(client, "reverse: kayak7", seed=5, max_tokens=40).choices[0].message.content
    )
    assert whole.object == "text_completion"


def test_max_tokens_cuts_the_answer(client):
    reply = chat(client, "sort: 93 12 55 71 38 64 20 89 47 5 77 31", seed=0, max_tokens=3)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 3
    assert len(reply.choices[0].message.content) <= 3  # one character a token on the demo


def test_stop_string_ends_the_answer(client):
    full = chat(client, SORT, seed=3).choices[0].message.content
    cut = chat(client, SORT, seed=3, stop=[" 42"])
    assert cut.choices[0].message.content == full[: full.index(" 42")]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, SORT, seed=3, stop=" 42", stream=True))
    assert streamed == cut.choices[0].message.content
    # A stop string across the first canvas's end (32 characters on the demo): its start, at the end
    # of the first chunk, is held back until the next canvas shows whether the stop follows.
    prompt = "json: name=ada age=36 city=oslo score=512"
    full = chat(client, prompt, seed=0).choices[0].message.content
    assert len(full) > 40
    stop = full[28:36]
    chunks = [c.choices[0].delta.content for c in chat(client, prompt, seed=0, stop=stop, stream=True)]
    assert "".join(c or "" for c in chunks) == full[: full.index(stop)]
    assert len([c for c in chunks if c]) == 1  # nothing of the first canvas's tail went out early


def test_multi_turn_reuses_the_prompt_cache(client, demo):
    model, tokenizer = demo
    first = [{"role": "user", "content": "sort: 8 31 64 2"}]
    reply = client.chat.completions.create(model=MODEL_ID, messages=first, seed=1)
    second = first + [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "reverse: abc"},
    ]
    again = client.chat.completions.create(model=MODEL_ID, messages=second, seed=1)
    first_ids = tokenizer.apply_chat_template(first, tokenize=True)
    second_ids = tokenizer.apply_chat_template(second, tokenize=True)
    assert second_ids[: len(first_ids)] == first_ids
    assert again.usage.prompt_tokens_details.cached_tokens == len(first_ids) - 1
    assert again.choices[0].message.content == generate(model, tokenizer, second_ids, seed=1)


def test_multi_turn_under_auto_reuses_the_prompt_cache(client, demo):
    """auto rows run in the engine with the others; their prompts go into the prompt cache too."""
    _, tokenizer = demo
    first = [{"role": "user", "content": "add: 12 75"}]
    reply = client.chat.completions.create(model=MODEL_ID, messages=first, seed=1, extra_body={"policy": "auto"})
    second = first + [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "sort: 4 1 3"},
    ]
    again = client.chat.completions.create(model=MODEL_ID, messages=second, seed=1, extra_body={"policy": "auto"})
    first_ids = tokenizer.apply_chat_template(first, tokenize=True)
    assert again.usage.prompt_tokens_details.cached_tokens == len(first_ids) - 1


def test_json_schema_reply_parses_and_validates(client):
    for prompt in ("json: name=ada age=36", "json: name=bo age=7", "sort: 5 3 9"):  # the last is not a json task
        reply = chat(
            client,
            prompt,
            seed=2,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        )
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    assert json.loads(
        chat(
            client,
            "json: name=ada age=36",
            seed=2,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        )
        .choices[0]
        .message.content
    ) == {"name": "ada", "age": 36}


def test_json_object_reply_is_an_object(client):
    for prompt in ("json: name=ada age=36", "sort: 5 3 9"):
        reply = chat(client, prompt, seed=2, response_format={"type": "json_object"})
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_forced_tool_call(client):
    reply = chat(
        client,
        "weather in paris for 3 days",
        seed=0,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    chunks = list(
        chat(client, "weather in paris for 3 days", seed=0, tools=[WEATHER], tool_choice="required", stream=True)
    )
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert [(t.index, t.function.name, t.function.arguments) for t in calls] == [
        (0, "get_weather", call.function.arguments)
    ]


def test_tool_call_in_the_answer_is_parsed(client):
    # A template writes Gemma 4's call syntax into the answer, as a tool-trained checkpoint does.
    template = 'Sure. <|tool_call>call:get_weather{city:<|"|>{{fill:6}}<|"|>,days:3}<tool_call|>'
    reply = chat(client, "weather in oslo", seed=0, tools=[WEATHER], extra_body={"template": template})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure. "
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and arguments["days"] == 3 and isinstance(arguments["city"], str)


def test_extra_body_policy_and_steps(client, demo):
    model, tokenizer = demo
    reply = chat(client, SORT, seed=4, extra_body={"policy": "ar"})
    assert reply.choices[0].message.content == generate(model, tokenizer, SORT, seed=4, policy="ar")
    reply = chat(client, SORT, seed=4, extra_body={"steps": 2})
    assert reply.choices[0].message.content == generate(model, tokenizer, SORT, seed=4, steps=2)


@pytest.mark.parametrize("policy", ["ar", "verified"])
def test_ar_and_verified_sample_at_the_requests_temperature(client, demo, policy):
    """``temperature`` reaches autoregressive and verified rows: seeds give different answers, and a
    seed gives what ``generate`` gives with that seed and temperature."""
    model, tokenizer = demo
    prompt = "add: 417 85"
    served, alone = [], []
    for seed in range(6):
        # verified drafts as long as the model's running acceptance estimate says, and every round
        # moves it: generate starts from the estimate the server's request started from
        estimate = PLANNERS.acceptance(model)
        before = copy.deepcopy(estimate)
        served.append(
            chat(client, prompt, seed=seed, temperature=1.5, max_tokens=32, extra_body={"policy": policy})
            .choices[0]
            .message.content
        )
        vars(estimate).update(vars(before))
        alone.append(generate(model, tokenizer, prompt, max_tokens=32, seed=seed, temperature=1.5, policy=policy))
    assert len(set(served)) > 1
    assert served == alone


@pytest.mark.parametrize(
    "kwargs, error, param",
    [
        ({"model": "gpt-4o"}, openai.NotFoundError, "model"),
        ({"max_tokens": -5}, openai.BadRequestError, "max_tokens"),
        ({"extra_body": {"policy": "warp"}}, openai.BadRequestError, "policy"),
        ({"temperature": 3}, openai.BadRequestError, "temperature"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"code": {"not": {"type": "string"}}}},
                    },
                }
            },
            openai.BadRequestError,
            "response_format",
        ),
        (
            {"messages": [{"role": "user", "content": "sort: 1 2 " * (CONTEXT // 8)}]},
            openai.BadRequestError,
            "messages",
        ),
    ],
)
def test_bad_requests_get_openai_errors(client, kwargs, error, param):
    request = {"model": MODEL_ID, "messages": [{"role": "user", "content": SORT}], **kwargs}
    with pytest.raises(error) as caught:
        client.chat.completions.create(**request)
    body = caught.value.body
    assert body["param"] == param and body["type"] == "invalid_request_error" and body["message"]
    if '"not"' in json.dumps(kwargs):  # the keyword no grammar enforces, named
        assert 'Unimplemented keys: ["not"]' in body["message"]
    if param == "messages":
        assert body["code"] == "context_length_exceeded"
    assert chat(client, SORT, seed=3).choices[0].message.content == "17 23 42 61 85"  # still serving


def test_content_the_demo_cannot_take_is_refused(client):
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    for payload, message in [
        ("aGVsbG8=", "messages[0]: the image data is not an image Pillow can read (PNG, JPEG, GIF, WebP, …)"),
        # The demo's chat template (its tiny vision tower is untrained) writes no image placeholders.
        (
            base64.b64encode(png.getvalue()).decode(),
            "the chat template wrote 0 image placeholders for 1 images "
            "(a template that takes no image parts, or drops them from some messages)",
        ),
    ]:
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + payload}}
        with pytest.raises(openai.BadRequestError) as caught:
            chat(client, [{"type": "text", "text": SORT}, image])
        assert caught.value.body["message"] == message
    with pytest.raises(openai.BadRequestError, match="content of type input_audio is not supported"):
        chat(client, [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}])


def test_a_refusal_by_the_worker_names_the_field(client, monkeypatch):
    """What the worker refuses (the engine's own checks of a prompt or template) names the field,
    whole and streamed."""
    from mlx_dgemma.errors import PromptError, TemplateError
    from mlx_dgemma.server import scheduler

    def refusing(model, tokenizer, resolved):
        raise (
            TemplateError("the template is refused")
            if resolved.args.template is not None
            else PromptError("the prompt is refused")
        )

    monkeypatch.setattr(scheduler, "plan", refusing)
    for request, param in [
        (lambda: chat(client, SORT, extra_body={"template": "{{fill:4}}"}), "template"),
        (lambda: chat(client, SORT), "messages"),
        (lambda: client.completions.create(model=MODEL_ID, prompt=SORT), "prompt"),
    ]:
        with pytest.raises(openai.BadRequestError) as caught:
            request()
        assert caught.value.body["param"] == param, caught.value.body
    stream = chat(client, SORT, stream=True)
    with pytest.raises(openai.APIError) as caught:
        list(stream)
    assert caught.value.body["param"] == "messages", caught.value.body


def test_malformed_and_oversized_bodies(server, client):
    status, body = raw_post(server, "/v1/chat/completions", b'{"model": "demo", "messages": [')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = raw_post(server, "/v1/completions", json.dumps({"prompt": "x" * MAX_BODY}).encode())
    assert status == 413 and body["error"]["code"] == "request_too_large"
    status, body = raw_post(server, "/v1/completions", b'["a list"]')
    assert status == 400
    assert chat(client, SORT, seed=3).choices[0].message.content == "17 23 42 61 85"


def test_disconnect_stops_the_compute(client, server):
    before = health(server)
    # 15 canvases of template holes: seconds of work that sends nothing until its last canvas.
    stream = chat(client, SORT, seed=0, stream=True, extra_body={"template": "{{fill:30}}, " * 15})
    next(iter(stream))  # the role chunk: the request is running
    stream.close()
    deadline = time.monotonic() + 10
    while (now := health(server))["cancelled"] == before["cancelled"]:
        assert time.monotonic() < deadline, "the request was not cancelled"
        time.sleep(0.05)
    assert now["active"] == 0
    time.sleep(0.3)
    after = health(server)
    assert after["rounds"] == now["rounds"]  # nothing runs for it any more
    assert after["rounds"] - before["rounds"] < 15 and after["finished"] == before["finished"]


def test_concurrent_clients_get_their_answers_served_alone(client, server):
    prompts = [
        SORT,
        "reverse: kayak7",
        "add: 17 + 25",
        "json: name=ada age=36",
        "sort: 9 71 33 48",
        "reverse: hello",
        "add: 305 + 96",
        "json: name=li age=7",
    ]
    start = health(server)["rounds"]
    alone = [chat(client, p, seed=i, max_tokens=64).choices[0].message.content for i, p in enumerate(prompts)]
    middle = health(server)["rounds"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(chat, client, p, seed=i, max_tokens=64) for i, p in enumerate(prompts)]
        together = [f.result(timeout=60).choices[0].message.content for f in futures]
    assert together == alone
    assert health(server)["rounds"] - middle < middle - start  # their canvases shared rounds
