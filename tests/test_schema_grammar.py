"""Schemas as people write them, answered by their grammar (grammar.py): every answer validates, formats
checked, whatever the model writes (the demo, or random logits: what a worse model could write), within
any max_tokens the closing path fits; verified drafting under a grammar is constrained AR token for
token; everyday pydantic models under every policy."""

import datetime
import enum
import json
import re
import uuid
from typing import Optional, Union

import jsonschema
import mlx.core as mx
import numpy as np
import pydantic
import pytest

from mlx_dgemma import batch_generate, generate, stream_generate
from mlx_dgemma.engine.grammar_rule import CLOSING_SLACK, MAX_DIGITS, WALK_OPERATIONS, GrammarRule
from mlx_dgemma.engine.resolve import generation_config, grammar_stop_ids
from mlx_dgemma.errors import TemplateError
from mlx_dgemma.structured.closing import CLOSING_CAP, check_closing_fits
from mlx_dgemma.structured.grammar import ANY_JSON, schema_grammar

POLICIES = ["reference", "fast", "ar", "verified", "auto"]
# Schemas the canvas template cannot lay out, one feature each (and annotations it ignores).
SCHEMAS = {
    "refs": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                "required": ["v", "kids"],
            }
        },
        "$ref": "#/$defs/node",
    },
    "definitions": {
        "definitions": {"n": {"type": "integer", "minimum": 3}},
        "type": "object",
        "properties": {"x": {"$ref": "#/definitions/n"}},
        "required": ["x"],
    },
    "unbounded": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}}, "note": {"type": "string"}},
        "required": ["tags", "note"],
    },
    "nullable": {
        "type": "object",
        "properties": {
            "a": {"type": ["integer", "null"]},
            "b": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "null"}]},
        },
        "required": ["a", "b"],
    },
    "combinators": {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
            {"properties": {"b": {"oneOf": [{"type": "boolean"}, {"type": "integer"}]}}, "required": ["b"]},
        ]
    },
    "formats": {
        "type": "object",
        "required": ["date", "time", "date-time", "duration", "email", "uuid", "uri", "hostname", "ipv4", "ipv6"],
        "properties": {
            f: {"type": "string", "format": f}
            for f in ["date", "time", "date-time", "duration", "email", "uuid", "uri", "hostname", "ipv4", "ipv6"]
        },
    },
    "pattern": {"type": "string", "pattern": "^[a-z]{2,4}-[0-9]{1,3}$"},
    "pattern-suffix": {
        "type": "object",
        "required": ["id", "v"],
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z0-9_]+(_DEVICE|_LAYOUT)$"},
            "v": {"type": "string", "pattern": r"v1\.0\.\d+"},
        },
    },
    "expression": {
        "$defs": {
            "expr": {
                "anyOf": [
                    *(
                        {
                            "type": "object",
                            "required": [k],
                            "additionalProperties": False,
                            "properties": {k: {"type": "array", "minItems": 2, "items": {"$ref": "#/$defs/expr"}}},
                        }
                        for k in "-+/*"
                    ),
                    {
                        "type": "object",
                        "required": ["expr"],
                        "additionalProperties": False,
                        "properties": {"expr": {"type": "string"}},
                    },
                ]
            }
        },
        "$ref": "#/$defs/expr",
    },
    "many-strings": {
        "type": "object",
        "required": [f"k{i:02d}" for i in range(30)],
        "properties": {f"k{i:02d}": {"type": "string"} for i in range(30)},
    },
    "map": {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1, "maxProperties": 3},
    "closed": {"type": "object", "properties": {"k": {"type": "boolean"}}, "additionalProperties": False},
    "pattern-properties": {
        "type": "object",
        "patternProperties": {"^x-": {"type": "string"}},
        "additionalProperties": False,
    },
    "tuple": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False, "minItems": 2},
    "numbers": {
        "type": "array",
        "minItems": 2,
        "items": {"type": "integer", "multipleOf": 5, "exclusiveMinimum": 0, "exclusiveMaximum": 100},
    },
    "dependent": {
        "type": "object",
        "required": ["a"],
        "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
        "dependentRequired": {"a": ["b"]},
    },
    "dependencies": {
        "type": "object",
        "required": ["a"],
        "properties": {"a": {"type": "string"}},
        "dependencies": {"a": {"properties": {"c": {"type": "boolean"}}, "required": ["c"]}},
    },
    "other-formats": {
        "type": "object",
        "required": ["r", "p", "x", "t", "u"],
        "properties": {
            "r": {"type": "string", "format": "uri-reference"},
            "p": {"type": "string", "format": "json-pointer"},
            "x": {"type": "string", "format": "regex"},
            "t": {"type": "string", "format": "uri-template"},
            "u": {"type": "string", "format": "made-up"},
        },
    },
    "any-const": {"enum": [{"k": [1, None]}, "x", 2.5, None]},
    "annotated": {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "$id": "http://example.com/s",
        "id": "s",
        "title": "t",
        "description": "d",
        "examples": [{}],
        "default": {},
        "readOnly": True,
        "x-vendor": {"a": 1},
        "type": "object",
        "required": ["a"],
        "properties": {"a": {"type": "string", "example": "e", "name": "n", "self": {}}},
    },
    "any-json": ANY_JSON,
    "alternation": {
        "type": "object",
        "required": ["hosts", "mode"],
        "properties": {
            "hosts": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["stage", "name", "path"],
                    "properties": {
                        "stage": {"type": "string", "pattern": "^test|acceptance|production$"},
                        "name": {"type": "string"},
                        "path": {"type": "string"},
                        "port": {"type": "integer"},
                    },
                },
            },
            "mode": {"type": "string", "pattern": "^(fast|careful)$"},
            "note": {"type": "string"},
        },
    },
}
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


def validate(answer, schema):
    jsonschema.validators.validator_for(schema)(schema, format_checker=FORMATS).validate(answer)


def grammar(demo, schema):
    model, tokenizer = demo
    return schema_grammar(
        tokenizer, schema, model.config.vocab_size, grammar_stop_ids(tokenizer, generation_config(model, tokenizer))
    )


@pytest.mark.parametrize("name", SCHEMAS)
def test_random_logits_under_a_grammar_validate_within_any_budget_that_fits(demo, name):
    """A model that writes noise still answers valid JSON: from ample room down to the closing path's
    own length, where the closing path takes over."""
    model, tokenizer = demo
    schema, vocab = SCHEMAS[name], model.config.vocab_size
    shortest = len(GrammarRule(grammar(demo, schema), vocab, 10_000).path)
    for seed, budget in [(0, 400), (1, 400), (2, shortest + 3), (3, shortest)]:
        rng = np.random.default_rng(seed)
        rule = GrammarRule(grammar(demo, schema), vocab, budget)
        while rule.step(mx.array(rng.normal(0, 4, vocab).astype(np.float32))) is not None and not rule.done:
            pass
        assert rule.finished and len(rule.output) <= budget, (name, seed, tokenizer.decode(rule.output))
        validate(json.loads(tokenizer.decode_clean(rule.output)), schema)


def wanting(vocab: int, token: int) -> mx.array:
    """Logits of a model that wants ``token``."""
    return mx.zeros(vocab).at[token].add(1.0)


def test_a_token_is_taken_only_where_the_answer_can_still_close_within_its_room(demo):
    """A string under ^test|acceptance|production$ begun with "e" can still close ("eacceptance"):
    the model's "e" is taken. Where the room left cannot hold that, it is not: the held closing
    path's next token is taken instead, and the answer ends valid all the same."""
    model, tokenizer = demo
    schema, vocab = SCHEMAS["alternation"], model.config.vocab_size
    g = grammar(demo, schema)
    start = tokenizer.encode('{"hosts": [{"stage": "', add_special_tokens=False)
    e = tokenizer.encode("e", add_special_tokens=False)[0]
    ample = GrammarRule(g, vocab, 10_000)
    for token in start:
        ample.step(wanting(vocab, token))
    held = len(ample.path)  # 'test", "name": ...': "e" then "acceptance" takes 7 more
    for budget, takes_e in [(400, True), (len(start) + held + 3, False)]:
        rule = GrammarRule(g, vocab, budget)
        for token in start + [e]:
            rule.step(wanting(vocab, token))
        assert (rule.output[-1] == e) == takes_e, tokenizer.decode(rule.output)
        while rule.step(wanting(vocab, e)) is not None and not rule.done:
            pass
        assert rule.finished and len(rule.output) <= budget
        validate(json.loads(tokenizer.decode_clean(rule.output)), schema)


def test_a_token_after_which_no_closing_path_is_found_is_not_taken(demo):
    """The alternation inside a group gives no example of "acceptance" or "production", so after "e"
    no closing path is found: the model's "e" is not taken there (it was, and the answer never
    closed), though it is after "test", where any text may follow."""
    schema = {
        "type": "object",
        "required": ["stage"],
        "properties": {"stage": {"type": "string", "pattern": "(^test|acceptance|production$)"}},
    }
    rule = wanting_forever(demo, schema, 150, '{"stage": "', "e")
    answer = json.loads(demo[1].decode_clean(rule.output))
    validate(answer, schema)
    assert answer["stage"].startswith("test") and len(rule.output) == 150


def test_an_integer_the_model_would_not_end_stays_within_what_pythons_json_reads(demo):
    """A model that writes digits forever, with room for 5,000: the integer ends at MAX_DIGITS digits
    (Python's JSON reader refuses one of over 4,300), and the answer reads and validates."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    rule = wanting_forever(demo, schema, 5000, '{"n": ', "7")
    answer = json.loads(demo[1].decode_clean(rule.output))
    validate(answer, schema)
    assert len(str(answer["n"])) == MAX_DIGITS


def wanting_forever(demo, schema: dict, budget: int, start: str, wanted: str) -> GrammarRule:
    """The rule's answer where the model writes ``start``, then wants ``wanted``'s token to the end."""
    model, tokenizer = demo
    vocab = model.config.vocab_size
    rule = GrammarRule(grammar(demo, schema), vocab, budget)
    for token in tokenizer.encode(start, add_special_tokens=False):
        rule.step(wanting(vocab, token))
    (token,) = tokenizer.encode(wanted, add_special_tokens=False)
    while rule.step(wanting(vocab, token)) is not None and not rule.done:
        pass
    return rule


@pytest.mark.parametrize("name", ["alternation", "many-strings", "expression", "formats"])
def test_the_closing_path_costs_a_bounded_count_of_operations_per_token(demo, name):
    """Each token's search for a closing path after it takes at most WALK_OPERATIONS per token of the
    path from the start and CLOSING_SLACK more, whatever max_tokens is (a count, not a timing)."""
    model, tokenizer = demo
    schema, vocab = SCHEMAS[name], model.config.vocab_size
    shortest = len(GrammarRule(grammar(demo, schema), vocab, 10_000).path)
    for budget in (shortest + 40, 1000):
        rng = np.random.default_rng(0)
        rule = GrammarRule(grammar(demo, schema), vocab, budget)
        bound = WALK_OPERATIONS * (shortest + CLOSING_SLACK) + 1  # (the one past the limit stops the walk)
        while rule.step(mx.array(rng.normal(0, 4, vocab).astype(np.float32))) is not None and not rule.done:
            pass
        assert 0 < rule.most_operations <= bound, (budget, rule.most_operations, bound)
        validate(json.loads(tokenizer.decode_clean(rule.output)), schema)


@pytest.mark.parametrize(
    "policy",
    [pytest.param("reference", marks=pytest.mark.slow), "ar", "verified", pytest.param("auto", marks=pytest.mark.slow)],
)
def test_sampled_answers_validate_under_every_policy_streamed_or_not_down_to_the_shortest(demo, policy):
    model, tokenizer = demo
    schema = SCHEMAS["alternation"]
    shortest = len(GrammarRule(grammar(demo, schema), model.config.vocab_size, 10_000).path)
    for seed, budget in [(0, shortest), (1, shortest + 7), (2, 150)]:
        kwargs = dict(max_tokens=budget, policy=policy, schema=schema, seed=seed, temperature=1.0)
        streamed = list(stream_generate(*demo, "json: hosts", **kwargs))
        text = "".join(r.text for r in streamed)
        assert streamed[-1].finish_reason == "stop" and streamed[-1].generation_tokens <= budget, text
        validate(json.loads(text), schema)
        validate(json.loads(generate(*demo, "json: hosts", **kwargs)), schema)


@pytest.mark.parametrize(
    "name, policy",
    [
        ("refs", "reference"),
        ("unbounded", "fast"),
        ("nullable", "ar"),
        ("formats", "verified"),
        ("map", "auto"),
        ("any-json", "reference"),
    ],
)
def test_the_demo_answers_validate_under_every_policy(demo, name, policy):
    responses = list(
        stream_generate(*demo, "json: name=ada age=36", max_tokens=400, policy=policy, schema=SCHEMAS[name], seed=0)
    )
    assert responses[-1].finish_reason == "stop"
    validate(json.loads("".join(r.text for r in responses)), SCHEMAS[name])


@pytest.mark.parametrize("name, prompt", [("refs", "json: name=ada age=36"), ("tuple", "sort: 42 17 85")])
def test_verified_under_a_grammar_is_constrained_ar_token_for_token(demo, name, prompt):
    ar = generate(*demo, prompt, max_tokens=80, policy="ar", schema=SCHEMAS[name])
    for length, steps in [(8, 1), (16, 2)]:
        assert (
            generate(
                *demo,
                prompt,
                max_tokens=80,
                policy="verified",
                schema=SCHEMAS[name],
                draft_length=length,
                draft_steps=steps,
            )
            == ar
        )


def test_grammar_rows_batched_equal_themselves_alone(demo):
    prompts = ["json: name=ada age=36", "sort: 42 17 85"]
    for policy, temperature in [("ar", None), ("verified", 0.9)]:  # (verified's draft fixed: its plan learns)
        kwargs = dict(
            max_tokens=60,
            policy=policy,
            schema=SCHEMAS["unbounded"],
            temperature=temperature,
            **(dict(draft_length=8, draft_steps=1) if policy == "verified" else {}),
        )
        together = batch_generate(*demo, prompts, seeds=[0, 1], **kwargs).texts
        assert together == [generate(*demo, p, seed=s, **kwargs) for p, s in zip(prompts, [0, 1])]


@pytest.mark.parametrize(
    "schema, keyword",
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "properties": {"a": {"type": "string"}}, "if": {"required": ["a"]}, "then": {}}, "if"),
        ({"not": {"type": "string"}}, "not"),
        ({"type": "array", "contains": {"type": "integer"}}, "contains"),
        ({"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames"),
    ],
)
def test_what_no_grammar_enforces_is_refused_by_name(demo, schema, keyword):
    with pytest.raises(TemplateError, match=f'cannot be enforced: .*"{keyword}"'):
        generate(*demo, "json: x", schema=schema, policy="ar")


def answer_to_noise(demo, schema: dict, seed: int, limit: int = 200) -> str:
    """What the schema's rule writes from random logits (the grammar decides every structural token)."""
    model, tokenizer = demo
    rng = np.random.default_rng(seed)
    rule = GrammarRule(grammar(demo, schema), model.config.vocab_size, limit)
    while rule.step(mx.array(rng.normal(0, 4, model.config.vocab_size).astype(np.float32))) is not None:
        if rule.done:
            break
    return tokenizer.decode_clean(rule.output)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "additionalProperties": {"type": "string"}, "minProperties": 4},
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "minProperties": 4,
        },  # (two keys past the properties)
        {
            "anyOf": [
                {"type": "object", "patternProperties": {"^x": {}}, "additionalProperties": False, "minProperties": 2},
                {"type": "null"},
            ]
        },
    ],
)
def test_a_min_properties_past_the_required_properties_is_met_by_distinct_keys(demo, schema):
    """llguidance lets a key of additionalProperties or patternProperties repeat ({"color": "da",
    "name": "ada", "year": "rda", "color": "dda"} met minProperties 4 with three keys once parsed); the
    rule never closes a key its object has (distinct_keys.py), so the keys counted are distinct."""
    for seed in range(3):
        text = answer_to_noise(demo, schema, seed)
        pairs = json.loads(text, object_pairs_hook=list)
        assert pairs is None or len(dict(pairs)) == len(pairs), text
        validate(None if pairs is None else dict(pairs), schema)


def test_a_min_properties_its_required_properties_meet_is_answered_with_as_many_keys(demo):
    """Three required properties and one key more: that key is none of them, so four keys once parsed."""
    schema = {
        "type": "object",
        "properties": {k: {"type": "integer"} for k in "abc"},
        "required": list("abc"),
        "additionalProperties": {"type": "string"},
        "minProperties": 4,
    }
    for seed in range(3):
        text = answer_to_noise(demo, schema, seed)
        pairs = json.loads(text, object_pairs_hook=list)
        assert len(dict(pairs)) >= 4, text
        validate(dict(pairs), schema)


@pytest.mark.parametrize(
    "schema, loop",
    [
        ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "#/$defs/a → #/$defs/a"),
        ({"$ref": "#", "title": "t"}, "# → #"),
        (
            {
                "type": "object",
                "required": ["x"],
                "properties": {"x": {"$ref": "#/$defs/b"}},
                "$defs": {"b": {"$ref": "#/$defs/c"}, "c": {"description": "d", "$ref": "#/$defs/b"}},
            },
            "#/$defs/b → #/$defs/c → #/$defs/b",
        ),
    ],
)
def test_a_ref_that_leads_back_to_itself_is_refused_by_name(demo, schema, loop):
    """It never describes a value (llguidance's grammar ended the answer before it began, refused as if
    a pattern were to blame)."""
    with pytest.raises(
        TemplateError,
        match=rf"^\$ref at \$\S* leads back to itself \({re.escape(loop)}\) and "
        "never describes a value;",
    ):
        grammar(demo, schema)


def test_a_ref_back_to_a_schema_that_describes_a_value_is_answered(demo):
    schema = {"type": "object", "required": ["k"], "properties": {"k": {"type": "integer"}, "t": {"$ref": "#"}}}
    validate(json.loads(generate(*demo, "json: k=3", schema=schema, max_tokens=64, policy="ar")), schema)


def test_a_budget_shorter_than_the_closing_path_is_refused_before_any_forward(demo):
    schema = SCHEMAS["formats"]
    shortest = len(GrammarRule(grammar(demo, schema), demo[0].config.vocab_size, 10_000).path)
    with pytest.raises(TemplateError, match=f"shortest answer takes {shortest} tokens, more than max_tokens 5"):
        generate(*demo, "json: x", schema=schema, policy="ar", max_tokens=5)


# -- everyday pydantic models -------------------------------------------------------------------------


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Address(pydantic.BaseModel):
    city: str
    zip: Optional[str] = None


class Everyday(pydantic.BaseModel):
    tags: list[str]
    nickname: Optional[str]
    address: Address
    color: Color
    counts: dict[str, int]
    born: datetime.date
    seen: datetime.datetime
    id: uuid.UUID
    either: Union[int, str]


class Tree(pydantic.BaseModel):
    value: int
    children: list["Tree"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("model_class", [Everyday, Tree])
def test_everyday_pydantic_models_answer_under_every_policy(demo, policy, model_class):
    text = generate(
        *demo, "json: name=ada age=36", max_tokens=256, policy=policy, schema=model_class.model_json_schema(), seed=1
    )
    model_class.model_validate_json(text)
    validate(json.loads(text), model_class.model_json_schema())


def required_keys(n: int) -> dict:
    keys = [f"required_key_number_{i:02d}" for i in range(n)]
    return {"type": "object", "properties": {k: {"type": "integer"} for k in keys}, "required": keys}


def test_a_schema_whose_closing_path_is_past_the_cap_is_refused(demo):
    """300 required keys of 22 characters: the shortest answer is longer than CLOSING_CAP tokens on the
    demo's tokenizer, so no closing path is found; such a schema would be answered unguarded and cut at
    max_tokens mid-string. No max_tokens helps, so none is asked for."""
    model, tokenizer = demo
    schema = required_keys(300)
    assert len(tokenizer.encode(json.dumps({k: 0 for k in schema["required"]}))) > CLOSING_CAP
    for policy in ("ar", "reference"):
        with pytest.raises(
            TemplateError,
            match=f"more than {CLOSING_CAP} tokens, the most an answer is closed within, "
            "so no max_tokens fits it; lower its minLength or minItems, or make "
            "fewer of its keys required$",
        ):
            generate(*demo, "json: x", schema=schema, max_tokens=256, policy=policy)
    with pytest.raises(TemplateError, match=f"more than {CLOSING_CAP} tokens, the most an answer is closed within"):
        check_closing_fits(grammar(demo, schema), model.config.vocab_size, CLOSING_CAP + 88)  # past the demo's context


def test_a_schema_whose_shortest_answer_cannot_fit_the_context_says_so(demo):
    """A shortest answer within the closing cap, but past what the 8192-position context leaves after a
    6000-token prompt: raising max_tokens would not help, and the error does not ask for it."""
    model, tokenizer = demo
    schema = {"type": "string", "minLength": 3000}
    shortest = len(GrammarRule(grammar(demo, schema), model.config.vocab_size, CLOSING_CAP).path)
    assert shortest < CLOSING_CAP
    with pytest.raises(
        TemplateError,
        match=rf"takes {shortest} tokens, more than the 2\d\d\d the model's context "
        "leaves after the prompt, so no max_tokens fits it;",
    ):
        generate(*demo, "x" * 6000, schema=schema, max_tokens=32, policy="ar")


@pytest.mark.parametrize(
    "name, shortest",
    [
        ("many-strings", {f"k{i:02d}": "" for i in range(30)}),  # a quote closes each string, however many came before
        ("pattern-suffix", {"id": "0_DEVICE", "v": "v1.0.0"}),  # a pattern's shortest match, not its narrowest way on
        ("expression", {"expr": ""}),  # the key that opens a string, not one of the four that open an array of more
    ],
)
def test_the_closing_path_from_the_start_is_the_shortest_answer(demo, name, shortest):
    model, tokenizer = demo
    path = GrammarRule(grammar(demo, SCHEMAS[name]), model.config.vocab_size, 10_000).path
    answer = json.loads(tokenizer.decode_clean(path))
    validate(answer, SCHEMAS[name])
    assert len(json.dumps(answer)) == len(json.dumps(shortest)), tokenizer.decode_clean(path)


def test_a_schema_whose_closing_path_fits_is_answered_valid(demo):
    schema = required_keys(4)
    validate(json.loads(generate(*demo, "json: x", schema=schema, max_tokens=256, policy="ar")), schema)


def test_where_llguidance_gives_up_mid_answer_no_answer_ends_as_if_whole(demo):
    """A pattern past llguidance's lexer limit: after some characters its mask allows only the end, the
    string open. The rule then takes its closing path's token, or fails by name; it never ends there."""
    model, tokenizer = demo
    schema = {"type": "object", "properties": {"q": GIVES_UP}, "additionalProperties": False}
    for seed in range(3):
        rng = np.random.default_rng(seed)
        rule = GrammarRule(grammar(demo, schema), model.config.vocab_size, 300)
        try:
            for token in tokenizer.encode('{"q": "', add_special_tokens=False):  # (the key the shortest answer skips)
                rule.step(wanting(model.config.vocab_size, token))
            while (
                rule.step(mx.array(rng.normal(0, 4, model.config.vocab_size).astype(np.float32))) is not None
                and not rule.done
            ):
                pass
        except TemplateError as e:
            assert "llguidance gave up on the schema mid-answer" in str(e) and "\n" not in str(e)
            continue
        validate(json.loads(tokenizer.decode_clean(rule.output)), schema)


GIVES_UP = {"type": "string", "maxLength": 5000, "pattern": r"^(?:\S+\s+){0,99}\S+$"}  # (at its first character)


@pytest.mark.parametrize(
    "schema",
    [
        GIVES_UP,
        {"type": "object", "required": ["q"], "properties": {"q": GIVES_UP}},
        {"type": "string", "maxLength": 5000, "pattern": r"^(?:\S+\s+){0,40}\S+$"},  # (the walk takes "a" whole)
    ],
)
def test_a_schema_llguidance_gives_up_on_within_its_shortest_answer_is_refused_before_any_forward(demo, schema):
    """Its shortest answer's first tokens are taken at admission as a row takes them, masks and all."""
    with pytest.raises(TemplateError, match=r"^the schema cannot be enforced: llguidance gave up on it") as caught:
        generate(*demo, "hello", schema=schema, policy="ar", max_tokens=64)
    assert "\n" not in str(caught.value)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1]) * 1024


def test_a_pattern_that_forces_millions_of_characters_is_refused_within_megabytes(demo):
    """a{110} nested four deep forces 110**4 characters: llguidance's default lexer fuel builds ~440 MB
    of them before the walk sees the cap; the walk's own fuel (closing.WALK_FUELS) stops it in a few."""
    pattern = "^" + "(?:" * 4 + "a" + "{110})" * 4 + "$"
    schema = {"type": "object", "required": ["code"], "properties": {"code": {"type": "string", "pattern": pattern}}}
    compiled = grammar(demo, schema)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # (the peak resident set restarts from now)
    baseline = _status_bytes("VmRSS")
    with pytest.raises(TemplateError, match=f"shortest answer takes more than {CLOSING_CAP} tokens"):
        check_closing_fits(compiled, demo[0].config.vocab_size, 256)
    assert _status_bytes("VmHWM") - baseline < 64 << 20
