"""The sampler against the reference: the reference's generate() runs on random checkpoints while every
random draw it makes is recorded; ours then runs with those draws replayed. Committed tokens, steps per
canvas and every step's argmax draft must be identical. Plus the sampler's pieces (temperature,
acceptance, stop rule) against the reference's own classes, and the default rng's distributions."""

import contextlib
import json
import shutil
from unittest import mock

import mlx.core as mx
import numpy as np
import pytest
import torch
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    EntropyBoundSampler,
    EntropyBoundSamplerConfig,
    LinearTemperatureScheduleLogitsProcessor,
    StableAndConfidentStoppingCriteria,
)

from checkpoint_tools import random_checkpoint
from mlx_dgemma import load, stream_generate
from mlx_dgemma.engine.sampler import MxRandom, SamplerSettings, StopRule, accept_mask, tempered_distribution

from .reference import load_reference

PROMPT = [2, 105, 10, 11, 12, 13, 14, 106, 15, 40, 41, 42, 43, 44]
SMALL = random_checkpoint.PRESETS["small"]
C, V = SMALL["canvas_length"], SMALL["vocab_size"]
STEPS = 8  # the random checkpoints' max_denoising_steps


# "tame" (soft attention): with the raw random init's very peaked attention, the ~1e-6 difference
# between our logits and the reference's grows ~3x per step through the self-conditioning chain until
# it flips an expert choice, and then the canvases differ. Soft attention keeps it at ~1e-6.
@pytest.fixture(scope="module")
def small(checkpoints):
    return checkpoints("small", tame=True)


@pytest.fixture(scope="module")
def converging(tmp_path_factory):
    return random_checkpoint.build(tmp_path_factory.mktemp("converging"), "small", tame=True, converging=True)


def variant(path, out, **generation):
    """A copy of a checkpoint with generation_config.json entries replaced (both sides read it)."""
    shutil.copytree(path, out)
    file = out / "generation_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **generation}))
    return out


@contextlib.contextmanager
def recorded_draws():
    """Record what torch.randint / torch.multinomial return while the reference generates."""
    draws = []

    def recording(kind, draw):
        def wrapper(*args, **kwargs):
            out = draw(*args, **kwargs)
            draws.append((kind, out.clone(), kwargs.get("high")))
            return out

        return wrapper

    with (
        mock.patch.object(torch, "randint", recording("uniform", torch.randint)),
        mock.patch.object(torch, "multinomial", recording("categorical", torch.multinomial)),
    ):
        yield draws


class ReplayRandom:
    """Our rng interface, handing out the reference's recorded draws in order."""

    def __init__(self, draws):
        self.draws, self.used = draws, 0

    def _next(self, kind, shape, vocab=None):
        assert self.used < len(self.draws), "we drew more than the reference"
        recorded, value, high = self.draws[self.used]
        self.used += 1
        assert recorded == kind, f"draw {self.used}: we asked for {kind}, the reference drew {recorded}"
        assert value.numel() == int(np.prod(shape)) and (vocab is None or vocab == high)
        return mx.array(value.reshape(shape).cpu().numpy().astype(np.int32))

    def canvas(self, shape, vocab):
        return self._next("uniform", shape, vocab)

    renoise = canvas

    def categorical(self, probs):
        return self._next("categorical", probs.shape[:-1])


class DraftRecorder:
    """A reference streamer: put_draft gets each step's argmax canvas, put each committed canvas."""

    def __init__(self):
        self.canvases, self.current, self.prompt_seen = [], [], False

    def put(self, value):
        if self.prompt_seen:
            self.canvases.append(self.current)
            self.current = []
        self.prompt_seen = True

    def put_draft(self, value):
        self.current.append(value[0].tolist())

    def end(self):
        pass


def run_reference(path, max_tokens, seed=1234, prompt=PROMPT):
    model = load_reference(path)
    streamer = DraftRecorder()
    torch.manual_seed(seed)
    with recorded_draws() as draws:
        out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=max_tokens, streamer=streamer)
    return out.sequences[0, len(prompt) :].tolist(), streamer.canvases, float(out.tokens_per_forward[0]), draws


def run_ours(path, max_tokens, draws, prompt=PROMPT):
    model, tokenizer = load(path)
    rng = ReplayRandom(draws)
    responses = list(stream_generate(model, tokenizer, prompt, max_tokens, rng=rng, drafts=True))
    assert rng.used == len(rng.draws), f"we used {rng.used} of the reference's {len(rng.draws)} draws"
    pad, canvas = tokenizer.pad_token_id, model.config.canvas_length
    tokens = []
    for r in responses:
        commit = list(r.drafts[-1].tokens)  # the whole canvas (the reference returns it all)
        if r.finish_reason == "length":  # handed out only up to max_tokens
            assert r.tokens == commit[: len(r.tokens)] and len(tokens) + len(r.tokens) == max_tokens
            tokens += commit
        else:
            tokens += r.tokens + [pad] * (canvas - len(r.tokens))
    return tokens, responses


def assert_replay_matches(path, max_tokens, prompt=PROMPT):
    ref_tokens, ref_drafts, ref_tpf, draws = run_reference(path, max_tokens, prompt=prompt)
    tokens, responses = run_ours(path, max_tokens, draws, prompt)
    assert tokens == ref_tokens
    assert [r.steps for r in responses] == [len(d) for d in ref_drafts]
    assert [[d.tokens for d in r.drafts] for r in responses] == ref_drafts
    assert responses[-1].tokens_per_forward == pytest.approx(ref_tpf)
    return ref_tokens, ref_drafts, responses


def test_one_canvas(small):
    tokens, drafts, responses = assert_replay_matches(small, max_tokens=C)
    assert len(tokens) == C and [len(d) for d in drafts] == [STEPS]
    assert responses[-1].finish_reason == "length"


@pytest.mark.parametrize("preset", ["small", "mixed"])
def test_three_canvases(checkpoints, preset):
    canvas = random_checkpoint.PRESETS[preset]["canvas_length"]
    # 3C - 5 new tokens round up to three whole canvases, as in the reference; 3C - 5 are handed out.
    tokens, drafts, responses = assert_replay_matches(checkpoints(preset, tame=True), max_tokens=3 * canvas - 5)
    assert len(tokens) == 3 * canvas and len(responses) == 3
    assert sum(len(r.tokens) for r in responses) == responses[-1].generation_tokens == 3 * canvas - 5
    assert [r.finish_reason for r in responses] == [None, None, "length"]


def test_stop_id_inside_a_canvas(small, tmp_path):
    # Make a token of the second canvas a stop id: one that first appears in its middle.
    tokens, _, _, _ = run_reference(small, 3 * C)
    position = next(p for p in range(C + 1, 2 * C - 1) if tokens[p] not in tokens[:p] and tokens[p] != 0)
    stop_id = tokens[position]
    path = variant(small, tmp_path / "stop", eos_token_id=[stop_id])

    ref_tokens, _, responses = assert_replay_matches(path, max_tokens=3 * C)
    assert len(ref_tokens) == 2 * C  # the reference stopped after the second canvas …
    assert ref_tokens[position] == stop_id and set(ref_tokens[position + 1 :]) == {0}  # … padded after the stop
    assert [r.finish_reason for r in responses] == [None, "stop"]
    assert responses[-1].tokens == tokens[C : position + 1]


def test_stop_rule_fires_before_the_step_limit(converging):
    _, drafts, responses = assert_replay_matches(converging, max_tokens=3 * C)
    steps = [len(d) for d in drafts]
    assert len(steps) == 3 and max(steps) < STEPS, f"the checkpoint did not converge early: {steps}"


@pytest.mark.parametrize("stability", [0, 2])
def test_stop_rule_with_other_stability_thresholds(converging, tmp_path, stability):
    path = variant(converging, tmp_path / f"stability{stability}", stability_threshold=stability)
    _, drafts, _ = assert_replay_matches(path, max_tokens=2 * C)
    assert max(len(d) for d in drafts) < STEPS


def test_other_sampler_settings(converging, tmp_path):
    path = variant(
        converging,
        tmp_path / "settings",
        max_denoising_steps=5,
        t_min=0.2,
        t_max=1.1,
        confidence_threshold=0.05,
        sampler_config={"entropy_bound": 0.5, "_cls_name": "EntropyBoundSamplerConfig"},
    )
    assert_replay_matches(path, max_tokens=2 * C)


# The pieces of a step, against the reference's classes on the same logits.


def test_temperature_schedule_rounds_like_the_reference():
    logits = torch.randn(1, 4, 50, generator=torch.Generator().manual_seed(0)) * 10
    for steps, t_min, t_max in [(48, 0.4, 0.8), (7, 0.1, 1.3), (16, 0.0, 0.7)]:
        settings = SamplerSettings(steps=steps, t_min=t_min, t_max=t_max)
        processor = LinearTemperatureScheduleLogitsProcessor(t_min, t_max, steps)
        for step, cur in enumerate(range(steps, 0, -1)):
            temperature = settings.temperature(step)
            # The reference's step counter is an int32 tensor (generate's _denoising_step).
            ref = processor(None, logits, torch.tensor(cur, dtype=torch.int32)).numpy()
            ours = np.array(tempered_distribution(mx.array(logits.numpy()), temperature)[0])
            assert np.array_equal(ours, ref), (steps, cur)


@pytest.mark.parametrize("sharpness", [1.0, 8.0, 40.0])
@pytest.mark.parametrize("bound", [0.1, 2.0])
def test_acceptance_and_entropy_match_the_reference(sharpness, bound):
    logits = torch.randn(1, 64, 300, generator=torch.Generator().manual_seed(int(sharpness))) * sharpness
    sampler = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=bound), 64, 300, 8)
    current, denoised = torch.zeros(1, 64, dtype=torch.long), torch.ones(1, 64, dtype=torch.long)
    sampler.accept_canvas(current, denoised, logits, 1)
    expected = sampler.accepted_token_mask.numpy()

    _, _, entropy, _ = tempered_distribution(mx.array(logits.numpy()), mx.array(1.0))
    ref_entropy = torch.distributions.Categorical(logits=logits).entropy().numpy()
    np.testing.assert_allclose(np.array(entropy), ref_entropy, rtol=1e-5, atol=1e-5)  # fp32 log-softmax rounding
    assert np.array_equal(np.array(accept_mask(entropy, bound)), expected)
    assert 0 < expected.sum() < 64 or sharpness == 40.0  # the cases accept some positions, not all


def test_stop_rule_matches_the_reference():
    rng = np.random.default_rng(0)
    sharp = rng.normal(size=(1, 6, 30)) * 200
    argmaxes = [np.array([[1, 2, 3, 4, 5, 6]]), np.array([[1, 2, 3, 4, 5, 7]])]
    # An argmax sequence with repeats; sharp logits (confident) and soft ones (not confident).
    steps = [(0, 1), (0, 1), (1, 1), (1, 0), (1, 1), (1, 1), (1, 1)]  # (which argmax, confident?)
    sequence = [(argmaxes[i], sharp if confident else sharp / 400) for i, confident in steps]
    for threshold in [0, 1, 2, 3]:
        ref = StableAndConfidentStoppingCriteria(threshold, 0.005)
        ours = StopRule(SamplerSettings(stability_threshold=threshold), (1, 6))
        for argmax, logits in sequence:
            expected = bool(ref(torch.tensor(argmax), torch.tensor(logits, dtype=torch.float32))[0])
            _, _, entropy, _ = tempered_distribution(mx.array(logits, dtype=mx.float32), mx.array(1.0))
            assert ours(mx.array(argmax, dtype=mx.int32), entropy.mean()).item() == expected


# The default rng.


def test_default_rng_draws_from_the_right_distributions():
    rng = MxRandom(seed=3)
    probs = mx.array([0.5, 0.3, 0.15, 0.05, 0.0])
    samples = np.array(rng.categorical(mx.broadcast_to(probs, (20000, 5))))
    frequencies = np.bincount(samples, minlength=5) / samples.size
    np.testing.assert_allclose(frequencies, np.array(probs), atol=0.015)
    canvas = np.array(rng.canvas((1, 20000), 7))
    assert canvas.shape == (1, 20000) and canvas.min() == 0 and canvas.max() == 6
    np.testing.assert_allclose(np.bincount(canvas[0]) / canvas.size, 1 / 7, atol=0.015)


def test_default_rng_is_seeded_and_independent_of_global_state():
    first = [np.array(MxRandom(seed=5).canvas((1, 32), 1000))]
    mx.random.seed(99)
    first.append(np.array(MxRandom(seed=5).canvas((1, 32), 1000)))
    assert np.array_equal(*first)
    assert not np.array_equal(first[0], np.array(MxRandom(seed=6).canvas((1, 32), 1000)))
    rng = MxRandom(seed=5)
    assert not np.array_equal(np.array(rng.canvas((1, 32), 1000)), np.array(rng.renoise((1, 32), 1000)))
