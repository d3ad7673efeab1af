"""Policies through the generation API: AR decoding, the trimmed last canvas, auto's device choice."""

import mlx.core as mx
import pytest

from mlx_dgemma import load, stream_generate
from mlx_dgemma.policy import Profile

PROMPT = [2, 10, 11, 12, 13, 14, 15, 16, 17]


@pytest.fixture(scope="module")
def pattern(checkpoints):
    return load(checkpoints("pattern"))  # canvas 16


def test_ar_policy_is_greedy_decoding_through_the_encoder(pattern):
    model, tokenizer = pattern
    responses = list(stream_generate(model, tokenizer, PROMPT, 20, policy="ar"))
    got = [t for r in responses for t in r.tokens]

    cache = model.make_cache()
    logits = model.next_token_logits(mx.array([PROMPT]), cache)
    expected = []
    for _ in range(20):
        expected.append(logits.argmax(-1).item())
        if expected[-1] in model.generation_config.eos_token_id:
            break
        logits = model.next_token_logits(mx.array([[expected[-1]]]), cache)
    assert got == expected
    assert [len(r.tokens) for r in responses][:1] == [min(16, len(expected))]  # blocks of one canvas
    assert responses[-1].plan.mode == "ar" and responses[-1].tokens_per_forward == pytest.approx(1.0)


def test_fast_policy_trims_the_last_canvas_and_compacts(pattern):
    model, tokenizer = pattern
    eos = model.generation_config.eos_token_id
    reference = list(stream_generate(model, tokenizer, PROMPT, 21, seed=1, policy="reference", drafts=True))
    fast = list(stream_generate(model, tokenizer, PROMPT, 21, seed=1, policy="fast", drafts=True))
    if any(r.finish_reason == "stop" for r in reference + fast):
        pytest.skip(f"a stop id {eos} came up in this random model's output")
    computed = lambda responses: [len(r.drafts[-1].tokens) for r in responses]  # noqa: E731
    assert computed(reference) == [16, 16]  # whole canvases, as the reference does
    assert computed(fast) == [16, 8]  # 5 tokens still wanted -> a canvas of 8
    assert [len(r.tokens) for r in reference] == [len(r.tokens) for r in fast] == [16, 5]  # 21 handed out
    plan = fast[0].plan
    assert plan.freeze_after >= 1 and plan.stability_threshold == 0 and reference[0].plan.freeze_after == 0


def test_auto_policy_follows_the_device_profile(pattern):
    """Compute-bound steps (time ~ canvas length) lose to AR; bandwidth-bound ones win."""
    model, tokenizer = pattern
    compute_bound = Profile("mac-like", "measured", {16: 0.016, 256: 0.256}, ar_token_s=0.01, prefill_tok_s=1e3)
    bandwidth_bound = Profile("gpu-like", "measured", {16: 0.002, 256: 0.004}, ar_token_s=0.004, prefill_tok_s=1e4)
    mac = next(stream_generate(model, tokenizer, PROMPT, 8, policy="auto", profile=compute_bound, expected_steps=16))
    gpu = next(stream_generate(model, tokenizer, PROMPT, 8, policy="auto", profile=bandwidth_bound, expected_steps=16))
    assert mac.plan.mode == "ar" and gpu.plan.mode == "diffusion"
    assert "mac-like" in mac.plan.explain() and "gpu-like" in gpu.plan.explain()


def test_unknown_policy_is_refused(pattern):
    model, tokenizer = pattern
    with pytest.raises(ValueError, match="unknown policy 'turbo'"):
        next(stream_generate(model, tokenizer, PROMPT, 8, policy="turbo"))
