"""Gemma 4 tool calls: parsed out of an answer, forced through a canvas template, and forced to any
of several tools through the grammar of their union."""

import json

import jsonschema
import pytest

from mlx_dgemma import load
from mlx_dgemma.engine.resolve import generation_config, grammar_stop_ids
from mlx_dgemma.generate import DEMO_MODEL
from mlx_dgemma.structured.grammar import schema_grammar
from mlx_dgemma.structured.template import FREE, TemplateError
from mlx_dgemma.structured.tool_calls import (
    ToolCall,
    call_choice_schema,
    chosen_call,
    forced_call_template,
    parse_tool_calls,
)

Q = '<|"|>'


def test_gemma_call_syntax_is_read_into_arguments():
    text = (
        f"Let me look. <|tool_call>call:get_weather{{city:{Q}Paris, {{France}}{Q},days:3,"
        f"options:{{units:{Q}metric{Q},flags:[true,null,-1.5e2]}}}}<tool_call|>"
        f"<|tool_call>call:clock{{}}<tool_call|> done"
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me look.  done"
    assert calls == [
        ToolCall(
            "get_weather",
            {"city": "Paris, {France}", "days": 3, "options": {"units": "metric", "flags": [True, None, -150.0]}},
        ),
        ToolCall("clock", {}),
    ]


def test_json_arguments_and_an_unclosed_last_call():
    content, calls = parse_tool_calls('<|tool_call>call:add{"a": 1, "b": "x\\"y"}')
    assert content == "" and calls == [ToolCall("add", {"a": 1, "b": 'x"y'})]
    assert parse_tool_calls("no calls here") == ("no calls here", [])


@pytest.mark.parametrize(
    "text, where",
    [
        ("<|tool_call>call:f{a:}<tool_call|>", "a value"),
        ("<|tool_call>call:f{a:1 b:2}<tool_call|>", "',' or '}'"),
        (f"<|tool_call>call:f{{a:{Q}open}}<tool_call|>", "closing"),
        ("<|tool_call>get_weather{}<tool_call|>", "call:NAME"),
    ],
)
def test_malformed_calls_say_where(text, where):
    with pytest.raises(ValueError, match=where):
        parse_tool_calls(text)


GET_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 5},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
        },
    },
}


def test_forced_call_template_clamps_the_frame_and_renders_the_arguments():
    _, tokenizer = load(DEMO_MODEL)
    template = forced_call_template(tokenizer, GET_WEATHER)
    literal = [t for t in template.tokens if t != FREE]
    assert tokenizer.decode(literal) == '<|tool_call>call:get_weather{"city": "", "days": }<tool_call|>'
    assert [h.size for _, h in template.holes] == [5, 1]
    assert template.render(["Oslo", "9"]) == {"city": "Oslo", "days": 7}  # clamped into the schema's range
    no_arguments = forced_call_template(tokenizer, {"type": "function", "function": {"name": "clock"}})
    assert tokenizer.decode(no_arguments.tokens) == "<|tool_call>call:clock{}<tool_call|>"
    assert no_arguments.render([]) == {}
    with pytest.raises(TemplateError, match="tool name"):
        forced_call_template(tokenizer, {"type": "function", "function": {"name": "two words"}})


def test_tools_whose_call_could_not_validate_are_refused():
    _, tokenizer = load(DEMO_MODEL)
    no_properties = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {}, "required": ["city"]}},
    }
    with pytest.raises(TemplateError, match='required key "city" at \\$ is not in its properties'):
        forced_call_template(tokenizer, no_properties)
    for tool in ("f", {"type": "function", "function": "f"}, {"function": {"name": "f", "parameters": [1]}}):
        with pytest.raises(TemplateError, match='a tool is {"type": "function", "function"'):
            forced_call_template(tokenizer, tool)


def test_a_call_to_any_of_several_tools_is_one_tools_name_and_its_arguments():
    """The union's grammar takes exactly the calls that name one of the tools with arguments valid
    against that tool's own schema (jsonschema's verdict on the tool as the client sent it: a $ref
    into its own $defs still resolves once the schema sits inside the union)."""
    model, tokenizer = load(DEMO_MODEL)
    answer = {
        "type": "function",
        "function": {
            "name": "final_answer",
            "parameters": {
                "type": "object",
                "required": ["answer"],
                "properties": {"answer": {"$ref": "#/$defs/Short"}},
                "$defs": {"Short": {"type": "string", "maxLength": 5}},
            },
        },
    }
    clock = {"type": "function", "function": {"name": "clock"}}
    tools = [GET_WEATHER, answer, clock]
    grammar = schema_grammar(
        tokenizer,
        call_choice_schema(tools),
        model.config.vocab_size,
        grammar_stop_ids(tokenizer, generation_config(model, tokenizer)),
    )
    calls = [
        ("get_weather", {"city": "Oslo", "days": 3}),
        ("get_weather", {"city": "Oslo"}),
        ("get_weather", {"city": "Oslo", "days": 9}),
        ("final_answer", {"answer": "42"}),
        ("final_answer", {"answer": "too long"}),
        ("final_answer", {"city": "Oslo", "days": 3}),
        ("clock", {}),
        ("alarm", {}),
    ]
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    verdicts = []
    for name, arguments in calls:
        text = json.dumps({"name": name, "arguments": arguments})
        matcher = grammar.matcher()
        taken = all(matcher.consume_token(i) for i in tokenizer.encode(text, add_special_tokens=False))
        valid = name in schemas and jsonschema.Draft202012Validator(schemas[name]).is_valid(arguments)
        verdicts.append(taken and not matcher.is_error())
        assert verdicts[-1] == valid, text
        if valid:
            assert chosen_call(text) == ToolCall(name, arguments)
    assert verdicts == [True, True, False, True, False, False, True, False]
    with pytest.raises(ValueError, match="expected"):
        chosen_call('{"name": "clock"}')
