"""python -m mlx_dgemma.demo.eval side by side: the mixed set, auto against the best fixed policy,
and a run beside a busy core with a profile measured afresh."""

import pytest
from click.testing import CliRunner

from mlx_dgemma.demo import eval as eval_module
from mlx_dgemma.demo.scores import MIXED, TaskScore, format_side_by_side, instances, tasked_instances
from mlx_dgemma.demo.tasks import TASKS, check, make_instance


def test_the_mixed_set_is_the_four_tasks_in_turn_each_checked_as_its_own():
    mixed = tasked_instances(MIXED, 8, seed=3)
    assert [kind for kind, _ in mixed] == list(TASKS) * 2
    assert mixed == tasked_instances(MIXED, 8, seed=3) != tasked_instances(MIXED, 8, seed=4)
    assert tasked_instances("sort", 3, 3) == [("sort", prompt) for prompt, _ in instances("sort", 3, 3)]
    import random

    rng = random.Random(f"{MIXED}-3")
    for kind, prompt in mixed:  # the same draws, with the answers: each checks right as its own task
        again, answer = make_instance(kind, rng, split="eval")
        assert again == prompt and check(kind, prompt, answer)


def test_side_by_side_puts_auto_against_the_best_fixed_policy():
    def score(tokens, seconds, correct):
        return {"sort": TaskScore(correct=correct, total=4, tokens=tokens, seconds=seconds)}

    scores = {"fast": score(300, 1.0, 3), "ar": score(100, 1.0, 4), "auto": score(270, 1.0, 3)}
    table = format_side_by_side(scores)
    row = table.splitlines()[-1]
    assert "auto/best fixed" in table
    assert row.split()[:4] == ["sort", "300.0", "1.00x", "75%"]
    assert row.endswith("0.90x (fast, 75% right)")
    assert "auto/best fixed" not in format_side_by_side({"fast": scores["fast"], "ar": scores["ar"]})
    # answer by answer: each of auto's answers against fast's to the same prompt, the median of four
    scores["fast"]["sort"].rates = [300.0, 150.0, 300.0, 300.0]
    scores["auto"]["sort"].rates = [270.0, 150.0, 30.0, 330.0]  # 0.9, 1, 0.1 (a burst of load), 1.1
    assert format_side_by_side(scores).splitlines()[-1].endswith("0.90x (fast, 75% right)  0.95x")


@pytest.mark.slow
def test_every_policy_beside_a_busy_core_from_a_fresh_profile():
    """One instance of the mixed set, every policy, another process spinning, the profile measured
    under it; the figures are not asserted (they are the machine's), their presence is."""
    result = CliRunner().invoke(
        eval_module.main, ["-n", "1", "--all-policies", "--task", MIXED, "--busy", "--fresh-profile", "--warmup", "1"]
    )
    assert result.exit_code == 0, result.output
    assert "auto/best fixed" in result.output
    for policy in ("reference", "fast", "ar", "verified", "auto"):
        assert f"policy {policy}" in result.output


def test_busy_and_fresh_profile_are_refused_with_templates():
    result = CliRunner().invoke(eval_module.main, ["--templates", "--busy"])
    assert result.exit_code != 0 and "leave out --templates" in result.output
