"""Bad input never destroys data, never ends in a traceback, never passes silently (issue 12).

One test (or a few) per cause: each asserts the exit status or the exception, a one-line message
that names the problem, and that nothing was deleted or left behind. Generation runs on the bundled
demo model (a tokenizer, a chat template, 32-token canvases, a context of 8192); conversion on the
small random reference checkpoint, copied next to unrelated files that must survive.
"""

import hashlib
import importlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file, save_file

from mlx_dgemma import bench, generate, json_template, load, parse_template, stream_generate
from mlx_dgemma.convert import ConversionError, convert
from mlx_dgemma.convert.__main__ import convert_command
from mlx_dgemma.convert.output import MARKER
from mlx_dgemma.demo import eval as eval_module
from mlx_dgemma.engine import policy
from mlx_dgemma.engine.policy import Profile, cached_profile
from mlx_dgemma.generate import DEMO_MODEL, PromptError, main
from mlx_dgemma.loader import CheckpointError
from mlx_dgemma.model.config import ConfigError, GenerationConfig
from mlx_dgemma.structured.template import TemplateError

gen = importlib.import_module("mlx_dgemma.generate")  # the package's `generate` attribute is the function
ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
PROMPT = "sort: 42 17 85"
PROFILE = Profile("test device", "measured", {16: 0.01, 256: 0.02}, ar_token_s=0.01, prefill_tok_s=100.0)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file and folder under ``folder`` with a hash of its bytes: what must survive unchanged."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        out[rel] = "dir" if path.is_dir() else hashlib.sha1(path.read_bytes()).hexdigest()
    return out


def one_line_error(result, *needles: str, status: int = 1) -> str:
    """A CliRunner result that failed with ``status`` and one line ``Error: ...`` holding each needle."""
    assert result.exit_code == status, (result.exit_code, result.output)
    text = result.stderr.strip() if result.stderr.strip() else result.output.strip()
    assert "Traceback" not in result.output
    assert len(text.strip().split("\n")) == 1 and text.startswith("Error: "), text
    for needle in needles:
        assert needle in text, text
    return text


def one_line(error: BaseException, *needles: str) -> str:
    message = str(error)
    assert "\n" not in message and message
    for needle in needles:
        assert needle in message, message
    return message


def run_generate(*args: str, **kwargs):
    return CliRunner().invoke(main, ["--max-tokens", "8", "--seed", "0", *args], **kwargs)


# ---- 1. the converter's destination: never the source, its parent, or anyone else's files ---------


@pytest.fixture
def models(checkpoints, tmp_path):
    """models/hf (a checkpoint) beside models/notes.txt and models/photos/cat.jpg (the user's)."""
    root = tmp_path / "models"
    shutil.copytree(checkpoints("small"), root / "hf")
    (root / "notes.txt").write_text("mine")
    (root / "photos").mkdir()
    (root / "photos" / "cat.jpg").write_bytes(b"\xff\xd8 a cat")
    return root


def convert_cli(*args: str):
    return CliRunner().invoke(convert_command, list(args))


def test_force_into_a_parent_of_the_source_is_refused(models):
    before = snapshot(models.parent)
    result = convert_cli("--hf-path", str(models / "hf"), "--mlx-path", str(models), "--force")
    one_line_error(result, f"{models} contains the source checkpoint", "choose an --mlx-path outside it")
    assert snapshot(models.parent) == before
    # The API and a relative spelling of the same folder, too.
    with pytest.raises(ConversionError, match="contains the source checkpoint") as info:
        convert(str(models / "hf"), str(models / "photos" / ".."), force=True, progress=False)
    one_line(info.value)
    assert snapshot(models.parent) == before


def test_a_destination_inside_the_source_is_refused(models):
    before = snapshot(models.parent)
    result = convert_cli("--hf-path", str(models / "hf"), "--mlx-path", str(models / "hf" / "mlx"))
    one_line_error(result, "is inside the source checkpoint", "outside it")
    with pytest.raises(ConversionError, match="is the source checkpoint"):
        convert(str(models / "hf"), str(models / "hf"), force=True, progress=False)
    assert snapshot(models.parent) == before


def test_force_never_replaces_files_a_conversion_did_not_write(models):
    before = snapshot(models.parent)
    result = convert_cli("--hf-path", str(models / "hf"), "--mlx-path", str(models / "photos"), "--force")
    one_line_error(result, "photos holds files a conversion did not write (cat.jpg)", "--force replaces only")
    assert snapshot(models.parent) == before


def test_force_replaces_an_earlier_conversion_but_not_a_file_added_to_it(models):
    out = models / "out"
    convert(str(models / "hf"), str(out), progress=False)
    assert (out / MARKER).is_file()
    result = convert_cli("--hf-path", str(models / "hf"), "--mlx-path", str(out))
    one_line_error(result, "already exists; pass --force to replace it")
    result = convert_cli("--hf-path", str(models / "hf"), "--mlx-path", str(out), "--force", "--dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"  # the new conversion is there
    (out / "my-notes.md").write_text("added by the user")
    before = snapshot(models.parent)
    result = convert_cli("--hf-path", str(models / "hf"), "--mlx-path", str(out), "--force")
    one_line_error(result, "holds files a conversion did not write (my-notes.md)")
    assert snapshot(models.parent) == before


def test_a_file_as_destination_is_refused(models):
    before = snapshot(models.parent)
    result = convert_cli("--hf-path", str(models / "hf"), "--mlx-path", str(models / "notes.txt"), "--force")
    one_line_error(result, "notes.txt exists and is not a plain folder")
    assert snapshot(models.parent) == before
    os.symlink(models / "photos", models / "link")
    before = snapshot(models.parent)
    result = convert_cli("--hf-path", str(models / "hf"), "--mlx-path", str(models / "link"), "--force")
    one_line_error(result, "link exists and is not a plain folder (a file or a link)")
    assert snapshot(models.parent) == before and os.readlink(models / "link") == str(models / "photos")


# ---- 3. SIGTERM / SIGHUP: the partial output goes, and so do the leftovers of killed runs --------

SLOW_CONVERSION = """
import sys, time
from mlx_dgemma.convert import checkpoint as c
from mlx_dgemma.convert.__main__ import main
read = c.read_tensor
def slow(info):
    print("writing", flush=True)
    time.sleep(0.3)
    return read(info)
c.read_tensor = slow
main(sys.argv[1:])
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_during_conversion_removes_the_partial_output(models, signum):
    before = snapshot(models.parent)
    dst = models / "out"
    process = subprocess.Popen(
        [sys.executable, "-c", SLOW_CONVERSION, "--hf-path", str(models / "hf"), "--mlx-path", str(dst)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        cwd=ROOT,
    )
    assert process.stdout.readline().strip() == "writing"  # the temporary folder exists and is being filled
    assert [p.name for p in models.iterdir() if p.name.endswith(".converting")]
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signum
    last = stderr.replace("\r", "\n").strip().split("\n")[-1]  # after tqdm's progress bar
    assert last == f"Error: conversion stopped by {signal.Signals(signum).name}; the partial output was removed"
    assert "Traceback" not in stderr
    assert snapshot(models.parent) == before


def test_temporary_folders_of_killed_runs_are_swept(models):
    dead = subprocess.Popen(["true"])
    dead.wait()
    alive = subprocess.Popen(["sleep", "60"])
    try:
        stale = models / f".out.{dead.pid}.k1ll3d.converting"
        running = models / f".out.{alive.pid}.runn1n.converting"
        other = models / f".other.{dead.pid}.abc.converting"  # another destination's: not ours to judge
        for folder in (stale, running, other):
            folder.mkdir()
            (folder / "model.safetensors").write_bytes(b"partial")
        convert(str(models / "hf"), str(models / "out"), progress=False)
        assert not stale.exists() and running.exists() and other.exists()
        assert (models / "notes.txt").read_text() == "mine" and (models / "photos" / "cat.jpg").exists()
        assert sorted(p.name for p in models.iterdir() if p.name.endswith(".converting")) == sorted(
            [running.name, other.name]
        )
    finally:
        alive.kill()
        alive.wait()


# ---- 4. quantization flags without -q --------------------------------------------------------------


@pytest.mark.parametrize(
    "flag", [["--q-bits", "8"], ["--q-group-size", "32"], ["--q-mode", "mxfp4"], ["--quant-predicate", "uniform"]]
)
def test_quantization_flags_need_quantize(models, flag):
    before = snapshot(models.parent)
    result = convert_cli("--hf-path", str(models / "hf"), "--mlx-path", str(models / "out"), *flag)
    one_line_error(result, f"{flag[0]} needs -q/--quantize", "unquantized")
    assert snapshot(models.parent) == before
    with pytest.raises(ConversionError, match="--q-bits needs -q"):
        convert(str(models / "hf"), str(models / "out"), q_bits=4, progress=False)


# ---- 10. tensor dtypes ----------------------------------------------------------------------------


def test_a_tensor_of_the_wrong_dtype_is_named(models):
    path = models / "hf" / "model.safetensors"
    tensors = load_file(path)
    key = "model.decoder.layers.1.input_layernorm.weight"
    tensors[key] = tensors[key].astype(np.int32)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        load(models / "hf")
    one_line(info.value, f"weight {key} has dtype int32, expected a floating-point type")
    before = snapshot(models.parent)
    result = convert_cli("--hf-path", str(models / "hf"), "--mlx-path", str(models / "out"))
    one_line_error(result, f"weight {key} has dtype int32")
    assert snapshot(models.parent) == before


# ---- 13. config values ----------------------------------------------------------------------------


def edit_json(path: Path, edit) -> None:
    raw = json.loads(path.read_text())
    path.write_text(json.dumps(edit(raw)))


def text_config(change):
    def edit(raw):
        raw["text_config"].update(change)
        return raw

    return edit


@pytest.mark.parametrize(
    "edit, message",
    [
        (text_config({"hidden_size": -4}), "hidden_size must be an integer of at least 1, got -4"),
        (text_config({"num_experts": 0}), "num_experts must be an integer of at least 1, got 0"),
        (text_config({"vocab_size": None}), "vocab_size must be an integer of at least 1, got null"),
        (text_config({"head_dim": "20"}), 'head_dim must be an integer of at least 1, got "20"'),
        (text_config({"rms_norm_eps": -1}), "rms_norm_eps must be a finite number above 0"),
        (lambda raw: [raw], "config.json must be a JSON object, got an array"),
        (lambda raw: {**raw, "text_config": [1]}, "text_config must be a JSON object, got an array"),
    ],
)
def test_config_values_are_checked(checkpoints, tmp_path, edit, message):
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoints("small"), folder)
    edit_json(folder / "config.json", edit)
    with pytest.raises(CheckpointError) as info:
        load(folder)
    one_line(info.value, message)


def test_a_shard_index_whose_weight_map_is_a_list(checkpoints, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoints("small"), folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    with pytest.raises(CheckpointError) as info:
        load(folder)
    one_line(info.value, "'weight_map' must map each tensor name to a shard file name")


def test_a_tokenizer_config_that_is_an_array(tmp_path):
    from mlx_dgemma.tokenizer import TokenizerError

    folder = tmp_path / "demo"
    shutil.copytree(DEMO_MODEL, folder)
    (folder / "tokenizer_config.json").write_text("[]")
    one_line_error(run_generate("--model", str(folder)), "tokenizer_config.json must be a JSON object, got list")
    with pytest.raises(TokenizerError):
        load(folder)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"t_max": float("nan")}, "t_max must be a finite number above 0"),
        ({"max_new_tokens": -1}, "max_new_tokens must be an integer of at least 1"),
        ({"t_min": 0.9, "t_max": 0.5}, "t_min 0.9 must be below t_max 0.5"),
        ([1, 2], "must be a JSON object, got an array"),
    ],
)
def test_generation_config_values_are_checked(raw, message):
    with pytest.raises(ConfigError) as info:
        GenerationConfig.from_dict(raw)
    one_line(info.value, "generation_config.json", message)


# ---- 18. a symlink loop as --model ---------------------------------------------------------------


def test_a_symlink_loop_as_model_is_named(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    os.symlink("b", tmp_path / "models" / "a")
    os.symlink("a", tmp_path / "models" / "b")
    monkeypatch.chdir(tmp_path)
    for model in ("models/a", str(tmp_path / "models" / "a")):  # "org/name" shaped, and absolute
        one_line_error(run_generate("--model", model), f"model path {model!r} runs into a symbolic link loop")
    os.symlink(tmp_path / "gone", tmp_path / "models" / "broken")
    one_line_error(run_generate("--model", "models/broken"), "is a broken symbolic link")


# ---- 2, 9, 14. templates and schemas -------------------------------------------------------------


def test_schema_numbers_keep_their_fractions(demo):
    jsonschema = pytest.importorskip("jsonschema")
    model, tokenizer = demo
    schema = {"type": "object", "properties": {"p": {"type": "number", "minimum": 0.2, "maximum": 0.8}}}
    template = json_template(tokenizer, schema)
    ((_, hole),) = template.holes
    assert hole.kind == "number"
    rendered = [template.render([v])["p"] for v in ("0.5", "0.25", "0", "7", "-", "0.95")]
    assert rendered == [0.5, 0.25, 0.2, 0.8, 0.2, 0.8]  # fractions kept, the rest clamped into range
    for seed in range(3):
        jsonschema.validate(json.loads(generate(model, tokenizer, "json: p=0.5", template=template, seed=seed)), schema)
    with pytest.raises(TemplateError) as info:
        json_template(tokenizer, {"type": "integer", "minimum": 0.2, "maximum": 0.8})
    one_line(info.value, "integer at $: no integer lies between minimum 0.2 and maximum 0.8")


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda t: parse_template(t, "x {{fill:1000000000000}}", limit=1024), "the hole at line 1, column 3"),
        (lambda t: parse_template(t, "x {{fill:1000000000000}}"), "runs past the model's context"),
        (
            lambda t: json_template(t, {"type": "array", "items": {"type": "integer"}, "maxItems": 10**12}, limit=1024),
            "schema at $ takes the template past the model's context of 1024",
        ),
        (lambda t: json_template(t, {"type": "string", "maxLength": 10**12}), "schema at $ takes the template past"),
    ],
)
def test_huge_holes_are_refused_before_they_are_built(demo, build, message):
    _, tokenizer = demo
    start = time.perf_counter()
    with pytest.raises(TemplateError) as info:
        build(tokenizer)
    assert time.perf_counter() - start < 5
    one_line(info.value, message)


def test_a_huge_hole_from_the_command_line(demo, tmp_path):
    template = tmp_path / "t.txt"
    template.write_text("{{fill:1000000000000}}")
    context = demo[0].config.max_position_embeddings
    one_line_error(run_generate("--template", str(template)), f"runs past the model's context of {context} positions")


@pytest.mark.parametrize(
    "schema, message",
    [
        ({"type": "integer", "minimum": "0"}, 'minimum at $ must be a finite number, got "0"'),
        (
            {"type": "object", "properties": {"n": {"type": "number", "maximum": [1]}}},
            "maximum at $.n must be a finite",
        ),
        ({"type": "array", "maxItems": "3"}, 'maxItems at $ must be a non-negative integer, got "3"'),
        ({"type": "string", "maxLength": 2.5}, "maxLength at $ must be a non-negative integer, got 2.5"),
        ({"type": "string", "maxLength": math.inf}, "maxLength at $ must be a non-negative integer, got Infinity"),
        ({"type": "integer", "maximum": math.inf}, "maximum at $ must be a finite number, got Infinity"),
        ({"type": "object", "properties": [1]}, "properties at $ must be an object"),
    ],
)
def test_bad_schema_values_name_the_place(demo, schema, message):
    _, tokenizer = demo
    with pytest.raises(TemplateError) as info:
        json_template(tokenizer, schema)
    one_line(info.value, message)


def test_deep_nesting_is_refused_by_place(demo, tmp_path):
    _, tokenizer = demo
    schema: dict = {"type": "integer"}
    for _ in range(520):
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(TemplateError) as info:
        json_template(tokenizer, schema)
    one_line(info.value, "nested deeper than 64 levels", "schema at $.a.a.a")
    path = tmp_path / "deep.json"  # too deep for json.dumps or json.loads at Python's recursion limit
    path.write_text('{"type": "object", "properties": {"a": ' * 520 + '{"type": "integer"}' + "}}" * 520)
    one_line_error(run_generate("--schema", str(path)), f"{path} is nested too deeply")
    path.write_text('{"type": "object", "properties": {"a": ' * 70 + '{"type": "integer"}' + "}}" * 70)
    one_line_error(run_generate("--schema", str(path)), "nested deeper than 128 levels")  # (its grammar's limit)


def test_a_schema_file_with_an_integer_past_pythons_digits(tmp_path):
    path = tmp_path / "digits.json"
    path.write_text('{"type": "integer", "maximum": ' + "9" * 5000 + "}")
    text = one_line_error(
        run_generate("--schema", str(path)),
        f"{path} holds an integer of more than {sys.get_int_max_str_digits()} digits",
    )
    assert "set_int_max_str_digits" not in text


def test_a_template_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(b"1 {{fill:3}} \xff 9")
    one_line_error(run_generate("--template", str(path)), f"{path} is not UTF-8 text (byte 0xff at offset 13)")


def test_holes_may_be_written_with_spaces(demo):
    _, tokenizer = demo
    for text in ("1 {{ fill:8 }} 9", "1 {{fill: 8}} 9", "1 {{ fill }} 9"):
        template = parse_template(tokenizer, text)
        assert [h.size for _, h in template.holes] == [8 if "8" in text else 16], text
    with pytest.raises(TemplateError) as info:
        parse_template(tokenizer, "1 {{ fill:8 9")
    one_line(info.value, "unclosed hole at line 1, column 3")
    assert parse_template(tokenizer, "{{ x }}").holes == []  # other {{ with a space stays text


# ---- 5. the auto policy's profile cache ----------------------------------------------------------


@pytest.fixture
def fake_measure(monkeypatch):
    calls = []
    monkeypatch.setattr(policy.profile, "measure", lambda model: calls.append(model) or PROFILE)
    return calls


def test_an_unwritable_profile_cache_is_said_not_fatal(demo, tmp_path, fake_measure, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cached_profile(demo[0], root=blocker / "profiles") == PROFILE
    err = capsys.readouterr().err.strip().split("\n")
    assert err[-1].startswith(f"cannot cache the device profile in {blocker / 'profiles'}")
    assert "measured again next time" in err[-1] and blocker.read_text() == ""


def test_no_home_folder_for_the_profile_cache(demo, fake_measure, monkeypatch, capsys):
    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", no_home)
    assert cached_profile(demo[0]) == PROFILE and len(fake_measure) == 1
    assert "no home folder to cache the device profile in" in capsys.readouterr().err


@pytest.mark.parametrize("content", ["", '{"device": "x", "sou', "[]", '{"device": "x"}'])
def test_a_damaged_profile_cache_is_measured_again(demo, tmp_path, fake_measure, capsys, content):
    path = policy.profile_cache_path(demo[0], tmp_path)
    path.write_text(content)
    assert cached_profile(demo[0], root=tmp_path) == PROFILE and len(fake_measure) == 1
    warning = capsys.readouterr().err.split("\n")[0]
    assert warning.startswith(f"ignoring the damaged device profile {path} (")
    assert Profile.from_json(json.loads(path.read_text())) == PROFILE  # replaced by a whole one
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


def test_auto_policy_with_an_unwritable_home(tmp_path, fake_measure):
    home = tmp_path / "home-is-a-file"
    home.write_text("")
    result = CliRunner().invoke(
        main, ["--prompt", PROMPT, "--policy", "auto", "--max-tokens", "8"], env={"HOME": str(home)}
    )
    assert result.exit_code == 0, result.output
    assert "cannot cache the device profile" in result.stderr and "Traceback" not in result.output


# ---- 6. temperatures -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--temp-max", "nan"),
        ("--temp-max", "inf"),
        ("--temp-min", "-inf"),
        ("--temp-max", "1e-310"),
        ("--temp-min", "nan"),
        ("--entropy-bound", "nan"),
    ],
)
def test_nan_infinite_and_denormal_temperatures_are_refused(flag, value):
    result = run_generate(flag, value)
    one_line_error(result, f"{flag} must be", "finite")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temp_max": math.nan},
        {"temp_max": math.inf},
        {"temp_min": math.nan},
        {"temp_max": 5e-324},
        {"entropy_bound": math.inf},
    ],
)
def test_nan_infinite_and_denormal_temperatures_in_the_api(demo, kwargs):
    model, tokenizer = demo
    with pytest.raises(ValueError) as info:
        next(stream_generate(model, tokenizer, PROMPT, 8, **kwargs))
    one_line(info.value, "finite")


# ---- 7, 15, 17, 21. prompts on the command line ---------------------------------------------------


def test_a_prompt_on_stdin_that_is_not_utf8():
    done = subprocess.run(
        [sys.executable, "-m", "mlx_dgemma.generate", "--prompt", "-"],
        input=b"sort: \xff 1",
        capture_output=True,
        env=ENV,
        cwd=ROOT,
    )
    assert done.returncode == 1
    assert done.stderr.decode().strip().split("\n") == [
        "Error: the prompt on stdin is not valid UTF-8 (byte 0xff at offset 6); re-encode it as UTF-8"
    ]


def test_a_prompt_argument_that_is_not_utf8():
    done = subprocess.run(
        [sys.executable, "-m", "mlx_dgemma.generate", b"--prompt", b"sort: \xfe 1"],
        capture_output=True,
        env=ENV,
        cwd=ROOT,
    )
    assert done.returncode == 1
    assert done.stderr.decode().strip().split("\n") == [
        "Error: --prompt is not valid UTF-8 (a bad byte at character 6); re-encode it as UTF-8"
    ]


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t "])
def test_an_empty_or_blank_prompt_is_refused(prompt):
    one_line_error(run_generate("--prompt", prompt), "the prompt is empty or only whitespace")
    one_line_error(run_generate("--prompt", "-", input=prompt), "the prompt is empty or only whitespace")


def test_an_empty_prompt_in_the_api(demo):
    model, tokenizer = demo
    for prompt in ("", " \n", []):
        with pytest.raises(PromptError) as info:
            next(stream_generate(model, tokenizer, prompt, 8))
        one_line(info.value, "is empty")


def test_an_empty_infill_prefix_is_still_a_start(demo):
    from mlx_dgemma import infill

    model, tokenizer = demo
    assert isinstance(infill(model, tokenizer, "", " 9", max_fill=4, seed=0), str)


def test_system_prompt_with_ignore_chat_template_is_refused(demo):
    one_line_error(
        run_generate("--system-prompt", "be brief", "--ignore-chat-template"), "--system-prompt needs the chat template"
    )
    model, tokenizer = demo
    for kwargs in ({"chat_template": False}, {}):
        prompt = PROMPT if kwargs else [2, 40, 41]  # token ids take no system prompt either
        with pytest.raises(PromptError) as info:
            next(stream_generate(model, tokenizer, prompt, 8, system_prompt="be brief", **kwargs))
        one_line(info.value, "a system prompt needs the chat template")


def test_prompt_from_stdin_gives_no_deprecation_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_generate("--prompt", "-", input=PROMPT.encode())
    assert result.exit_code == 0, result.output
    ours = [w for w in caught if issubclass(w.category, DeprecationWarning) and "mlx_dgemma" in w.filename]
    assert ours == [], [str(w.message) for w in ours]
    assert result.output == run_generate("--prompt", PROMPT).output


# ---- 8. seeds ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", ["-1", str(2**64), str(10**30)])
def test_seeds_out_of_range_are_refused(seed):
    one_line_error(run_generate("--seed", seed), "--seed must be an integer from 0 to 2**64 - 1", seed)


def test_seeds_in_the_api(demo):
    model, tokenizer = demo
    assert generate(model, tokenizer, PROMPT, max_tokens=8, seed=2**64 - 1) is not None  # the largest is fine
    for seed in (-1, 2**64, 1.5, "7"):
        with pytest.raises(ValueError) as info:
            next(stream_generate(model, tokenizer, PROMPT, 8, seed=seed))
        one_line(info.value, "seed must be an integer from 0 to 2**64 - 1")


# ---- 11. the API's prompt and template types -----------------------------------------------------


@pytest.mark.parametrize(
    "prompt, message",
    [
        (b"sort: 1 2", "the prompt is bytes; decode it to text"),
        ([2, 40.7, 41], "token ids must be integers, got 40.7 (float)"),
        (None, "the prompt is None; pass text (str) or a list of token ids"),
        ({"text": "hi"}, "must be text (str) or a list of token ids, got dict"),
        ([2, True], "token ids must be integers, got True (bool)"),
    ],
)
def test_api_prompts_of_the_wrong_type(demo, prompt, message):
    model, tokenizer = demo
    with pytest.raises(PromptError) as info:
        next(stream_generate(model, tokenizer, prompt, 8))
    one_line(info.value, message)


def test_api_templates_of_the_wrong_type(demo):
    model, tokenizer = demo
    with pytest.raises(TemplateError) as info:
        next(stream_generate(model, tokenizer, PROMPT, template=123))
    one_line(info.value, "template must be text with {{fill:N}} holes or a CanvasTemplate, got int")
    with pytest.raises(TemplateError, match="a template is text, got bytes"):
        parse_template(tokenizer, b"{{fill}}")


def test_api_token_ids_as_arrays_still_work(demo):
    model, tokenizer = demo
    ids = tokenizer.encode("sort: 3 1 2")
    text = generate(model, tokenizer, ids, max_tokens=8, seed=0)
    assert generate(model, tokenizer, np.array(ids), max_tokens=8, seed=0) == text
    assert generate(model, tokenizer, mx.array([ids]), max_tokens=8, seed=0) == text


# ---- 12. --verbose shows the plan that runs ------------------------------------------------------


def test_verbose_plan_shows_the_callers_settings():
    result = run_generate(
        "--verbose",
        "--steps",
        "3",
        "--entropy-bound",
        "0.5",
        "--temp-min",
        "0.1",
        "--temp-max",
        "0.3",
        "--prompt",
        PROMPT,
    )
    assert result.exit_code == 0, result.output
    head = result.stderr.split("\n")[0]
    assert head == "plan (reference): diffusion, ≤3 steps/canvas, entropy bound 0.5, t 0.1–0.3, full canvases"
    assert "set by the caller: steps 3, entropy bound 0.5, t min 0.1, t max 0.3" in result.stderr
    plain = run_generate("--verbose", "--prompt", PROMPT)
    assert plain.stderr.split("\n")[0].startswith("plan (reference): diffusion, ≤24 steps/canvas, entropy bound 0.1")
    assert "set by the caller" not in plain.stderr


# ---- 16. the whole generation must fit the context -----------------------------------------------


def test_generation_past_the_context_is_refused_up_front(demo, monkeypatch):
    model, tokenizer = demo
    calls = []
    monkeypatch.setattr(
        importlib.import_module("mlx_dgemma.engine.rows.diffusion"), "new_run", lambda *a, **k: calls.append(1)
    )
    context = model.config.max_position_embeddings
    too_many = context  # with the prompt, past the context
    with pytest.raises(PromptError) as info:
        next(stream_generate(model, tokenizer, PROMPT, too_many))
    prompt_tokens = len(gen.prompt_ids(tokenizer, PROMPT))
    room = (context - prompt_tokens) // 32 * 32
    one_line(
        info.value,
        f"max_tokens of {too_many} takes {context // 32} canvases of 32 after the {prompt_tokens}-token prompt",
        f"past the model's context of {context} tokens; ask for at most {room}",
    )
    one_line_error(run_generate("--prompt", PROMPT, "--max-tokens", str(too_many)), f"ask for at most {room}")
    with pytest.raises(PromptError):
        next(stream_generate(model, tokenizer, PROMPT, too_many, policy="ar"))
    assert calls == []


# ---- 19. eval -n 0, bench --json into a missing folder -------------------------------------------


def test_eval_with_no_instances():
    one_line_error(CliRunner().invoke(eval_module.main, ["-n", "0"]), "--instances must be at least 1, got 0")


def test_bench_output_into_a_missing_folder_is_refused_before_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("the benchmark ran"))
    for flag in ("--json", "--plot"):
        result = CliRunner().invoke(bench.main, ["--model", str(DEMO_MODEL), flag, str(tmp_path / "no" / "out")])
        one_line_error(result, f"{flag}: folder {tmp_path / 'no'} does not exist; create it first")
    assert list(tmp_path.iterdir()) == []


# ---- 20. --max-tokens caps what is printed and returned ------------------------------------------


@pytest.mark.parametrize("policy_name", ["reference", "fast", "ar", "auto"])
def test_max_tokens_caps_the_answer_on_every_policy(demo, policy_name):
    model, tokenizer = demo
    for max_tokens in (1, 5, 33):
        responses = list(
            stream_generate(model, tokenizer, PROMPT, max_tokens, seed=1, policy=policy_name, profile=PROFILE)
        )
        tokens = [t for r in responses for t in r.tokens]
        assert len(tokens) <= max_tokens and responses[-1].generation_tokens == len(tokens)
        assert "".join(r.text for r in responses) == tokenizer.decode_clean(tokens)
        if responses[-1].finish_reason == "length":
            assert len(tokens) == max_tokens


def test_max_tokens_caps_the_printed_text(demo):
    model, tokenizer = demo
    result = run_generate("--prompt", "reverse: abcdefghij", "--max-tokens", "3", "--seed", "2")
    assert result.exit_code == 0, result.output
    expected = generate(model, tokenizer, "reverse: abcdefghij", max_tokens=3, seed=2)
    assert result.output == expected + "\n"
    assert len(tokenizer.encode(expected, add_special_tokens=False)) <= 3
