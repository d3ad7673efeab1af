"""Structured answers by grammar: a JSON schema, or any JSON value, compiled by llguidance (the grammar
engine vLLM, SGLang and llama.cpp ship) into a matcher that says, token by token, which tokens may
come next. ``GrammarRule`` decodes with it, greedy or sampled, one token at a time (the engine's
autoregressive rows) or verifying a draft (drafting.verify_rounds): at each position the encoder's
logits are masked to the tokens the grammar allows before the token is chosen, so verified output
under a grammar is the autoregressive constrained output, token for token when greedy and in
distribution when sampled. Tokens the grammar forces (a key, a bracket) go into drafts as known tokens.

Here: compiling a schema (checked first: its shape, keywords llguidance cannot enforce, ``$ref``
loops) and the mask; closing.py walks the closing path (the way out of a grammar state that fits a
budget) the rule (grammar_rule.py) holds at every token.
"""

from __future__ import annotations

import json
import urllib.parse
from dataclasses import dataclass

import llguidance
import numpy as np

from ..errors import TemplateError
from .schema_rewrite import required_only, rewrite
from .string_examples import match_count, string_examples

# Compact JSON, laid out as the templates lay it out ({"a": 1, "b": [2, 3]}): no free whitespace a
# small model could loop in, and the separators the model saw in training.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SCHEMA_CHARS = 1 << 20  # a schema's JSON text (llguidance's own limits bound the grammar it builds)
MAX_CHOICES = 10_000  # values of one enum (llguidance builds 100,000 in seconds)
MAX_NESTING = 128  # levels of JSON in a schema (64 of properties)
ANY_JSON: dict = {}  # the schema every JSON value validates against
JSON_OBJECT = {"type": "object"}  # OpenAI's json_object: any object


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled grammar (llguidance's serialized form) for one tokenizer; ``schema`` is what it came
    from; ``shortest`` the grammar of its required-only shape (schema_rewrite.required_only), on which
    the closing path from the start is walked (None where that shape does not compile); ``examples``
    the tokens of short strings its string constraints accept, each with its closing quote
    (string_examples.py), which a closing path tries where a string cannot end yet."""

    text: str
    schema: object
    tokenizer: llguidance.LLTokenizer
    shortest: str | None = None
    examples: tuple[tuple[int, ...], ...] = ()

    def matcher(self, fuel: int | None = None, shortest: bool = False) -> llguidance.LLMatcher:
        """A fresh matcher of the grammar (``shortest``: of its required-only shape); ``fuel`` bounds
        the lexer's work over the matcher's life (llguidance's ``initial_lexer_fuel``; None: its
        default of 1,000,000, about 500 MB of forced characters)."""
        limits = None if fuel is None else llguidance.LLParserLimits(initial_lexer_fuel=fuel)
        return llguidance.LLMatcher(
            self.tokenizer, self.shortest if shortest else self.text, log_level=0, limits=limits
        )


def grammar_tokenizer(tokenizer, vocab: int, stop_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of ``tokenizer`` over the model's ``vocab`` ids, ending a grammar with the
    first of ``stop_ids`` (cached on the tokenizer: building one reads the whole vocabulary)."""
    key = (vocab, tuple(stop_ids))
    cached = getattr(tokenizer, "_grammar_tokenizer", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    backend = getattr(tokenizer, "_backend", None)
    if backend is None:
        raise TemplateError(
            "this checkpoint has no tokenizer files, so a schema cannot be enforced; "
            "add tokenizer.json or tokenizer.model"
        )
    if hasattr(backend, "_tok"):  # tokenizer.json: llguidance reads the tokenizers library's own format
        built = llguidance.LLTokenizer(backend._tok.to_str(), n_vocab=vocab, eos_token=list(stop_ids))
    else:
        built = llguidance.LLTokenizer(
            _SentencePieceVocabulary(backend._sp, vocab, stop_ids[0]), n_vocab=vocab, eos_token=list(stop_ids)
        )
    tokenizer._grammar_tokenizer = (key, built)
    return built


class _SentencePieceVocabulary:
    """A sentencepiece model as llguidance's ``TokenizerWrapper`` reads one: each id's bytes (``▁`` a
    space, ``<0xNN>`` its byte, a special token 0xFF and its name) and an encoder."""

    is_tokenizer_wrapper = True

    def __init__(self, sp, vocab: int, eos: int):
        self._sp = sp
        self.eos_token_id, self.bos_token_id = eos, None
        self.tokens, self.special_token_ids = [], []
        for i in range(vocab):
            piece = sp.id_to_piece(i) if i < sp.get_piece_size() else ""
            if i < sp.get_piece_size() and sp.is_byte(i):
                self.tokens.append(bytes([int(piece[3:5], 16)]))
            elif i < sp.get_piece_size() and (
                sp.is_control(i)
                or sp.is_unknown(i)
                or (piece.startswith("<") and piece.endswith(">") and len(piece) > 2)
            ):
                self.tokens.append(b"\xff" + piece.encode())
                self.special_token_ids.append(i)
            else:
                self.tokens.append(piece.replace("▁", " ").encode())

    def __call__(self, text: str | bytes) -> list[int]:
        return self._sp.encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)


def schema_grammar(tokenizer, schema, vocab: int, stop_ids: list[int], where: str = "schema") -> Grammar:
    """The grammar of the JSON values ``schema`` validates (rewritten first: schema_rewrite.py), or a
    ``TemplateError`` saying what in the schema cannot be enforced. Keywords that only annotate
    (title, description, examples, vendor keys) are ignored, as JSON Schema says."""
    if not isinstance(schema, (dict, bool)):
        raise TemplateError(f"a JSON schema is an object, got {type(schema).__name__}")
    try:
        text = json.dumps(rewritten := rewrite(schema), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise TemplateError(f"the {where} is not JSON ({e})") from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise TemplateError(f"the {where} is {len(text)} characters of JSON, more than {MAX_SCHEMA_CHARS}; shorten it")
    _check_shape(schema)
    llt = grammar_tokenizer(tokenizer, vocab, stop_ids)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
    except ValueError as e:
        raise TemplateError(f"the {where} cannot be read: {single_line(e)}") from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, llt)
    if failed:
        raise TemplateError(f"the {where} cannot be enforced: {single_line(messages[0])}")
    examples = tuple(tuple(llt.tokenize_str(json.dumps(example)[1:])) for example in string_examples(rewritten))
    return Grammar(grammar, schema, llt, _shortest_grammar(schema, llt), examples)


def _shortest_grammar(schema, llt: llguidance.LLTokenizer) -> str | None:
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(rewrite(required_only(schema))), overrides=JSON_OPTIONS
        )
    except (ValueError, TypeError, RecursionError):
        return None
    failed, _ = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, llt)
    return None if failed else grammar


def _check_shape(schema) -> None:
    """Refuse, before compiling, an enum of more than ``MAX_CHOICES`` values, JSON nested deeper than
    ``MAX_NESTING`` (llguidance's compiler would give up on it with a recursion error), a
    ``minProperties`` more than its keys' names (``_check_key_space``) and a ``$ref`` that leads back
    to itself (``_check_ref_loops``)."""
    stack, refs = [(schema, "$", 0, False)], []
    while stack:
        node, path, depth, value = stack.pop()  # (value: inside an enum, const, default or example)
        if depth > MAX_NESTING:
            raise TemplateError(f"schema at {path[:60]}…: nested deeper than {MAX_NESTING} levels; flatten it")
        if isinstance(node, dict):
            values = node.get("enum")
            if isinstance(values, list) and len(values) > MAX_CHOICES:
                raise TemplateError(
                    f"enum at {path} has {len(values)} values, more than the {MAX_CHOICES} a schema "
                    "takes; use a pattern or fewer values"
                )
            if not value:
                _check_key_space(node, path)
                if isinstance(node.get("$ref"), str):
                    refs.append((path, node["$ref"]))
            stack.extend(
                (v, f"{path}.{k}", depth + 1, value or k in _VALUES)
                for k, v in node.items()
                if isinstance(v, (dict, list))
            )
        elif isinstance(node, list):
            stack.extend(
                (v, f"{path}[{i}]", depth + 1, value) for i, v in enumerate(node) if isinstance(v, (dict, list))
            )
    _check_ref_loops(schema, refs)


_VALUES = ("enum", "const", "default", "examples")  # keywords whose values are JSON, not schemas


def _check_key_space(schema: dict, path: str) -> None:
    """An object's keys are distinct (distinct_keys.py), so a ``minProperties`` needs as many names:
    refuse one larger than the names its keys can take, where those are finitely many (its
    ``properties``, and with ``additionalProperties`` false, the strings its ``patternProperties``
    match, counted by ``string_examples.match_count``)."""
    least, kind = schema.get("minProperties"), schema.get("type", "object")
    if not isinstance(least, int) or least <= 1 or "object" not in (kind if isinstance(kind, list) else [kind]):
        return
    if schema.get("additionalProperties", True) is not False:
        return  # any other key may be written
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    patterns = schema.get("patternProperties") if isinstance(schema.get("patternProperties"), dict) else {}
    names = len(properties)
    for pattern in patterns:
        count = match_count(pattern)
        if count is None:
            return
        names += count
    if least > names:
        raise TemplateError(
            f"minProperties at {path} is {least}, but its keys can take only {names} distinct names "
            f"({len(properties)} properties, and what its patternProperties match); lower minProperties to "
            f"{names}, or allow more keys"
        )


_ONLY_A_REF = {
    "$ref",
    "$defs",
    "definitions",
    "$schema",
    "$id",
    "$comment",
    "title",
    "description",
    "default",
    "examples",
}  # a schema with no other keyword says nothing but its $ref


def _check_ref_loops(schema, refs: list[tuple[str, str]]) -> None:
    """Refuse a ``$ref`` (``refs``: where each is, and what it says) whose chain of schemas that are only
    a ``$ref`` comes back round: it never describes a value (llguidance's grammar would end the answer
    before it starts). Each reference is followed once."""
    settled: set[str] = set()
    for path, ref in refs:
        chain: list[str] = []
        while ref.startswith("#") and ref not in settled:
            if ref in chain:
                loop = " → ".join(chain[chain.index(ref) :] + [ref])
                raise TemplateError(
                    f"$ref at {path} leads back to itself ({loop[:120]}) and never describes a value; "
                    "replace one of those references with the schema it stands for"
                )
            chain.append(ref)
            target = _pointed(schema, ref)
            if not isinstance(target, dict) or not isinstance(target.get("$ref"), str) or set(target) - _ONLY_A_REF:
                break
            ref = target["$ref"]
        settled.update(chain)


def _pointed(schema, ref: str):
    """What the local reference ``ref`` (``#`` or ``#/a/b``) points to in ``schema``, or None."""
    if ref != "#" and not ref.startswith("#/"):
        return None  # (an anchor: llguidance resolves it)
    node = schema
    for part in ref[2:].split("/") if ref != "#" else []:
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def single_line(message) -> str:
    """``message``'s words on one line, cut short (llguidance's errors span lines)."""
    text = " ".join(str(message).split())
    return text if len(text) <= 300 else text[:300] + "…"


def allowed_tokens(matcher: llguidance.LLMatcher, vocab: int) -> np.ndarray:
    """The [vocab] boolean mask of the tokens ``matcher`` allows next."""
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return np.unpackbits(bits, bitorder="little")[:vocab].astype(bool)
