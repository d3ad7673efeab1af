"""The DiffusionGemma text backbone in MLX: one set of layer weights shared by a causal encoder and a
bidirectional denoiser, a KV cache the encoder appends to and the denoiser only reads, the
self-conditioning block and the tied, soft-capped head.

Module paths mirror the Hugging Face checkpoint (``model.decoder.layers.N...``) so that weights load
by name and mlx-lm style per-module quantization overrides apply as written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from . import cpu_kernels
from .config import ModelConfig


def rms_norm_noscale(x: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, None, eps)


class RMSNorm(nn.Module):
    """RMSNorm with a plain multiplicative weight (``x̂ · w``, not Gemma-3's ``x̂ · (1 + w)``)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight, self.eps)


def rope_periods(head_dim: int, params: dict) -> mx.array:
    """Per-pair rotation periods for ``mx.fast.rope``; unrotated pairs get an infinite period.

    "proportional" (full layers) rotates only the first ``partial_rotary_factor · head_dim / 2`` pairs,
    but with frequencies whose denominator is the *full* head_dim, as the reference does.
    """
    theta = float(params.get("rope_theta", 10000.0))
    half = head_dim // 2
    rotated = half
    if params.get("rope_type", "default") == "proportional":
        rotated = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    i = mx.arange(half, dtype=mx.float32)
    periods = mx.power(theta, 2.0 * i / head_dim)
    return mx.where(i < rotated, periods, mx.array(math.inf, dtype=mx.float32))


@dataclass
class LayerCache:
    """Prefix K/V of one layer, [1, kv_heads, T, head_dim]; sliding layers show the last ``window − 1``.

    Stand-in trim until cache.py lands: a sliding layer stores up to ``history`` positions more than
    it shows, so that ``trim(n)`` for n ≤ history is exact (verified drafting trims rejected drafts)."""

    window: int | None
    history: int = 0
    stored_keys: mx.array | None = None
    stored_values: mx.array | None = None

    def _visible(self, stored: mx.array | None) -> mx.array | None:
        if stored is None or self.window is None or stored.shape[2] <= self.window - 1:
            return stored
        return stored[:, :, -(self.window - 1):]

    @property
    def keys(self) -> mx.array | None:
        return self._visible(self.stored_keys)

    @property
    def values(self) -> mx.array | None:
        return self._visible(self.stored_values)

    def append(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store new K/V and return everything the new positions may attend to (visible old ⊕ new)."""
        shown, new_positions = self.length, keys.shape[2]
        if self.stored_keys is not None:
            keys = mx.concatenate([self.stored_keys, keys], axis=2)
            values = mx.concatenate([self.stored_values, values], axis=2)
        total = keys.shape[2]
        keep = total if self.window is None else min(total, self.window - 1 + self.history)
        self.stored_keys, self.stored_values = keys[:, :, -keep:], values[:, :, -keep:]
        first = 0 if self.window is None else total - shown - new_positions
        return keys[:, :, first:], values[:, :, first:]

    def trim(self, n: int) -> None:
        """Drop the last ``n`` positions."""
        if n <= 0:
            return
        if n > (0 if self.stored_keys is None else self.stored_keys.shape[2]) or (
                self.window is not None and n > self.history):
            raise ValueError(f"cannot trim {n} positions from a sliding layer that keeps {self.history} extra")
        self.stored_keys, self.stored_values = self.stored_keys[:, :, :-n], self.stored_values[:, :, :-n]

    @property
    def length(self) -> int:
        keys = self.keys
        return 0 if keys is None else keys.shape[2]


@dataclass
class FrozenCanvas:
    """Canvas positions the sampler no longer recomputes (active-set compaction, the fast policy):
    per layer, the K/V they had when last computed, which the positions still being denoised keep
    attending to. ``last`` holds the latest ``denoise`` call's K/V of the positions it computed."""

    keys: list[mx.array | None]
    values: list[mx.array | None]
    last: list[tuple[mx.array, mx.array] | None]

    @classmethod
    def empty(cls, layers: int) -> "FrozenCanvas":
        return cls([None] * layers, [None] * layers, [None] * layers)

    def freeze(self, rows: mx.array) -> None:
        """Keep the K/V of ``rows`` (indexes into the latest call's computed positions) for good."""
        for i, (k, v) in enumerate(self.last):
            k, v = k[:, :, rows], v[:, :, rows]
            if self.keys[i] is not None:
                k = mx.concatenate([self.keys[i], k], axis=2)
                v = mx.concatenate([self.values[i], v], axis=2)
            self.keys[i], self.values[i] = k, v


@dataclass
class KVCache:
    """The encoder's cache: one ``LayerCache`` per layer and the number of positions encoded."""

    layers: list[LayerCache]
    offset: int = 0

    def state(self) -> list[mx.array]:
        return [a for c in self.layers if c.stored_keys is not None for a in (c.stored_keys, c.stored_values)]

    def trim(self, n: int) -> None:
        """Forget the last ``n`` encoded positions (stand-in until cache.py lands): exact for ``n`` up
        to the sliding layers' extra history (one canvas, see ``DiffusionGemma.make_cache``)."""
        if not 0 <= n <= self.offset:
            raise ValueError(f"cannot trim {n} positions from a cache of {self.offset}")
        for layer in self.layers:
            layer.trim(n)
        self.offset -= n


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.sliding = cfg.is_sliding(layer)
        self.head_dim = d = cfg.layer_head_dim(layer)
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.layer_kv_heads(layer)
        self.eps = cfg.rms_norm_eps
        hidden = cfg.hidden_size
        self.q_proj = nn.Linear(hidden, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(hidden, self.n_kv_heads * d, bias=False)
        if self.sliding:  # full layers have K = V and no v_proj
            self.v_proj = nn.Linear(hidden, self.n_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, hidden, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        kind = "sliding_attention" if self.sliding else "full_attention"
        self._periods = rope_periods(d, cfg.rope_parameters[kind])

    def _rope(self, x: mx.array, offset: int | mx.array) -> mx.array:
        if isinstance(offset, int):
            return mx.fast.rope(
                x, self.head_dim, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._periods
            )
        # Positions that are not a run (a compacted canvas): the same rotation, spelled out.
        angles = offset.astype(mx.float32)[:, None] / self._periods[None, :]
        cos, sin = mx.cos(angles).astype(x.dtype), mx.sin(angles).astype(x.dtype)
        half = self.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)

    def project(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Queries, keys and values as [B, heads, T, head_dim], normed and rotated; ``offset`` is the
        first position, or an array of T positions."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, T, self.n_heads, self.head_dim))
        k_raw = self.k_proj(x).reshape(B, T, self.n_kv_heads, self.head_dim)
        v_raw = self.v_proj(x).reshape(B, T, self.n_kv_heads, self.head_dim) if self.sliding else k_raw
        q = self._rope(q.transpose(0, 2, 1, 3), offset)
        k = self._rope(self.k_norm(k_raw).transpose(0, 2, 1, 3), offset)
        v = rms_norm_noscale(v_raw, self.eps).transpose(0, 2, 1, 3)
        return q, k, v

    def attend(self, q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None) -> mx.array:
        B, _, T, _ = q.shape
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, dims: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dims, hidden, bias=False)
        self.up_proj = nn.Linear(dims, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dims, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = mx.ones((cfg.hidden_size,))
        self.per_expert_scale = mx.ones((cfg.num_experts,))
        self.top_k = cfg.top_k_experts
        self.eps = cfg.rms_norm_eps
        self._root = cfg.hidden_size**-0.5

    def __call__(self, r: mx.array) -> tuple[mx.array, mx.array]:
        z = rms_norm_noscale(r, self.eps) * self.scale * self._root
        probs = mx.softmax(self.proj(z).astype(mx.float32), axis=-1, precise=True)
        idx = mx.argpartition(-probs, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        weights = mx.take_along_axis(probs, idx, axis=-1)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        return idx, weights * self.per_expert_scale[idx]


class ExpertLinear(nn.Module):
    """One linear map per expert, weight [E, out, in]; tokens arrive sorted by expert."""

    def __init__(self, inputs: int, outputs: int, experts: int):
        super().__init__()
        self.weight = mx.zeros((experts, outputs, inputs))

    def __call__(self, x: mx.array, idx: mx.array) -> mx.array:
        """x [N, 1, in] through expert ``idx[n]`` each, with gather_mm (fast on Metal/CUDA)."""
        return mx.gather_mm(x, self.weight.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=True)

    def segments(self, x: mx.array, counts: list[int]) -> mx.array:
        """x [N, in] in runs of ``counts[e]`` rows for expert e: one BLAS product per expert."""
        w = self.weight
        if w.dtype != mx.float32:  # MLX's CPU matmuls are fast in float32 only
            x, w = x.astype(mx.float32), w.astype(mx.float32)
        return _per_segment(x, counts, lambda rows, e: rows @ w[e].T)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_) -> "QuantizedExpertLinear":
        return QuantizedExpertLinear(*mx.quantize(self.weight, group_size, bits, mode=mode), group_size=group_size,
                                     bits=bits, mode=mode)


class QuantizedExpertLinear(nn.Module):
    def __init__(self, weight, scales, biases=None, *, group_size: int, bits: int, mode: str):
        super().__init__()
        self.weight, self.scales = weight, scales
        if biases is not None:
            self.biases = biases
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.freeze()

    def __call__(self, x: mx.array, idx: mx.array) -> mx.array:
        return mx.gather_qmm(x, self.weight, self.scales, self.get("biases"), rhs_indices=idx, transpose=True,
                             group_size=self.group_size, bits=self.bits, mode=self.mode, sorted_indices=True)

    def segments(self, x: mx.array, counts: list[int]) -> mx.array:
        biases = self.get("biases")

        def product(rows, e):
            return mx.quantized_matmul(rows, self.weight[e], self.scales[e], None if biases is None else biases[e],
                                       transpose=True, group_size=self.group_size, bits=self.bits, mode=self.mode)

        return _per_segment(x, counts, product)


def _per_segment(x: mx.array, counts: list[int], product) -> mx.array:
    outputs, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            outputs.append(product(x[start : start + count], expert))
        start += count
    return mx.concatenate(outputs)


# Rows per expert (on average) from which per-expert BLAS beats gather_mm on the CPU. Measured on 2
# cores (benchmarks/expert_dispatch.py): gather 0.85x the time at 0.2-1 rows (an AR token), 0.95x at
# 2, 1.1x at 4, 1.4-1.9x from 8.
SEGMENT_MIN_ROWS = 1


class Experts(nn.Module):
    """``num_experts`` GeGLU FFNs; fused ``gate_up_proj`` [E, 2I, H] (gate rows first), ``down_proj`` [E, H, I]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = ExpertLinear(cfg.hidden_size, 2 * cfg.moe_intermediate_size, cfg.num_experts)
        self.down_proj = ExpertLinear(cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts)
        self.inner = cfg.moe_intermediate_size
        self.num_experts = cfg.num_experts

    def _per_expert_products(self, rows: int) -> bool:
        """On the CPU, one BLAS product per expert, unless experts get few rows each (a short
        canvas, a single AR token) and gather_mm's row-by-row products, without the host sync,
        cost less; gather_mm on the CPU takes float32 weights only."""
        if not cpu_kernels.on_cpu():
            return False
        weight = self.gate_up_proj.weight
        few = rows < SEGMENT_MIN_ROWS * self.num_experts
        return not (few and isinstance(self.gate_up_proj, ExpertLinear) and weight.dtype == mx.float32)

    def __call__(self, x: mx.array, idx: mx.array, weights: mx.array) -> mx.array:
        shape, k = x.shape, idx.shape[-1]
        x = x.reshape(-1, shape[-1])
        flat = idx.reshape(-1)
        # Token copies sorted by expert, so that each expert's weights are walked once.
        order = mx.argsort(flat)
        sorted_idx = flat[order]
        xs = x[order // k]
        if self._per_expert_products(xs.shape[0]):
            # MLX's CPU gather_mm multiplies row by row (and only in float32); one BLAS product per
            # expert is ~4x faster. It needs the per-expert counts on the host: one sync per layer,
            # which costs nothing on the CPU, where there is no device queue to drain.
            counts = np.bincount(np.array(sorted_idx), minlength=self.num_experts).tolist()
            gate_up = self.gate_up_proj.segments(xs, counts)
            h = nn.gelu_approx(gate_up[..., : self.inner]) * gate_up[..., self.inner :]
            y = self.down_proj.segments(h, counts).astype(x.dtype)
        else:
            gate_up = self.gate_up_proj(xs[:, None, :], sorted_idx)
            h = nn.gelu_approx(gate_up[..., : self.inner]) * gate_up[..., self.inner :]
            y = self.down_proj(h, sorted_idx)[:, 0]
        y = y[mx.argsort(order)].reshape(-1, k, shape[-1])
        out = (y.astype(mx.float32) * weights.reshape(-1, k, 1)).sum(axis=1)
        return out.astype(x.dtype).reshape(shape)


class Layer(nn.Module):
    """One transformer layer; the encoder and the denoiser run the same weights with their own scalars."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        dims, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(dims, cfg.intermediate_size)
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "post_feedforward_layernorm_1",
            "pre_feedforward_layernorm_2",
            "post_feedforward_layernorm_2",
        ):
            setattr(self, name, RMSNorm(dims, eps))
        self.layer_scalar = mx.ones((1,))  # the denoiser's; the encoder's live in EncoderScalars

    def feed_forward(self, r: mx.array) -> mx.array:
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(r)))
        idx, weights = self.router(r)  # the router reads the un-normed residual
        moe = self.post_feedforward_layernorm_2(self.experts(self.pre_feedforward_layernorm_2(r), idx, weights))
        return r + self.post_feedforward_layernorm(dense + moe)


class SelfConditioning(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.eps = cfg.rms_norm_eps

    def __call__(self, embeds: mx.array, signal: mx.array | None) -> mx.array:
        if signal is not None:  # a zero signal gives a zero MLP output, so step 1 skips it
            n = self.pre_norm(signal)
            embeds = embeds + self.down_proj(nn.gelu_approx(self.gate_proj(n)) * self.up_proj(n))
        return rms_norm_noscale(embeds, self.eps)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [Layer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_conditioning = SelfConditioning(cfg)


class LayerScalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_scalar = mx.ones((1,))


class EncoderLanguageModel(nn.Module):
    """The encoder's own weights: only its per-layer scalars (everything else is the decoder's)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layers = [LayerScalar() for _ in range(cfg.num_hidden_layers)]


class EncoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.language_model = EncoderLanguageModel(cfg)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.decoder = DecoderModel(cfg)
        self.encoder = EncoderModel(cfg)


def _embedding_dtype(embed: nn.Module, activations: mx.Dtype) -> mx.Dtype:
    """The dtype the embedding computes in: its weights', or for a quantized one its scales' when
    those are floats (affine); microscaling modes keep uint8 scales, so use the activations' dtype."""
    if not isinstance(embed, nn.QuantizedEmbedding):
        return embed.weight.dtype
    return embed.scales.dtype if mx.issubdtype(embed.scales.dtype, mx.floating) else activations


def _soft_embed(embed: nn.Module, probs: mx.array) -> mx.array:
    """``probs [.., V] @ E [V, H]``: the expected embedding under a distribution over the vocabulary."""
    if isinstance(embed, nn.QuantizedEmbedding):
        return mx.quantized_matmul(
            probs, embed.weight, embed.scales, embed.get("biases"), transpose=False,
            group_size=embed.group_size, bits=embed.bits, mode=embed.mode,
        )
    return probs @ embed.weight


class DiffusionGemma(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)

    @property
    def layers(self) -> list[Layer]:
        return self.model.decoder.layers

    def make_cache(self) -> KVCache:
        cfg = self.config
        # Sliding layers keep one canvas of history beyond their window, so that a trim of up to a
        # canvas (a rejected draft) leaves exactly the window.
        return KVCache([LayerCache(cfg.sliding_window, cfg.canvas_length) if cfg.is_sliding(i) else LayerCache(None)
                        for i in range(len(self.layers))])

    def _embed(self, ids: mx.array) -> mx.array:
        embed = self.model.decoder.embed_tokens
        h = embed(ids)
        scale = mx.array(math.sqrt(self.config.hidden_size), dtype=_embedding_dtype(embed, h.dtype))
        return h * scale.astype(h.dtype)

    def _encoder_masks(self, length: int, cache: KVCache) -> dict[bool, mx.array | None]:
        """Causal masks for ``length`` new positions after the cache, keyed by ``sliding``."""
        masks = {}
        q_pos = mx.arange(cache.offset, cache.offset + length)[:, None]
        for layer, c in zip(self.layers, cache.layers):
            sliding = layer.self_attn.sliding
            if sliding in masks:
                continue
            k_pos = mx.arange(cache.offset - c.length, cache.offset + length)[None, :]
            allowed = k_pos <= q_pos
            if sliding:
                allowed = allowed & (k_pos > q_pos - self.config.sliding_window)
            masks[sliding] = allowed
        return masks

    def encode(self, ids: mx.array, cache: KVCache, return_hidden: bool = False) -> mx.array | None:
        """Run the causal encoder over ``ids`` [1, T] and append their K/V to ``cache``.

        With ``return_hidden`` it returns the final-normed hidden states [1, T, H] (next-token
        prediction through ``head``); otherwise the last layer's feed-forward, which only feeds
        those states, is skipped.
        """
        ids = mx.array(ids, dtype=mx.int32).reshape(1, -1)
        masks = self._encoder_masks(ids.shape[1], cache)
        scalars = self.model.encoder.language_model.layers
        h = self._embed(ids)
        last = len(self.layers) - 1
        for i, (layer, c) in enumerate(zip(self.layers, cache.layers)):
            attn = layer.self_attn
            q, k, v = attn.project(layer.input_layernorm(h), cache.offset)
            k, v = c.append(k, v)
            r = h + layer.post_attention_layernorm(attn.attend(q, k, v, masks[attn.sliding]))
            if i == last and not return_hidden:
                break
            h = layer.feed_forward(r) * scalars[i].layer_scalar
        cache.offset += ids.shape[1]
        mx.eval(cache.state())
        return self.model.decoder.norm(h) if return_hidden else None

    def next_token_logits(self, ids: mx.array, cache: KVCache) -> mx.array:
        """Autoregressive mode: encode ``ids`` [1, T] and return the next-token logits [1, V].

        The encoder is trained as a causal LM too, so its final-normed hidden state at the last
        position through the tied, soft-capped head predicts the next token.
        """
        return self.head(self.encode(ids, cache, return_hidden=True)[:, -1])

    def denoise(self, canvas: mx.array, cache: KVCache, self_conditioning: mx.array | None = None,
                self_conditioning_probs: mx.array | None = None, active: mx.array | None = None,
                frozen: FrozenCanvas | None = None) -> mx.array:
        """Logits [1, C, V] (float32, soft-capped) for a canvas [1, C]; the cache is only read.

        ``self_conditioning`` is the previous step's temperature-scaled logits [1, C, V] or None.
        A sampler that already has their softmax passes it as ``self_conditioning_probs`` to save a
        vocabulary-wide pass (used with float32 embeddings, where it is the same number).

        Active-set compaction (not the reference's computation): with ``active`` (sorted canvas
        indexes [A]) only those positions are computed, ``canvas`` and the self-conditioning inputs
        hold just their rows, and they attend to the prefix, to each other and to ``frozen``'s K/V;
        the logits are [1, A, V]. ``frozen.last`` receives the computed positions' K/V.
        """
        canvas = mx.array(canvas, dtype=mx.int32).reshape(1, -1)
        positions = cache.offset if active is None else cache.offset + active
        decoder = self.model.decoder
        h = self._embed(canvas)
        signal = None
        if self_conditioning is not None:
            dtype = _embedding_dtype(decoder.embed_tokens, h.dtype)
            if self_conditioning_probs is not None and dtype == mx.float32:
                probs = self_conditioning_probs
            else:
                # The reference keeps the previous step's logits in the embedding dtype before the softmax.
                logits = self_conditioning.astype(dtype).astype(mx.float32)
                probs = (cpu_kernels.softmax(logits) if cpu_kernels.on_cpu()
                         else mx.softmax(logits, axis=-1, precise=True)).astype(dtype)
            scale = mx.array(math.sqrt(self.config.hidden_size), dtype=dtype).astype(h.dtype)
            signal = (_soft_embed(decoder.embed_tokens, probs) * scale).astype(h.dtype)
        h = decoder.self_conditioning(h, signal)
        for i, (layer, c) in enumerate(zip(self.layers, cache.layers)):
            attn = layer.self_attn
            q, k, v = attn.project(layer.input_layernorm(h), positions)
            if frozen is not None:
                frozen.last[i] = (k, v)
                if frozen.keys[i] is not None:
                    k = mx.concatenate([frozen.keys[i], k], axis=2)
                    v = mx.concatenate([frozen.values[i], v], axis=2)
            if c.keys is not None:  # the canvas sees the cached prefix and itself, bidirectionally
                k = mx.concatenate([c.keys, k], axis=2)
                v = mx.concatenate([c.values, v], axis=2)
            r = h + layer.post_attention_layernorm(attn.attend(q, k, v, None))
            h = layer.feed_forward(r) * layer.layer_scalar
        return self.head(decoder.norm(h))

    def head(self, hidden: mx.array) -> mx.array:
        """Tied output head with the fp32 soft-cap."""
        embed = self.model.decoder.embed_tokens
        cap = self.config.final_logit_softcapping
        logits = embed.as_linear(hidden).astype(mx.float32)
        if cpu_kernels.on_cpu():
            return cpu_kernels.softcap(logits, cap)
        return cap * mx.tanh(logits / cap)
