"""Configurable reasoning: Gemma 4's thinking switch in the chat templates (the built-in one and the
demo's, against transformers' own renderer), ``think`` in the API and ``--think`` in the CLI, and each
API's reasoning field on the server (OpenAI chat's ``reasoning_effort``, Responses' ``reasoning``,
Anthropic's ``thinking``, Ollama's ``think``) driven by its official client, whole and streamed.

The demo was not trained to think, so the thought is laid out by a text template: a literal thought
channel, then a hole the model fills. What is tested is the protocol: the thought in each API's own
field, never in the answer, and none with thinking off."""

import copy
import json
import subprocess
import sys

import anthropic
import ollama
import openai
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from checkpoint_tools import train_demo
from mlx_dgemma import generate, stream_generate
from mlx_dgemma.engine.resolve import prompt_ids
from mlx_dgemma.errors import PromptError
from mlx_dgemma.structured.json_schema import json_template
from mlx_dgemma.tokenizer import BUILTIN_CHAT_TEMPLATE, TextStream

from .test_server import MODEL_ID, SORT, serving

THOUGHT = "the numbers, smallest first"
TEMPLATE = "<|channel>thought\n" + THOUGHT + "<channel|>sorted:{{fill:8}}"  # a thought, then the answer
NO_SWITCH = (
    "{{ bos_token }}{% for m in messages %}{{ '<|turn>' + m['role'] + '\n' }}{{ m['content'] | trim }}"
    "{{ '<turn|>\n' }}{% endfor %}{{ '<|turn>model\n<|channel>thought\n<channel|>' }}"
)  # no switch


@pytest.fixture(scope="module")
def server(demo):
    with serving(*demo) as url:
        yield url


@pytest.fixture(scope="module")
def openai_client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=60)


# -- the chat template ---------------------------------------------------------------------------------


@pytest.mark.parametrize("template", [BUILTIN_CHAT_TEMPLATE, train_demo.CHAT_TEMPLATE], ids=["builtin", "demo"])
def test_the_switch_renders_as_gemma4_and_as_transformers_renders_it(demo, template):
    """Gemma 4's convention: thinking on opens the system turn with <|think|> (a turn of its own when
    there is no system message) and leaves the model's turn open; off, the prompt ends with an empty
    thought channel. transformers renders the same template to the same text for enable_thinking."""
    tokenizer = copy.copy(demo[1])
    tokenizer.chat_template = template
    user = [{"role": "user", "content": " Solve it. "}]
    system = [{"role": "system", "content": " Be exact. "}] + user
    expected = {
        (False, False): "<bos><|turn>user\nSolve it.<turn|>\n<|turn>model\n<|channel>thought\n<channel|>",
        (True, False): "<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\nSolve it.<turn|>\n<|turn>model\n",
        (False, True): "<bos><|turn>system\nBe exact.<turn|>\n<|turn>user\nSolve it.<turn|>\n<|turn>model\n"
        "<|channel>thought\n<channel|>",
        (True, True): "<bos><|turn>system\n<|think|>\nBe exact.<turn|>\n<|turn>user\nSolve it.<turn|>\n<|turn>model\n",
    }
    for (think, with_system), text in expected.items():
        messages = system if with_system else user
        ours = tokenizer.apply_chat_template(messages, enable_thinking=think, tokenize=False)
        assert ours == text
        theirs = render_jinja_template(
            [messages], chat_template=template, add_generation_prompt=True, bos_token="<bos>", enable_thinking=think
        )[0][0]
        assert ours == theirs
    assert tokenizer.apply_chat_template(user, tokenize=False) == expected[False, False]  # off unless asked for
    assert tokenizer.renders_thinking


def test_thinking_off_renders_the_prompt_the_demo_was_trained_on(demo):
    _, tokenizer = demo
    ids = prompt_ids(tokenizer, SORT, "be brief")
    assert ids == tokenizer.encode(train_demo.render_prompt(SORT, "be brief"))
    on = prompt_ids(tokenizer, SORT, "be brief", think=True)
    channel = tokenizer.encode("<|channel>thought\n<channel|>", add_special_tokens=False)
    think = tokenizer.encode("<|think|>\n", add_special_tokens=False)
    turn = tokenizer.encode("<|turn>system\n", add_special_tokens=False)
    # on = off with <|think|> after the system turn's opening and without the empty thought channel
    assert on == ids[: 1 + len(turn)] + think + ids[1 + len(turn) : -len(channel)]


def test_a_template_without_the_switch_is_refused(demo):
    tokenizer = copy.copy(demo[1])
    tokenizer.chat_template = NO_SWITCH
    assert not tokenizer.renders_thinking
    with pytest.raises(PromptError, match="has no thinking switch"):
        prompt_ids(tokenizer, SORT, think=True)
    assert prompt_ids(tokenizer, [2, 5, 6], think=True) == [2, 5, 6]  # ids are taken as given


def test_the_thought_streams_apart_from_the_answer(demo):
    _, tokenizer = demo
    ids = tokenizer.encode("<|channel>thought\n" + THOUGHT + "<channel|>1 3 7 9<turn|>after", add_special_tokens=False)
    stop = {tokenizer.token_id("<turn|>")}
    answer, thought = TextStream(tokenizer, stop), TextStream(tokenizer, stop, thought=True)
    pieces = [(answer.add(ids[i : i + 3]), thought.add(ids[i : i + 3])) for i in range(0, len(ids), 3)]
    assert "".join(a for a, _ in pieces) == "1 3 7 9" and "".join(t for _, t in pieces) == THOUGHT
    assert pieces[0] == ("", "")  # "<|channel>thought\n" is the channel's name, no part of the thought
    # thought tokens: the channel, markers included, up to the stop id; padding is none of them
    assert tokenizer.thought_tokens([0] + ids, stop) == ids.index(tokenizer.token_id("<channel|>")) + 1


# -- the API and the CLI -------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["reference", "fast", "ar", "verified", "auto"])
def test_every_policy_hands_out_the_thought_apart(demo, policy):
    model, tokenizer = demo
    on = list(stream_generate(model, tokenizer, SORT, seed=0, think=True, template=TEMPLATE, policy=policy))
    assert "".join(r.thought for r in on) == THOUGHT
    answer = "".join(r.text for r in on)
    assert answer.startswith("sorted:") and THOUGHT not in answer and "<|channel>" not in answer
    free = list(stream_generate(model, tokenizer, SORT, seed=0, max_tokens=16, think=True, policy=policy))
    assert "<|channel>" not in "".join(r.text for r in free) and "thought" not in "".join(r.text for r in free)


def test_without_think_no_thought_and_with_a_json_template_a_refusal(demo):
    model, tokenizer = demo
    off = list(stream_generate(model, tokenizer, SORT, seed=0, template=TEMPLATE))
    assert all(r.thought == "" for r in off)
    answer = "".join(r.text for r in off)
    assert answer.startswith("sorted:") and THOUGHT not in answer and "<|channel>" not in answer
    schema = json_template(tokenizer, {"type": "object", "properties": {"a": {"type": "integer"}}})
    with pytest.raises(ValueError, match="JSON answer .* no room for a thought"):
        generate(model, tokenizer, SORT, think=True, template=schema)
    with pytest.raises(ValueError, match="JSON answer .* no room for a thought"):
        generate(model, tokenizer, SORT, think=True, schema={"type": "object"}, policy="ar")


def test_cli_think_writes_the_thought_to_stderr(tmp_path, demo):
    model, tokenizer = demo
    (tmp_path / "layout.txt").write_text(TEMPLATE + "\n")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_dgemma.generate",
            "--prompt",
            SORT,
            "--seed",
            "0",
            "--think",
            "--template",
            str(tmp_path / "layout.txt"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stderr == THOUGHT + "\n"  # its line ended before the answer
    assert run.stdout == generate(model, tokenizer, SORT, seed=0, think=True, template=TEMPLATE) + "\n"
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object"}))
    refused = subprocess.run(
        [sys.executable, "-m", "mlx_dgemma.generate", "--think", "--schema", str(schema)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr == (
        "Error: a schema lays the answer out from its first token and leaves no room for a "
        "thought; drop --think or --schema\n"
    )


# -- the server: each API's own fields -----------------------------------------------------------------


def expected_answer(demo, think=True):
    return generate(*demo, SORT, seed=0, think=think, template=TEMPLATE)


def chat(client, **kwargs):
    return client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": SORT}],
        seed=0,
        extra_body={"template": TEMPLATE, **kwargs.pop("extra_body", {})},
        **kwargs,
    )


def thought_tokens(demo):
    return len(demo[1].encode("<|channel>thought\n" + THOUGHT + "<channel|>", add_special_tokens=False))


def test_chat_reasoning_effort(openai_client, demo):
    reply = chat(openai_client, reasoning_effort="low")
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] == THOUGHT and message.content == expected_answer(demo)
    assert reply.usage.completion_tokens_details.reasoning_tokens == thought_tokens(demo)
    assert reply.usage.completion_tokens > thought_tokens(demo)
    chunks = list(chat(openai_client, reasoning_effort="high", stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == THOUGHT
    assert "".join(d.content or "" for d in deltas) == expected_answer(demo)
    same = chat(openai_client, extra_body={"reasoning": {"effort": "medium"}}).choices[0].message
    assert same.model_extra["reasoning_content"] == THOUGHT
    for off in [{}, {"reasoning_effort": "none"}, {"reasoning_effort": "minimal"}]:
        reply = chat(openai_client, **off)
        message = reply.choices[0].message
        assert "reasoning_content" not in message.model_extra and message.content == expected_answer(demo, False)
        assert reply.usage.completion_tokens_details.reasoning_tokens == 0
    chunks = list(chat(openai_client, stream=True, reasoning_effort="none"))
    assert not any(c.choices[0].delta.model_extra.get("reasoning_content") for c in chunks if c.choices)


@pytest.mark.parametrize("policy", ["ar", "verified"])
def test_chat_reasoning_under_a_policy_is_the_apis(openai_client, demo, policy):
    message = chat(openai_client, reasoning_effort="low", extra_body={"policy": policy}).choices[0].message
    assert message.model_extra["reasoning_content"] == THOUGHT
    assert message.content == generate(*demo, SORT, seed=0, think=True, template=TEMPLATE, policy=policy)


def test_responses_reasoning_items(openai_client, demo):
    def respond(**kwargs):
        return openai_client.responses.create(
            model=MODEL_ID, input=SORT, extra_body={"seed": 0, "template": TEMPLATE}, **kwargs
        )

    whole = respond(reasoning={"effort": "low"})
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert [c.text for c in whole.output[0].content] == [THOUGHT] and whole.output_text == expected_answer(demo)
    assert whole.usage.output_tokens_details.reasoning_tokens == thought_tokens(demo)
    events = list(respond(reasoning={"effort": "low"}, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
    ]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [(e.item.type, e.output_index) for e in done] == [("reasoning", 0), ("message", 1)]
    assert kinds.index("response.output_item.done") < kinds.index("response.output_text.delta")
    final = events[-1].response
    assert final.status == "completed" and final.output[0].content[0].text == THOUGHT
    assert final.output_text == whole.output_text
    for off in [{}, {"reasoning": {"effort": "none"}}]:
        assert [item.type for item in respond(**off).output] == ["message"]
        assert "response.reasoning_text.delta" not in [e.type for e in respond(**off, stream=True)]


def test_anthropic_thinking_blocks(server, demo):
    client = anthropic.Anthropic(base_url=server, api_key="none", max_retries=0, timeout=60)
    request = {
        "model": MODEL_ID,
        "max_tokens": 2048,
        "messages": [{"role": "user", "content": SORT}],
        "extra_body": {"seed": 0, "template": TEMPLATE},
    }
    thinking = {"type": "enabled", "budget_tokens": 1024}
    whole = client.messages.create(**request, thinking=thinking)
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == THOUGHT and whole.content[0].signature
    assert whole.content[1].text == expected_answer(demo)
    with client.messages.stream(**request, thinking=thinking) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert starts == ["thinking", "text"]
    assert deltas[0] == "thinking_delta" and deltas.index("signature_delta") < deltas.index("text_delta")
    assert final.content[0].thinking == THOUGHT and final.content[0].signature == whole.content[0].signature
    assert final.content[1].text == whole.content[1].text
    for off in [{}, {"thinking": {"type": "disabled"}}]:
        assert [b.type for b in client.messages.create(**request, **off).content] == ["text"]
    with client.messages.stream(**request) as stream:
        assert "thinking" not in [e.content_block.type for e in stream if e.type == "content_block_start"]


def test_ollama_think(server, demo):
    client = ollama.Client(host=server, timeout=60)
    request = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": SORT}],
        "options": {"seed": 0, "template": TEMPLATE},
    }
    whole = client.chat(**request, think=True)
    assert whole.message.thinking == THOUGHT and whole.message.content == expected_answer(demo)
    chunks = list(client.chat(**request, think="low", stream=True))
    assert "".join(c.message.thinking or "" for c in chunks) == THOUGHT
    assert "".join(c.message.content for c in chunks) == expected_answer(demo)
    generated = client.generate(model=MODEL_ID, prompt=SORT, options=request["options"], think=True)
    assert generated.thinking == THOUGHT and generated.response == expected_answer(demo)
    off = client.chat(**request, think=False)
    assert off.message.thinking is None and off.message.content == expected_answer(demo, False)
    assert all(c.message.thinking is None for c in client.chat(**request, stream=True))
    assert "thinking" in client.show(MODEL_ID).capabilities


def test_reasoning_that_cannot_be_had_is_refused(server, openai_client, demo):
    for kwargs, param, message in [
        ({"reasoning_effort": "extreme"}, "reasoning_effort", "reasoning_effort must be one of none, minimal, low"),
        ({"extra_body": {"reasoning": "high"}}, "reasoning", "reasoning must be an object"),
    ]:
        with pytest.raises(openai.BadRequestError) as caught:
            chat(openai_client, **kwargs)
        assert caught.value.body["param"] == param and message in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.completions.create(model=MODEL_ID, prompt=SORT, extra_body={"reasoning_effort": "low"})
    assert (
        caught.value.body["param"] == "reasoning_effort" and "needs the chat template" in caught.value.body["message"]
    )
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.responses.create(model=MODEL_ID, input=SORT, reasoning={"effort": "max"})
    assert caught.value.body["param"] == "reasoning" and "reasoning must be one of" in caught.value.body["message"]
    client = anthropic.Anthropic(base_url=server, api_key="none", max_retries=0, timeout=60)
    for thinking, message in [
        ({"type": "enabled", "budget_tokens": 100}, "at least 1024, got 100"),
        ({"type": "enabled", "budget_tokens": 4096}, "(4096) must be less than max_tokens"),
        ({"type": "on"}, 'thinking must be {"type": "enabled"'),
    ]:
        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(
                model=MODEL_ID, max_tokens=2048, messages=[{"role": "user", "content": SORT}], thinking=thinking
            )
        assert caught.value.body["type"] == "error" and message in caught.value.body["error"]["message"]
    with pytest.raises(ollama.ResponseError) as caught:
        ollama.Client(host=server, timeout=60).chat(
            model=MODEL_ID, messages=[{"role": "user", "content": SORT}], think="max"
        )
    assert caught.value.status_code == 400 and caught.value.error.startswith("think must be true, false")
    # A checkpoint whose chat template has no switch: thinking on is refused, off goes through.
    model, tokenizer = demo
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = NO_SWITCH
    with serving(model, tokenizer) as url:
        plain = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as caught:
            chat(plain, reasoning_effort="low")
        assert caught.value.body["param"] == "reasoning_effort" and "no thinking switch" in caught.value.body["message"]
        assert chat(plain, reasoning_effort="none").choices[0].message.content
        assert "thinking" not in ollama.Client(host=url, timeout=60).show(MODEL_ID).capabilities


def test_a_template_thinking_by_default_is_off_unless_asked(demo):
    """A template whose switch is on when enable_thinking is not given (Qwen 3's way) gets it either
    way: thinking is off unless asked for, in the API and on the server alike."""
    model, tokenizer = demo
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = train_demo.CHAT_TEMPLATE.replace(
        "enable_thinking is defined and enable_thinking", "enable_thinking is not defined or enable_thinking"
    )
    off, on = prompt_ids(tokenizer, SORT), prompt_ids(tokenizer, SORT, think=True)
    assert off == prompt_ids(demo[1], SORT) and on == prompt_ids(demo[1], SORT, think=True)
    with serving(model, tokenizer) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        assert chat(client).usage.prompt_tokens == len(off)
        assert chat(client, reasoning_effort="low").usage.prompt_tokens == len(on)
