"""benchmarks/full_scale.py and benchmarks/gpu_suite.sh: the released model's shapes end to end."""

import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import full_scale  # noqa: E402

from checkpoint_tools.synthetic_checkpoint import scaled_sizes, write_checkpoint  # noqa: E402
from mlx_dgemma.convert import convert  # noqa: E402
from mlx_dgemma.engine.policy import RELEASED  # noqa: E402
from mlx_dgemma.loader import load_model  # noqa: E402


def test_released_sizes_are_the_released_config():
    sizes = full_scale.released_sizes(30)
    config = full_scale.ModelConfig.from_dict(full_scale.hf_config(sizes, "bfloat16"))
    for name in (
        "vocab_size",
        "hidden_size",
        "num_experts",
        "top_k_experts",
        "moe_intermediate_size",
        "head_dim",
        "global_head_dim",
        "num_global_key_value_heads",
        "sliding_window",
        "layer_types",
    ):
        assert getattr(config, name) == getattr(RELEASED, name), name
    assert 50.4e9 < full_scale.source_bytes(sizes, "bfloat16") < 50.6e9  # the 50.5 GB
    assert full_scale.released_sizes(2)["layer_types"] == ["sliding_attention", "full_attention"]


def quantized_modules(model) -> dict[str, tuple[int, int]]:
    return {path: (m.bits, m.group_size) for path, m in model.named_modules() if hasattr(m, "bits")}


def test_model_made_in_memory_is_quantized_as_the_converter_does(tmp_path):
    """--in-memory (the GPU run) quantizes each module at the bits a conversion of the same
    checkpoint gives it, and leaves nothing unfilled."""
    sizes = scaled_sizes(2, width=8)
    write_checkpoint(tmp_path / "src", sizes)
    convert(
        str(tmp_path / "src"), str(tmp_path / "dst"), quantize=True, q_bits=4, quant_predicate="mixed", progress=False
    )
    converted = quantized_modules(load_model(tmp_path / "dst"))
    model, _ = full_scale.random_model(sizes, "mixed", 4, "bfloat16")
    assert quantized_modules(model) == converted
    assert {b for b, _ in converted.values()} == {4, 8}
    weights = [v for name, v in tree_flatten(model.parameters()) if name.endswith("experts.down_proj.weight")]
    assert weights and all(mx.any(w != 0).item() for w in weights)
    assert isinstance(model.model.decoder.embed_tokens, nn.QuantizedEmbedding)


def test_files_are_removed_when_a_stage_fails(tmp_path, monkeypatch):
    def failing_write(folder, sizes, dtype):
        folder.mkdir(parents=True)
        (folder / "model-00001-of-00001.safetensors").write_bytes(b"partial")
        raise SystemExit("full_scale: source written failed (exit 1)")

    monkeypatch.setattr(full_scale, "write_source", failing_write)
    with pytest.raises(SystemExit, match="source written failed"):
        full_scale.main(["--layers", "1", "--work-dir", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []


def test_too_little_disk_is_refused_before_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(full_scale.shutil, "disk_usage", lambda _: type("Usage", (), {"free": 10**9}))
    with pytest.raises(SystemExit, match=r"needs 6[0-9.]+ GB free .* there are 1.0 GB"):
        full_scale.main(["--work-dir", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []


QUICK = ["--prompt", "8", "--ar-tokens", "2", "--steps", "1", "--canvas", "16", "--draft-length", "8"]


@pytest.mark.slow
def test_full_scale_at_two_layers(tmp_path):
    """Writes, converts, loads and runs each policy at the released shapes (2 layers), then cleans up."""
    run = subprocess.run(
        [sys.executable, "benchmarks/full_scale.py", "--layers", "2", "--work-dir", str(tmp_path), *QUICK],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    for stage in (
        "source written",
        "converted",
        "loaded",
        "prefill",
        "AR answer",
        "verified round",
        "diffusion canvas",
        "peak",
        "load and runs",
    ):
        assert f"\n{stage}" in run.stdout, stage
    assert list(tmp_path.iterdir()) == []


def test_gpu_suite_dry_run():
    """benchmarks/gpu_suite.sh, the GPU run, in its CPU dry run: every step wired (the parity tests
    collected; each benchmark on a small model of the released layout), and the sweep's figures printed
    beside the roofline's for the device."""
    run = subprocess.run(
        ["bash", "benchmarks/gpu_suite.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    lines = run.stdout.split("\n")
    assert lines[-2] == "gpu_suite: all steps passed"
    assert any(re.fullmatch(r"[1-9]\d* tests collected in .*", line) for line in lines)
    assert any(re.fullmatch(r"against .*cpu\.json: 0 of [1-9]\d* answers differ", line) for line in lines)
    sweeps = [i for i, line in enumerate(lines) if line.startswith("sweep: ")]
    assert len(sweeps) == 2  # bfloat16 (float32 here) and 4-bit
    number = r"\s+\d+\.\d\d"
    for start in sweeps:
        assert "predicted (H200)" in lines[start + 1]
        rows = [
            ("AR", "tok/s", True),
            ("prefill", "tok/s", True),
            ("step at 16", "ms", True),
            ("crossover at 16", "steps", False),
        ]
        for line, (row, unit, ratio) in zip(lines[start + 2 :], rows):
            pattern = row + 2 * f"{number} {unit}" + (f"{number}x" if ratio else "")  # measured, predicted, x roofline
            assert re.fullmatch(pattern, line.rstrip()), line
