"""Canvas templates: answers with fixed text and holes, infilling, and JSON from a schema.

A template is the answer laid out on the canvases after the prompt: literal text whose tokens are
clamped (fixed from the first draft to the commit, sampler.Clamp) and holes the model denoises::

    {"name": "{{fill:12}}", "age": {{fill:3}}}
    def area(r):\\n    {{fill:40}}\\n    return a

``{{fill:N}}`` is a hole of at most N tokens (``{{ fill:N }}`` too), ``{{fill}}`` one of ``DEFAULT_HOLE``; unused hole
positions end as padding, which the output drops. After the template the rest of its last canvas is
clamped to the end-of-turn token and padding, the way every answer ends in training, and generation
stops there. A hole takes no stop id, except the end of turn where that is the text that follows it.

``json_template`` builds the template from a JSON schema: brackets, keys and separators clamped, each
value a hole limited to the tokens its type allows (string characters, digits, an enum's choices);
the output is rendered from the hole values (numbers clamped to their range, strings cut to their
``maxLength``, unused optional array items dropped), so it always parses and validates. A schema
whose answer could not validate (a ``required`` key that is not a property, an enum value not of
the schema's type or not JSON, a bound no float holds) is refused, as is any feature the clamps
cannot express. docs/templates.md has the whole list.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from .errors import TemplateError
from .sampler import Clamp

DEFAULT_HOLE = 16  # tokens of a {{fill}} without a size
DEFAULT_STRING = 16  # tokens of a string value without maxLength
DEFAULT_DIGITS = 6  # digits of an integer without a maximum
DECIMALS = 4  # fractional digits a number hole leaves room for
MAX_DEPTH = 64  # nesting levels of a schema
MAX_CHOICES = 1000  # values of one enum (OpenAI's structured outputs allow 1000 in a whole schema)
TEMPLATE_LIMIT = 1 << 20  # positions a template may take when the caller does not give the model's context
FREE = -1  # a hole position in CanvasTemplate.tokens
_NEG = -1e9  # the bias of a token a position may not take (finite: no inf - inf anywhere)


@dataclass
class Hole:
    size: int
    kind: str = "text"  # a token class: text, string, digits, signed, number, or choice
    required: int = 0  # leading positions that may not be padding
    choices: list[list[int]] | None = None  # for kind "choice": the token sequences it may end as
    where: str = ""  # for error messages: "line 1, column 9" or "$.age"


@dataclass
class CanvasTemplate:
    """Template tokens (``FREE`` at holes) and the holes' positions in them."""

    tokens: list[int]
    holes: list[tuple[int, Hole]]  # (start position, hole)
    render: Callable[[list[str]], Any] | None = None  # a JSON template's value from its holes' texts
    ends_turn: bool = True  # the end-of-turn token follows (an infill's suffix ends its canvas instead)

    def __len__(self) -> int:
        return len(self.tokens)

    def following(self, index: int, end_of_turn: int | None) -> list[int]:
        """The literal tokens right after hole ``index`` (the end of turn after the last one)."""
        start, hole = self.holes[index]
        out = []
        for t in self.tokens[start + hole.size:]:
            if t == FREE:
                return out
            out.append(t)
        return out + ([end_of_turn] if end_of_turn is not None else [])

    def hole_values(self, tokens: list[int], pad: int, end_of_turn: int | None) -> list[list[int]]:
        """Each hole's tokens: padding removed, and cut where the model starts writing the text that
        follows the hole. A model trained on answers that end in padding does not put padding in the
        middle of a canvas; it writes a shorter value and then the next literal text early (``ada",``
        in a 6-token string hole), so the value ends where that text begins."""
        values = []
        for index, (start, hole) in enumerate(self.holes):
            ids = [t for t in tokens[start:start + hole.size] if t != pad]
            after = self.following(index, end_of_turn)
            if after and hole.kind != "choice":
                for p in range(len(ids)):
                    seen = ids[p:p + len(after)]
                    # Kind-limited holes can only write the next text's first token as a terminator.
                    if seen == after[:len(seen)] or (hole.kind != "text" and ids[p] == after[0]):
                        ids = ids[:p]
                        break
            if end_of_turn in ids:  # the model ended its answer inside the hole
                ids = ids[: ids.index(end_of_turn)]
            values.append(ids)
        return values

    def answer_tokens(self, tokens: list[int], pad: int, end_of_turn: int | None) -> list[int]:
        """The answer: the literal tokens with each hole's value in its place."""
        values = self.hole_values(tokens, pad, end_of_turn)
        out, position = [], 0
        for (start, hole), value in zip(self.holes, values):
            out += self.tokens[position:start] + value
            position = start + hole.size
        return out + self.tokens[position:]


# ------------------------------------------------------------------------------------------------
# text templates

_HOLE = re.compile(r"\{\{\s*([A-Za-z_]\w*)\s*(?::([^}]*))?\}\}")
_OPEN = re.compile(r"\{\{(?:[A-Za-z_]|\s+fill\b)")


def _place(text: str, offset: int) -> str:
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return f"line {line}, column {column}"


def parse_template(tokenizer, text: str, limit: int | None = None) -> CanvasTemplate:
    """A text template with ``{{fill}}`` / ``{{fill:N}}`` holes. ``{{`` followed by a letter (or by
    spaces and ``fill``) starts a hole, so a misspelt one is an error, not text; any other ``{{`` is
    literal text. ``limit`` (the model's context) bounds the positions the template may take."""
    if not isinstance(text, str):
        raise TemplateError(f"a template is text, got {type(text).__name__}")
    _check_unicode(text, "the template")
    limit = TEMPLATE_LIMIT if limit is None else limit
    tokens: list[int] = []
    holes: list[tuple[int, Hole]] = []
    position = 0
    for match in _OPEN.finditer(text):
        start = match.start()
        if start < position:
            continue
        hole = _HOLE.match(text, start)
        where = _place(text, start)
        if hole is None:
            raise TemplateError(f"unclosed hole at {where}: write {{{{fill}}}} or {{{{fill:N}}}}")
        kind, size = hole.group(1), hole.group(2)
        if kind != "fill":
            raise TemplateError(f"unknown hole '{hole.group(0)}' at {where}: holes are {{{{fill}}}} or {{{{fill:N}}}}")
        if size is None:
            n = DEFAULT_HOLE
        elif size.strip().isdigit() and int(size) > 0:
            n = int(size)
        else:
            raise TemplateError(f"hole at {where}: the size must be a positive integer, got {size!r}")
        tokens += _literal(tokenizer, text[position:start])
        if len(tokens) + n > limit:
            raise TemplateError(f"the hole at {where} ({n} tokens) runs past the model's context of {limit} "
                                "positions; make it smaller")
        holes.append((len(tokens), Hole(n, where=where)))
        tokens += [FREE] * n
        position = hole.end()
    tokens += _literal(tokenizer, text[position:])
    if len(tokens) > limit:
        raise TemplateError(f"the template's text takes {len(tokens)} tokens, past the model's context of {limit} "
                            "positions; shorten it")
    if not holes and not tokens:
        raise TemplateError("the template is empty")
    return CanvasTemplate(tokens, holes)


def as_template(tokenizer, template, limit: int | None = None) -> CanvasTemplate | None:
    """A ``CanvasTemplate`` from what a caller passed as a template: text (parsed), one, or None."""
    if template is None or isinstance(template, CanvasTemplate):
        return template
    if isinstance(template, str):
        return parse_template(tokenizer, template, limit)
    raise TemplateError(f"template must be text with {{{{fill:N}}}} holes or a CanvasTemplate, "
                        f"got {type(template).__name__}")


def _literal(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []


_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_unicode(text: str, what: str) -> None:
    """Refuse a lone surrogate (JSON's "\\ud800" makes one): UTF-8 cannot encode it, no tokenizer reads it."""
    if bad := _SURROGATE.search(text):
        raise TemplateError(f"{what} holds a lone surrogate ({ascii(bad.group())[1:-1]}) at {_place(text, bad.start())}, "
                            "which is not text; send UTF-8")


def infill_template(tokenizer, suffix: str, max_fill: int, canvas_length: int) -> CanvasTemplate:
    """A hole of ``max_fill`` tokens or more, then ``suffix`` ending exactly at a canvas end."""
    if max_fill < 1:
        raise TemplateError(f"max_fill must be at least 1, got {max_fill}")
    _check_unicode(suffix, "the suffix")
    tail = _literal(tokenizer, suffix)
    canvases = -(-(max_fill + len(tail)) // canvas_length)
    size = canvases * canvas_length - len(tail)
    return CanvasTemplate([FREE] * size + tail, [(0, Hole(size, where="the fill"))], ends_turn=False)


# ------------------------------------------------------------------------------------------------
# JSON schema templates

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
        self.tokens += _literal(self.tokenizer, s)
        self.room(0, path, "shorten its keys and const or enum values")

    def hole(self, hole: Hole) -> int:
        self.room(hole.size, hole.where)
        self.holes.append((len(self.tokens), hole))
        self.tokens += [FREE] * hole.size
        return len(self.holes) - 1

    def room(self, size: int, path: str, fix: str = _TOO_LONG) -> None:
        """Refuse, before building it, what would take the template past the model's context."""
        if len(self.tokens) + size > self.limit:
            raise TemplateError(f"schema at {path} takes the template past the model's context of {self.limit} "
                                f"positions; {fix}")


def _count(schema: dict, key: str, path: str, default: int) -> int:
    """A schema's item or length bound: a non-negative integer."""
    value = schema.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 \
            or (isinstance(value, float) and not value.is_integer()):
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
        raise TemplateError(f"{key} at {path} is an integer of more than 308 digits; a bound must fit a float "
                            f"(at most {sys.float_info.max:.1e})")
    return value


def _is_number(value: Any) -> bool:
    """A JSON number: an int or a finite float, not a bool."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float)
                                                                         and math.isfinite(value))


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
        raise TemplateError(f"required at {path} must be a list of property names, got {json.dumps(required)[:60]}")
    for key in required:
        if key not in properties:
            raise TemplateError(f"required key {json.dumps(key)} at {path} is not in its properties; add it to "
                                "properties or drop it from required")


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
        raise TemplateError(f"schema at {path}: type {json.dumps(kind)} is not supported; use one of "
                            f"{', '.join(_SUPPORTED)}, 'enum' or 'const'")
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
    if kind is not None and not (isinstance(kinds, list) and kinds
                                 and all(isinstance(k, str) and k in _SUPPORTED for k in kinds)):
        raise TemplateError(f"schema at {path}: type {json.dumps(kind)[:60]} is not a JSON type; use one of "
                            f"{', '.join(_SUPPORTED)} or a list of them")
    texts = []
    for value in values:
        try:
            text = json.dumps(value, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as e:
            raise TemplateError(f"{word} at {path} holds a value that is not JSON ({e})") from None
        if kind is not None and not any(_is_type(value, k) for k in kinds):
            raise TemplateError(f"{word} value {text[:40]} at {path} is not of type {json.dumps(kind)}; "
                                "fix the value or the type")
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
        readers[key] = _node(b, sub, f"{path}.{key}", draft.get(key, _NO_DRAFT) if isinstance(draft, dict)
                             else _NO_DRAFT)
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
        size = min(longest, max(shortest, 1, len(_literal(b.tokenizer, draft))))
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
            raise TemplateError(f"integer at {path}: no integer lies between minimum {schema['minimum']} "
                                f"and maximum {schema['maximum']}")
    widest = max(len(str(int(v))) for v in (low, high) if v is not None) if (low, high) != (None, None) \
        else DEFAULT_DIGITS
    signed = low is None or low < 0
    size = widest + signed + (0 if integer else 1 + DECIMALS)
    if _is_number(draft) and abs(draft) < 10 ** size:  # (a longer draft leaves the hole as it is)
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
        sequences.append(_literal(b.tokenizer, text))
        b.room(len(sequences[-1]), path, "shorten its enum values")
    index = b.hole(Hole(max(map(len, sequences)), "choice", choices=sequences, where=path))
    first = dict(zip(reversed(texts), reversed(options)))  # (an enum may repeat a value)
    return lambda values: first.get(values[index], options[0])


# ------------------------------------------------------------------------------------------------
# canvases


def token_classes(tokenizer, vocab: int) -> dict[str, np.ndarray]:
    """Boolean [V] masks of the tokens each hole kind may take (padding not included), cached per tokenizer."""
    cached = getattr(tokenizer, "_template_classes", None)
    if cached is not None and len(cached["text"]) == vocab:
        return cached
    stops = set(getattr(tokenizer, "stop_ids", [])) | {getattr(tokenizer, "bos_token_id", 2)}
    pad = tokenizer.pad_token_id
    text = np.ones(vocab, dtype=bool)
    string = np.zeros(vocab, dtype=bool)
    digits = np.zeros(vocab, dtype=bool)
    minus = np.zeros(vocab, dtype=bool)
    point = np.zeros(vocab, dtype=bool)
    for i in range(vocab):
        if i in stops or i == pad:
            text[i] = False
            continue
        s = tokenizer.decode([i])
        string[i] = bool(s) and not any(c in '"\\' or ord(c) < 32 for c in s)
        digits[i] = s.isascii() and s.isdigit()
        minus[i] = s == "-"
        point[i] = s == "."
    classes = {"text": text, "string": string, "digits": digits, "signed": digits | minus,
               "number": digits | minus | point}
    tokenizer._template_classes = classes
    return classes


class _BuiltOnRead(Sequence):
    """``n`` items, each built by ``build(index)`` when it is read and not kept."""

    def __init__(self, n: int, build: Callable[[int], Any]):
        self.n, self.build = n, build

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.build(i) for i in range(*index.indices(self.n))]
        if not -self.n <= index < self.n:
            raise IndexError(index)
        return self.build(index % self.n)


def canvas_clamps(template: CanvasTemplate, tokenizer, vocab: int, canvas_length: int, end_of_turn: int | None,
                  last_length: Callable[[int, int], int] | None = None) -> Sequence[tuple[int, Clamp]]:
    """(length, Clamp) per canvas of the template. After the template, its last canvas holds
    ``end_of_turn`` then padding (with None, padding alone). ``last_length(used, canvas_length)``
    may shorten the last canvas to a length that still holds its ``used`` template positions.

    Each canvas's Clamp is built when it is read: its ``bias`` holds a row of the vocabulary for each
    token set its own positions allow (an enum's positions each allow their own), so memory follows
    the canvas length, not the template's."""
    pad = tokenizer.pad_token_id
    tokens = list(template.tokens)
    if end_of_turn is not None:
        tokens.append(end_of_turn)
    used = len(tokens)
    total = -(-len(tokens) // canvas_length) * canvas_length
    tokens += [pad] * (total - len(tokens))
    classes = token_classes(tokenizer, vocab)
    allowed: list[tuple | None] = [None] * total  # per position, what its row allows (None: everything)
    for index, (start, hole) in enumerate(template.holes):
        after = template.following(index, end_of_turn)
        for j in range(hole.size):
            allowed[start + j] = _allowed(hole, j, after)
    fixed = np.array([t != FREE for t in tokens])
    values = np.array([max(t, 0) for t in tokens], dtype=np.int32)
    windows = []
    for k in range(0, total, canvas_length):
        length = canvas_length
        if last_length is not None and k + canvas_length >= total:
            length = max(used - k, min(canvas_length, last_length(used - k, canvas_length)))
        windows.append((k, length))
    choice_holes = [(start, hole) for start, hole in template.holes if hole.kind == "choice"]

    def clamp(i: int) -> tuple[int, Clamp]:
        k, length = windows[i]
        window = slice(k, k + length)
        rows = {None: 0}  # row 0 allows everything (fixed positions)
        position_class = np.array([rows.setdefault(a, len(rows)) for a in allowed[window]], dtype=np.int32)
        bias = np.stack([_bias_row(a, classes, vocab, pad) for a in rows])
        finish = _snap_choices([(s - k, h) for s, h in choice_holes if k <= s < k + length], pad)
        return length, Clamp(fixed=mx.array(fixed[None, window]), tokens=mx.array(values[None, window]),
                             classes=mx.array(position_class[None]), bias=mx.array(bias), finish=finish)

    return _BuiltOnRead(len(windows), clamp)


def _allowed(hole: Hole, j: int, after: list[int]) -> tuple[str, tuple[int, ...], bool]:
    """What position ``j`` of ``hole`` may take: (token class, more tokens, padding too)."""
    if hole.kind == "choice":
        tokens = tuple(sorted({seq[j] for seq in hole.choices if j < len(seq)}))
        return "choice", tokens, not all(j < len(seq) for seq in hole.choices)
    required = j < hole.required
    if required or not after:
        return hole.kind, (), not required
    # The value may end early (see CanvasTemplate.hole_values): a kind-limited hole can write the
    # next text's first token; a text hole all of it, the end of turn included, so the cut can see
    # where the value stopped.
    return hole.kind, tuple(after[:1] if hole.kind != "text" else after), True


def _bias_row(allowed: tuple | None, classes: dict[str, np.ndarray], vocab: int, pad: int) -> np.ndarray:
    """The [V] bias of a position: 0 where ``allowed`` (``_allowed``'s) allows a token, ``_NEG`` elsewhere."""
    if allowed is None:
        return np.zeros(vocab, np.float32)
    kind, tokens, padded = allowed
    mask = np.zeros(vocab, dtype=bool) if kind == "choice" else classes[kind].copy()
    mask[list(tokens)] = True
    if padded:
        mask[pad] = True
    return np.where(mask, 0.0, _NEG).astype(np.float32)


def _snap_choices(holes: list[tuple[int, Hole]], pad: int):
    """The commit's multiple-choice holes set to their likeliest choice under the last step's distribution."""
    if not holes:
        return None

    def finish(tokens: mx.array, probs: mx.array) -> mx.array:
        out = np.array(tokens)
        log_probs = np.log(np.maximum(np.asarray(probs[0]), 1e-30))
        for start, hole in holes:
            best, best_score = None, -np.inf
            for seq in hole.choices:
                seq = seq + [pad] * (hole.size - len(seq))
                score = sum(log_probs[start + j, t] for j, t in enumerate(seq) if start + j < len(log_probs))
                if score > best_score:
                    best, best_score = seq, score
            out[0, start:start + hole.size] = best[: out.shape[1] - start]
        return mx.array(out)

    return finish
