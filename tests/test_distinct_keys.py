"""No object of a grammar's answer writes a key twice (distinct_keys.py), under every policy: maps
whose minProperties only distinct keys meet, a model that wants to repeat a key (the demo with its
head biased towards `"` and `a`), and random logits; a minProperties its keys cannot name is refused."""

import json

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from mlx_dgemma import generate, load, stream_generate
from mlx_dgemma.engine.grammar_rule import GrammarRule
from mlx_dgemma.errors import TemplateError
from mlx_dgemma.generate import DEMO_MODEL
from mlx_dgemma.structured.distinct_keys import KeyTracker
from mlx_dgemma.structured.string_examples import match_count

from .test_schema_grammar import grammar

POLICIES = ["reference", "fast", "ar", "verified", "auto"]
MAPS = {
    "pattern-map": {
        "type": "object",
        "patternProperties": {"^[a-z]{1,8}$": {"type": "integer"}},
        "additionalProperties": False,
        "minProperties": 3,
    },
    "integer-map": {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 5},
    "nested": {
        "type": "object",
        "required": ["groups"],
        "properties": {
            "groups": {
                "type": "array",
                "minItems": 2,
                "maxItems": 2,
                "items": {"type": "object", "additionalProperties": {"type": "string"}, "minProperties": 2},
            }
        },
    },
}


def distinct_objects(text: str):
    """The answer's value, asserting that no object in it repeats a key."""

    def distinct(pairs):
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)), f"a repeated key in {text}"
        return dict(pairs)

    return json.loads(text, object_pairs_hook=distinct)


@pytest.mark.parametrize(
    "text, repeats",
    [
        ('{"a": 1, "a"', True),
        ('{"a": 1, "b"', False),
        ('{"a": 1, "\\u0061"', True),  # (JSON reads both as "a")
        ('{"a": {"a": 1}, "b": [{"a": 2}], "a"', True),
        ('{"a": {"a": 1}, "b": [{"a": 2}]', False),  # (the same key in other objects)
        ('{"a": "x\\"y", "a\\"', False),  # (an escaped quote does not close the key)
        ('["a", "a"]', False),
        ('{"k": ["a", "a"], "v": "a"', False),  # (strings that are values)
    ],
)
def test_a_key_is_repeated_only_where_its_object_has_it_as_json_reads_it(text, repeats):
    keys = KeyTracker()
    assert keys.feed(text.encode()) != repeats


@pytest.mark.parametrize("pattern, count", [("^[ab]$", 2), ("^(x|yz)?$", 3), ("^k[0-9]{2}$", 100), ("^a", None)])
def test_the_names_a_pattern_matches_are_counted_on_its_parse_tree(pattern, count):
    assert match_count(pattern) == count


@pytest.mark.parametrize("name", MAPS)
def test_random_logits_write_each_key_once(demo, name):
    """A model that writes noise: minProperties met by distinct keys, whatever it picks."""
    model, tokenizer = demo
    vocab = model.config.vocab_size
    for seed in range(3):
        rng = np.random.default_rng(seed)
        rule = GrammarRule(grammar(demo, MAPS[name]), vocab, 400)
        while rule.step(mx.array(rng.normal(0, 4, vocab).astype(np.float32))) is not None and not rule.done:
            pass
        text = tokenizer.decode_clean(rule.output)
        jsonschema.validate(distinct_objects(text), MAPS[name])


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["pattern-map", "integer-map"])
def test_maps_whose_min_properties_only_distinct_keys_meet_are_answered_under_every_policy(demo, name, policy):
    kwargs = dict(max_tokens=120, policy=policy, schema=MAPS[name], seed=0)
    streamed = list(stream_generate(*demo, "json: a=1 b=2 c=3 d=4 e=5", **kwargs))
    assert streamed[-1].finish_reason == "stop"
    jsonschema.validate(distinct_objects("".join(r.text for r in streamed)), MAPS[name])


@pytest.fixture(scope="module")
def repeating():
    """The demo with its head biased towards `"`, `a` and `,`: it writes {"a": 1, "a": 8, ...} where
    nothing stops it (the key "a" again and again)."""
    model, tokenizer = load(DEMO_MODEL)
    bias = np.zeros(model.config.vocab_size, np.float32)
    for text, logit in [('"', 40.0), ("a", 30.0), (",", 20.0)]:
        (token,) = tokenizer.encode(text, add_special_tokens=False)
        bias[token] = logit
    head, bias = model.head, mx.array(bias)
    model.head = lambda hidden: head(hidden) + bias
    return model, tokenizer


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 4},
        {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 4},
        MAPS["pattern-map"],
    ],
)
def test_a_model_that_wants_to_repeat_a_key_writes_each_once(repeating, schema, policy):
    answer = generate(*repeating, "json: a=1 a=2 a=3", schema=schema, policy=policy, max_tokens=60, seed=0)
    value = distinct_objects(answer)
    jsonschema.validate(value, schema)
    assert len(value) >= 3, answer  # (it wrote several keys: each one "a" was wanted)


def test_the_biased_model_does_repeat_a_key_where_nothing_stops_it(repeating):
    """The bias is real: free text, it writes the same key twice."""
    text = generate(*repeating, "json: a=1", max_tokens=12, policy="ar", seed=0)
    assert text.count('"a"') >= 2 or text.count('""') >= 2, text


@pytest.mark.parametrize(
    "schema, path, names",
    [
        (
            {
                "type": "object",
                "patternProperties": {"^[ab]$": {"type": "integer"}},
                "additionalProperties": False,
                "minProperties": 3,
            },
            "$",
            2,
        ),
        (
            {
                "type": "object",
                "properties": {"x": {"type": "object"}},
                "patternProperties": {"^k[0-9]$": {}},
                "additionalProperties": False,
                "minProperties": 12,
            },
            "$",
            11,
        ),
    ],
)
def test_a_min_properties_past_the_names_its_keys_can_take_is_refused_by_name(demo, schema, path, names):
    with pytest.raises(TemplateError, match=rf"minProperties at \{path} is .* only {names} distinct names"):
        grammar(demo, schema)


def test_a_min_properties_the_names_meet_exactly_is_answered_with_each(demo):
    schema = {
        "type": "object",
        "patternProperties": {"^[abc]$": {"type": "integer"}},
        "additionalProperties": False,
        "minProperties": 3,
    }
    answer = distinct_objects(generate(*demo, "json: a=1", schema=schema, policy="ar", max_tokens=60))
    assert sorted(answer) == ["a", "b", "c"]
