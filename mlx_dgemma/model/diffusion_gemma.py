"""The DiffusionGemma text backbone in MLX: one set of layer weights shared by a causal encoder and a
bidirectional denoiser, a KV cache the encoder appends to and the denoiser only reads, the
self-conditioning block and the tied, soft-capped head.

Every method takes B rows (prompts left-padded to a common length, see cache.py). One layer body
serves both halves; the encoder and the denoiser differ only in their masks, caches and layer
scalars. Device-specific fast paths live behind ``kernels.Kernels``, chosen when the model is made.

Module paths mirror the Hugging Face checkpoint (``model.decoder.layers.N...``) so that weights load
by name and mlx-lm style per-module quantization overrides apply as written.
"""

from __future__ import annotations

import contextlib
import math

import mlx.core as mx
import mlx.nn as nn

from ..options import KVQuantization
from . import kernels as device_kernels, vision
from .cache import CanvasView, KVCache
from .config import ModelConfig
from .experts import Experts


def row_size(x: mx.array) -> int:
    """Elements per row of a batch [B, T, ...]: the CPU kernels choose their path by it, so that a
    row computes the same numbers in a batch as alone."""
    return x.size // x.shape[0] if x.ndim >= 3 else x.size


# Attention scores [heads, queries, keys] of one row computed at a time, at most (float32: 512 MB):
# queries beyond it go in blocks, so that a prefill chunk or a canvas after a long prefix holds one
# block's scores, not all of them (per row: a row splits the same in a batch as alone).
ATTENTION_SCORES_ELEMENTS = 1 << 27


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
    # Concrete values, not a lazy graph: a lazy one would be evaluated on the stream of the thread that
    # built the model, which another thread (an app's generation thread) does not have.
    periods = [theta ** (2.0 * i / head_dim) if i < rotated else math.inf for i in range(half)]
    return mx.array(periods, dtype=mx.float32)


class QuantizedLinear(nn.QuantizedLinear):
    """mlx's quantized linear with its product through the device seam (kernels.py)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kernels = device_kernels.for_device()

    def __call__(self, x: mx.array) -> mx.array:
        y = self.kernels.quantized_matmul(
            x, self["weight"], self["scales"], self.get("biases"), True, self.group_size, self.bits, self.mode
        )
        return y + self["bias"] if "bias" in self else y


class Linear(nn.Linear):
    def to_quantized(
        self, group_size: int | None = None, bits: int | None = None, mode: str = "affine", **_
    ) -> QuantizedLinear:
        return QuantizedLinear.from_linear(self, group_size, bits, mode)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.sliding = cfg.is_sliding(layer)
        self.head_dim = d = cfg.layer_head_dim(layer)
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.layer_kv_heads(layer)
        self.eps = cfg.rms_norm_eps
        hidden = cfg.hidden_size
        self.q_proj = Linear(hidden, self.n_heads * d, bias=False)
        self.k_proj = Linear(hidden, self.n_kv_heads * d, bias=False)
        if self.sliding:  # full layers have K = V and no v_proj
            self.v_proj = Linear(hidden, self.n_kv_heads * d, bias=False)
        self.o_proj = Linear(self.n_heads * d, hidden, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        kind = "sliding_attention" if self.sliding else "full_attention"
        self._periods = rope_periods(d, cfg.rope_parameters[kind])
        self.kernels = device_kernels.MLX

    def _rope(self, x: mx.array, positions: mx.array) -> mx.array:
        """``positions``: each row's first position [B] (a run), or every position [B, T]."""
        if positions.ndim == 1:
            return mx.fast.rope(
                x, self.head_dim, traditional=False, base=None, scale=1.0, offset=positions, freqs=self._periods
            )
        # Positions that are not a run (a compacted canvas): each position as a run of one, so that
        # the rotation is the very same arithmetic.
        B, H, T, D = x.shape
        runs = x.transpose(0, 2, 1, 3).reshape(B * T, H, 1, D)
        runs = mx.fast.rope(
            runs,
            self.head_dim,
            traditional=False,
            base=None,
            scale=1.0,
            offset=positions.reshape(-1),
            freqs=self._periods,
        )
        return runs.reshape(B, T, H, D).transpose(0, 2, 1, 3)

    def project(self, x: mx.array, positions: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Queries, keys and values as [B, heads, T, head_dim], normed and rotated at ``positions``."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, T, self.n_heads, self.head_dim))
        k_raw = self.k_proj(x).reshape(B, T, self.n_kv_heads, self.head_dim)
        v_raw = self.v_proj(x).reshape(B, T, self.n_kv_heads, self.head_dim) if self.sliding else k_raw
        q = self._rope(q.transpose(0, 2, 1, 3), positions)
        k = self._rope(self.k_norm(k_raw).transpose(0, 2, 1, 3), positions)
        v = rms_norm_noscale(v_raw, self.eps).transpose(0, 2, 1, 3)
        return q, k, v

    def attend(self, q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None) -> mx.array:
        B, _, T, _ = q.shape
        block = max(1, ATTENTION_SCORES_ELEMENTS // (self.n_heads * k.shape[2]))
        if T <= block:
            out = self.kernels.attention(q, k, v, mask)  # scale 1: the Q/K norms stand in for 1/sqrt(d)
        else:
            per_query = mask is not None and mask.shape[2] == T
            out = mx.concatenate(
                [
                    self.kernels.attention(
                        q[:, :, a : a + block], k, v, mask[:, :, a : a + block] if per_query else mask
                    )
                    for a in range(0, T, block)
                ],
                axis=2,
            )
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, dims: int, hidden: int):
        super().__init__()
        self.gate_proj = Linear(dims, hidden, bias=False)
        self.up_proj = Linear(dims, hidden, bias=False)
        self.down_proj = Linear(hidden, dims, bias=False)
        self.kernels = device_kernels.MLX

    def __call__(self, x: mx.array) -> mx.array:
        gate = self.gate_proj(x)
        return self.down_proj(self.kernels.gelu(gate, row_size(gate)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.proj = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = mx.ones((cfg.hidden_size,))
        self.per_expert_scale = mx.ones((cfg.num_experts,))
        self.top_k = cfg.top_k_experts
        self.eps = cfg.rms_norm_eps
        self._root = cfg.hidden_size**-0.5

    def __call__(self, r: mx.array) -> tuple[mx.array, mx.array]:
        z = rms_norm_noscale(r, self.eps) * self.scale * self._root
        probs = mx.softmax(self.proj(z).astype(mx.float32), axis=-1, precise=True)
        # The choice is discrete: no gradient flows into it (training would otherwise ask for one).
        idx = mx.stop_gradient(mx.argpartition(-probs, kth=self.top_k - 1, axis=-1)[..., : self.top_k])
        weights = mx.take_along_axis(probs, idx, axis=-1)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        return idx, weights * self.per_expert_scale[idx]


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

    def __call__(
        self,
        h: mx.array,
        positions: mx.array,
        mask: mx.array | None,
        cache,
        scalar: mx.array,
        attention_only: bool = False,
    ) -> mx.array:
        """One layer over h [B, T, H] at ``positions``: ``cache`` appends the new K/V and returns all
        the keys they attend to (the encoder's cache, or a canvas view for the denoiser)."""
        attn = self.self_attn
        q, k, v = attn.project(self.input_layernorm(h), positions)
        k, v = cache.update_and_fetch(k, v)
        r = h + self.post_attention_layernorm(attn.attend(q, k, v, mask))
        return r if attention_only else self.feed_forward(r) * scalar

    def feed_forward(self, r: mx.array) -> mx.array:
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(r)))
        idx, weights = self.router(r)  # the router reads the un-normed residual
        moe = self.post_feedforward_layernorm_2(self.experts(self.pre_feedforward_layernorm_2(r), idx, weights))
        return r + self.post_feedforward_layernorm(dense + moe)


class SelfConditioning(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.eps = cfg.rms_norm_eps
        self.kernels = device_kernels.MLX

    def __call__(self, embeds: mx.array, signal: mx.array | None) -> mx.array:
        if signal is not None:  # a zero signal gives a zero MLP output, so step 1 skips it
            n = self.pre_norm(signal)
            gate = self.gate_proj(n)
            embeds = embeds + self.down_proj(self.kernels.gelu(gate, row_size(gate)) * self.up_proj(n))
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


def embedding_product(kernels: device_kernels.Kernels, embed: nn.Module, x: mx.array, transpose: bool) -> mx.array:
    """``x @ E.T`` (the tied head) or, without ``transpose``, ``x @ E``; a quantized ``E`` through the seam."""
    if isinstance(embed, nn.QuantizedEmbedding):
        return kernels.quantized_matmul(
            x, embed.weight, embed.scales, embed.get("biases"), transpose, embed.group_size, embed.bits, embed.mode
        )
    return x @ (embed.weight.T if transpose else embed.weight)


def soft_embed(embed: nn.Module, probs: mx.array, kernels: device_kernels.Kernels = device_kernels.MLX) -> mx.array:
    """``probs [.., V] @ E [V, H]``: the expected embedding under a distribution over the vocabulary."""
    return embedding_product(kernels, embed, probs, transpose=False)


class DiffusionGemma(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.use_kernels(device_kernels.for_device())

    @property
    def layers(self) -> list[Layer]:
        return self.model.decoder.layers

    def use_kernels(self, kernels: device_kernels.Kernels) -> None:
        """The device's fast paths (kernels.py); chosen for the default device when the model is made."""
        self.kernels = kernels
        for module in self.modules():
            if hasattr(module, "kernels"):
                module.kernels = kernels

    @contextlib.contextmanager
    def kernels_in_use(self, kernels: device_kernels.Kernels):
        """``use_kernels(kernels)`` for the duration of a ``with`` block, then the model's own again."""
        previous = self.kernels
        self.use_kernels(kernels)
        try:
            yield self
        finally:
            self.use_kernels(previous)

    def make_cache(self, left_padding: list[int] | None = None, quantization: KVQuantization | None = None) -> KVCache:
        """An empty cache for one row, or for ``len(left_padding)`` left-padded rows; with
        ``quantization``, stored quantized past its start (cache.py)."""
        cfg = self.config
        windows = [cfg.sliding_window if cfg.is_sliding(i) else None for i in range(len(self.layers))]
        if quantization is not None:
            quantization.check([cfg.layer_head_dim(i) for i in range(len(self.layers))])
        return KVCache(windows, left_padding or [0], slack=cfg.canvas_length, quantization=quantization)

    def embed(self, ids: mx.array) -> mx.array:
        embed = self.model.decoder.embed_tokens
        h = embed(ids)
        scale = mx.array(math.sqrt(self.config.hidden_size), dtype=_embedding_dtype(embed, h.dtype))
        return h * scale.astype(h.dtype)

    def encode(
        self,
        ids: mx.array,
        cache: KVCache | CanvasView,
        return_hidden: bool = False,
        pixel_values=None,
        image_position_ids=None,
        mm_token_type_ids=None,
    ) -> mx.array | None:
        """Run the causal encoder over ``ids`` [B, T] (rows left-padded as the cache says) and append
        their K/V to ``cache``; nothing is evaluated here.

        ``cache`` may be a ``CanvasView`` of several rows' own caches and ``ids`` their committed
        canvases: the K/V then land in the view's canvas room, and ``view.append_canvas`` copies them
        to each row's cache (the commits of rows that settled at the same step, in one forward).

        With ``return_hidden`` it returns the final-normed hidden states [B, T, H] (next-token
        prediction through ``head``); otherwise the last layer's feed-forward, which only feeds
        those states, is skipped.

        Images (vision.py): ``pixel_values`` and ``image_position_ids`` as ``images.preprocess``
        returns them; their soft tokens replace the image tokens of ``ids``, and each run of image
        tokens (``mm_token_type_ids``, by default the image tokens of ``ids``) attends to itself
        bidirectionally.
        """
        ids = _rows(ids)
        if ids.shape[0] != cache.batch_size:
            raise ValueError(f"{ids.shape[0]} rows of ids for a cache of {cache.batch_size} rows")
        T, positions = ids.shape[1], cache.positions if isinstance(cache, CanvasView) else cache.lengths
        if isinstance(cache, CanvasView):
            if T != cache.length:
                raise ValueError(f"{T} ids for a canvas view of {cache.length} positions")
            cache.set_active(None)
            masks = cache.encoder_masks()
        else:
            masks = cache.encoder_masks(T)
        scalars = self.model.encoder.language_model.layers
        h = self.embed(ids)
        if pixel_values is not None:
            h = vision.place_image_features(self, ids, h, pixel_values, image_position_ids)
            if mm_token_type_ids is None:
                mm_token_type_ids = ids == self.config.image_token_id
        if mm_token_type_ids is not None and self.config.use_bidirectional_attention == "vision":
            masks = vision.with_image_blocks(masks, vision.image_blocks(mm_token_type_ids))
        last = len(self.layers) - 1
        for i, (layer, c) in enumerate(zip(self.layers, cache.layers)):
            h = layer(
                h, positions, masks[i], c, scalars[i].layer_scalar, attention_only=i == last and not return_hidden
            )
        return self.model.decoder.norm(h) if return_hidden else None

    def next_token_logits(self, ids: mx.array, cache: KVCache, **vision_inputs) -> mx.array:
        """Autoregressive mode: encode ``ids`` [B, T] and return the next-token logits [B, V].

        The encoder is trained as a causal LM too, so its final-normed hidden state at the last
        position through the tied, soft-capped head predicts the next token.
        """
        return self.head(self.encode(ids, cache, return_hidden=True, **vision_inputs)[:, -1])

    def denoise(
        self,
        canvas: mx.array,
        cache: KVCache | CanvasView,
        self_conditioning: mx.array | None = None,
        self_conditioning_probs: mx.array | None = None,
        active: mx.array | None = None,
        self_conditioned_rows: mx.array | None = None,
    ) -> mx.array:
        """Logits [B, C, V] (float32, soft-capped) for a canvas [B, C]; the cache is only read.

        ``cache`` is the encoder's cache, or a ``CanvasView`` of it that the sampler lays out once
        per canvas (``cache.canvas_view(C)``) and passes to every step. ``self_conditioning`` is
        the previous step's temperature-scaled logits [B, C, V] or None. A sampler that already has
        their softmax passes it as ``self_conditioning_probs`` to save a vocabulary-wide pass (used
        with float32 embeddings, where it is the same number).

        Active-set compaction (not the reference's computation): with ``active`` (canvas indexes
        [B, A], sorted per row; a view is required) only those positions are computed: ``canvas``
        and the self-conditioning inputs hold just their rows, they attend to the prefix, to each
        other and to the K/V the view holds for the other canvas positions from when they were
        last computed; the logits are [B, A, V].

        ``self_conditioned_rows`` [B] bool: only these rows are self-conditioned, the others compute
        as without a signal (a row that joined a batch at its first step).
        """
        canvas = _rows(canvas)
        if isinstance(cache, KVCache):
            if active is not None:
                raise ValueError("active-set compaction needs a CanvasView that keeps the canvas's K/V")
            cache = cache.canvas_view(canvas.shape[1])
        view = cache
        if active is not None and active.ndim == 1:
            active = mx.broadcast_to(active[None], canvas.shape)
        positions = view.positions if active is None else view.positions[:, None] + active
        view.set_active(active)
        decoder = self.model.decoder
        h = self.embed(canvas)
        signal = None
        if self_conditioning is not None:
            signal = self.self_conditioning_signal(self_conditioning, h.dtype, self_conditioning_probs)
            if self_conditioned_rows is not None:  # a zero signal adds exactly zero
                signal = signal * self_conditioned_rows[:, None, None].astype(signal.dtype)
        h = decoder.self_conditioning(h, signal)
        for layer, layer_view, mask in zip(self.layers, view.layers, view.masks):
            h = layer(h, positions, mask, layer_view, layer.layer_scalar)
        return self.head(decoder.norm(h))

    def self_conditioning_signal(self, logits: mx.array, dtype: mx.Dtype, probs: mx.array | None = None) -> mx.array:
        """The expected token embedding under ``softmax(logits)`` (the previous step's tempered logits
        [B, C, V]), scaled as ``embed`` scales tokens, in the activations' ``dtype``: what the denoiser
        is conditioned on. ``probs``: that softmax, when the caller has it (used with float32 embeddings)."""
        embed = self.model.decoder.embed_tokens
        embedding_dtype = _embedding_dtype(embed, dtype)
        if probs is None or embedding_dtype != mx.float32:
            # The reference keeps the previous step's logits in the embedding dtype before the softmax.
            probs = self.kernels.softmax(logits.astype(embedding_dtype).astype(mx.float32)).astype(embedding_dtype)
        scale = mx.array(math.sqrt(self.config.hidden_size), dtype=embedding_dtype).astype(dtype)
        return (soft_embed(embed, probs, self.kernels) * scale).astype(dtype)

    def head(self, hidden: mx.array) -> mx.array:
        """Tied output head with the fp32 soft-cap."""
        logits = embedding_product(self.kernels, self.model.decoder.embed_tokens, hidden, transpose=True)
        logits = logits.astype(mx.float32)
        return self.kernels.softcap(logits, self.config.final_logit_softcapping)


def _rows(ids) -> mx.array:
    """Token ids as int32 [B, T] (a flat sequence is one row)."""
    ids = mx.array(ids, dtype=mx.int32) if not isinstance(ids, mx.array) else ids.astype(mx.int32)
    return ids.reshape(1, -1) if ids.ndim < 2 else ids
