"""Chat templates rendered within bounds: a template is code (an operator's ``--chat-template``, a
checkpoint's file), and jinja's sandbox keeps it from the host but not from looping for ever or doubling a
string until memory runs out. Here every render has a deadline and a most characters: the deadline is
checked at every item a loop takes, every call, attribute, operator and concatenation, and every piece
of output; the size before a string, list or number grows (``+``, ``*``, ``%``, ``**``, ``~``, and the
filters and methods that lengthen text) and after every call. Past either, ``RenderLimitError``."""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from dataclasses import dataclass
from datetime import datetime

RENDER_SECONDS = 2.0  # a real template renders a long conversation in milliseconds
RENDER_CHARS = 1 << 25  # characters any string (or list) of a render may reach, its output included


@dataclass(frozen=True)
class RenderLimit:
    seconds: float = RENDER_SECONDS
    chars: int = RENDER_CHARS


class RenderLimitError(Exception):
    """A render that ran past its deadline or grew past its characters (``size``: the text that did;
    None for the deadline)."""

    def __init__(self, message: str, size: int | None = None):
        super().__init__(message)
        self.size = size


_budget = threading.local()  # the render running on this thread: its deadline and characters


def _check_time() -> None:
    limit = getattr(_budget, "limit", None)
    if limit is not None and time.monotonic() > _budget.deadline:
        raise RenderLimitError(f"rendering ran past {limit.seconds:g} s (a loop without end?)")


def _check_size(size: int) -> None:
    limit = getattr(_budget, "limit", None)
    if limit is not None and size > limit.chars:
        raise RenderLimitError(f"rendering grew a text of {size:,} characters, past the {limit.chars:,} allowed", size)


def _sized(value) -> int:
    return len(value) if isinstance(value, (str, list, tuple)) else 0


def _grown(name: str, obj, args: tuple, kwargs: dict) -> int:
    """The size a filter or method that lengthens text would give, known before it runs (0: none of those)."""
    arg = args[0] if args else None
    if name == "tojson":
        indent = kwargs.get("indent", arg)
        return (len(json.dumps(obj, default=str)) + 1) * (1 + indent) if isinstance(indent, int) and indent > 0 else 0
    if not isinstance(obj, str):
        if name == "join" and isinstance(obj, (list, tuple)):  # the join filter
            return sum(len(str(item)) for item in obj) + len(obj) * len(str(kwargs.get("d", arg or "")))
        return 0
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        return len(obj) + (obj.count(args[0]) if args[0] else len(obj) + 1) * len(args[1])
    if name in ("center", "ljust", "rjust", "zfill") and isinstance(arg, int):
        return max(len(obj), arg)
    if name == "indent":
        width = kwargs.get("width", arg if arg is not None else 4)
        return len(obj) + (obj.count("\n") + 1) * (width if isinstance(width, int) else len(str(width)))
    if name == "expandtabs":
        return len(obj) * max(1, arg if isinstance(arg, int) else 8)
    if name == "join" and isinstance(arg, (list, tuple)):  # str.join
        return sum(map(_sized, arg)) + len(obj) * len(arg)
    if name == "format":
        return _formatted(obj, [*args, *kwargs.values()])
    return 0


def _formatted(text: str, values) -> int:
    """At most the length of ``text`` formatted with ``values`` (``%`` or ``str.format``): its own, the
    values' and every field width it asks for (``%9s``, ``{:>9}``)."""
    widths = sum(int(width) for width in re.findall(r"[%:][^a-zA-Z%{}]*?(\d+)", text))
    return len(text) + widths + sum(len(str(value)) for value in values)


def _bounded_filter(name: str, function):
    """``function`` (a jinja filter) bounded. The wrapper takes the context, as jinja's own filters that
    read it do, so that the compiler never runs it on constants ahead of a render (outside its bounds)."""
    from jinja2 import pass_context

    passes = getattr(getattr(function, "jinja_pass_arg", None), "name", None)  # (context, eval_context...)

    def bounded(context, value, *args, **kwargs):
        _check_time()
        _check_size(_grown(name, value, args, kwargs))
        first = {"context": context, "eval_context": context.eval_ctx, "environment": context.environment}
        result = function(*([first[passes]] if passes in first else []), value, *args, **kwargs)
        _check_size(_sized(result))
        return result

    return pass_context(bounded)


def _bounded_iter(iterable):
    for item in iterable:
        _check_time()
        yield item


def _bounded_concat(*parts) -> str:
    _check_time()
    texts = [str(part) for part in parts]
    _check_size(sum(map(len, texts)))
    return "".join(texts)


@functools.lru_cache(maxsize=1)
def _environment_class():
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    class Bounded(NodeTransformer):
        """Every loop's items and every ``~`` through the environment's bounded helpers."""

        def visit_For(self, node):
            node = self.generic_visit(node)
            node.iter = nodes.Call(nodes.EnvironmentAttribute("bounded_iter"), [node.iter], [], None, None)
            return node

        def visit_Concat(self, node):
            node = self.generic_visit(node)
            return nodes.Call(nodes.EnvironmentAttribute("bounded_concat"), node.nodes, [], None, None)

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"+", "*", "%", "**"})
        bounded_iter = staticmethod(_bounded_iter)
        bounded_concat = staticmethod(_bounded_concat)

        def _parse(self, source, name, filename):
            return Bounded().visit(super()._parse(source, name, filename))

        def call_binop(self, context, operator, left, right):
            _check_time()
            if operator == "*" and isinstance(right, int) and _sized(left):
                _check_size(_sized(left) * right)
            elif operator == "*" and isinstance(left, int) and _sized(right):
                _check_size(_sized(right) * left)
            elif operator == "+":
                _check_size(_sized(left) + _sized(right))
            elif operator == "%" and isinstance(left, str):
                _check_size(_formatted(left, right if isinstance(right, (tuple, list)) else [right]))
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
                _check_size(right * max(abs(left).bit_length() - 1, 0) // 8)  # (its bytes)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
            _check_time()
            method = getattr(__obj, "__wrapped__", __obj)  # (the sandbox's own str.format wraps the method)
            _check_size(_grown(getattr(method, "__name__", ""), getattr(method, "__self__", None), args, kwargs))
            result = super().call(__context, __obj, *args, **kwargs)
            _check_size(_sized(result))
            return result

        def getattr(self, obj, attribute):
            _check_time()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            _check_time()
            return super().getitem(obj, argument)

    return BoundedEnvironment


@functools.lru_cache(maxsize=8)
def compiled(template: str):
    """A template compiled once (as transformers does, sandboxed with trimmed blocks): compiling costs
    ~5 ms, a whole demo answer ~50."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols

    def raise_exception(message):
        raise TemplateError(message)

    env = _environment_class()(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.filters = {name: _bounded_filter(name, function) for name, function in env.filters.items()}
    env.globals.pop("lipsum", None)  # (text of any length, for no template's use)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render(template: str, limit: RenderLimit = RenderLimit(), **context) -> str:
    """``template`` rendered with ``context`` within ``limit`` (``RenderLimitError`` past it)."""
    compiled_template = compiled(template)  # (compiling is bounded by the template's own length)
    _budget.limit, _budget.deadline = limit, time.monotonic() + limit.seconds
    try:
        size, pieces = 0, []
        for piece in compiled_template.generate(**context):
            _check_time()
            size += len(piece)
            _check_size(size)
            pieces.append(piece)
        return "".join(pieces)
    finally:
        _budget.limit = None
