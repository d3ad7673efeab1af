"""The Gemma 4 vision tower and the multimodal embedder, and how image features enter the encoder.

Module paths mirror the checkpoint (``model.encoder.vision_tower...``, ``model.encoder.embed_vision...``)
so weights load by name. An image arrives as the image processor's patches (``images.preprocess``):
``pixel_values`` [N, P, 3·p²] in [0, 1] and ``image_position_ids`` [N, P, 2] (x, y; (-1, -1) pads).
Each image's patches go through a bidirectional transformer with 2-D RoPE, are average-pooled in
k×k patch squares, standardized, normed and projected to the text width: one soft token per square,
which replaces one image token of the prompt. In the encoder, each run of image tokens attends to
itself bidirectionally (``use_bidirectional_attention="vision"``); text stays causal.

Padding patches are dropped before the tower rather than masked: they are masked out as keys and
zeroed before pooling in the reference, so the real patches' outputs are the same.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import ImageError
from .config import VisionConfig


def _rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """RMSNorm in float32 (as the reference computes it), cast back to the input's dtype."""
    return mx.fast.rms_norm(x.astype(mx.float32), weight if weight is None else weight.astype(mx.float32), eps).astype(
        x.dtype
    )


class Float32RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return _rms_norm(x, self.weight, self.eps)


class ClippableLinear(nn.Module):
    """A bias-free linear map, with its input and output clamped to learned bounds when the
    checkpoint has them (``use_clipped_linears``)."""

    def __init__(self, inputs: int, outputs: int, clipped: bool):
        super().__init__()
        self.linear = nn.Linear(inputs, outputs, bias=False)
        self.clipped = clipped
        if clipped:
            self.input_min, self.input_max = mx.array(-math.inf), mx.array(math.inf)
            self.output_min, self.output_max = mx.array(-math.inf), mx.array(math.inf)

    def __call__(self, x: mx.array) -> mx.array:
        if not self.clipped:
            return self.linear(x)
        x = mx.clip(x, self.input_min.astype(x.dtype), self.input_max.astype(x.dtype))
        y = self.linear(x)
        return mx.clip(y, self.output_min.astype(y.dtype), self.output_max.astype(y.dtype))


def axial_rope(x: mx.array, positions: mx.array, theta: float) -> mx.array:
    """2-D RoPE on [T, heads, d]: the first half of each head rotates by the x position, the second
    by the y position, each half in rotate-half layout with the same d/4 frequencies."""
    d = x.shape[-1]
    quarter = d // 4
    inv_freq = 1.0 / (theta ** (mx.arange(0, d // 2, 2, dtype=mx.float32) / (d // 2)))
    halves = []
    for axis in range(2):
        part = x[..., axis * 2 * quarter : (axis + 1) * 2 * quarter]
        angles = positions[:, axis].astype(mx.float32)[:, None] * inv_freq[None, :]  # [T, d/4]
        cos, sin = mx.cos(angles)[:, None, :].astype(x.dtype), mx.sin(angles)[:, None, :].astype(x.dtype)
        x1, x2 = part[..., :quarter], part[..., quarter:]
        halves += [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    return mx.concatenate(halves + [x[..., 4 * quarter :]], axis=-1)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d, clipped = cfg.head_dim, cfg.use_clipped_linears
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = ClippableLinear(cfg.hidden_size, self.n_heads * d, clipped)
        self.k_proj = ClippableLinear(cfg.hidden_size, self.n_kv_heads * d, clipped)
        self.v_proj = ClippableLinear(cfg.hidden_size, self.n_kv_heads * d, clipped)
        self.o_proj = ClippableLinear(self.n_heads * d, cfg.hidden_size, clipped)
        self.q_norm = Float32RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = Float32RMSNorm(d, cfg.rms_norm_eps)
        self.eps, self.theta = cfg.rms_norm_eps, cfg.rope_theta

    def __call__(self, x: mx.array, positions: mx.array) -> mx.array:
        T = x.shape[0]
        q = axial_rope(self.q_norm(self.q_proj(x).reshape(T, self.n_heads, -1)), positions, self.theta)
        k = axial_rope(self.k_norm(self.k_proj(x).reshape(T, self.n_kv_heads, -1)), positions, self.theta)
        v = _rms_norm(self.v_proj(x).reshape(T, self.n_kv_heads, -1), None, self.eps)
        # In float32, rounded once: torch's CPU attention keeps the scores in float32 at half precision.
        q, k, v = (a.transpose(1, 0, 2)[None].astype(mx.float32) for a in (q, k, v))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0).astype(x.dtype)
        return self.o_proj(out[0].transpose(1, 0, 2).reshape(T, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        clipped = cfg.use_clipped_linears
        self.gate_proj = ClippableLinear(cfg.hidden_size, cfg.intermediate_size, clipped)
        self.up_proj = ClippableLinear(cfg.hidden_size, cfg.intermediate_size, clipped)
        self.down_proj = ClippableLinear(cfg.intermediate_size, cfg.hidden_size, clipped)

    def __call__(self, x: mx.array) -> mx.array:
        gate = self.gate_proj(x)  # GELU in float32, rounded once, as torch computes it in half precision
        return self.down_proj(nn.gelu_approx(gate.astype(mx.float32)).astype(gate.dtype) * self.up_proj(x))


class VisionLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.self_attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            setattr(self, name, Float32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def __call__(self, x: mx.array, positions: mx.array) -> mx.array:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layers = [VisionLayer(cfg) for _ in range(cfg.num_hidden_layers)]


class PatchEmbedder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.input_proj = nn.Linear(3 * cfg.patch_size**2, cfg.hidden_size, bias=False)
        self.position_embedding_table = mx.ones((2, cfg.position_embedding_size, cfg.hidden_size))

    def __call__(self, patches: mx.array, positions: mx.array) -> mx.array:
        x = (2 * (patches - 0.5)).astype(self.input_proj.weight.dtype)  # pixels [0, 1] → [-1, 1]
        table = self.position_embedding_table
        return self.input_proj(x) + (table[0][positions[:, 0]] + table[1][positions[:, 1]])


class VisionModel(nn.Module):
    """``model.encoder.vision_tower``: patches of one image → its soft tokens (vision width)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.patch_embedder = PatchEmbedder(cfg)
        self.encoder = VisionEncoder(cfg)
        if cfg.standardize:
            self.std_bias = mx.zeros((cfg.hidden_size,))
            self.std_scale = mx.ones((cfg.hidden_size,))

    def __call__(self, patches: mx.array, positions: np.ndarray, kernel: int) -> mx.array:
        """``patches`` [P, 3·p²] and ``positions`` [P, 2] (host ints) of one image's real patches →
        [P / kernel², hidden]: one token per ``kernel``×``kernel`` square of patches."""
        pos = mx.array(positions.astype(np.int32))
        h = self.patch_embedder(patches, pos)
        for layer in self.encoder.layers:
            h = layer(h, pos)
        dtype = h.dtype
        # Averaged in float32 and rounded to the working dtype, as the reference does; then scaled and
        # standardized in float32 (the sqrt(width) scaling can overflow float16).
        h = (pool(positions, kernel) @ h.astype(mx.float32)).astype(dtype)
        h = h.astype(mx.float32) * math.sqrt(self.config.hidden_size)
        if self.config.standardize:
            h = (h - self.std_bias.astype(mx.float32)) * self.std_scale.astype(mx.float32)
        return h.astype(dtype)


def pool(positions: np.ndarray, kernel: int) -> mx.array:
    """The averaging matrix [squares, P]: patch (x, y) goes to square x//k + (width/k)·(y//k), and
    each square is the mean of its k² patches; squares in that order, empty ones left out."""
    width = int(positions[:, 0].max()) + 1
    square = positions[:, 0] // kernel + (width // kernel) * (positions[:, 1] // kernel)
    used = np.unique(square)
    weights = (square[None, :] == used[:, None]).astype(np.float32) / kernel**2
    return mx.array(weights)


class MultimodalEmbedder(nn.Module):
    """``model.encoder.embed_vision``: soft tokens → text width (a weightless RMSNorm, then a projection)."""

    def __init__(self, vision_width: int, text_width: int, eps: float):
        super().__init__()
        self.embedding_projection = nn.Linear(vision_width, text_width, bias=False)
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return self.embedding_projection(_rms_norm(x, None, self.eps))


def add_vision_modules(model) -> None:
    """Give a model whose config has a vision tower its vision modules (the loader calls this when
    the checkpoint holds their weights)."""
    cfg = model.config.vision_config
    encoder = model.model.encoder
    encoder.vision_tower = VisionModel(cfg)
    encoder.embed_vision = MultimodalEmbedder(cfg.hidden_size, model.config.hidden_size, cfg.rms_norm_eps)


def has_vision(model) -> bool:
    """The checkpoint holds vision tower weights (whether it can take images: ``check_takes_images``)."""
    return "vision_tower" in model.model.encoder


def check_takes_images(model, what: str = "images") -> None:
    """An ``ImageError`` saying why the checkpoint cannot take images, if it cannot: a tower is of no
    use without image tokens in the vocabulary (the bundled demo has an untrained tower and no image
    tokens)."""
    cfg = model.config
    if not has_vision(model):
        reason = "it has no vision tower weights"
    elif (outside := max(cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id)) >= cfg.vocab_size:
        reason = f"its image token ids (up to {outside}) are outside its vocabulary of {cfg.vocab_size}"
    else:
        return
    raise ImageError(f"this checkpoint takes text only, not {what}: {reason}")


def image_features(model, pixel_values, image_position_ids) -> mx.array:
    """The soft tokens of every image, in order, at the text width: [sum of tokens per image, H].

    ``pixel_values`` [N, P, 3·p²] and ``image_position_ids`` [N, P, 2] as the image processor
    returns them (padded to the same P; (-1, -1) marks padding)."""
    check_takes_images(model)
    encoder = model.model.encoder
    cfg = model.config.vision_config
    positions = np.asarray(image_position_ids).astype(np.int64)
    pixels = mx.array(pixel_values)
    if pixels.ndim == 2:
        pixels, positions = pixels[None], positions[None]
    padded = pixels.shape[1]
    squares = padded // cfg.pooling_kernel_size**2
    kernel = int((padded // squares) ** 0.5)  # the reference derives the pooling from the padded length
    features = []
    for image, where in zip(pixels, positions):
        real = np.flatnonzero((where != -1).any(axis=-1))
        features.append(encoder.vision_tower(image[mx.array(real)], where[real], kernel))
    return encoder.embed_vision(mx.concatenate(features))


def place_image_features(model, ids: mx.array, embeds: mx.array, pixel_values, image_position_ids) -> mx.array:
    """``embeds`` [1, T, H] with the image tokens' rows replaced by the images' soft tokens, in order."""
    features = image_features(model, pixel_values, image_position_ids).astype(embeds.dtype)
    slots = np.flatnonzero(np.array(ids).reshape(-1) == model.config.image_token_id)
    if len(slots) != features.shape[0]:
        raise ValueError(
            f"the prompt has {len(slots)} image tokens but the images give {features.shape[0]} "
            "soft tokens; expand each image placeholder with images.expand_image_tokens"
        )
    index = np.full(embeds.shape[1], -1)
    index[slots] = np.arange(len(slots))
    rows = features[mx.array(np.maximum(index, 0))][None]
    return mx.where(mx.array(index >= 0)[None, :, None], rows, embeds)


def image_blocks(mm_token_type_ids) -> np.ndarray:
    """Block id per position: each run of image (1) or video (2) tokens is a block 0, 1, …; text is -1."""
    types = np.asarray(mm_token_type_ids).reshape(-1)
    vision = (types == 1) | (types == 2)
    starts = vision & ~np.concatenate([[False], vision[:-1]])
    return np.where(vision, np.cumsum(starts) - 1, -1)


def with_image_blocks(masks: list, blocks: np.ndarray) -> list:
    """Encoder masks (per layer, [B|1, 1, T, K] booleans whose last T columns are the T new
    positions, or None for "everything") opened so that the positions of each image block see each
    other both ways, in every layer, window or not."""
    if not (blocks >= 0).any():
        return masks
    T = len(blocks)
    same = mx.array((blocks[:, None] == blocks[None, :]) & (blocks[:, None] >= 0))
    out = []
    for mask in masks:
        if mask is not None:
            K = mask.shape[-1]
            mask = mx.concatenate([mask[..., : K - T], mask[..., K - T :] | same], axis=-1)
        out.append(mask)
    return out
