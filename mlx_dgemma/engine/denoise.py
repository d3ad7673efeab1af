"""The denoising forwards that drive canvas runs (sampler.py's step math): ``new_run`` starts one,
``step_batch`` and ``step_compacted`` are one step of the runs of a lane (the engine's diffusion rows
group them: rows/diffusion.py), ``denoise_canvas`` drives one canvas from its first draft to its
commit.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from ..model.cache import CanvasView
from ..structured.template import Clamp
from .sampler import CanvasResult, CanvasRun, CompactedRun, Draft, Random, RunBatch, SamplerSettings


def new_run(
    model,
    settings: SamplerSettings,
    rng: Random,
    length: int | None = None,
    clamp: Clamp | None = None,
    on_step: Callable[[Draft], None] | None = None,
) -> CanvasRun:
    """A canvas run of ``length`` (default: the model's canvas) after whatever prefix it is denoised on."""
    kind = CompactedRun if settings.freeze_after else CanvasRun
    return kind(
        settings, rng, length or model.config.canvas_length, model.config.vocab_size, model.kernels, clamp, on_step
    )


def step_batch(model, view: CanvasView, batch: RunBatch) -> CanvasView | None:
    """One denoising step of every run in ``batch`` (the rows of ``view``, in order); returns the
    view of the rows that go on (None when none does)."""
    canvas, self_conditioning, self_conditioning_probs, conditioned = batch.inputs()
    logits = model.denoise(canvas, view, self_conditioning, self_conditioning_probs, self_conditioned_rows=conditioned)
    mx.eval(batch.advance(logits))
    before = len(batch.runs)
    kept = batch.settle()
    if not kept:
        return None
    return view.select(kept) if len(kept) < before else view


def step_compacted(
    model, view: CanvasView, runs: list[CompactedRun]
) -> tuple[CanvasView | None, list[int], dict[int, Exception]]:
    """One denoising step of runs under active-set compaction (the rows of ``view``, in order; a run
    may be at its first step while the others are not); returns the view of the rows that go on
    (None when none does), their indexes, and the runs whose own step raised (index -> the error;
    they go on no more, the others as they would alone)."""
    inputs = [run.inputs() for run in runs]
    tokens, self_conditioning, self_conditioning_probs, active, conditioned = _stack(inputs, runs[0].length)
    logits = model.denoise(
        tokens, view, self_conditioning, self_conditioning_probs, active, self_conditioned_rows=conditioned
    )
    pending, failed = [], {}
    for i, run in enumerate(runs):
        try:
            pending += run.advance(logits[i : i + 1, : inputs[i][0].shape[1]])
        except Exception as e:
            failed[i] = e
    mx.eval(pending)
    for i, run in enumerate(runs):
        if i not in failed:
            try:
                run.settle()
            except Exception as e:
                failed[i] = e
    keep = [i for i, run in enumerate(runs) if run.result is None and i not in failed]
    if not keep:
        return None, keep, failed
    return (view.select(keep) if len(keep) < len(runs) else view), keep, failed


def _stack(inputs, length: int):
    """One batch of forward inputs from the rows' own; under compaction the rows' active sets are
    padded to the longest by repeating their last index (the same position computed twice, written
    to the same slot with the same K/V, its extra logits ignored). A row at its first step (no
    self-conditioning yet) beside rows that have one gets zeros, switched off by the returned
    self-conditioned rows [B] (None: all rows alike)."""
    tokens, sc, sc_probs, active = zip(*inputs)
    if len(tokens) == 1:
        return tokens[0], sc[0], sc_probs[0], None if active[0] is None else active[0][None], None
    conditioned = None
    if any(s is None for s in sc) and not all(s is None for s in sc):
        conditioned = mx.array([s is not None for s in sc])
        like = next(s for s in sc if s is not None)
        sc = [s if s is not None else mx.zeros((1, t.shape[1], like.shape[-1]), like.dtype) for s, t in zip(sc, tokens)]
        sc_probs = [
            p if p is not None else mx.zeros((1, t.shape[1], like.shape[-1]), like.dtype)
            for p, t in zip(sc_probs, tokens)
        ]
    if all(a is None for a in active):
        return (
            mx.concatenate(tokens),
            None if sc[0] is None else mx.concatenate(sc),
            None if any(p is None for p in sc_probs) else mx.concatenate(sc_probs),
            None,
            conditioned,
        )
    active = [mx.arange(length, dtype=mx.int32) if a is None else a for a in active]
    width = max(a.shape[0] for a in active)

    def pad(x, axis):
        extra = width - x.shape[axis]
        if not extra:
            return x
        last = mx.take(x, mx.array([x.shape[axis] - 1]), axis=axis)
        return mx.concatenate([x, mx.repeat(last, extra, axis=axis)], axis=axis)

    return (
        mx.concatenate([pad(t, 1) for t in tokens]),
        None if sc[0] is None else mx.concatenate([pad(s, 1) for s in sc]),
        None if any(p is None for p in sc_probs) else mx.concatenate([pad(p, 1) for p in sc_probs]),
        mx.stack([pad(a, 0) for a in active]),
        conditioned,
    )


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
    run = new_run(model, settings, rng, canvas_length, clamp, on_step)
    view = cache.canvas_view(run.length)
    if type(run) is CanvasRun:
        batch = RunBatch([run])
        while view is not None:
            view = step_batch(model, view, batch)
    else:
        while view is not None:
            view, _, failed = step_compacted(model, view, [run])
            if failed:
                raise failed[0]
    return run.result
