"""The command lines at their edges: options that would train garbage, a diverging run, a full disk,
Ctrl-C, an output that cannot be written, files of the wrong kind. Each ends in one line on stderr
and a known exit status (docs/cli.md); nothing half-written is left."""

import errno
import io
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tracemalloc
import zlib
from pathlib import Path

import mlx.core as mx
import pytest
from PIL import Image

from mlx_dgemma import lora
from mlx_dgemma.cli import command_line
from mlx_dgemma.errors import FineTuneError
from mlx_dgemma.generate import DEMO_MODEL
from mlx_dgemma.tuner import adapters, trainer

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}


def cli(module, *args, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", f"mlx_dgemma.{module}", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=ENV,
        **kwargs,
    )


def one_line(result, *needles, status=1) -> str:
    assert result.returncode == status, (result.returncode, result.stderr)
    lines = result.stderr.strip().split("\n")
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    subprocess.run(
        [sys.executable, "-m", "mlx_dgemma.demo.tasks", str(folder), "--mix", "upper=6", "--held-out", "1"],
        check=True,
        cwd=ROOT,
        env=ENV,
        capture_output=True,
    )
    return folder


def train(data, adapters_folder, *args, **kwargs):
    return cli(
        "lora",
        "--train",
        "--data",
        data,
        "--batch-size",
        2,
        "--num-layers",
        1,
        "--adapter-path",
        adapters_folder,
        *args,
        **kwargs,
    )


# ---- 1. options are checked before anything loads, from flags and from the YAML config alike --------


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--learning-rate", "nan"], "--learning-rate must be a finite number > 0, got nan"),
        (["--learning-rate", "inf"], "--learning-rate must be a finite number > 0, got inf"),
        (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    ],
)
def test_options_that_would_train_garbage_are_refused(data, tmp_path, flags, message):
    result = cli("lora", "--train", "--data", data, "--adapter-path", tmp_path / "a", *flags)
    assert one_line(result) == f"Error: {message}"
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize(
    "yaml, message",
    [
        ("iters: many", "iters in {} must be an integer, got 'many'"),
        ("learning_rate: .nan", "learning_rate in {} must be a finite number > 0, got nan"),
        ("learning_rate: -1e-5", "learning_rate in {} must be a finite number > 0, got -1e-05"),
        ("batch_size: 0", "batch_size in {} must be at least 1, got 0"),
        ("save_every: 0", "save_every in {} must be at least 1, got 0"),
        ("num_layers: 0", "num_layers in {} must be at least 1, got 0"),
        ("grad_checkpoint: 'yes'", "grad_checkpoint in {} must be true or false, got 'yes'"),
        ("lora_parameters: {rank: -3}", "lora_parameters in {} rank must be at least 1, got -3"),
        ("lora_parameters: {dropout: 1.0}", "lora_parameters in {} dropout must be a finite number in [0, 1), got 1.0"),
        ("lora_parameters: {scale: .inf}", "lora_parameters in {} scale must be a finite number, got inf"),
        ("lora_parameters: {rank: '8'}", "lora_parameters in {} rank must be an integer, got '8'"),
        (
            "lr_schedule: {name: cosine_decay, arguments: [.nan, 10]}",
            "lr_schedule in {} arguments[0] (the peak learning rate) must be a finite number > 0, got nan",
        ),
        (
            "lr_schedule: {name: cosine_decay, arguments: [1e-3, 10], warmup: -1}",
            "lr_schedule in {} warmup must be at least 0, got -1",
        ),
        ("- iters: 3", "the config {} must be a mapping of options (key: value), got a list"),
        (
            "lr_schedule: {name: cosine_decay, arguments: [1e-3]}",
            "lr_schedule in {}: cosine_decay takes the arguments ['init', 'decay_steps', 'end'], got 1",
        ),
        (
            "lr_schedule: {name: __class__, arguments: [1e-3]}",
            "lr_schedule in {}: name must be one of cosine_decay, exponential_decay, linear_schedule, step_decay "
            "(mlx.optimizers.schedulers), got '__class__'",
        ),
        (
            "lr_schedule: {name: join_schedules, arguments: [1e-3, 10]}",
            "lr_schedule in {}: name must be one of cosine_decay, exponential_decay, linear_schedule, step_decay "
            "(mlx.optimizers.schedulers), got 'join_schedules'",
        ),
        (
            "lr_schedule: {name: linear_schedule, arguments: [1e-3, 0.0, -3]}",
            "lr_schedule in {}: linear_schedule(0.001, 0.0, -3): steps must be greater than 0, but got -3.",
        ),
    ],
)
def test_config_values_are_checked_as_flags_are(tmp_path, yaml, message):
    config = tmp_path / "config.yaml"
    config.write_text(yaml + "\n")
    with pytest.raises(FineTuneError) as info:
        lora.resolve_args(["--train", "-c", str(config)])
    assert str(info.value) == message.format(config)


def test_a_yaml_alias_bomb_is_shown_cut(tmp_path):
    """Seven levels of ten aliases each: ten million strings, 80 MB in its whole repr, from 400 bytes on disk."""
    levels = ["&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    levels += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 7)]
    config = tmp_path / "bomb.yaml"
    config.write_text(f"iters: [{', '.join(levels)}]\n")
    tracemalloc.start()
    try:
        with pytest.raises(FineTuneError) as info:
            lora.resolve_args(["--train", "-c", str(config)])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert message.startswith(f"iters in {config} must be an integer, got [[") and len(message) - len(str(config)) < 300
    assert peak < 16 << 20, peak


def test_a_partial_lora_parameters_keeps_the_other_defaults(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("lora_parameters: {rank: 4}\nlearning_rate: 1e-4\n")
    args = lora.resolve_args(["--train", "-c", str(config)])
    assert args.lora_parameters == {"rank": 4, "dropout": 0.0, "scale": 20.0}
    assert args.learning_rate == 1e-4  # mlx-lm's YAML reading: 1e-4 is a number, not a string


# ---- 2, 3. a diverging run stops at once; the adapter folder is checked before training ------------


def test_a_diverging_run_stops_and_saves_nothing(data, tmp_path):
    result = train(data, tmp_path / "a", "--learning-rate", "1e30", "--iters", 50)
    line = one_line(result, "training stopped", "lower --learning-rate")
    assert "is nan" in line or "not finite" in line
    assert "Saved" not in result.stdout
    assert not (tmp_path / "a").exists()


def test_an_adapter_path_that_cannot_be_written_is_refused_before_training(data, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    result = train(data, tmp_path / "file" / "adapters", "--iters", 1)
    one_line(result, "--adapter-path", "is not a folder")
    assert "Iter" not in result.stdout


# ---- 4. saves are whole or absent -------------------------------------------------------------------


def failing_writer(path, weights, *args, **kwargs):
    Path(path).write_bytes(b"half a safetensors file")
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_leaves_the_previous_adapters_and_no_temporary(tmp_path, monkeypatch):
    from mlx_dgemma import load

    demo, _ = load(DEMO_MODEL)
    adapters.apply_fine_tune(demo, "lora", 1, {"rank": 2, "dropout": 0.0, "scale": 1.0})
    target = tmp_path / "adapters.safetensors"
    adapters.save_adapters(demo, target)
    before = target.read_bytes()
    monkeypatch.setattr(mx, "save_safetensors", failing_writer)
    with pytest.raises(FineTuneError, match="cannot write .*adapters.safetensors: No space left on device"):
        adapters.save_adapters(demo, target)
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapters.safetensors"]


def test_a_full_disk_at_the_final_save_is_one_line_and_leaves_nothing(data, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(mx, "save_safetensors", failing_writer)
    folder = tmp_path / "a"
    with pytest.raises(SystemExit) as info:
        lora.main(
            [
                "--train",
                "--data",
                str(data),
                "--iters",
                "1",
                "--batch-size",
                "2",
                "--num-layers",
                "1",
                "--adapter-path",
                str(folder),
            ]
        )
    assert info.value.code == 1
    err = capsys.readouterr().err.strip().split("\n")
    assert len(err) == 1 and err[0].startswith("Error: cannot write") and "No space left" in err[0], err
    assert list(folder.iterdir()) == []


# ---- 5, 6. Ctrl-C and an output that cannot be written ---------------------------------------------


def interrupted(command, wait_for: str) -> str:
    """Start ``python COMMAND``, send SIGINT once stdout shows ``wait_for`` (or anything, for "") — the
    command is then in the phase under test — and check that it ends with 130 and one line; returns its stdout."""
    process = subprocess.Popen(
        [sys.executable, *map(str, command)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**ENV, "PYTHONFAULTHANDLER": "1"},
    )
    seen = ""
    while not seen or wait_for not in seen:
        char = process.stdout.read(1)
        assert char, f"ended before {wait_for!r}: {process.stderr.read()}"
        seen += char
    process.send_signal(signal.SIGINT)
    try:
        stdout, stderr = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # say where it hangs: faulthandler prints every thread's stack on SIGABRT
        process.send_signal(signal.SIGABRT)
        stderr = process.communicate(timeout=30)[1]
        raise AssertionError(f"no exit within 60 s of SIGINT; its threads:\n{stderr[-6000:]}") from None
    *progress, last = stderr.replace("\r", "\n").strip().split("\n") or [""]
    assert process.returncode == 130 and last == "Error: interrupted", (process.returncode, stderr)
    assert all("%|" in line for line in progress), stderr  # nothing but a progress bar before it
    return seen + stdout


# A command whose function ``WHERE.WHAT`` says "paused" and sleeps: SIGINT lands inside that phase.
PAUSED = """
import importlib, sys, time
from mlx_dgemma import fast_blas
fast_blas.load()
where, what, command = sys.argv[1:4]
owner = importlib.import_module(where)
*path, name = what.split(".")
for part in path:
    owner = getattr(owner, part)
def paused(*args, **kwargs):
    print("paused", flush=True)
    time.sleep(60)
setattr(owner, name, paused)
importlib.import_module(command).main(sys.argv[4:])
"""


def test_ctrl_c_while_loading_is_130_and_one_line():
    interrupted(
        ["-c", PAUSED, "mlx_dgemma.loader", "read_safetensors", "mlx_dgemma.generate", "--max-tokens", 8], "paused"
    )


def test_ctrl_c_during_generation_is_130_and_one_line():
    # The demo reverses 420 letters: seconds of canvases after the first one is printed.
    letters = "".join("abcdefghij"[(i * 7) % 10] for i in range(420))
    out = interrupted(["-m", "mlx_dgemma.generate", "--prompt", f"reverse: {letters}", "--max-tokens", 512], "")
    assert len(out) < len(letters)


def test_ctrl_c_during_training_is_130_and_one_line(data, tmp_path):
    interrupted(
        [
            "-m",
            "mlx_dgemma.lora",
            "--train",
            "--data",
            data,
            "--iters",
            100000,
            "--batch-size",
            2,
            "--num-layers",
            1,
            "--steps-per-report",
            1,
            "--val-batches",
            1,
            "--adapter-path",
            tmp_path / "a",
        ],
        "Train loss",
    )
    assert not (tmp_path / "a").exists()


def test_ctrl_c_while_fusing_is_130_and_one_line_and_leaves_nothing(tmp_path):
    from mlx_dgemma import load

    demo, _ = load(DEMO_MODEL)
    args = lora.resolve_args(["--train", "--num-layers", "1"])
    adapters.apply_fine_tune(demo, "lora", 1, args.lora_parameters)
    (tmp_path / "a").mkdir()
    trainer.save_run(demo, args, tmp_path / "a", [adapters.ADAPTERS])  # untrained adapters, as a run saves them
    interrupted(
        [
            "-c",
            PAUSED,
            "mlx_dgemma.safetensors_io",
            "ShardWriter.write",
            "mlx_dgemma.fuse",
            "--adapter-path",
            tmp_path / "a",
            "--save-path",
            tmp_path / "fused",
        ],
        "paused",
    )
    assert [p.name for p in tmp_path.iterdir()] == ["a"]  # no fused model, no temporary folder


def test_ctrl_c_while_evaluating_is_130_and_one_line():
    interrupted(["-m", "mlx_dgemma.demo.eval", "--templates", "-n", 200], "instances per task")


def test_ctrl_c_while_converting_is_130_and_one_line_and_leaves_nothing(tmp_path):
    interrupted(
        [
            "-c",
            PAUSED,
            "mlx_dgemma.convert.checkpoint",
            "read_tensor",
            "mlx_dgemma.convert.__main__",
            "--hf-path",
            DEMO_MODEL,
            "--mlx-path",
            tmp_path / "out",
        ],
        "paused",
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_an_output_on_a_full_disk_is_one_line():
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "mlx_dgemma.generate", "--max-tokens", "8"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=ENV,
        )
    one_line(result, "cannot write the output to stdout", "No space left on device")


def test_a_closed_pipe_is_one_line():
    # The pipe is closed before the CLI can write anything: however fast the demo answers, its first
    # write meets a closed pipe.
    process = subprocess.Popen(
        [sys.executable, "-m", "mlx_dgemma.generate", "--max-tokens", "64", "--policy", "ar"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=ENV,
    )
    process.stdout.close()
    stderr = process.stderr.read()
    assert process.wait(timeout=60) == 1
    assert stderr.strip().split("\n") == ["Error: cannot write the output to stdout (Broken pipe)"], stderr


def test_an_os_error_of_a_commands_own_file_is_one_line(capsys):
    @command_line
    def reads_a_missing_file():
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "/nowhere/run.yaml")

    with pytest.raises(SystemExit) as info:
        reads_a_missing_file()
    assert info.value.code == 1
    assert capsys.readouterr().err == "Error: /nowhere/run.yaml: No such file or directory\n"


def test_an_in_process_caller_gets_its_stdout_back():
    stdout = sys.stdout
    command_line(lambda: print("done"))()
    assert sys.stdout is stdout


# ---- 7. files of the wrong kind ---------------------------------------------------------------------


@pytest.fixture
def demo_copy(tmp_path):
    folder = tmp_path / "demo"
    shutil.copytree(DEMO_MODEL, folder, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    return folder


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header says ``width`` x ``height`` (its one pixel of data never decoded)."""
    png = io.BytesIO()
    Image.new("L", (1, 1)).save(png, format="PNG")
    data = bytearray(png.getvalue())
    ihdr = b"IHDR" + struct.pack(">II", width, height) + data[24:29]
    data[12:33] = ihdr + struct.pack(">I", zlib.crc32(ihdr))
    return bytes(data)


def test_an_image_past_pillows_bound_is_our_one_line_only(tmp_path):
    (tmp_path / "bomb.png").write_bytes(png_header(10000, 9000))  # past Pillow's warning, short of its error
    one_line(
        cli("generate", "--image", tmp_path / "bomb.png", "--max-tokens", 8),
        "is 10000x9000 pixels, more than the 67108864 pixels accepted",
    )


def test_a_config_json_that_is_a_folder(demo_copy):
    (demo_copy / "config.json").unlink()
    (demo_copy / "config.json").mkdir()
    one_line(cli("generate", "--model", demo_copy, "--max-tokens", 8), f"{demo_copy / 'config.json'} cannot be read")


@pytest.mark.parametrize(
    "content, message",
    [
        ("[1, 2]", "must be a JSON object of the run's options, got a list"),
        ('{"num_layers": ', "is not valid JSON"),
        ("{}", "has no num_layers"),
    ],
)
def test_an_adapter_config_of_the_wrong_kind(tmp_path, content, message):
    (tmp_path / "adapter_config.json").write_text(content)
    (tmp_path / "adapters.safetensors").write_bytes(b"")
    one_line(
        cli("generate", "--max-tokens", 8, "--adapter-path", tmp_path), str(tmp_path / "adapter_config.json"), message
    )


# ---- 8. fuse names its own flags --------------------------------------------------------------------


def test_fuse_errors_name_save_path(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    line = one_line(
        cli("fuse", "--adapter-path", tmp_path / "none", "--save-path", tmp_path / "taken", "--force"), "--save-path"
    )
    assert "--mlx-path" not in line
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    line = one_line(
        cli("fuse", "--adapter-path", tmp_path / "none", "--save-path", DEMO_MODEL, "--force"),
        "is the source checkpoint",
        "--save-path",
    )
    assert json.loads((DEMO_MODEL / "config.json").read_text())


def test_a_schema_llguidance_gives_up_on_is_one_line_before_anything_runs(tmp_path):
    """(At admission: its shortest answer's first tokens are tried through the grammar.)"""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "string", "maxLength": 5000, "pattern": r"^(?:\S+\s+){0,99}\S+$"}))
    result = cli("generate", "--schema", schema, "-p", "hello", "-m", 64, "--policy", "ar")
    one_line(result, "the schema cannot be enforced: llguidance gave up on it", "simplify its patterns")
    assert result.stdout.strip() == ""  # nothing half-written


def test_a_prefill_step_past_its_bound_is_one_line():
    one_line(cli("generate", "--prefill-step-size", 10**30), "--prefill-step-size must be an integer from 1 to 1048576")


def test_python_m_mlx_dgemma_runs_each_command_by_name():
    """mlx-lm's ``python -m mlx_lm generate``: the same run as ``python -m mlx_dgemma.generate`` (here
    with mlx-lm's ``--verbose False``); no command or an unknown one is a usage error (2)."""
    flags = ["--max-tokens", "8", "--seed", "0"]
    by_name = subprocess.run(
        [sys.executable, "-m", "mlx_dgemma", "generate", *flags, "--verbose", "False"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=ENV,
    )
    assert by_name.returncode == 0, by_name.stderr
    assert by_name.stdout == cli("generate", *flags).stdout and by_name.stdout.strip()
    helped = subprocess.run(
        [sys.executable, "-m", "mlx_dgemma", "convert", "--help"], capture_output=True, text=True, cwd=ROOT, env=ENV
    )
    assert helped.returncode == 0 and "Usage: python -m mlx_dgemma.convert" in helped.stdout
    for args, message in (([], "usage: python -m mlx_dgemma {generate,"), (["chat"], "Error: no command 'chat'")):
        done = subprocess.run(
            [sys.executable, "-m", "mlx_dgemma", *args], capture_output=True, text=True, cwd=ROOT, env=ENV
        )
        assert done.returncode == 2 and message in done.stderr, done.stderr
