"""What every API the server speaks is: an ``Api`` (a translation of its JSON into the chat or
completions body ``Server`` reads, and of the ``Answer`` back into its own shape), the ``Reply`` that
shapes a request's answer, and ``BadRequest`` with OpenAI's error shape."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.responses import JSONResponse, Response

from ..engine.scoring import TokenLogprob
from .scheduler import Event, Usage

MAX_STOP_STRINGS = 4  # OpenAI's limit (Api.max_stop)
# APIs with no small limit of their own (Ollama's, Anthropic's): editors send several for tab completion.
MANY_STOP_STRINGS = 16


class BadRequest(Exception):
    """A request answered with a 4xx (or a worker's 5xx) in its API's error shape. Messages and ``param``
    name fields as the chat and completions bodies do; ``Api.renamed`` gives them an API's own names."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def error_body(message: str, status: int = 400, param: str | None = None, code: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(message: str, status: int = 400, param: str | None = None, code: str | None = None):
    return JSONResponse(error_body(message, status, param, code), status)


@dataclass
class Reply:
    """How to shape the worker's text for one request."""

    chat: bool
    stream: bool
    include_usage: bool
    tools: bool  # tool calls in the answer are parsed out ("auto")
    # The functions a forced call is to: one (the answer is its arguments) or several (the answer is
    # tool_calls.call_choice_schema's {"name", "arguments"}); none where no call is forced.
    forced: tuple[str, ...]
    id: str = ""
    prompt_tokens: int = 0
    n: int = 1  # choices (OpenAI's n) per prompt, each its own job
    prompts: int = 1  # a completions request's prompts (choices: n of each, prompt by prompt)
    logprobs: bool = False  # the answer's log-probabilities go with it
    echoes: list[str] | None = None  # (completions' echo) each choice's prompt text, which the choice starts with
    held_logprobs: int = 0  # the log-probabilities the reply may hold, at most (logprobs.check_reply_logprobs)


@dataclass
class Answer:
    """A finished answer (or a stream's last piece): its text, thought channel, tool calls as (name,
    arguments as JSON text), finish reason ("tool_calls" when there are calls), and usage."""

    content: str
    reasoning: str
    calls: list[tuple[str, str]]
    finish: str
    usage: Usage | None = None
    stop_sequence: str | None = None  # the stop string that ended it
    # With logprobs (scoring.py): the answer's tokens', the prompt's (with echo), and what drew the tokens.
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    sampled_from: str | None = None


class Api:
    """One API over the shared request model. ``translate`` turns its body into a chat or completions
    body (None: nothing to generate, answered by ``empty``); ``reply`` shapes a whole answer,
    ``stream`` the events of a streamed one, ``error_reply`` an error. One instance per request: a
    translation may keep what its answer needs."""

    stream_type = "text/event-stream"
    names: dict[str, str] = {}  # chat and completions fields this API calls otherwise
    max_stop = MAX_STOP_STRINGS  # stop strings a request may give
    # Whether max_tokens is a cap, cut to what the context leaves (Ollama's num_predict), or a promise
    # that a request the context cannot keep breaks with a 400 (OpenAI's and Anthropic's max_tokens).
    caps_max_tokens = False

    def __init__(self, server):  # the Server it answers for
        self.server = server
        # What the API calls each chat message ("messages[2]", "input[0]"; None: the system prompt it
        # became), when that is not the chat message's own index.
        self.origins: list[str | None] | None = None
        self.translated = False  # set once ``translate`` returned: errors before that already use this API's names

    def translate(self, body: dict) -> tuple[dict, bool] | None:
        raise NotImplementedError

    def reply(self, answer: Answer, reply: Reply) -> dict:
        raise NotImplementedError

    def replies(self, answers: list[Answer], reply: Reply) -> dict:
        """The reply of a request's whole answers, one per choice (only OpenAI's APIs take ``n`` and several
        prompts)."""
        (answer,) = answers
        return self.reply(answer, reply)

    def stream(self, events: AsyncIterator[Event], reply: Reply) -> AsyncIterator[str]:
        raise NotImplementedError

    def error_reply(self, e: BadRequest) -> Response:
        return error_response(str(e), e.status, e.param, e.code)

    def empty(self) -> Response:
        raise NotImplementedError

    def renamed(self, e: BadRequest) -> BadRequest:
        """``e`` with this API's field names (and its own message indices)."""
        if not self.translated:
            return e
        message, param = str(e), e.param
        if self.origins is not None and param == "messages":
            message = re.sub(r"messages\[(\d+)\]", lambda m: self._message_name(int(m.group(1))), message)
        if param in self.names:
            message = re.sub(rf"(?<![\w.]){re.escape(param)}(?![\w\[])", self.names[param], message)
            param = self.names[param]
        return BadRequest(message, param, e.code, e.status)

    def _message_name(self, index: int) -> str:
        return (self.origins[index] if index < len(self.origins) else None) or "the system prompt"


def given(fields: dict) -> dict:
    """A translated body: the fields its request gave (None is left out, as the chat body reads it)."""
    return {k: v for k, v in fields.items() if v is not None}
