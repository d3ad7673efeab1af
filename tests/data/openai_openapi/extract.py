"""Write schemas.json: the response schemas of OpenAI's OpenAPI document that tests/test_openapi.py
checks the server's replies against, with every schema they refer to. Descriptions, examples and the
document's own annotations (x-...) are left out; nothing else is changed.

    python tests/data/openai_openapi/extract.py openapi.json   # openai/openai-openapi's openapi.json
"""

import json
import sys
from pathlib import Path

RESPONSES = [
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "CreateEmbeddingResponse",
    "ListModelsResponse",
    "Model",
    "Response",
    "ResponseStreamEvent",
    "ErrorResponse",
]
NOTES = {"description", "example", "examples"}
MAPS = {"properties", "patternProperties", "$defs", "definitions"}  # their keys are names, not keywords


def stripped(schema, names: bool = False):
    if isinstance(schema, list):
        return [stripped(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    if names:
        return {name: stripped(s) for name, s in schema.items()}
    return {k: stripped(v, k in MAPS) for k, v in schema.items() if k not in NOTES and not k.startswith("x-")}


def refs(schema) -> set[str]:
    if isinstance(schema, list):
        return set().union(*map(refs, schema)) if schema else set()
    if not isinstance(schema, dict):
        return set()
    found = {schema["$ref"].rsplit("/", 1)[1]} if isinstance(schema.get("$ref"), str) else set()
    return found.union(*(refs(v) for v in schema.values()))


def main(source: str) -> None:
    document = json.loads(Path(source).read_text())
    schemas, kept, todo = document["components"]["schemas"], {}, list(RESPONSES)
    while todo:
        if (name := todo.pop()) not in kept:
            kept[name] = stripped(schemas[name])
            todo += refs(schemas[name])
    out = {
        "openapi": document["openapi"],
        "info": {"title": document["info"]["title"], "version": document["info"]["version"]},
        "components": {"schemas": dict(sorted(kept.items()))},
    }
    (Path(__file__).parent / "schemas.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
