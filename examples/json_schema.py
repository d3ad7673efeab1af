"""JSON that always parses and validates: the schema's structure is clamped into the canvas and each
value is a hole the model fills, limited to the tokens its type allows.

    python examples/json_schema.py
"""

import json

from mlx_dgemma import drafted_json_template, generate, json_template, load
from mlx_dgemma.generate import DEMO_MODEL

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "age"],
}


def main():
    model, tokenizer = load(DEMO_MODEL)
    prompt = "json: name=ada age=36"
    # Holes at their upper bounds: one generation.
    answer = generate(model, tokenizer, prompt, template=json_template(tokenizer, SCHEMA), seed=0)
    print("upper-bound holes:", json.loads(answer))
    # Holes sized by a free draft first (two generations; right more often on the demo's json task).
    template = drafted_json_template(model, tokenizer, prompt, SCHEMA, seed=0)
    print("holes sized by a draft:", json.loads(generate(model, tokenizer, prompt, template=template, seed=0)))


if __name__ == "__main__":
    main()
