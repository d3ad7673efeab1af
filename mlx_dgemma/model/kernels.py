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
- attention computes its softmax in numpy between two BLAS products, where MLX's fused attention
  spends most of its time in exp: 3-4x faster for a 256-position canvas after 64-576 keys,
  1.5x for a 2048-token prefill chunk (benchmarks/attention_cpu.py);
- the feed-forward's tanh-approximated GELU runs in numpy (MLX: 7.1 ms over 256 × 1024, numpy
  0.25 ms), with MLX's own gradient, so training through it is unchanged;
- quantized products (linears, the experts a forward routes to, the tied head) dequantize their
  weights in bounded chunks and multiply in float32 by BLAS, where MLX's CPU quantized kernels run at
  a few GFLOP/s (benchmarks/quantized_cpu.py), except for a few rows (an AR token);
- matmuls use OpenBLAS when it is installed (``fast_blas.py``: loaded before ``mlx.core``).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..cpu_threads import free_cores

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
    # the tanh approximation (gelu_pytorch_tanh); (x, elements of one row of the batch, by which the path
    # is chosen so that a row computes the same numbers in a batch as alone; default x.size)
    gelu: Callable[..., mx.array]
    # mx.quantized_matmul's arguments: (x, w, scales, biases, transpose, group_size, bits, mode)
    quantized_matmul: Callable[..., mx.array]


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


def _mlx_gelu(x: mx.array, elements: int | None = None) -> mx.array:
    return nn.gelu_approx(x)


def _mlx_quantized_matmul(x, w, scales, biases, transpose, group_size, bits, mode) -> mx.array:
    return mx.quantized_matmul(x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits, mode=mode)


MLX = Kernels(
    "mlx",
    _mlx_softcap,
    _mlx_softmax,
    _mlx_tempered_distribution,
    _gather_always,
    _mlx_attention,
    _mlx_gelu,
    _mlx_quantized_matmul,
)


# --- CPU -----------------------------------------------------------------------------------------


def _host(a: mx.array) -> np.ndarray:
    mx.eval(a)
    return np.asarray(a)


def _filled_by_numpy(shape: tuple[int, ...], dtype=mx.float32) -> tuple[mx.array, np.ndarray]:
    """A new MLX array and a numpy view of its buffer to write it through: results written there need
    no copy into MLX (``mx.array(ndarray)`` copies, ~40 ms per 70 MB here)."""
    out = mx.zeros(shape, dtype)
    return out, _host(out)


def _rows(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1, a.shape[-1])


def _cpu_softcap(logits: mx.array, cap: float) -> mx.array:
    x = _rows(_host(logits.astype(mx.float32)))
    out, view = _filled_by_numpy(logits.shape)
    y, cap = _rows(view), np.float32(cap)

    def work(a: int, b: int) -> None:
        np.divide(x[a:b], cap, out=y[a:b])
        np.tanh(y[a:b], out=y[a:b])
        y[a:b] *= cap

    _in_parallel(work, x.shape[0], x.size)
    return out


def _cpu_softmax(logits: mx.array) -> mx.array:
    x = _rows(_host(logits.astype(mx.float32)))
    out, view = _filled_by_numpy(logits.shape)
    y = _rows(view)

    def work(a: int, b: int) -> None:
        np.subtract(x[a:b], x[a:b].max(axis=-1, keepdims=True), out=y[a:b])
        np.exp(y[a:b], out=y[a:b])
        y[a:b] /= y[a:b].sum(axis=-1, keepdims=True)

    _in_parallel(work, x.shape[0], x.size)
    return out


def _cpu_tempered_distribution(logits: mx.array, temperature: mx.array):
    # temperature: a scalar, or one per row broadcastable against logits ([B, 1, 1])
    x = _rows(_host(logits))
    t = np.broadcast_to(_host(temperature.astype(mx.float32)), logits.shape[:-1] + (1,)).reshape(-1, 1)
    scaled_mx, scaled_view = _filled_by_numpy(logits.shape)
    probs_mx, probs_view = _filled_by_numpy(logits.shape)
    scaled, probs = _rows(scaled_view), _rows(probs_view)
    entropy = np.empty(x.shape[0], dtype=np.float32)
    argmax = np.empty(x.shape[0], dtype=np.int32)

    def work(a: int, b: int) -> None:
        np.divide(x[a:b], t[a:b], out=scaled[a:b])
        shifted = scaled[a:b] - scaled[a:b].max(axis=-1, keepdims=True)
        np.exp(shifted, out=probs[a:b])
        total = probs[a:b].sum(axis=-1, keepdims=True)
        probs[a:b] /= total
        shifted -= np.log(total)  # now the log-probabilities, finite everywhere
        entropy[a:b] = -np.einsum("rv,rv->r", probs[a:b], shifted)
        argmax[a:b] = scaled[a:b].argmax(axis=-1)

    _in_parallel(work, x.shape[0], x.size)
    rows = logits.shape[:-1]
    return scaled_mx, probs_mx, mx.array(entropy.reshape(rows)), mx.array(argmax.reshape(rows))


def _cpu_expert_counts(sorted_idx: mx.array, num_experts: int, gather_ok: bool) -> list[int] | None:
    if gather_ok and sorted_idx.size < SEGMENT_MIN_ROWS * num_experts:
        return None
    return np.bincount(_host(sorted_idx), minlength=num_experts).tolist()


def _numpy_softmax_attention(q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None) -> mx.array:
    B, H, T, D = q.shape
    Hkv, K = k.shape[1], k.shape[2]
    group = H // Hkv  # query heads per key head: one product per key head
    scores = (q.reshape(B, Hkv, group * T, D) @ k.swapaxes(-1, -2)).astype(mx.float32)
    # The softmax is computed in place in the scores' own buffer (a fresh array no one else holds),
    # which then goes on to the product with V: the B·H·T·K floats are never copied (at 8448 keys a
    # copy back into MLX cost as much as the softmax).
    view = _host(scores).reshape(B, Hkv, group, T, K)
    # The mask as an additive bias at its own size, broadcast in place over the heads.
    bias = None if mask is None else np.where(_host(mask), np.float32(0), np.float32(-np.inf))[:, :, None]
    per_query = bias is not None and bias.shape[-2] != 1  # (a mask of one row for every query is shared whole)
    _in_parallel(
        lambda a, b: _softmax_in_place(view[..., a:b, :], bias[..., a:b, :] if per_query else bias), T, view.size
    )
    out = scores.astype(v.dtype) @ v
    return out.reshape(B, H, T, v.shape[-1])


def _softmax_in_place(scores: np.ndarray, bias: np.ndarray | None) -> None:
    if bias is not None:
        scores += bias
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)


# Elements from which numpy's vocabulary- or key-wide passes are split over the free cores (numpy
# runs one thread; the BLAS products around them already use them: cpu_threads.py).
PARALLEL_MIN_ELEMENTS = 1 << 20
_pool: ThreadPoolExecutor | None = None


def _in_parallel(work: Callable[[int, int], None], rows: int, elements: int) -> None:
    """``work(start, stop)`` over ``rows`` rows, split among the cores when ``elements`` is large (each
    row is computed as it would be alone, so the split changes no number)."""
    global _pool
    workers = min(free_cores(), rows) if elements >= PARALLEL_MIN_ELEMENTS else 1
    if workers == 1:
        work(0, rows)
        return
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=os.cpu_count(), thread_name_prefix="mlx_dgemma-numpy")
    bounds = [rows * i // workers for i in range(workers + 1)]
    for future in [_pool.submit(work, a, b) for a, b in zip(bounds[:-1], bounds[1:])]:
        future.result()


# The numpy paths leave MLX's graph; their gradients are MLX's own (training runs through them).
@mx.custom_function
def _attention_unmasked(q, k, v):
    return _numpy_softmax_attention(q, k, v, None)


@_attention_unmasked.vjp
def _attention_unmasked_vjp(primals, cotangent, output):
    return mx.vjp(lambda q, k, v: _mlx_attention(q, k, v, None), list(primals), [cotangent])[1]


@mx.custom_function
def _attention_masked(q, k, v, mask):
    return _numpy_softmax_attention(q, k, v, mask)


@_attention_masked.vjp
def _attention_masked_vjp(primals, cotangent, output):
    q, k, v, mask = primals
    grads = mx.vjp(lambda q, k, v: _mlx_attention(q, k, v, mask), [q, k, v], [cotangent])[1]
    return grads + [mx.zeros_like(mask)]


# Sizes from which leaving MLX's graph for numpy pays: below them (an AR token, a short draft) the
# host round trip costs more than MLX's slow transcendentals (benchmarks/attention_cpu.py).
NUMPY_ATTENTION_MIN_SCORES = 32768  # B · heads · queries · keys (rows stacked pay for the host trip together)
NUMPY_GELU_MIN_ELEMENTS = 4096  # of one row; numpy and MLX cost the same at ~6000 (a GELU between two matmuls)


def _cpu_attention(q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None) -> mx.array:
    if q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] < NUMPY_ATTENTION_MIN_SCORES:
        return _mlx_attention(q, k, v, mask)
    return _attention_unmasked(q, k, v) if mask is None else _attention_masked(q, k, v, mask)


_GELU_C = np.float32(math.sqrt(2 / math.pi))


def _cpu_gelu(x: mx.array, elements: int | None = None) -> mx.array:
    return (
        _numpy_gelu(x) if (x.size if elements is None else elements) >= NUMPY_GELU_MIN_ELEMENTS else nn.gelu_approx(x)
    )


@mx.custom_function
def _numpy_gelu(x: mx.array) -> mx.array:
    a = _host(x.astype(mx.float32))
    out = a * a
    out *= np.float32(0.044715)
    out += np.float32(1)
    out *= a
    out *= _GELU_C  # sqrt(2/pi) (x + 0.044715 x^3)
    np.tanh(out, out=out)
    out += np.float32(1)
    out *= a
    out *= np.float32(0.5)
    return mx.array(out).astype(x.dtype)


@_numpy_gelu.vjp
def _numpy_gelu_vjp(x, cotangent, output):  # one input: the array itself, not a tuple
    return mx.vjp(nn.gelu_approx, [x], [cotangent])[1][0]


# Rows from which dequantizing a weight and multiplying in float32 by BLAS beats MLX's CPU quantized
# product (measured on 2 cores, 2816 x 4096 at 4 bits: 0.6x its time at 1 row, 2.6x at 8, 4.4x at 256 with the
# reference BLAS, and the gap grows with OpenBLAS); weights are dequantized in chunks of at most this many
# elements (64 MB of float32), so a vocabulary-wide head never holds its whole float32 copy.
QUANTIZED_MIN_ROWS = 4
DEQUANTIZED_CHUNK_ELEMENTS = 1 << 24
# Rows of a weight dequantized at a time by one core: their float32 (≈ 512 KB) stays in its cache
# between the unpacking, the scaling and the offset.
DEQUANTIZED_TILE_ELEMENTS = 1 << 17

# Affine 2- and 4-bit weights are unpacked a byte at a time through a table: byte value -> its values,
# lowest bits first (MLX's packing); 8-bit bytes are the values themselves.
_BYTE_VALUES = {
    bits: np.array(
        [[(byte >> (bits * i)) & ((1 << bits) - 1) for i in range(8 // bits)] for byte in range(256)], dtype=np.float32
    )
    for bits in (2, 4)
}
NUMPY_DEQUANTIZED_BITS = (2, 4, 8)


def _cpu_quantized_matmul(x, w, scales, biases, transpose, group_size, bits, mode) -> mx.array:
    if math.prod(x.shape[:-1]) < QUANTIZED_MIN_ROWS:
        # MLX's CPU kernel runs ~10x faster on float32 activations than on bfloat16 ones
        out = _mlx_quantized_matmul(x.astype(mx.float32), w, scales, biases, transpose, group_size, bits, mode)
        return out.astype(x.dtype)
    per_row = w.shape[-1] * 32 // bits  # the dequantized row's width
    step = max(1, DEQUANTIZED_CHUNK_ELEMENTS // per_row)
    xf = x.astype(mx.float32)
    parts = []
    for a in range(0, w.shape[0], step):
        b = min(a + step, w.shape[0])
        chunk_biases = None if biases is None else biases[a:b]
        with _dequantized(w[a:b], scales[a:b], chunk_biases, group_size, bits, mode) as weight:
            # transpose: w is [out, in] and a chunk gives some outputs; otherwise [in, out] and a partial sum
            part = xf @ weight.T if transpose else xf[..., a:b] @ weight
            mx.eval(part)  # before the chunk's float32 buffer is written again
        parts.append(part)
    out = mx.concatenate(parts, axis=-1) if transpose else sum(parts[1:], parts[0])
    return out.astype(x.dtype)


class _Scratch(threading.local):
    """One float32 buffer per thread that every dequantized chunk is written into: no allocation, and
    no zero-fill, per expert and per chunk of the head."""

    buffer: mx.array | None = None
    view: np.ndarray | None = None
    busy: bool = False


_scratch = _Scratch()


@contextmanager
def _dequantized(w, scales, biases, group_size: int, bits: int, mode: str):
    """The float32 weights [rows, in] of one chunk, valid inside the ``with`` block: written by numpy
    into the thread's scratch buffer where the format allows (affine, 2/4/8 bits), else MLX's."""
    if mode != "affine" or biases is None or bits not in NUMPY_DEQUANTIZED_BITS or _scratch.busy:
        yield mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, mode=mode).astype(mx.float32)
        return
    rows, width = w.shape[0], w.shape[1] * 32 // bits
    if _scratch.buffer is None or _scratch.buffer.size < rows * width:
        _scratch.buffer, _scratch.view = _filled_by_numpy((max(rows * width, DEQUANTIZED_CHUNK_ELEMENTS),))
    out = _scratch.view[: rows * width].reshape(rows, width)
    _dequantize_into(
        out,
        _host(w).view(np.uint8),
        _host(scales.astype(mx.float32)),
        _host(biases.astype(mx.float32)),
        group_size,
        bits,
    )
    _scratch.busy = True
    try:
        yield _scratch.buffer[: rows * width].reshape(rows, width)
    finally:
        _scratch.busy = False


def _dequantize_into(
    out: np.ndarray, packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, group_size: int, bits: int
) -> None:
    """``out`` [rows, in] = scales · values + biases per group, from ``packed`` bytes [rows, in · bits / 8],
    tile by tile, the rows split among the cores."""
    rows = out.shape[0]
    tile = max(1, DEQUANTIZED_TILE_ELEMENTS // out.shape[1])

    def work(a: int, b: int) -> None:
        for i in range(a, b, tile):
            j = min(b, i + tile)
            block = out[i:j]
            if bits == 8:
                np.copyto(block, packed[i:j], casting="unsafe")
            else:
                np.take(_BYTE_VALUES[bits], packed[i:j], axis=0, out=block.reshape(j - i, -1, 8 // bits))
            groups = block.reshape(j - i, -1, group_size)
            groups *= scales[i:j, :, None]
            groups += biases[i:j, :, None]

    _in_parallel(work, rows, out.size)


CPU = Kernels(
    "cpu",
    _cpu_softcap,
    _cpu_softmax,
    _cpu_tempered_distribution,
    _cpu_expert_counts,
    _cpu_attention,
    _cpu_gelu,
    _cpu_quantized_matmul,
)


def differentiable(kernels: Kernels) -> Kernels:
    """``kernels`` for training: plain MLX wherever a numpy path has no gradient of its own (and for
    attention, whose numpy forward would be recomputed in MLX by its gradient anyway); the GELU keeps
    its numpy forward and MLX gradient, and the expert dispatch stays (its products are MLX's)."""
    return replace(
        kernels,
        name=f"{kernels.name} (differentiable)",
        softcap=_mlx_softcap,
        softmax=_mlx_softmax,
        tempered_distribution=_mlx_tempered_distribution,
        attention=_mlx_attention,
    )


def for_device(device: mx.Device | None = None) -> Kernels:
    """The kernels for ``device`` (default: MLX's default device)."""
    return CPU if (device or mx.default_device()) == mx.cpu else MLX
