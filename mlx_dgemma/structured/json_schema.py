"""JSON from a schema: the canvas template of a value that always parses and validates.

``json_template`` builds the template (template.py) from a JSON schema: brackets, keys and separators
clamped, each value a hole limited to the tokens its type allows (string characters, digits, an enum's
choices); the output is rendered from the hole values (numbers clamped to their range, strings cut to
their ``maxLength``, unused optional array items dropped), so it always parses and validates. A schema
whose answer could not validate (a ``required`` key that is not a property, an enum value not of
the schema's type or not JSON, a bound no float holds) is refused, as is any feature the clamps
cannot express. docs/templates.md has the whole list.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import TemplateError
from ..validate import shown_json
from .template import FREE, TEMPLATE_LIMIT, CanvasTemplate, Hole, literal_tokens

DEFAULT_STRING = 16  # tokens of a string value without maxLength
DEFAULT_DIGITS = 6  # digits of an integer without a maximum
DECIMALS = 4  # fractional digits a number hole leaves room for
MAX_DEPTH = 64  # nesting levels of a schema
MAX_CHOICES = 1000  # values of one enum (OpenAI's structured outputs allow 1000 in a whole schema)

_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment"}
_SUPPORTED = {
    "object": {"type", "properties", "required", "additionalProperties"},
    "array": {"type", "items", "minItems", "maxItems"},
    "string": {"type", "minLength", "maxLength"},
    "integer": {"type", "minimum", "maximum"},
    "number": {"type", "minimum", "maximum"},
    "boolean": {"type"},
    "null": {"type"},
}
_PYTHON_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
_TOO_LONG = "lower its maxItems, maxLength or maximum"


@dataclass
class _Builder:
    tokenizer: Any
    limit: int = TEMPLATE_LIMIT
    tokens: list[int] = field(default_factory=list)
    holes: list[tuple[int, Hole]] = field(default_factory=list)
    depth: int = 0

    def text(self, s: str, path: str) -> None:
        self.tokens += literal_tokens(self.tokenizer, s)
        self.room(0, path, "shorten its keys and const or enum values")

    def hole(self, hole: Hole) -> int:
        self.room(hole.size, hole.where)
        self.holes.append((len(self.tokens), hole))
        self.tokens += [FREE] * hole.size
        return len(self.holes) - 1

    def room(self, size: int, path: str, fix: str = _TOO_LONG) -> None:
        """Refuse, before building it, what would take the template past the model's context."""
        if len(self.tokens) + size > self.limit:
            raise TemplateError(
                f"schema at {path} takes the template past the model's context of {self.limit} positions; {fix}"
            )


def _count(schema: dict, key: str, path: str, default: int) -> int:
    """A schema's item or length bound: a non-negative integer."""
    value = schema.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or value < 0
        or (isinstance(value, float) and not value.is_integer())
    ):
        raise TemplateError(f"{key} at {path} must be a non-negative integer, got {json.dumps(value)}")
    return int(value)


def _bound(schema: dict, key: str, path: str) -> int | float | None:
    """A schema's minimum or maximum: a finite number that fits a float (integers kept exact), or None."""
    value = schema.get(key)
    if value is None:
        return None
    if not _is_number(value):
        raise TemplateError(f"{key} at {path} must be a finite number, got {json.dumps(value)}")
    if abs(value) > sys.float_info.max:  # (Python compares an int with a float exactly)
        raise TemplateError(
            f"{key} at {path} is an integer of more than 308 digits; a bound must fit a float "
            f"(at most {sys.float_info.max:.1e})"
        )
    return value


def _is_number(value: Any) -> bool:
    """A JSON number: an int or a finite float, not a bool."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and math.isfinite(value)
    )


def _is_type(value: Any, kind: str) -> bool:
    """``value`` is of JSON schema type ``kind`` (1.0 is an integer, True is not)."""
    if kind in ("integer", "number"):
        return _is_number(value) and (kind == "number" or isinstance(value, int) or value.is_integer())
    return isinstance(value, _PYTHON_TYPES[kind])


def check_required(schema: dict, path: str = "$") -> None:
    """An object schema's ``required``: a list of keys, each one of its ``properties`` (the template
    writes those keys only)."""
    required, properties = schema.get("required", []), schema.get("properties") or {}
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
        raise TemplateError(f"required at {path} must be a list of property names, got {shown_json(required, 60)}")
    for key in required:
        if key not in properties:
            raise TemplateError(
                f"required key {json.dumps(key)} at {path} is not in its properties; add it to "
                "properties or drop it from required"
            )


_NO_DRAFT = object()


def json_template(tokenizer, schema: dict, draft: Any = _NO_DRAFT, limit: int | None = None) -> CanvasTemplate:
    """The template of a JSON value of ``schema``; its ``render`` gives the Python value.

    ``draft`` (a value parsed from a free generation, say) sizes the holes: a string or integer hole
    as long as the draft's value there (within the schema's bounds), an array with the draft's
    number of items. Holes at their value's length keep the model's layout; upper-bound holes make
    it stretch values towards the clamped text after them. ``limit`` (the model's context) bounds
    the positions the template may take."""
    if not isinstance(schema, dict):
        raise TemplateError(f"a JSON schema is an object, got {type(schema).__name__}")
    builder = _Builder(tokenizer, TEMPLATE_LIMIT if limit is None else limit)
    value_of = _node(builder, schema, "$", draft)
    return CanvasTemplate(builder.tokens, builder.holes, render=value_of)


def _node(b: _Builder, schema: dict, path: str, draft: Any = _NO_DRAFT) -> Callable[[list[str]], Any]:
    """Append the schema's layout to ``b``; return the function that reads its value from hole texts."""
    if b.depth >= MAX_DEPTH:
        raise TemplateError(f"schema at {path[:60]}…: nested deeper than {MAX_DEPTH} levels; flatten it")
    b.depth += 1
    try:
        return _layout(b, schema, path, draft)
    finally:
        b.depth -= 1


def _layout(b: _Builder, schema: dict, path: str, draft: Any) -> Callable[[list[str]], Any]:
    if not isinstance(schema, dict):
        raise TemplateError(f"schema at {path} must be an object, got {json.dumps(schema)}")
    if "const" in schema or "enum" in schema:
        values, texts = _listed_values(schema, path)
        if "const" in schema:
            b.text(texts[0], path)
            return lambda values_, v=values[0]: v
        return _choice(b, values, texts, path)
    kind = schema.get("type")
    if kind is None and set(schema) - _ANNOTATIONS:
        raise TemplateError(f"schema feature '{min(set(schema) - _ANNOTATIONS)}' at {path} is not supported")
    if not isinstance(kind, str) or kind not in _SUPPORTED:
        raise TemplateError(
            f"schema at {path}: type {json.dumps(kind)} is not supported; use one of "
            f"{', '.join(_SUPPORTED)}, 'enum' or 'const'"
        )
    extra = set(schema) - _SUPPORTED[kind] - _ANNOTATIONS
    if extra:
        raise TemplateError(f"schema feature '{min(extra)}' at {path} is not supported")
    if kind == "object":
        return _object(b, schema, path, draft)
    if kind == "array":
        return _array(b, schema, path, draft)
    if kind == "string":
        return _string(b, schema, path, draft)
    if kind in ("integer", "number"):
        return _number(b, schema, path, draft, integer=kind == "integer")
    if kind == "boolean":
        return _choice(b, [True, False], ["true", "false"], path)
    b.text("null", path)
    return lambda values: None


def _listed_values(schema: dict, path: str) -> tuple[list, list[str]]:
    """A ``const``'s value or an ``enum``'s values and their JSON texts: each JSON (no NaN or
    Infinity) and of the schema's ``type`` where it has one."""
    word = "const" if "const" in schema else "enum"
    extra = set(schema) - {word, "type"} - _ANNOTATIONS
    if extra:
        raise TemplateError(f"schema feature '{min(extra)}' at {path} is not supported alongside '{word}'")
    values = [schema["const"]] if word == "const" else schema["enum"]
    if not isinstance(values, list) or not values:
        raise TemplateError(f"enum at {path} needs a non-empty list of values")
    if len(values) > MAX_CHOICES:
        raise TemplateError(f"enum at {path} has {len(values)} values, more than the {MAX_CHOICES} a template takes")
    kind = schema.get("type")
    kinds = [kind] if isinstance(kind, str) else kind
    if kind is not None and not (
        isinstance(kinds, list) and kinds and all(isinstance(k, str) and k in _SUPPORTED for k in kinds)
    ):
        raise TemplateError(
            f"schema at {path}: type {shown_json(kind, 60)} is not a JSON type; use one of "
            f"{', '.join(_SUPPORTED)} or a list of them"
        )
    texts = []
    for value in values:
        try:
            text = json.dumps(value, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as e:
            raise TemplateError(f"{word} at {path} holds a value that is not JSON ({e})") from None
        if kind is not None and not any(_is_type(value, k) for k in kinds):
            raise TemplateError(
                f"{word} value {text[:40]} at {path} is not of type {json.dumps(kind)}; fix the value or the type"
            )
        texts.append(text)
    return values, texts


def _object(b: _Builder, schema: dict, path: str, draft: Any):
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        raise TemplateError(f"properties at {path} must be an object, got {json.dumps(properties)}")
    if not properties:
        raise TemplateError(f"object at {path} needs 'properties' (its keys are clamped)")
    check_required(schema, path)
    readers = {}
    b.text("{", path)
    for i, (key, sub) in enumerate(properties.items()):
        b.text((", " if i else "") + json.dumps(key) + ": ", path)
        readers[key] = _node(
            b, sub, f"{path}.{key}", draft.get(key, _NO_DRAFT) if isinstance(draft, dict) else _NO_DRAFT
        )
    b.text("}", path)
    return lambda values: {k: read(values) for k, read in readers.items()}


def _array(b: _Builder, schema: dict, path: str, draft: Any):
    if "maxItems" not in schema:
        raise TemplateError(f"array at {path} needs maxItems (the canvas has a fixed size)")
    most, least = _count(schema, "maxItems", path, 0), _count(schema, "minItems", path, 0)
    if not least <= most:
        raise TemplateError(f"array at {path}: needs 0 <= minItems <= maxItems, got {least} and {most}")
    b.room(most, path)  # each item takes a position at least
    if isinstance(draft, list):  # the draft's item count, all required
        most = least = min(max(len(draft), least), most)
    items = []
    b.text("[", path)
    for i in range(most):
        if i:
            b.text(", ", path)
        first = len(b.holes)
        sub = draft[i] if isinstance(draft, list) and i < len(draft) else _NO_DRAFT
        read = _node(b, schema.get("items", {"type": "string"}), f"{path}[{i}]", sub)
        items.append((read, first, len(b.holes), i < least))
    b.text("]", path)

    def value(values):
        out = []
        for read, first, end, required in items:
            # An optional item whose holes are all padding was not used.
            if required or any(values[first:end]):
                out.append(read(values))
        return out

    return value


def _string(b: _Builder, schema: dict, path: str, draft: Any):
    longest = _count(schema, "maxLength", path, DEFAULT_STRING)
    shortest = _count(schema, "minLength", path, 0)
    if not 0 <= shortest <= longest or longest < 1:
        raise TemplateError(f"string at {path}: needs 0 <= minLength <= maxLength and maxLength >= 1")
    size = longest
    if isinstance(draft, str):
        size = min(longest, max(shortest, 1, len(literal_tokens(b.tokenizer, draft))))
    b.text('"', path)
    index = b.hole(Hole(size, "string", required=shortest, where=path))
    b.text('"', path)
    # A token may be several characters: the hole bounds tokens, the cut bounds characters. Byte
    # tokens may make fewer characters than tokens: spaces then make up minLength.
    return lambda values: values[index][:longest].ljust(shortest)


def _number(b: _Builder, schema: dict, path: str, draft: Any, integer: bool):
    """An integer hole (digits, maybe a sign) or a number hole (with a decimal point and ``DECIMALS``
    more digits); the value is clamped into the schema's range, in exact integer arithmetic for integers."""
    low, high = _bound(schema, "minimum", path), _bound(schema, "maximum", path)
    if low is not None and high is not None and low > high:
        raise TemplateError(f"number at {path}: minimum {low} is above maximum {high}")
    if integer:
        low, high = (None if low is None else math.ceil(low)), (None if high is None else math.floor(high))
        if low is not None and high is not None and low > high:
            raise TemplateError(
                f"integer at {path}: no integer lies between minimum {schema['minimum']} "
                f"and maximum {schema['maximum']}"
            )
    widest = (
        max(len(str(int(v))) for v in (low, high) if v is not None) if (low, high) != (None, None) else DEFAULT_DIGITS
    )
    signed = low is None or low < 0
    size = widest + signed + (0 if integer else 1 + DECIMALS)
    if _is_number(draft) and abs(draft) < 10**size:  # (a longer draft leaves the hole as it is)
        size = min(size, max(1, len(str(int(draft) if integer else draft))))
    kind = "number" if not integer else "signed" if signed else "digits"
    index = b.hole(Hole(size, kind, required=1, where=path))
    pattern = r"-?\d+" if integer else r"-?(\d+\.?\d*|\.\d+)"
    parse = int if integer else float

    def value(values):
        text = values[index]
        number = parse(text) if re.fullmatch(pattern, text) else parse(0)
        if math.isinf(number):  # more digits than a float holds
            number = math.copysign(sys.float_info.max, number)
        if low is not None:
            number = max(number, low)
        if high is not None:
            number = min(number, high)
        return number

    return value


def _choice(b: _Builder, options: list, texts: list[str], path: str):
    """A hole that ends as one of ``texts`` (the JSON of ``options``)."""
    sequences = []
    for text in texts:
        sequences.append(literal_tokens(b.tokenizer, text))
        b.room(len(sequences[-1]), path, "shorten its enum values")
    index = b.hole(Hole(max(map(len, sequences)), "choice", choices=sequences, where=path))
    first = dict(zip(reversed(texts), reversed(options)))  # (an enum may repeat a value)
    return lambda values: first.get(values[index], options[0])
