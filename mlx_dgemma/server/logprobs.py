"""A request's log-probability fields (chat's ``logprobs`` and ``top_logprobs``, completions' ``logprobs``
and ``echo``) read, and the bound on the log-probabilities one reply may hold, checked before any forward."""

from __future__ import annotations

from ..engine.scoring import MAX_TOP_LOGPROBS
from ..validate import shown
from .api import BadRequest
from .body import typed
from .scheduler import Job

# Log-probabilities one reply may hold (each position's own and its most likely tokens', over every choice,
# an echoed prompt's included): one prompt as long as the released model's 256K context, scored with its
# most likely token. Each costs memory on the worker and bytes of the reply.
MAX_REPLY_LOGPROBS = 1 << 19


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
        raise BadRequest(
            "top_logprobs is for chat completions; on completions, logprobs is the number of most likely tokens",
            param="top_logprobs",
        )
    top = body.get("logprobs")
    if top is False:
        top = None
    if top is not None and not (isinstance(top, int) and not isinstance(top, bool) and 0 <= top <= MAX_TOP_LOGPROBS):
        raise BadRequest(
            f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS} (the most likely tokens given "
            f"per position), got {shown(top)}",
            param="logprobs",
        )
    return top, typed(body, "echo", bool, False)


def check_reply_logprobs(jobs: list[Job]) -> int:
    """The log-probabilities a request's reply may hold, at most: ``jobs`` are its choices, each resolved
    (its answer's budget known) or a prompt scored alone. Over ``MAX_REPLY_LOGPROBS`` it is refused,
    before any forward."""
    scored = [job for job in jobs if job.logprobs is not None]
    positions = [(len(job.ids) if job.echo else 0) + (job.resolved.max_tokens if job.resolved else 0) for job in scored]
    total = sum(count * (1 + job.logprobs) for count, job in zip(positions, scored))
    if total > MAX_REPLY_LOGPROBS:
        echoed = ", the echoed prompts' included," if any(job.echo for job in scored) else ""
        top = "top_logprobs" if scored[0].prompt_param == "messages" else "logprobs"
        raise BadRequest(
            f"the reply would hold {total:,} log-probabilities ({len(scored)} choices of up to {max(positions):,} "
            f"positions{echoed} each with its own and {top} {max(j.logprobs for j in scored)} more), over the "
            f"{MAX_REPLY_LOGPROBS:,} one reply may hold; send fewer prompts or choices, fewer tokens, a smaller "
            f"{top} or no echo",
            param=top,
        )
    return total
