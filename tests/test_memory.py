"""The memory check before loading: what it counts is what the loader holds, a refusal names a recipe
(or a number of machines) that fits, and nothing is refused or read where the model fits."""

from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten

from checkpoint_tools.synthetic_checkpoint import RELEASED, write_header_only
from mlx_dgemma import distributed, load, loader as loader_module
from mlx_dgemma.convert import Quantization, converted_size, plan_conversion
from mlx_dgemma.errors import MemoryCheckError
from mlx_dgemma.generate import DEMO_MODEL, main as generate_main
from mlx_dgemma.loader import read_config
from mlx_dgemma.memory import (
    DEVICE_MEMORY_ENV,
    MEMORY_RECIPES,
    canvas_bytes,
    check_memory,
    device_memory,
    format_size,
    kv_cache_bytes,
    memory_need,
    requested_context,
    weight_bytes,
)
from mlx_dgemma.safetensors_io import read_header
from mlx_dgemma.server.__main__ import main as server_main

PROMPT = "sort: 3 1 2"


def demo_need(folder=DEMO_MODEL, prompt=PROMPT, max_tokens=None):
    config = read_config(folder)
    tensors = {k: v for f in loader_module.weight_files(folder) for k, v in read_header(f).items()}
    return memory_need(config, tensors, requested_context(folder, config, prompt, max_tokens))


@pytest.fixture(scope="module")
def demo():
    return load(DEMO_MODEL)[0]


def parameter_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def test_weights_are_what_the_loader_holds(demo):
    assert demo_need().weights == parameter_bytes(demo)  # the vision tower included


class OneRankOf:
    def __init__(self, size):
        self._size = size

    def rank(self):
        return 0  # the first ranks hold one expert more: the busiest

    def size(self):
        return self._size


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_sharded_run_counts_one_ranks_share_of_the_experts(ranks):
    model = load(DEMO_MODEL)[0]
    distributed.shard(model, OneRankOf(ranks))
    tensors = {k: v for f in loader_module.weight_files(DEMO_MODEL) for k, v in read_header(f).items()}
    assert weight_bytes(tensors, read_config(DEMO_MODEL), ranks) == parameter_bytes(model)


@pytest.mark.parametrize(
    "text",
    ["9" * 400, "9" * 400 + ".5GB", "0.1", "0", "1e3", "-5GB", "9" * 30 + "TiB"],
    ids=["400-nines", "400-nines-GB", "0.1", "0", "1e3", "-5GB", "30-nines-TiB"],
)
def test_a_device_memory_that_is_no_size_is_one_line_from_generate_and_the_server(monkeypatch, text):
    monkeypatch.setenv(DEVICE_MEMORY_ENV, text)
    for main, args in ((generate_main, ["--prompt", "hi"]), (server_main, ["--port", "1"])):
        result = CliRunner().invoke(main, args)
        lines = result.output.strip().split("\n")
        assert result.exit_code == 1 and len(lines) == 1 and len(lines[0]) < 200, (
            result.output[-300:],
            result.exception,
        )
        assert lines[0].startswith(f"Error: {DEVICE_MEMORY_ENV}=") and lines[0].endswith(
            "is not a memory size; write it like 16GB or 24GiB"
        ), lines[0]


def test_device_memory_from_the_environment(monkeypatch):
    for text, expected in [("16GB", 16 * 10**9), ("24 GiB", 24 * 2**30), ("512mb", 512 * 10**6), ("4096", 4096)]:
        monkeypatch.setenv(DEVICE_MEMORY_ENV, text)
        assert device_memory() == (expected, DEVICE_MEMORY_ENV)
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "lots")
    with pytest.raises(MemoryCheckError, match=f"^{DEVICE_MEMORY_ENV}='lots' is not a memory size; write it like 16GB"):
        device_memory()
    monkeypatch.delenv(DEVICE_MEMORY_ENV)
    available, source = device_memory()
    on_cpu = mx.default_device() == mx.cpu and not mx.metal.is_available()
    assert available > 0 and (source == "available memory" or not on_cpu)  # /proc/meminfo on a Linux CPU


def test_a_refusal_names_a_recipe_whose_conversion_then_fits(monkeypatch, tmp_path):
    from mlx_dgemma.convert import convert

    need = demo_need()
    monkeypatch.setenv(DEVICE_MEMORY_ENV, str(need.total - 1))
    with pytest.raises(MemoryCheckError) as info:
        check_memory(DEMO_MODEL, PROMPT)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"the model needs {need.describe()} and this device can give")
    assert message.endswith("or pass --ignore-memory-check to load it anyway")
    recipe = message.split("converted with --quant-predicate ")[1].split()[0]
    assert recipe == MEMORY_RECIPES[0]  # the largest, and it fits
    dst = convert(
        str(DEMO_MODEL), str(tmp_path / recipe), quantize=True, quant_predicate=recipe, q_group_size=32, progress=False
    )
    assert f"it fits ({format_size(demo_need(dst).weights)} of weights)" in message  # what it then holds
    assert check_memory(dst, PROMPT).total < need.total  # no refusal


def test_no_refusal_where_the_model_fits(monkeypatch):
    need = demo_need()
    monkeypatch.setenv(DEVICE_MEMORY_ENV, str(need.total))
    assert check_memory(DEMO_MODEL, PROMPT) == need


def test_the_context_counts_the_prompt_and_whole_canvases():
    config = read_config(DEMO_MODEL)
    assert requested_context(DEMO_MODEL, config, "héllo", 33) == 6 + 2 * config.canvas_length


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    return write_header_only(tmp_path_factory.mktemp("released"), RELEASED)


@pytest.mark.parametrize("memory,recipe,machines", [("12GB", "mixed-16gb", 8), ("19GB", "mixed-24gb", 4)])
def test_the_released_model_names_what_fits(released, monkeypatch, memory, recipe, machines):
    monkeypatch.setenv(DEVICE_MEMORY_ENV, memory)
    with pytest.raises(MemoryCheckError) as info:
        check_memory(released, PROMPT)
    message = str(info.value)
    assert message.startswith("the model needs 51.8 GB (50.5 GB of weights")
    assert f"1.1 GB for a 256-position canvas) and this device can give {memory[:-2]}.0 GB" in message
    assert f"converted with --quant-predicate {recipe} it fits" in message
    assert f"sharded over {machines} machines like this one it fits" in message


@pytest.mark.parametrize("recipe,gib", [("mixed-16gb", 16), ("mixed-24gb", 24), ("mixed-32gb", 32)])
def test_each_memory_recipe_is_the_widest_that_fits_its_mac(released, recipe, gib):
    """Three quarters of the Mac's memory (the GPU's working set) holds the released model's weights,
    a canvas and 4096 tokens of context; the experts one width wider would not fit."""
    config = read_config(released)
    rest = kv_cache_bytes(config, 4096, 2) + canvas_bytes(config)
    working_set = 0.75 * gib * 2**30
    quantization = Quantization.from_flags(recipe=recipe)
    wider = Quantization.from_flags(bits=(2, 3, 4, 5, 6, 8)[(2, 3, 4, 5, 6, 8).index(quantization.default.bits) + 1])
    assert converted_size(plan_conversion(released, quantization, None)) + rest <= working_set
    assert converted_size(plan_conversion(released, wider, None)) + rest > working_set


def test_generate_refuses_before_reading_a_weight(monkeypatch):
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "5MB")  # the demo needs 12.7 MB; converted, 4.3 MB
    monkeypatch.setattr(loader_module, "read_safetensors", lambda path: pytest.fail("a weight was read"))
    result = CliRunner().invoke(generate_main, ["--prompt", PROMPT, "--max-tokens", "8"])
    assert result.exit_code == 1
    lines = result.stderr.strip().split("\n")
    assert len(lines) == 1 and lines[0].startswith("Error: the model needs ")
    assert "converted with --quant-predicate mixed-" in lines[0] and lines[0].endswith(
        "--ignore-memory-check to load it anyway"
    )


def test_generate_goes_on_with_the_flag(monkeypatch):
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "1MB")
    result = CliRunner().invoke(generate_main, ["--prompt", PROMPT, "--max-tokens", "8", "--ignore-memory-check"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()


def test_the_server_refuses_before_loading(monkeypatch):
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "1MB")
    monkeypatch.setattr(loader_module, "read_safetensors", lambda path: pytest.fail("a weight was read"))
    result = CliRunner().invoke(server_main, [])
    assert result.exit_code == 1
    lines = result.stderr.strip().split("\n")
    assert len(lines) == 1 and lines[0].startswith("Error: the model needs ")


def test_256k_on_the_24gb_recipe_needs_a_quantized_kv_cache(released, monkeypatch, tmp_path):
    """At 256K tokens the bfloat16 cache and the canvas view's copy of it (11.4 GB) do not fit beside
    the 24 GB recipe's 15.4 GB of weights in 24 GB; the refusal names the widest KV bits that fit, and
    at 4 bits (3.8 GB with a layer read dequantized) it is accepted."""
    from checkpoint_tools.synthetic_checkpoint import write_converted_header_only

    converted = write_converted_header_only(released, tmp_path / "mixed-24gb", "mixed-24gb")
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "24GB")
    prompt, max_tokens = "x" * (256 * 1024 - 2048), 2048
    with pytest.raises(MemoryCheckError) as info:
        check_memory(converted, prompt, max_tokens)
    message = str(info.value)
    assert message.startswith("the model needs 28.1 GB (15.4 GB of weights, 11.4 GB of KV cache for 262144 tokens")
    assert "; with --kv-bits 8 it fits (5.2 GB of KV cache);" in message
    for bits, kv in ((8, "5.2 GB"), (4, "3.8 GB")):
        need = check_memory(converted, prompt, max_tokens, kv_bits=bits)
        assert need.context == 256 * 1024 and format_size(need.kv_cache) == kv and need.total <= 24e9
    result = CliRunner().invoke(
        generate_main, ["--model", str(converted), "--prompt", "-", "--max-tokens", str(max_tokens)], input=prompt
    )
    assert result.exit_code == 1 and "with --kv-bits 8 it fits" in result.stderr.strip().split("\n")[-1]


def test_a_quantized_kv_cache_is_counted_at_its_bits(released):
    """Per position of a full layer (2 KV heads of 512, K and V): 4096 bytes in bfloat16; at b bits
    2048 · b / 8 bytes and a bfloat16 scale and bias per 64. The bfloat16 plan counts the cache and the
    canvas view's copy; the quantized one the cache, the view's canvas room and, once, the largest
    layer read dequantized and joined to its room."""
    config = read_config(released)
    full = [i for i in range(config.num_hidden_layers) if not config.is_sliding(i)]
    one = kv_cache_bytes(config, 4096, 2)  # past the sliding layers' window: only the full layers grow
    for bits in (8, 4):
        grown = kv_cache_bytes(config, 4096 + 256, 2, bits) - kv_cache_bytes(config, 4096, 2, bits)
        per_position = 2048 * bits // 8 + 2048 // 64 * 4
        assert grown == 256 * (len(full) * per_position + 2 * 4096)  # stored; the dequantized layer and its join
    assert kv_cache_bytes(config, 4096 + 256, 2) - one == 256 * len(full) * 4096 * 2


def test_the_readme_recipe_table_is_what_the_plan_gives(released):
    """Each recipe's context on a Mac whose GPU gets three quarters of its memory, per KV width."""
    import re

    from mlx_dgemma.memory import _tensors, largest_context, recipe_weight_sizes

    config = read_config(released)
    sizes = dict(recipe_weight_sizes(released, config, _tensors(released)))
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    rows = re.findall(r"^\| `(mixed-\d+gb)` \| [^|]+ \| [^|]+ \| (.+) \|$", text, re.M)
    assert [r[0] for r in rows] == ["mixed-16gb", "mixed-24gb", "mixed-32gb"]
    for recipe, cells in rows:
        want = []
        for gib in (16, 24, 32):
            tokens = [largest_context(config, sizes[recipe], 2, int(0.75 * gib * 2**30), b) for b in (None, 8, 4)]
            want.append(" / ".join(f"{t // 1024}K" if t else "–" for t in tokens))
        assert [c.strip() for c in cells.split("|")] == want, recipe
