"""One canvas of DiffusionGemma's denoising loop, exactly as the reference ``generate()`` runs it.

Per step (``cur`` counts down N..1): denoise the canvas; divide the logits by
``T = t_min + (t_max - t_min) * cur / N``; sample a denoiser canvas from the tempered distribution;
accept the lowest-entropy positions whose summed entropy stays within the bound; renoise every other
position uniformly; stop once the argmax canvas is stable and the mean entropy is below the
confidence threshold. The tempered logits self-condition the next step; the last argmax is committed.

A ``template.Clamp`` fixes some canvas positions: they hold their token from the
first draft to the commit, are always accepted, never renoised, and take no part in the entropy
budget or the stop rule's mean entropy; other positions may be limited to a class of tokens. With no
clamp the loop is the reference's, draw for draw.

All randomness goes through one small object (``Random``) so tests can replay the reference's draws.

A canvas in progress is a ``CanvasRun`` (``CompactedRun`` under active-set compaction): it says what
the next forward should compute and takes that forward's logits. The loop that runs the model and
hands it those logits is denoise.py's.
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import mlx.core as mx

from ..errors import OptionError
from ..model import kernels as device_kernels
from ..model.config import GenerationConfig
from ..structured.template import Clamp
from ..validate import (
    MAX_STEPS,
    check_entropy_bound,
    check_min_p,
    check_penalty,
    check_repetition_penalty,
    check_temperature,
    check_temperatures,
    check_top_k,
    check_top_p,
    integer_in,
)
from .filters import filtering, sampling_probs

_check_freeze_after = integer_in(0, MAX_STEPS)  # (past a canvas's steps, nothing freezes)


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
        if seed is None:
            from ..distributed import from_rank0

            seed = from_rank0(secrets.randbits(32))  # under mx.distributed every rank draws rank 0's seed
        self.seed = seed
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
    # The draws (filters.sampling_probs): each position's token is drawn at draw_temperature times the
    # step's temperature (1: the schedule's, the reference; 0: the argmax), through the filters
    # (top_p 1, top_k 0 and min_p 0 are off; they apply to autoregressive and verified tokens too).
    draw_temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    # Autoregressive decoding only (filters.penalized; 1, 0 and 0 are off).
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        if not isinstance(self.steps, int) or self.steps < 1:
            raise OptionError(f"steps must be a positive integer, got {self.steps!r}")
        check_entropy_bound(self.entropy_bound)
        check_temperatures(self.t_min, self.t_max)
        if not isinstance(self.stability_threshold, int) or self.stability_threshold < 0:
            raise OptionError(f"stability threshold must be an integer >= 0, got {self.stability_threshold!r}")
        if not self.confidence_threshold > 0:
            raise OptionError(f"confidence threshold must be > 0, got {self.confidence_threshold}")
        _check_freeze_after(self.freeze_after, "freeze_after")
        check_temperature(self.draw_temperature, "temperature")
        check_top_p(self.top_p, "top_p")
        check_top_k(self.top_k, "top_k")
        check_min_p(self.min_p, "min_p")
        check_repetition_penalty(self.repetition_penalty, "repetition_penalty")
        check_penalty(self.presence_penalty, "presence_penalty")
        check_penalty(self.frequency_penalty, "frequency_penalty")

    @property
    def penalties(self) -> tuple[float, float, float]:
        """(repetition, presence, frequency), as ``filters.penalized`` takes them."""
        return self.repetition_penalty, self.presence_penalty, self.frequency_penalty

    @property
    def penalizing(self) -> bool:
        return self.penalties != (1.0, 0.0, 0.0)

    @property
    def filters(self) -> tuple[float, int, float]:
        """(top_p, top_k, min_p), as ``filters.sampling_probs`` takes them after the temperature."""
        return self.top_p, self.top_k, self.min_p

    @property
    def plain_draws(self) -> bool:
        """Whether the draws are the reference's: from the step's tempered distribution itself."""
        return self.draw_temperature == 1 and not filtering(*self.filters)

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

    def temperature(self, step: int) -> mx.array:
        """The temperature of step ``step`` (0 is the first), rounded as the reference computes it: in
        float32, because its step counter is an int32 tensor. A function of the step, so no schedule
        of ``steps`` entries is ever held."""
        cur = self.steps - step
        span, low = _f32(self.t_max - self.t_min), _f32(self.t_min)
        return mx.array(_f32(low + _f32(span * _f32(cur / self.steps))))

    def draws(self, scaled: mx.array, probs: mx.array) -> mx.array:
        """What a step draws each position from, given its tempered logits ``scaled`` and their
        distribution ``probs`` (the reference's draws: ``probs`` itself)."""
        if self.plain_draws:
            return probs
        return sampling_probs(scaled, self.draw_temperature, *self.filters)


def _f32(x: float) -> float:
    """x rounded to float32: an operation on float32 values done in float64 and rounded so is the
    float32 operation's result (correctly rounded), with no numpy."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass
class Draft:
    """What one denoising step produced, for live views (host copies)."""

    step: int
    tokens: list[int]  # the argmax canvas [C]
    accepted: list[bool]  # [C]: positions that kept the denoiser's token
    mean_entropy: float
    fixed: list[bool] | None = None  # [C]: clamped by a template or frozen by compaction


@dataclass
class CanvasResult:
    tokens: mx.array  # the committed (last argmax) canvas, [1, C]
    steps: int
    converged: bool  # the stop rule fired (as opposed to running out of steps)
    probs: mx.array | None = None  # the last step's tempered distribution [1, C, V]


def tempered_distribution(logits: mx.array, temperature: mx.array, kernels: device_kernels.Kernels | None = None):
    """All the step needs from the vocabulary: tempered logits, probabilities, entropy (nats) and
    argmax, from one tempered log-softmax."""
    return (kernels or device_kernels.for_device()).tempered_distribution(logits, temperature)


def accept_mask(entropy: mx.array, bound: float) -> mx.array:
    """Entropy-bound acceptance: with entropies sorted ascending, the j-th is accepted iff
    ``sum_{m<=j} H_(m) - H_(j) <= bound``; the lowest-entropy position always is."""
    order = mx.argsort(entropy, axis=-1)
    sorted_entropy = mx.take_along_axis(entropy, order, axis=-1)
    keep_sorted = mx.cumsum(sorted_entropy, axis=-1) - sorted_entropy <= bound
    # Scatter back: sorted position k holds the decision for canvas position order[k].
    return mx.take_along_axis(keep_sorted, mx.argsort(order, axis=-1), axis=-1)


class StopRule:
    """Stable and confident, per row: the argmax canvas [B, C] equals each of the last
    ``stability_threshold`` ones (the history starts at -1, so never on the first step; threshold 0
    means always stable), and the mean entropy [B] is below ``confidence_threshold``."""

    def __init__(self, settings: SamplerSettings, shape: tuple[int, ...], confidence: list[float] | None = None):
        """``confidence``: each row's threshold (default: the settings' for every row)."""
        self.history = [mx.full(shape, -1, dtype=mx.int32)] * settings.stability_threshold
        self.confidence = mx.array(confidence or [settings.confidence_threshold] * shape[0])

    def __call__(self, argmax: mx.array, mean_entropy: mx.array) -> mx.array:
        stable = mx.ones(argmax.shape[:-1], dtype=mx.bool_)
        for previous in self.history:
            stable = stable & mx.all(previous == argmax, axis=-1)
        if self.history:
            self.history = self.history[1:] + [argmax]
        return stable & (mean_entropy < self.confidence)

    def select(self, rows: mx.array) -> None:
        """Keep ``rows`` only."""
        self.history = [h[rows] for h in self.history]
        self.confidence = self.confidence[rows]

    def extend(self, other: StopRule) -> None:
        """Append ``other``'s rows."""
        self.history = [mx.concatenate([a, b]) for a, b in zip(self.history, other.history)]
        self.confidence = mx.concatenate([self.confidence, other.confidence])


class CanvasRun:
    """One row's canvas: its settings, draws, clamp and live view, and, once committed, ``result``.
    Plain runs (the reference loop) advance together in a ``RunBatch``; ``CompactedRun`` advances
    alone."""

    def __init__(
        self,
        settings: SamplerSettings,
        rng: Random,
        length: int,
        vocab: int,
        kernels: device_kernels.Kernels,
        clamp: Clamp | None = None,
        on_step: Callable[[Draft], None] | None = None,
    ):
        self.settings, self.rng, self.vocab, self.kernels = settings, rng, vocab, kernels
        self.clamp, self.on_step = clamp, on_step
        self.shape = (1, length)
        canvas = rng.canvas(self.shape, vocab)
        self.canvas = canvas if clamp is None else clamp.apply(canvas)
        self.step = 0
        self.result: CanvasResult | None = None

    @property
    def length(self) -> int:
        return self.shape[1]


class RunBatch:
    """Plain canvas runs of one length, advanced together: the vocabulary-wide distribution,
    acceptance and stop rule of every row in one set of batched operations (each row keeps its own
    draws, settings, clamp and step, so a row gives what it gives alone). Runs may join between
    steps (``add``: continuous batching) and leave when committed. ``inputs()`` for the next
    forward, ``advance`` with its logits (lazy; returns what to evaluate), then ``settle()``."""

    def __init__(self, runs: list[CanvasRun]):
        self.runs: list[CanvasRun] = []
        self.threshold = runs[0].settings.stability_threshold
        self.add(runs)

    def add(self, runs: list[CanvasRun]) -> None:
        """Runs that start now (their first step comes with the others' next one)."""
        if any(run.settings.stability_threshold != self.threshold for run in runs):
            raise ValueError("the runs of one batch must share the stability threshold")
        C, V = runs[0].length, runs[0].vocab
        fresh = StopRule(runs[0].settings, (len(runs), C), [run.settings.confidence_threshold for run in runs])
        fixed = [run.clamp.fixed if run.clamp else mx.zeros((1, C), dtype=mx.bool_) for run in runs]
        tokens = [run.clamp.tokens if run.clamp else mx.zeros((1, C), dtype=mx.int32) for run in runs]
        state = dict(
            canvas=mx.concatenate([run.canvas for run in runs]),
            fixed=mx.concatenate(fixed),
            tokens=mx.concatenate(tokens),
            bound=mx.array([[run.settings.entropy_bound] for run in runs]),
        )
        if not self.runs:
            for name, value in state.items():
                setattr(self, name, value)
            self.stop_rule, self.conditioned = fresh, [False] * len(runs)
            self.self_conditioning = self.self_conditioning_probs = None
        else:
            for name, value in state.items():
                setattr(self, name, mx.concatenate([getattr(self, name), value]))
            self.stop_rule.extend(fresh)
            self.conditioned += [False] * len(runs)
            if self.self_conditioning is not None:  # zeros, switched off for the new rows (see inputs)
                none = mx.zeros((len(runs), C, V), dtype=self.self_conditioning.dtype)
                self.self_conditioning = mx.concatenate([self.self_conditioning, none])
                self.self_conditioning_probs = mx.concatenate([self.self_conditioning_probs, none])
        self.runs += runs
        self.clamped = any(run.clamp is not None for run in self.runs)
        self.free = mx.maximum(mx.logical_not(self.fixed).sum(axis=-1), 1)

    def inputs(self) -> tuple[mx.array, mx.array | None, mx.array | None, mx.array | None]:
        """Canvas tokens [B, C]; self-conditioning logits and probabilities [B, C, V], or None before
        any row has a step behind it; which rows are self-conditioned [B] (None: all)."""
        if all(self.conditioned):
            return self.canvas, self.self_conditioning, self.self_conditioning_probs, None
        if not any(self.conditioned):
            return self.canvas, None, None, None
        return self.canvas, self.self_conditioning, self.self_conditioning_probs, mx.array(self.conditioned)

    def advance(self, logits: mx.array) -> list[mx.array]:
        runs = self.runs
        kernels, vocab, shape = runs[0].kernels, runs[0].vocab, (1, runs[0].length)
        if any(run.clamp is not None and run.clamp.bias is not None for run in runs):
            logits = mx.concatenate(
                [
                    logits[i : i + 1] if run.clamp is None else run.clamp.restrict(logits[i : i + 1])
                    for i, run in enumerate(runs)
                ]
            )
        temperature = mx.stack([run.settings.temperature(run.step) for run in runs])[:, None, None]
        for run in runs:
            run.step += 1
        scaled, probs, entropy, argmax = tempered_distribution(logits, temperature, kernels)
        denoised = mx.concatenate(
            [run.rng.categorical(run.settings.draws(scaled[i : i + 1], probs[i : i + 1])) for i, run in enumerate(runs)]
        )
        renoise = mx.concatenate([run.rng.renoise(shape, vocab) for run in runs])
        if self.clamped:
            entropy = mx.where(self.fixed, 0.0, entropy)  # fixed positions: accepted first, costing nothing
            mean_entropy = entropy.sum(axis=-1) / self.free
            argmax = mx.where(self.fixed, self.tokens, argmax)
        else:
            mean_entropy = entropy.mean(axis=-1)
        accepted = accept_mask(entropy, self.bound)
        canvas = mx.where(accepted, denoised, renoise)
        self.canvas = mx.where(self.fixed, self.tokens, canvas) if self.clamped else canvas
        self.stop = self.stop_rule(argmax, mean_entropy)
        self.self_conditioning, self.self_conditioning_probs = scaled, probs
        self.conditioned = [True] * len(runs)
        self._draft = (argmax, accepted, mean_entropy)
        # The step's one wait for the device; reading what it evaluated costs nothing more.
        pending = [self.stop, self.canvas, scaled]
        return pending + [argmax, accepted, mean_entropy] if any(run.on_step for run in runs) else pending

    def settle(self) -> list[int]:
        """Hand each row its step and commit the rows that are done (they leave); returns the
        indexes (among the rows before) of those that go on."""
        argmax, accepted, mean_entropy = self._draft
        stops = self.stop.tolist()
        keep = []
        for i, run in enumerate(self.runs):
            if run.on_step is not None:
                fixed = None if run.clamp is None else run.clamp.fixed[0].tolist()
                run.on_step(Draft(run.step, argmax[i].tolist(), accepted[i].tolist(), mean_entropy[i].item(), fixed))
            if stops[i] or run.step == run.settings.steps:
                probs = self.self_conditioning_probs[i : i + 1]
                run.result = _commit(CanvasResult(argmax[i : i + 1], run.step, bool(stops[i]), probs), run.clamp)
            else:
                keep.append(i)
        if len(keep) < len(self.runs):
            self.select(keep)
        return keep

    def select(self, keep: list[int]) -> None:
        """Only the ``keep``-th rows go on."""
        self.runs = [self.runs[i] for i in keep]
        self.conditioned = [self.conditioned[i] for i in keep]
        if not keep:
            return
        index = mx.array(keep, dtype=mx.int32)
        for name in ("canvas", "fixed", "tokens", "free", "bound"):
            setattr(self, name, getattr(self, name)[index])
        if self.self_conditioning is not None:
            self.self_conditioning = self.self_conditioning[index]
            self.self_conditioning_probs = self.self_conditioning_probs[index]
        self.stop_rule.select(index)
        self.clamped = any(run.clamp is not None for run in self.runs)


class CompactedRun(CanvasRun):
    """The same loop with active-set compaction: positions that settled (accepted with an unchanged
    argmax and an entropy under the stop rule's threshold for ``freeze_after`` steps) keep their
    token and their last K/V (in the canvas view), and only the others are recomputed, so a step
    costs about the share of the canvas still moving. Not the reference's computation (settled
    positions stop seeing later changes); the fast policy measures what it costs in accuracy.
    Which positions are still computed is known on the host: one more sync per step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        C = self.length
        self.stop_rule = StopRule(self.settings, self.shape)
        self.self_conditioning = self.self_conditioning_probs = None
        self.fixed = mx.zeros((C,), dtype=mx.bool_) if self.clamp is None else self.clamp.fixed[0]
        self.free = C if self.clamp is None else int((~self.fixed).sum().item())
        self.active = list(range(C))  # positions still computed
        self.frozen = mx.zeros((C,), dtype=mx.bool_)
        self.streak = mx.zeros((C,), dtype=mx.int32)
        self.entropy_all = mx.zeros((C,), dtype=mx.float32)
        self.argmax_all = mx.full((C,), -1, dtype=mx.int32)
        self.tokens = self.canvas[0]
        self.probs_all = None  # [C, V], kept only when the clamp snaps choices from it

    def _index(self) -> mx.array:
        return mx.array(self.active, dtype=mx.int32)

    def inputs(self):
        index = self._index()
        return (
            self.tokens[index][None],
            self.self_conditioning,
            self.self_conditioning_probs,
            index if len(self.active) < self.length else None,
        )

    def advance(self, logits: mx.array) -> list[mx.array]:
        settings, clamp = self.settings, self.clamp
        C, A = self.length, len(self.active)
        index = self._index()
        temperature = settings.temperature(self.step)
        self.step += 1
        if clamp is not None:
            logits = clamp.restrict(logits, index if A < C else None)
        scaled, probs, entropy, argmax = tempered_distribution(logits, temperature, self.kernels)
        denoised = self.rng.categorical(settings.draws(scaled, probs))[0]
        renoise = self.rng.renoise((1, A), self.vocab)[0]
        entropy_a, argmax_a, fixed_a, tokens_a = entropy[0], argmax[0], self.fixed[index], self.tokens[index]
        if clamp is not None:
            argmax_a = mx.where(fixed_a, tokens_a, argmax_a)
        budget = mx.zeros((C,), dtype=mx.float32)
        budget[index] = mx.where(fixed_a, 0.0, entropy_a)
        accepted = accept_mask(budget, settings.entropy_bound) | self.frozen
        accepted_a = accepted[index]
        new = mx.where(accepted_a, denoised, renoise)
        self.tokens[index] = mx.where(fixed_a, tokens_a, new)
        confident = entropy_a < settings.confidence_threshold  # as sure as the stop rule wants the canvas
        steady = accepted_a & (argmax_a == self.argmax_all[index]) & (fixed_a | ((new == argmax_a) & confident))
        self.streak[index] = mx.where(steady, self.streak[index] + 1, 0)
        self.entropy_all[index] = entropy_a
        self.argmax_all[index] = argmax_a
        if self.probs_all is not None or (clamp is not None and clamp.finish is not None):
            if self.probs_all is None:
                self.probs_all = mx.zeros((C, self.vocab), dtype=mx.float32)
            self.probs_all[index] = probs[0]
        free_entropy = mx.where(self.fixed, 0.0, self.entropy_all).sum()
        mean_entropy = free_entropy / self.free if self.free else mx.array(0.0)
        self.stop = self.stop_rule(self.argmax_all[None], mean_entropy)
        # Which positions freeze is read in settle(), with the rest of the step: runs stepped together
        # (step_compacted) then wait once for all of them, not once each.
        self._freezing = self.streak[index] >= settings.freeze_after
        self.self_conditioning, self.self_conditioning_probs = scaled, probs
        self._draft = (accepted, mean_entropy)
        return [self.stop, scaled, self.tokens, self._freezing]

    def _freeze(self) -> None:
        """Positions steady for ``freeze_after`` steps keep their token and K/V from now on."""
        freezing = self._freezing.tolist()
        if any(freezing):
            rows = mx.array([p for p, f in zip(self.active, freezing) if f], dtype=mx.int32)
            self.frozen[rows] = True
            self.tokens[rows] = self.argmax_all[rows]
            keep = [i for i, f in enumerate(freezing) if not f]
            self.active = [self.active[i] for i in keep]
            keep = mx.array(keep, dtype=mx.int32)
            self.self_conditioning = self.self_conditioning[:, keep]
            self.self_conditioning_probs = self.self_conditioning_probs[:, keep]

    def settle(self) -> None:
        self._freeze()
        accepted, mean_entropy = self._draft
        if self.on_step is not None:
            self.on_step(
                Draft(
                    self.step,
                    self.argmax_all.tolist(),
                    accepted.tolist(),
                    mean_entropy.item(),
                    (self.fixed | self.frozen).tolist(),
                )
            )
        converged = bool(self.stop.item()) or not self.active
        if converged or self.step == self.settings.steps:
            result = CanvasResult(self.argmax_all[None], self.step, converged)
            if self.probs_all is not None:
                result.probs = self.probs_all[None]
            self.result = _commit(result, self.clamp)


def _commit(result: CanvasResult, clamp: Clamp | None) -> CanvasResult:
    if clamp is not None and clamp.finish is not None:
        result.tokens = clamp.finish(result.tokens, result.probs)
    return result
