"""The answer's layout a request asks for, as the body says it: a text ``template``, a JSON schema
(``response_format``, Ollama's ``format``) or a forced tool call. A call forced to one tool is the JSON
of its parameters, laid out exactly as that schema's ``response_format``; a call to any of several
(``tool_choice`` "required") is the JSON of their union, the tool's name then its arguments
(tool_calls.call_choice_schema). Which layout the answer gets is decided as the request is resolved
(structured/layout.py, for every front door).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..structured.grammar import JSON_OBJECT
from ..structured.template import TemplateError
from ..structured.tool_calls import call_choice_schema, check_tool
from ..validate import shown, shown_json
from .api import BadRequest


@dataclass(frozen=True)
class AskedLayout:
    """A request's layout fields read: its ``template`` text or JSON ``schema`` (or neither), the body
    field a refusal of it names, and whether a draft of it may come as a tool call (a forced call)."""

    template: str | None = None
    schema: object = None
    param: str = "response_format"
    reads_call: bool = False

    @property
    def given(self) -> bool:
        return self.template is not None or self.schema is not None


def asked_layout(server, body: dict, forced: list[dict] | None) -> AskedLayout:
    """The layout ``body`` asks for: ``template``, ``response_format`` or a call forced to one of ``forced``."""
    text = typed(body, "template", str, None)
    response_format = typed(body, "response_format", dict, None) or {"type": "text"}
    kind = response_format.get("type")
    if sum(x is not None for x in (text, forced, None if kind == "text" else kind)) > 1:
        raise BadRequest("give one of template, response_format and a forced tool call", param="response_format")
    if kind not in ("text", "json_object", "json_schema"):
        raise BadRequest(f"response_format type must be text, json_object or json_schema, got {shown(kind)}",
                         param="response_format")
    if text is not None:
        server._check_length(len(text), "the template", "template")
        return AskedLayout(template=text, param="template")
    if forced is not None:
        try:
            for tool in forced:
                check_tool(tool)
        except TemplateError as e:
            raise BadRequest(str(e), param="tools") from None
        schema = (forced[0]["function"].get("parameters") or {"type": "object", "properties": {}}
                  if len(forced) == 1 else call_choice_schema(forced))
        server._check_length(sum(map(len, strings(schema))), "the tool's parameters", "tools")
        return AskedLayout(schema=schema, param="tools", reads_call=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise BadRequest("response_format json_schema needs {\"json_schema\": {\"name\": ..., "
                             "\"schema\": {...}}}", param="response_format")
        server._check_length(sum(map(len, strings(schema))), "the schema's text", "response_format")
        return AskedLayout(schema=schema)
    if kind == "json_object":
        return AskedLayout(schema=JSON_OBJECT)
    return AskedLayout()


def leaves(value):
    """Every string, number, bool and null in a JSON value, keys included (looked at without recursion:
    a body may nest deep)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            stack += item
        else:
            yield item


def strings(value):
    """Every string in a JSON value, keys included."""
    return (item for item in leaves(value) if isinstance(item, str))


def typed(body: dict, key: str, kind, default):
    """``body[key]``, of type ``kind`` (a 400 naming it otherwise), or ``default`` when it is absent."""
    value = body.get(key)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):  # JSON true is no number
        names = " or ".join(k.__name__ for k in kinds)
        raise BadRequest(f"{key} must be of type {names}, got {shown_json(value)}", param=key)
    return value
