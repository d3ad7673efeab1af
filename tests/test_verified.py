"""Verified drafting: the decoder drafts, the encoder verifies; greedy output is the autoregressive
output token for token, sampled output has the autoregressive distribution; the cache trim it
relies on is exact."""

import json
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from scipy import stats as scipy_stats

from checkpoint_tools.random_checkpoint import PRESETS
from mlx_dgemma import generate, json_template, load, stream_generate
from mlx_dgemma.demo.scores import instances
from mlx_dgemma.demo.tasks import TASKS, json_schema
from mlx_dgemma.engine import drafting, rules
from mlx_dgemma.engine.filters import sampling_probs
from mlx_dgemma.engine.sampler import MxRandom, SamplerSettings
from mlx_dgemma.generate import prompt_ids
from mlx_dgemma.model.config import GenerationConfig, ModelConfig
from mlx_dgemma.model.diffusion_gemma import DiffusionGemma

from .test_model_parity import FP32_BOUND, rel_err


def test_cache_trim_is_exact_on_full_and_sliding_layers(checkpoints):
    """Encode, append a draft, trim part of it, encode more == encoding the kept tokens from scratch:
    the same cache contents and the same logits from every later forward, with a prompt longer than
    the sliding window (the trim reaches back past what the window shows)."""
    preset = "pattern"
    sizes = PRESETS[preset]
    model, _ = load(checkpoints(preset))
    window, canvas = sizes["sliding_window"], sizes["canvas_length"]
    ids = np.random.default_rng(3).integers(3, sizes["vocab_size"], size=(1, 3 * window + 2 * canvas + 5))
    prompt, draft_a, draft_b = 3 * window + 1, canvas, canvas - 3
    for kept_a in (0, 1, window // 2, canvas - 1):  # trims of canvas, canvas-1, ... positions
        trimmed = model.make_cache()
        model.encode(mx.array(ids[:, :prompt]), trimmed)
        model.encode(mx.array(ids[:, prompt : prompt + draft_a]), trimmed)
        trimmed.trim(draft_a - kept_a)
        end = prompt + kept_a
        assert trimmed.offset == end
        after_trim = model.next_token_logits(mx.array(ids[:, end : end + draft_b]), trimmed)
        fresh = model.make_cache()
        model.encode(mx.array(ids[:, :end]), fresh)
        after_fresh = model.next_token_logits(mx.array(ids[:, end : end + draft_b]), fresh)
        assert rel_err(after_trim, after_fresh) <= FP32_BOUND
        for i in range(len(model.layers)):  # what later forwards read: sliding layers' last window - 1
            (ka, va), (kb, vb) = trimmed.layer_keys(i), fresh.layer_keys(i)
            assert ka.shape == kb.shape
            assert rel_err(ka, kb) <= FP32_BOUND and rel_err(va, vb) <= FP32_BOUND
        canvas_ids = mx.array(ids[:, :canvas])
        assert rel_err(model.denoise(canvas_ids, trimmed), model.denoise(canvas_ids, fresh)) <= FP32_BOUND


def test_cache_trim_past_the_kept_history_is_refused(checkpoints):
    model, _ = load(checkpoints("pattern"))
    window = PRESETS["pattern"]["sliding_window"]
    cache = model.make_cache()
    model.encode(mx.arange(3, 40)[None], cache)
    with pytest.raises(ValueError, match="cannot trim"):
        cache.trim(cache.offset + 1)
    with pytest.raises(ValueError, match="cannot trim"):
        cache.trim(-1)
    model.encode(mx.zeros((1, 600), dtype=mx.int32) + 5, cache)  # sliding layers drop old history
    sliding = next(i for i, w in enumerate(cache.windows) if w is not None)
    kept = cache.layers[sliding].state[0].shape[2] - (window - 1)
    with pytest.raises(ValueError, match="cannot trim"):
        cache.trim(kept + 1)
    assert cache.trim(kept) == kept


# ---------------------------------------------------------------------------------------------
# Greedy: token for token the autoregressive output


def tokens_of(responses) -> list[int]:
    return [t for r in responses for t in r.tokens]


@pytest.mark.parametrize("preset", ["small", "pattern", "mixed"])
def test_greedy_verified_equals_ar_on_random_checkpoints(checkpoints, preset):
    """Several draft lengths (2, odd, the whole canvas) and 1-3 draft steps; 40 tokens run over
    several rounds and several canvas lengths, with prompts longer than the sliding window."""
    model, tokenizer = load(checkpoints(preset))
    sizes = PRESETS[preset]
    prompt = [2] + np.random.default_rng(5).integers(10, sizes["vocab_size"], 2 * sizes["sliding_window"] + 3).tolist()
    ar = tokens_of(stream_generate(model, tokenizer, prompt, 40, policy="ar"))
    for length, steps in ((2, 1), (5, 2), (sizes["canvas_length"], 1), (sizes["canvas_length"], 3)):
        responses = list(
            stream_generate(
                model, tokenizer, prompt, 40, policy="verified", seed=length, draft_length=length, draft_steps=steps
            )
        )
        assert tokens_of(responses) == ar, (length, steps)
        plan = responses[0].plan
        assert (plan.mode, plan.draft_length, plan.draft_steps) == ("verified", length, steps)
        assert all(r.steps == steps + 1 for r in responses[:-1])  # draft steps + one verifying pass


def test_a_stop_id_inside_a_draft_ends_it(demo):
    """With a stop id that first comes up as a draft token the encoder confirms (not as a round's
    last token, the encoder's own), verified drafting ends there, exactly where AR does."""
    model, tokenizer = demo
    prompt = prompt_ids(tokenizer, "json: name=ada city=rome age=36")
    ar = tokens_of(stream_generate(model, tokenizer, prompt, policy="ar"))
    rounds = [tokens for tokens, *_ in run_verified(model, prompt, rules.GreedyRule(set(), 64), 32, 2)]
    free = [t for tokens in rounds for t in tokens]
    assert free[: len(ar)] == ar  # AR ended at the model's own stop id
    before = 1  # the first round begins with the prompt's next token, no draft token
    inside = []  # tokens whose first occurrence is a kept draft token, before AR's end
    for k, tokens in enumerate(rounds):
        tokens = tokens[1:] if k == 0 else tokens
        inside += [t for i, t in enumerate(tokens[:-1]) if before + i < len(ar) - 1 and t not in ar[: before + i]]
        before += len(tokens)
    assert inside, "no round kept a draft token"
    stop = inside[len(inside) // 2]
    rounds = list(run_verified(model, prompt, rules.GreedyRule({stop}, 64), 32, 2))
    assert [t for tokens, *_ in rounds for t in tokens] == ar[: ar.index(stop) + 1]
    last_tokens, done, _, kept, _ = rounds[-1]
    assert done and kept >= 1 and last_tokens[-1] == stop


def run_verified(model, prompt, rule, length, steps, seed=0, cache=None, first=None):
    """Rounds of drafting.verify_rounds for one row, from a fresh cache holding ``prompt`` (or the given
    one and its logits): yields (tokens the round adds, done, forwards, draft tokens kept, draft length);
    a sampling rule's random source draws the drafts too."""
    if cache is None:
        cache = model.make_cache()
        first = model.next_token_logits(mx.array([prompt]), cache)
    schedule = SamplerSettings.from_generation_config(model.generation_config)
    if filters := getattr(rule, "filters", ()):  # the draft draws through them, as the engine's do
        schedule = replace(schedule, **dict(zip(("top_p", "top_k", "min_p"), filters)))
    temperature, rng = getattr(rule, "temperature", 0.0), getattr(rule, "rng", None) or MxRandom(seed)
    settings = drafting.DraftSettings(length, steps, temperature)
    _, known = rule.follow(first.reshape(1, -1), [])
    if known is None:
        yield rule.output, True, 0, 0, 0
    tokens, row = rule.output[:], drafting.DraftRow(cache, known, rule, schedule, rng)
    while row.known is not None:
        round_settings = replace(settings, length=max(1, min(length, rule.room)))
        done = drafting.verify_rounds(model, [row], round_settings)[0]
        row.known, row.leftover = done.known, done.leftover
        yield tokens + done.tokens, row.known is None, done.forwards, done.kept, done.length
        tokens = []


@pytest.mark.parametrize("task", TASKS)
def test_greedy_verified_equals_ar_on_the_demo_tasks(demo, task):
    model, tokenizer = demo
    for i, (prompt, _) in enumerate(instances(task, 4, seed=21)):
        ar = tokens_of(stream_generate(model, tokenizer, prompt, policy="ar"))
        for length, steps in ((32, 1), (12, 2)):
            verified = stream_generate(
                model, tokenizer, prompt, policy="verified", seed=i, draft_length=length, draft_steps=steps
            )
            assert tokens_of(verified) == ar, (prompt, length, steps)


@pytest.mark.parametrize("template", ["17 {{fill:8}} 85", '{"name": "{{fill:6}}", "age": {{fill:3}}}'])
def test_templates_verified_equals_ar(demo, template):
    """Clamped text is forced and the holes are verified: the same template-aligned tokens and text as
    autoregressive template decoding (which runs the same rule one token at a time)."""
    model, tokenizer = demo
    for prompt in ("sort: 42 17 85 23 61", "json: name=bob age=41"):
        ar = list(stream_generate(model, tokenizer, prompt, policy="ar", template=template))
        verified = list(
            stream_generate(
                model, tokenizer, prompt, policy="verified", template=template, draft_length=16, draft_steps=2
            )
        )
        assert tokens_of(verified) == tokens_of(ar)
        assert verified[-1].text == ar[-1].text and verified[-1].finish_reason == "stop"


def test_a_schema_template_verified_equals_ar(demo):
    model, tokenizer = demo
    prompt = "json: name=eve age=29 city=oslo"
    schema = json_schema(prompt)
    template = json_template(tokenizer, schema)
    ar = generate(model, tokenizer, prompt, policy="ar", template=template)
    assert (
        generate(model, tokenizer, prompt, policy="verified", template=template, draft_length=32, draft_steps=2) == ar
    )
    json.loads(ar)


def test_bad_draft_settings_are_refused(demo):
    model, tokenizer = demo
    with pytest.raises(ValueError, match="draft length must be an integer from 1 to the model's canvas length 32"):
        generate(model, tokenizer, "sort: 3 1", policy="verified", draft_length=33, draft_steps=1)
    with pytest.raises(ValueError, match=r"^draft_steps must be an integer from 1 to 512, got 0$"):
        generate(model, tokenizer, "sort: 3 1", policy="verified", draft_length=8, draft_steps=0)
    with pytest.raises(ValueError, match="^temperature must be 0 or a finite number from 0.0001 to 10000, got -0.5"):
        generate(model, tokenizer, "sort: 3 1", policy="verified", temperature=-0.5)


# ---------------------------------------------------------------------------------------------
# Sampling: the autoregressive distribution, exactly

TINY = ModelConfig(
    vocab_size=5,
    hidden_size=16,
    intermediate_size=24,
    moe_intermediate_size=8,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    global_head_dim=8,
    num_global_key_value_heads=1,
    num_experts=3,
    top_k_experts=2,
    layer_types=["sliding_attention", "full_attention"],
    sliding_window=3,
    canvas_length=4,
)
PROMPT = [2, 4, 3, 0, 1]  # longer than the window
TEMPERATURE = 1.3
DRAWS = 3000


@pytest.fixture(scope="module")
def tiny():
    """A 5-token vocabulary model with random weights, its encoder scalars unlike the denoiser's so
    that the draft distribution q differs from the encoder's p (every rule mistake then shows)."""
    mx.random.seed(3)
    model = DiffusionGemma(TINY)
    params = model.parameters()
    experts = [layer.experts for layer in model.layers]
    for e in experts:
        e.gate_up_proj.weight = 0.3 * mx.random.normal(e.gate_up_proj.weight.shape)
        e.down_proj.weight = 0.3 * mx.random.normal(e.down_proj.weight.shape)
    for i, scalar in enumerate(model.model.encoder.language_model.layers):
        scalar.layer_scalar = mx.array([0.4 + 0.3 * i])
    mx.eval(params)
    model.generation_config = GenerationConfig()
    return model


def exact_ar_distribution(model, length: int, filters: tuple = ()) -> np.ndarray:
    """P(the first ``length`` tokens after PROMPT) under AR sampling at TEMPERATURE through the
    ``filters`` (top_p, top_k, min_p), by enumeration."""
    V = TINY.vocab_size
    out = np.zeros((V,) * length)
    for seq in np.ndindex(*out.shape):
        cache = model.make_cache()
        logits = model.head(model.encode(mx.array([PROMPT + list(seq[:-1])]), cache, return_hidden=True))[0]
        probs = np.array(sampling_probs(logits[len(PROMPT) - 1 :], TEMPERATURE, *filters))
        out[seq] = np.prod([probs[i, t] for i, t in enumerate(seq)])
    return out


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of the counts to the probabilities, outcomes expected < 5 times pooled."""
    counts, expected = counts.ravel(), probs.ravel() / probs.sum() * counts.sum()
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return scipy_stats.chisquare(counts, expected).pvalue


def sampled_verified_counts(model, length: int = 3, draft_length: int = 3, filters: tuple = ()) -> np.ndarray:
    """Counts of the first ``length`` tokens over DRAWS sampled verified generations through the
    ``filters``, each with its own random source and its own copy of the prompt's cache, drafted and
    verified together as the engine's rows are (rows whose drafts have one length share a round)."""
    counts = np.zeros((TINY.vocab_size,) * length, dtype=np.int64)
    cache = model.make_cache()
    first = model.next_token_logits(mx.array([PROMPT]), cache).reshape(1, -1)
    schedule = SamplerSettings.from_generation_config(model.generation_config)
    if filters:  # the drafts draw through them, as the engine's do
        schedule = replace(schedule, **dict(zip(("top_p", "top_k", "min_p"), filters)))
    rows = []
    for i in range(DRAWS):
        rule = rules.SampledRule(set(), length, TEMPERATURE, MxRandom(7 + i), filters)
        _, known = rule.follow(first, [])
        rows.append(drafting.DraftRow(cache.rows([0]), known, rule, schedule, rule.rng))
    live = [row for row in rows if row.known is not None]
    while live:
        by_length = {}
        for row in live:
            by_length.setdefault(max(1, min(draft_length, row.rule.room)), []).append(row)
        for n, group in by_length.items():
            settings = drafting.DraftSettings(n, 2, TEMPERATURE)
            for row, done in zip(group, drafting.verify_rounds(model, group, settings)):
                row.known, row.leftover = done.known, done.leftover
        live = [row for row in live if row.known is not None]
    for row in rows:
        counts[tuple(row.rule.output)] += 1
    return counts


@pytest.fixture(scope="module")
def exact(tiny):
    return exact_ar_distribution(tiny, 3)


@pytest.mark.slow
def test_sampled_ar_has_the_ar_distribution(tiny, exact):
    """The reference point: AR sampling at a temperature (the engine's draws, rows.autoregressive.next_token) fits
    the enumerated distribution."""
    from mlx_dgemma.engine.rows.autoregressive import next_token

    counts = np.zeros_like(exact, dtype=np.int64)
    rng = MxRandom(5)
    cache = tiny.make_cache()
    first = tiny.next_token_logits(mx.array([PROMPT]), cache)
    for _ in range(DRAWS):
        logits, tokens = first, []
        for _ in range(3):
            tokens.append(next_token(logits, TEMPERATURE, rng).item())
            logits = tiny.next_token_logits(mx.array([tokens[-1:]]), cache)
        counts[tuple(tokens)] += 1
        cache.trim(cache.offset - len(PROMPT))
    assert chi_square_p(counts, exact) > 1e-3


def test_sampled_verified_has_the_ar_distribution(tiny, exact):
    counts = sampled_verified_counts(tiny)
    assert chi_square_p(counts, exact) > 1e-3


@pytest.mark.parametrize(
    "filters",
    [
        pytest.param((1.0, 2, 0.0), marks=pytest.mark.slow),
        (0.6, 0, 0.0),
        pytest.param((1.0, 0, 0.3), marks=pytest.mark.slow),
    ],
    ids=["top_k", "top_p", "min_p"],
)
def test_sampled_verified_has_the_filtered_ar_distribution(tiny, filters):
    """Verification stays exact for the filtered target: the tokens the filter cuts never come, and
    the rest come as often as filtered AR sampling gives them."""
    exact = exact_ar_distribution(tiny, 3, filters)
    assert (exact == 0).any()
    counts = sampled_verified_counts(tiny, filters=filters)
    cut = exact == 0
    assert counts[cut].sum() == 0
    assert chi_square_p(counts[~cut], exact[~cut]) > 1e-3


@pytest.mark.parametrize("broken", ["accept always", pytest.param("redraw from p", marks=pytest.mark.slow)])
def test_the_goodness_of_fit_catches_a_broken_acceptance_rule(tiny, exact, monkeypatch, broken):
    """The same test fails when the rule is wrong: keeping every draft token (the draft's own
    distribution), or redrawing a rejected token from p instead of the residual max(0, p − q)."""
    if broken == "accept always":
        monkeypatch.setattr(rules.SampledRule, "acceptance", staticmethod(lambda p, q: mx.ones_like(p)))
    else:
        monkeypatch.setattr(rules.SampledRule, "residual", staticmethod(lambda p, q: p))
    counts = sampled_verified_counts(tiny)
    assert chi_square_p(counts, exact) < 1e-6


def test_cli_verified_prints_the_ar_answer_and_refuses_a_bad_filter():
    from click.testing import CliRunner

    from mlx_dgemma.generate import main

    prompt = ["--prompt", "reverse: a b c d"]
    ar = CliRunner().invoke(main, prompt + ["--policy", "ar"])
    verified = CliRunner().invoke(
        main, prompt + ["--policy", "verified", "--draft-length", "8", "--draft-steps", "1", "--verbose"]
    )
    assert ar.exit_code == verified.exit_code == 0, verified.output
    assert ar.output.strip() in verified.output and "tokens per round" in verified.output
    for flag, value, message in [
        ("--top-p", "1.5", "--top-p must be a finite number in (0, 1], got 1.5"),
        ("--top-k", "-1", "--top-k must be at least 0, got -1"),
        ("--min-p", "nan", "--min-p must be a finite number in [0, 1], got nan"),
    ]:
        bad = CliRunner().invoke(main, prompt + [flag, value])
        assert bad.exit_code == 1 and bad.output.strip().split("\n") == [f"Error: {message}"], bad.output


def test_the_verified_policy_learns_its_acceptance(demo):
    """Without a draft length and steps the plan comes from the device profile and the verified
    policy's running acceptance estimate for the model, which every verified round updates (and
    auto's, which auto's rounds update, does not hear of)."""
    from mlx_dgemma.engine.policy import PLANNERS, Profile, auto_planner

    model, tokenizer = demo
    profile = Profile(
        "cpu-like",
        "measured",
        {2: 0.003, 16: 0.004, 32: 0.005, 256: 0.064},
        ar_token_s=0.004,
        prefill_tok_s=1e4,
        verify_s_by_length={2: 0.003, 16: 0.004, 32: 0.005},
    )
    autos = auto_planner(model, model.generation_config, profile).acceptance
    acceptance = PLANNERS.acceptance(model)
    before = acceptance.alpha(1), acceptance.alpha(2)
    responses = list(
        stream_generate(model, tokenizer, "json: name=ada city=rome age=36", policy="verified", profile=profile)
    )
    plan = responses[0].plan
    assert plan.mode == "verified" and 2 <= plan.draft_length <= 32 and "tokens per round" in plan.explain()
    seen = sum(acceptance.kept.values()) + sum(acceptance.rejected.values())
    assert seen > 0 and (acceptance.alpha(1), acceptance.alpha(2)) != before
    # auto drafts afresh each round, the verified policy from the last draft's rest: auto's own is untouched
    assert PLANNERS.get(model).acceptance is autos and not autos.kept and not autos.rejected
    PLANNERS.set(model, None)


def test_drafts_of_several_rows_equal_each_row_drafted_alone(checkpoints):
    """``draft_rows`` over stacked views (prefixes of other lengths, each row its own known tokens,
    start, random draws and self-conditioning schedule, two steps so the schedules are used) gives
    each row the draft ``draft`` gives it alone."""
    from mlx_dgemma.model.cache import CanvasView

    model, _ = load(checkpoints("small", tame=True))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, model.config.vocab_size, n).tolist() for n in (7, 19, 12)]
    caches = []
    for prompt in prompts:
        caches.append(model.make_cache())
        model.encode(mx.array([prompt]), caches[-1])
    length, settings = 12, drafting.DraftSettings(12, 2)
    known = [[5], [6, 7], [8]]
    starts = [[9, 10, 11], [], [12]]
    schedules = [
        SamplerSettings(t_min=0.2, t_max=0.9),
        SamplerSettings(t_min=0.5, t_max=0.6),
        SamplerSettings(t_min=0.05, t_max=2.0),
    ]

    def row(i, schedule):  # known[i][0] decided, the rest forced by the row's rule
        return drafting.DraftRow(caches[i], known[i][0], Forced(known[i][1:]), schedule, MxRandom(i), starts[i])

    view = CanvasView.stack([c.canvas_view(length) for c in caches])
    together, _ = drafting.draft_rows(model, view, [row(i, schedules[i]) for i in range(3)], settings)
    for i in range(3):
        alone, _ = drafting.draft(model, row(i, schedules[i]), settings)
        assert together[i].tolist() == alone.tolist(), i
    # The schedules matter: the first row drafted with the third's schedule is another draft.
    other, _ = drafting.draft(model, row(0, schedules[2]), settings)
    assert other.tolist() != together[0].tolist()


class Forced:
    """A rule whose next tokens are known whatever the model predicts."""

    def __init__(self, tokens):
        self.tokens = tokens

    def known(self, n):
        return self.tokens[:n]
