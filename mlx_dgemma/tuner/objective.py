"""DiffusionGemma's training objective in MLX: a differentiable forward over a whole batch and the loss.

The published objective, as the reference trains it (``checkpoint_tools/train_demo.py``):

* Layout: ``<bos> prompt`` (left-padded to the batch's longest prompt, P tokens), then the answer
  plus its end-of-turn token padded with ``<pad>`` to K canvases of C tokens; the answer starts on
  a canvas boundary.
* Encoder: the causal backbone over the whole clean sequence (prompt and all K canvases, as if
  committed), with the encoder's layer scalars; next-token cross-entropy on every real token
  (``mask_prompt``: answer tokens only): the causal-LM loss.
* Decoder: each canvas k gets a noise level t ~ U(0.001, 1); each position is replaced with
  probability t by a token drawn uniformly from the vocabulary. All canvases are denoised in one
  pass: canvas k attends to the clean prefix it would see at generation time (prompt and canvases
  before it; sliding layers only the last W−1 of those) and to its own C positions, never to
  other canvases. Cross-entropy over every position of every canvas, padding included.
* Self-conditioning, per example with probability 0.5: a first decoder pass without it (no
  gradient); its logits divided by a temperature T ~ U(t_min, t_max) feed the second pass, as
  generation feeds the previous step's tempered logits. Other examples get a zero signal.
* Loss = decoder CE + encoder CE.

All random draws of a step are in one ``Noise`` value, so a test can give the reference the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..model import kernels as device_kernels
from ..model.diffusion_gemma import DiffusionGemma


@dataclass
class ObjectiveConfig:
    self_conditioning_prob: float = 0.5
    t_min: float = 0.4  # self-conditioning temperatures, the generation schedule's range
    t_max: float = 0.8
    min_noise: float = 0.001
    encoder_weight: float = 1.0


@dataclass
class Example:
    """One training sample: ``<bos>`` + prompt ids, and answer ids ending with the end-of-turn id."""

    prefix: list[int]
    answer: list[int]
    mask_prompt: bool = False

    def canvases(self, canvas_length: int) -> int:
        return -(-len(self.answer) // canvas_length)

    def length(self, canvas_length: int) -> int:
        return len(self.prefix) + self.canvases(canvas_length) * canvas_length


@dataclass
class Batch:
    ids: mx.array  # [B, P + K·C] int32: left-padded prefix, then K canvases
    pad: mx.array  # [B] left padding of each row
    prefix_length: int  # P
    canvases: int  # K
    scored: mx.array  # [B, P + K·C] bool: position i's next token ids[i + 1] is in the encoder loss

    @property
    def size(self) -> int:
        return self.ids.shape[0]


def collate(examples: list[Example], canvas_length: int, pad_id: int) -> Batch:
    """Examples with the same canvas count → one batch (the reference's layout)."""
    C = canvas_length
    K = examples[0].canvases(C)
    if any(e.canvases(C) != K for e in examples):
        raise ValueError("a batch needs examples of one canvas count")
    P = max(len(e.prefix) for e in examples)
    L = P + K * C
    ids = np.full((len(examples), L), pad_id, dtype=np.int32)
    pad = np.zeros(len(examples), dtype=np.int32)
    scored = np.zeros((len(examples), L), dtype=bool)
    for b, e in enumerate(examples):
        pad[b] = P - len(e.prefix)
        ids[b, pad[b] : P] = e.prefix
        ids[b, P : P + len(e.answer)] = e.answer
        first = P - 1 if e.mask_prompt else pad[b]
        scored[b, first : P + len(e.answer) - 1] = True  # targets up to and including the end of turn
    return Batch(mx.array(ids), mx.array(pad), P, K, mx.array(scored))


@dataclass
class Noise:
    """The random draws of one step."""

    t: mx.array  # [B, K] noise level per canvas
    replace: mx.array  # [B, K·C] bool: position renoised
    tokens: mx.array  # [B, K·C] int32: the uniform draw it gets
    self_conditioning: mx.array  # [B] bool: example trained with the two-pass self-conditioning
    temperature: mx.array  # [B] the first pass's logits are divided by this


def draw_noise(
    rng: np.random.Generator,
    batch: Batch,
    canvas_length: int,
    vocab_size: int,
    objective: ObjectiveConfig = ObjectiveConfig(),
) -> Noise:
    B, K, C = batch.size, batch.canvases, canvas_length
    t = rng.random((B, K), dtype=np.float32) * (1 - objective.min_noise) + objective.min_noise
    replace = rng.random((B, K, C), dtype=np.float32) < t[:, :, None]
    tokens = rng.integers(0, vocab_size, (B, K * C))
    sc = rng.random(B) < objective.self_conditioning_prob
    temperature = rng.random(B, dtype=np.float32) * (objective.t_max - objective.t_min) + objective.t_min
    return Noise(
        mx.array(t),
        mx.array(replace.reshape(B, K * C)),
        mx.array(tokens, dtype=mx.int32),
        mx.array(sc),
        mx.array(temperature),
    )


def attention_masks(batch: Batch, canvas_length: int, window: int):
    """Boolean masks (True = attend), keyed by ``sliding``: the encoder's [B, 1, L, L] (causal, own
    position always) and the decoder's [B, 1, K·C, L + K·C] (the prefix canvas k sees, then its own
    canvas)."""
    B, L, P, C = batch.size, batch.ids.shape[1], batch.prefix_length, canvas_length
    idx = mx.arange(L)
    real_key = (idx[None, :] >= batch.pad[:, None])[:, None, :]  # [B, 1, L]
    causal = (idx[None, :] <= idx[:, None])[None]
    in_window = (idx[None, :] > idx[:, None] - window)[None]
    eye = mx.eye(L, dtype=mx.bool_)[None]
    encoder = {False: (causal & real_key) | eye, True: (causal & in_window & real_key) | eye}

    canvas = mx.arange(batch.canvases * C) // C  # canvas index of each decoder query
    start = (P + canvas * C)[:, None]  # the prefix canvas k sees ends here
    prefix_full = (idx[None, :] < start)[None] & real_key
    prefix_sliding = prefix_full & (idx[None, :] >= start - (window - 1))[None]
    own = mx.broadcast_to((canvas[:, None] == canvas[None, :])[None], (B, len(canvas), len(canvas)))
    decoder = {False: mx.concatenate([prefix_full, own], -1), True: mx.concatenate([prefix_sliding, own], -1)}
    return ({k: v[:, None] for k, v in encoder.items()}, {k: v[:, None] for k, v in decoder.items()})


class KeptKeys:
    """The encoder's K/V source in training: a layer attends to its own keys (the mask says which),
    kept for the decoder."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys, self.values = keys, values
        return keys, values


class PrefixedKeys:
    """The decoder's: the encoder's K/V of the whole sequence, then the canvases' own (the mask says
    which prefix and which canvas each position sees)."""

    def __init__(self, keys: mx.array, values: mx.array):
        self.keys, self.values = keys, values

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return mx.concatenate([self.keys, keys], axis=2), mx.concatenate([self.values, values], axis=2)


def _encoder_layer(layer, h, positions, mask, scalar):
    kept = KeptKeys()
    return layer(h, positions, mask, kept, scalar), kept.keys, kept.values


def _decoder_layer(layer, h, positions, prefix_keys, prefix_values, mask):
    return layer(h, positions, mask, PrefixedKeys(prefix_keys, prefix_values), layer.layer_scalar)


class Forward:
    """The encoder and decoder passes of a training batch through the model's own layers, under the
    differentiable kernels ``loss`` sets; ``grad_checkpoint`` recomputes each layer in the backward
    pass instead of keeping its activations."""

    def __init__(self, model: DiffusionGemma, grad_checkpoint: bool = False):
        self.model, self.grad_checkpoint = model, grad_checkpoint

    def layer(self, body: Callable, layer: nn.Module, *args):
        """``body(layer, *args)``, checkpointed as mlx-lm does it (the layer's trainable parameters
        are inputs of the checkpointed function)."""
        if not self.grad_checkpoint:
            return body(layer, *args)
        kernels = self.model.kernels  # the backward pass recomputes the layer once ``loss`` has returned

        def checkpointed(params, *args):
            layer.update(params)
            with self.model.kernels_in_use(kernels):
                return body(layer, *args)

        return mx.checkpoint(checkpointed)(layer.trainable_parameters(), *args)

    def encode(self, ids: mx.array, positions: mx.array, masks) -> tuple[mx.array, list]:
        """Final-normed hidden states [B, L, H] and every layer's K/V."""
        model = self.model
        scalars = model.model.encoder.language_model.layers
        h = model.embed(ids)
        kv = []
        for layer, scalar in zip(model.layers, scalars):
            h, k, v = self.layer(
                _encoder_layer, layer, h, positions, masks[layer.self_attn.sliding], scalar.layer_scalar
            )
            kv.append((k, v))
        return model.model.decoder.norm(h), kv

    def denoise(
        self,
        canvas: mx.array,
        positions: mx.array,
        kv,
        masks,
        tempered: mx.array | None = None,
        on: mx.array | None = None,
    ) -> mx.array:
        """Soft-capped logits [B, K·C, V] of noisy canvases against the encoder's K/V, self-conditioned
        on the ``tempered`` logits of a first pass for the examples where ``on`` is True."""
        model = self.model
        decoder = model.model.decoder
        h = model.embed(canvas)
        signal = None if tempered is None else model.self_conditioning_signal(tempered, h.dtype) * on[:, None, None]
        h = decoder.self_conditioning(h, signal)
        for layer, (k, v) in zip(model.layers, kv):
            h = self.layer(_decoder_layer, layer, h, positions, k, v, masks[layer.self_attn.sliding])
        return model.head(decoder.norm(h))


@dataclass
class Losses:
    total: mx.array
    decoder: mx.array
    encoder: mx.array
    tokens: int  # positions the step computed (encoder + decoder), for tokens/s


def loss(
    model: DiffusionGemma,
    batch: Batch,
    noise: Noise,
    objective: ObjectiveConfig = ObjectiveConfig(),
    grad_checkpoint: bool = False,
) -> Losses:
    cfg = model.config
    C, P = cfg.canvas_length, batch.prefix_length
    forward = Forward(model, grad_checkpoint)
    positions = mx.maximum(mx.arange(batch.ids.shape[1])[None, :] - batch.pad[:, None], 0)
    encoder_masks, decoder_masks = attention_masks(batch, C, cfg.sliding_window)
    # The CPU's fast paths go through numpy, which has no gradient.
    with model.kernels_in_use(device_kernels.differentiable(model.kernels)):
        hidden, kv = forward.encode(batch.ids, positions, encoder_masks)
        ce = nn.losses.cross_entropy(model.head(hidden[:, :-1]), batch.ids[:, 1:])
        scored = batch.scored[:, :-1]
        encoder_loss = (ce * scored).sum() / scored.sum()

        clean = batch.ids[:, P:]
        noisy = mx.where(noise.replace, noise.tokens, clean)
        canvas_positions = positions[:, P:]
        tempered = None
        if noise.self_conditioning.any().item():
            first = mx.stop_gradient(forward.denoise(noisy, canvas_positions, kv, decoder_masks))
            tempered = first / noise.temperature[:, None, None]
        logits = forward.denoise(noisy, canvas_positions, kv, decoder_masks, tempered, noise.self_conditioning)
        decoder_loss = nn.losses.cross_entropy(logits, clean).mean()
        tokens = batch.size * (batch.ids.shape[1] + clean.shape[1])
        return Losses(decoder_loss + objective.encoder_weight * encoder_loss, decoder_loss, encoder_loss, tokens)
