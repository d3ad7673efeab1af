"""The step policy: roofline predictions, measured profiles, and the plans they imply."""

import json

import pytest

from mlx_dgemma import load
from mlx_dgemma.engine.policy import (
    KNOWN_DEVICES,
    RELEASED,
    Profile,
    cached_profile,
    forward_cost,
    make_plan,
    parameter_count,
    predict,
    predicted_table,
)
from mlx_dgemma.model.config import GenerationConfig

GEN = GenerationConfig()  # the reference defaults: 48 steps, bound 0.1, t 0.4–0.8


def test_cost_model_counts_the_released_model():
    assert parameter_count(RELEASED) == pytest.approx(25.25e9, rel=0.01)  # "25.2B total"
    one_token = forward_cost(RELEASED, 1, 0, 16, denoise=False)
    active = one_token.flops / 2
    assert active == pytest.approx(3.8e9, rel=0.05)  # "3.8B active", with the tied head
    # A 256-canvas step touches every expert; an AR token only its top-8.
    assert forward_cost(RELEASED, 256, 0, 16, True).bytes > 5 * one_token.bytes


def test_predictions_reproduce_the_public_data_points():
    m1 = predict("M1 Ultra")
    assert m1.ar_tok_s == pytest.approx(71, rel=0.15)  # measured 71 tok/s, 4-bit
    assert m1.diffusion_tok_s(16) == pytest.approx(15, rel=0.25)  # measured ~15 tok/s
    h100 = predict("H100")
    assert 2 < h100.diffusion_tok_s(16) / h100.ar_tok_s < 4.5  # "up to 4x"


def test_crossover_is_where_diffusion_equals_ar():
    for name in ("M2 Max", "H200"):
        p = predict(name)
        assert p.diffusion_tok_s(p.crossover_steps()) == pytest.approx(p.ar_tok_s, rel=1e-9)
    table = predicted_table()
    assert set(table) == set(KNOWN_DEVICES)
    assert table["H100"]["speedup"] > 1 > table["M1 Ultra"]["speedup"]


def test_plans_follow_the_device():
    """An M1-class Mac is compute-poor: auto picks AR; an H100 picks diffusion."""
    mac = make_plan("auto", GEN, 256, 512, predict("M1 Max"), expected_steps=16)
    gpu = make_plan("auto", GEN, 256, 512, predict("H100"), expected_steps=16)
    assert mac.mode == "ar" and gpu.mode == "diffusion"
    # With few enough steps per canvas even the Mac should diffuse.
    assert make_plan("auto", GEN, 256, 512, predict("M1 Max"), expected_steps=2).mode == "diffusion"
    for plan, device in ((mac, "M1 Max"), (gpu, "H100")):
        text = plan.explain()
        assert plan.mode in text and device in text and "steps per canvas" in text


def test_reference_plan_is_the_generation_config():
    gen = GenerationConfig(max_denoising_steps=24, entropy_bound=0.3, t_min=0.2, t_max=0.9)
    plan = make_plan("reference", gen, 32, 1000, predict("H100"))
    s = plan.settings
    assert (plan.mode, s.steps, s.entropy_bound, s.t_min, s.t_max) == ("diffusion", 24, 0.3, 0.2, 0.9)
    assert not plan.trim_last_canvas and plan.last_canvas_length(5, 32) == 32
    assert plan.reasons


def test_fast_plan_cuts_work():
    plan = make_plan("fast", GEN, 256, 40, None)
    assert plan.settings.freeze_after >= 1 and plan.settings.stability_threshold == 0  # compaction, no confirming step
    assert (plan.settings.steps, plan.settings.entropy_bound) == (GEN.max_denoising_steps, GEN.entropy_bound)
    assert "frozen" in plan.explain()
    assert plan.last_canvas_length(40, 256) == 48 and plan.last_canvas_length(300, 256) == 256
    assert make_plan("ar", GEN, 256, 40).mode == "ar"
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        make_plan("fastest", GEN, 256, 40)


def test_measured_profile_is_cached(checkpoints, tmp_path):
    model, _ = load(checkpoints("small"))
    profile = cached_profile(model, root=tmp_path)
    assert profile.source == "measured" and set(profile.step_s_by_canvas) == {2, 4, 8, 16, 32, 64, 128, 256}
    assert set(profile.verify_s_by_length) == {2, 4, 8}  # draft lengths up to the canvas (12)
    assert all(s > 0 for s in profile.verify_s_by_length.values())
    assert all(s > 0 for s in profile.step_s_by_canvas.values()) and profile.ar_token_s > 0
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1
    again = cached_profile(model, root=tmp_path)  # read back, not re-measured
    assert again == profile == Profile.from_json(json.loads(files[0].read_text()))


def test_callers_settings_replace_the_plans_and_are_named():
    fast = make_plan("fast", GEN, 256, 40)
    assert fast.overridden({"steps": GEN.max_denoising_steps}) == fast  # the policy's own value: nothing to say
    plan = fast.overridden({"steps": 5, "freeze_after": 0, "t_max": GEN.t_max})
    assert (plan.settings.steps, plan.settings.freeze_after, plan.settings.stability_threshold) == (5, 0, 0)
    assert plan.reasons[-1] == "set by the caller: steps 5, freeze after 0"
    assert "frozen" not in plan.explain().split("\n")[0]
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        fast.overridden({"steps": 0})
