"""The server's log of requests: at debug level each request as it arrives, its body in outline (long
text cut, long lists counted), and each refusal with its reason and the field at fault at info level (a failure of the
server's own at error level), numbered alike, so that what a client such as Open WebUI sends, and
when, can be read off the log."""

from __future__ import annotations

import json
import logging

log = logging.getLogger("mlx_dgemma.server")

TEXT_SHOWN = 60  # characters of a string the outline keeps
ITEMS_SHOWN = 16  # items of a list (the messages of a long chat) before the rest is only counted
DEPTH_SHOWN = 6  # levels of nesting before the rest is left out


def outline(value, depth: int = 0):
    """``value`` (a JSON body) small enough for one log line: strings past ``TEXT_SHOWN`` cut with their
    length, lists past ``ITEMS_SHOWN`` (such as a client's dozens of tools) as their length alone."""
    if isinstance(value, str):
        return value if len(value) <= TEXT_SHOWN else f"{value[:TEXT_SHOWN]}… ({len(value)} characters)"
    if not isinstance(value, (dict, list)):
        return value
    if depth >= DEPTH_SHOWN:
        return "…"
    if isinstance(value, dict):
        return {str(key)[:TEXT_SHOWN]: outline(item, depth + 1) for key, item in value.items()}
    if len(value) > ITEMS_SHOWN:
        return f"({len(value)} items)"
    return [outline(item, depth + 1) for item in value]


def arrived(number: int, path: str, body: dict) -> None:
    if log.isEnabledFor(logging.DEBUG):
        log.debug("#%d %s %s", number, path, json.dumps(outline(body), ensure_ascii=False))


def refused(number: int, path: str, status: int, message: str, param: str | None = None) -> None:
    """A 4xx (info) or a 5xx, the server's own failure (error), with the request field at fault."""
    field = f" ({param})" if param else ""
    if status < 500:
        log.info("#%d %s refused with %d%s: %s", number, path, status, field, message)
    else:
        log.error("#%d %s failed with %d%s: %s", number, path, status, field, message)
