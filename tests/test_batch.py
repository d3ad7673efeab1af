"""Batches: rows of different prompt lengths, left-padded into one cache, give each row what it gives
alone (encode, AR logits, denoise with and without self-conditioning and compaction, whole
generations); the cache trims exactly; chunked prefill equals one forward."""

import mlx.core as mx
import numpy as np
import pytest

from checkpoint_tools.random_checkpoint import PRESETS
from mlx_dgemma import BatchGenerator, batch_generate, generate, load, stream_generate
from mlx_dgemma.errors import TemplateError
from mlx_dgemma.generate import prefill, prepare
from mlx_dgemma.options import GenerationArgs

BOUND = 1e-5
# Denoiser logits: OpenBLAS blocks a product by its row count, so rows stacked four deep sum in
# another order than alone and measure up to 1.6e-5 on these untamed random checkpoints; with MLX's
# own BLAS they are within BOUND (the subprocess test at the end).
DENOISE_BOUND = 2e-5
LENGTHS = {1: [23], 2: [23, 9], 4: [9, 41, 23, 2]}  # 41 > the pattern preset's sliding window


def job(model, tokenizer, ids: list[int], max_tokens: int | None = None, **kwargs):
    """A request for the engine, made ready as the API makes it (``kwargs``: stream_generate's)."""
    return prepare(model, tokenizer, ids, GenerationArgs.of(max_tokens=max_tokens, **kwargs))


def relative(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module", params=["pattern", "mixed"])
def model(request, checkpoints):
    return load(checkpoints(request.param))[0]


def prompts_of(model, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, model.config.vocab_size, n).tolist() for n in lengths]


def batched_cache(model, prompts):
    longest = max(map(len, prompts))
    padding = [longest - len(p) for p in prompts]
    cache = model.make_cache(padding)
    hidden = model.encode(mx.array([[0] * q + p for q, p in zip(padding, prompts)]), cache, return_hidden=True)
    return cache, hidden, padding


def single_cache(model, prompt):
    cache = model.make_cache()
    hidden = model.encode(mx.array([prompt]), cache, return_hidden=True)
    return cache, hidden


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_encode_and_next_token_rows_equal_single_rows(model, rows):
    prompts = prompts_of(model, LENGTHS[rows])
    cache, hidden, padding = batched_cache(model, prompts)
    step = mx.array([[5 + i] for i in range(rows)])
    logits = model.next_token_logits(step, cache)
    for i, prompt in enumerate(prompts):
        alone, alone_hidden = single_cache(model, prompt)
        assert relative(hidden[i, padding[i] :], alone_hidden[0]) <= BOUND
        assert relative(logits[i], model.next_token_logits(step[i : i + 1], alone)[0]) <= BOUND
    assert cache.lengths.tolist() == [len(p) + 1 for p in prompts]


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("self_conditioned", [False, True])
def test_denoise_rows_equal_single_rows(model, rows, self_conditioned):
    C, V = model.config.canvas_length, model.config.vocab_size
    prompts = prompts_of(model, LENGTHS[rows], seed=1)
    cache, _, _ = batched_cache(model, prompts)
    canvas = mx.random.randint(0, V, (rows, C), key=mx.random.key(1))
    sc = mx.random.normal((rows, C, V), key=mx.random.key(2)) * 3 if self_conditioned else None
    got = model.denoise(canvas, cache, sc)
    for i, prompt in enumerate(prompts):
        alone, _ = single_cache(model, prompt)
        want = model.denoise(canvas[i : i + 1], alone, None if sc is None else sc[i : i + 1])
        assert relative(got[i], want[0]) <= DENOISE_BOUND


@pytest.mark.parametrize("rows", [2, 4])
def test_compacted_rows_equal_single_compacted_rows(model, rows):
    """Each row computes its own active set (of different sizes) against the K/V its view keeps."""
    C, V = model.config.canvas_length, model.config.vocab_size
    prompts = prompts_of(model, LENGTHS[rows], seed=2)
    cache, _, _ = batched_cache(model, prompts)
    canvas = mx.random.randint(0, V, (rows, C), key=mx.random.key(3))
    sc = mx.random.normal((rows, C, V), key=mx.random.key(4)) * 3
    probs = mx.softmax(sc, axis=-1)
    rng = np.random.default_rng(0)
    actives = [np.sort(rng.choice(C, size=C // 2 - i, replace=False)).astype(np.int32) for i in range(rows)]
    width = max(len(a) for a in actives)
    padded = [np.concatenate([a, np.repeat(a[-1:], width - len(a))]) for a in actives]  # as the sampler pads
    index = mx.array(np.stack(padded))
    view = cache.canvas_view(C)
    model.denoise(canvas, view, sc, probs)  # every position's K/V laid into the view
    got = model.denoise(
        mx.take_along_axis(canvas, index, axis=1),
        view,
        mx.take_along_axis(sc, index[..., None], axis=1),
        mx.take_along_axis(probs, index[..., None], axis=1),
        active=index,
    )
    for i, prompt in enumerate(prompts):
        alone, _ = single_cache(model, prompt)
        own = alone.canvas_view(C)
        model.denoise(canvas[i : i + 1], own, sc[i : i + 1], probs[i : i + 1])
        a = mx.array(actives[i])
        want = model.denoise(canvas[i : i + 1, a], own, sc[i : i + 1, a], probs[i : i + 1, a], active=a)
        assert relative(got[i, : len(actives[i])], want[0]) <= DENOISE_BOUND


@pytest.mark.parametrize("rows", [2, 4])
def test_commits_encoded_through_a_stacked_view_equal_each_encoded_alone(model, rows):
    """Rows with caches of their own (from one padded prefill, as batch.py keeps them) whose canvases
    commit at the same step encode them in one forward through their stacked views; every layer's
    cache then holds what it holds after encoding each row alone, past the sliding window too."""
    from mlx_dgemma.model.cache import CanvasView

    C, V = model.config.canvas_length, model.config.vocab_size
    prompts = prompts_of(model, LENGTHS[rows], seed=5)
    shared, _, _ = batched_cache(model, prompts)
    caches = [shared.rows([i]) for i in range(rows)]
    canvas = mx.random.randint(0, V, (rows, C), key=mx.random.key(5))
    view = CanvasView.stack([c.canvas_view(C) for c in caches[::-1]])  # prefixes of other lengths, reversed
    model.encode(canvas[::-1], view)
    view.append_canvas(caches[::-1])
    step = mx.array([[7]])
    for i, prompt in enumerate(prompts):
        alone, _ = single_cache(model, prompt)
        model.encode(canvas[i : i + 1], alone)
        assert caches[i].lengths.tolist() == alone.lengths.tolist() == [len(prompt) + C]
        for layer in range(len(model.layers)):
            got, want = caches[i].layer_keys(layer), alone.layer_keys(layer)
            for a, b in zip(got, want):
                assert relative(a[..., -C:, :], b[..., -C:, :]) <= BOUND
        assert relative(model.next_token_logits(step, caches[i]), model.next_token_logits(step, alone)) <= BOUND


def test_trim_then_encode_equals_encoding_from_scratch(checkpoints):
    model, _ = load(checkpoints("pattern"))
    window, C = PRESETS["pattern"]["sliding_window"], PRESETS["pattern"]["canvas_length"]
    prompt, draft, other = prompts_of(model, [3 * window + 5, C, 7], seed=3)
    cache = model.make_cache()
    prefill(model, mx.array(prompt), cache)
    model.encode(mx.array([draft]), cache)
    assert cache.trim(C - 2) == C - 2  # keep the draft's first two tokens
    trimmed = model.next_token_logits(mx.array([other]), cache)
    fresh = model.make_cache()
    want = model.next_token_logits(mx.array([prompt + draft[:2] + other]), fresh)
    assert cache.offset == fresh.offset == len(prompt) + 2 + len(other)
    assert relative(trimmed, want) <= BOUND
    for i in range(len(model.layers)):
        assert relative(cache.layer_keys(i)[0], fresh.layer_keys(i)[0]) <= BOUND
    canvas = mx.arange(C)[None] % model.config.vocab_size
    assert relative(model.denoise(canvas, cache), model.denoise(canvas, fresh)) <= BOUND


def test_chunked_prefill_equals_one_forward(checkpoints):
    model, _ = load(checkpoints("pattern"))
    prompt = prompts_of(model, [70], seed=4)[0]
    whole, chunked = model.make_cache(), model.make_cache()
    a = prefill(model, mx.array(prompt), whole, step_size=4096, logits=True)
    b = prefill(model, mx.array(prompt), chunked, step_size=16, logits=True)
    assert relative(a, b) <= BOUND
    for i in range(len(model.layers)):
        assert relative(whole.layer_keys(i)[0], chunked.layer_keys(i)[0]) <= BOUND


DEMO_PROMPTS = ["sort: 42 17 85 23 61", "reverse: planet", "add: 417 85", "json: name=ada age=36 city=rome"]


@pytest.mark.parametrize("policy", ["reference", "ar", "fast", "verified"])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_batch_generate_equals_generate_on_the_demo(demo, policy, rows):
    model, tokenizer = demo
    prompts, seeds = DEMO_PROMPTS[:rows], [7, 8, 9, 10][:rows]
    alone = [generate(model, tokenizer, p, seed=s, policy=policy) for p, s in zip(prompts, seeds)]
    assert batch_generate(model, tokenizer, prompts, seeds=seeds, policy=policy).texts == alone


def test_batch_generate_equals_generate_on_a_random_checkpoint(checkpoints):
    model, tokenizer = load(checkpoints("small", tame=True))
    C = model.config.canvas_length
    prompts = [[2, 10, 11, 12], [2] + list(range(20, 39)), [2, 7]]
    alone = [generate(model, tokenizer, p, max_tokens=3 * C, seed=s, steps=6) for s, p in enumerate(prompts)]
    assert batch_generate(model, tokenizer, prompts, 3 * C, seeds=[0, 1, 2], steps=6).texts == alone


def test_a_request_joins_between_rounds_and_a_removed_one_stops(demo):
    model, tokenizer = demo
    from mlx_dgemma.generate import prompt_ids

    ids = [prompt_ids(tokenizer, p) for p in DEMO_PROMPTS]
    generator = BatchGenerator(model, tokenizer)
    first = generator.insert(job(model, tokenizer, ids[3], 96, seed=1))
    gone = generator.insert(job(model, tokenizer, ids[1], 96, seed=2))
    texts = {first: "", gone: ""}
    for response in generator.next():
        texts[response.uid] += response.text
    generator.remove(gone)
    late = generator.insert(job(model, tokenizer, ids[0], 96, seed=3))
    texts[late] = ""
    while len(generator):
        for response in generator.next():
            assert response.uid != gone
            texts[response.uid] += response.text
    assert texts[first] == generate(model, tokenizer, DEMO_PROMPTS[3], max_tokens=96, seed=1)
    assert texts[late] == generate(model, tokenizer, DEMO_PROMPTS[0], max_tokens=96, seed=3)


def test_seeds_must_match_prompts(demo):
    model, tokenizer = demo
    with pytest.raises(ValueError, match="2 prompts but 1 seeds"):
        batch_generate(model, tokenizer, DEMO_PROMPTS[:2], seeds=[1])


def _staggered(model, tokenizer, requests: list, remove_at: int | None = None) -> dict:
    """Insert one request per step; remove the last inserted one at step ``remove_at``; run to the end."""
    generator = BatchGenerator(model, tokenizer)
    texts, uids, gone = {}, [], None
    step = 0
    while step < len(requests) or len(generator):
        if step < len(requests):
            request = requests[step]
            uids.append(generator.insert(request))
            texts[uids[-1]] = ""
        if step == remove_at:
            gone = uids[-2]
            generator.remove(gone)
        for response in generator.next():
            assert response.uid != gone
            texts[response.uid] += response.text
        step += 1
    return {i: texts[uid] for i, uid in enumerate(uids) if uid != gone}


def test_rows_that_join_at_every_step_give_what_they_give_alone(checkpoints):
    """Continuous batching: requests join at different denoising steps of the others' canvases (one
    forward mixes rows with and without self-conditioning, and prefixes of other lengths), one leaves
    mid-canvas, a short last canvas runs beside full ones."""
    model, tokenizer = load(checkpoints("small", tame=True))
    C = model.config.canvas_length
    prompts = [[2, 10, 11, 12], [2] + list(range(20, 39)), [2, 7], [2, 30, 31, 32, 33, 34], [2, 5, 6]]
    requests = [job(model, tokenizer, p, 2 * C if i != 1 else C + 3, seed=i, steps=6) for i, p in enumerate(prompts)]
    texts = _staggered(model, tokenizer, requests, remove_at=3)  # request 2 leaves, two steps in
    assert sorted(texts) == [0, 1, 3, 4]
    for i, text in texts.items():
        r = requests[i]
        assert text == generate(
            model, tokenizer, r.ids, max_tokens=r.max_tokens, seed=r.rng.seed, steps=6, chat_template=False
        )


def test_verified_rows_drafted_and_verified_together_give_ar_answers(checkpoints):
    """Verified rows on a random checkpoint, joining at different rounds, with budgets that end inside
    a draft (shorter drafts, grouped apart): each answer is the autoregressive one, and a round of
    several rows takes one verifying pass, not one per row."""
    from mlx_dgemma.engine import drafting

    model, tokenizer = load(checkpoints("small", tame=True))
    prompts = [[2, 10, 11, 12], [2] + list(range(20, 39)), [2, 7], [2, 30, 31, 32, 33, 34]]
    budgets = [40, 23, 9, 31]
    requests = [
        job(model, tokenizer, p, n, seed=i, policy="verified") for i, (p, n) in enumerate(zip(prompts, budgets))
    ]
    passes = []
    original = drafting.verify_rounds

    def counted(model, rows, *args, **kwargs):
        passes.append(len(rows))
        return original(model, rows, *args, **kwargs)

    drafting.verify_rounds = counted
    try:
        texts = _staggered(model, tokenizer, requests)
    finally:
        drafting.verify_rounds = original
    assert max(passes) > 1
    for i, r in enumerate(requests):
        assert texts[i] == generate(
            model, tokenizer, r.ids, max_tokens=r.max_tokens, policy="ar", chat_template=False
        ), i


def test_a_template_row_joins_plain_rows_on_the_demo(demo):
    from mlx_dgemma.generate import prompt_ids
    from mlx_dgemma.structured.template import parse_template

    model, tokenizer = demo
    template = parse_template(tokenizer, '{"name": "{{fill:6}}", "age": {{fill:3}}}')
    requests = [
        job(model, tokenizer, prompt_ids(tokenizer, DEMO_PROMPTS[3]), 96, seed=1),
        job(model, tokenizer, prompt_ids(tokenizer, DEMO_PROMPTS[3]), seed=2, template=template),
        job(model, tokenizer, prompt_ids(tokenizer, DEMO_PROMPTS[0]), 96, seed=3),
    ]
    texts = _staggered(model, tokenizer, requests)
    for i, r in enumerate(requests):
        alone = generate(
            model, tokenizer, r.ids, max_tokens=r.max_tokens, seed=r.rng.seed, template=r.template, chat_template=False
        )
        assert texts[i] == alone, i


def test_a_row_without_self_conditioning_in_a_conditioned_batch(checkpoints):
    """A row that joins at its first step has no signal while the others do; with bf16 embeddings the
    signal is recomputed from the logits, so it must be switched off, not fed zeros."""
    model, _ = load(checkpoints("small", "bfloat16", tame=True))
    C, V = model.config.canvas_length, model.config.vocab_size
    prompts = prompts_of(model, [9, 9], seed=3)
    cache, _, _ = batched_cache(model, prompts)
    canvas = mx.random.randint(0, V, (2, C), key=mx.random.key(1))
    sc = mx.random.normal((2, C, V), key=mx.random.key(2)) * 3
    got = model.denoise(canvas, cache, sc, self_conditioned_rows=mx.array([True, False]))
    assert relative(got[0], model.denoise(canvas[:1], cache.rows([0]), sc[:1])[0]) <= BOUND
    assert relative(got[1], model.denoise(canvas[1:], cache.rows([1]))[0]) <= BOUND
    assert relative(got[1], model.denoise(canvas[1:], cache.rows([1]), sc[1:])[0]) > 1e-3


@pytest.mark.parametrize("policy", ["reference", "fast", "verified"])
def test_demo_rows_that_join_at_every_step_give_what_they_give_alone(demo, policy):
    """Staggered joins on the demo, where canvases settle at different steps (under the fast policy
    freeze different positions; verified rows keep different numbers of draft tokens per round, and
    draft shorter near their budgets): each answer is the one it gets alone."""
    from mlx_dgemma.generate import prompt_ids

    model, tokenizer = demo
    prompts = DEMO_PROMPTS + ["json: name=bob age=7 city=oslo", "sort: 9 3 77 12"]
    requests = [
        job(model, tokenizer, prompt_ids(tokenizer, p), 96, seed=i, policy=policy) for i, p in enumerate(prompts)
    ]
    texts = _staggered(model, tokenizer, requests, remove_at=2)
    for i, text in texts.items():
        r = requests[i]
        assert text == generate(
            model, tokenizer, r.ids, max_tokens=r.max_tokens, seed=r.rng.seed, policy=policy, chat_template=False
        )


def test_with_mlxs_own_blas_batched_denoise_rows_are_within_the_encoders_bound(checkpoints):
    """The 2e-5 above is OpenBLAS's: with MLX's bundled BLAS (no row-count blocking) a batched row's
    denoiser logits are within 1e-5 of the row alone, with and without self-conditioning."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = f"""
import mlx.core as mx
from mlx_dgemma import fast_blas, load
from tests.test_batch import LENGTHS, batched_cache, prompts_of, relative, single_cache
assert fast_blas.loaded is None
worst = 0.0
for path in {[str(checkpoints(p)) for p in ("pattern", "mixed")]!r}:
    model = load(path)[0]
    C, V = model.config.canvas_length, model.config.vocab_size
    prompts = prompts_of(model, LENGTHS[4], seed=1)
    cache, _, _ = batched_cache(model, prompts)
    canvas = mx.random.randint(0, V, (4, C), key=mx.random.key(1))
    for sc in (None, mx.random.normal((4, C, V), key=mx.random.key(2)) * 3):
        got = model.denoise(canvas, cache, sc)
        for i, prompt in enumerate(prompts):
            alone, _ = single_cache(model, prompt)
            want = model.denoise(canvas[i:i + 1], alone, None if sc is None else sc[i:i + 1])
            worst = max(worst, relative(got[i], want[0]))
print(worst)
"""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "MLX_DGEMMA_BLAS": "reference", "PYTHONPATH": str(root)}
    env.pop("LD_PRELOAD", None)
    run = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert float(run.stdout.split()[-1]) <= BOUND


@pytest.mark.parametrize("policy", ["ar", "verified"])
def test_sampled_rows_in_a_batch_give_what_they_give_alone(demo, policy):
    """Autoregressive and verified rows sample at their own temperatures (one greedy) through their
    own draws, joining at different steps: each answer is the one ``generate`` gives alone."""
    from mlx_dgemma.generate import prepare, prompt_ids
    from mlx_dgemma.options import GenerationArgs

    model, tokenizer = demo
    temperatures = [1.5, 0.0, 0.7, 1.2, 1.5]
    prompts = ["add: 417 85", "add: 417 85", "sort: 9 3 77 12", "reverse: planet", "add: 305 96"]
    # verified: a fixed draft plan (the model's running acceptance estimate would move it)
    draft = dict(draft_length=6, draft_steps=2) if policy == "verified" else {}
    settings = [
        dict(seed=i, policy=policy, temperature=t, chat_template=False, **draft) for i, t in enumerate(temperatures)
    ]
    ids = [prompt_ids(tokenizer, p) for p in prompts]
    texts = _staggered(
        model,
        tokenizer,
        [prepare(model, tokenizer, p, GenerationArgs.of(max_tokens=40, **kw)) for p, kw in zip(ids, settings)],
    )
    for i, (p, kw) in enumerate(zip(ids, settings)):
        assert texts[i] == generate(model, tokenizer, p, max_tokens=40, **kw), i


class ScriptedPlanner:
    """An auto planner whose choice depends only on the row (its prompt and how much it has produced),
    not on what other rows taught it: then a row's answer in a batch must be its answer alone."""

    SCRIPT = ["verified", "reference", "ar", "fast", "verified", "ar", "reference"]

    def __new__(cls, model):
        from dataclasses import replace

        from mlx_dgemma.engine.policy import AutoPlanner, DraftRequest, cached_profile, make_plan
        from mlx_dgemma.generate import generation_config

        class Scripted(AutoPlanner):
            def choose(self, remaining, overrides=None, produced=0, prompt=()):
                name = cls.SCRIPT[(len(prompt) + produced // 5) % len(cls.SCRIPT)]
                plan = make_plan(name, self.gen, self.canvas, remaining, self.profile, draft=DraftRequest(5, 1))
                return replace(plan, policy="auto").overridden(overrides or {})

        return Scripted(generation_config(model, None), model.config.canvas_length, cached_profile(model))


def test_auto_rows_switch_kinds_in_the_batch_and_give_what_they_give_alone(demo, monkeypatch):
    """auto rows move between canvases, autoregressive blocks and verified rounds inside the engine,
    joining at different steps: each answer is the one it gets alone, and their denoising,
    autoregressive and verifying forwards take several rows at once."""
    from mlx_dgemma.generate import prompt_ids

    model, tokenizer = demo
    from mlx_dgemma.engine.policy import PLANNERS

    saved = PLANNERS.get(model)
    PLANNERS.set(model, ScriptedPlanner(model))
    rows = {"denoise": 0, "next_token_logits": 0, "encode": 0}
    for name in rows:

        def counted(ids, *args, _forward=getattr(model, name), _name=name, **kwargs):
            rows[_name] = max(rows[_name], ids.shape[0])
            return _forward(ids, *args, **kwargs)

        monkeypatch.setattr(model, name, counted, raising=False)
    try:
        prompts = DEMO_PROMPTS + ["json: name=bob age=7 city=oslo", "sort: 9 3 77 12"]
        requests = [
            job(model, tokenizer, prompt_ids(tokenizer, p), 96, seed=i, policy="auto") for i, p in enumerate(prompts)
        ]
        texts = _staggered(model, tokenizer, requests)
        assert min(rows.values()) > 1, rows
        monkeypatch.undo()
        modes = []
        for i, r in enumerate(requests):
            responses = list(
                stream_generate(
                    model, tokenizer, r.ids, r.max_tokens, seed=r.rng.seed, policy="auto", chat_template=False
                )
            )
            assert texts[i] == "".join(x.text for x in responses), i
            modes += [x.plan.mode for x in responses]
        assert {"diffusion", "ar", "verified"} <= set(modes)
    finally:
        PLANNERS.set(model, saved)


# A schema llguidance gives up on mid-answer (its lexer's limit on the pattern), once the model writes
# the optional key that the shortest answer, checked at admission, leaves out.
GIVES_UP = {
    "type": "object",
    "properties": {"q": {"type": "string", "maxLength": 5000, "pattern": r"^(?:\S+\s+){0,99}\S+$"}},
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "policy, bad",
    [("ar", {"schema": GIVES_UP}), ("verified", {"schema": GIVES_UP}), ("reference", {"schema": GIVES_UP})],
)
def test_a_row_whose_step_fails_ends_alone(demo, policy, bad):
    """The failing row's response carries its one-line error; the healthy row beside it gives its answer alone."""
    model, tokenizer = demo
    healthy = {"max_tokens": 40, "policy": policy, "seed": 3}
    alone = generate(model, tokenizer, "sort: 42 17 85 23 61", **healthy)
    engine = BatchGenerator(model, tokenizer)
    good = engine.insert(prepare(model, tokenizer, "sort: 42 17 85 23 61", GenerationArgs.of(**healthy)))
    failing = engine.insert(prepare(model, tokenizer, "hello", GenerationArgs.of(max_tokens=64, policy=policy, **bad)))
    text, errors = "", {}
    while len(engine):
        for r in engine.next():
            if r.error is not None:
                errors[r.uid] = r.error
            elif r.uid == good:
                text += r.text
    assert text == alone
    assert list(errors) == [failing] and isinstance(errors[failing], TemplateError)
    assert "llguidance gave up on the schema mid-answer" in str(errors[failing]) and "\n" not in str(errors[failing])
