"""The answer's layout a request asks for: a text ``template``, a JSON schema (``response_format``,
Ollama's ``format``) or a forced tool call. Under a diffusion policy a schema the canvas template
expresses (and that fits ``max_tokens``) is a canvas template whose holes a free draft sizes
(``Job.redraft``); every other schema is followed by its grammar (grammar.py). A call forced to one
tool is the JSON of its parameters, drafted and laid out exactly as that schema's ``response_format``;
a call to any of several (``tool_choice`` "required") follows the grammar of their union, the tool's
name then its arguments (tool_calls.call_choice_schema).
"""

from __future__ import annotations

import json

from ..engine.request import answer_room, check_template_fits, grammar_stop_ids, schema_template
from ..structured.closing import check_closing_room
from ..structured.grammar import JSON_OBJECT, Grammar, schema_grammar
from ..structured.json_schema import json_template
from ..structured.template import CanvasTemplate, TemplateError, parse_template
from ..structured.tool_calls import call_choice_schema, check_tool, parse_tool_calls
from ..validate import shown, shown_json
from .api import BadRequest
from .scheduler import Job


def answer_layout(server, job: Job, body: dict, forced: list[dict] | None, max_tokens: int | None,
                  policy: str) -> tuple[CanvasTemplate | None, Grammar | None]:
    """The job's template, draft-then-template or schema, from ``template``, ``response_format`` or a
    call forced to one of ``forced``; returns the schema's grammar where the answer follows one (its closing path is
    checked against max_tokens once that is settled)."""
    text = typed(body, "template", str, None)
    response_format = typed(body, "response_format", dict, None) or {"type": "text"}
    kind = response_format.get("type")
    if sum(x is not None for x in (text, forced, None if kind == "text" else kind)) > 1:
        raise BadRequest("give one of template, response_format and a forced tool call", param="response_format")
    if kind not in ("text", "json_object", "json_schema"):
        raise BadRequest(f"response_format type must be text, json_object or json_schema, got {shown(kind)}",
                         param="response_format")
    param = "template" if text is not None else "tools" if forced is not None else "response_format"
    job.template_param = param
    try:
        if text is not None:
            server._check_length(len(text), "the template", "template")
            return _fits(server, job, parse_template(server.tokenizer, text, server.context), param), None
        elif forced is not None:
            for tool in forced:
                check_tool(tool)
            schema = (forced[0]["function"].get("parameters") or {"type": "object", "properties": {}}
                      if len(forced) == 1 else call_choice_schema(forced))
            server._check_length(sum(map(len, strings(schema))), "the tool's parameters", "tools")
            return _structured(server, job, schema, max_tokens, policy)
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, (dict, bool)):
                raise BadRequest("response_format json_schema needs {\"json_schema\": {\"name\": ..., "
                                 "\"schema\": {...}}}", param="response_format")
            server._check_length(sum(map(len, strings(schema))), "the schema's text", "response_format")
            return _structured(server, job, schema, max_tokens, policy)
        elif kind == "json_object":
            return _structured(server, job, JSON_OBJECT, max_tokens, policy)
    except TemplateError as e:
        raise BadRequest(str(e), param=param) from None
    return None, None


def _structured(server, job: Job, schema, max_tokens: int | None, policy: str) -> tuple[None, Grammar | None]:
    """A JSON answer of ``schema`` (a forced call's arguments): under a diffusion policy the canvas
    template, holes sized by a free draft, where the template expresses the schema and fits
    ``max_tokens``; otherwise the schema's grammar. A forced call is answered as ``response_format``
    with its parameters is (the reply wraps the arguments in the call)."""
    tokenizer, limit = server.tokenizer, server.context
    largest = schema_template(tokenizer, schema, policy, limit, max_tokens)
    if largest is not None:
        job.redraft = lambda draft: json_template(tokenizer, schema, draft=_arguments_or_none(draft), limit=limit)
        _fits(server, job, largest, job.template_param)
        return None, None
    vocab = server.model.config.vocab_size
    grammar = schema_grammar(tokenizer, schema, vocab, grammar_stop_ids(tokenizer, server.defaults))
    # The closing path, walked here (and kept): a schema llguidance gives up on, or whose shortest answer
    # no max_tokens fits in the context, is refused.
    check_closing_room(grammar, vocab, answer_room(job.ids, server.model.config))
    return None, grammar


def _fits(server, job: Job, template, param: str):
    """``template``, when its canvases (the largest a draft may size it to) fit after the prompt."""
    try:
        check_template_fits(template, len(job.ids), server.model.config)
    except TemplateError as e:
        raise BadRequest(str(e), param=param, code="context_length_exceeded") from None
    return template


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


def _arguments_or_none(text: str):
    """A free draft's arguments for a forced call: its first tool call's, or its JSON object."""
    try:
        _, calls = parse_tool_calls(text)
    except ValueError:
        calls = []
    return calls[0].arguments if calls else _json_or_none(text)


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


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
