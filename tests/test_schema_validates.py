"""The promise of JSON-schema templates: every answer parses and validates against its schema.

Every schema the tests and examples use, and the edge schemas templates take (required keys, enums
and consts with a type, bounds past a float's precision), answered by the bundled demo model and by
random canvases (any tokens the clamps allow: what a worse model could write), each checked with
``jsonschema``."""

import importlib.util
import json

import numpy as np
import pytest

from mlx_dgemma import generate, json_template
from mlx_dgemma.demo.tasks import json_schema
from mlx_dgemma.generate import DEMO_MODEL
from mlx_dgemma.structured.template import FREE, canvas_clamps
from mlx_dgemma.structured.tool_calls import forced_call_template

from .test_server import PERSON, WEATHER
from .test_template import SCHEMA
from .test_tool_calls import GET_WEATHER

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.skipif(not (DEMO_MODEL / "model.safetensors").exists(), reason="no bundled demo model")


def _example_schema():
    path = DEMO_MODEL.parents[1] / "examples" / "json_schema.py"
    spec = importlib.util.spec_from_file_location("json_schema_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SCHEMA


# The schemas the other tests and the examples use (sharded_check.py's is the example's).
USED = {
    "test_template": SCHEMA,
    "example": _example_schema(),
    "server-person": PERSON,
    "hole-values": {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}}},
    "fractions": {"type": "object", "properties": {"p": {"type": "number", "minimum": 0.2, "maximum": 0.8}}},
    "integer": {"type": "integer"},
    "demo-task": json_schema("json: name=eve age=29 city=oslo"),
}
TOOLS = {"server-weather": WEATHER, "get-weather": GET_WEATHER}
EDGES = {
    "required": {
        "type": "object",
        "additionalProperties": False,
        "required": ["a", "b"],
        "properties": {
            "a": {"type": "string", "minLength": 3, "maxLength": 4},
            "b": {"type": "null"},
            "c": {"type": "boolean"},
        },
    },
    "typed-enum": {"type": "string", "enum": ["x", "yy", "zzz"]},
    "nullable-enum": {"type": ["string", "null"], "enum": ["a", None]},
    "integer-enum": {"type": "integer", "enum": [1, 2.0, 10**30]},
    "typed-const": {"type": "object", "const": {"k": [1, "x", None]}},
    "enum-items": {"type": "array", "minItems": 1, "maxItems": 6, "items": {"enum": ["cat", 12, None, [1]]}},
    "past-int64": {"type": "integer", "minimum": 2**64 + 1, "maximum": 2**64 + 3},
    "past-float-precision": {"type": "integer", "minimum": 2**53 + 1, "maximum": 2**53 + 1},
    "float-range": {"type": "number", "minimum": -1e20, "maximum": 1e20},
    "integer-from-floats": {"type": "integer", "minimum": 0.5, "maximum": 1e19},
}
CASES = [*USED.items(), *EDGES.items(), *TOOLS.items()]


def template_and_schema(tokenizer, case):
    """The case's template and the schema its answer must validate against (a tool's parameters)."""
    if case.get("type") == "function":
        return forced_call_template(tokenizer, case), case["function"]["parameters"]
    return json_template(tokenizer, case), case


@pytest.mark.parametrize("name, case", CASES, ids=[name for name, _ in CASES])
def test_the_demo_models_answer_validates(demo, name, case):
    model, tokenizer = demo
    template, schema = template_and_schema(tokenizer, case)
    # Two steps a canvas: what is checked is the template's guarantee, not the answer's quality.
    answer = generate(model, tokenizer, "json: name=ada age=36", template=template, seed=0, steps=2)
    jsonschema.validate(json.loads(answer), schema)


def random_canvas(template, tokenizer, model, rng) -> list[int]:
    """The template's canvases with every free position a random token of those its clamp allows."""
    end = tokenizer.token_id("<turn|>")
    out = []
    for _, clamp in canvas_clamps(template, tokenizer, model.config.vocab_size, model.config.canvas_length, end):
        allowed = np.array(clamp.bias)[np.array(clamp.classes[0])] == 0
        fixed, tokens = np.array(clamp.fixed[0]), np.array(clamp.tokens[0])
        out += [int(tokens[i]) if fixed[i] else int(rng.choice(np.flatnonzero(allowed[i]))) for i in range(len(fixed))]
    return out


@pytest.mark.parametrize("name, case", CASES, ids=[name for name, _ in CASES])
def test_random_canvases_validate(demo, name, case):
    model, tokenizer = demo
    template, schema = template_and_schema(tokenizer, case)
    rng = np.random.default_rng(0)
    end, pad = tokenizer.token_id("<turn|>"), tokenizer.pad_token_id
    for _ in range(20):
        canvas = random_canvas(template, tokenizer, model, rng)
        assert FREE not in canvas
        values = template.hole_values(canvas, pad, end)
        answer = json.dumps(template.render([tokenizer.decode(v) for v in values]))
        jsonschema.validate(json.loads(answer), schema)
