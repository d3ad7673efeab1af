"""A device profile that is hard to poison: the isotonic fit, a poisoned cache read back fitted, and
auto's choices recovering from a poisoned profile once it observes the forwards it runs.

The engine's forwards are simulated from a "true" profile (the seconds each canvas, block or round
would take on the device), so that the choices are deterministic: no assertion rests on a measured
speed."""

import json
import math
from dataclasses import replace

import pytest

from mlx_dgemma.engine import drafting
from mlx_dgemma.engine.policy import (
    AutoPlanner,
    LiveProfile,
    Profile,
    cached_profile,
    isotonic,
    profile_cache_path,
    store_profile,
)
from mlx_dgemma.engine.policy.observed import CONFIRM
from mlx_dgemma.model.config import GenerationConfig

GEN = GenerationConfig(max_denoising_steps=16)
CANVAS = 16
ANSWER = 48  # tokens per answer
STEPS = {"reference": 4, "fast": 3}  # what a canvas takes on this (simulated) task
ALPHA = 0.9  # a draft token is kept with this probability (verified rounds keep its expectation)

# Where diffusion wins: steps are cheap next to AR tokens (the truly fastest plan is a diffusion one).
DIFFUSION_WINS = Profile(
    "device",
    "measured",
    {2: 0.002, 4: 0.002, 8: 0.0025, 16: 0.003},
    ar_token_s=0.004,
    prefill_tok_s=1e4,
    verify_s_by_length={2: 0.002, 4: 0.002, 8: 0.0025, 16: 0.003},
)
# Where AR wins: a step costs as much as many AR tokens.
AR_WINS = replace(
    DIFFUSION_WINS,
    step_s_by_canvas={2: 0.01, 4: 0.012, 8: 0.016, 16: 0.024},
    verify_s_by_length={2: 0.01, 4: 0.012, 8: 0.016, 16: 0.024},
    ar_token_s=0.001,
)


def truly_fastest(true: Profile) -> str:
    """The plan with the most tokens per second on the simulated device, over whole answers."""
    rates = {}
    for name in ("reference", "fast", "ar"):
        tokens, seconds = _run(name, true, ANSWER, 0, None)
        rates[name] = tokens / seconds
    return max(rates, key=rates.get)


def _run(name: str, true: Profile, remaining: int, context: int, plan) -> tuple[int, float]:
    """(tokens, seconds) of one canvas, block or round of ``name`` on the true device."""
    p = true.at_prefix(context)
    if name in STEPS:
        positions = CANVAS if name == "reference" else CANVAS // 2
        return min(CANVAS, remaining), STEPS[name] * p.step_s(positions) + p.verify_s(CANVAS)
    if name == "ar":
        block = min(4, remaining)
        return block, block * p.ar_token_s
    n, k = plan.draft_length, plan.draft_steps
    return min(remaining, round((1 - ALPHA**n) / (1 - ALPHA))), k * p.step_s(n) + p.verify_s(n)


def answer(planner: AutoPlanner, true: Profile, prompt=(7, 8, 9)) -> list[str]:
    """One answer of ``ANSWER`` tokens: the plans auto chose for it, each observed as the true device
    would have run it."""
    produced, chosen = 0, []
    while produced < ANSWER:
        plan = planner.choose(ANSWER - produced, produced=produced, prompt=list(prompt))
        produced += observe(planner, plan, true, ANSWER - produced, prompt)
        chosen.append(plan.predicted[0])
    planner.observe_answer(produced, list(prompt))
    return chosen


def observe(planner: AutoPlanner, plan, true: Profile, remaining: int, prompt) -> int:
    """Run ``plan``'s canvas, block or round on the true device, as the planner observes it; its tokens."""
    name = plan.predicted[0]
    tokens, seconds = _run(name, true, remaining, plan.context, plan)
    if name in STEPS:
        planner.observe_canvas(plan, STEPS[name], seconds, tokens, list(prompt))
    elif name == "ar":
        planner.observe_ar(plan, tokens, seconds, list(prompt))
    else:
        done = drafting.Round(list(range(tokens)), 1, plan.draft_length, tokens - 1, plan.draft_steps + 1, [])
        planner.observe_round(plan, done, seconds, list(prompt))
    return tokens


def test_isotonic_pools_what_falls():
    assert isotonic({2: 1.0, 4: 2.0, 8: 3.0}) == {2: 1.0, 4: 2.0, 8: 3.0}  # already a shape it can have
    fitted = isotonic({2: 0.035, 8: 0.027, 16: 0.0126, 256: 0.07})  # the poisoned cache of the issue
    assert fitted[2] == fitted[8] == fitted[16] == pytest.approx((0.035 + 0.027 + 0.0126) / 3)
    assert fitted[256] == 0.07
    values = [fitted[n] for n in sorted(fitted)]
    assert values == sorted(values)
    # least squares: the pooled value is the mean, so the total is kept
    assert sum(values) == pytest.approx(0.035 + 0.027 + 0.0126 + 0.07)


def test_a_poisoned_cache_is_read_back_in_a_shape_the_hardware_can_have(checkpoints, tmp_path):
    from mlx_dgemma import load

    model, _ = load(checkpoints("small"))
    path = profile_cache_path(model, tmp_path)
    poisoned = replace(
        DIFFUSION_WINS,
        step_s_by_canvas={2: 0.035, 8: 0.027, 16: 0.0126, 256: 0.07},
        verify_s_by_length={2: 0.02, 4: 0.01},
        ar_s_per_key=-1e-6,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(poisoned.to_json()))
    read = cached_profile(model, root=tmp_path)  # not measured again: the figures are all positive
    steps = [read.step_s_by_canvas[n] for n in sorted(read.step_s_by_canvas)]
    assert steps == sorted(steps) and read.verify_s_by_length[2] == read.verify_s_by_length[4] == 0.015
    assert read.ar_s_per_key == 0.0
    assert all(read.step_s(n) <= read.step_s(n + 1) for n in range(1, 300))


POISONS = [
    # AR 10x slower in the cache than on the device: auto would never run it
    lambda p: replace(p, ar_token_s=p.ar_token_s * 10),
    # AR 10x faster in the cache than on the device
    lambda p: replace(p, ar_token_s=p.ar_token_s / 10),
    # measured on a busy machine (the cache): step costs falling as the canvas grows, 4-17x too slow
    lambda p: replace(
        p,
        step_s_by_canvas={2: 0.035, 4: 0.03, 8: 0.027, 16: 0.0126},
        verify_s_by_length={2: 0.03, 4: 0.025, 8: 0.02, 16: 0.01},
    ),
]


@pytest.mark.parametrize(
    "true, poison",
    [(AR_WINS, POISONS[0]), (DIFFUSION_WINS, POISONS[1]), (DIFFUSION_WINS, POISONS[2])],
    ids=["ar-10x-slow", "ar-10x-fast", "steps-falling"],
)
def test_auto_recovers_from_a_poisoned_profile_within_a_few_answers(true, poison):
    """A planner on the poisoned profile first chooses a plan that is slower on the device; from the
    forwards it runs (and one probe of a kind it never ran) its live profile takes the device's
    times, and by the third answer it runs the truly fastest plan; the cache is replaced once the
    observations confirm the disagreement. The same planner on the fixed poisoned profile stays."""
    best = truly_fastest(true)
    poisoned = poison(true).fitted()
    stored = []
    live = AutoPlanner(GEN, CANVAS, poisoned, live=LiveProfile(poisoned, stored.append))
    fixed = AutoPlanner(GEN, CANVAS, poisoned)
    assert answer(fixed, true)[0] != best  # the poison misleads a choice made from it
    for _ in range(3):
        answer(live, true)
    assert set(answer(live, true)) == {best}
    if poison is POISONS[0]:  # too slow in the cache, so never run: on the fixed profile it stays so
        assert best not in answer(fixed, true) + answer(fixed, true)
    # the poisoned time is now the device's; where the plan that runs on it was run CONFIRM+ times, the
    # cache holds it too (a plan left after one run is corrected here, and probed again by a new process)
    kind = "ar" if poison is not POISONS[2] else "step"
    live_s, truth = (
        (live.current.ar_token_s, true.ar_token_s)
        if kind == "ar"
        else (live.current.step_s(CANVAS), true.step_s(CANVAS))
    )
    assert math.isclose(live_s, truth, rel_tol=0.35), (live_s, truth)
    if best == "ar" or kind == "step":
        assert stored[-1].source == "observed"
        cached = stored[-1].ar_token_s if kind == "ar" else stored[-1].step_s(CANVAS)
        assert math.isclose(cached, truth, rel_tol=0.35), (cached, truth)


def test_the_cache_takes_a_faster_time_and_a_slower_one_stays_in_the_process(tmp_path):
    """A time confirmed 2.5x faster than the cache's is written to it (a profile measured under load
    is corrected for good); one 2.5x slower moves this process's profile and not the cache (another
    process's load lasts only a while: written, it would price that plan out of every later process,
    which finds a slower time in CONFIRM forwards of its own). Either way the kind is marked observed,
    so that the next process does not probe it again, and the cache is a profile like any other."""
    stored = []
    live = LiveProfile(DIFFUSION_WINS, stored.append)
    for _ in range(CONFIRM):
        live.observe_ar(4, 0, 4 * 0.01)  # 2.5x the cached AR token
    assert live.profile.ar_token_s == pytest.approx(0.01)
    assert stored == [replace(DIFFUSION_WINS, observed=["ar"])]
    for _ in range(CONFIRM):
        live.observe_canvas(CANVAS, 4, 0, (4 * 0.003 + 0.003) / 2.5)  # steps 2.5x faster than cached
    assert stored[-1].observed == ["ar", "step"] and stored[-1].source == "observed"
    assert stored[-1].step_s(CANVAS) == pytest.approx(0.003 / 2.5) and stored[-1].ar_token_s == 0.004
    path = tmp_path / "p.json"
    store_profile(path, stored[-1])
    assert Profile.from_json(json.loads(path.read_text())) == stored[-1]
    again = AutoPlanner(GEN, CANVAS, stored[-1], live=LiveProfile(stored[-1]))
    assert "ar" in again.live.observed_kinds()


def test_one_slow_canvas_does_not_replace_the_cache():
    """A canvas slowed by another process does not move the live profile (its lower quartile: load
    only slows a forward), and the cache is replaced only when several observations disagree with it."""
    stored = []
    live = LiveProfile(DIFFUSION_WINS, stored.append)
    live.observe_canvas(CANVAS, 4, 0, 10 * (4 * 0.003 + 0.003))  # 10x slower once
    assert live.profile.step_s(CANVAS) == pytest.approx(0.003)  # alone, it does not shut diffusion out
    live.observe_canvas(CANVAS, 4, 0, 4 * 0.003 + 0.003)
    live.observe_canvas(CANVAS, 4, 0, 4 * 0.003 + 0.003)
    assert live.profile.step_s(CANVAS) == pytest.approx(0.003)  # the quartile of three
    # once the quartile agrees with the cache, the cache is only marked: its steps were observed
    assert stored == [replace(DIFFUSION_WINS, observed=["step"])]


def test_a_round_is_predicted_as_it_was_observed():
    """Once canvases have said what a step costs, a verified round's draft steps cost that and its
    verifying pass the rest, so the live profile predicts the rounds it observed; an untried draft
    length takes the verifying passes' ratio, not the canvases'."""
    live = LiveProfile(DIFFUSION_WINS)
    for _ in range(CONFIRM):  # (slower than the cache: it takes CONFIRM observations to say so)
        live.observe_canvas(CANVAS, 4, 0, 2 * (4 * 0.003 + 0.003))  # steps at 2x the cache
    round_s = 0.05  # a round of 2 draft steps of 8 and its verifying pass: slow for its forwards
    for _ in range(CONFIRM):
        live.observe_round(8, 2, 0, round_s)
    p = live.profile
    assert 2 * p.step_s(8) + p.verify_s(8) == pytest.approx(round_s)
    assert p.step_s(8) == pytest.approx(2 * DIFFUSION_WINS.step_s(8))  # the canvases' ratio
    ratio = p.verify_s(8) / DIFFUSION_WINS.verify_s(8)
    assert p.verify_s(4) / DIFFUSION_WINS.verify_s(4) == pytest.approx(ratio) and ratio > 2
    for _ in range(CONFIRM):  # the canvases' steps back at the cache's time: the rounds still as they ran
        live.observe_canvas(CANVAS, 4, 0, 4 * 0.003 + 0.003)
    p = live.profile
    assert p.step_s(8) == pytest.approx(DIFFUSION_WINS.step_s(8))
    assert 2 * p.step_s(8) + p.verify_s(8) == pytest.approx(round_s)


def test_the_models_planner_turns_live_when_auto_asks_for_the_cached_profile():
    """Verified drafting asks the model's planner for its acceptance without a store; the auto request
    that follows, on the cached profile, gets the same planner with a live profile."""
    from types import SimpleNamespace

    from mlx_dgemma.engine.policy import PLANNERS, auto_planner

    class Model:
        config = SimpleNamespace(canvas_length=CANVAS)

    model, stored = Model(), []
    first = auto_planner(model, GEN, DIFFUSION_WINS)
    assert first.live is None
    again = auto_planner(model, GEN, DIFFUSION_WINS, stored.append)
    assert again is first and again.live is not None and again.live.store == stored.append
    PLANNERS.set(model, None)


def test_one_probe_at_a_time_among_concurrent_answers():
    """Two answers choose before either's probe is observed: the second does not probe too (nor the
    first's probe end when the second chooses); once the probe is observed the next kind may be."""
    live = AutoPlanner(GEN, CANVAS, DIFFUSION_WINS, live=LiveProfile(DIFFUSION_WINS))
    first = live.choose(ANSWER, prompt=[1])
    second = live.choose(ANSWER, prompt=[2])
    third = live.choose(ANSWER, prompt=[3])
    assert "not yet observed" in first.why and first.predicted[0] != "reference"  # not the best's own kind
    assert not second.why and not third.why
    observe(live, first, DIFFUSION_WINS, ANSWER, [1])
    fourth = live.choose(ANSWER, prompt=[4])
    assert "not yet observed" in fourth.why and fourth.predicted[0] not in ("reference", first.predicted[0])


def test_a_point_measured_through_a_burst_takes_its_fastest_run(monkeypatch, checkpoints):
    """Beside a busy core a forward runs at its pace or several times slower, in bursts: a point two
    of whose three runs fell in one is measured at the third (the lower quartile, as the live profile
    takes in forwards), not at the burst a median would give."""
    from mlx_dgemma import load
    from mlx_dgemma.engine.policy import profile as profile_module

    model, _ = load(checkpoints("pattern"))
    pace = {8: 0.002, 16: 0.003}
    runs: dict[int, int] = {}

    def timed(model, cache, steps, canvas, seed=0):
        runs[canvas] = runs.get(canvas, 0) + 1
        return steps * pace[canvas] * (1 if runs[canvas] % 3 == 0 else 10)  # the warm-up, then 10x, 10x, 1x

    monkeypatch.setattr(profile_module, "time_canvas", timed)
    measured = profile_module.measure(model, canvases=(8, 16), repeats=3, draft_lengths=())
    assert measured.step_s_by_canvas == pytest.approx(pace)
