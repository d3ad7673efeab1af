"""Which layout an answer gets, decided here and nowhere else (``answer_layout``): free text, a canvas
template, a JSON schema's canvas template whose holes a free draft sizes, or a schema's grammar.

- A template (text with ``{{fill:N}}`` holes, or a ``CanvasTemplate``) is the answer laid out in advance.
- A JSON schema under a diffusion policy (reference, fast, auto), where its canvas template expresses
  it (json_schema.py) and fits ``max_tokens``, is *drafted*: a free generation comes first, and the
  answer is generated on the schema's template with each hole as long as the draft's value there
  (within the schema's bounds). On the demo's json tasks that is right far more often than holes at
  their upper bounds, and it is always valid.
- Every other schema, and every schema under ar and verified, is followed by its grammar token by
  token (grammar.py).

A forced tool call's draft may come as a tool call: its arguments are the values (``reads_call``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import TemplateError
from .grammar import Grammar, schema_grammar
from .json_schema import json_template
from .template import CanvasTemplate, as_template
from .tool_calls import parse_tool_calls

DIFFUSION_POLICIES = ("reference", "fast", "auto")  # those that draft a schema's template where they can


@dataclass(frozen=True, eq=False)
class Layout:
    """An answer's layout: ``template`` (for a drafted schema, the largest template a draft may size,
    which the context must hold), ``grammar``, or ``schema`` with ``template``: drafted; none: free."""

    template: CanvasTemplate | None = None
    grammar: Grammar | None = None
    schema: object = None  # a drafted layout's schema
    reads_call: bool = False  # a drafted layout's draft may be a tool call
    tokenizer: object = None
    limit: int | None = None  # the model's context, which no template can outgrow

    @property
    def kind(self) -> str:
        if self.schema is not None:
            return "drafted"
        return "template" if self.template is not None else "grammar" if self.grammar is not None else "free"

    @property
    def json(self) -> bool:
        """Whether the answer is JSON laid out from its first token (no room for a thought before it)."""
        return self.kind in ("drafted", "grammar") or self.template is not None and self.template.render is not None

    def sized(self, draft: str) -> Layout:
        """A drafted layout's answer: the schema's template with its holes sized by ``draft``'s values."""
        template = json_template(self.tokenizer, self.schema, draft=_values(draft, self.reads_call), limit=self.limit)
        return Layout(template=template)


def answer_layout(
    tokenizer,
    vocab: int,
    stop_ids: list[int],
    *,
    template=None,
    schema=None,
    policy: str = "reference",
    limit: int | None = None,
    max_tokens: int | None = None,
    reads_call: bool = False,
) -> Layout:
    """The layout of an answer to ``template`` or ``schema`` (a JSON schema, or a ``Grammar`` compiled
    already) under ``policy``; ``stop_ids`` end a grammar's answer, the end of turn first; ``limit``
    is the model's context and ``max_tokens`` the caller's (None: not given)."""
    if schema is None:
        return Layout(template=as_template(tokenizer, template, limit=limit))
    if template is not None:
        raise TemplateError("give a template or a schema, not both")
    if isinstance(schema, Grammar):
        return Layout(grammar=schema)
    largest = _schema_template(tokenizer, schema, policy, limit, max_tokens)
    if largest is not None:
        return Layout(template=largest, schema=schema, reads_call=reads_call, tokenizer=tokenizer, limit=limit)
    return Layout(grammar=schema_grammar(tokenizer, schema, vocab, stop_ids))


def drafted_layout(tokenizer, schema, limit: int | None = None, reads_call: bool = False) -> Layout:
    """``schema``'s drafted layout whatever the policy (its template checked now: a bad schema fails
    before any generation)."""
    largest = json_template(tokenizer, schema, limit=limit)
    return Layout(template=largest, schema=schema, reads_call=reads_call, tokenizer=tokenizer, limit=limit)


def _schema_template(
    tokenizer, schema, policy: str, limit: int | None, max_tokens: int | None
) -> CanvasTemplate | None:
    """The canvas template of ``schema`` where ``policy`` drafts one: the template expresses the
    schema and fits ``max_tokens`` (with the end of turn after it); None where the grammar follows it."""
    if policy not in DIFFUSION_POLICIES or not isinstance(schema, dict):
        return None
    try:
        template = json_template(tokenizer, schema, limit=limit)
    except TemplateError:
        return None
    return template if max_tokens is None or len(template) + 1 <= max_tokens else None


def _values(draft: str, reads_call: bool):
    """A draft's values: its JSON, or (``reads_call``) its first tool call's arguments where it is one;
    None where it is neither (the holes then take their upper bounds)."""
    if reads_call:
        try:
            _, calls = parse_tool_calls(draft)
        except ValueError:
            calls = []
        if calls:
            return calls[0].arguments
    try:
        return json.loads(draft)
    except ValueError:
        return None
