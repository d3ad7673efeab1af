"""Tool calls in Gemma 4's chat format: parsed out of an answer, or forced by a canvas template.

A Gemma 4 model calls a tool by writing ``<|tool_call>call:NAME{ARGS}<tool_call|>`` in its answer,
where ARGS is a JSON-like object with bare keys and strings between ``<|"|>`` delimiters::

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>

``parse_tool_calls`` reads those (and plain JSON arguments) into ``(name, arguments)`` pairs and
returns the rest of the text as the answer's content. ``forced_call_template`` lays out one call of a
given tool as a canvas template, its arguments the JSON template of the tool's parameter schema, so a
forced call (``tool_choice`` naming a function) always parses and validates. A call forced to any of
several tools (``tool_choice`` "required") is a JSON value of ``call_choice_schema``, the name then
its tool's arguments, which ``chosen_call`` reads.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..validate import shown_json
from .json_schema import check_required, json_template
from .schema_rewrite import rebased
from .template import CanvasTemplate, TemplateError

CALL_OPEN, CALL_CLOSE = "<|tool_call>", "<tool_call|>"
STRING_DELIMITER = '<|"|>'

_NAME = re.compile(r"call:([\w.-]+)")
_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][+-]?\d+)?")
_KEY = re.compile(r"[\w.-]+")
_LITERALS = {"true": True, "false": False, "null": None}


@dataclass
class ToolCall:
    name: str
    arguments: dict


class _Arguments:
    """A recursive-descent reader of Gemma 4's argument syntax (JSON's, with ``<|"|>`` strings and
    bare keys allowed)."""

    def __init__(self, text: str, position: int):
        self.text, self.i = text, position

    def fail(self, what: str):
        raise ValueError(f"tool call arguments: expected {what} at character {self.i}")

    def skip(self) -> None:
        while self.i < len(self.text) and self.text[self.i].isspace():
            self.i += 1

    def value(self) -> Any:
        self.skip()
        text, i = self.text, self.i
        if text.startswith(STRING_DELIMITER, i):
            end = text.find(STRING_DELIMITER, i + len(STRING_DELIMITER))
            if end < 0:
                self.fail('the closing <|"|>')
            self.i = end + len(STRING_DELIMITER)
            return text[i + len(STRING_DELIMITER) : end]
        if text.startswith('"', i):
            try:
                value, self.i = json.JSONDecoder().raw_decode(text, i)
            except json.JSONDecodeError:
                self.fail("a string")
            return value
        if text.startswith("{", i):
            return self.object()
        if text.startswith("[", i):
            return self.array()
        for word, value in _LITERALS.items():
            if text.startswith(word, i):
                self.i += len(word)
                return value
        if number := _NUMBER.match(text, i):
            self.i = number.end()
            return json.loads(number.group())
        self.fail("a value")

    def object(self) -> dict:
        self.i += 1  # {
        out: dict = {}
        self.skip()
        if self.text.startswith("}", self.i):
            self.i += 1
            return out
        while True:
            self.skip()
            if self.text.startswith(('"', STRING_DELIMITER), self.i):
                key = self.value()
            elif key := _KEY.match(self.text, self.i):
                self.i, key = key.end(), key.group()
            else:
                self.fail("a key")
            self.skip()
            if not self.text.startswith(":", self.i):
                self.fail("':'")
            self.i += 1
            out[key] = self.value()
            if self.separator("}"):
                return out

    def array(self) -> list:
        self.i += 1  # [
        out: list = []
        self.skip()
        if self.text.startswith("]", self.i):
            self.i += 1
            return out
        while True:
            out.append(self.value())
            if self.separator("]"):
                return out

    def separator(self, closing: str) -> bool:
        """Past a ',' (False) or the closing bracket (True)."""
        self.skip()
        if self.text.startswith(",", self.i):
            self.i += 1
            return False
        if self.text.startswith(closing, self.i):
            self.i += 1
            return True
        self.fail(f"',' or '{closing}'")


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The text without its ``<|tool_call>…<tool_call|>`` spans, and the calls they hold, in order.
    A span that does not parse raises ``ValueError`` naming the place; an unclosed last span is read
    to the end of the text (the answer may have stopped on the close token)."""
    calls: list[ToolCall] = []
    content: list[str] = []
    position = 0
    while (start := text.find(CALL_OPEN, position)) >= 0:
        content.append(text[position:start])
        body_start = start + len(CALL_OPEN)
        end = text.find(CALL_CLOSE, body_start)
        body = text[body_start:] if end < 0 else text[body_start:end]
        name = _NAME.match(body.lstrip())
        if name is None:
            raise ValueError(f"tool call at character {start}: expected call:NAME{{...}}, got {body[:40]!r}")
        reader = _Arguments(body.lstrip(), name.end())
        reader.skip()
        if not body.lstrip().startswith("{", reader.i):
            reader.fail("'{'")
        calls.append(ToolCall(name.group(1), reader.object()))
        position = len(text) if end < 0 else end + len(CALL_CLOSE)
    content.append(text[position:])
    return "".join(content), calls


def check_tool(tool: dict) -> None:
    """A ``TemplateError`` unless ``tool`` is an OpenAI tool with a usable name and a schema (or none)."""
    function = tool.get("function") if isinstance(tool, dict) else None
    parameters = function.get("parameters") if isinstance(function, dict) else None
    if not isinstance(function, dict) or not isinstance(parameters, (dict, type(None))):
        raise TemplateError('a tool is {"type": "function", "function": {"name": ..., "parameters": {a JSON schema}}}')
    name = function.get("name")
    if not isinstance(name, str) or not _KEY.fullmatch(name):
        raise TemplateError(f"tool name {name!r} must be letters, digits, '_', '.' or '-'")
    check_parameters(function)


def check_parameters(function: dict) -> None:
    """A ``TemplateError`` unless ``function``'s parameters are a schema of type object, or none (a
    call's arguments are an object; OpenAI and Anthropic refuse other tools alike)."""
    parameters = function.get("parameters")
    if parameters and parameters.get("type") != "object":
        raise TemplateError(
            f"tool {str(function.get('name'))[:40]!r}: parameters must be a JSON schema of type "
            f'"object" (a call\'s arguments are an object), got type '
            f"{shown_json(parameters.get('type'))}"
        )


def forced_call_template(tokenizer, tool: dict, limit: int | None = None, draft: Any = None) -> CanvasTemplate:
    """A canvas template of one call of ``tool`` (an OpenAI tool: ``{"type": "function", "function":
    {"name", "parameters"}}``): the call's frame and the keys of its parameter schema clamped, the
    values holes (``limit``, the model's context, bounds them as in ``json_template``; ``draft``, the
    arguments of a free draft, sizes them). Its ``render`` gives the arguments. The arguments are
    laid out as JSON (the template module's), which ``parse_tool_calls`` reads as well as Gemma's own syntax."""
    check_tool(tool)
    name, parameters = tool["function"]["name"], tool["function"].get("parameters")
    parameters = parameters or {"type": "object", "properties": {}}
    if parameters.get("type") == "object" and not parameters.get("properties"):
        check_required(parameters)
        arguments = CanvasTemplate(tokenizer.encode("{}", add_special_tokens=False), [], render=lambda values: {})
    elif draft is None:
        arguments = json_template(tokenizer, parameters, limit=limit)
    else:
        arguments = json_template(tokenizer, parameters, draft=draft, limit=limit)
    head = tokenizer.encode(f"{CALL_OPEN}call:{name}", add_special_tokens=False)
    tail = tokenizer.encode(CALL_CLOSE, add_special_tokens=False)
    holes = [(start + len(head), hole) for start, hole in arguments.holes]
    return CanvasTemplate(head + arguments.tokens + tail, holes, render=arguments.render)


def call_choice_schema(tools: list[dict]) -> dict:
    """The JSON schema of one call of any of ``tools`` (OpenAI tools, each checked by ``check_tool``):
    ``{"name": NAME, "arguments": {...}}``, NAME one of the tools' and the arguments valid for its
    parameters. The name comes first, so a grammar settles which tool before its arguments."""
    choices = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        choices.append(
            {
                "type": "object",
                "required": ["name", "arguments"],
                "additionalProperties": False,
                "properties": {
                    "name": {"const": function["name"]},
                    "arguments": rebased(parameters, f"/anyOf/{i}/properties/arguments"),
                },
            }
        )
    return {"anyOf": choices}


# A path into call_choice_schema's union: a JSON pointer (a $ref's, llguidance's) or a path as grammar.py writes it.
_UNION_PATH = re.compile(r"(#?)/anyOf/(\d+)/properties/arguments\b|\$\.anyOf\[(\d+)\]\.properties\.arguments\b")


def in_tool_terms(message: str, tools: list[dict]) -> str:
    """A message about the schema of a call forced to one of ``tools`` (one tool's parameters, or
    ``call_choice_schema(tools)``) put in the terms of the tool it is about: that tool named, and each path
    into the union (``/anyOf/1/properties/arguments/$defs/X``) as the path inside its parameters
    (``/$defs/X``). A message about no one of several tools comes back as it is."""
    if len(tools) == 1:
        return f"tool {tools[0]['function']['name']!r}: {message}"
    indexes = {int(pointer or path) for _, pointer, path in _UNION_PATH.findall(message)}
    if len(indexes) != 1 or (index := indexes.pop()) >= len(tools):
        return message
    text = _UNION_PATH.sub(lambda m: m.group(1) if m.group(2) is not None else "$", message)
    return f"tool {tools[index]['function']['name']!r}: {text}"


def chosen_call(text: str) -> ToolCall:
    """The call in an answer of ``call_choice_schema`` (a ``ValueError`` where the text is not one)."""
    value = json.loads(text)
    if not (
        isinstance(value, dict) and isinstance(value.get("name"), str) and isinstance(value.get("arguments"), dict)
    ):
        raise ValueError(f'expected {{"name": ..., "arguments": {{...}}}}, got {text[:40]!r}')
    return ToolCall(value["name"], value["arguments"])
