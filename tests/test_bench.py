"""python -m mlx_dgemma.bench: the JSON it writes and the consistency of its figures."""

import json

import pytest
from click.testing import CliRunner

from mlx_dgemma.bench import main
from mlx_dgemma.engine.policy import KNOWN_DEVICES


def test_bench_json_and_plot(checkpoints, tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    args = ["--model", str(checkpoints("small")), "--json", str(out), "--repeats", "1", "--prefix", "16"]
    try:
        import matplotlib  # noqa: F401

        args += ["--plot", str(png)]
    except ImportError:
        png = None
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    r = json.loads(out.read_text())
    for key in (
        "device",
        "dtype",
        "ar_tok_s",
        "prefill_tok_s",
        "step_s_by_canvas",
        "diffusion_tok_s_by_steps",
        "crossover_steps",
        "predicted",
    ):
        assert key in r, key
    steps = {int(c): s for c, s in r["step_s_by_canvas"].items()}
    # the canvas lengths, and the draft lengths up to the model's canvas (12) for verified drafting
    assert sorted(steps) == [2, 4, 8, 16, 32, 64, 128, 256] and all(s > 0 for s in steps.values())
    for n, tok_s in r["diffusion_tok_s_by_steps"].items():
        assert tok_s == pytest.approx(256 / (int(n) * steps[256]), rel=0.1)
    # The crossover is where diffusion's tok/s meets AR's.
    assert 256 / (r["crossover_steps"] * steps[256]) == pytest.approx(r["ar_tok_s"], rel=1e-6)
    assert set(r["predicted"]) == set(KNOWN_DEVICES)
    assert "crossover" in result.output and "H100" in result.output
    # verified drafting: the encoder pass per draft length, a measured run (64 tokens, at least one per
    # round: the encoder's own token), predictions for this device and for each known one
    v = r["verified"]
    assert {int(n) for n in r["verify_s_by_length"]} == {2, 4, 8}
    assert v["measured"]["tokens_per_round"] >= 1 and v["measured"]["tok_s"] > 0
    assert v["measured"]["tokens_per_forward"] == pytest.approx(
        v["measured"]["tokens_per_round"] / (v["measured"]["draft_steps"] + 1), rel=0.35
    )
    assert v["half_acceptance"]["tokens_per_round"] < v["demo_acceptance"]["tokens_per_round"]
    assert all(p["verified_tok_s"] > p["verified_half_tok_s"] > 0 for p in r["predicted"].values())
    assert "verified drafting measured" in result.output
    # the profile beside the forwards auto ran: every measured point, and those it ran observed
    points = r["observed"]["points"]
    assert {(p["kind"], p["length"]) for p in points} >= {("step", n) for n in steps} | {("ar", 1)}
    seen = [p for p in points if p["observations"]]
    assert seen and all(p["observed_s"] > 0 for p in seen)
    assert all(p["observed_s"] is None for p in points if not p["observations"])
    ran = r["observed"]["ran"]
    assert len(ran) == 3 and all(ran) and set().union(*ran) <= {"reference", "fast", "ar", "verified"}
    assert "the profile beside the forwards auto ran" in result.output
    if png is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_bad_model_is_one_line(tmp_path):
    result = CliRunner().invoke(main, ["--model", str(tmp_path / "missing")])
    assert result.exit_code != 0 and "not a folder" in result.output
    assert len(result.output.strip().split("\n")) == 1
