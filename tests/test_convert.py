"""The converter: exact unquantized conversion, bounded quantization error, clean failures that leave
nothing behind, interop with the mlx-vlm / mlx-community layout, and bounded memory."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten, tree_map
from safetensors.numpy import load_file

from checkpoint_tools import random_checkpoint
from checkpoint_tools.synthetic_checkpoint import RELEASED, scaled_sizes, write_checkpoint, write_header_only
from mlx_dgemma import load
from mlx_dgemma.convert import (
    BITS,
    MAX_SHARD_BYTES,
    RECIPES,
    ConversionError,
    Quantization,
    checkpoint as convert_module,
    convert,
    converted_size,
    output_specs,
    plan_conversion,
    recipe_trials,
    split_into_shards,
)
from mlx_dgemma.convert.__main__ import convert_command, main, report_command, sizes_command
from mlx_dgemma.convert.report import LogitError, Probe, probe_logits
from mlx_dgemma.demo.scores import evaluate_policies
from mlx_dgemma.generate import DEMO_MODEL
from mlx_dgemma.loader import CheckpointError

ROOT = Path(__file__).resolve().parents[1]

# Every input dimension a multiple of 64 (mixed quantization uses group 64), none equal to another;
# 192 is not a multiple of 128, so --q-group-size 128 must be refused.
QUANT_PRESET = dict(
    vocab_size=640,
    hidden_size=192,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    global_head_dim=64,
    num_global_key_value_heads=1,
    num_experts=4,
    top_k_experts=2,
    sliding_window=5,
    canvas_length=16,
    layer_types=["sliding_attention"] * 2 + ["full_attention"],
)
SIDE_FILES = {
    "tokenizer_config.json": '{"add_bos_token": true}',
    "special_tokens_map.json": '{"eos_token": "<eos>"}',
    "chat_template.jinja": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}",
}


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """A transformers-saved checkpoint (``tame``: soft attention, so quantization error is not
    swamped by the chaotic attention of random weights) with tokenizer files and a chat template."""
    from tokenizers import Tokenizer, models

    folder = random_checkpoint.build(tmp_path_factory.mktemp("hf"), QUANT_PRESET, seed=0, tame=True)
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "sky": 4, "blue": 5}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(folder / "tokenizer.json"))
    for name, text in SIDE_FILES.items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture(scope="module")
def converted(src, tmp_path_factory):
    """Conversions of ``src``, made once per set of options."""
    made: dict[tuple, Path] = {}

    def get(**options) -> Path:
        key = tuple(sorted(options.items()))
        if key not in made:
            made[key] = convert(str(src), str(tmp_path_factory.mktemp("mlx") / "out"), progress=False, **options)
        return made[key]

    return get


@pytest.fixture(scope="module")
def reference(src):
    model, _ = load(src)
    probe = Probe.for_model(model)
    return probe, probe_logits(model, probe)


def errors(folder: Path, reference) -> tuple[LogitError, LogitError]:
    probe, (step, self_conditioned) = reference
    model, _ = load(folder)
    ours = probe_logits(model, probe)
    return LogitError.between(ours[0], step), LogitError.between(ours[1], self_conditioned)


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


# ---- exact conversion --------------------------------------------------------------------------


def test_unquantized_conversion_gives_the_source_logits(src, converted, reference):
    dst = converted()
    step, self_conditioned = errors(dst, reference)
    assert step.max_abs <= 1e-6 and self_conditioned.max_abs <= 1e-6

    index = json.loads((dst / "model.safetensors.index.json").read_text())
    keys = set(index["weight_map"])
    assert "model.decoder.layers.0.experts.gate_up_proj.weight" in keys  # mlx-vlm's names
    assert not any(k.startswith("model.encoder.language_model.") and "layer_scalar" not in k for k in keys)
    source_keys = set(load_file(src / "model.safetensors"))
    vision = {k for k in source_keys if k.startswith(("model.encoder.vision_tower.", "model.encoder.embed_vision."))}
    assert vision and vision <= keys  # passed through for mlx-vlm, which builds the vision tower
    for name in [*SIDE_FILES, "tokenizer.json", "generation_config.json"]:
        assert (dst / name).read_bytes() == (src / name).read_bytes(), name
    config = json.loads((dst / "config.json").read_text())
    assert "quantization" not in config
    assert config["text_config"]["global_head_dim"] == 64  # the spelling mlx-vlm reads
    umask = os.umask(0)
    os.umask(umask)
    assert dst.stat().st_mode & 0o777 == 0o777 & ~umask  # not the staging folder's private mode


def test_bfloat16_conversion_equals_the_source_cast_to_bfloat16(src, converted):
    ours, _ = load(converted(dtype="bfloat16"))
    model, _ = load(src)
    model.update(tree_map(lambda p: p.astype(mx.bfloat16), model.parameters()))
    params = dict(tree_flatten(ours.parameters()))
    for key, value in tree_flatten(model.parameters()):
        assert params[key].dtype == mx.bfloat16 and mx.array_equal(params[key], value), key
    probe = Probe.for_model(model)
    for a, b in zip(probe_logits(ours, probe), probe_logits(model, probe)):
        assert np.array_equal(a, b)


def test_mlx_layout_sources_convert_too(converted, tmp_path):
    """An unquantized MLX-layout checkpoint (bf16, fused or per-expert keys) is a valid source."""
    bf16 = converted(dtype="bfloat16")
    expected = dict(tree_flatten(load(bf16)[0].parameters()))
    per_expert_src = tmp_path / "per-expert"
    per_expert_src.mkdir()
    weights = mx.load(str(bf16 / "model.safetensors"))
    mx.save_safetensors(str(per_expert_src / "model.safetensors"), per_expert(weights))
    shutil.copy(bf16 / "config.json", per_expert_src)
    for source in (bf16, per_expert_src):
        again, _ = load(convert(str(source), str(tmp_path / f"{source.name}-again"), progress=False))
        for key, value in tree_flatten(again.parameters()):
            assert value.dtype == mx.bfloat16 and mx.array_equal(value, expected[key]), key


def test_sharded_output_has_an_index_and_loads_the_same(src, converted, tmp_path, reference):
    dst = convert(str(src), str(tmp_path / "sharded"), quantize=True, max_shard_bytes=200_000, progress=False)
    shards = sorted(dst.glob("*.safetensors"))
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert len(shards) > 3 and set(index["weight_map"].values()) == {s.name for s in shards}
    assert shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] <= sum(s.stat().st_size for s in shards)
    one_file = converted(quantize=True)
    assert errors(dst, reference) == errors(one_file, reference)


# ---- quantization ------------------------------------------------------------------------------

# Relative logit RMS error (‖Δ‖/‖ref‖) against the fp32 source on the report's probe (seed 0),
# measured: mixed 8-bit 1.94e-2 (self-conditioned step 2.11e-2), mixed 4-bit 1.36e-1 (2.38e-1),
# uniform 4-bit 3.87e-1 (5.01e-1). Random weights give near-uniform logits (|logit| < 2), so these
# relative errors are far larger than a trained model's; the bounds leave ~1.5x headroom.
ERROR_BOUNDS = {
    ("mixed", 8): (0.03, 0.035),
    ("mixed", 4): (0.2, 0.35),
    ("uniform", 4): (0.6, 0.75),
}


@pytest.mark.parametrize("recipe,bits", list(ERROR_BOUNDS))
def test_quantized_logit_error_is_bounded(converted, reference, recipe, bits):
    step, self_conditioned = errors(converted(quantize=True, q_bits=bits, quant_predicate=recipe), reference)
    step_bound, sc_bound = ERROR_BOUNDS[recipe, bits]
    assert 0 < step.rel_rms <= step_bound
    assert 0 < self_conditioned.rel_rms <= sc_bound


def test_mixed_recipe_writes_mlx_lm_overrides(converted, src):
    dst = converted(quantize=True, q_bits=4)
    quantization = json.loads((dst / "config.json").read_text())["quantization"]
    eight = {"group_size": 64, "bits": 8, "mode": "affine"}
    assert {k: quantization[k] for k in ("group_size", "bits", "mode")} == {
        "group_size": 64,
        "bits": 4,
        "mode": "affine",
    }
    overrides = {k for k in quantization if k.startswith("model.")}
    assert overrides == {
        "model.decoder.embed_tokens",
        *(
            f"model.decoder.layers.{i}.{m}"
            for i in range(3)
            for m in (
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.o_proj",
                "router.proj",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            )
        ),
        *(f"model.decoder.layers.{i}.self_attn.v_proj" for i in range(2)),  # the full layer has none
    }
    assert all(quantization[k] == eight for k in overrides)

    model, _ = load(dst)
    layer = model.layers[0]
    assert (layer.experts.gate_up_proj.bits, layer.experts.down_proj.bits) == (4, 4)
    assert model.model.decoder.self_conditioning.gate_proj.bits == 4
    assert (layer.self_attn.q_proj.bits, layer.router.proj.bits, layer.mlp.down_proj.bits) == (8, 8, 8)
    assert model.model.decoder.embed_tokens.bits == 8
    sizes = [
        sum(f.stat().st_size for f in converted(**o).glob("*.safetensors"))
        for o in ({}, {"quantize": True, "q_bits": 8}, {"quantize": True, "q_bits": 4})
    ]
    assert sizes[0] > sizes[1] > sizes[2]


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {path: m for path, m in model.named_modules() if hasattr(m, "scales")}


def dequantized(module: nn.Module) -> mx.array:
    return mx.dequantize(
        module.weight,
        module.scales,
        getattr(module, "biases", None),
        group_size=module.group_size,
        bits=module.bits,
        mode=module.mode,
    )


@pytest.fixture(scope="module")
def uniform_at(src, tmp_path_factory):
    """``python -m mlx_dgemma.convert -q --q-bits B --quant-predicate uniform`` of ``src``, once per width."""
    made: dict[int, Path] = {}

    def get(bits: int) -> Path:
        if bits not in made:
            dst = tmp_path_factory.mktemp(f"uniform-{bits}") / "out"
            result = CliRunner().invoke(
                convert_command,
                [
                    "--hf-path",
                    str(src),
                    "--mlx-path",
                    str(dst),
                    "-q",
                    "--q-bits",
                    str(bits),
                    "--quant-predicate",
                    "uniform",
                ],
            )
            assert result.exit_code == 0, result.output
            made[bits] = dst
        return made[bits]

    return get


@pytest.mark.parametrize("bits", BITS)
def test_every_width_dequantizes_within_one_step_and_runs_as_its_dequantized_weights(src, uniform_at, bits):
    """At each width every module is stored at it, its dequantized weight lies within one quantization step
    (MLX's affine step: the group's range / (2**bits - 1), widened where the zero point is snapped) of the
    source's, and the quantized model's logits are those of the model holding the dequantized weights."""
    quantized, _ = load(uniform_at(bits))
    source, _ = load(src)
    original = dict(tree_flatten(source.parameters()))
    modules = quantized_modules(quantized)
    assert len(modules) > 20 and {m.bits for m in modules.values()} == {bits}
    replaced = []
    for path, module in modules.items():
        w, d = original[f"{path}.weight"], dequantized(module)
        groups = w.reshape(*w.shape[:-1], -1, module.group_size)
        step = (groups.max(-1) - groups.min(-1)) / (2**bits - 1)
        scales = mx.abs(module.scales)
        error = mx.abs(d - w).reshape(groups.shape).max(-1)
        assert mx.all(error <= scales * 1.0001 + 1e-7).item(), path
        assert mx.all(scales <= 2 * step + 1e-7).item(), path
        replaced.append((f"{path}.weight", d))
    source.load_weights(replaced, strict=False)
    probe = Probe.for_model(source)
    for ours, theirs in zip(probe_logits(quantized, probe), probe_logits(source, probe)):
        assert np.abs(ours - theirs).max() < 2e-3 * np.abs(theirs).max()


def test_dequantize_writes_each_weight_as_mx_dequantize_gives_it(src, converted, tmp_path):
    """mlx-lm's -d: a quantized conversion written back unquantized, each quantized weight exactly its
    mx.dequantize, every other tensor as it was, and no quantization left in its config."""
    four_bit = converted(quantize=True, q_bits=4)
    dst = tmp_path / "dequantized"
    result = CliRunner().invoke(convert_command, ["--hf-path", str(four_bit), "--mlx-path", str(dst), "-d"])
    assert result.exit_code == 0, result.output
    quantized, _ = load(four_bit)
    plain, _ = load(dst)
    assert quantized_modules(quantized) and not quantized_modules(plain)
    assert "quantization" not in json.loads((dst / "config.json").read_text())
    weights, modules = dict(tree_flatten(plain.parameters())), quantized_modules(quantized)
    expected = {
        name: array
        for name, array in tree_flatten(quantized.parameters())
        if name.rpartition(".")[0] not in modules or name.rpartition(".")[2] not in ("weight", "scales", "biases")
    }
    expected.update({f"{path}.weight": dequantized(module) for path, module in modules.items()})
    assert set(weights) == set(expected)
    for name, array in expected.items():
        assert mx.array_equal(weights[name], array).item(), name


@pytest.mark.parametrize(
    "options, message",
    [
        (["-q"], "Error: -d/--dequantize writes the checkpoint's own weights unquantized; drop -q"),
        (
            ["--dtype", "float16"],
            "Error: -d/--dequantize writes the checkpoint's own weights unquantized; drop --dtype",
        ),
    ],
)
def test_dequantize_with_quantization_flags_is_refused(converted, tmp_path, options, message):
    assert (
        cli_error(["--hf-path", str(converted(quantize=True, q_bits=4)), "-d", *options], tmp_path / "out") == message
    )


def test_dequantize_of_an_unquantized_checkpoint_is_refused(converted, tmp_path):
    plain = converted()
    assert cli_error(["--hf-path", str(plain), "-d"], tmp_path / "out") == (
        f"Error: --dequantize takes a quantized MLX checkpoint, and {plain}'s config.json has no quantization; "
        "convert it without -d"
    )


def test_an_upload_that_fails_says_what_was_written_and_why(src, tmp_path, monkeypatch):
    """--upload-repo through huggingface_hub, offline here: one line naming the written folder and the
    hub's reason, exit 1, the conversion kept whole."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dst = tmp_path / "out"
    result = CliRunner().invoke(
        convert_command,
        ["--hf-path", str(src), "--mlx-path", str(dst), "--upload-repo", "someone/dgemma-mlx", "--trust-remote-code"],
    )
    assert result.exit_code == 1
    (line,) = [line for line in result.stderr.split("\n") if line.startswith("Error:")]  # (after the progress bar)
    assert line.startswith(f"Error: wrote {dst}, but could not upload it to someone/dgemma-mlx: ") and "offline" in line
    assert load(dst)[0] is not None


def test_logit_error_falls_with_every_bit(uniform_at, reference):
    rel_rms = [errors(uniform_at(bits), reference)[0].rel_rms for bits in BITS]
    assert all(a > b for a, b in zip(rel_rms, rel_rms[1:])), rel_rms


@pytest.mark.parametrize(
    "options,message",
    [
        (
            ["--q-bits", "3", "--quant-predicate", "mixed-24gb"],
            "mixed-24gb quantizes the experts at 4 bits; drop --q-bits 3",
        ),
        (["--quant-predicate", "mixed-16gb", "--q-mode", "mxfp4"], "mixed-16gb is affine; drop --q-mode mxfp4"),
    ],
)
def test_conflicting_quantization_flags_are_refused(src, tmp_path, options, message):
    assert message in cli_error(["--hf-path", str(src), "-q", *options], tmp_path / "dst")


def test_a_width_mlx_cannot_quantize_to_is_refused_by_the_python_api(src, tmp_path):
    with pytest.raises(ConversionError, match="--q-bits 7 is not a width MLX quantizes to; choose one of 2, 3, 4"):
        convert(str(src), str(tmp_path / "dst"), quantize=True, q_bits=7)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("recipe,bits", [(None, None), *recipe_trials(list(RECIPES), [3, 5])])
def test_predicted_size_is_what_the_conversion_writes(src, tmp_path, recipe, bits):
    """From the headers alone, exactly the bytes of the safetensors files written (several shards)."""
    quantization = None if recipe is None else Quantization.from_flags(bits, recipe=recipe)
    predicted = converted_size(plan_conversion(src, quantization, None), max_shard_bytes=300_000)
    options = {} if recipe is None else dict(quantize=True, q_bits=bits, quant_predicate=recipe)
    dst = convert(str(src), str(tmp_path / "dst"), max_shard_bytes=300_000, progress=False, **options)
    files = list(dst.glob("*.safetensors"))
    assert len(files) > 1 and predicted == sum(f.stat().st_size for f in files)


def test_sizes_command_prints_every_recipe_without_reading_a_weight(src, monkeypatch):
    monkeypatch.setattr(convert_module, "read_tensor", lambda info: pytest.fail("a weight was read"))
    result = CliRunner().invoke(sizes_command, ["--hf-path", str(src)])
    assert result.exit_code == 0, result.output
    rows = {line[:32].strip(): int(line.split()[-1]) for line in result.stdout.strip().split("\n")[1:]}
    assert len(rows) == 1 + 2 * len(BITS) + 3
    source_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    assert abs(rows["unquantized"] - source_bytes) < 1e-3 * source_bytes  # the same tensors, another header
    expected = converted_size(plan_conversion(src, Quantization.from_flags(2, recipe="mixed-16gb"), None))
    assert rows["mixed-16gb 2-bit affine g64"] == expected == rows["mixed 2-bit affine g64"]
    assert rows["uniform 2-bit affine g64"] < expected < rows["mixed 3-bit affine g64"]


@pytest.mark.parametrize("mode", ["mxfp4", "mxfp8"])
def test_microscaling_modes_convert_and_load(converted, reference, mode):
    step, _ = errors(converted(quantize=True, q_mode=mode), reference)
    assert 0 < step.rel_rms < 0.3  # measured: mxfp4 0.160, mxfp8 0.097


def test_uniform_microscaling_quantizes_the_embedding_too(converted, reference):
    """mxfp4 keeps uint8 scales: the embedding scale and the soft embedding must use the activations' dtype."""
    _, self_conditioned = errors(converted(quantize=True, q_mode="mxfp4", quant_predicate="uniform"), reference)
    assert self_conditioned.rel_rms < 0.75


def test_report_lists_every_recipe(src, tmp_path):
    """The recipes that take --q-bits once per width asked for; the memory recipes once, at their own."""
    result = CliRunner().invoke(
        report_command,
        ["--hf-path", str(src), "--work-dir", str(tmp_path), "-n", "0", "--q-bits", "4", "--q-bits", "8"],
    )
    assert result.exit_code == 0, result.output
    rows = result.stdout.strip().split("\n")[2:]
    assert [r.split("  ")[0] for r in rows] == [
        "unquantized (config dtype)",
        "mixed 4-bit affine g64",
        "mixed 8-bit affine g64",
        "uniform 4-bit affine g64",
        "uniform 8-bit affine g64",
        "mixed-16gb 2-bit affine g64",
        "mixed-24gb 4-bit affine g64",
        "mixed-32gb 6-bit affine g64",
    ]
    assert " 0.00e+00 " in rows[0] and " 0.00e+00 " not in rows[1]
    assert "diff acc" not in result.stdout  # -n 0: logit error only
    assert list(tmp_path.iterdir()) == []


def test_report_with_failed_trials_exits_1_naming_the_first(broken):
    """A --work-dir inside the source: every trial's destination is refused, so there is nothing to report."""
    result = CliRunner().invoke(
        report_command,
        [
            "--hf-path",
            str(broken),
            "--work-dir",
            str(broken),
            "-n",
            "0",
            "--q-bits",
            "4",
            "--quant-predicate",
            "uniform",
        ],
    )
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().split("\n")
    assert len(lines) == 1 and lines[0].startswith(
        "Error: 2 trials failed; the first: unquantized (config dtype): failed ("
    ), result.stderr
    assert len(result.stdout.strip().split("\n")) == 2  # the table's header alone


def test_report_measures_the_demo_tasks(tmp_path):
    """Accuracy under diffusion (with steps per canvas) and AR: the unquantized row is what the demo
    evaluation gives the same instances; a 2-bit-expert recipe is measured the same way."""
    n = 2
    result = CliRunner().invoke(
        report_command,
        [
            "--hf-path",
            str(DEMO_MODEL),
            "--work-dir",
            str(tmp_path),
            "--quant-predicate",
            "mixed-16gb",
            "--q-group-size",
            "32",
            "-n",
            str(n),
            "--seed",
            "5",
        ],
    )
    assert result.exit_code == 0, result.output
    header, _, *rows = result.stdout.strip().split("\n")
    assert header.split()[-5:] == ["diff", "acc", "steps", "AR", "acc"]
    assert [r.split("  ")[0] for r in rows] == ["unquantized (config dtype)", "mixed-16gb 2-bit affine g32"]
    model, tokenizer = load(DEMO_MODEL)
    scores = evaluate_policies(model, tokenizer, n, 5, ["reference", "ar"])
    diffusion, ar = (list(scores[p].values()) for p in ("reference", "ar"))
    steps = [k for s in diffusion for k in s.steps]
    expected = [f"{sum(s.correct for s in d) / sum(s.total for s in d):.1%}" for d in (diffusion, ar)]
    assert rows[0].split()[-3:] == [expected[0], f"{sum(steps) / len(steps):.2f}", expected[1]]
    for row in rows:
        diffusion_accuracy, steps_per_canvas, ar_accuracy = row.split()[-3:]
        assert diffusion_accuracy.endswith("%") and ar_accuracy.endswith("%")
        assert 1 <= float(steps_per_canvas) <= model.generation_config.max_denoising_steps


def test_plan_for_the_released_checkpoint(tmp_path):
    """A sparse 50 GB bf16 file (a header and no data) plans like the real one: every quantized
    dimension divides group 64; mixed 4-bit writes 15.4 GB of text weights in 3 shards of at most 5 GiB,
    with one 8-bit override per embedding, attention, router and dense MLP module; group 128 is refused."""
    write_header_only(tmp_path, RELEASED)
    plan = plan_conversion(tmp_path, Quantization.from_flags(bits=4), dtype=None)
    groups = output_specs(plan)
    sizes = [sum(s.nbytes for _, specs in shard for s in specs) for shard in split_into_shards(groups, MAX_SHARD_BYTES)]
    assert len(sizes) == 3 and max(sizes) <= MAX_SHARD_BYTES
    assert 15.3e9 < sum(sizes) < 15.5e9  # from 50.5 GB
    overrides = [k for k in plan.quantization_config() if k.startswith("model.")]
    assert len(overrides) == 1 + 30 * 7 + 25  # embedding; q, k, o, router, 3 MLP per layer; v on 25 sliding layers
    with pytest.raises(ConversionError, match="does not divide the input dimension 704"):
        plan_conversion(tmp_path, Quantization.from_flags(bits=4, group_size=128), dtype=None)


# ---- bad input: one line, non-zero exit, nothing left behind ----------------------------------


@pytest.fixture
def broken(src, tmp_path):
    folder = tmp_path / "src"
    shutil.copytree(src, folder)
    return folder


def cli_error(args: list[str], dst: Path) -> str:
    result = CliRunner().invoke(convert_command, args + ["--mlx-path", str(dst)])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().split("\n")
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert leftovers(dst.parent) == []
    return lines[0]


def test_corrupt_shard(broken, tmp_path):
    data = bytearray((broken / "model.safetensors").read_bytes())
    data[8:40] = b"{not json at all, just garbage!!"
    (broken / "model.safetensors").write_bytes(bytes(data))
    msg = cli_error(["--hf-path", str(broken)], tmp_path / "dst")
    assert "model.safetensors is not a readable safetensors file" in msg
    assert not (tmp_path / "dst").exists()


def test_truncated_shard(broken, tmp_path):
    path = broken / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    msg = cli_error(["--hf-path", str(broken), "-q"], tmp_path / "dst")
    assert "ends past the end of the file" in msg
    assert not (tmp_path / "dst").exists()


def test_index_naming_a_missing_shard(broken, tmp_path):
    keys = list(load_file(broken / "model.safetensors"))
    weight_map = {k: ("model.safetensors" if i % 2 else "model-extra.safetensors") for i, k in enumerate(keys)}
    (broken / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    msg = cli_error(["--hf-path", str(broken)], tmp_path / "dst")
    assert "names shard model-extra.safetensors, which is missing" in msg
    assert not (tmp_path / "dst").exists()


def test_wrong_model_type(broken, tmp_path):
    raw = json.loads((broken / "config.json").read_text())
    raw["model_type"] = "gemma3"
    (broken / "config.json").write_text(json.dumps(raw))
    assert "model_type 'gemma3'" in cli_error(["--hf-path", str(broken)], tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_group_size_that_does_not_divide_a_dimension(src, tmp_path):
    msg = cli_error(["--hf-path", str(src), "-q", "--q-group-size", "128"], tmp_path / "dst")
    assert "group size 128 does not divide the input dimension 64 of model.decoder.layers.0.experts.down_proj" in msg
    assert "--q-group-size 32 or 64" in msg
    assert not (tmp_path / "dst").exists()


def test_existing_destination_is_refused_unless_forced(src, tmp_path):
    dst = tmp_path / "dst"
    assert convert(str(src), str(dst), progress=False) == dst
    assert "already exists; pass --force" in cli_error(["--hf-path", str(src)], dst)

    result = CliRunner().invoke(convert_command, ["--hf-path", str(src), "--mlx-path", str(dst), "--force", "-q"])
    assert result.exit_code == 0, result.output
    assert json.loads((dst / "config.json").read_text())["quantization"]  # the earlier conversion was replaced
    assert leftovers(tmp_path) == []


def test_already_quantized_source_is_refused(converted, tmp_path):
    with pytest.raises(ConversionError, match="already quantized"):
        convert(str(converted(quantize=True)), str(tmp_path / "dst"), quantize=True)
    assert list(tmp_path.iterdir()) == []


def test_a_failure_while_writing_leaves_nothing_behind(src, tmp_path, monkeypatch):
    calls = []

    def failing_read(info):
        calls.append(info)
        if len(calls) == 20:
            raise OSError("[Errno 28] No space left on device")
        return read_tensor(info)

    read_tensor = convert_module.read_tensor
    monkeypatch.setattr(convert_module, "read_tensor", failing_read)
    with pytest.raises(OSError, match="No space left"):
        convert(str(src), str(tmp_path / "dst"), quantize=True, max_shard_bytes=100_000, progress=False)
    assert len(calls) == 20 and list(tmp_path.iterdir()) == []


def test_command_line_exit_status(src, tmp_path):
    """The real entry point: status 1 and one line on stderr."""
    dst = tmp_path / "dst"
    dst.mkdir()
    command = [sys.executable, "-m", "mlx_dgemma.convert", "--hf-path", str(src), "--mlx-path", str(dst), "-q"]
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT
    )
    assert done.returncode == 1
    assert done.stderr.strip().split("\n") == [f"Error: {dst} already exists; pass --force to replace it"]


def test_missing_source_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="not a folder"):
        convert(str(tmp_path / "nope"), str(tmp_path / "dst"))
    with pytest.raises(SystemExit) as info:
        main(["--hf-path", str(tmp_path / "nope"), "--mlx-path", str(tmp_path / "dst")])
    assert info.value.code == 1 and list(tmp_path.iterdir()) == []


# ---- interop with the mlx-vlm / mlx-community layout -------------------------------------------


def mlx_vlm_quantize(model: nn.Module, bits: int = 4, group_size: int = 64) -> dict:
    """mlx-vlm 0.7.10's ``quantize_model`` (quant_utils.py) with DiffusionGemma's ``quant_predicate``
    (models/diffusion_gemma/language.py), re-expressed: returns the ``quantization`` it writes."""
    quantization = {"group_size": group_size, "bits": bits, "mode": "affine"}

    def predicate(path, module):
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % group_size:
            return False
        if "vision" in path:  # mlx-vlm's skip_multimodal_module: the vision tower stays unquantized
            return False
        if (
            path.endswith(("embed_tokens", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
            or ".self_attn." in path
            or "router" in path
        ):
            quantization[path] = {"group_size": 64, "bits": 8}  # mlx-vlm writes no "mode" here
            return quantization[path]
        return True

    nn.quantize(model, group_size, bits, mode="affine", class_predicate=predicate)
    return quantization


def per_expert(weights: dict) -> dict:
    """Fused expert tensors (and their scales and biases) split into per-expert keys."""
    out = {}
    for key, value in weights.items():
        head, sep, part = key.rpartition(".experts.gate_up_proj.")
        if sep:
            inner = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{head}.experts.{e}.gate_proj.{part}"] = value[e, :inner]
                out[f"{head}.experts.{e}.up_proj.{part}"] = value[e, inner:]
            continue
        head, sep, part = key.rpartition(".experts.down_proj.")
        if sep:
            for e in range(value.shape[0]):
                out[f"{head}.experts.{e}.down_proj.{part}"] = value[e]
            continue
        out[key] = value
    return out


@pytest.mark.parametrize("layout", ["fused", "per-expert"])
def test_mlx_vlm_layout_with_overrides_loads_and_matches(src, converted, reference, tmp_path, layout):
    model, _ = load(src)
    quantization = mlx_vlm_quantize(model)
    weights = dict(tree_flatten(model.parameters()))
    source = load_file(src / "model.safetensors")
    weights.update({k: mx.array(v) for k, v in source.items() if k.startswith("model.encoder.vision")})
    if layout == "per-expert":
        weights = per_expert(weights)
    folder = tmp_path / "community"
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = json.loads((src / "config.json").read_text())
    config.update(quantization=quantization, quantization_config=quantization)
    (folder / "config.json").write_text(json.dumps(config))

    ours = converted(quantize=True, q_bits=4)
    assert errors(folder, reference) == errors(ours, reference)
    a, _ = load(folder)
    b, _ = load(ours)
    params = dict(tree_flatten(b.parameters()))
    for key, value in tree_flatten(a.parameters()):
        assert mx.array_equal(value, params[key]), key


def test_output_loads_in_mlx_vlm(converted):
    """Run with mlx-vlm installed (it is not a dependency): strict load, same weights, same logits."""
    pytest.importorskip("mlx_vlm")
    from mlx_vlm.utils import load_model

    dst = converted(quantize=True, q_bits=4)
    vlm = load_model(dst)
    ours, _ = load(dst)
    theirs = dict(tree_flatten(vlm.parameters()))
    for key, value in tree_flatten(ours.parameters()):
        assert mx.array_equal(value, theirs[key]), key
    rng = np.random.default_rng(0)
    prompt = mx.array(rng.integers(3, 640, (1, 4)), dtype=mx.int32)
    canvas = mx.array(rng.integers(0, 640, (1, 16)), dtype=mx.int32)
    cache = vlm.diffusion_prefill_cache(prompt, cache=vlm.make_cache())
    expected = vlm.diffusion_decoder_logits(canvas, cache).astype(mx.float32)
    our_cache = ours.make_cache()
    ours.encode(prompt, our_cache)
    got = ours.denoise(canvas, our_cache)
    assert float(mx.abs(got - expected).max() / mx.abs(expected).max()) < 1e-4


# ---- memory ------------------------------------------------------------------------------------

PEAK_RSS = """
import resource, sys
from mlx_dgemma.convert import convert
imported = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
convert(sys.argv[1], sys.argv[2], quantize=True, progress=False)
print(imported * 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def test_conversion_memory_does_not_hold_the_model(tmp_path):
    """≈300 MB of fp32 in 3 shards, largest tensor 16 MB, converted (4-bit mixed) in a child process:
    its peak RSS may exceed the peak after its imports by at most a third of the checkpoint.
    Measured: +31 MB; loading everything at once adds ≥ 300 MB."""
    src = write_checkpoint(tmp_path / "src", scaled_sizes(layers=7), "float32", shard_bytes=100 << 20)
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    assert size > 250e6
    done = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, str(src), str(tmp_path / "dst")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
    )
    imported, peak = map(int, done.stdout.split())
    assert peak - imported < size / 3, (peak - imported) / 1e6
    assert (tmp_path / "dst" / "model.safetensors.index.json").exists()
