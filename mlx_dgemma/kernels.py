"""The device seam: the few places where the CPU and the accelerators compute the same numbers in
different ways, chosen once, when a model is made (``DiffusionGemma.use_kernels``).

On Metal and CUDA everything is plain MLX. On a CPU, MLX evaluates transcendentals one element at a
time (``mx.exp``/``mx.tanh`` over 256 × 32000 fp32: ≈ 220 ms, numpy ≈ 10 ms) and its ``gather_mm``
multiplies row by row in float32 only, so there:

- the vocabulary-wide soft-cap, softmax and tempered distribution run in numpy;
- each expert's rows go through one BLAS product (``expert_counts`` says how many rows each expert
  has, one host sync per MoE layer, which costs nothing where there is no device queue to drain),
  unless experts get under ``SEGMENT_MIN_ROWS`` rows each on average (a short canvas, an AR token)
  and ``gather_mm`` without the sync is cheaper (benchmarks/expert_dispatch.py);
- attention over many keys (a long prompt) computes its softmax in numpy between two BLAS
  products, where MLX's fused attention spends most of its time in exp: a 256-position canvas
  after 8192 prompt tokens, full layer, ≈ 2x faster (benchmarks/attention_cpu.py);
- matmuls use OpenBLAS when it is installed (``fast_blas.py``: loaded before ``mlx.core``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

_FLOAT32_MIN = float(np.finfo(np.float32).min)

# Rows per expert (on average) from which per-expert BLAS beats gather_mm on the CPU. Measured on 2
# cores: gather 0.85x the time at 0.2-1 rows (an AR token), 0.95x at 2, 1.1x at 4, 1.4-1.9x from 8.
SEGMENT_MIN_ROWS = 1


@dataclass(frozen=True)
class Kernels:
    name: str
    softcap: Callable[[mx.array, float], mx.array]  # cap · tanh(logits / cap), float32
    softmax: Callable[[mx.array], mx.array]  # over the last axis, float32
    # (logits, temperature) -> tempered logits, probabilities, entropy (nats), argmax
    tempered_distribution: Callable[[mx.array, mx.array], tuple[mx.array, mx.array, mx.array, mx.array]]
    # (sorted expert ids [N], experts, gather_ok) -> rows per expert, or None for gather_mm
    expert_counts: Callable[[mx.array, int, bool], list[int] | None]
    # (q [B, H, T, D], k [B, Hkv, K, D], v [B, Hkv, K, Dv], bool mask broadcastable to [B, 1, T, K] | None)
    attention: Callable[[mx.array, mx.array, mx.array, mx.array | None], mx.array]


# --- MLX (Metal, CUDA) -------------------------------------------------------------------------


def _mlx_softcap(logits: mx.array, cap: float) -> mx.array:
    return cap * mx.tanh(logits / cap)


def _mlx_softmax(logits: mx.array) -> mx.array:
    return mx.softmax(logits, axis=-1, precise=True)


@mx.compile
def _mlx_tempered_distribution(logits: mx.array, temperature: mx.array):
    scaled = logits / temperature
    log_probs = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
    probs = mx.exp(log_probs)
    # The reference's Categorical.entropy clamps log-probabilities so that p = 0 adds 0, not nan.
    entropy = -(probs * mx.maximum(log_probs, _FLOAT32_MIN)).sum(axis=-1)
    return scaled, probs, entropy, mx.argmax(scaled, axis=-1).astype(mx.int32)


def _gather_always(sorted_idx: mx.array, num_experts: int, gather_ok: bool) -> None:
    return None


def _mlx_attention(q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None) -> mx.array:
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=mask)


MLX = Kernels("mlx", _mlx_softcap, _mlx_softmax, _mlx_tempered_distribution, _gather_always, _mlx_attention)


# --- CPU -----------------------------------------------------------------------------------------


def _host(a: mx.array) -> np.ndarray:
    mx.eval(a)
    return np.asarray(a)


def _cpu_softcap(logits: mx.array, cap: float) -> mx.array:
    out = np.divide(_host(logits.astype(mx.float32)), np.float32(cap), dtype=np.float32)
    np.tanh(out, out=out)
    out *= np.float32(cap)
    return mx.array(out)


def _cpu_softmax(logits: mx.array) -> mx.array:
    a = _host(logits.astype(mx.float32))
    out = np.exp(a - a.max(axis=-1, keepdims=True))
    out /= out.sum(axis=-1, keepdims=True)
    return mx.array(out)


def _cpu_tempered_distribution(logits: mx.array, temperature: mx.array):
    scaled = np.divide(_host(logits), np.float32(temperature.item()), dtype=np.float32)
    shifted = scaled - scaled.max(axis=-1, keepdims=True)
    probs = np.exp(shifted)
    total = probs.sum(axis=-1, keepdims=True)
    probs /= total
    shifted -= np.log(total)  # now the log-probabilities, finite everywhere
    entropy = -np.einsum("...v,...v->...", probs, shifted)
    argmax = scaled.argmax(axis=-1).astype(np.int32)
    return mx.array(scaled), mx.array(probs), mx.array(entropy.astype(np.float32)), mx.array(argmax)


def _cpu_expert_counts(sorted_idx: mx.array, num_experts: int, gather_ok: bool) -> list[int] | None:
    if gather_ok and sorted_idx.size < SEGMENT_MIN_ROWS * num_experts:
        return None
    return np.bincount(_host(sorted_idx), minlength=num_experts).tolist()


# Keys from which the numpy softmax beats MLX's fused attention on the CPU (2 cores: 1.0x at 320
# keys, 2.4x at 1279, 1.8x at 8448; benchmarks/attention_cpu.py).
NUMPY_SOFTMAX_MIN_KEYS = 512


def _cpu_attention(q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None) -> mx.array:
    B, H, T, D = q.shape
    Hkv, K = k.shape[1], k.shape[2]
    if K < NUMPY_SOFTMAX_MIN_KEYS:
        return _mlx_attention(q, k, v, mask)
    group = H // Hkv  # query heads per key head: one product per key head
    scores = _host(q.reshape(B, Hkv, group * T, D) @ k.swapaxes(-1, -2)).reshape(B, Hkv, group, T, K)
    if mask is not None:
        scores = np.where(_host(mask)[:, :, None], scores, -np.inf)  # [B|1, 1, 1, T, K]
    probs = scores - scores.max(axis=-1, keepdims=True)
    np.exp(probs, out=probs)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = mx.array(probs.reshape(B, Hkv, group * T, K)) @ v
    return out.reshape(B, H, T, v.shape[-1])


CPU = Kernels("cpu", _cpu_softcap, _cpu_softmax, _cpu_tempered_distribution, _cpu_expert_counts, _cpu_attention)


def differentiable(kernels: Kernels) -> Kernels:
    """``kernels`` with every path through numpy (which has no gradient) replaced by plain MLX, for
    training; the expert dispatch stays, its per-expert products are MLX operations."""
    return replace(kernels, name=f"{kernels.name} (differentiable)", softcap=_mlx_softcap, softmax=_mlx_softmax,
                   tempered_distribution=_mlx_tempered_distribution, attention=_mlx_attention)


def for_device(device: mx.Device | None = None) -> Kernels:
    """The kernels for ``device`` (default: MLX's default device)."""
    return CPU if (device or mx.default_device()) == mx.cpu else MLX
