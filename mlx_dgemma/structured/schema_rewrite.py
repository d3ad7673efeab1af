"""JSON schemas rewritten, before llguidance compiles them (grammar.py), into schemas it enforces
exactly, each rewrite equivalent to what JSON Schema asks or stricter where a value would fail a
validator's check:

- ``format`` date, time and date-time become the RFC 3339 patterns a validator holds them to (a year
  from 0001, days within their month, seconds to 59): llguidance's own take year 0000 and :60;
- formats llguidance does not know but validators check become patterns of a safe subset
  (``uri-reference`` a relative path, ``json-pointer`` plain tokens, ``regex`` literal text; the
  internationalized ones their ASCII forms); other unknown formats are annotations, as JSON Schema
  2020-12 says, and are dropped;
- ``dependentRequired`` and the list form of ``dependencies`` become "the key is absent, or it and
  its dependents are present"; the schema form of ``dependencies`` and ``dependentSchemas`` "absent,
  or present and the schema holds".

Everything else goes through as written; what llguidance cannot enforce it refuses by name.
``rebased`` places a schema inside another (a tool's parameters in the union of a forced call's
tools), its local ``$ref`` pointers moved with it.
"""

from __future__ import annotations

MAX_DEPTH = 256  # levels rewritten; deeper subschemas go to llguidance as written

_YEAR = "([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_DAY = "((0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])|(0[13-9]|1[0-2])-(29|30)|(0[13578]|1[02])-31)"
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,9})?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
PATTERNS = {
    "date": f"^{_YEAR}-{_DAY}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_YEAR}-{_DAY}[Tt]{_TIME}$",
    "uri-reference": "^[A-Za-z0-9._~/-]*$",
    "iri-reference": "^[A-Za-z0-9._~/-]*$",
    "uri-template": "^[A-Za-z0-9._~/:-]*$",
    "json-pointer": "^(/[A-Za-z0-9._-]*)*$",
    "relative-json-pointer": "^[0-9]+(/[A-Za-z0-9._-]*)*$",
    "regex": "^[A-Za-z0-9 _-]*$",
}
ALIASES = {"iri": "uri", "idn-email": "email", "idn-hostname": "hostname"}
KNOWN = {"email", "hostname", "ipv4", "ipv6", "uuid", "uri", "duration"}  # llguidance's, kept as they are

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMAS = (
    "additionalProperties",
    "items",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "additionalItems",
    "unevaluatedProperties",
    "unevaluatedItems",
)


def _subschemas(schema: dict, transform, depth: int) -> dict:
    """A copy of ``schema`` with ``transform(subschema, depth + 1)`` applied to each of its subschemas."""
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: transform(v, depth + 1) for k, v in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [transform(v, depth + 1) for v in out[key]]
    for key in _SCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = transform(out[key], depth + 1)
        elif key == "items" and isinstance(out.get(key), list):
            out[key] = [transform(v, depth + 1) for v in out[key]]
    return out


def rewrite(schema, depth: int = 0):
    """``schema`` with the rewrites above applied throughout (a new object; the argument is not changed)."""
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return schema
    out = _subschemas(schema, rewrite, depth)
    _rewrite_format(out)
    _rewrite_dependencies(out, depth)
    return out


def _rewrite_format(schema: dict) -> None:
    fmt = schema.get("format")
    if not isinstance(fmt, str) or fmt in KNOWN:
        return
    if fmt in ALIASES:
        schema["format"] = ALIASES[fmt]
        return
    del schema["format"]
    if fmt in PATTERNS and "pattern" not in schema:
        schema["pattern"] = PATTERNS[fmt]


def _rewrite_dependencies(schema: dict, depth: int) -> None:
    """Each dependency as "the key absent, or present with what it brings" (anyOf), under allOf."""
    if not isinstance(schema.get("allOf", []), list):
        return  # llguidance refuses the schema as it is
    rules = []
    for word in ("dependentRequired", "dependencies", "dependentSchemas"):
        given = schema.get(word)
        if not isinstance(given, dict):
            continue
        del schema[word]
        for key, then in given.items():
            if isinstance(then, list):
                present = {"required": [key, *then]}
            else:
                present = {"allOf": [{"required": [key]}, rewrite(then, depth + 1)]}
            rules.append({"anyOf": [{"properties": {key: False}}, present]})
    if rules:
        schema["allOf"] = schema.get("allOf", []) + rules


def rebased(schema, pointer: str, depth: int = 0):
    """``schema`` as placed at JSON pointer ``pointer`` (``/anyOf/0``) inside another: each local
    ``$ref`` (``#``, ``#/$defs/X``) made to point from there, so its own ``$defs`` are still found."""
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return schema
    out = _subschemas(schema, lambda sub, d: rebased(sub, pointer, d), depth)
    ref = out.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = "#" + pointer + ref[1:]
    return out


def required_only(schema, depth: int = 0):
    """``schema`` narrowed to its shortest instances' shape: each object keeps only its required
    properties and takes no others. Every instance of it is an instance of ``schema`` wherever it is
    satisfiable (grammar.py walks its closing path, an answer's shortest end, on it)."""
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return schema
    out = _subschemas(schema, required_only, depth)
    required = out.get("required")
    if isinstance(out.get("properties"), dict) and isinstance(required, list):
        out["properties"] = {k: v for k, v in out["properties"].items() if k in required}
        out["additionalProperties"] = False
    return out
