"""The bundled demo model: a trained DiffusionGemma whose answers can be checked.

Lower bounds on 50 fresh (evaluation-split) instances, set below what the shipped checkpoint
measured, so that a regression in the model, sampler or tokenizer fails. Measured with
`python -m mlx_dgemma.demo.eval -n 50 --seed 1`: sort 70%, reverse 100%, add 28%, json 94% (issue 6's
targets, 95/95/80/95, are not all met).
"""

import statistics

import pytest

from mlx_dgemma import load
from mlx_dgemma.demo.scores import evaluate
from mlx_dgemma.generate import DEMO_MODEL, prompt_ids

from .test_sampler_replay import assert_replay_matches

pytestmark = pytest.mark.skipif(not (DEMO_MODEL / "model.safetensors").exists(), reason="no bundled demo model")

LOWER_BOUNDS = {"sort": 0.55, "reverse": 0.9, "add": 0.15, "json": 0.8}


@pytest.fixture(scope="module")
def scores():
    model, tokenizer = load(DEMO_MODEL)
    return evaluate(model, tokenizer, n=50, seed=1, tasks=tuple(LOWER_BOUNDS))


@pytest.mark.parametrize("task", sorted(LOWER_BOUNDS))
def test_accuracy_on_fresh_instances(scores, task):
    assert scores[task].accuracy >= LOWER_BOUNDS[task], f"{task}: {scores[task].accuracy:.0%}"


def test_stop_rule_fires_well_before_the_step_limit(scores):
    model, _ = load(DEMO_MODEL)
    steps = [s for score in scores.values() for s in score.steps]
    assert statistics.median(steps) <= model.generation_config.max_denoising_steps / 2


@pytest.mark.parametrize("prompt", ["sort: 9 4 7 1", "reverse: planet", "add: 417 85", "json: name=ada age=36"])
def test_the_reference_gives_the_same_answers_with_the_same_draws(prompt):
    """The demo is a real DiffusionGemma: the reference loads the folder and, replaying its random
    draws in ours, both commit the same canvases after the same steps."""
    _, tokenizer = load(DEMO_MODEL)
    tokens, _, responses = assert_replay_matches(DEMO_MODEL, 64, prompt_ids(tokenizer, prompt))
    assert responses[-1].finish_reason == "stop"  # the demo answers and stops


def test_history_puts_answered_turns_before_the_prompt():
    import random

    from mlx_dgemma.demo.scores import with_history

    _, tokenizer = load(DEMO_MODEL)
    alone = prompt_ids(tokenizer, "reverse: planet")
    ids = with_history(tokenizer, "reverse: planet", 300, random.Random(0))
    assert len(ids) >= 300 and ids[:1] == alone[:1] and ids[-(len(alone) - 1) :] == alone[1:]
    text = tokenizer.decode(ids)
    assert text.count("<|turn>user") == text.count("<|turn>model") >= 2
