"""The OpenAI body's fields that shape a request's jobs: ``n`` choices, a completions request's
prompts, log-probabilities and echo, and the parameters this server refuses unless they are off."""

from __future__ import annotations

import dataclasses
import json

from .. import validate
from ..engine.scoring import MAX_TOP_LOGPROBS
from ..validate import shown
from .api import BadRequest
from .layout import typed
from .scheduler import Job

MAX_CHOICES = 8  # n: the choices of one request, each a row of the worker's batch
MAX_PROMPTS = 64  # a completions request's prompts, times n: its choices (each a row of the engine's batch)
# OpenAI parameters this server does not honour, each with the value that leaves it off: clients
# send those defaults, so they are accepted; anything else is refused by name. (user, metadata,
# store, service_tier and parallel_tool_calls change nothing here and are accepted as they come.)
UNSUPPORTED = {"best_of": 1, "logit_bias": {},
               "suffix": "", "functions": [],
               "function_call": "none", "modalities": ["text"], "audio": None, "prediction": None,
               "web_search_options": None}



def choice(job: Job, index: int) -> Job:
    """Choice ``index`` of a request with ``n`` > 1: its first choice's job at seed + ``index`` (modulo
    2**64), or unseeded as the first is; so each choice is the answer the request alone gets at that seed."""
    seed = job.args.seed
    args = dataclasses.replace(job.args, seed=None if seed is None else (seed + index) % validate.SEED_LIMIT)
    resolved = None if job.resolved is None else dataclasses.replace(job.resolved, args=args)
    return dataclasses.replace(job, args=args, resolved=resolved)


def prompts(body: dict) -> list:
    """A completions request's prompts: a string, a list of token ids, or a list of either (one choice
    each, at most ``MAX_PROMPTS``); a list of one string is that string."""
    prompt = body.get("prompt")
    if not (isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)):
        return [prompt]
    if len(prompt) > MAX_PROMPTS:
        raise BadRequest(f"prompt holds {len(prompt)} prompts, more than the {MAX_PROMPTS} one request takes; "
                         "send them in several requests", param="prompt")
    return prompt


def logprobs(body: dict, chat: bool) -> tuple[int | None, bool]:
    """The most likely tokens a request's log-probabilities give per position (None: no log-probabilities),
    and whether a completion echoes its prompt: chat's ``logprobs`` (true or false) and ``top_logprobs``,
    completions' ``logprobs`` (the number) and ``echo``."""
    if chat:
        if typed(body, "echo", bool, False):
            raise BadRequest("echo is for completions; leave it out or send false", param="echo")
        on, top = typed(body, "logprobs", bool, False), typed(body, "top_logprobs", int, None)
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"top_logprobs must be from 0 to {MAX_TOP_LOGPROBS}, got {top}", param="top_logprobs")
        if top and not on:
            raise BadRequest("top_logprobs needs logprobs true", param="top_logprobs")
        return (top or 0) if on else None, False
    if body.get("top_logprobs") not in (None, 0):
        raise BadRequest("top_logprobs is for chat completions; on completions, logprobs is the number of most "
                         "likely tokens", param="top_logprobs")
    top = body.get("logprobs")
    if top is False:
        top = None
    if top is not None and not (isinstance(top, int) and not isinstance(top, bool) and 0 <= top <= MAX_TOP_LOGPROBS):
        raise BadRequest(f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS} (the most likely tokens given "
                         f"per position), got {shown(top)}", param="logprobs")
    return top, typed(body, "echo", bool, False)


def check_supported(body: dict, chat: bool) -> None:
    for key, off in UNSUPPORTED.items():
        value = body.get(key)
        if key == "suffix" and not chat:  # completions fill the middle
            continue
        if value is not None and not (value == off and isinstance(value, bool) == isinstance(off, bool)):
            leave = "leave it out" if off is None else f"leave it out or send {json.dumps(off)}"
            raise BadRequest(f"{key} is not supported by this server; {leave}", param=key)


