"""Canvas templates: answers with fixed text and holes, infilling, and their per-canvas clamps.

A template is the answer laid out on the canvases after the prompt: literal text whose tokens are
clamped (fixed from the first draft to the commit, ``Clamp``) and holes the model denoises::

    {"name": "{{fill:12}}", "age": {{fill:3}}}
    def area(r):\\n    {{fill:40}}\\n    return a

``{{fill:N}}`` is a hole of at most N tokens (``{{ fill:N }}`` too), ``{{fill}}`` one of ``DEFAULT_HOLE``; unused hole
positions end as padding, which the output drops. After the template the rest of its last canvas is
clamped to the end-of-turn token and padding, the way every answer ends in training, and generation
stops there. A hole takes no stop id, except the end of turn where that is the text that follows it.

json_schema.py builds a template from a JSON schema (``json_template``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import TemplateError

DEFAULT_HOLE = 16  # tokens of a {{fill}} without a size
TEMPLATE_LIMIT = 1 << 20  # positions a template may take when the caller does not give the model's context
FREE = -1  # a hole position in CanvasTemplate.tokens
_NEG = -1e9  # the bias of a token a position may not take (finite: no inf - inf anywhere)


@dataclass
class Clamp:
    """Fixed tokens and per-position token classes for one canvas.

    ``fixed`` [1, C] bool and ``tokens`` [1, C] int32 (read where fixed). ``classes`` [1, C] int32
    indexes rows of ``bias`` [K, V] float32 (0 for allowed tokens, a large negative number for the
    others; row 0 allows everything): K token classes rather than a [C, V] mask keep the memory at
    K rows of the vocabulary. ``finish`` may rewrite the committed canvas from the last step's
    probabilities (a template snapping a multiple-choice hole to one of its choices)."""

    fixed: mx.array
    tokens: mx.array
    classes: mx.array | None = None
    bias: mx.array | None = None
    finish: Callable[[mx.array, mx.array], mx.array] | None = None

    def apply(self, canvas: mx.array) -> mx.array:
        return mx.where(self.fixed, self.tokens, canvas)

    def restrict(self, logits: mx.array, active: mx.array | None = None) -> mx.array:
        """Logits of the canvas (or of its ``active`` positions) with disallowed tokens pushed down."""
        if self.bias is None:
            return logits
        classes = self.classes if active is None else self.classes[:, active]
        return logits + self.bias[classes]

    def free_entropy(self, entropy: mx.array) -> tuple[mx.array, mx.array]:
        """Entropy with fixed positions at 0 (accepted first, costing nothing), and its mean over the
        free positions."""
        free = mx.logical_not(self.fixed)
        entropy = mx.where(free, entropy, 0.0)
        return entropy, entropy.sum() / mx.maximum(free.sum(), 1)


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
        for t in self.tokens[start + hole.size :]:
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
            ids = [t for t in tokens[start : start + hole.size] if t != pad]
            after = self.following(index, end_of_turn)
            if after and hole.kind != "choice":
                for p in range(len(ids)):
                    seen = ids[p : p + len(after)]
                    # Kind-limited holes can only write the next text's first token as a terminator.
                    if seen == after[: len(seen)] or (hole.kind != "text" and ids[p] == after[0]):
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
        tokens += literal_tokens(tokenizer, text[position:start])
        if len(tokens) + n > limit:
            raise TemplateError(
                f"the hole at {where} ({n} tokens) runs past the model's context of {limit} positions; make it smaller"
            )
        holes.append((len(tokens), Hole(n, where=where)))
        tokens += [FREE] * n
        position = hole.end()
    tokens += literal_tokens(tokenizer, text[position:])
    if len(tokens) > limit:
        raise TemplateError(
            f"the template's text takes {len(tokens)} tokens, past the model's context of {limit} positions; shorten it"
        )
    if not holes and not tokens:
        raise TemplateError("the template is empty")
    return CanvasTemplate(tokens, holes)


def as_template(tokenizer, template, limit: int | None = None) -> CanvasTemplate | None:
    """A ``CanvasTemplate`` from what a caller passed as a template: text (parsed), one, or None."""
    if template is None or isinstance(template, CanvasTemplate):
        return template
    if isinstance(template, str):
        return parse_template(tokenizer, template, limit)
    raise TemplateError(
        f"template must be text with {{{{fill:N}}}} holes or a CanvasTemplate, got {type(template).__name__}"
    )


def literal_tokens(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []


_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_unicode(text: str, what: str) -> None:
    """Refuse a lone surrogate (JSON's "\\ud800" makes one): UTF-8 cannot encode it, no tokenizer reads it."""
    if bad := _SURROGATE.search(text):
        raise TemplateError(
            f"{what} holds a lone surrogate ({ascii(bad.group())[1:-1]}) at {_place(text, bad.start())}, "
            "which is not text; send UTF-8"
        )


def infill_template(
    tokenizer, suffix: str, max_fill: int, canvas_length: int, limit: int | None = None
) -> CanvasTemplate:
    """A hole of ``max_fill`` tokens or more, then ``suffix`` ending exactly at a canvas end, within
    ``limit`` positions (the model's context; refused before the hole is built)."""
    if max_fill < 1:
        raise TemplateError(f"max_fill must be at least 1, got {max_fill}")
    _check_unicode(suffix, "the suffix")
    tail = literal_tokens(tokenizer, suffix)
    canvases = -(-(max_fill + len(tail)) // canvas_length)
    limit = TEMPLATE_LIMIT if limit is None else limit
    if canvases * canvas_length > limit:
        raise TemplateError(
            f"a fill of {max_fill} tokens before the {len(tail)}-token suffix takes {canvases} "
            f"canvases of {canvas_length}, past the model's context of {limit} positions; "
            f"ask for at most {limit // canvas_length * canvas_length - len(tail)}"
        )
    size = canvases * canvas_length - len(tail)
    return CanvasTemplate([FREE] * size + tail, [(0, Hole(size, where="the fill"))], ends_turn=False)


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
    classes = {
        "text": text,
        "string": string,
        "digits": digits,
        "signed": digits | minus,
        "number": digits | minus | point,
    }
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


def canvas_clamps(
    template: CanvasTemplate,
    tokenizer,
    vocab: int,
    canvas_length: int,
    end_of_turn: int | None,
    last_length: Callable[[int, int], int] | None = None,
) -> Sequence[tuple[int, Clamp]]:
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
        return length, Clamp(
            fixed=mx.array(fixed[None, window]),
            tokens=mx.array(values[None, window]),
            classes=mx.array(position_class[None]),
            bias=mx.array(bias),
            finish=finish,
        )

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
            out[0, start : start + hole.size] = best[: out.shape[1] - start]
        return mx.array(out)

    return finish
