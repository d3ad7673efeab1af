"""OpenAI's Responses API on the shared request model: ``POST /v1/responses`` (``input`` as text or
items, ``instructions``, ``max_output_tokens``, ``text.format``, function tools) becomes a chat body;
the answer is a response object, or its semantic events (``response.created`` …
``response.output_text.delta`` … ``response.completed``). Responses are not stored."""

from __future__ import annotations

import itertools
import json
import secrets
import time

from starlette.routing import Route

from ..validate import shown_json
from .api import Answer, Api, BadRequest, Reply, error_body, given
from .app import Server, Thought
from .scheduler import RequestFailed
from .settings import SETTINGS

PASSED = ("model", "parallel_tool_calls", "template", *SETTINGS)  # read as the chat body reads them


class Responses(Api):
    names = {
        "max_tokens": "max_output_tokens",
        "response_format": "text.format",
        "messages": "input",
        "reasoning_effort": "reasoning",
    }

    def __init__(self, server: Server):
        super().__init__(server)
        self.id, self.created = f"resp_{secrets.token_hex(12)}", int(time.time())
        self.message_id = f"msg_{secrets.token_hex(12)}"
        self.reasoning_id = f"rs_{secrets.token_hex(12)}"
        self.body: dict = {}

    def translate(self, body: dict) -> tuple[dict, bool]:
        self.body = body
        for key in ("previous_response_id", "conversation", "prompt"):
            if body.get(key) is not None:
                raise BadRequest(
                    f"{key} is not supported by this server (it stores no responses); send the whole "
                    "conversation in input",
                    param=key,
                )
        if body.get("background"):
            raise BadRequest("background is not supported by this server; leave it out", param="background")
        if body.get("top_logprobs") not in (None, 0):  # (chat completions give them)
            raise BadRequest(
                "top_logprobs is not supported on the Responses API by this server; leave it out or send "
                "0, or ask chat completions for logprobs",
                param="top_logprobs",
            )
        messages, self.origins = [], []
        if (instructions := body.get("instructions")) is not None:
            if not isinstance(instructions, str):
                raise BadRequest("instructions must be a string", param="instructions")
            messages.append({"role": "system", "content": instructions})
            self.origins.append(None)
        items = body.get("input")
        if isinstance(items, str):
            messages.append({"role": "user", "content": items})
            self.origins.append("input")
        elif isinstance(items, list) and items:
            for index, item in enumerate(items):
                if (message := _message(item, index)) is not None:
                    messages.append(message)
                    self.origins.append(f"input[{index}]")
        else:
            raise BadRequest("input must be a string or a non-empty list of items", param="input")
        text = body.get("text") or {}
        if not isinstance(text, dict):
            raise BadRequest('text must be an object such as {"format": {"type": "text"}}', param="text")
        reasoning = body.get("reasoning") or {}
        return given(
            {
                **{k: body[k] for k in PASSED if k in body},
                "messages": messages,
                "stream": body.get("stream"),
                "max_tokens": body.get("max_output_tokens"),
                "response_format": _format(text.get("format")),
                "tools": [_tool(t) for t in _list(body.get("tools"), "tools")] or None,
                "tool_choice": _tool_choice(body.get("tool_choice")),
                "reasoning_effort": reasoning.get("effort") if isinstance(reasoning, dict) else reasoning,
            }
        ), True

    def reply(self, answer: Answer, reply: Reply) -> dict:
        items = (
            ([self._reasoning_item(answer.reasoning)] if answer.reasoning else [])
            + ([self._text_item(answer.content)] if answer.content or not answer.calls else [])
            + [_call_item(name, arguments) for name, arguments in answer.calls]
        )
        return self._response(answer, items)

    async def stream(self, events, reply: Reply):
        sequence = itertools.count()

        def sse(kind: str, **data) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(sequence), **data})}\n\n"

        yield sse("response.created", response=self._response(None, []))
        yield sse("response.in_progress", response=self._response(None, []))
        items: list[dict] = []
        kind, text, where = None, "", {}  # the item being streamed ("reasoning" or "message") and its text
        async for piece in self.server.text_pieces(events, reply):
            if isinstance(piece, RequestFailed):
                yield sse(
                    "error", **{k: v for k, v in error_body(str(piece), piece.status)["error"].items() if k != "type"}
                )
                return
            wanted = (
                "reasoning"
                if isinstance(piece, Thought)
                else ("message" if isinstance(piece, str) or not piece.calls or kind == "message" else None)
            )
            if kind is not None and kind != wanted:
                items.append(self._item(kind, text))
                for event, data in _closing(kind, text, where, items[-1]):
                    yield sse(event, **data)
                kind = None
            if kind is None and wanted is not None:
                kind, text = wanted, ""
                where = {"item_id": self._item(kind, "")["id"], "output_index": len(items), "content_index": 0}
                yield sse(
                    "response.output_item.added",
                    output_index=len(items),
                    item={**self._item(kind, ""), "status": "in_progress", "content": []},
                )
                yield sse("response.content_part.added", **where, part=_part_of(kind, ""))
            if isinstance(piece, str):
                text += piece
                yield sse(f"response.{_PARTS[kind]}.delta", **where, delta=piece, **_logprobs(kind))
                continue
            if kind is not None:  # the message, whose last piece came before the answer
                items.append(self._item(kind, text))
                for event, data in _closing(kind, text, where, items[-1]):
                    yield sse(event, **data)
            for name, arguments in piece.calls:
                item, index = _call_item(name, arguments), len(items)
                yield sse(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "arguments": "", "status": "in_progress"},
                )
                call = {"item_id": item["id"], "output_index": index}
                yield sse("response.function_call_arguments.delta", **call, delta=arguments)
                yield sse("response.function_call_arguments.done", **call, name=name, arguments=arguments)
                items.append(item)
                yield sse("response.output_item.done", output_index=index, item=item)
            final = self._response(piece, items)
            yield sse(f"response.{final['status']}", response=final)

    def _response(self, answer: Answer | None, output: list[dict]) -> dict:
        """The response object: in progress (no ``answer`` yet), completed, or incomplete (cut by
        ``max_output_tokens``)."""
        body = self.body
        cut = answer is not None and answer.finish == "length"
        usage = None
        if answer is not None:
            u = answer.usage
            usage = {
                "input_tokens": u.prompt_tokens,
                # the prompt cache is kept without asking (nothing is written on request), as Anthropic's
                # usage says with cache_creation_input_tokens 0
                "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
                "total_tokens": u.prompt_tokens + u.completion_tokens,
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": "in_progress" if answer is None else "incomplete" if cut else "completed",
            "model": self.server.model_id,
            "output": output,
            **({"usage": usage} if usage is not None else {}),  # (the document's usage is an object or absent)
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "tool_choice": body.get("tool_choice", "auto"),
            # (as given; the document requires strict and parameters in each, null where not given)
            "tools": [{"strict": None, "parameters": None, **tool} for tool in body.get("tools") or []],
            "text": body.get("text") or {"format": {"type": "text"}},
            "store": False,
            "metadata": body.get("metadata") or {},
        }

    def _text_item(self, text: str) -> dict:
        return {
            "type": "message",
            "id": self.message_id,
            "status": "completed",
            "role": "assistant",
            "content": [_output_text(text)],
        }

    def _reasoning_item(self, text: str) -> dict:
        return {
            "type": "reasoning",
            "id": self.reasoning_id,
            "status": "completed",
            "summary": [],
            "content": [_reasoning_text(text)],
        }

    def _item(self, kind: str, text: str) -> dict:
        return self._reasoning_item(text) if kind == "reasoning" else self._text_item(text)


_PARTS = {"reasoning": "reasoning_text", "message": "output_text"}  # each item's part, as its events name it


def _part_of(kind: str, text: str) -> dict:
    return _reasoning_text(text) if kind == "reasoning" else _output_text(text)


def _logprobs(kind: str) -> dict:
    return {"logprobs": []} if kind == "message" else {}


def _closing(kind: str, text: str, where: dict, item: dict):
    """The events that end a streamed item: its text done, its part done, the item done."""
    yield f"response.{_PARTS[kind]}.done", {**where, "text": text, **_logprobs(kind)}
    yield "response.content_part.done", {**where, "part": _part_of(kind, text)}
    yield "response.output_item.done", {"output_index": where["output_index"], "item": item}


def _reasoning_text(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def _output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(name: str, arguments: str) -> dict:
    return {
        "type": "function_call",
        "id": f"fc_{secrets.token_hex(12)}",
        "call_id": f"call_{secrets.token_hex(12)}",
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def _list(value, name: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadRequest(f"{name} must be a list", param=name)
    return value


def _message(item, index: int) -> dict | None:
    """An input item as a chat message (None for a reasoning item, which the model does not read)."""
    if isinstance(item, str):
        return {"role": "user", "content": item}
    kind = item.get("type", "message") if isinstance(item, dict) else None
    if kind == "message":
        role, content = item.get("role"), item.get("content")
        if isinstance(content, list):
            content = [_part(part) for part in content]
        return {"role": "system" if role == "developer" else role, "content": content}
    if kind == "function_call":
        return {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": item.get("call_id"),
                    "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")},
                }
            ],
        }
    if kind == "function_call_output":
        output = item.get("output")
        if isinstance(output, list):
            if not all(isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in output):
                raise BadRequest(
                    f"input[{index}].output must be a string or a list of parts "
                    '{"type": "input_text", "text": "..."}',
                    param="input",
                )
            output = "".join(p.get("text", "") for p in output)
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": output}
    if kind == "reasoning":
        return None
    raise BadRequest(
        f"input[{index}]: items of type {shown_json(kind)} are not supported; send messages, "
        "function_call and function_call_output items",
        param="input",
    )


def _part(part):
    """A content part as a chat part (a kind the chat body does not take keeps its type, to be refused by name)."""
    if not isinstance(part, dict):
        return part
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": part.get("text", "")}
    if kind == "refusal":
        return {"type": "text", "text": part.get("refusal", "")}
    if kind == "input_image":
        return {"type": "image_url", "image_url": {"url": part.get("image_url")}}
    return part


def _format(value) -> dict | None:
    if value is None or not isinstance(value, dict) or value.get("type") != "json_schema":
        return value
    return {"type": "json_schema", "json_schema": {"name": value.get("name"), "schema": value.get("schema")}}


def _tool(tool) -> dict:
    if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("name"), str)):
        raise BadRequest(
            'each tool must be {"type": "function", "name": ..., "parameters": {a JSON schema}} '
            "(the server runs no built-in tools)",
            param="tools",
        )
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool}}


def _tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def routes(server: Server) -> list[Route]:
    async def responses(request):
        return await server.respond(request, Responses(server))

    return [Route("/v1/responses", responses, methods=["POST"])]
