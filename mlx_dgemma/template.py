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
``maxLength``, unused optional array items dropped), so it always parses and validates.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
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


def infill_template(tokenizer, suffix: str, max_fill: int, canvas_length: int) -> CanvasTemplate:
    """A hole of ``max_fill`` tokens or more, then ``suffix`` ending exactly at a canvas end."""
    if max_fill < 1:
        raise TemplateError(f"max_fill must be at least 1, got {max_fill}")
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


@dataclass
class _Builder:
    tokenizer: Any
    limit: int = TEMPLATE_LIMIT
    tokens: list[int] = field(default_factory=list)
    holes: list[tuple[int, Hole]] = field(default_factory=list)
    depth: int = 0

    def text(self, s: str) -> None:
        self.tokens += _literal(self.tokenizer, s)

    def hole(self, hole: Hole) -> int:
        self.room(hole.size, hole.where)
        self.holes.append((len(self.tokens), hole))
        self.tokens += [FREE] * hole.size
        return len(self.holes) - 1

    def room(self, size: int, path: str) -> None:
        """Refuse, before building it, what would take the template past the model's context."""
        if len(self.tokens) + size > self.limit:
            raise TemplateError(f"schema at {path} takes the template past the model's context of {self.limit} "
                                "positions; lower its maxItems, maxLength or maximum")


def _count(schema: dict, key: str, path: str, default: int) -> int:
    """A schema's item or length bound: a non-negative integer."""
    value = schema.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 \
            or (isinstance(value, float) and not value.is_integer()):
        raise TemplateError(f"{key} at {path} must be a non-negative integer, got {json.dumps(value)}")
    return int(value)


def _bound(schema: dict, key: str, path: str) -> float | None:
    """A schema's minimum or maximum: a finite number, or None."""
    value = schema.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not np.isfinite(value)):
        raise TemplateError(f"{key} at {path} must be a finite number, got {json.dumps(value)}")
    return value


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
    if "const" in schema:
        b.text(json.dumps(schema["const"]))
        return lambda values, v=schema["const"]: v
    if "enum" in schema:
        return _choice(b, schema["enum"], path)
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
        return _choice(b, [True, False], path)
    b.text("null")
    return lambda values: None


def _object(b: _Builder, schema: dict, path: str, draft: Any):
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        raise TemplateError(f"properties at {path} must be an object, got {json.dumps(properties)}")
    if not properties:
        raise TemplateError(f"object at {path} needs 'properties' (its keys are clamped)")
    readers = {}
    b.text("{")
    for i, (key, sub) in enumerate(properties.items()):
        b.text((", " if i else "") + json.dumps(key) + ": ")
        readers[key] = _node(b, sub, f"{path}.{key}", draft.get(key, _NO_DRAFT) if isinstance(draft, dict)
                             else _NO_DRAFT)
    b.text("}")
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
    b.text("[")
    for i in range(most):
        if i:
            b.text(", ")
        first = len(b.holes)
        sub = draft[i] if isinstance(draft, list) and i < len(draft) else _NO_DRAFT
        read = _node(b, schema.get("items", {"type": "string"}), f"{path}[{i}]", sub)
        items.append((read, first, len(b.holes), i < least))
    b.text("]")

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
    b.text('"')
    index = b.hole(Hole(size, "string", required=shortest, where=path))
    b.text('"')
    # A token may be several characters: the hole bounds tokens, the cut bounds characters.
    return lambda values: values[index][:longest]


def _number(b: _Builder, schema: dict, path: str, draft: Any, integer: bool):
    """An integer hole (digits, maybe a sign) or a number hole (with a decimal point and ``DECIMALS``
    more digits); the value is clamped into the schema's range."""
    low, high = _bound(schema, "minimum", path), _bound(schema, "maximum", path)
    if low is not None and high is not None and low > high:
        raise TemplateError(f"number at {path}: minimum {low} is above maximum {high}")
    if integer:
        low, high = (None if low is None else int(np.ceil(low))), (None if high is None else int(np.floor(high)))
        if low is not None and high is not None and low > high:
            raise TemplateError(f"integer at {path}: no integer lies between minimum {schema['minimum']} "
                                f"and maximum {schema['maximum']}")
    widest = max(len(str(int(v))) for v in (low, high) if v is not None) if (low, high) != (None, None) \
        else DEFAULT_DIGITS
    signed = low is None or low < 0
    size = widest + signed + (0 if integer else 1 + DECIMALS)
    if isinstance(draft, (int, float)) and not isinstance(draft, bool):
        size = min(size, max(1, len(str(int(draft) if integer else draft))))
    kind = "number" if not integer else "signed" if signed else "digits"
    index = b.hole(Hole(size, kind, required=1, where=path))
    pattern = r"-?\d+" if integer else r"-?(\d+\.?\d*|\.\d+)"
    parse = int if integer else float

    def value(values):
        text = values[index]
        number = parse(text) if re.fullmatch(pattern, text) else parse(0)
        if low is not None:
            number = max(number, low)
        if high is not None:
            number = min(number, high)
        return number

    return value


def _choice(b: _Builder, options: list, path: str):
    if not isinstance(options, list) or not options:
        raise TemplateError(f"enum at {path} needs a non-empty list of values")
    texts = [json.dumps(v) for v in options]
    sequences = [_literal(b.tokenizer, t) for t in texts]
    index = b.hole(Hole(max(map(len, sequences)), "choice", choices=sequences, where=path))
    return lambda values: options[texts.index(values[index])] if values[index] in texts else options[0]


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


def canvas_clamps(template: CanvasTemplate, tokenizer, vocab: int, canvas_length: int, end_of_turn: int | None,
                  last_length: Callable[[int, int], int] | None = None) -> list[tuple[int, Clamp]]:
    """(length, Clamp) per canvas of the template. After the template, its last canvas holds
    ``end_of_turn`` then padding (with None, padding alone). ``last_length(used, canvas_length)``
    may shorten the last canvas to a length that still holds its ``used`` template positions."""
    pad = tokenizer.pad_token_id
    tokens = list(template.tokens)
    if end_of_turn is not None:
        tokens.append(end_of_turn)
    used = len(tokens)
    total = -(-len(tokens) // canvas_length) * canvas_length
    tokens += [pad] * (total - len(tokens))
    classes = token_classes(tokenizer, vocab)
    rows = {"any": np.zeros(vocab, np.float32)}  # row 0 allows everything (fixed positions)
    position_class = np.zeros(total, dtype=np.int32)
    choice_holes = []
    names = list(rows)
    for index, (start, hole) in enumerate(template.holes):
        after = template.following(index, end_of_turn)
        for j in range(hole.size):
            required = j < hole.required
            if hole.kind == "choice":
                allowed = np.zeros(vocab, dtype=bool)
                for seq in hole.choices:
                    if j < len(seq):
                        allowed[seq[j]] = True
                name = f"choice@{start}+{j}"
                required = all(j < len(seq) for seq in hole.choices)
            else:
                allowed = classes[hole.kind].copy()
                name = hole.kind
                if after and not required:  # the value may end early: see CanvasTemplate.hole_values
                    # A kind-limited hole can write the next text's first token; a text hole all of
                    # it, the end of turn included, so the cut can see where the value stopped.
                    ends = after[:1] if hole.kind != "text" else after
                    allowed[ends] = True
                    name += "+" + ",".join(map(str, ends))
            if not required:
                allowed[pad] = True
                name += "+pad"
            if name not in rows:
                rows[name] = np.where(allowed, 0.0, _NEG).astype(np.float32)
                names.append(name)
            position_class[start + j] = names.index(name)
        if hole.kind == "choice":
            choice_holes.append((start, hole))
    bias = mx.array(np.stack([rows[n] for n in names]))
    fixed = np.array([t != FREE for t in tokens])
    values = np.array([max(t, 0) for t in tokens], dtype=np.int32)
    clamps = []
    for k in range(0, total, canvas_length):
        length = canvas_length
        if last_length is not None and k + canvas_length >= total:
            length = max(used - k, min(canvas_length, last_length(used - k, canvas_length)))
        window = slice(k, k + length)
        finish = _snap_choices([(s - k, h) for s, h in choice_holes if k <= s < k + length], pad)
        clamps.append((length, Clamp(
            fixed=mx.array(fixed[None, window]), tokens=mx.array(values[None, window]),
            classes=mx.array(position_class[None, window]), bias=bias, finish=finish)))
    return clamps


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
