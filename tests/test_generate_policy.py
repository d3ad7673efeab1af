"""Policies through the generation API: AR decoding, the trimmed last canvas, auto's device choice."""

import itertools
from dataclasses import replace

import mlx.core as mx
import pytest

from mlx_dgemma import load, stream_generate
from mlx_dgemma.engine import drafting
from mlx_dgemma.engine.policy import PLANNERS, Profile, make_plan
from mlx_dgemma.generate import DEMO_MODEL
from mlx_dgemma.model.config import GenerationConfig

PROMPT = [2, 10, 11, 12, 13, 14, 15, 16, 17]


# Steps cheap next to a verifying pass, an AR token a quarter of a 16-position step.
CPU_LIKE = Profile(
    "cpu-like",
    "measured",
    {2: 0.008, 8: 0.012, 16: 0.016},
    ar_token_s=0.004,
    prefill_tok_s=1e4,
    verify_s_by_length={2: 0.008, 8: 0.02, 16: 0.03},
)


def fixed(policy: str):
    """The plan of a fixed policy, as auto's canvases and rounds are observed under one."""
    return make_plan(policy, GenerationConfig(), 16, 64)


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
    assert plan.settings.freeze_after >= 1 and plan.settings.stability_threshold == 0
    assert reference[0].plan.settings.freeze_after == 0


def test_auto_policy_follows_the_device_profile(pattern):
    """Auto takes the policy with the most predicted tok/s: AR where every forward costs many AR
    tokens (compute-bound), diffusion where steps are cheap and few, verified drafting where a short
    draft and its check cost about an AR token each."""
    model, tokenizer = pattern
    compute_bound = Profile(
        "mac-like",
        "measured",
        {2: 0.02, 16: 0.05, 256: 0.256},
        ar_token_s=0.01,
        prefill_tok_s=1e3,
        verify_s_by_length={2: 0.02, 16: 0.05},
    )
    bandwidth_bound = Profile(
        "gpu-like",
        "measured",
        {2: 0.002, 16: 0.002, 256: 0.004},
        ar_token_s=0.004,
        prefill_tok_s=1e4,
        verify_s_by_length={2: 0.004, 16: 0.004},
    )
    draft_friendly = Profile(
        "cpu-like",
        "measured",
        {2: 0.003, 16: 0.004, 256: 0.064},
        ar_token_s=0.004,
        prefill_tok_s=1e4,
        verify_s_by_length={2: 0.003, 16: 0.004},
    )
    cases = ((compute_bound, 16, "ar"), (bandwidth_bound, 2, "diffusion"), (draft_friendly, 16, "verified"))
    for profile, steps, mode in cases:
        response = next(
            stream_generate(model, tokenizer, PROMPT, 8, policy="auto", profile=profile, expected_steps=steps)
        )
        assert response.plan.mode == mode, profile.device
        text = response.plan.explain()
        assert profile.device in text and all(name in text for name in ("reference", "fast", "ar", "verified"))


def test_auto_learns_from_what_it_observes(pattern):
    """A planner that expected short canvases switches away from diffusion once canvases keep running
    to the step limit (random weights never converge), between canvases of one generation."""
    from mlx_dgemma.engine.policy import AutoPlanner
    from mlx_dgemma.model.config import GenerationConfig

    model, tokenizer = pattern
    profile = Profile(
        "cpu-like",
        "measured",
        {2: 0.008, 16: 0.016, 256: 0.256},
        ar_token_s=0.004,
        prefill_tok_s=1e4,
        verify_s_by_length={2: 0.05, 16: 0.05},
    )
    planner = AutoPlanner(GenerationConfig(max_denoising_steps=8), 16, profile, expected_steps=1)
    assert planner.choose(64).mode == "diffusion"
    for _ in range(4):
        planner.observe_canvas(fixed("reference"), 8)
        planner.observe_canvas(fixed("fast"), 8)
    assert planner.choose(64).mode == "ar"


def test_auto_expects_answers_as_long_as_the_last_ones():
    """A canvas gives no more tokens than the answer still has: after short answers auto decodes the
    next one autoregressively, after long ones it denoises canvases again."""
    from mlx_dgemma.engine.policy import AutoPlanner
    from mlx_dgemma.model.config import GenerationConfig

    planner = AutoPlanner(GenerationConfig(max_denoising_steps=8), 16, CPU_LIKE, expected_steps=2)
    assert planner.choose(64).mode == "diffusion"  # a whole canvas in 2 steps: 500 tok/s (fast more), AR 250
    for _ in range(3):
        planner.observe_answer(3)
    assert planner.expected_tokens(0) == 3
    predicted = planner.predictions(64)
    assert max(predicted, key=lambda n: predicted[n][0]) == "ar"  # 3 tokens per canvas or round
    assert planner.choose(64).mode == "ar"
    for _ in range(8):
        planner.observe_answer(40)
    assert planner.choose(64).mode == "diffusion"
    assert planner.expected_tokens(30) == 10
    assert planner.expected_tokens(40) == 40  # none longer: as many again as it has


def test_both_diffusion_plans_canvases_say_how_many_steps_a_canvas_takes():
    """A prompt takes about as many steps under reference and fast: each plan's estimate comes from
    the canvases of both (fast saving the confirming step, the stability threshold, until both have
    canvases enough to say how many it saves), so one slow canvas of fast does not keep it out."""
    from mlx_dgemma.engine.policy import AutoPlanner

    planner = AutoPlanner(GenerationConfig(max_denoising_steps=16, stability_threshold=1), 16, CPU_LIKE)
    assert planner.steps_per_canvas("fast") == planner.steps_per_canvas("reference") == 4  # the prior
    planner.observe_canvas(fixed("fast"), 7)
    assert (planner.steps_per_canvas("reference"), planner.steps_per_canvas("fast")) == (8, 7)
    for _ in range(4):
        planner.observe_canvas(fixed("reference"), 3)
    assert planner.steps_per_canvas("reference") == pytest.approx((4 * 3 + 8) / 5)
    assert planner.steps_per_canvas("fast") == pytest.approx((4 * 3 + 8) / 5 - 1)
    for _ in range(2):  # fast's canvases take as many steps as the reference's: it saves none
        planner.observe_canvas(fixed("fast"), 3)
    both = (4 * 3 + 7 + 2 * 3) / 7
    assert planner.steps_per_canvas("reference") == pytest.approx(both) == planner.steps_per_canvas("fast")


def planner_of_two_answer_lengths():
    """An auto planner that has seen 3-token answers to prompts beginning ``template + short`` and
    40-token ones to prompts beginning ``template + long``."""
    from mlx_dgemma.engine.policy import AutoPlanner
    from mlx_dgemma.model.config import GenerationConfig

    planner = AutoPlanner(GenerationConfig(max_denoising_steps=8), 16, CPU_LIKE, expected_steps=2)
    template, short, long = [2, 105, 9], [40, 41], [50, 51]
    for i in range(8):
        planner.observe_answer(3, template + short + [60 + i])
        planner.observe_answer(40, template + long + [70 + i])
    return planner, template, short, long


def test_auto_expects_the_length_of_answers_to_prompts_like_this_one():
    """Answers to prompts that begin alike (a task's instructions, a conversation's earlier turns) say
    how long the next one may be; a prompt like none of them gets all the recent answers."""
    planner, template, short, long = planner_of_two_answer_lengths()
    assert planner.answers(template + short + [99]) == [3] * 8
    assert planner.expected_tokens(0, template + long + [99]) == 40
    assert planner.choose(64, prompt=template + short + [99]).mode == "ar"  # 3 tokens per canvas or round
    assert planner.choose(64, prompt=template + long + [99]).mode == "diffusion"
    assert planner.expected_tokens(0, [7, 7]) == (3 + 40) / 2  # shares nothing: the latest answers
    assert planner.answers(template + [30, 1]) == [3, 40] * 4  # a new kind: the latest others
    planner.observe_answer(20, template + [30])  # then its own, from the first
    assert planner.answers(template + [30, 1]) == [20]
    assert planner.answers(template + short + [99]) == [3] * 8
    for i in range(8):  # steps per canvas, too, come from the canvases of prompts like this one
        planner.observe_canvas(fixed("fast"), 1, prompt=template + short + [60 + i])
        planner.observe_canvas(fixed("fast"), 6, prompt=template + long + [70 + i])
    assert planner.steps["fast"].value(template + short) == 1 and planner.steps["fast"].value(template + long) == 6


def test_a_prompt_unlike_every_one_seen_is_not_promised_their_steps():
    """Steps per canvas differ several-fold between the demo's tasks (sort 1-3, add 4-24), so a prompt unlike
    every one whose canvases were seen is expected halfway between what those took and the prior (a
    quarter of the step limit); one with their instructions takes what they took, whatever follows."""
    from mlx_dgemma.engine.policy import AutoPlanner

    planner = AutoPlanner(GenerationConfig(max_denoising_steps=24), 16, CPU_LIKE)
    template, task = [2, 105, 9], [40, 41]
    for i in range(8):
        planner.observe_canvas(fixed("fast"), 1, prompt=template + task + [60 + i])
        planner.observe_answer(8, template + task + [60 + i])
    assert planner.steps["fast"].prior == 6
    same, other = template + task + [99], template + [30, 31]  # 99 follows no prompt seen
    assert planner.steps_per_canvas("fast", same) == 1 and planner.choose(64, prompt=same).mode == "diffusion"
    assert planner.steps_per_canvas("fast", other) == (1 + 6) / 2
    assert planner.choose(64, prompt=other).mode != "diffusion"  # 8 tokens in 3.5 steps: slower than AR
    for i in range(8):  # its own canvases, from the first
        planner.observe_canvas(fixed("fast"), 2, prompt=template + [30, 50 + i])
    assert planner.steps_per_canvas("fast", other) == 2 and planner.steps_per_canvas("fast", same) == 1
    for i in range(2):  # the latest canvases of two tasks, and a prompt of neither
        planner.observe_canvas(fixed("fast"), 1, prompt=template + task + [70 + i])
    assert planner.steps_per_canvas("fast", template + [20, 21]) == ((6 * 2 + 2 * 1) / 8 + 6) / 2
    planner.observe_canvas(fixed("fast"), 3, prompt=template + [25, 26])  # one of a third task among them
    assert planner.steps_per_canvas("fast", template + [20, 21]) == ((5 * 2 + 2 * 1 + 3) / 8 + 6) / 2
    for other in ([11, 12], [13, 14]):  # the reference's canvases: one each of two more tasks
        planner.observe_canvas(fixed("reference"), 4, prompt=template + other)
    assert planner.untried(template + [20, 21]) and not planner.untried(template + [13, 14, 15])
    fresh = AutoPlanner(GenerationConfig(max_denoising_steps=24), 16, CPU_LIKE)
    for other in ([11, 12], [13, 14], [13, 14]):  # two prompts, one answered in two canvases
        fresh.observe_canvas(fixed("fast"), 1, prompt=template + other)
        fresh.observe_answer(8, template + other)
    assert not fresh.untried(template + [20, 21])  # two prompts of two tasks: none is told apart yet
    # a task's own canvases under one plan, not the other plan's canvases of other tasks
    assert planner.steps_per_canvas("reference", template + [13, 14, 16]) == 4
    assert planner.steps_per_canvas("fast", template + [13, 14, 16]) == 4 - planner.gen.stability_threshold


def test_a_tasks_steps_seen_once_are_confirmed_while_close_to_the_best():
    """One canvas of a task (a warm-up's) is all its steps rest on: 3 steps puts fast just behind AR,
    which then runs every answer and no canvas corrects it (reverse canvases take 1). While fewer than
    3 agree, a canvas predicted within EXPLORE_WITHIN of the best is run; then the best is."""
    from mlx_dgemma.engine.policy import AutoPlanner
    from mlx_dgemma.engine.policy.auto import EXPLORE_WITHIN

    planner = AutoPlanner(GenerationConfig(max_denoising_steps=24), 16, CPU_LIKE)
    template, sort, reverse = [2, 105, 9], [40, 41], [30, 31]
    for i in range(8):
        planner.observe_canvas(fixed("fast"), 1, prompt=template + sort + [60 + i])
        planner.observe_answer(8, template + sort + [60 + i])
    planner.observe_canvas(fixed("fast"), 3, prompt=template + reverse + [50])
    planner.observe_answer(8, template + reverse + [50])
    chosen = []
    for i in range(4):
        prompt = template + reverse + [51 + i]
        predicted = planner.predictions(64, 0, prompt)
        assert EXPLORE_WITHIN * predicted["ar"][0] < predicted["fast"][0] < predicted["ar"][0]
        plan = planner.choose(64, prompt=prompt)
        chosen.append(plan.mode)
        if plan.mode == "diffusion":
            assert plan.exploring and "run to confirm their steps" in plan.explain()
            planner.observe_canvas(plan, 3, prompt=prompt)
        planner.observe_answer(8, prompt)
    assert chosen == ["diffusion", "diffusion", "ar", "ar"]


def test_tokens_per_round_against_the_model_are_averaged_as_ratios():
    """A task's verified rounds give tokens per round at some ratio to the acceptance model's: a round
    at half and one at twice the model's cancel, and a task whose first round keeps no draft token (1
    token of 14 modelled, an add answer) is predicted well below the model at once (the arithmetic mean
    with the prior would still say 0.54 of it)."""
    from mlx_dgemma.engine.policy import AutoPlanner

    planner = AutoPlanner(GenerationConfig(), 16, CPU_LIKE)
    even, poor = [2, 105, 9, 40, 41], [2, 105, 9, 70, 71]
    for ratio in (0.5, 2.0):
        planner.round_yield.add(ratio, even + [60])
    planner.round_yield.add(1 / 14, poor + [60])
    planner.prompts.add(even + [61])
    planner.prompts.add(poor + [61])
    assert planner.round_yield.value(even + [62]) == pytest.approx(1.0)
    assert planner.round_yield.value(poor + [62]) == pytest.approx((1 / 14) ** 0.5)


def test_one_canvas_at_the_step_limit_does_not_keep_a_task_off_diffusion():
    """A plan planned too slow for a task is not run on it, so nothing would correct it: a task's
    steps per canvas are its mean less a standard error, and a slower reading counts once 3 agree."""
    from mlx_dgemma.engine.policy import AutoPlanner

    planner = AutoPlanner(GenerationConfig(max_denoising_steps=24), 16, CPU_LIKE)
    template, easy, hard = [2, 105, 9], [40, 41], [50, 51]
    for i in range(3):
        planner.observe_answer(16, template + [30, 31, 60 + i])  # another task's answers: the tasks told apart
        planner.observe_canvas(fixed("fast"), 2, prompt=template + easy + [60 + i])
        planner.observe_answer(16, template + easy + [60 + i])
    assert planner.choose(64, prompt=template + easy + [99]).mode == "diffusion"
    planner.observe_canvas(fixed("fast"), 24, prompt=template + easy + [70])  # the mean: 7.5 steps, slower than AR
    assert planner.steps_per_canvas("fast", template + easy + [99]) == 2
    assert planner.choose(64, prompt=template + easy + [99]).mode == "diffusion"
    for i in range(3):  # a task whose canvases all take the step limit is found out once 3 agree
        planner.observe_canvas(fixed("fast"), 24, prompt=template + hard + [60 + i])
        planner.observe_answer(16, template + hard + [60 + i])
        if i == 0:
            assert planner.steps_per_canvas("fast", template + hard + [99]) < 24 / 2
    assert planner.steps_per_canvas("fast", template + hard + [99]) == 24
    assert planner.choose(64, prompt=template + hard + [99]).mode == "ar"


def test_a_task_answered_but_never_by_a_canvas_runs_one():
    """A new task's first answer, expected halfway to the step limit, runs AR; the task's canvases would
    never be observed, and an easy task stay on AR for good. Once the task has been answered, a canvas
    predicted the best at the other tasks' steps is run once, and its own steps decide from then on.
    The first answer is not staked on a canvas to check a plan not run for a while either."""
    from mlx_dgemma.engine.policy import AutoPlanner
    from mlx_dgemma.engine.policy.auto import EXPLORE_EVERY, EXPLORE_WITHIN

    planner = AutoPlanner(GenerationConfig(max_denoising_steps=20), 16, CPU_LIKE)
    template, sort, reverse = [2, 105, 9], [40, 41], [30, 31]
    for i in range(8):
        planner.observe_canvas(fixed("fast"), 1, prompt=template + sort + [60 + i])
        planner.observe_answer(8, template + sort + [60 + i])
    first, second = template + reverse + [50], template + reverse + [51]
    planner.idle.update(reference=EXPLORE_EVERY, fast=EXPLORE_EVERY)
    predicted = planner.predictions(64, 0, first)
    assert EXPLORE_WITHIN * predicted["ar"][0] < predicted["fast"][0] < predicted["ar"][0]  # 8 tokens in 3 steps
    plan = planner.choose(64, prompt=first)
    assert plan.mode == "ar" and not plan.why
    planner.observe_ar(plan, 8, prompt=first)
    planner.observe_answer(8, first)
    plan = planner.choose(64, prompt=second)
    assert plan.mode == "diffusion" and plan.why.startswith(" (no canvas yet on prompts like this one")
    assert planner.predictions(64, 0, second)["ar"][0] > planner.predictions(64, 0, second)["fast"][0]
    planner.observe_canvas(plan, 1, prompt=second)
    planner.observe_answer(8, second)
    for i in range(2):
        plan = planner.choose(64, prompt=template + reverse + [52 + i])
        assert plan.mode == "diffusion" and not plan.why  # the task's own steps: 1
        planner.observe_canvas(plan, 1, prompt=template + reverse + [52 + i])
        planner.observe_answer(8, template + reverse + [52 + i])
    hard = template + [20, 21]
    for i in range(2):
        plan = planner.choose(64, prompt=hard + [70 + i])
        assert plan.mode == ("ar" if i == 0 else "diffusion")
        planner.observe_answer(8, hard + [70 + i])
    planner.observe_canvas(plan, 12, prompt=hard + [71])
    assert planner.choose(64, prompt=hard + [72]).mode == "ar"  # once: its steps are the task's own


def test_a_trial_canvas_runs_when_close_to_the_best_not_only_above_it():
    """A new task of short answers: one verified round or a few AR tokens, and a canvas at the other
    tasks' steps, are predicted within a few percent of each other, so which is ahead is noise. The
    trial runs once within ``EXPLORE_WITHIN`` of the best, as a retry does: else an easy task (the
    demo's reverse) can stay on the runner-up for good."""
    from mlx_dgemma.engine.policy import AutoPlanner
    from mlx_dgemma.engine.policy.auto import EXPLORE_WITHIN

    planner = AutoPlanner(GenerationConfig(max_denoising_steps=24), 16, CPU_LIKE)
    template, sort, short = [2, 105, 9], [40, 41], [30, 31]
    for i in range(8):
        planner.observe_canvas(fixed("fast"), 1, prompt=template + sort + [60 + i])
        planner.observe_answer(8, template + sort + [60 + i])
    plan = planner.choose(64, prompt=template + short + [50])
    assert plan.mode == "ar"  # a new task's first answer: not a canvas
    planner.observe_ar(plan, 3, prompt=template + short + [50])
    planner.observe_answer(3, template + short + [50])
    planner.observe_answer(2, template + short + [51])
    second = template + short + [52]
    predicted, hopeful = planner.predictions(64, 0, second), planner.predictions(64, 0, second, hopeful=True)
    best = max(predicted[name][0] for name in predicted)
    assert EXPLORE_WITHIN * best <= hopeful["fast"][0] < best  # 2.5 tokens in a 12 ms step, AR's 4 ms each
    plan = planner.choose(64, prompt=second)
    assert plan.mode == "diffusion" and plan.why.startswith(" (no canvas yet on prompts like this one")


def test_a_verified_round_is_paid_in_full_at_the_end_of_an_answer():
    """A round costs the same however few tokens are left: an answer of 18 tokens at 13 a round takes
    two rounds, 9 tokens each, where 13 or 26 take one or two full ones."""
    from mlx_dgemma.engine.policy import AutoPlanner

    planner = AutoPlanner(GenerationConfig(max_denoising_steps=8), 16, CPU_LIKE, expected_steps=2)
    planner.acceptance.tokens_per_round = lambda steps, length: 13.0
    template = [2, 105, 9]
    for length, task in ((13, 40), (18, 50), (26, 60)):
        for i in range(8):
            planner.observe_answer(length, template + [task, 70 + i])
    verified = {
        n: planner.predictions(64, 0, template + [task, 99])["verified"][0]
        for n, task in ((13, 40), (18, 50), (26, 60))
    }
    assert verified[18] == pytest.approx(verified[13] * 9 / 13) and verified[26] == pytest.approx(verified[13])


def test_auto_learns_each_answers_length(pattern):
    model, tokenizer = pattern
    PLANNERS.set(model, None)
    profile = Profile(
        "any",
        "measured",
        {2: 0.01, 16: 0.01},
        ar_token_s=0.01,
        prefill_tok_s=1e3,
        verify_s_by_length={2: 0.01, 16: 0.01},
    )
    lengths = []
    for max_tokens in (5, 21):
        responses = list(stream_generate(model, tokenizer, PROMPT, max_tokens, policy="auto", profile=profile))
        lengths.append(responses[-1].generation_tokens)
    assert PLANNERS.get(model).answers() == lengths
    PLANNERS.set(model, None)


def test_auto_switches_plans_between_canvases_and_rounds(pattern, monkeypatch):
    """Whatever auto switches between, the cache holds exactly what was emitted: every AR block and
    verified round after a switch continues the text as greedy decoding of everything before it would.
    No stop ids: whether a random checkpoint's answer meets one within the script depends on float32
    rounding (another BLAS, another device), and the script must run to its end."""
    from mlx_dgemma.engine.policy import AutoPlanner, DraftRequest, make_plan
    from mlx_dgemma.model.config import GenerationConfig

    class Scripted(AutoPlanner):
        def __init__(self, modes, *args):
            super().__init__(*args)
            self.modes = iter(modes)

        def choose(self, remaining, overrides=None, produced=0, prompt=()):
            name = next(self.modes, "ar")
            plan = make_plan(name, self.gen, self.canvas, remaining, self.profile, draft=DraftRequest(5, 1))
            return replace(plan, policy="auto").overridden(overrides or {})

    model, tokenizer = pattern
    monkeypatch.setattr(model, "generation_config", replace(model.generation_config, eos_token_id=[]))
    profile = Profile("any", "measured", {16: 0.01}, ar_token_s=0.01, prefill_tok_s=1e3)
    script = ["verified", "verified", "reference", "verified", "ar", "verified", "fast", "ar"]
    PLANNERS.set(model, Scripted(script, GenerationConfig(max_denoising_steps=4), 16, profile))
    responses = list(stream_generate(model, tokenizer, PROMPT, 80, policy="auto", profile=profile, seed=0))
    assert responses[-1].finish_reason == "length"  # no stop id cut the script short
    assert [r.plan.mode for r in responses][: len(script)] == [
        make_plan(m, GenerationConfig(), 16, 8).mode for m in script
    ]
    emitted = list(PROMPT)
    for r in responses:
        if r.plan.mode != "diffusion":
            cache = model.make_cache()
            logits = model.next_token_logits(mx.array([emitted]), cache)
            expected = []
            for _ in r.tokens:
                expected.append(logits.argmax(-1).item())
                logits = model.next_token_logits(mx.array([[expected[-1]]]), cache)
            assert r.tokens == expected, r.plan.mode
        emitted += r.tokens
    PLANNERS.set(model, None)


def test_an_ar_block_run_to_measure_ar_is_short(pattern, monkeypatch):
    """An AR block auto runs to time AR (a probe or a retry, not the best plan) is paid for at AR's
    pace: it is the shortest block, and the plan is chosen again after it; the best plan's block runs
    as long as the answer is expected to."""
    from mlx_dgemma.engine.policy import AutoPlanner
    from mlx_dgemma.engine.rows.autoregressive import AR_BLOCK_MIN

    class Scripted(AutoPlanner):
        def __init__(self, exploring, *args):
            super().__init__(*args)
            self.exploring = iter(exploring)

        def choose(self, remaining, overrides=None, produced=0, prompt=()):
            plan = make_plan("ar", self.gen, self.canvas, remaining, self.profile)
            return replace(plan, policy="auto", exploring=next(self.exploring, False))

    model, tokenizer = pattern
    monkeypatch.setattr(model, "generation_config", replace(model.generation_config, eos_token_id=[]))
    profile = Profile("any", "measured", {16: 0.01}, ar_token_s=0.01, prefill_tok_s=1e3)
    planner = Scripted([True, False, True], GenerationConfig(max_denoising_steps=4), 16, profile)
    planner.observe_answer(40, PROMPT)  # answers to it run to 40 tokens
    PLANNERS.set(model, planner)
    responses = list(stream_generate(model, tokenizer, PROMPT, 40, policy="auto", profile=profile, seed=0))
    blocks = [sum(len(r.tokens) for r in group) for _, group in itertools.groupby(responses, key=lambda r: id(r.plan))]
    assert blocks == [AR_BLOCK_MIN, 16, AR_BLOCK_MIN, 16], blocks
    PLANNERS.set(model, None)


def test_unknown_policy_is_refused(pattern):
    model, tokenizer = pattern
    with pytest.raises(ValueError, match="unknown policy 'turbo'"):
        next(stream_generate(model, tokenizer, PROMPT, 8, policy="turbo"))


def test_auto_runs_a_close_second_again_now_and_then():
    """Estimates of a plan that does not run cannot move, so auto re-runs a close second every
    EXPLORE_EVERY choices (and then follows what it sees), but never a plan far behind."""
    from mlx_dgemma.engine.policy import EXPLORE_EVERY, EXPLORE_WITHIN, AutoPlanner
    from mlx_dgemma.model.config import GenerationConfig

    profile = Profile(
        "cpu-like",
        "measured",
        {2: 0.0055, 16: 0.016, 256: 0.256},
        ar_token_s=0.004,
        prefill_tok_s=1e4,
        verify_s_by_length={2: 0.0055, 16: 0.016},
    )
    planner = AutoPlanner(GenerationConfig(max_denoising_steps=48), 16, profile, expected_steps=48)
    predicted = planner.predictions(64)
    assert max(predicted, key=lambda n: predicted[n][0]) == "ar"
    assert predicted["verified"][0] > EXPLORE_WITHIN * predicted["ar"][0] > predicted["reference"][0]
    plans = [planner.choose(64) for _ in range(2 * EXPLORE_EVERY + 2)]
    modes = [plan.mode for plan in plans]
    assert modes.count("verified") == 2 and modes.count("diffusion") == 0
    assert all("run again to check" in plan.explain() for plan in plans if plan.mode == "verified")
    assert [plan.exploring for plan in plans] == [plan.mode == "verified" for plan in plans]


def test_overrides_apply_on_top_of_given_settings():
    """``settings=`` is the base; explicit numbers still override it (none is silently dropped)."""
    from mlx_dgemma.engine.sampler import SamplerSettings

    model, tokenizer = load(DEMO_MODEL)
    responses = list(
        stream_generate(
            model,
            tokenizer,
            "sort: 42 17 85 23 61",
            32,
            seed=0,
            settings=SamplerSettings(steps=20, confidence_threshold=1e-30),
            steps=3,
            freeze_after=1,
            drafts=True,
        )
    )
    assert responses[0].steps == 3 == len(responses[0].drafts)  # the override's step count, not the settings'
    assert responses[0].plan.settings.steps == 3


def test_auto_applies_the_callers_settings_to_every_plan(pattern):
    """Auto re-plans at every canvas; each plan carries the caller's sampler numbers (none dropped)."""
    model, tokenizer = pattern
    cheap_steps = Profile(
        "gpu-like",
        "measured",
        {2: 0.002, 16: 0.002, 256: 0.004},
        ar_token_s=0.004,
        prefill_tok_s=1e4,
        verify_s_by_length={2: 0.004, 16: 0.004},
    )
    assert model.generation_config.max_denoising_steps > 2
    responses = list(
        stream_generate(
            model,
            tokenizer,
            PROMPT,
            32,
            policy="auto",
            profile=cheap_steps,
            expected_steps=2,
            steps=2,
            entropy_bound=0.7,
        )
    )
    diffused = [r for r in responses if r.plan.mode == "diffusion"]
    assert diffused, [r.plan.mode for r in responses]
    for r in diffused:
        assert (r.plan.settings.steps, r.plan.settings.entropy_bound) == (2, 0.7)
        assert r.steps <= 2
        assert "set by the caller: steps 2, entropy bound 0.7" in r.plan.explain()


def _predicted_s(planner, plan, steps: int = 2, tokens: int = 2, length: int = 8) -> float:
    """Seconds the planner's profile gives a canvas of ``steps`` steps (its commit encoded), an AR
    block of ``tokens`` or a verified round of drafts of ``length`` under ``plan``."""
    p, canvas = planner.current.at_prefix(plan.context), planner.canvas
    if plan.mode == "ar":
        return tokens * p.ar_token_s
    if plan.mode == "verified":
        return plan.draft_steps * p.step_s(length) + p.verify_s(length)
    positions = canvas // 2 if plan.settings.freeze_after else canvas
    return steps * p.step_s(positions) + p.verify_s(canvas)


def test_auto_leaves_a_plan_whose_forwards_run_slower_than_predicted():
    """The pace compares the seconds a canvas, block or round took with those the profile gives its
    work: a plan that runs 10x slower than predicted is left for the next best, one that runs twice
    as fast is kept. Only time counts: a canvas that gave 1 token (a short answer) does not slow it."""
    from mlx_dgemma.engine.policy import AutoPlanner
    from mlx_dgemma.model.config import GenerationConfig

    # no confirming steps: the reference's canvases are expected to take as many steps as fast's
    planner = AutoPlanner(
        GenerationConfig(max_denoising_steps=8, stability_threshold=0), 16, CPU_LIKE, expected_steps=2
    )
    first = planner.choose(64)
    name = first.predicted[0]
    planner.observe_canvas(first, 2, seconds=_predicted_s(planner, first), tokens=1)  # on time, 1 token
    assert planner.pace[name].value() == 1 and planner.choose(64).predicted[0] == name
    planner.observe_canvas(first, 2, seconds=10 * _predicted_s(planner, first), tokens=16)
    after = planner.choose(64)
    assert (after.mode, bool(after.settings.freeze_after)) != (first.mode, bool(first.settings.freeze_after))
    assert planner.pace[name].value() < 1
    runner_up = after.predicted[0]
    for _ in range(6):  # the next best runs twice as fast as predicted: it stays
        plan = planner.choose(64)
        if runner_up == "ar":
            planner.observe_ar(plan, 2, seconds=_predicted_s(planner, plan) / 2)
        elif runner_up == "verified":
            done = drafting.Round(tokens=[1, 2], known=3, length=8, kept=4, forwards=2, leftover=[])
            planner.observe_round(plan, done, seconds=_predicted_s(planner, plan) / 2)
        else:
            planner.observe_canvas(plan, 2, seconds=_predicted_s(planner, plan) / 2, tokens=2)
    assert planner.choose(64).predicted[0] == runner_up and planner.pace[runner_up].value() > 1.5


def test_concurrent_auto_answers_are_each_paced_against_their_own_choice():
    """Two answers share the model's planner and choose between each other's observations: each
    canvas or block is measured against the plan it ran under, not against whatever the planner
    chose last."""
    planner, template, short, long = planner_of_two_answer_lengths()
    canvas = planner.choose(64, prompt=template + long + [99])
    block = planner.choose(64, prompt=template + short + [99])  # the other answer's choice, made meanwhile
    assert (canvas.mode, block.mode) == ("diffusion", "ar")
    name = canvas.predicted[0]
    planner.observe_canvas(
        canvas, 2, seconds=2 * _predicted_s(planner, canvas), tokens=16, prompt=template + long + [99]
    )
    planner.observe_ar(block, 4, seconds=_predicted_s(planner, block, tokens=4) / 2, prompt=template + short + [99])
    assert planner.pace[name].value(template + long + [99]) == pytest.approx((1 + 0.5) / 2)  # the prior, then 0.5
    assert planner.pace["ar"].value(template + short + [99]) == pytest.approx((1 + 2) / 2)


def test_each_auto_response_says_which_kind_it_ran_in_and_why(pattern):
    """Every canvas, block or round auto runs carries its choice in the response's plan: the kind it
    ran in (the response's mode), each plan's predicted tok/s and the costs those rest on."""
    model, tokenizer = pattern
    PLANNERS.set(model, None)
    profile = Profile(
        "cpu-like",
        "measured",
        {2: 0.008, 16: 0.016},
        ar_token_s=0.004,
        prefill_tok_s=1e4,
        verify_s_by_length={2: 0.008, 16: 0.03},
    )
    responses = list(stream_generate(model, tokenizer, PROMPT, 40, policy="auto", profile=profile))
    kinds = {"diffusion": ("reference", "fast"), "ar": ("ar",), "verified": ("verified",)}
    for r in responses:
        name = r.plan.predicted[0]
        assert name in kinds[r.plan.mode]
        names, rates = [n for n, _, _ in r.plan.predictions], [t for _, t, _ in r.plan.predictions]
        assert sorted(names) == ["ar", "fast", "reference", "verified"] and rates == sorted(rates, reverse=True)
        line = r.plan.choice()
        assert line.startswith(f"auto ran {name}") and "tok/s predicted" in line
        assert ("ms per step" if r.plan.mode == "diffusion" else "ms per") in line


def test_the_live_profile_learns_only_from_forwards_a_row_had_alone(pattern):
    """A batched row's canvas, block or round shares its forwards with the other rows: its time is not
    the device's for one row, so the live profile observes nothing while two rows are in the engine,
    and what the one left runs alone once the other is done."""
    from mlx_dgemma.engine.batch import BatchGenerator
    from mlx_dgemma.engine.policy import AutoPlanner, LiveProfile
    from mlx_dgemma.engine.request import generation_device, prepare
    from mlx_dgemma.options import GenerationArgs

    model, tokenizer = pattern
    profile = Profile(
        "cpu-like", "measured", {2: 0.008, 16: 0.016}, 0.004, 1e4, verify_s_by_length={2: 0.008, 16: 0.03}
    )
    live = LiveProfile(profile)
    PLANNERS.set(model, AutoPlanner(model.generation_config, 16, profile, live=live))
    generator = BatchGenerator(model, tokenizer)
    try:
        for tokens in (8, 48):  # the first ends well before the second
            args = GenerationArgs.of(max_tokens=tokens, seed=0, policy="auto", profile=profile)
            generator.insert(prepare(model, tokenizer, PROMPT, args))
        with generation_device(model):
            while len(generator):
                together = len(generator) == 2
                generator.next()
                if together:
                    assert not live.counts
    finally:
        PLANNERS.set(model, None)
    assert live.counts  # the second row's last canvases, blocks or rounds: alone


def test_verbose_says_which_kind_each_round_ran_in_and_why(monkeypatch):
    """--verbose under auto prints, after the statistics, one line per canvas, block or round: the kind
    it ran in and the predictions it was chosen by (the costs behind them)."""
    from click.testing import CliRunner

    from mlx_dgemma.engine import request
    from mlx_dgemma.generate import main

    cheap_drafts = Profile(  # short drafts nearly free, a canvas dear: verified drafting every round
        "cpu-like",
        "measured",
        {2: 1e-4, 8: 1e-4, 16: 0.1, 32: 0.1},
        ar_token_s=0.01,
        prefill_tok_s=1e4,
        verify_s_by_length={2: 1e-4, 8: 1e-4, 16: 0.1, 32: 0.1},
    )
    monkeypatch.setattr(request, "cached_profile", lambda model: cheap_drafts)
    monkeypatch.setattr(request, "live_profile_store", lambda model: None)
    model_args = ["--model", str(DEMO_MODEL), "--prompt", "reverse: 1 2 3 4 5 6 7 8 9 10 11 12", "--seed", "0"]
    result = CliRunner().invoke(main, [*model_args, "--policy", "auto", "--verbose", "--max-tokens", "64"])
    assert result.exit_code == 0, result.output
    assert "plan (auto): verified" in result.output
    rounds = int(result.output.split(" rounds, ")[0].rsplit(" ", 1)[1])  # "Generation: N tokens in R rounds"
    lines = result.output.split("round by round:\n")[1].splitlines()
    assert len(lines) == rounds > 1, result.output
    for i, line in enumerate(lines, 1):
        assert line.startswith(f"  {i}. auto ran verified: ") and "tok/s predicted (drafts of" in line
        assert "ms per round" in line and all(f"{name} " in line for name in ("fast", "reference", "ar"))
