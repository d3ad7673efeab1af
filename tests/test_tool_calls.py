"""Gemma 4 tool calls: parsed out of an answer, and forced through a canvas template."""

import pytest

from mlx_dgemma import load
from mlx_dgemma.generate import DEMO_MODEL
from mlx_dgemma.template import FREE, TemplateError
from mlx_dgemma.tool_calls import ToolCall, forced_call_template, parse_tool_calls

Q = '<|"|>'


def test_gemma_call_syntax_is_read_into_arguments():
    text = (f"Let me look. <|tool_call>call:get_weather{{city:{Q}Paris, {{France}}{Q},days:3,"
            f"options:{{units:{Q}metric{Q},flags:[true,null,-1.5e2]}}}}<tool_call|>"
            f"<|tool_call>call:clock{{}}<tool_call|> done")
    content, calls = parse_tool_calls(text)
    assert content == "Let me look.  done"
    assert calls == [ToolCall("get_weather", {"city": "Paris, {France}", "days": 3,
                                              "options": {"units": "metric", "flags": [True, None, -150.0]}}),
                     ToolCall("clock", {})]


def test_json_arguments_and_an_unclosed_last_call():
    content, calls = parse_tool_calls('<|tool_call>call:add{"a": 1, "b": "x\\"y"}')
    assert content == "" and calls == [ToolCall("add", {"a": 1, "b": 'x"y'})]
    assert parse_tool_calls("no calls here") == ("no calls here", [])


@pytest.mark.parametrize("text, where", [
    ("<|tool_call>call:f{a:}<tool_call|>", "a value"),
    ("<|tool_call>call:f{a:1 b:2}<tool_call|>", "',' or '}'"),
    (f"<|tool_call>call:f{{a:{Q}open}}<tool_call|>", "closing"),
    ("<|tool_call>get_weather{}<tool_call|>", "call:NAME"),
])
def test_malformed_calls_say_where(text, where):
    with pytest.raises(ValueError, match=where):
        parse_tool_calls(text)


GET_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}


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
    no_properties = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {}, "required": ["city"]}}}
    with pytest.raises(TemplateError, match='required key "city" at \\$ is not in its properties'):
        forced_call_template(tokenizer, no_properties)
    for tool in ("f", {"type": "function", "function": "f"}, {"function": {"name": "f", "parameters": [1]}}):
        with pytest.raises(TemplateError, match='a tool is {"type": "function", "function"'):
            forced_call_template(tokenizer, tool)
