"""Anthropic's Messages API on the shared request model: ``POST /v1/messages`` (``system``, ``messages``
with text, image, ``tool_use`` and ``tool_result`` blocks, ``max_tokens``, ``stop_sequences``, ``tools``)
becomes a chat body; the answer is a message, or its events (``message_start`` … ``message_stop``);
errors are ``{"type": "error", "error": {"type": ..., "message": ...}}``."""

from __future__ import annotations

import json
import secrets

from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .api import MANY_STOP_STRINGS, Answer, Api, BadRequest, Reply, given
from .app import Server
from .scheduler import RequestFailed
from .settings import SETTINGS

PASSED = ("model", "max_tokens", "template", *SETTINGS)  # top_p and top_k among the settings
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


class Anthropic(Api):
    names = {"stop": "stop_sequences"}
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
        return given({**{k: body[k] for k in PASSED if k in body}, "messages": messages,
                      "stop": body.get("stop_sequences"), "stream": body.get("stream"),
                      "tools": [_tool(t) for t in tools or []] or None,
                      "tool_choice": _tool_choice(body.get("tool_choice"))}), True

    def reply(self, answer: Answer, reply: Reply) -> dict:
        blocks = ([{"type": "text", "text": answer.content}] if answer.content or not answer.calls else []) + \
            [_tool_use(name, arguments) for name, arguments in answer.calls]
        return {**self._message(blocks, answer), "usage": _usage(answer)}

    async def stream(self, events, reply: Reply):
        start = self._message([], None)
        yield _sse("message_start", message={**start, "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": 0}})
        text = None  # the text block's, once it is open
        async for piece in self.server.text_pieces(events, reply):
            if isinstance(piece, RequestFailed):
                yield _sse("error", error={"type": _error_type(piece.status), "message": str(piece)})
                return
            if text is None and (isinstance(piece, str) or not piece.calls):
                yield _sse("content_block_start", index=0, content_block={"type": "text", "text": ""})
                text = ""
            if isinstance(piece, str):
                text += piece
                yield _sse("content_block_delta", index=0, delta={"type": "text_delta", "text": piece})
                continue
            index = 0
            if text is not None:
                yield _sse("content_block_stop", index=0)
                index = 1
            for name, arguments in piece.calls:
                block = _tool_use(name, arguments)
                yield _sse("content_block_start", index=index, content_block={**block, "input": {}})
                yield _sse("content_block_delta", index=index, delta={"type": "input_json_delta",
                                                                      "partial_json": arguments})
                yield _sse("content_block_stop", index=index)
                index += 1
            final = self._message([], piece)
            yield _sse("message_delta", delta={"stop_reason": final["stop_reason"],
                                               "stop_sequence": final["stop_sequence"]}, usage=_usage(piece))
            yield _sse("message_stop")

    def _message(self, content: list[dict], answer: Answer | None) -> dict:
        stop_reason = None
        if answer is not None:
            stop_reason = STOP_REASONS.get(answer.finish, "stop_sequence" if answer.stop_sequence else "end_turn")
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.server.model_id,
                "content": content, "stop_reason": stop_reason,
                "stop_sequence": answer.stop_sequence if answer is not None else None}

    def error_reply(self, e: BadRequest) -> Response:
        return JSONResponse({"type": "error", "error": {"type": _error_type(e.status), "message": str(e)}}, e.status)


def _error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def _usage(answer: Answer) -> dict:
    usage = answer.usage
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}


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
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _text(block.get("content") or "", f"messages[{index}]")})
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input", {}))}})
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
    raise BadRequest(f'messages[{index}]: an image block needs a source {{"type": "base64", "media_type": '
                     '"image/png", "data": ...}', param="messages")


def _tool(tool) -> dict:
    if not (isinstance(tool, dict) and isinstance(tool.get("name"), str) and tool.get("type") in (None, "custom")):
        raise BadRequest('each tool must be {"name": ..., "input_schema": {a JSON schema}} (the server runs no '
                         'server tools)', param="tools")
    function = {"name": tool["name"], "parameters": tool.get("input_schema")}
    return {"type": "function", "function": {**function, **({"description": tool["description"]}
                                                          if "description" in tool else {})}}


def _tool_choice(choice):
    """Anthropic's tool_choice as the chat body's."""
    if not isinstance(choice, dict):
        return choice
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return {"any": "required"}.get(kind, kind)


def _sse(kind: str, **data) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


def routes(server: Server) -> list[Route]:
    async def messages(request):
        return await server.respond(request, Anthropic(server))

    return [Route("/v1/messages", messages, methods=["POST"])]
