"""OpenAI's chat completions and completions: ``POST /v1/chat/completions`` and ``/v1/completions`` take
the very bodies ``Server`` reads; the answer is a completion object, or its chunks as server-sent events."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator

from starlette.routing import Route

from .api import Answer, Api, Reply, error_body
from .app import Server
from .scheduler import Event, Usage


class OpenAI(Api):
    """OpenAI's chat completions and completions."""

    def __init__(self, server: Server, chat: bool):
        super().__init__(server)
        self.chat = chat

    def translate(self, body: dict) -> tuple[dict, bool]:
        return body, self.chat

    def reply(self, answer: Answer, reply: Reply) -> dict:
        return self.replies([answer], reply)

    def replies(self, answers: list[Answer], reply: Reply) -> dict:
        """A completion of ``n`` choices: their usage together, the prompt counted once (as OpenAI's)."""
        choices = []
        for index, answer in enumerate(answers):
            if reply.chat:
                choices.append({"index": index, "message": {"role": "assistant", **self._message(answer)},
                                "logprobs": None, "finish_reason": answer.finish})
            else:
                choices.append({"index": index, "text": answer.content, "logprobs": None,
                                "finish_reason": answer.finish})
        return {**self._head(reply, chunk=False), "choices": choices, "usage": _usage(*(a.usage for a in answers))}

    async def stream(self, events: AsyncIterator[Event], reply: Reply) -> AsyncIterator[str]:
        """Chunks of each choice's deltas as they come (``Event.choice`` its index); the usage of all
        once the last has finished."""
        head = self._head(reply, chunk=True)
        if reply.chat:
            yield _sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "finish_reason": None} for i in range(reply.n)]})
        usages = {}
        async for event in events:
            if event.error is not None:
                yield _sse(error_body(str(event.error), event.error.status, event.error.param))
                break
            yield _sse({**head, "choices": [self._delta(event, reply)]})
            if event.finish_reason is not None:
                usages[event.choice] = event.usage
                if reply.include_usage and len(usages) == reply.n:
                    yield _sse({**head, "choices": [], "usage": _usage(*usages.values())})
        yield "data: [DONE]\n\n"

    @staticmethod
    def _message(answer: Answer) -> dict:
        message = {"content": answer.content or (None if answer.calls else "")}
        if answer.reasoning:
            message["reasoning_content"] = answer.reasoning
        if answer.calls:
            message["tool_calls"] = [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
                                      "function": {"name": name, "arguments": arguments}}
                                     for name, arguments in answer.calls]
        return message

    def _delta(self, event: Event, reply: Reply) -> dict:
        if not reply.chat:
            return {"index": event.choice, "text": event.content, "logprobs": None, "finish_reason": event.finish_reason}
        delta, finish = {}, event.finish_reason
        if finish is not None and (reply.tools or reply.forced):
            # Tool-call text was held back until the end: now it becomes tool_calls.
            last = self.server.answer(event, reply)
            delta, finish = {k: v for k, v in self._message(last).items() if v}, last.finish
            for index, call in enumerate(delta.get("tool_calls", [])):
                call["index"] = index
        elif event.content:
            delta["content"] = event.content
        if event.reasoning:
            delta["reasoning_content"] = event.reasoning
        return {"index": event.choice, "delta": delta, "logprobs": None, "finish_reason": finish}

    def _head(self, reply: Reply, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if reply.chat else "text_completion"
        return {"id": reply.id, "object": kind, "created": int(time.time()), "model": self.server.model_id,
                "system_fingerprint": None}


def routes(server: Server) -> list[Route]:
    async def chat_completions(request):
        return await server.respond(request, OpenAI(server, chat=True))

    async def completions(request):
        return await server.respond(request, OpenAI(server, chat=False))

    return [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"])]


def _usage(first: Usage, *others: Usage) -> dict:
    """The usage of a request's choices together: the prompt counted once (OpenAI's), the completions summed."""
    completion = sum(u.completion_tokens for u in (first, *others))
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": sum(u.reasoning_tokens for u in (first, *others))}}


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"
