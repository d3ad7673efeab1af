"""benchmarks/schema_coverage.py on a tiny JSONSchemaBench-shaped folder written here: its tables'
columns, coverage figures equal to what this project and llguidance say about each schema directly,
and every answer under every policy validating."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_dgemma import generate, load
from mlx_dgemma.errors import TemplateError
from mlx_dgemma.generate import DEMO_MODEL
from mlx_dgemma.structured.grammar import grammar_tokenizer

llguidance = pytest.importorskip("llguidance")
pytest.importorskip("jsonschema")
pytestmark = pytest.mark.skipif(not (DEMO_MODEL / "model.safetensors").exists(), reason="no bundled demo model")

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 40
LONG_KEYS = ["first_rather_long_key", "second_rather_long_key"]
SCHEMAS = {  # dataset -> file -> schema (a str: the file's text as it is)
    "flat": {
        # the canvas template takes it
        "person.json": {
            "type": "object",
            "required": ["name", "age"],
            "properties": {
                "name": {"type": "string", "maxLength": 6},
                "age": {"type": "integer", "minimum": 0, "maximum": 99},
            },
        },
        # $ref and format: the grammar only
        "tree.json": {
            "$defs": {
                "node": {
                    "type": "object",
                    "required": ["label"],
                    "properties": {
                        "label": {"type": "string", "maxLength": 8},
                        "born": {"type": "string", "format": "date"},
                        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                    },
                }
            },
            "$ref": "#/$defs/node",
        },
    },
    "hard": {
        # neither: a oneOf whose branches overlap
        "overlap.json": {"oneOf": [{"type": "object"}, {"type": "object", "required": ["a"]}]},
        # llguidance compiles it, but its shortest answer is longer than MAX_TOKENS
        "long.json": {
            "type": "object",
            "required": LONG_KEYS,
            "properties": {k: {"type": "integer"} for k in LONG_KEYS},
        },
        "broken.json": '{"type": "object",',
    },
}
COVERAGE_COLUMNS = [
    "dataset",
    "schemas",
    "this project",
    "by template",
    "llguidance",
    "llguidance only",
    "this project only",
    "shortest answer too long",
    "compile p50 / p99 ms",
]
POLICY_COLUMNS = [
    "policy",
    "schemas",
    "answered",
    "validated",
    "invalid",
    "unchecked",
    "refused",
    "errors",
    "finish reasons",
]


def table(text: str, first_column: str) -> list[dict]:
    """The markdown table whose header starts with ``first_column``, as a dict per row."""
    lines = text.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_column} |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip().strip("*") for c in line.strip("|").split("|")))))
    return [{"_header": header}] + rows


def run_benchmark(data: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "benchmarks/schema_coverage.py", str(data), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_schema_coverage_on_a_tiny_folder(tmp_path):
    data = tmp_path / "data"
    for dataset, files in SCHEMAS.items():
        (data / dataset).mkdir(parents=True)
        for name, schema in files.items():
            (data / dataset / name).write_text(schema if isinstance(schema, str) else json.dumps(schema))
    out = tmp_path / "out.json"
    run = run_benchmark(
        data, "--sample", "4", "--max-tokens", str(MAX_TOKENS), "--cost-schemas", "1", "--json", str(out)
    )
    assert run.returncode == 0, run.stderr[-3000:]

    # What each schema gets, asked directly: this project's generate, and llguidance with its defaults.
    model, tokenizer = load(str(DEMO_MODEL))
    lltokenizer = grammar_tokenizer(tokenizer, model.config.vocab_size, [1])
    direct = {}
    for dataset, files in SCHEMAS.items():
        for name, schema in files.items():
            if isinstance(schema, str):
                direct[dataset, name] = (False, False)
                continue
            try:
                answer = generate(model, tokenizer, "json: x", schema=schema, max_tokens=MAX_TOKENS)
                json.loads(answer)
                ours = True
            except TemplateError:
                ours = False
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
            direct[dataset, name] = (ours, llguidance.LLMatcher.validate_grammar(grammar, lltokenizer) == "")
    # the folder has a schema of each kind the table tells apart
    assert direct["flat", "tree.json"] == (True, True) and direct["hard", "overlap.json"] == (False, False)
    assert direct["hard", "long.json"] == (False, True)

    coverage = table(run.stdout, "dataset")
    assert coverage[0]["_header"] == COVERAGE_COLUMNS
    rows = {r["dataset"]: r for r in coverage[1:]}
    assert list(rows) == ["flat", "hard", "all"]
    for name, row in rows.items():
        mine = [v for (dataset, _), v in direct.items() if name in ("all", dataset)]
        assert int(row["schemas"]) == len(mine)
        assert row["this project"] == f"{100 * sum(o for o, _ in mine) / len(mine):.1f}%"
        assert row["llguidance"] == f"{100 * sum(g for _, g in mine) / len(mine):.1f}%"
        assert int(row["llguidance only"]) == sum(g and not o for o, g in mine)
        assert int(row["this project only"]) == sum(o and not g for o, g in mine)
    assert rows["flat"]["by template"] == "50.0%" and rows["hard"]["shortest answer too long"] == "1"

    # The four readable schemas under each policy: two answered, each validating; two refused.
    policies = table(run.stdout, "policy")
    assert policies[0]["_header"] == POLICY_COLUMNS
    assert [r["policy"] for r in policies[1:]] == ["reference", "ar", "verified", "auto"]
    for row in policies[1:]:
        counts = {k: int(row[k]) for k in POLICY_COLUMNS[1:-1]}
        assert counts == {
            "schemas": 4,
            "answered": 2,
            "validated": 2,
            "invalid": 0,
            "unchecked": 0,
            "refused": 2,
            "errors": 0,
        }, row

    result = json.loads(out.read_text())
    assert {(r["dataset"], r["file"]): (r["ours"], r["llguidance"]) for r in result["schemas"]} == direct
    assert result["invalid"] == []
    assert [r["dataset"] for r in result["coverage"]] == ["flat", "hard", "all"]
    cost = result["cost"]
    assert cost["schemas"] == 1 and cost["structured_tokens"] > 0
    per = cost["ms_per_token"]
    assert cost["structured_over_free"] == pytest.approx(per["structured"] / per["free"])
    assert all(0 < p50 <= p99 for p50, p99 in cost["per_token_ms"].values()), cost["per_token_ms"]
    assert "structured / unconstrained" in run.stdout


def test_schema_coverage_without_a_dataset_folder_says_so(tmp_path):
    run = run_benchmark(tmp_path / "missing")
    assert run.returncode != 0 and run.stdout == ""
    assert run.stderr.strip().split("\n") == [
        f"{tmp_path / 'missing'} has no folders of schema files; give JSONSchemaBench's data/ folder"
    ]
