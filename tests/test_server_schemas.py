"""Structured output as clients ask for it, against the demo server: pydantic models through openai's
``.parse`` and ollama's ``format``, schemas no canvas template takes, ``json_object``; stop strings and
``max_tokens`` with a schema or a forced tool in every API, streamed and not: valid JSON or a 400 naming
the field; a forced call's arguments drafted as ``response_format``'s are; a call forced to any of
several tools, under every policy and in every API that has tool_choice."""

import json

import anthropic
import jsonschema
import ollama
import openai
import pytest

from mlx_dgemma.structured import grammar

from .test_schema_grammar import Everyday, Tree
from .test_server import (
    MODEL_ID,
    PERSON,
    WEATHER,
    serving,
)

POLICIES = ["reference", "ar", "verified"]
PERSON_TOOL = {"type": "function", "function": {"name": "person", "parameters": {**PERSON, "required": ["name"]}}}


@pytest.fixture(scope="module")
def server(demo):
    with serving(*demo) as url:
        yield url


@pytest.fixture(scope="module")
def openai_client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


def user(text):
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("model_class", [Everyday, Tree])
def test_openai_parse_answers_everyday_pydantic_models(openai_client, policy, model_class):
    completion = openai_client.chat.completions.parse(
        model=MODEL_ID,
        messages=user("json: name=ada age=36"),
        response_format=model_class,
        max_tokens=300,
        seed=1,
        extra_body={"policy": policy},
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, model_class)


def test_ollama_format_takes_a_pydantic_models_schema(server):
    client = ollama.Client(host=server, timeout=120)
    for model_class in (Everyday, Tree):
        reply = client.chat(
            model=MODEL_ID,
            messages=user("json: name=ada age=36"),
            format=model_class.model_json_schema(),
            options={"seed": 0, "num_predict": 300},
        )
        model_class.model_validate_json(reply.message.content)


def test_json_object_is_any_object_under_every_policy(openai_client):
    for policy in POLICIES:
        reply = openai_client.chat.completions.create(
            model=MODEL_ID,
            messages=user("sort: 5 3 9"),
            response_format={"type": "json_object"},
            max_tokens=120,
            seed=2,
            extra_body={"policy": policy},
        )
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_stop_strings_never_cut_a_structured_answer(openai_client, policy, stream):
    kwargs = dict(
        model=MODEL_ID,
        messages=user("json: name=ada age=36"),
        seed=2,
        stop=["}", '"'],
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        extra_body={"policy": policy},
    )
    if stream:
        text = "".join(
            c.choices[0].delta.content or ""
            for c in openai_client.chat.completions.create(stream=True, **kwargs)
            if c.choices
        )
    else:
        text = openai_client.chat.completions.create(**kwargs).choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)


def test_anthropic_forced_tool_with_stop_sequences_streamed_and_not(server):
    client = anthropic.Anthropic(base_url=server, api_key="none", max_retries=0, timeout=120)
    kwargs = dict(
        model=MODEL_ID,
        messages=user("json: name=ada age=36"),
        max_tokens=64,
        stop_sequences=['"', "}"],
        tools=[{"name": "person", "input_schema": PERSON}],
        tool_choice={"type": "tool", "name": "person"},
        extra_body={"seed": 2},
    )
    (block,) = client.messages.create(**kwargs).content
    assert block.type == "tool_use"
    jsonschema.validate(block.input, PERSON)
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "tool_use" and final.content[0].input == block.input


@pytest.mark.parametrize("policy", POLICIES)
def test_max_tokens_below_a_schemas_shortest_answer_is_a_400_naming_it(openai_client, server, policy):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(
            model=MODEL_ID,
            messages=user("json: name=ada"),
            max_tokens=1,
            tools=[PERSON_TOOL],
            tool_choice="required",
            extra_body={"policy": policy},
        )
    assert caught.value.body["param"] == "max_tokens" and "raise max_tokens" in caught.value.body["message"]
    client = anthropic.Anthropic(base_url=server, api_key="none", max_retries=0, timeout=120)
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(
            model=MODEL_ID,
            messages=user("json: name=ada"),
            max_tokens=1,
            tools=[{"name": "person", "input_schema": PERSON}],
            tool_choice={"type": "tool", "name": "person"},
            extra_body={"policy": policy},
        )
    assert "max_tokens" in str(refused.value)


def test_a_schema_llguidance_gives_up_on_is_a_400_naming_response_format(openai_client):
    """A pattern past llguidance's lexer limit: found when the closing path is walked, and refused
    as the schema's fault, not answered with a 500."""
    schema = {
        "type": "object",
        "required": ["q"],
        "properties": {
            "q": {"type": "string", "minLength": 1, "maxLength": 5000, "pattern": r"^$|(^(?:\S+\s+){0,99}\S+$)"}
        },
    }
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(
            model=MODEL_ID,
            messages=user("json: q"),
            extra_body={"policy": "ar"},
            response_format={"type": "json_schema", "json_schema": {"name": "q", "schema": schema}},
        )
    assert caught.value.body["param"] == "response_format" and "llguidance gave up" in caught.value.body["message"]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_max_tokens_that_fits_still_ends_valid(openai_client, policy):
    """From the shortest answer the server names up: each answer a valid tree within its budget."""
    kwargs = dict(
        model=MODEL_ID,
        messages=user("json: name=ada age=36"),
        seed=0,
        extra_body={"policy": policy},
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": Tree.model_json_schema()}},
    )
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(max_tokens=1, **kwargs)
    shortest = int(caught.value.body["message"].split("takes ")[1].split(" tokens")[0])
    for max_tokens in (shortest, shortest + 7, 3 * shortest):
        reply = openai_client.chat.completions.create(max_tokens=max_tokens, **kwargs)
        Tree.model_validate_json(reply.choices[0].message.content)
        assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens <= max_tokens


def test_a_forced_call_is_drafted_as_response_format_is(openai_client):
    """Under a diffusion policy both go by the canvas template, holes sized by a free draft: the same values."""
    kwargs = dict(model=MODEL_ID, messages=user("json: name=ada age=36"), seed=2, max_tokens=64)
    formatted = json.loads(
        openai_client.chat.completions.create(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": PERSON_TOOL["function"]["parameters"]},
            },
            **kwargs,
        )
        .choices[0]
        .message.content
    )
    called = openai_client.chat.completions.create(tools=[PERSON_TOOL], tool_choice="required", **kwargs)
    arguments = json.loads(called.choices[0].message.tool_calls[0].function.arguments)
    assert arguments == formatted and arguments["name"] == "ada"


@pytest.mark.parametrize("policy", POLICIES)
def test_a_streamed_forced_call_carries_its_whole_arguments(openai_client, policy):
    chunks = list(
        openai_client.chat.completions.create(
            model=MODEL_ID,
            messages=user("json: name=ada age=36"),
            seed=2,
            max_tokens=64,
            stream=True,
            tools=[PERSON_TOOL],
            tool_choice="required",
            extra_body={"policy": policy},
        )
    )
    calls = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or []]
    assert all(not (chunk.choices and chunk.choices[0].delta.content) for chunk in chunks)
    arguments = "".join(call.function.arguments or "" for call in calls)
    jsonschema.validate(json.loads(arguments), PERSON_TOOL["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_stop_never_cuts_a_format_answer(server, stream):
    client = ollama.Client(host=server, timeout=120)
    kwargs = dict(
        model=MODEL_ID,
        messages=user("json: name=ada age=36"),
        format=PERSON,
        options={"seed": 2, "num_predict": 64, "stop": ["}", '"']},
    )
    if stream:
        text = "".join(part.message.content for part in client.chat(stream=True, **kwargs))
    else:
        text = client.chat(**kwargs).message.content
    jsonschema.validate(json.loads(text), PERSON)


def test_a_schema_is_compiled_once_and_its_hostile_pattern_is_never_backtracked(openai_client, monkeypatch):
    """``^(a?){n}a{n}$`` takes Python's re 2**n steps to match: the pattern's example is built from its
    parse tree instead (test_string_examples), so the answer comes and it is valid; and the grammar the
    server compiles as it admits the request is the one the worker answers with, not compiled again."""
    compiled = []

    class Counted(grammar.Grammar):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            compiled.append(self)

    monkeypatch.setattr(grammar, "Grammar", Counted)
    schema = {
        "type": "object",
        "required": ["q"],
        "additionalProperties": False,
        "properties": {"q": {"type": "string", "pattern": "^(a?){60}a{60}$"}},
    }
    reply = openai_client.chat.completions.create(
        model=MODEL_ID,
        messages=user("json: q"),
        seed=0,
        extra_body={"policy": "ar"},
        max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "q", "schema": schema}},
    )
    (answer,) = json.loads(reply.choices[0].message.content).values()  # (checked by hand: re would backtrack)
    assert set(answer) == {"a"} and 60 <= len(answer) <= 120
    assert len(compiled) == 1


def test_a_min_properties_is_met_by_distinct_keys_over_http(openai_client):
    """A map of at least 4 entries: answered, each key once (json.loads would keep one of two)."""
    schema = {"type": "object", "additionalProperties": {"type": "string"}, "minProperties": 4}
    reply = openai_client.completions.create(
        model=MODEL_ID,
        prompt="json: color name year",
        max_tokens=64,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "m", "schema": schema}}},
    )
    pairs = json.loads(reply.choices[0].text, object_pairs_hook=list)
    assert len(pairs) >= 4 and len(dict(pairs)) == len(pairs), reply.choices[0].text


def test_a_min_properties_past_the_names_its_keys_can_take_is_a_400_naming_response_format(openai_client):
    schema = {
        "type": "object",
        "patternProperties": {"^[ab]$": {"type": "string"}},
        "additionalProperties": False,
        "minProperties": 3,
    }
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.completions.create(
            model=MODEL_ID,
            prompt="json: a b",
            max_tokens=64,
            extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "m", "schema": schema}}},
        )
    assert caught.value.body["param"] == "response_format"
    assert "minProperties at $ is 3, but its keys can take only 2 distinct names" in caught.value.body["message"]


@pytest.mark.parametrize("parameters", [{"type": "integer"}, {"properties": {"a": {"type": "string"}}}])
def test_a_tool_whose_parameters_are_no_object_schema_is_a_400_naming_tools(openai_client, server, parameters):
    """A call's arguments are an object: such a forced tool was answered with "input": 88."""
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(
            model=MODEL_ID,
            messages=user("json: 88"),
            max_tokens=32,
            tool_choice="required",
            tools=[{"type": "function", "function": {"name": "n", "parameters": parameters}}],
        )
    assert (
        caught.value.body["param"] == "tools"
        and 'parameters must be a JSON schema of type "object"' in caught.value.body["message"]
    )
    client = anthropic.Anthropic(base_url=server, api_key="none", max_retries=0, timeout=120)
    with pytest.raises(anthropic.BadRequestError, match='of type "object"'):
        client.messages.create(
            model=MODEL_ID,
            messages=user("json: 88"),
            max_tokens=32,
            tools=[{"name": "n", "input_schema": parameters}],
            tool_choice={"type": "tool", "name": "n"},
        )


def test_a_schema_no_max_tokens_fits_is_a_400_naming_response_format(openai_client):
    """A string of at least a million characters: no budget fits the context, so raising max_tokens is not
    what the error asks for."""
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(
            model=MODEL_ID,
            messages=user("json: x"),
            max_tokens=64,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": {"type": "string", "minLength": 1_000_000}},
            },
        )
    message = caught.value.body["message"]
    assert caught.value.body["param"] == "response_format" and "so no max_tokens fits it" in message
    assert "raise max_tokens" not in message


TOOLS = [WEATHER, PERSON_TOOL]


def check_call(name, arguments):
    """A call to one of ``TOOLS`` whose arguments validate against that tool's parameters."""
    (tool,) = [t for t in TOOLS if t["function"]["name"] == name]
    jsonschema.validate(arguments, tool["function"]["parameters"])


@pytest.mark.parametrize("policy", ["reference", "fast", "ar", "verified", "auto"])
def test_required_with_several_tools_calls_one_of_them(openai_client, server, policy):
    kwargs = dict(model=MODEL_ID, seed=0, max_tokens=64, extra_body={"policy": policy})
    asked = user("weather in paris for 3 days")
    whole = openai_client.chat.completions.create(messages=asked, tools=TOOLS, tool_choice="required", **kwargs)
    choice = whole.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_call(call.function.name, json.loads(call.function.arguments))
    chunks = list(
        openai_client.chat.completions.create(
            messages=asked, tools=TOOLS, tool_choice="required", stream=True, **kwargs
        )
    )
    streamed = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [
        (call.function.name, call.function.arguments)
    ]

    responses_tools = [{"type": "function", **t["function"]} for t in TOOLS]
    response = openai_client.responses.create(
        model=MODEL_ID,
        input=asked,
        tools=responses_tools,
        tool_choice="required",
        max_output_tokens=64,
        extra_body={"seed": 0, "policy": policy},
    )
    (item,) = response.output
    assert item.type == "function_call"
    check_call(item.name, json.loads(item.arguments))

    client = anthropic.Anthropic(base_url=server, api_key="none", max_retries=0, timeout=120)
    message = client.messages.create(
        model=MODEL_ID,
        messages=asked,
        max_tokens=64,
        tool_choice={"type": "any"},
        tools=[{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS],
        extra_body={"seed": 0, "policy": policy},
    )
    (block,) = message.content
    assert block.type == "tool_use" and message.stop_reason == "tool_use"
    check_call(block.name, block.input)
