"""Active-set compaction (the fast policy): settled positions keep their K/V and are not recomputed.

The model-level computation is exact when the frozen K/V come from the canvas being denoised; the
sampler with nothing frozen replays the reference loop draw for draw; what freezing changes in
accuracy is measured by the benchmark, not asserted here.
"""

import mlx.core as mx
import numpy as np
import pytest

from checkpoint_tools import random_checkpoint
from mlx_dgemma import load
from mlx_dgemma.engine.denoise import denoise_canvas
from mlx_dgemma.engine.sampler import MxRandom, SamplerSettings

PROMPT = [2] + list(range(10, 50))  # longer than the pattern preset's sliding window


@pytest.fixture(scope="module", params=["pattern", "mixed"])
def model_and_cache(request, checkpoints):
    model, _ = load(checkpoints(request.param))
    cache = model.make_cache()
    model.encode(mx.array([PROMPT]), cache)
    return model, cache


def relative(a, b):
    return float(mx.abs(a - b).max() / mx.abs(b).max())


@pytest.mark.parametrize("self_conditioned", [False, True])
def test_compacted_denoise_matches_the_full_one(model_and_cache, self_conditioned):
    model, cache = model_and_cache
    C, V = model.config.canvas_length, model.config.vocab_size
    canvas = mx.random.randint(0, V, (1, C), key=mx.random.key(1))
    scaled = probs = None
    if self_conditioned:
        scaled = mx.random.normal((1, C, V), key=mx.random.key(2)) * 3
        probs = mx.softmax(scaled, axis=-1)
    view = cache.canvas_view(C)  # keeps each canvas position's K/V from when it was last computed
    full = model.denoise(canvas, view, scaled, probs)
    frozen_rows = np.array([0, 2, 3, C // 2, C - 1])
    active = np.setdiff1d(np.arange(C), frozen_rows).astype(np.int32)
    a = mx.array(active)
    part = model.denoise(
        canvas[:, a], view, None if scaled is None else scaled[:, a], None if probs is None else probs[:, a], active=a
    )
    assert part.shape == (1, len(active), V)
    assert relative(part, full[:, a]) < 1e-4


def test_explicit_positions_rotate_like_a_run(model_and_cache):
    model, cache = model_and_cache
    C, V = model.config.canvas_length, model.config.vocab_size
    canvas = mx.random.randint(0, V, (1, C), key=mx.random.key(3))
    full = model.denoise(canvas, cache)
    everything = model.denoise(canvas, cache.canvas_view(C), active=mx.arange(C, dtype=mx.int32))
    assert relative(everything, full) < 1e-4


def test_compaction_needs_a_view(model_and_cache):
    model, cache = model_and_cache
    with pytest.raises(ValueError, match="needs a CanvasView"):
        model.denoise(mx.zeros((1, 3), dtype=mx.int32), cache, active=mx.arange(3))


def test_nothing_frozen_is_the_reference_loop(model_and_cache):
    model, cache = model_and_cache
    reference = denoise_canvas(model, cache, SamplerSettings(steps=5), MxRandom(11))
    never = denoise_canvas(model, cache, SamplerSettings(steps=5, freeze_after=100), MxRandom(11))
    assert never.tokens.tolist() == reference.tokens.tolist() and never.steps == reference.steps


class CountingModel:
    """The model, recording how many canvas positions each denoising call computes."""

    def __init__(self, model):
        self.model, self.widths = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def denoise(self, canvas, *args, **kwargs):
        self.widths.append(canvas.shape[1])
        return self.model.denoise(canvas, *args, **kwargs)


def test_frozen_positions_stop_being_computed_and_keep_their_token(tmp_path):
    model, _ = load(random_checkpoint.build(tmp_path, "small", tame=True, converging=True))
    cache = model.make_cache()
    model.encode(mx.array([PROMPT[:9]]), cache)
    counting = CountingModel(model)
    drafts = []
    result = denoise_canvas(counting, cache, SamplerSettings(steps=8, freeze_after=1), MxRandom(0), drafts.append)
    C = model.config.canvas_length
    assert counting.widths[0] == C and counting.widths[-1] < C  # the active set shrank
    assert all(b <= a for a, b in zip(counting.widths, counting.widths[1:]))
    # A position computed in no later call kept the argmax it had when it froze, to the commit.
    for step, width in enumerate(counting.widths[1:], start=1):
        if width < counting.widths[step - 1]:
            settled = drafts[step - 1].tokens
            break
    later = np.array([d.tokens for d in drafts[step:]] + [np.array(result.tokens[0])])
    unchanged = (later == settled).all(axis=0)
    assert unchanged.sum() >= C - counting.widths[step]
