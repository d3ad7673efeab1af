"""benchmarks/reference_speed.py and benchmarks/profile_step.py at a small preset's shapes: what they
time and print, never how fast anything is."""

import math
import re
import sys
from pathlib import Path

import mlx.core as mx
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import full_scale  # noqa: E402
import profile_step  # noqa: E402
import reference_speed  # noqa: E402

from checkpoint_tools.random_checkpoint import PRESETS  # noqa: E402
from mlx_dgemma.engine.policy import Profile  # noqa: E402

PRESET = "pattern"  # the released 5:1 layer pattern, canvas 16
LAYERS = PRESETS[PRESET]["num_hidden_layers"]
QUICK = [
    "--preset",
    PRESET,
    "--dtype",
    "float32",
    "--prompt",
    "8",
    "--canvas",
    "16",
    "--draft-length",
    "8",
    "--repeats",
    "1",
]


@pytest.fixture(scope="module")
def mlx_model():
    model, _ = full_scale.random_model(dict(PRESETS[PRESET]), "none", 4, "float32")
    return model


@pytest.fixture(scope="module")
def forwards(mlx_model):
    return profile_step.profiles(mlx_model, prompt=8, canvas=16, draft_length=8, repeats=1)


def test_profile_times_every_part_of_every_layer(forwards):
    step, verify, ar = forwards
    layer_parts = {part for _, part in profile_step.LAYER_PARTS}
    outside = {"embedding", "final norm", "vocabulary head"}
    self_conditioning = {"self-conditioning signal", "self-conditioning MLP"}
    for forward, model_parts in ((step, outside | self_conditioning), (verify, outside), (ar, outside)):
        expected = {(i, part) for i in range(LAYERS) for part in layer_parts} | {(None, p) for p in model_parts}
        assert set(forward.parts_s) == expected, forward.name
        assert all(math.isfinite(s) and s >= 0 for s in forward.parts_s.values()), forward.name
        # The parts are timed inside the run they belong to: together no longer than it.
        assert 0 <= forward.other_s and sum(forward.by_part().values()) <= forward.barriers_s
        assert forward.whole_s > 0


def test_the_profiled_forward_is_the_models_own(mlx_model):
    """The parts are timed in place: the same logits as the forward with no barrier, and nothing of the
    timing left on the model afterwards."""
    cache = mlx_model.make_cache()
    mlx_model.encode(mx.arange(3, 11)[None], cache)
    view = cache.canvas_view(16)
    canvas = mx.arange(20, 36)[None]
    plain = mlx_model.denoise(canvas, view)
    seconds = {}
    with profile_step.parts_timed(mlx_model, seconds):
        timed = mlx_model.denoise(canvas, view)
    assert len(seconds) == LAYERS * len({p for _, p in profile_step.LAYER_PARTS}) + 4  # no self-conditioning
    assert mx.array_equal(plain, timed).item()
    assert not [m for m in mlx_model.modules() if any(isinstance(v, profile_step._Timed) for v in vars(m).values())]
    assert not any(isinstance(v, profile_step._Timed) for v in vars(mlx_model).values())


def test_profile_step_prints_each_forward_by_part_and_layer(capsys, tmp_path):
    profile_step.main([*QUICK, "--json", str(tmp_path / "profile.json")])
    out = capsys.readouterr().out
    for name in ("denoising step of 16 positions", "verifying pass of 8 tokens", "AR token"):
        assert f"\n{name}: " in out
    assert len(re.findall(r"^ +5 full +(?: +[0-9.]+){7}$", out, re.M)) == 3  # the full layer's row, each forward
    assert (tmp_path / "profile.json").read_text().count('"whole_s"') == 3


ROWS = ["AR", "prefill", "step at 16", "crossover at 16", "round of 8, 1 step"]


def test_reference_speed_prints_the_sweeps_rows_beside_mlx(capsys):
    reference_speed.main([*QUICK, "--steps", "2", "--ar-tokens", "2", "--mlx", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "reference: torch cpu, float32; MLX: " in out
    for label in ROWS:
        line = next((line for line in out.splitlines() if line.startswith(label + " ")), None)
        assert line is not None, label
        figures = [float(x) for x in re.findall(r"-?[0-9]+\.[0-9]+", line.removeprefix(label))]
        assert len(figures) == (2 if label.startswith("crossover") else 3), line  # reference, MLX, speed-up
        assert all(math.isfinite(f) and f > 0 for f in figures), line


def test_the_reference_has_the_shapes_mlx_runs_at():
    """At the released shapes (made on the meta device: no memory) the reference holds what the
    checkpoint full_scale.py makes holds, tensor for tensor: the decoder's weights (the encoder's are
    tied to them) and both sets of layer scalars."""
    import torch

    sizes = full_scale.released_sizes(30)
    model = reference_speed.reference_model(sizes, "bfloat16", torch.device("meta"))
    own = {name: tuple(p.shape) for name, p in model.model.decoder.named_parameters(prefix="model.decoder")}
    own.update({name: tuple(b.shape) for name, b in model.named_buffers() if name.endswith("layer_scalar")})
    assert own == dict(full_scale.hf_tensors(sizes))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_reference_times_each_denoising_step_of_its_own_loop():
    """One generate() at N steps gives N step times; the timing wrapper is gone afterwards."""
    import torch

    sizes = dict(PRESETS[PRESET])
    model = reference_speed.reference_model(sizes, "float32", torch.device("cpu"))
    reference = reference_speed.Reference(model, 8, torch.device("cpu"))
    with torch.no_grad():
        assert reference.step_s(16, 3) > 0
    assert "_denoising_step" not in vars(model)


def test_speed_up_is_reference_seconds_over_mlx_seconds():
    reference = Profile(
        "torch", "measured", {16: 0.04}, ar_token_s=0.01, prefill_tok_s=100.0, verify_s_by_length={8: 0.02}, prefix=8
    )
    mlx = Profile(
        "mlx", "measured", {16: 0.01}, ar_token_s=0.02, prefill_tok_s=400.0, verify_s_by_length={8: 0.01}, prefix=8
    )
    lines = reference_speed.table(reference, mlx, [16], 8)
    speed_up = {line.split("  ")[0]: line.split()[-1] for line in lines[2:]}
    assert speed_up == {
        "AR": "0.50x",
        "prefill": "4.00x",
        "step at 16": "4.00x",
        "crossover at 16": "steps",
        "round of 8, 1 step": "2.67x",
    }


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--canvas", "300"], "--canvas must be 1..256"),
        (["--canvas", "16", "--draft-length", "32"], "--draft-length 1..--canvas"),
        (["--steps", "0"], "--steps must be at least 1, got 0"),
    ],
)
def test_reference_speed_refuses_bad_options(capsys, argv, message):
    with pytest.raises(SystemExit):
        reference_speed.parse_args(argv)
    assert message in capsys.readouterr().err


def test_layers_out_of_range_are_refused():
    args = reference_speed.parse_args(["--layers", "31"])
    with pytest.raises(SystemExit, match="--layers must be 1..30, got 31"):
        reference_speed.sizes_from(args)
