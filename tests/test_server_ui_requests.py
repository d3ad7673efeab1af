"""Requests shaped as chat UIs send them, against a real server (Open WebUI 0.12's, as measured in a browser
by examples/open_webui.sh): dozens of tools with every chat to a template that renders none, background
prompts of 1,000-1,600 tokens, Ollama's ``num_predict`` past what the context holds; and the server's
request log, which that script reads."""

import copy
import json
import logging
import time

import ollama
import openai
import pytest

from mlx_dgemma.server.request_log import ITEMS_SHOWN, TEXT_SHOWN, outline

from .test_server import CONTEXT, MODEL_ID, SORT, serving, short_context  # noqa: F401 (fixtures)

ANSWER = "17 23 42 61 85"  # the demo's answer to SORT at seed 3
# A template that writes the request's tools before the conversation (as tool-trained checkpoints' do).
TOOLS_FIRST = "{%- if tools %}{{ tools | tojson }}{% endif %}"
# A template that writes every message ten times: its prompt is ten times the messages' text.
TENFOLD = "{%- for message in messages %}{{ message['content'] * 10 }}{% endfor %}"


def tool(i: int, description: str = "x") -> dict:
    return {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "what to look up"}},
            },
        },
    }


def user(text):
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def demo_server(demo):
    with serving(*demo) as url:  # the default limits: a 32 MiB body
        yield url


def with_template(tokenizer, template: str):
    twin = copy.copy(tokenizer)
    twin.chat_template = template + tokenizer.chat_template
    return twin


def max_text_chars(model, tokenizer) -> int:
    """The server's bound on a request's text: the context times the vocabulary's longest token."""
    return CONTEXT * max(len(tokenizer.piece(i)) for i in range(model.config.vocab_size))


def near_the_end(tokenizer, context: int, left: int) -> tuple[str, int]:
    """Text (no chat template) whose tokens leave about ``left`` positions of ``context``, and their count."""
    unit = "sort: 3 1 2 "
    text = unit * ((context - left - 1) // len(tokenizer.encode(unit, add_special_tokens=False)))
    return text, len(tokenizer.encode(text))


def test_tools_a_template_does_not_render_count_for_nothing(demo_server, demo):
    model, tokenizer = demo
    client = ollama.Client(host=demo_server, timeout=60)
    assert "tools" not in client.show(MODEL_ID).capabilities  # the demo's template writes no tools
    # More tool text than the whole context could hold, were it rendered: the model never sees it.
    many = [tool(i, "d" * 2000) for i in range(max_text_chars(model, tokenizer) // 2000 + 1)]
    alone = client.chat(model=MODEL_ID, messages=user(SORT), options={"seed": 3})
    with_tools = client.chat(model=MODEL_ID, messages=user(SORT), tools=many, options={"seed": 3})
    assert with_tools.message.content == alone.message.content == ANSWER
    assert (
        with_tools.prompt_eval_count
        == alone.prompt_eval_count
        == len(tokenizer.apply_chat_template(user(SORT), tokenize=True))
    )


def test_tools_a_template_renders_count_and_are_refused_before_rendering(demo):
    model, tokenizer = demo
    twin = with_template(tokenizer, TOOLS_FIRST)
    with serving(model, twin) as url:
        client = ollama.Client(host=url, timeout=60)
        assert {"completion", "insert", "tools"} <= set(client.show(MODEL_ID).capabilities)
        small = client.chat(model=MODEL_ID, messages=user(SORT), tools=[tool(0)], options={"seed": 3})
        expected = twin.apply_chat_template(user(SORT), tokenize=True, tools=[tool(0)])
        assert small.prompt_eval_count == len(expected) > len(tokenizer.apply_chat_template(user(SORT), tokenize=True))
        many = [tool(i, "d" * 2000) for i in range(max_text_chars(model, tokenizer) // 2000 + 1)]
        start = time.monotonic()
        with pytest.raises(ollama.ResponseError) as caught:
            client.chat(model=MODEL_ID, messages=user(SORT), tools=many)
        assert time.monotonic() - start < 5
        assert caught.value.status_code == 400 and caught.value.error.startswith(
            "the text of the messages and tools is "
        ), caught.value.error


def test_a_prompt_the_template_makes_too_long_is_refused_before_tokenizing(demo):
    model, tokenizer = demo
    limit = max_text_chars(model, tokenizer)
    with serving(model, with_template(tokenizer, TENFOLD)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as caught:  # a fifth of the limit, rendered ten times
            client.chat.completions.create(model=MODEL_ID, messages=user("s" * (limit // 5)))
    error = caught.value.body
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded"
    assert (
        error["message"].startswith("the prompt the chat template renders is ")
        and f"(at most {limit})" in error["message"]
    )


def test_background_prompts_of_a_chat_ui_fit_the_demo(demo_server):
    """Open WebUI's title prompt is ~1,100 tokens of the demo's and its follow-up prompt ~1,500 after
    two turns (the title asks num_predict 1000): the demo's context holds them with room to spare."""
    client = ollama.Client(host=demo_server, timeout=120)
    prompt = "### Task:\nwrite a title\n" + "USER: sort: 42 17 85 23 61\n" * 60
    reply = client.chat(model=MODEL_ID, messages=user(prompt), options={"num_predict": 64, "seed": 0})
    assert reply.done and reply.prompt_eval_count > 1600 and 0 < reply.eval_count <= 64
    assert reply.prompt_eval_count + 1000 < CONTEXT


def test_ollama_num_predict_is_a_cap_and_openai_max_tokens_a_promise(demo_server, demo, short_context):  # noqa: F811
    model, tokenizer = demo
    client = ollama.Client(host=demo_server, timeout=60)
    prompt_tokens = len(tokenizer.apply_chat_template(user(SORT), tokenize=True))
    room = (CONTEXT - prompt_tokens) // 32 * 32
    for num_predict in (room + 1, 10 * CONTEXT):  # Ollama answers, as it does past its num_ctx
        reply = client.chat(model=MODEL_ID, messages=user(SORT), options={"seed": 3, "num_predict": num_predict})
        assert reply.message.content == ANSWER and reply.done_reason == "stop"
    with serving(*short_context) as short:  # a prompt that nearly fills a 1024-token context: cut to the rest
        near = ollama.Client(host=short, timeout=60)
        text, tokens = near_the_end(tokenizer, 1024, 40)  # one 32-token canvas left
        cut = near.generate(model=MODEL_ID, prompt=text, raw=True, options={"seed": 0, "num_predict": 10 * CONTEXT})
        assert cut.done and cut.prompt_eval_count == tokens and 0 < cut.eval_count <= (1024 - tokens) // 32 * 32
        # An infill's hole is generated whole, num_predict positions: past the room it is refused, not cut.
        with pytest.raises(ollama.ResponseError) as caught:
            near.generate(model=MODEL_ID, prompt=text, suffix=" 85", options={"seed": 1, "num_predict": 10 * CONTEXT})
        assert caught.value.status_code == 400 and "options.num_predict is" in caught.value.error
        hole = int(caught.value.error.split("room for at most ")[1].split()[0])
        middle = near.generate(model=MODEL_ID, prompt=text, suffix=" 85", options={"seed": 1, "num_predict": hole})
        assert middle.done and middle.response and " 85" not in middle.response
    openai_client = openai.OpenAI(base_url=demo_server + "/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(model=MODEL_ID, messages=user(SORT), max_tokens=room + 1)
    assert caught.value.body["code"] == "context_length_exceeded" and caught.value.body["param"] == "max_tokens"
    assert caught.value.body["message"].endswith(f"ask for at most {room}")


def test_the_log_outlines_each_request_and_gives_each_refusal_its_reason(demo_server, caplog):
    caplog.set_level(logging.DEBUG, logger="mlx_dgemma.server")
    client = ollama.Client(host=demo_server, timeout=60)
    client.chat(model=MODEL_ID, messages=user(SORT), tools=[tool(i) for i in range(36)], options={"seed": 3})
    with pytest.raises(ollama.ResponseError):
        client.chat(model=MODEL_ID, messages=user(SORT), options={"temperature": 5})
    lines = [r.getMessage() for r in caplog.records if r.name == "mlx_dgemma.server"]
    arrived = [line for line in lines if " /api/chat {" in line]
    assert len(arrived) == 2
    number, path, body = arrived[0].split(" ", 2)
    assert path == "/api/chat" and json.loads(body)["tools"] == "(36 items)"
    assert json.loads(body)["messages"] == user(SORT) and json.loads(body)["options"] == {"seed": 3}
    second = arrived[1].split(" ")[0]
    # The field behind the refusal, as the client named it.
    assert (
        f"{second} /api/chat refused with 400 (options.temperature): options.temperature must be 0 or a "
        "finite number from 0.0001 to 2, got 5"
    ) in lines
    assert int(second[1:]) == int(number[1:]) + 1


def test_outline_cuts_long_text_and_counts_long_lists():
    body = {
        "messages": [{"role": "user", "content": "a" * 1000}],
        "tools": list(range(ITEMS_SHOWN + 1)),
        "stop": ["x"] * ITEMS_SHOWN,
        "deep": [[[[[[[["bottom"]]]]]]]],
    }
    shown = outline(body)
    assert shown["messages"][0]["content"] == "a" * TEXT_SHOWN + "… (1000 characters)"
    assert shown["tools"] == f"({ITEMS_SHOWN + 1} items)" and shown["stop"] == ["x"] * ITEMS_SHOWN
    assert shown["deep"] == [[[[["…"]]]]]  # six levels shown, then the rest left out
