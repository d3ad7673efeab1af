"""Bounds on what one request may ask for: denoising and draft steps, bounded by ``validate.MAX_STEPS``
(the checkpoint's ``max_denoising_steps`` is their default, not their bound)."""

import json
import shutil
import tracemalloc

import pytest
from click.testing import CliRunner

from mlx_dgemma import batch_generate, generate, load, stream_generate
from mlx_dgemma.engine.denoise import new_run
from mlx_dgemma.engine.sampler import MxRandom, SamplerSettings
from mlx_dgemma.generate import DEMO_MODEL, main
from mlx_dgemma.validate import MAX_STEPS

pytestmark = pytest.mark.skipif(not (DEMO_MODEL / "model.safetensors").exists(), reason="no bundled demo model")


def test_a_run_holds_no_schedule_of_its_steps(demo):
    """The temperature is computed per step: starting a run of a million steps allocates nothing per step."""
    model, _ = demo
    tracemalloc.start()
    try:
        run = new_run(model, SamplerSettings(steps=10**6), MxRandom(0))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # a schedule costs ~72 bytes a step: 72 MB here
    settings = run.settings
    assert settings.temperature(0).item() == pytest.approx(settings.t_max)
    assert settings.temperature(10**6 - 1).item() == pytest.approx(settings.t_min, abs=1e-5)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(steps=10**9), "steps"),
        (dict(steps=MAX_STEPS + 1), "steps"),
        (dict(steps=True), "steps"),
        (dict(settings=SamplerSettings(steps=10**9)), "steps"),
        (dict(policy="verified", draft_length=8, draft_steps=10**9), "draft_steps"),
    ],
)
def test_steps_past_the_bound_are_refused(demo, kwargs, name):
    model, tokenizer = demo
    with pytest.raises(ValueError, match=rf"^{name} must be an integer from 1 to {MAX_STEPS}, got "):
        generate(model, tokenizer, "sort: 3 1", **kwargs)


def test_a_batch_request_past_the_bound_is_refused(demo):
    model, tokenizer = demo
    with pytest.raises(ValueError, match=f"^steps must be an integer from 1 to {MAX_STEPS}, got 1000000000"):
        batch_generate(model, tokenizer, [tokenizer.encode("sort: 3 1")], 8, steps=10**9)


@pytest.fixture(scope="module")
def two_step_checkpoint(tmp_path_factory):
    """The demo with a generation config saying max_denoising_steps 2 (the same weights)."""
    folder = tmp_path_factory.mktemp("two-steps") / "demo"
    shutil.copytree(DEMO_MODEL, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "max_denoising_steps": 2}))
    return folder


def test_steps_past_the_checkpoints_default_run(two_step_checkpoint):
    """max_denoising_steps is the default: a checkpoint saying 2 runs 8, as mlx-vlm and the reference do."""
    model, tokenizer = load(two_step_checkpoint)
    assert model.generation_config.max_denoising_steps == 2
    responses = list(stream_generate(model, tokenizer, "sort: 3 1", steps=8, entropy_bound=1e-9, seed=0))
    assert max(r.steps for r in responses) > 2
    result = CliRunner().invoke(
        main, ["--model", str(two_step_checkpoint), "--prompt", "sort: 3 1", "--steps", "8", "--max-tokens", "8"]
    )
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("flag", ["--steps", "--draft-steps"])
def test_cli_steps_past_the_bound(flag, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "integer"}')
    for extra in ([], ["--schema", str(schema)]):  # the bound holds before a schema's free draft runs
        result = CliRunner().invoke(
            main, ["--prompt", "sort: 3 1", "--policy", "verified", "--draft-length", "8", flag, "1000000000", *extra]
        )
        assert result.exit_code == 1
        assert result.output.strip().split("\n") == [
            f"Error: {flag} must be an integer from 1 to {MAX_STEPS}, got 1000000000"
        ]
