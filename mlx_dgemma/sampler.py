"""One canvas of DiffusionGemma's denoising loop, exactly as the reference ``generate()`` runs it.

Per step (``cur`` counts down N..1, REFERENCE.md §3.2): denoise the canvas; divide the logits by
``T = t_min + (t_max - t_min) * cur / N``; sample a denoiser canvas from the tempered distribution;
accept the lowest-entropy positions whose summed entropy stays within the bound; renoise every other
position uniformly; stop once the argmax canvas is stable and the mean entropy is below the
confidence threshold. The tempered logits self-condition the next step; the last argmax is committed.

A ``Clamp`` (template.py builds them) fixes some canvas positions: they hold their token from the
first draft to the commit, are always accepted, never renoised, and take no part in the entropy
budget or the stop rule's mean entropy; other positions may be limited to a class of tokens. With no
clamp the loop is the reference's, draw for draw.

All randomness goes through one small object (``Random``) so tests can replay the reference's draws.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import mlx.core as mx
import numpy as np

from . import cpu_kernels
from .config import GenerationConfig
from .validate import check_entropy_bound, check_temperatures

_FLOAT32_MIN = float(np.finfo(np.float32).min)


class Random(Protocol):
    """The sampler's source of randomness; each call returns an int array of ``shape``."""

    def canvas(self, shape: tuple[int, ...], vocab: int) -> mx.array:
        """The initial canvas: tokens uniform over ``[0, vocab)``."""

    def categorical(self, probs: mx.array) -> mx.array:
        """One token per row of ``probs`` [..., V], drawn from that distribution; shape ``probs.shape[:-1]``."""

    def renoise(self, shape: tuple[int, ...], vocab: int) -> mx.array:
        """A fresh uniform canvas; the sampler keeps it where it rejected the denoiser's token."""


class MxRandom:
    """``Random`` on ``mx.random`` with its own key, split once per draw (global RNG state is untouched)."""

    def __init__(self, seed: int | None = None):
        self.seed = secrets.randbits(32) if seed is None else seed
        self._key = mx.random.key(self.seed)

    def _next_key(self) -> mx.array:
        self._key, key = mx.random.split(self._key)
        return key

    def canvas(self, shape, vocab):
        return mx.random.randint(0, vocab, shape, key=self._next_key())

    renoise = canvas

    def categorical(self, probs):
        # Inverse CDF: one uniform per row and a running sum, no vocabulary-wide random draws or logs.
        cdf = mx.cumsum(probs, axis=-1)
        u = mx.random.uniform(shape=probs.shape[:-1] + (1,), key=self._next_key()) * cdf[..., -1:]
        return mx.minimum((cdf <= u).sum(axis=-1), probs.shape[-1] - 1).astype(mx.int32)


@dataclass(frozen=True)
class SamplerSettings:
    """How one canvas is denoised; built from the generation config, replaceable per canvas."""

    steps: int = 48
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    # Active-set compaction (the fast policy; 0 = off, the reference): a position accepted with the
    # same argmax token for this many steps in a row is frozen and no longer recomputed.
    freeze_after: int = 0

    def __post_init__(self):
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be a positive integer, got {self.steps!r}")
        check_entropy_bound(self.entropy_bound)
        check_temperatures(self.t_min, self.t_max)
        if not isinstance(self.stability_threshold, int) or self.stability_threshold < 0:
            raise ValueError(f"stability threshold must be an integer >= 0, got {self.stability_threshold!r}")
        if not self.confidence_threshold > 0:
            raise ValueError(f"confidence threshold must be > 0, got {self.confidence_threshold}")
        if not isinstance(self.freeze_after, int) or self.freeze_after < 0:
            raise ValueError(f"freeze_after must be an integer >= 0, got {self.freeze_after!r}")

    @classmethod
    def from_generation_config(cls, config: GenerationConfig, **overrides) -> SamplerSettings:
        """The config's values, with every override that is not None in their place."""
        settings = cls(
            steps=config.max_denoising_steps,
            entropy_bound=config.entropy_bound,
            t_min=config.t_min,
            t_max=config.t_max,
            stability_threshold=config.stability_threshold,
            confidence_threshold=config.confidence_threshold,
        )
        return replace(settings, **{k: v for k, v in overrides.items() if v is not None})

    def temperatures(self) -> list[mx.array]:
        """The temperature of each step, first to last, rounded as the reference computes it: in
        float32, because its step counter is an int32 tensor."""
        f32 = np.float32
        span, low = f32(self.t_max - self.t_min), f32(self.t_min)
        return [mx.array(low + span * (f32(cur) / f32(self.steps))) for cur in range(self.steps, 0, -1)]


@dataclass
class Clamp:
    """Fixed tokens and per-position token classes for one canvas.

    ``fixed`` [1, C] bool and ``tokens`` [1, C] int32 (read where fixed). ``classes`` [1, C] int32
    indexes rows of ``bias`` [K, V] float32 (0 for allowed tokens, a large negative number for the
    others; row 0 allows everything): K token classes rather than a [C, V] mask keep the memory at
    K rows of the vocabulary. ``finish`` may rewrite the committed canvas from the last step's
    probabilities (a template snapping a multiple-choice hole to one of its choices)."""

    fixed: mx.array
    tokens: mx.array
    classes: mx.array | None = None
    bias: mx.array | None = None
    finish: Callable[[mx.array, mx.array], mx.array] | None = None

    def apply(self, canvas: mx.array) -> mx.array:
        return mx.where(self.fixed, self.tokens, canvas)

    def restrict(self, logits: mx.array, active: mx.array | None = None) -> mx.array:
        """Logits of the canvas (or of its ``active`` positions) with disallowed tokens pushed down."""
        if self.bias is None:
            return logits
        classes = self.classes if active is None else self.classes[:, active]
        return logits + self.bias[classes]

    def free_entropy(self, entropy: mx.array) -> tuple[mx.array, mx.array]:
        """Entropy with fixed positions at 0 (accepted first, costing nothing), and its mean over the
        free positions."""
        free = mx.logical_not(self.fixed)
        entropy = mx.where(free, entropy, 0.0)
        return entropy, entropy.sum() / mx.maximum(free.sum(), 1)


@dataclass
class Draft:
    """What one denoising step produced, for live views (host copies)."""

    step: int
    tokens: np.ndarray  # the argmax canvas [C]
    accepted: np.ndarray  # bool [C]: positions that kept the denoiser's token
    mean_entropy: float
    fixed: np.ndarray | None = None  # bool [C]: clamped by a template or frozen by compaction


@dataclass
class CanvasResult:
    tokens: mx.array  # the committed (last argmax) canvas, [1, C]
    steps: int
    converged: bool  # the stop rule fired (as opposed to running out of steps)
    probs: mx.array | None = None  # the last step's tempered distribution [1, C, V]


def tempered_distribution(logits: mx.array, temperature: mx.array):
    """All the step needs from the vocabulary: tempered logits, probabilities, entropy (nats) and
    argmax, from one tempered log-softmax (numpy on the CPU, see cpu_kernels.py)."""
    if cpu_kernels.on_cpu():
        return cpu_kernels.tempered_distribution(logits, temperature)
    return _tempered_distribution(logits, temperature)


@mx.compile
def _tempered_distribution(logits: mx.array, temperature: mx.array):
    scaled = logits / temperature
    log_probs = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
    probs = mx.exp(log_probs)
    # The reference's Categorical.entropy clamps log-probabilities so that p = 0 adds 0, not nan.
    entropy = -(probs * mx.maximum(log_probs, _FLOAT32_MIN)).sum(axis=-1)
    return scaled, probs, entropy, mx.argmax(scaled, axis=-1).astype(mx.int32)


def accept_mask(entropy: mx.array, bound: float) -> mx.array:
    """Entropy-bound acceptance: with entropies sorted ascending, the j-th is accepted iff
    ``sum_{m<=j} H_(m) - H_(j) <= bound``; the lowest-entropy position always is."""
    order = mx.argsort(entropy, axis=-1)
    sorted_entropy = mx.take_along_axis(entropy, order, axis=-1)
    keep_sorted = mx.cumsum(sorted_entropy, axis=-1) - sorted_entropy <= bound
    # Scatter back: sorted position k holds the decision for canvas position order[k].
    return mx.take_along_axis(keep_sorted, mx.argsort(order, axis=-1), axis=-1)


class StopRule:
    """Stable and confident: the argmax canvas equals each of the last ``stability_threshold`` ones
    (the history starts at -1, so never on the first step; threshold 0 means always stable), and the
    mean entropy is below ``confidence_threshold``."""

    def __init__(self, settings: SamplerSettings, shape: tuple[int, ...]):
        self.history = [mx.full(shape, -1, dtype=mx.int32)] * settings.stability_threshold
        self.confidence = settings.confidence_threshold

    def __call__(self, argmax: mx.array, mean_entropy: mx.array) -> mx.array:
        stable = mx.array(True)
        for previous in self.history:
            stable = stable & mx.array_equal(previous, argmax)
        if self.history:
            self.history = self.history[1:] + [argmax]
        return stable & (mean_entropy < self.confidence)


def denoise_canvas(
    model,
    cache,
    settings: SamplerSettings,
    rng: Random,
    on_step: Callable[[Draft], None] | None = None,
    canvas_length: int | None = None,
    clamp: Clamp | None = None,
) -> CanvasResult:
    """Denoise one canvas after the prefix in ``cache`` (which this only reads); returns the commit.

    ``canvas_length`` defaults to the model's; a policy may denoise a shorter last canvas. ``clamp``
    fixes or limits positions (see ``Clamp``).
    """
    shape = (1, canvas_length or model.config.canvas_length)
    vocab = model.config.vocab_size
    canvas = rng.canvas(shape, vocab)
    if clamp is not None:
        canvas = clamp.apply(canvas)
    if settings.freeze_after:
        return _denoise_compacted(model, cache, settings, rng, on_step, canvas, clamp)
    stop_rule = StopRule(settings, shape)
    self_conditioning = self_conditioning_probs = None
    for step, temperature in enumerate(settings.temperatures(), start=1):
        logits = model.denoise(canvas, cache, self_conditioning, self_conditioning_probs)
        if clamp is not None:
            logits = clamp.restrict(logits)
        scaled, probs, entropy, argmax = tempered_distribution(logits, temperature)
        denoised = rng.categorical(probs)
        if clamp is None:
            mean_entropy = entropy.mean()
        else:
            entropy, mean_entropy = clamp.free_entropy(entropy)
            argmax = clamp.apply(argmax)
        accepted = accept_mask(entropy, settings.entropy_bound)
        canvas = mx.where(accepted, denoised, rng.renoise(shape, vocab))
        if clamp is not None:
            canvas = clamp.apply(canvas)
        stop = stop_rule(argmax, mean_entropy)
        self_conditioning, self_conditioning_probs = scaled, probs
        # The step's one wait for the device; reading what it evaluated costs nothing more.
        if on_step is None:
            mx.eval(stop, canvas, self_conditioning)
        else:
            mx.eval(stop, canvas, self_conditioning, argmax, accepted, mean_entropy)
            on_step(Draft(step, np.array(argmax[0]), np.array(accepted[0]), mean_entropy.item(),
                          None if clamp is None else np.array(clamp.fixed[0])))
        if stop.item():
            return _commit(CanvasResult(argmax, step, True, probs), clamp)
    return _commit(CanvasResult(argmax, settings.steps, False, probs), clamp)


def _commit(result: CanvasResult, clamp: Clamp | None) -> CanvasResult:
    if clamp is not None and clamp.finish is not None:
        result.tokens = clamp.finish(result.tokens, result.probs)
    return result


def _denoise_compacted(model, cache, settings: SamplerSettings, rng: Random, on_step, canvas: mx.array,
                       clamp: Clamp | None) -> CanvasResult:
    """The same loop with active-set compaction: positions that settled (accepted with an unchanged
    argmax for ``freeze_after`` steps) keep their token and their last K/V, and only the others are
    recomputed, so a step costs about the share of the canvas still moving. Not the reference's
    computation (settled positions stop seeing later changes); the fast policy measures what it costs
    in accuracy. Per-position bookkeeping is on the host: [C] numbers, one more sync per step."""
    from .model import FrozenCanvas

    shape, vocab = canvas.shape, model.config.vocab_size
    C = shape[1]
    stop_rule = StopRule(settings, shape)
    store = FrozenCanvas.empty(len(model.layers))
    fixed = np.zeros(C, dtype=bool) if clamp is None else np.array(clamp.fixed[0])
    active = np.arange(C)  # positions still computed
    frozen = np.zeros(C, dtype=bool)
    streak = np.zeros(C, dtype=np.int32)
    entropy_all = np.zeros(C, dtype=np.float32)
    argmax_all = np.full(C, -1, dtype=np.int32)
    tokens = np.array(canvas[0])
    probs_all = None  # [C, V] on the host, kept only when the clamp snaps choices from it
    self_conditioning = self_conditioning_probs = None
    for step, temperature in enumerate(settings.temperatures(), start=1):
        compact = len(active) < C
        index = mx.array(active.astype(np.int32)) if compact else None
        logits = model.denoise(mx.array(tokens[active])[None], cache, self_conditioning, self_conditioning_probs,
                               active=index, frozen=store)
        if clamp is not None:
            logits = clamp.restrict(logits, index)
        scaled, probs, entropy, argmax = tempered_distribution(logits, temperature)
        denoised = rng.categorical(probs)
        renoise = rng.renoise((1, len(active)), vocab)
        mx.eval(entropy, argmax, denoised, renoise)
        entropy_a, argmax_a = np.array(entropy[0]), np.array(argmax[0])
        if clamp is not None:
            argmax_a = np.where(fixed[active], tokens[active], argmax_a)
        budget = np.zeros(C, dtype=np.float32)
        budget[active] = np.where(fixed[active], 0.0, entropy_a)
        accepted = np.array(accept_mask(mx.array(budget), settings.entropy_bound)) | frozen
        new = np.where(accepted[active], np.array(denoised[0]), np.array(renoise[0]))
        tokens[active] = np.where(fixed[active], tokens[active], new)
        confident = entropy_a < settings.confidence_threshold  # as sure as the stop rule wants the canvas
        steady = accepted[active] & (argmax_a == argmax_all[active]) & (fixed[active] | ((new == argmax_a) & confident))
        streak[active] = np.where(steady, streak[active] + 1, 0)
        entropy_all[active], argmax_all[active] = entropy_a, argmax_a
        if probs_all is not None or (clamp is not None and clamp.finish is not None):
            probs_all = np.zeros((C, vocab), np.float32) if probs_all is None else probs_all
            probs_all[active] = np.array(probs[0])
        mean_entropy = mx.array(entropy_all[~fixed].mean() if (~fixed).any() else 0.0)
        stop = stop_rule(mx.array(argmax_all)[None], mean_entropy)
        settle = streak[active] >= settings.freeze_after
        if settle.any():
            rows = np.flatnonzero(settle)
            store.freeze(mx.array(rows.astype(np.int32)))
            frozen[active[rows]] = True
            tokens[active[rows]] = argmax_all[active[rows]]
            keep = mx.array(np.flatnonzero(~settle).astype(np.int32))
            active = active[~settle]
            scaled, probs = scaled[:, keep], probs[:, keep]
        self_conditioning, self_conditioning_probs = scaled, probs
        if on_step is not None:
            on_step(Draft(step, argmax_all.copy(), accepted.copy(), float(mean_entropy.item()), fixed | frozen))
        if stop.item() or len(active) == 0:
            result = CanvasResult(mx.array(argmax_all)[None], step, True)
            break
    else:
        result = CanvasResult(mx.array(argmax_all)[None], settings.steps, False)
    if probs_all is not None:
        result.probs = mx.array(probs_all)[None]
    return _commit(result, clamp)
