"""Schemas by grammar (grammar.py) at the edge of ``max_tokens``: an answer the closing path cannot
keep valid is refused before any forward, never cut invalid."""

import json

import pytest

from mlx_dgemma import generate, load
from mlx_dgemma.errors import TemplateError
from mlx_dgemma.generate import DEMO_MODEL
from mlx_dgemma.grammar import CLOSING_CAP

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.skipif(not (DEMO_MODEL / "model.safetensors").exists(), reason="no bundled demo model")


def required_keys(n: int) -> dict:
    keys = [f"required_key_number_{i:02d}" for i in range(n)]
    return {"type": "object", "properties": {k: {"type": "integer"} for k in keys}, "required": keys}


@pytest.fixture(scope="module")
def demo():
    return load(str(DEMO_MODEL))


def test_a_schema_whose_closing_path_is_past_the_cap_is_refused(demo):
    """30 required keys of 22 characters: the shortest answer is longer than CLOSING_CAP tokens on the
    demo's tokenizer, so the closing path is not found. Such a schema was answered unguarded and cut
    at max_tokens mid-string (JSONSchemaBench's Github_hard/o21072.json, under every policy)."""
    model, tokenizer = demo
    schema = required_keys(30)
    assert len(tokenizer.encode(json.dumps({k: 0 for k in schema["required"]}))) > CLOSING_CAP
    for policy in ("ar", "reference"):
        with pytest.raises(TemplateError, match="more than 512 tokens, more than max_tokens 256; raise max_tokens"):
            generate(model, tokenizer, "json: x", schema=schema, max_tokens=256, policy=policy)
    with pytest.raises(TemplateError, match=f"more than {CLOSING_CAP} tokens, the most an answer is closed within; "
                                            "make fewer of its keys required"):
        generate(model, tokenizer, "json: x", schema=schema, max_tokens=CLOSING_CAP + 88, policy="ar")


def test_a_schema_whose_closing_path_fits_is_answered_valid(demo):
    model, tokenizer = demo
    schema = required_keys(4)
    answer = generate(model, tokenizer, "json: x", schema=schema, max_tokens=256, policy="ar")
    jsonschema.validate(json.loads(answer), schema)
