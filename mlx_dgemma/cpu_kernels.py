"""Vocabulary-wide element-wise math in numpy when MLX runs on the CPU.

MLX's CPU backend evaluates transcendentals one element at a time: on a 256 × 32000 fp32 array
`mx.exp` and `mx.tanh` took ≈ 220 ms where numpy's vectorized ones took ≈ 10 ms (same machine, same
run). A denoising step applies them to the whole [C, V] logits three times (soft-cap, tempered
softmax, self-conditioning softmax), so on the CPU those passes run here; on Metal and CUDA MLX
keeps them.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def _host(a: mx.array) -> np.ndarray:
    mx.eval(a)
    return np.asarray(a)


def softcap(logits: mx.array, cap: float) -> mx.array:
    """``cap · tanh(logits / cap)`` in float32."""
    out = np.divide(_host(logits.astype(mx.float32)), np.float32(cap), dtype=np.float32)
    np.tanh(out, out=out)
    out *= np.float32(cap)
    return mx.array(out)


def tempered_distribution(logits: mx.array, temperature: mx.array):
    """Tempered logits, probabilities, entropy (nats) and argmax, as sampler.tempered_distribution."""
    scaled = np.divide(_host(logits), np.float32(temperature.item()), dtype=np.float32)
    shifted = scaled - scaled.max(axis=-1, keepdims=True)
    probs = np.exp(shifted)
    total = probs.sum(axis=-1, keepdims=True)
    probs /= total
    shifted -= np.log(total)  # now the log-probabilities, finite everywhere
    entropy = -np.einsum("...v,...v->...", probs, shifted)
    argmax = scaled.argmax(axis=-1).astype(np.int32)
    return mx.array(scaled), mx.array(probs), mx.array(entropy.astype(np.float32)), mx.array(argmax)


def softmax(logits: mx.array) -> mx.array:
    a = _host(logits.astype(mx.float32))
    out = np.exp(a - a.max(axis=-1, keepdims=True))
    out /= out.sum(axis=-1, keepdims=True)
    return mx.array(out)
