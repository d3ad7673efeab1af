"""Anthropic's Messages API on the shared request model: ``POST /v1/messages`` (``system``, ``messages``
with text, image, ``tool_use`` and ``tool_result`` blocks, ``max_tokens``, ``stop_sequences``, ``tools``)
becomes a chat body; the answer is a message, or its events (``message_start`` … ``message_stop``);
errors are ``{"type": "error", "error": {"type": ..., "message": ...}}``. ``POST /v1/messages/count_tokens``
counts the prompt tokens of the same body."""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import replace

from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..validate import shown_json
from .api import MANY_STOP_STRINGS, Answer, Api, BadRequest, Reply, given
from .app import Server, Thought
from .scheduler import RequestFailed, Usage
from .settings import SETTINGS

PASSED = ("model", "max_tokens", "template", *SETTINGS)  # top_p and top_k among the settings
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


class Anthropic(Api):
    names = {"stop": "stop_sequences", "reasoning_effort": "thinking"}
    max_stop = MANY_STOP_STRINGS

    def __init__(self, server: Server):
        super().__init__(server)
        self.id = f"msg_{secrets.token_hex(12)}"

    def translate(self, body: dict) -> tuple[dict, bool]:
        messages, self.origins = [], []
        if system := body.get("system"):
            messages.append({"role": "system", "content": _text(system, "system")})
            self.origins.append(None)
        given_messages = body.get("messages")
        if not isinstance(given_messages, list) or not given_messages:
            raise BadRequest("messages must be a non-empty list", param="messages")
        for index, message in enumerate(given_messages):
            for chat_message in _messages(message, index):
                messages.append(chat_message)
                self.origins.append(f"messages[{index}]")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise BadRequest("tools must be a list", param="tools")
        return given(
            {
                **{k: body[k] for k in PASSED if k in body},
                "messages": messages,
                "stop": body.get("stop_sequences"),
                "stream": body.get("stream"),
                "tools": [_tool(t) for t in tools or []] or None,
                "tool_choice": _tool_choice(body.get("tool_choice")),
                "reasoning_effort": _effort(body.get("thinking"), body.get("max_tokens")),
            }
        ), True

    def reply(self, answer: Answer, reply: Reply) -> dict:
        blocks = (
            ([_thinking(answer.reasoning)] if answer.reasoning else [])
            + ([{"type": "text", "text": answer.content}] if answer.content or not answer.calls else [])
            + [_tool_use(name, arguments) for name, arguments in answer.calls]
        )
        return {**self._message(blocks, answer), "usage": _usage(answer.usage)}

    async def stream(self, events, reply: Reply):
        # message_start waits for the worker's first event: its usage splits the prompt into the tokens
        # read from the prompt cache and the rest, as the last one does.
        first = await anext(aiter(events), None)
        usage = first.usage if first is not None and first.usage is not None else Usage(reply.prompt_tokens, 0, 0)
        start = {**self._message([], None), "usage": _usage(replace(usage, completion_tokens=0))}
        yield _sse("message_start", message=start)
        index, kind, thought = 0, None, ""  # the open block's index and kind ("thinking" or "text")
        async for piece in self.server.text_pieces(_after(first, events), reply):
            if isinstance(piece, RequestFailed):
                yield _sse("error", error={"type": _error_type(piece.status), "message": str(piece)})
                return
            wanted = (
                "thinking"
                if isinstance(piece, Thought)
                else ("text" if isinstance(piece, str) or not piece.calls or kind == "text" else None)
            )
            if kind is not None and kind != wanted:
                if kind == "thinking":
                    yield _sse(
                        "content_block_delta",
                        index=index,
                        delta={"type": "signature_delta", "signature": _signature(thought)},
                    )
                yield _sse("content_block_stop", index=index)
                kind, index = None, index + 1
            if kind is None and wanted is not None:
                yield _sse(
                    "content_block_start",
                    index=index,
                    content_block=_thinking("", "") if wanted == "thinking" else {"type": "text", "text": ""},
                )
                kind, thought = wanted, ""
            if isinstance(piece, Thought):
                thought += piece
                yield _sse("content_block_delta", index=index, delta={"type": "thinking_delta", "thinking": piece})
                continue
            if isinstance(piece, str):
                yield _sse("content_block_delta", index=index, delta={"type": "text_delta", "text": piece})
                continue
            if kind is not None:
                yield _sse("content_block_stop", index=index)
                index += 1
            for name, arguments in piece.calls:
                block = _tool_use(name, arguments)
                yield _sse("content_block_start", index=index, content_block={**block, "input": {}})
                yield _sse(
                    "content_block_delta", index=index, delta={"type": "input_json_delta", "partial_json": arguments}
                )
                yield _sse("content_block_stop", index=index)
                index += 1
            final = self._message([], piece)
            yield _sse(
                "message_delta",
                delta={"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]},
                usage=_usage(piece.usage),
            )
            yield _sse("message_stop")

    def _message(self, content: list[dict], answer: Answer | None) -> dict:
        stop_reason = None
        if answer is not None:
            stop_reason = STOP_REASONS.get(answer.finish, "stop_sequence" if answer.stop_sequence else "end_turn")
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.server.model_id,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": answer.stop_sequence if answer is not None else None,
        }

    def error_reply(self, e: BadRequest) -> Response:
        return anthropic_error(str(e), e.status)


def anthropic_error(message: str, status: int) -> Response:
    """Anthropic's error shape."""
    return JSONResponse({"type": "error", "error": {"type": _error_type(status), "message": message}}, status)


def _error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


async def _after(first, events):
    """``first``, then the rest of ``events``."""
    if first is not None:
        yield first
    async for event in events:
        yield event


def _usage(usage: Usage) -> dict:
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _effort(thinking, max_tokens) -> str | None:
    """Anthropic's ``thinking`` as the chat body's reasoning effort; its budget is checked by Anthropic's
    rules (at least 1024, less than max_tokens), and the thought is bounded by max_tokens alone."""
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        return "none"
    if kind == "adaptive":
        return "medium"
    if kind != "enabled":
        raise BadRequest(
            'thinking must be {"type": "enabled", "budget_tokens": N}, {"type": "adaptive"} or {"type": "disabled"}',
            param="reasoning_effort",
        )
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1024:
        raise BadRequest(
            f"thinking.budget_tokens must be an integer of at least 1024, got {shown_json(budget)}",
            param="reasoning_effort",
        )
    if isinstance(max_tokens, int) and budget >= max_tokens:
        raise BadRequest(
            f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})", param="reasoning_effort"
        )
    return "high"


def _thinking(thought: str, signature: str | None = None) -> dict:
    return {
        "type": "thinking",
        "thinking": thought,
        "signature": _signature(thought) if signature is None else signature,
    }


def _signature(thought: str) -> str:
    """A thinking block's signature: a digest of its text (the model's earlier thoughts are not read again,
    so a client's round trip of it checks nothing)."""
    return hashlib.sha256(thought.encode()).hexdigest()


def _tool_use(name: str, arguments: str) -> dict:
    return {"type": "tool_use", "id": f"toolu_{secrets.token_hex(12)}", "name": name, "input": json.loads(arguments)}


def _text(value, name: str) -> str:
    """A string, or the text of a list of text blocks (``system``, a tool result's content)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in value):
        return "".join(str(b.get("text", "")) for b in value)
    raise BadRequest(f"{name} must be a string or a list of text blocks", param=name.partition("[")[0])


def _messages(message, index: int) -> list:
    """A message as chat messages: its tool results become tool messages before the rest of it, its
    tool_use blocks the assistant's tool_calls, its images image parts."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return [message]  # (a string content, or something the shared check refuses)
    parts, calls, results = [], [], []
    for block in message["content"]:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": block.get("tool_use_id"),
                    "content": _text(block.get("content") or "", f"messages[{index}]: a tool_result's content"),
                }
            )
        elif kind == "tool_use":
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input", {}))},
                }
            )
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), index)}})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # the model's earlier thoughts are not read again
        else:
            parts.append(block)  # text, or a kind the chat body refuses by name
    out = {**message, "content": parts}
    if calls:
        out["tool_calls"] = calls
    return results + ([out] if parts or calls or not results else [])


def _image_url(source, index: int) -> str:
    if isinstance(source, dict) and source.get("type") == "base64":
        return f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    if isinstance(source, dict) and source.get("type") == "url":
        return str(source.get("url"))
    raise BadRequest(
        f'messages[{index}]: an image block needs a source {{"type": "base64", "media_type": '
        '"image/png", "data": ...}',
        param="messages",
    )


def _tool(tool) -> dict:
    if not (isinstance(tool, dict) and isinstance(tool.get("name"), str) and tool.get("type") in (None, "custom")):
        raise BadRequest(
            'each tool must be {"name": ..., "input_schema": {a JSON schema}} (the server runs no server tools)',
            param="tools",
        )
    function = {"name": tool["name"], "parameters": tool.get("input_schema")}
    return {
        "type": "function",
        "function": {**function, **({"description": tool["description"]} if "description" in tool else {})},
    }


def _tool_choice(choice):
    """Anthropic's tool_choice as the chat body's."""
    if not isinstance(choice, dict):
        return choice
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if kind not in ("auto", "any", "none"):
        raise BadRequest(
            f'tool_choice type must be "auto", "any", "tool" or "none", got {shown_json(kind)}', param="tool_choice"
        )
    return {"any": "required"}.get(kind, kind)


def _sse(kind: str, **data) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


def routes(server: Server) -> list[Route]:
    async def messages(request):
        return await server.respond(request, Anthropic(server))

    async def count_tokens(request):
        return await server.count_tokens(request, Anthropic(server))

    return [
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ]
