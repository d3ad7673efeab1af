"""Accuracy of a model on the demo tasks, per task and per policy, on fresh instances.

    python -m mlx_dgemma.eval [--model PATH] [-n 50] [--policy reference --policy fast] [--seed 0]

Instances come from the evaluation half of the task space (tasks.py), never the training set.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

import click

from .tasks import TASKS, check, make_instance


@dataclass
class TaskScore:
    correct: int = 0
    total: int = 0
    steps: list[int] = field(default_factory=list)  # per canvas
    tokens: int = 0
    forwards: int = 0
    seconds: float = 0.0

    @property
    def accuracy(self) -> float:
        return self.correct / max(self.total, 1)


def instances(task: str, n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(f"{task}-{seed}")
    return [make_instance(task, rng, split="eval") for _ in range(n)]


def evaluate(model, tokenizer, n: int = 50, seed: int = 0, policy: str = "reference", tasks=TASKS,
             **generate_kwargs) -> dict[str, TaskScore]:
    from .generate import stream_generate

    scores = {}
    for task in tasks:
        score = TaskScore()
        for i, (prompt, _) in enumerate(instances(task, n, seed)):
            start = time.perf_counter()
            responses = list(stream_generate(model, tokenizer, prompt, seed=seed * 100003 + i, policy=policy,
                                             **generate_kwargs))
            score.seconds += time.perf_counter() - start
            text = "".join(r.text for r in responses)
            score.correct += check(task, prompt, text)
            score.total += 1
            score.steps += [r.steps for r in responses]
            score.tokens += responses[-1].generation_tokens
            score.forwards += sum(r.steps for r in responses)
        scores[task] = score
    return scores


def format_scores(policy: str, scores: dict[str, TaskScore]) -> str:
    lines = [f"policy {policy}",
             f"  {'task':<8} {'accuracy':>9} {'median steps/canvas':>20} {'tokens/forward':>15} {'tok/s':>8}"]
    for task, s in scores.items():
        lines.append(f"  {task:<8} {s.accuracy:8.1%} {statistics.median(s.steps):20.1f} "
                     f"{s.tokens / max(s.forwards, 1):15.2f} {s.tokens / s.seconds:8.1f}")
    return "\n".join(lines)


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--model", "model_path", help="Checkpoint folder [default: the bundled demo model].")
@click.option("-n", "--instances", "n", default=50, show_default=True, help="Fresh instances per task.")
@click.option("--policy", "policies", multiple=True, default=["reference"], show_default=True,
              type=click.Choice(["reference", "fast", "ar", "auto"]))
@click.option("--seed", default=0, show_default=True)
@click.option("--task", "tasks", multiple=True, type=click.Choice(TASKS), help="Only these tasks.")
def main(model_path, n, policies, seed, tasks):
    from .generate import DEMO_MODEL
    from .loader import CheckpointError, load

    try:
        model, tokenizer = load(model_path or DEMO_MODEL)
    except CheckpointError as e:
        raise click.ClickException(str(e)) from None
    for policy in policies:
        click.echo(format_scores(policy, evaluate(model, tokenizer, n, seed, policy, tasks or TASKS)))


if __name__ == "__main__":
    main()
