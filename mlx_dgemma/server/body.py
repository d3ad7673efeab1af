"""Request bodies read as JSON objects, refused with a 400 naming what is wrong, and large replies
written as JSON, without holding the interpreter for long.

Python's C reader never lets go of the GIL while it runs, so on a prepare thread a body of millions of
values (25 MiB of ``[]``, of numbers) would still pause the event loop, and the worker's Python, for its
whole parse: up to seconds. A body with few values is read by it at once (milliseconds); one with more
is read by the pure-Python reader, between whose steps the interpreter switches threads, with its
arrays and objects counted: each is work for the garbage collector, whose full passes hold the GIL too.
A reply is written a piece at a time for the same reason (2,048 embeddings of 2,816 floats are 3 s of
``json.dumps`` in one call). ``typed`` reads one field of a body, of its type.
"""

from __future__ import annotations

import itertools
import json
import json.decoder
import json.scanner

from starlette.responses import Response

from ..validate import shown_json
from . import request_log
from .api import BadRequest

FAST_VALUES = 1 << 16  # at most this many values (by the body's commas and brackets): the C reader's
MAX_CONTAINERS = 1 << 18  # arrays and objects in one body (a request has a few thousand at most)


class NotJson(str):
    """What Python's JSON reader makes of NaN, Infinity and -Infinity here: their name, to be refused."""


class TooManyContainers(ValueError):
    """A body of more than ``MAX_CONTAINERS`` arrays and objects."""


def loads(body: bytes):
    """``body``'s JSON value (NaN and Infinity as ``NotJson``); a ValueError (or RecursionError, nested
    too deep) where it is not JSON, ``TooManyContainers`` past the bound."""
    if body.count(b",") + body.count(b"[") + body.count(b"{") <= FAST_VALUES:
        return json.loads(body, parse_constant=NotJson)
    text = body.decode(json.detect_encoding(body), "surrogatepass")  # (as json.loads reads bytes)
    return _stepwise().decode(text)


def _stepwise() -> json.JSONDecoder:
    """A decoder whose values are read by Python code (strings by the C scanner, a string at a time)."""
    decoder = json.JSONDecoder(parse_constant=NotJson)
    containers = itertools.count(1)

    def counted(parse):
        def parse_counted(*args):
            if next(containers) > MAX_CONTAINERS:
                raise TooManyContainers(f"the request body holds more than {MAX_CONTAINERS} arrays and objects")
            return parse(*args)

        return parse_counted

    decoder.parse_array = counted(json.decoder.JSONArray)
    decoder.parse_object = counted(json.decoder.JSONObject)
    decoder.scan_once = json.scanner.py_make_scanner(decoder)
    return decoder


def parsed(body: bytes, number: int | None, path: str) -> dict:
    """``parse_body``, then the request outlined in the log as request ``number`` of ``path``."""
    data = parse_body(body)
    if number is not None:
        request_log.arrived(number, path, data)
    return data


def parse_body(body: bytes) -> dict:
    """A request body as a JSON object, refused with a 400 unless it is one (NaN and Infinity included,
    which Python's reader takes)."""
    try:
        data = loads(body)
    except TooManyContainers as e:
        raise BadRequest(f"{e}; send fewer", code="request_too_large", status=413) from None
    except (ValueError, RecursionError) as e:  # (bad UTF-8, an integer past Python's digit limit, deep nesting)
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    if any(isinstance(v, NotJson) for v in leaves(data)):  # a reply echoing NaN or Infinity cannot be written
        field, bad = _not_json(data)
        raise BadRequest(f"{field} is {bad}, which is not JSON; send a number or null", param=field)
    return data


def _not_json(data: dict) -> tuple[str, str]:
    """The first NaN or Infinity in ``data`` and the field that holds it, named as the client sent it
    (``options.temperature``, ``messages[0].content``; a long key cut)."""
    stack = [(data, "")]
    while stack:
        value, field = stack.pop()
        if isinstance(value, NotJson):
            return field, value
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in reversed(list(items)):
            name = (
                f"[{key}]"
                if isinstance(value, list)
                else (f"{'.' if field else ''}{key if len(key) <= 40 else key[:37] + '...'}")
            )
            stack.append((item, field + name))
    raise AssertionError("no NaN or Infinity in data")


def check_unicode(body: dict) -> None:
    """Text that UTF-8 cannot encode (lone surrogates, as JSON's "\\ud800" makes) is refused by its field."""
    for key, value in body.items():
        for text in strings([key, value]):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                name = key if key.isascii() else None
                raise BadRequest(
                    f"{name or 'a key'} holds text that is not valid Unicode (a lone surrogate such "
                    "as \\ud800); send UTF-8 text",
                    param=name,
                ) from None


def json_reply(content, status: int = 200) -> Response:
    """``content`` as a JSON response, as starlette's ``JSONResponse`` writes it (no NaN), its arrays of
    arrays and objects written an item at a time."""
    return Response("".join(_pieces(content)).encode(), status, media_type="application/json")


def _pieces(value):
    if isinstance(value, dict):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield f"{',' if i else ''}{_dumps(key if isinstance(key, str) else str(key))}:"
            yield from _pieces(item)
        yield "}"
    elif isinstance(value, list) and value and isinstance(value[0], (dict, list)):
        yield "["
        for i, item in enumerate(value):
            if i:
                yield ","
            yield from _pieces(item)
        yield "]"
    else:
        yield _dumps(value)


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def leaves(value):
    """Every string, number, bool and null in a JSON value, keys included (looked at without recursion:
    a body may nest deep)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            stack += item
        else:
            yield item


def strings(value):
    """Every string in a JSON value, keys included."""
    return (item for item in leaves(value) if isinstance(item, str))


def typed(body: dict, key: str, kind, default):
    """``body[key]``, of type ``kind`` (a 400 naming it otherwise), or ``default`` when it is absent."""
    value = body.get(key)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):  # JSON true is no number
        names = " or ".join(k.__name__ for k in kinds)
        raise BadRequest(f"{key} must be of type {names}, got {shown_json(value)}", param=key)
    return value
