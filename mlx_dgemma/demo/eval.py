"""Accuracy of a model on the demo tasks, per task and per policy, on fresh instances.

    python -m mlx_dgemma.demo.eval [--model PATH] [-n 50] [--policy reference --policy fast] [--seed 0]
    python -m mlx_dgemma.demo.eval -n 30 --seed 11 --policy ar --policy verified [--draft-length 32 --draft-steps 2]
    python -m mlx_dgemma.demo.eval --templates [-n 50]
    python -m mlx_dgemma.demo.eval --history 300 [-n 50]
    python -m mlx_dgemma.demo.eval -n 30 --all-policies --warmup 2 [--task mixed] [--busy --fresh-profile]

Instances come from the evaluation half of the task space (tasks.py), never the training set.
``--templates`` compares free generation with canvas templates on the same instances: sort, reverse
and add answers with their first and last items given and the middle a hole (exactly as long as the
missing text, and 3 tokens longer), json answers from a schema of the prompt's keys (the output must
parse and validate), and the same with holes sized by a free generation's values
(``json_template(..., draft=)``: two generations). ``--history N`` puts earlier turns (other
instances, answered right) before each prompt until the conversation is N tokens, as a chat UI sends
it (the demo was trained on single prompts). ``--task mixed`` is a set of the four tasks in turn.
``--all-policies`` runs every policy side by side (auto against the best fixed one per task);
``--busy`` keeps one core busy with another process for the whole run, and ``--fresh-profile``
measures the device profile auto plans from anew (under that load, with ``--busy``) instead of
reading the cache, and keeps it live without caching it.
"""

from __future__ import annotations

from .. import fast_blas

fast_blas.load()  # a command-line process: the fast BLAS before mlx.core loads

import contextlib
import os
import subprocess
import sys

import click

from ..cli import command_line
from ..validate import at_least, check_seed, option
from .scores import MIXED, evaluate_policies, evaluate_templates, format_scores, format_side_by_side
from .tasks import TASKS, UNSEEN_TASKS

POLICIES = ("reference", "fast", "ar", "verified", "auto")


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--model", "model_path", help="Checkpoint folder [default: the bundled demo model].")
@click.option(
    "-n",
    "--instances",
    "n",
    default=50,
    show_default=True,
    callback=option(at_least(1)),
    help="Fresh instances per task.",
)
@click.option(
    "--policy",
    "policies",
    multiple=True,
    default=["reference"],
    show_default=True,
    type=click.Choice(POLICIES),
)
@click.option("--all-policies", is_flag=True, help="Every policy, side by side (in place of --policy).")
@click.option("--seed", default=0, show_default=True, callback=option(check_seed))
@click.option(
    "--task",
    "tasks",
    multiple=True,
    type=click.Choice(TASKS + UNSEEN_TASKS + (MIXED,)),
    help="Only these tasks (upper: one the demo model never saw, for fine-tuning; mixed: the four in turn).",
)
@click.option("--adapter-path", help="Adapters of a fine-tuning run (python -m mlx_dgemma.lora) to apply.")
@click.option("--templates", is_flag=True, help="Free generation against canvas templates (infill, JSON schema).")
@click.option("--draft-length", type=int, help="verified: draft length [default: the policy's].")
@click.option("--draft-steps", type=int, help="verified: draft steps [default: the policy's].")
@click.option(
    "--history",
    default=0,
    show_default=True,
    callback=option(at_least(0)),
    help="Earlier turns before each prompt, until the conversation is this many tokens.",
)
@click.option(
    "--warmup",
    default=0,
    show_default=True,
    callback=option(at_least(0)),
    help="Unscored answers per policy before the run (kernels built, auto's first observations).",
)
@click.option("--busy", is_flag=True, help="Keep one core busy with another process for the whole run.")
@click.option(
    "--fresh-profile", is_flag=True, help="Measure auto's device profile anew (not from the cache, not cached)."
)
@command_line
def main(
    model_path,
    n,
    policies,
    all_policies,
    seed,
    tasks,
    adapter_path,
    templates,
    draft_length,
    draft_steps,
    history,
    warmup,
    busy,
    fresh_profile,
):
    if templates and (history or busy or fresh_profile or MIXED in tasks):
        raise click.UsageError(
            "--history, --busy, --fresh-profile and --task mixed apply to free generation; leave out --templates"
        )
    from ..loader import load
    from . import DEMO_MODEL

    policies = POLICIES if all_policies else policies
    model, tokenizer = load(model_path or DEMO_MODEL, adapter_path=adapter_path)
    if templates:
        for policy in policies:
            click.echo(
                f"policy {policy}, {n} instances per task\n  {'task':<8} {'setting':<11} {'accuracy':>9} {'valid':>7}"
            )
            for task, name, accuracy, valid in evaluate_templates(
                model, tokenizer, n, seed, policy, tasks=tasks or TASKS
            ):
                click.echo(f"  {task:<8} {name:<11} {accuracy:8.1%} {valid:7.1%}")
        return
    drafts = {"verified": {"draft_length": draft_length, "draft_steps": draft_steps}}
    with one_core_busy() if busy else contextlib.nullcontext():
        if fresh_profile:
            drafts = with_a_fresh_profile(model, drafts)
        scores = evaluate_policies(model, tokenizer, n, seed, list(policies), tasks or TASKS, drafts, history, warmup)
    for policy in policies:
        click.echo(format_scores(policy, scores[policy]))
    if len(policies) > 1:
        click.echo(format_side_by_side(scores))


@contextlib.contextmanager
def one_core_busy():
    """Another process that keeps one core busy until the block ends (a user's other work), or until
    this process is gone however it ended (it checks that its parent is still the same)."""
    spin = "import os, sys\nwhile os.getppid() == int(sys.argv[1]):\n    for _ in range(10**6): pass"
    process = subprocess.Popen([sys.executable, "-c", spin, str(os.getpid())])
    try:
        yield
    finally:
        process.kill()
        process.wait()


def with_a_fresh_profile(model, generate_kwargs: dict[str, dict]) -> dict[str, dict]:
    """A profile measured now (neither read from the cache nor cached), the model's planner kept live
    on it, and ``generate_kwargs`` with auto and verified planning from it."""
    from ..engine.policy import PLANNERS, AutoPlanner, LiveProfile, measure

    click.echo("measuring the device profile (not cached)", err=True)
    profile = measure(model)
    planner = AutoPlanner(model.generation_config, model.config.canvas_length, profile, live=LiveProfile(profile))
    PLANNERS.set(model, planner)  # the model's planner for this profile: auto's, and verified's acceptance
    return {**generate_kwargs, **{p: {**generate_kwargs.get(p, {}), "profile": profile} for p in ("auto", "verified")}}


if __name__ == "__main__":
    main()
