"""Reasoning as the chat body asks for it: OpenAI's ``reasoning_effort`` (or ``reasoning: {"effort": ...}``),
which every other API's own field becomes (Responses' ``reasoning``, Anthropic's ``thinking``, Ollama's
``think``). Gemma 4's chat template has one switch, so an effort is on or off: "none" and "minimal"
are off, the rest on; the thought is bounded by the answer's max_tokens alone."""

from __future__ import annotations

from ..validate import shown_json
from .api import BadRequest

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
OFF = ("none", "minimal")


def effort(body: dict) -> str | None:
    """The body's reasoning effort (None: not asked for)."""
    value = body.get("reasoning_effort")
    if value is None and isinstance(reasoning := body.get("reasoning"), dict):
        value = reasoning.get("effort")
    elif value is None and body.get("reasoning") is not None:
        raise BadRequest('reasoning must be an object such as {"effort": "low"}', param="reasoning")
    if value is not None and value not in EFFORTS:
        raise BadRequest(
            f"reasoning_effort must be one of {', '.join(EFFORTS)}, got {shown_json(value)}", param="reasoning_effort"
        )
    return value


def thinks(body: dict, chat: bool, renders_thinking: bool, default: bool = False) -> bool:
    """Whether the request turns thinking on (``default``: the server's, for a chat request that does
    not say); a 400 where it cannot be."""
    value = effort(body)
    if value is None:
        return default and chat
    if value in OFF:
        return False
    if not chat:
        raise BadRequest(
            "reasoning needs the chat template: send messages to the chat endpoint, or leave reasoning_effort out",
            param="reasoning_effort",
        )
    if not renders_thinking:
        raise BadRequest(
            "this model's chat template has no thinking switch (enable_thinking); leave reasoning_effort out",
            param="reasoning_effort",
        )
    return True
