"""Sampling filters (top_p, top_k, min_p) and the one meaning of ``temperature``: the filter math is
mlx-lm's, on the tempered distribution; every policy draws through it (autoregressive tokens, verified
drafting's target and draft, each position of a denoising step); ``top_k=1`` is greedy at any
temperature; a diffusion policy's temperature scales its draws, and ``schedule_scale`` its schedule."""

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from mlx_dgemma import generate, load, stream_generate
from mlx_dgemma.engine.filters import sampling_probs
from mlx_dgemma.engine.sampler import MxRandom, SamplerSettings
from mlx_dgemma.generate import DEMO_MODEL, main, prompt_ids

PROMPT = "add: 417 85"
POLICIES = ["reference", "fast", "ar", "verified"]
LOGITS = [[2.0, 1.0, 0.5, -1.0, 0.0, 1.5, -0.3, 0.9]]
# Summed float32 probabilities of V = 8 terms are within V·eps of their exact sum.
EPS = 8 * np.finfo(np.float32).eps


def mlx_lms(logits, top_p=1.0, top_k=0, min_p=0.0):
    """mlx-lm's sampler chain (make_sampler's order) on log-probabilities, as probabilities."""
    log_probs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if top_p < 1:
        log_probs = apply_top_p(log_probs, top_p)
    if min_p:
        log_probs = apply_min_p(log_probs, min_p)
    if top_k:
        log_probs = apply_top_k(log_probs, top_k)
    return mx.softmax(log_probs, axis=-1)


@pytest.mark.parametrize(
    "filters",
    [
        dict(top_p=0.7),
        dict(top_p=0.95),
        dict(min_p=0.3),
        dict(top_k=3),
        dict(top_p=0.9, top_k=2),
        dict(top_p=0.8, min_p=0.4, top_k=5),
    ],
)
def test_the_filters_are_mlx_lms_at_temperature_one(filters):
    logits = mx.array(LOGITS)
    got, want = np.array(sampling_probs(logits, 1.0, **filters)), np.array(mlx_lms(logits, **filters))
    assert ((got > 0) == (want > 0)).all() and (want == 0).any()
    assert np.abs(got - want).max() <= EPS


def test_the_filters_apply_to_the_tempered_distribution():
    """At temperature T the kept set is the one of softmax(logits / T): the top-p nucleus of a flatter
    distribution holds more tokens, min-p keeps tokens at least min_p as likely as the top one."""
    logits = np.array(LOGITS[0])
    for temperature in (0.5, 2.0):
        tempered = np.exp(logits / temperature) / np.exp(logits / temperature).sum()
        order = np.argsort(-tempered)
        nucleus = order[: np.searchsorted(np.cumsum(tempered[order]), 0.8) + 1]
        got = np.array(sampling_probs(mx.array(LOGITS), temperature, top_p=0.8))[0]
        assert set(np.flatnonzero(got)) == set(nucleus)
        want = np.where(np.isin(np.arange(len(logits)), nucleus), tempered, 0)
        assert np.abs(got - want / want.sum()).max() <= EPS
        got = np.array(sampling_probs(mx.array(LOGITS), temperature, min_p=0.3))[0]
        assert set(np.flatnonzero(got)) == set(np.flatnonzero(tempered >= 0.3 * tempered.max()))
    assert len(np.flatnonzero(sampling_probs(mx.array(LOGITS), 2.0, top_p=0.8))) > len(
        np.flatnonzero(sampling_probs(mx.array(LOGITS), 0.5, top_p=0.8))
    )


def test_temperature_zero_and_top_k_one_are_the_argmax():
    for probs in (
        sampling_probs(mx.array(LOGITS), 0),
        sampling_probs(mx.array(LOGITS), 0, top_p=0.5),
        sampling_probs(mx.array(LOGITS), 1.9, top_k=1),
        sampling_probs(mx.array(LOGITS), 1.9, top_p=1e-6),
    ):
        assert np.array(probs).tolist() == [[1.0] + [0.0] * 7]


@pytest.mark.parametrize("policy", POLICIES)
def test_top_k_one_is_greedy_at_any_temperature(demo, policy):
    """Through the API, per policy: top_k=1 at temperature 1.7 is temperature 0 at the same seed
    (greedy decoding; for diffusion, greedy draws beside the same renoising draws), and without the
    filter that temperature gives other answers over the seeds."""
    model, tokenizer = demo
    greedy = [
        generate(model, tokenizer, PROMPT, max_tokens=32, seed=seed, policy=policy, temperature=0) for seed in range(2)
    ]
    top_1 = [
        generate(model, tokenizer, PROMPT, max_tokens=32, seed=seed, policy=policy, temperature=1.7, top_k=1)
        for seed in range(2)
    ]
    hot = [
        generate(model, tokenizer, PROMPT, max_tokens=32, seed=seed, policy=policy, temperature=1.7)
        for seed in range(2)
    ]
    assert top_1 == greedy and hot != greedy


class Recording:
    """A ``Random`` that keeps every distribution it draws a token from."""

    def __init__(self, seed: int):
        self.inner, self.drawn = MxRandom(seed), []

    def canvas(self, shape, vocab):
        return self.inner.canvas(shape, vocab)

    renoise = canvas

    def categorical(self, probs):
        self.drawn.append(np.array(probs.reshape(-1, probs.shape[-1])))
        return self.inner.categorical(probs)


@pytest.mark.parametrize("policy", ["reference", "fast", "ar"])
@pytest.mark.parametrize(
    "filters, kept",
    [(dict(top_k=3), lambda p: np.argsort(-p)[:3]), (dict(min_p=0.2), lambda p: np.flatnonzero(p >= 0.2 * p.max()))],
)
def test_every_draw_goes_through_the_filters(demo, policy, filters, kept):
    """Each position a denoising step draws (and each autoregressive token) comes from a distribution
    the filter cut; the same draws unfiltered reach past the cut (so the check can fail)."""
    model, tokenizer = demo
    for given, cut in ((filters, True), ({}, False)):
        rng = Recording(1)
        generate(model, tokenizer, PROMPT, max_tokens=16, rng=rng, policy=policy, temperature=1.5, **given)
        rows = np.concatenate(rng.drawn)
        assert len(rows) >= 4  # (an answer of a few tokens and its end)
        within = [set(np.flatnonzero(row)) <= set(kept(row)) for row in rows]
        assert all(within) if cut else not all(within)


def test_a_diffusion_temperature_scales_the_draws_and_schedule_scale_the_schedule(demo):
    """Under reference, temperature 1 is the checkpoint's own sampling; schedule_scale multiplies the
    schedule, as temp_min and temp_max of the scaled values do; temperature and schedule_scale differ."""
    model, tokenizer = demo
    t_min, t_max = model.generation_config.t_min, model.generation_config.t_max
    for seed in range(3):
        plain = generate(model, tokenizer, PROMPT, max_tokens=32, seed=seed)
        assert generate(model, tokenizer, PROMPT, max_tokens=32, seed=seed, temperature=1.0) == plain
        scaled = generate(model, tokenizer, PROMPT, max_tokens=32, seed=seed, schedule_scale=0.5)
        assert scaled == generate(
            model, tokenizer, PROMPT, max_tokens=32, seed=seed, temp_min=t_min * 0.5, temp_max=t_max * 0.5
        )
    answers = {
        (t, s): tuple(
            generate(model, tokenizer, PROMPT, max_tokens=32, seed=seed, temperature=t, schedule_scale=s)
            for seed in range(4)
        )
        for t, s in ((1.8, None), (None, 1.8))
    }
    assert len(set(answers.values())) == 2


@pytest.mark.parametrize(
    "penalty", [dict(repetition_penalty=3.0), dict(presence_penalty=2.0), dict(frequency_penalty=1.5)]
)
def test_penalties_under_ar_are_mlx_lms(demo, penalty):
    """Greedy ar with a penalty: each token is the argmax after mlx-lm's own logits processor over the
    last 20 tokens (the prompt's included), replayed token by token; the penalty changes the answer."""
    model, tokenizer = demo
    ids = prompt_ids(tokenizer, "sort: 5 5 5 3 3")
    tokens = [t for r in stream_generate(model, tokenizer, ids, 16, policy="ar", **penalty) for t in r.tokens]
    processors = make_logits_processors(**penalty)
    cache = model.make_cache()
    logits, history, want = model.next_token_logits(mx.array([ids]), cache), list(ids), []
    for _ in tokens:
        for processor in processors:
            logits = processor(mx.array(history), logits)
        want.append(int(logits.argmax(-1).item()))
        history.append(want[-1])
        logits = model.next_token_logits(mx.array([want[-1:]]), cache)
    assert tokens == want
    assert generate(model, tokenizer, ids, max_tokens=16, policy="ar") != tokenizer.decode_clean(tokens, set())


@pytest.mark.parametrize("policy", ["reference", "fast", "verified", "auto"])
def test_a_penalty_outside_ar_is_refused(demo, policy):
    with pytest.raises(ValueError, match=r"^frequency_penalty applies to autoregressive decoding only \(policy ar\)"):
        generate(*demo, PROMPT, max_tokens=8, policy=policy, frequency_penalty=0.5)


def test_a_template_samples_under_diffusion_and_is_refused_a_temperature_under_ar(demo):
    """ar and verified decode a template's holes greedily, so a temperature or a filter there is an
    error saying so; a diffusion policy draws the holes at it."""
    template = "{{fill:6}} and {{fill:6}}"
    for policy, settings in [
        ("ar", dict(temperature=0.5)),
        ("verified", dict(top_k=3)),
        ("ar", dict(presence_penalty=1.0)),
    ]:
        with pytest.raises(ValueError, match=f"^templates decode greedily under {policy}; drop the temperature"):
            generate(*demo, PROMPT, policy=policy, template=template, **settings)
    answers = {generate(*demo, PROMPT, seed=seed, template=template, temperature=2.0) for seed in range(4)}
    assert len(answers) > 1 and all(" and " in answer for answer in answers)


def test_the_draw_settings_are_checked():
    for name, value, message in [
        ("top_p", 0.0, "top_p must be a finite number in (0, 1], got 0.0"),
        ("top_k", 2.5, "top_k must be an integer, got 2.5"),
        ("min_p", 1.5, "min_p must be a finite number in [0, 1], got 1.5"),
        ("draw_temperature", -1.0, "temperature must be 0 or a finite number from 0.0001 to 10000"),
        ("repetition_penalty", 0, "repetition_penalty must be a finite number in [0.0001, 10000], got 0"),
        ("repetition_penalty", 1e-300, "repetition_penalty must be a finite number in [0.0001, "),
        ("presence_penalty", 3, "presence_penalty must be a finite number in [-2, 2], got 3"),
    ]:
        with pytest.raises(ValueError) as caught:
            SamplerSettings(**{name: value})
        assert str(caught.value).startswith(message)


def test_the_cli_takes_mlx_lms_flags():
    prompt = ["--prompt", PROMPT, "--max-tokens", "32", "--seed", "2"]
    for policy in POLICIES:
        greedy = CliRunner().invoke(main, prompt + ["--policy", policy, "--temp", "0"])
        top_1 = CliRunner().invoke(main, prompt + ["--policy", policy, "--temp", "1.7", "--top-k", "1"])
        nucleus = CliRunner().invoke(main, prompt + ["--policy", policy, "--temp", "1.7", "--top-p", "0.000001"])
        assert greedy.exit_code == top_1.exit_code == nucleus.exit_code == 0, top_1.output
        assert greedy.output == top_1.output == nucleus.output
        # (a fresh model, as the command loads: verified drafts by the model's running acceptance estimate)
        want = generate(*load(DEMO_MODEL), PROMPT, max_tokens=32, seed=2, policy=policy, temperature=1.7, min_p=0.1)
        got = CliRunner().invoke(main, prompt + ["--policy", policy, "--temp", "1.7", "--min-p", "0.1"])
        assert got.output == want + "\n"
