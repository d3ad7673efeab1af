"""OpenAI's chat completions and completions: ``POST /v1/chat/completions`` and ``/v1/completions`` take
the very bodies ``Server`` reads; the answer is a completion object (a choice per prompt of a completions
prompt array), or its chunks as server-sent events. Log-probabilities (scoring.py) take chat's shape
(``logprobs.content``) or completions' (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``),
each with ``sampled_from``: what drew the tokens, the encoder whose numbers these are or the denoiser."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator

from starlette.routing import Route

from ..engine.scoring import TokenLogprob
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
        """A completion of each choice (``n`` per prompt, prompt by prompt): their usage together, each
        prompt counted once (as OpenAI's)."""
        choices = []
        for index, answer in enumerate(answers):
            if reply.chat:
                choices.append(
                    {
                        "index": index,
                        "message": {"role": "assistant", **self._message(answer)},
                        "logprobs": self._chat_logprobs(answer) if reply.logprobs else None,
                        "finish_reason": answer.finish,
                    }
                )
                continue
            echo = reply.echoes[index] if reply.echoes else ""
            logprobs = None
            if reply.logprobs:
                kept = _kept(self.tokenizer, answer.logprobs, answer.content if answer.stop_sequence else None)
                logprobs = self._legacy_logprobs(
                    (answer.prompt_logprobs or []) + kept,
                    answer.sampled_from,
                    len(echo),
                    len(answer.prompt_logprobs or []),
                )
            choices.append(
                {"index": index, "text": echo + answer.content, "logprobs": logprobs, "finish_reason": answer.finish}
            )
        return {
            **self._head(reply, chunk=False),
            "choices": choices,
            "usage": _usage([answer.usage for answer in answers], reply.n),
        }

    async def stream(self, events: AsyncIterator[Event], reply: Reply) -> AsyncIterator[str]:
        """Chunks of each choice's deltas as they come (``Event.choice`` its index); the usage of all
        once the last has finished."""
        head = self._head(reply, chunk=True)
        if reply.chat:
            yield _sse(
                {
                    **head,
                    "choices": [
                        {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                        for i in range(reply.n)
                    ],
                }
            )
        choices = reply.n * reply.prompts
        echoes = list(reply.echoes) if reply.echoes else [""] * choices
        offsets = [0] * choices  # (completions' text_offset: where each choice's next text starts)
        usages = {}

        def chunk(event: Event) -> str:
            if reply.chat:
                choice = self._delta(event, reply)
            else:
                choice = self._text_delta(event, reply, echoes[event.choice], offsets[event.choice])
                offsets[event.choice] += len(choice["text"])
                echoes[event.choice] = ""
            return _sse({**head, "choices": [choice]})

        async for event in events:
            if event.error is not None:
                yield _sse(error_body(str(event.error), event.error.status, event.error.param))
                break
            # A chunk of log-probabilities (an echoed prompt's: thousands of entries, each token decoded) is
            # written off the event loop, as a whole reply is.
            yield await self.server.off_loop(chunk, event) if event.logprobs or event.prompt_logprobs else chunk(event)
            if event.finish_reason is not None:
                usages[event.choice] = event.usage
                if reply.include_usage and len(usages) == choices:
                    yield _sse({**head, "choices": [], "usage": _usage([usages[i] for i in range(choices)], reply.n)})
        yield "data: [DONE]\n\n"

    @property
    def tokenizer(self):
        return self.server.tokenizer

    def _chat_logprobs(self, answer: Answer) -> dict:
        kept = _kept(self.tokenizer, answer.logprobs, answer.content if answer.stop_sequence else None)
        return {
            "content": [self._chat_entry(entry) for entry in kept],
            "refusal": None,
            "sampled_from": answer.sampled_from,
        }

    def _chat_entry(self, entry: TokenLogprob) -> dict:
        def described(token: int, logprob: float) -> dict:
            text = _shown(self.tokenizer, token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            **described(entry.token, entry.logprob),
            "top_logprobs": [described(token, logprob) for token, logprob in entry.top],
        }

    def _legacy_logprobs(
        self,
        entries: list[TokenLogprob],
        sampled_from: str | None,
        answer_offset: int,
        prompt_entries: int,
        offset: int = 0,
    ) -> dict:
        """Completions' shape; the text offsets count each token's text from ``offset`` (the answer's
        first token, the ``prompt_entries``-th entry, at ``answer_offset``: after the echoed text)."""
        tokens, offsets = [], []
        for i, entry in enumerate(entries):
            offset = answer_offset if i == prompt_entries else offset
            tokens.append(_shown(self.tokenizer, entry.token))
            offsets.append(offset)
            offset += len(self.tokenizer.decode([entry.token]))
        logprobs = {
            "tokens": tokens,
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [
                None
                if entry.logprob is None
                else {_shown(self.tokenizer, token): logprob for token, logprob in entry.top}
                for entry in entries
            ],
            "text_offset": offsets,
        }
        if sampled_from is not None:
            logprobs["sampled_from"] = sampled_from
        return logprobs

    def _text_delta(self, event: Event, reply: Reply, echo: str, offset: int) -> dict:
        """A completions chunk (the first: after the echoed prompt)."""
        logprobs = None
        if reply.logprobs:
            prompt = event.prompt_logprobs or []
            logprobs = self._legacy_logprobs(
                prompt + (event.logprobs or []), event.sampled_from, offset + len(echo), len(prompt), offset
            )
        return {
            "index": event.choice,
            "text": echo + event.content,
            "logprobs": logprobs,
            "finish_reason": event.finish_reason,
        }

    @staticmethod
    def _message(answer: Answer) -> dict:
        message = {"content": answer.content or (None if answer.calls else ""), "refusal": None}
        if answer.reasoning:
            message["reasoning_content"] = answer.reasoning
        if answer.calls:
            message["tool_calls"] = [
                {
                    "id": f"call_{secrets.token_hex(12)}",
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
                for name, arguments in answer.calls
            ]
        return message

    def _delta(self, event: Event, reply: Reply) -> dict:
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
        logprobs = None
        if reply.logprobs:
            logprobs = {"content": [self._chat_entry(entry) for entry in event.logprobs or []], "refusal": None}
            if event.sampled_from is not None:
                logprobs["sampled_from"] = event.sampled_from
        return {"index": event.choice, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def _head(self, reply: Reply, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if reply.chat else "text_completion"
        return {
            "id": reply.id,
            "object": kind,
            "created": int(time.time()),
            "model": self.server.model_id,
        }


def routes(server: Server) -> list[Route]:
    async def chat_completions(request):
        return await server.respond(request, OpenAI(server, chat=True))

    async def completions(request):
        return await server.respond(request, OpenAI(server, chat=False))

    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]


def _shown(tokenizer, token: int) -> str:
    """A token as its entry shows it: its text, or a special token's name (``<eos>``)."""
    return tokenizer.decode([token]) or tokenizer.piece(token)


def _kept(tokenizer, entries: list[TokenLogprob], text: str | None) -> list[TokenLogprob]:
    """The entries of the tokens whose text starts within ``text`` (an answer a stop string cut;
    None: all of them)."""
    if text is None:
        return entries
    kept, offset = [], 0
    for entry in entries:
        if offset >= len(text):
            break
        kept.append(entry)
        offset += len(tokenizer.decode([entry.token]))
    return kept


def _usage(usages: list[Usage], n: int = 1) -> dict:
    """The usage of a request's choices together (``n`` of each prompt, in a row): each prompt counted
    once (OpenAI's), the completions summed."""
    prompts = usages[::n]
    prompt, completion = sum(u.prompt_tokens for u in prompts), sum(u.completion_tokens for u in usages)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in prompts)},
        "completion_tokens_details": {"reasoning_tokens": sum(u.reasoning_tokens for u in usages)},
    }


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"
