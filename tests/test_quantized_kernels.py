"""The CPU seam's quantized products (dequantize, then BLAS) against MLX's own quantized kernels."""

from dataclasses import replace
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_dgemma.model import kernels
from mlx_dgemma.model.diffusion_gemma import Linear
from mlx_dgemma.model.experts import Experts

# float32 products of the same dequantized weights: differences are summation order only
TOLERANCE = 1e-4


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("transpose", [True, False])
def test_cpu_quantized_matmul_matches_mlx(bits, group_size, transpose, monkeypatch):
    monkeypatch.setattr(kernels, "DEQUANTIZED_CHUNK_ELEMENTS", 64 * 128)  # several chunks
    w = mx.random.normal((320, 256), key=mx.random.key(bits))
    x = mx.random.normal((3, 7, 256 if transpose else 320), key=mx.random.key(1))
    q = mx.quantize(w, group_size, bits)
    args = (x, *q, transpose, group_size, bits, "affine")
    expected = mx.quantized_matmul(x, *q, transpose=transpose, group_size=group_size, bits=bits)
    got = kernels.CPU.quantized_matmul(*args)
    assert got.shape == expected.shape
    assert mx.abs(got - expected).max().item() <= TOLERANCE * mx.abs(expected).max().item()


def test_quantized_linear_goes_through_the_seam():
    model = nn.Sequential(Linear(128, 64, bias=False))
    nn.quantize(model, group_size=64, bits=4)
    calls = []
    model.layers[0].kernels = replace(
        kernels.CPU, quantized_matmul=lambda *a: calls.append(a) or kernels.CPU.quantized_matmul(*a)
    )
    model(mx.zeros((5, 128)))
    assert len(calls) == 1


def test_quantized_experts_match_gather_qmm():
    cfg = SimpleNamespace(hidden_size=128, moe_intermediate_size=64, num_experts=8, top_k_experts=2)
    experts = Experts(cfg)
    experts.update(
        {
            "gate_up_proj": {"weight": 0.1 * mx.random.normal(experts.gate_up_proj.weight.shape)},
            "down_proj": {"weight": 0.1 * mx.random.normal(experts.down_proj.weight.shape)},
        }
    )
    nn.quantize(experts, group_size=32, bits=4, class_predicate=lambda p, m: hasattr(m, "to_quantized"))
    x = mx.random.normal((2, 24, cfg.hidden_size))
    idx = mx.random.randint(0, cfg.num_experts, (2, 24, cfg.top_k_experts))
    weights = mx.softmax(mx.random.normal(idx.shape), axis=-1)
    for module in (experts, experts.gate_up_proj, experts.down_proj):
        module.kernels = kernels.MLX
    expected = experts(x, idx, weights)  # gather_qmm
    for module in (experts, experts.gate_up_proj, experts.down_proj):
        module.kernels = kernels.CPU
    got = experts(x, idx, weights)  # one dequantized BLAS product per expert
    assert mx.abs(got - expected).max().item() <= TOLERANCE * mx.abs(expected).max().item()


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.bfloat16])
def test_numpy_dequantize_matches_mlx(bits, scale_dtype, monkeypatch):
    """The byte-table unpacking (several tiles, rows split over the cores) gives MLX's dequantized weights,
    also with the bfloat16 scales and biases a conversion writes."""
    monkeypatch.setattr(kernels, "DEQUANTIZED_TILE_ELEMENTS", 3 * 256)
    monkeypatch.setattr(kernels, "PARALLEL_MIN_ELEMENTS", 0)
    w, scales, biases = mx.quantize(mx.random.normal((40, 256), key=mx.random.key(bits)), 64, bits)
    scales, biases = scales.astype(scale_dtype), biases.astype(scale_dtype)
    # (in float32: MLX's own output with bfloat16 scales is rounded to bfloat16)
    expected = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=64, bits=bits)
    with kernels._dequantized(w, scales, biases, 64, bits, "affine") as got:
        assert mx.abs(got - expected).max().item() <= 1e-6 * mx.abs(expected).max().item()


def test_dequantized_chunks_reuse_one_buffer(monkeypatch):
    """Every chunk of a product is written into the same scratch buffer, each product evaluated before
    the next chunk overwrites it: the result still matches MLX's over many chunks."""
    monkeypatch.setattr(kernels, "DEQUANTIZED_CHUNK_ELEMENTS", 16 * 256)
    q = mx.quantize(mx.random.normal((160, 256), key=mx.random.key(3)), 64, 4)
    x = mx.random.normal((5, 256), key=mx.random.key(4))
    got = kernels.CPU.quantized_matmul(x, *q, True, 64, 4, "affine")
    first = kernels._scratch.buffer
    kernels.CPU.quantized_matmul(x, *q, True, 64, 4, "affine")
    assert kernels._scratch.buffer is first
    expected = mx.quantized_matmul(x, *q, transpose=True, group_size=64, bits=4)
    assert mx.abs(got - expected).max().item() <= TOLERANCE * mx.abs(expected).max().item()
