"""Canvas templates: clamped positions in the sampler, text and JSON-schema templates, infill, errors.

Run on the bundled demo model (it has a tokenizer and a chat template); the sampler-level checks also
on a random checkpoint's sizes through the same code.
"""

import json
import time

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

from mlx_dgemma import generate, infill, json_template, parse_template, stream_generate
from mlx_dgemma.engine.denoise import denoise_canvas
from mlx_dgemma.engine.sampler import MxRandom, SamplerSettings
from mlx_dgemma.generate import DEMO_MODEL, main
from mlx_dgemma.structured.template import FREE, Clamp, TemplateError, canvas_clamps, infill_template

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.skipif(not (DEMO_MODEL / "model.safetensors").exists(), reason="no bundled demo model")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6, "minLength": 1},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "bird"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "where": {"type": "object", "properties": {"x": {"type": "integer", "maximum": 99}, "y": {"type": "number"}}},
    },
    "required": ["name", "age"],
}


def fixed_positions(template, tokenizer, model):
    """(canvas index, position, token) of every clamped position of the template's canvases."""
    end = tokenizer.token_id("<turn|>")
    clamps = canvas_clamps(template, tokenizer, model.config.vocab_size, model.config.canvas_length, end)
    out = []
    for k, (_, clamp) in enumerate(clamps):
        fixed, tokens = np.array(clamp.fixed[0]), np.array(clamp.tokens[0])
        out += [(k, i, int(tokens[i])) for i in np.flatnonzero(fixed)]
    return out


@pytest.mark.parametrize("policy", ["reference", "fast"])
def test_clamped_tokens_hold_at_every_step_of_the_view(demo, policy):
    model, tokenizer = demo
    template = parse_template(tokenizer, '{"name": "{{fill:5}}", "note": "{{fill:30}}", "ok": 1}')
    responses = list(
        stream_generate(model, tokenizer, "json: name=ada", seed=3, template=template, drafts=True, policy=policy)
    )
    drafts_per_canvas = [r.drafts for r in responses]
    assert len(responses) == -(-(len(template) + 1) // model.config.canvas_length) > 1  # + end of turn
    fixed = fixed_positions(template, tokenizer, model)
    assert len(fixed) > 20
    for k, i, token in fixed:
        for draft in drafts_per_canvas[k]:
            if i < len(draft.tokens):
                assert draft.tokens[i] == token, (k, i, draft.step)
                assert draft.accepted[i] and draft.fixed[i]  # the view draws it as fixed
    committed = [t for r in responses for t in r.tokens]
    for k, i, token in fixed:
        if k * model.config.canvas_length + i < len(committed):
            assert committed[k * model.config.canvas_length + i] == token
    text = responses[-1].text
    assert text.startswith('{"name": "') and text.endswith('", "ok": 1}') and '", "note": "' in text
    assert all(r.text == "" for r in responses[:-1])


def test_an_empty_clamp_is_the_reference_loop(demo):
    model, tokenizer = demo
    C = model.config.canvas_length
    cache = model.make_cache()
    model.encode(mx.array(tokenizer.encode("sort: 3 1 2")), cache)
    settings = SamplerSettings(steps=6)
    plain = denoise_canvas(model, cache, settings, MxRandom(7))
    nothing = Clamp(fixed=mx.zeros((1, C), dtype=mx.bool_), tokens=mx.zeros((1, C), dtype=mx.int32))
    clamped = denoise_canvas(model, cache, settings, MxRandom(7), clamp=nothing)
    assert plain.steps == clamped.steps
    assert plain.tokens.tolist() == clamped.tokens.tolist()


def test_clamp_fixes_tokens_and_limits_classes(demo):
    model, tokenizer = demo
    C, V = model.config.canvas_length, model.config.vocab_size
    cache = model.make_cache()
    model.encode(mx.array(tokenizer.encode("reverse: abc")), cache)
    fixed = np.zeros((1, C), dtype=bool)
    fixed[0, ::3] = True
    tokens = np.full((1, C), 7, dtype=np.int32)
    digits = [tokenizer.token_id(str(d)) for d in range(10)]
    bias = np.full((2, V), -1e9, dtype=np.float32)
    bias[0] = 0
    bias[1, digits] = 0
    classes = np.where(fixed, 0, 1).astype(np.int32)
    clamp = Clamp(mx.array(fixed), mx.array(tokens), mx.array(classes), mx.array(bias))
    drafts = []
    result = denoise_canvas(model, cache, SamplerSettings(steps=5), MxRandom(1), drafts.append, clamp=clamp)
    out = np.array(result.tokens)
    assert (out[fixed] == 7).all()
    assert set(out[~fixed].tolist()) <= set(digits)
    assert all((np.array(d.tokens)[fixed[0]] == 7).all() for d in drafts)


@pytest.mark.parametrize("policy", ["reference", "ar"])
def test_schema_output_parses_and_validates(demo, policy):
    model, tokenizer = demo
    template = json_template(tokenizer, SCHEMA)
    for seed, prompt in enumerate(["json: name=ada age=36", "json: tag=x", "reverse: hello", "add: 4 5"]):
        text = generate(model, tokenizer, prompt, seed=seed, template=template, policy=policy)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_hole_values_end_where_the_following_text_starts(demo):
    _, tokenizer = demo
    pad = tokenizer.pad_token_id

    def ids(s):
        return tokenizer.encode(s, add_special_tokens=False)

    template = parse_template(tokenizer, "1 {{fill:6}} 7 9")
    # The model wrote the missing "4", then began the clamped text " 7 9" early.
    canvas = ids("1 ") + ids("4 7 9") + [pad] + ids(" 7 9")
    assert tokenizer.decode(template.answer_tokens(canvas, pad, None)) == "1 4 7 9"
    canvas = ids("1 ") + ids("4") + [pad, pad] + ids("5") + [pad, pad] + ids(" 7 9")
    assert tokenizer.decode(template.answer_tokens(canvas, pad, None)) == "1 45 7 9"
    schema = json_template(tokenizer, {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}}})
    canvas = ids('{"s": "') + ids('ab"}') + [pad] + ids('"}')
    assert [tokenizer.decode(v) for v in schema.hole_values(canvas, pad, None)] == ["ab"]


PREFIX = "<bos><|turn>user\nsort: 5 2 9<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"


@pytest.mark.parametrize("max_fill", [5, 40])  # one canvas, then a fill spanning two
def test_infill_clamps_the_suffix_at_the_canvas_end(demo, max_fill):
    model, tokenizer = demo
    C = model.config.canvas_length
    suffix = tokenizer.encode(" 9", add_special_tokens=False)
    template = infill_template(tokenizer, " 9", max_fill, C)
    responses = list(stream_generate(model, tokenizer, PREFIX, seed=0, template=template, chat_template=False))
    assert len(responses) == -(-(max_fill + len(suffix)) // C)
    assert all(len(r.tokens) == C for r in responses)
    assert responses[-1].tokens[-len(suffix) :] == suffix
    text = infill(model, tokenizer, PREFIX, " 9", max_fill=max_fill, seed=0)
    assert responses[-1].text == text + " 9"


@pytest.mark.parametrize(
    "template, message",
    [
        ("a {{fill:3", "unclosed hole at line 1, column 3"),
        ("ab\ncd {{fill:x}}", "hole at line 2, column 4: the size must be a positive integer"),
        ("{{fill:0}}", "size must be a positive integer"),
        ("x {{fil:3}}", "unknown hole '{{fil:3}}' at line 1, column 3"),
    ],
)
def test_bad_templates_name_the_place(demo, template, message):
    _, tokenizer = demo
    with pytest.raises(TemplateError, match=message.replace("{", r"\{").replace("}", r"\}").replace("(", r"\(")):
        parse_template(tokenizer, template)


def test_literal_double_braces_are_text(demo):
    _, tokenizer = demo
    template = parse_template(tokenizer, "{{ x }} {{fill:2}}")
    assert template.tokens[: len(tokenizer.encode("{{ x }} ", add_special_tokens=False))].count(FREE) == 0
    assert [h.size for _, h in template.holes] == [2]


def test_a_hole_past_the_context_is_refused(demo):
    model, tokenizer = demo
    context = model.config.max_position_embeddings
    with pytest.raises(TemplateError, match=r"the hole at line 1, column 5 crosses it"):
        list(stream_generate(model, tokenizer, "sort: 1", template="abc {{fill:%d}}" % (context - 8)))


@pytest.mark.parametrize(
    "schema, message",
    [
        (
            {"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}]}}},
            r"'anyOf' at \$\.a is not supported",
        ),
        ({"type": "object", "properties": {"a": {"type": "string", "pattern": "x+"}}}, r"'pattern' at \$\.a is not"),
        ({"type": "array", "items": {"type": "integer"}}, r"array at \$ needs maxItems"),
        (
            {"type": "object", "properties": {"a": {"type": ["string", "null"]}}},
            r"\$\.a: type \[\"string\", \"null\"\]",
        ),
        ({"type": "integer", "minimum": 5, "maximum": 2}, r"minimum 5 is above maximum 2"),
    ],
)
def test_unsupported_schemas_name_the_place(demo, schema, message):
    _, tokenizer = demo
    with pytest.raises(TemplateError, match=message):
        json_template(tokenizer, schema)


def test_cli_template_and_schema_files(tmp_path):
    runner = CliRunner()
    template = tmp_path / "answer.txt"
    template.write_text("1 {{fill:3}} 9\n")  # as editors save it: the final newline is not the template's
    result = runner.invoke(main, ["--prompt", "sort: 9 4 1", "--template", str(template), "--seed", "0"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("1 ") and result.output.endswith(" 9\n") and result.output.count("\n") == 1
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    result = runner.invoke(main, ["--prompt", "json: name=ada", "--schema", str(schema), "--seed", "0"])
    assert result.exit_code == 0, result.output
    jsonschema.validate(json.loads(result.output), SCHEMA)
    template.write_text("1 {{fill:3 9")
    result = runner.invoke(main, ["--prompt", "sort: 9 4 1", "--template", str(template)])
    assert result.exit_code == 1
    assert result.output.strip() == "Error: unclosed hole at line 1, column 3: write {{fill}} or {{fill:N}}"
    schema.write_text("{not json")
    result = runner.invoke(main, ["--prompt", "x", "--schema", str(schema)])
    assert result.exit_code == 1 and "is not JSON" in result.output and len(result.output.strip().split("\n")) == 1


def test_cli_schema_checks_its_template_before_the_draft(tmp_path, monkeypatch):
    """--schema: the template that says the canvas takes the schema (structured/layout.py decides),
    then the one sized by the draft; a bad schema fails before any generation."""
    from mlx_dgemma.engine import batch
    from mlx_dgemma.structured import layout

    built, real = [], layout.json_template
    monkeypatch.setattr(layout, "json_template", lambda *a, **k: built.append("draft" in k) or real(*a, **k))
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    result = CliRunner().invoke(main, ["--prompt", "json: name=ada", "--schema", str(schema), "--seed", "0"])
    assert result.exit_code == 0, result.output
    assert built == [False, True]  # the check, then the drafted template
    monkeypatch.setattr(batch, "prefill", lambda *a, **k: pytest.fail("a bad schema reached the draft"))
    schema.write_text("[1, 2]")
    result = CliRunner().invoke(main, ["--prompt", "x", "--schema", str(schema)])
    assert result.exit_code == 1 and "a JSON schema is an object" in result.output, result.output


def test_a_draft_sizes_the_schema_holes(demo):
    _, tokenizer = demo
    sizes = lambda template: {h.where: h.size for _, h in template.holes}  # noqa: E731
    upper = sizes(json_template(tokenizer, SCHEMA))
    assert upper["$.name"] == 6 and upper["$.age"] == 3 and "$.tags[1]" in upper
    draft = {"name": "ada", "age": 7, "tags": ["ab"], "where": {"x": 12345}, "pet": "dog"}
    drafted = sizes(json_template(tokenizer, SCHEMA, draft=draft))
    assert drafted["$.name"] == 3 and drafted["$.age"] == 1 and drafted["$.tags[0]"] == 2
    assert "$.tags[1]" not in drafted  # the draft's item count
    assert drafted["$.where.x"] == upper["$.where.x"] == 3  # bounded by the schema (sign + 2 digits), not the draft
    assert drafted["$.where.y"] == upper["$.where.y"]  # no draft value: the upper bound
    for nonsense in (None, [1, 2], "text"):  # a draft that is not an object sizes nothing
        assert sizes(json_template(tokenizer, SCHEMA, draft=nonsense)) == upper


@pytest.mark.parametrize(
    "schema, message",
    [
        (
            {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"]},
            'required key "b" at $ is not in its properties; add it to properties or drop it from required',
        ),
        (
            {"type": "object", "properties": {"a": {"type": "null"}}, "required": "a"},
            'required at $ must be a list of property names, got "a"',
        ),
        ({"type": "string", "enum": ["x", 1]}, 'enum value 1 at $ is not of type "string"'),
        ({"type": ["string", "null"], "enum": ["x", False]}, 'enum value false at $ is not of type ["string", "null"]'),
        ({"type": "integer", "const": 1.5}, 'const value 1.5 at $ is not of type "integer"'),
        ({"type": "strin", "enum": ["x"]}, 'type "strin" is not a JSON type'),
        ({"const": float("nan")}, "const at $ holds a value that is not JSON (Out of range float values"),
        ({"enum": [1, [float("inf")]]}, "enum at $ holds a value that is not JSON"),
        ({"enum": ["a", "b"], "maxLength": 1}, "schema feature 'maxLength' at $ is not supported alongside 'enum'"),
        (
            {"enum": [f"s{i}" for i in range(100_000)]},
            "enum at $ has 100000 values, more than the 1000 a template takes",
        ),
        (
            {"type": "integer", "minimum": 10**400},
            "minimum at $ is an integer of more than 308 digits; a bound must fit",
        ),
        ({"type": "number", "maximum": -(10**309)}, "maximum at $ is an integer of more than 308 digits"),
    ],
)
def test_schemas_whose_answer_could_not_validate_are_refused(demo, schema, message):
    _, tokenizer = demo
    start = time.perf_counter()
    with pytest.raises(TemplateError) as info:
        json_template(tokenizer, schema)
    assert time.perf_counter() - start < 1
    assert message in str(info.value) and "\n" not in str(info.value)


def test_integer_bounds_are_exact_and_numbers_finite(demo):
    _, tokenizer = demo
    big = {"type": "integer", "minimum": 10**20 + 1, "maximum": 10**20 + 3}
    assert json_template(tokenizer, big).render(["0"]) == 10**20 + 1
    assert json_template(tokenizer, {"type": "integer", "maximum": 2**53 + 1}).render(["9" * 40]) == 2**53 + 1
    assert json_template(tokenizer, {"type": "integer", "minimum": 0.5, "maximum": 1e19}).render(["0"]) == 1
    wide = json_template(tokenizer, {"type": "number", "minimum": -1e308})  # a hole of 315 positions
    assert np.isfinite(wide.render(["9" * 400]))  # more digits than a float holds: the largest float
    for draft in (float("inf"), float("nan"), 10**400):  # a free draft's nonsense sizes nothing
        assert [h.size for _, h in json_template(tokenizer, {"type": "integer"}, draft=draft).holes] == [7]


def test_min_length_holds_when_byte_tokens_make_one_character(demo):
    _, tokenizer = demo
    schema = {"type": "string", "minLength": 2, "maxLength": 2}
    template = json_template(tokenizer, schema)
    e_acute = tokenizer.encode("é", add_special_tokens=False)
    assert len(e_acute) == 2 and len(tokenizer.decode(e_acute)) == 1  # two byte tokens, one character
    answer = template.render([tokenizer.decode(v) for v in template.hole_values(e_acute, tokenizer.pad_token_id, None)])
    jsonschema.validate(answer, schema)


@pytest.mark.parametrize(
    "build",
    [
        lambda t: parse_template(t, "x" * 5000 + "{{fill:2}}", limit=1024),
        lambda t: parse_template(t, "{{fill:2}}" + "x" * 5000, limit=1024),
        lambda t: json_template(t, {"type": "object", "properties": {"k" * 5000: {"type": "null"}}}, limit=1024),
        lambda t: json_template(t, {"type": "object", "properties": {"k": {"const": "x" * 5000}}}, limit=1024),
        lambda t: json_template(t, {"enum": ["a", "x" * 5000]}, limit=1024),
    ],
)
def test_template_text_is_bounded_by_the_context(demo, build):
    _, tokenizer = demo
    with pytest.raises(TemplateError, match="past the model's context of 1024 positions") as info:
        build(tokenizer)
    assert "\n" not in str(info.value)


def test_a_lone_surrogate_is_a_template_error(demo):
    model, tokenizer = demo
    with pytest.raises(TemplateError, match=r"the template holds a lone surrogate \(\\ud800\) at line 2, column 3"):
        parse_template(tokenizer, "{{fill:2}}\nab\ud800")
    with pytest.raises(TemplateError, match="the suffix holds a lone surrogate"):
        infill_template(tokenizer, "\udfff", 4, model.config.canvas_length)


def test_a_canvas_bias_has_rows_for_its_own_positions_only(demo):
    model, tokenizer = demo
    C, V, pad = model.config.canvas_length, model.config.vocab_size, tokenizer.pad_token_id
    options = ["cat", "zebra", 12, None, "dog!"]
    schema = {"type": "array", "minItems": 1, "maxItems": 40, "items": {"enum": options}}
    template = json_template(tokenizer, schema)
    holes = dict(template.holes)
    clamps = canvas_clamps(template, tokenizer, V, C, tokenizer.token_id("<turn|>"))
    assert len(clamps) * C >= len(template) > 3 * C
    for k, (length, clamp) in enumerate(clamps):
        assert clamp.bias.shape[0] <= length + 1  # not a row per choice position of the whole template
        allowed = np.array(clamp.bias)[np.array(clamp.classes[0])] == 0
        for i in range(length):
            start = max((s for s in holes if s <= k * C + i), default=None)
            if start is not None and k * C + i < start + holes[start].size:
                j = k * C + i - start
                sequences = holes[start].choices
                expected = {seq[j] for seq in sequences if j < len(seq)}
                expected |= {pad} if any(j >= len(seq) for seq in sequences) else set()
                assert set(np.flatnonzero(allowed[i])) == expected
