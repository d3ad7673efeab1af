"""Scoring a model on the demo tasks (tasks.py), per task and per policy, on fresh instances of the
evaluation half of the task space: free answers (``evaluate_policies``) and answers laid out by canvas
templates (``evaluate_templates``). ``python -m mlx_dgemma.demo.eval`` prints them."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

from .tasks import TASKS, answer_template, check, json_schema, make_instance


@dataclass
class TaskScore:
    correct: int = 0
    total: int = 0
    steps: list[int] = field(default_factory=list)  # per canvas
    tokens: int = 0
    forwards: int = 0
    seconds: float = 0.0
    rounds: int = 0  # verified drafting's rounds (one response each)
    round_tokens: int = 0  # tokens those rounds produced
    plans: dict[str, int] = field(default_factory=dict)  # responses per plan (what auto chose)
    rates: list[float] = field(default_factory=list)  # tok/s of each answer, in the instances' order

    @property
    def accuracy(self) -> float:
        return self.correct / max(self.total, 1)


MIXED = "mixed"  # a set of the four tasks in turn: auto may run each in its own kind


def instances(task: str, n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(f"{task}-{seed}")
    return [make_instance(task, rng, split="eval") for _ in range(n)]


def tasked_instances(task: str, n: int, seed: int) -> list[tuple[str, str]]:
    """(task, prompt) of ``n`` fresh instances of ``task``; of ``MIXED``, the four tasks in turn."""
    if task != MIXED:
        return [(task, prompt) for prompt, _ in instances(task, n, seed)]
    rng = random.Random(f"{MIXED}-{seed}")
    return [(TASKS[i % len(TASKS)], make_instance(TASKS[i % len(TASKS)], rng, split="eval")[0]) for i in range(n)]


def evaluate(
    model, tokenizer, n: int = 50, seed: int = 0, policy: str = "reference", tasks=TASKS, **generate_kwargs
) -> dict[str, TaskScore]:
    return evaluate_policies(model, tokenizer, n, seed, [policy], tasks, {policy: generate_kwargs})[policy]


def with_history(tokenizer, prompt: str, tokens: int, rng: random.Random) -> list[int]:
    """``prompt`` as the last turn of a chat whose earlier turns (other instances and their right
    answers) make it at least ``tokens`` long, through the chat template."""
    messages = []
    while len(tokenizer.apply_chat_template(messages + [{"role": "user", "content": prompt}], tokenize=True)) < tokens:
        earlier, answer = make_instance(rng.choice(TASKS), rng, split="eval")
        messages += [{"role": "user", "content": earlier}, {"role": "assistant", "content": answer}]
    return tokenizer.apply_chat_template(messages + [{"role": "user", "content": prompt}], tokenize=True)


def evaluate_policies(
    model,
    tokenizer,
    n: int,
    seed: int,
    policies: list[str],
    tasks=TASKS,
    generate_kwargs: dict[str, dict] | None = None,
    history: int = 0,
    warmup: int = 0,
) -> dict[str, dict[str, TaskScore]]:
    """Scores per policy and task. The policies take turns on each instance, in an order drawn afresh
    for each (seeded), so that they share whatever else the machine is doing (on a shared host the
    speed of one run moves by a quarter; side by side, the ratios hold) and none always follows the
    same other one (what a policy leaves the allocator and the threads would be charged to it). Each
    policy first answers ``warmup`` mixed instances (of another seed) unscored: the kernels for its
    shapes are built, and auto has seen answers."""
    from ..api import stream_generate

    for kind, prompt in tasked_instances(MIXED, warmup, seed + 1):
        for policy in policies:
            for _ in stream_generate(
                model, tokenizer, prompt, seed=seed, policy=policy, **(generate_kwargs or {}).get(policy, {})
            ):
                pass
    scores = {policy: {} for policy in policies}
    for task in tasks:
        for policy in policies:
            scores[policy][task] = TaskScore()
        rng, order = random.Random(f"history-{task}-{seed}"), random.Random(f"order-{task}-{seed}")
        for i, (kind, prompt) in enumerate(tasked_instances(task, n, seed)):
            asked = with_history(tokenizer, prompt, history, rng) if history else prompt
            for policy in order.sample(policies, len(policies)):
                score = scores[policy][task]
                start = time.perf_counter()
                responses = list(
                    stream_generate(
                        model,
                        tokenizer,
                        asked,
                        seed=seed * 100003 + i,
                        policy=policy,
                        **(generate_kwargs or {}).get(policy, {}),
                    )
                )
                seconds = time.perf_counter() - start
                score.seconds += seconds
                score.rates.append(responses[-1].generation_tokens / seconds)
                text = "".join(r.text for r in responses)
                score.correct += check(kind, prompt, text)
                score.total += 1
                score.steps += [r.steps for r in responses]
                score.tokens += responses[-1].generation_tokens
                score.forwards += sum(r.steps for r in responses)
                for r in responses:
                    name = (
                        r.plan.mode
                        if r.plan.mode != "diffusion"
                        else "fast"
                        if r.plan.settings.freeze_after
                        else "reference"
                    )
                    score.plans[name] = score.plans.get(name, 0) + 1
                verified = [r for r in responses if r.plan.mode == "verified"]
                score.rounds += len(verified)
                score.round_tokens += sum(len(r.tokens) for r in verified)
    return scores


def evaluate_templates(
    model, tokenizer, n: int = 50, seed: int = 0, policy: str = "reference", slacks=(0, 3), tasks=TASKS
) -> list[tuple[str, str, float, float]]:
    """(task, setting, accuracy, valid) rows: free generation, answer templates with each hole slack,
    and (json) schema templates; ``valid`` is the share of outputs that parse and validate (json) or
    keep the given text (the others)."""
    import json as _json

    from ..api import drafted_json_template, generate
    from ..structured.json_schema import json_template

    rows = []
    for task in tasks:
        cases = instances(task, n, seed)
        # (name, template builder from the prompt and the instance's seed)
        settings = [("free", lambda p, s: None)]
        if task == "json":
            settings.append(("schema", lambda p, s: json_template(tokenizer, json_schema(p))))
            settings.append(
                (
                    "schema+draft",
                    lambda p, s: drafted_json_template(model, tokenizer, p, json_schema(p), seed=s, policy=policy),
                )
            )
        else:
            settings += [
                (f"hole +{k}" if k else "exact hole", lambda p, s, k=k, t=task: answer_template(t, p, k))
                for k in slacks
            ]
        for name, build in settings:
            correct = valid = 0
            for i, (prompt, answer) in enumerate(cases):
                instance_seed = seed * 100003 + i
                template = build(prompt, instance_seed)
                text = generate(model, tokenizer, prompt, seed=instance_seed, policy=policy, template=template)
                correct += check(task, prompt, text)
                if task == "json":
                    valid += _validates(_json, text, json_schema(prompt))
                else:
                    valid += template is None or _keeps_given_text(template, text)
            rows.append((task, name, correct / n, valid / n))
    return rows


def _validates(json_module, text: str, schema: dict) -> bool:
    try:
        value = json_module.loads(text)
    except ValueError:
        return False
    if not isinstance(value, dict) or list(value) != list(schema["properties"]):
        return False
    for key, rule in schema["properties"].items():
        v = value[key]
        if rule["type"] == "string" and not (isinstance(v, str) and len(v) <= rule["maxLength"]):
            return False
        if rule["type"] == "integer" and not (isinstance(v, int) and rule["minimum"] <= v <= rule["maximum"]):
            return False
    return True


def _keeps_given_text(template: str, text: str) -> bool:
    head, rest = template.split("{{", 1)
    tail = rest.split("}}", 1)[1]
    return text.startswith(head) and text.endswith(tail)


def format_scores(policy: str, scores: dict[str, TaskScore]) -> str:
    """One table per policy: accuracy, median forwards per canvas (per round for verified drafting:
    draft steps + the verifying pass), tokens per forward, tokens per round (verified) and tok/s;
    for auto, the share of canvases/rounds each mode ran."""
    lines = [
        f"policy {policy}",
        f"  {'task':<8} {'accuracy':>9} {'median forwards/canvas':>22} {'tokens/forward':>15} "
        f"{'tokens/round':>13} {'tok/s':>8}",
    ]
    for task, s in scores.items():
        rounds = f"{s.round_tokens / s.rounds:13.2f}" if s.rounds else f"{'':13}"
        line = (
            f"  {task:<8} {s.accuracy:8.1%} {statistics.median(s.steps):22.1f} "
            f"{s.tokens / max(s.forwards, 1):15.2f} {rounds} {s.tokens / s.seconds:8.1f}"
        )
        if policy == "auto":
            total = sum(s.plans.values())
            line += "  " + ", ".join(f"{mode} {n / total:.0%}" for mode, n in sorted(s.plans.items()))
        lines.append(line)
    return "\n".join(lines)


def paired_ratio(score: TaskScore, against: TaskScore) -> float | None:
    """The median over instances of one answer's tok/s against the other's to the same prompt (run
    next to each other, so a burst of load falls on both): on a shared core, where the totals of
    30 answers move by a quarter between runs of the same plan, it resolves a few percent."""
    if not score.rates or len(score.rates) != len(against.rates):
        return None
    return statistics.median(a / b for a, b in zip(score.rates, against.rates))


def format_side_by_side(scores: dict[str, dict[str, TaskScore]]) -> str:
    """tok/s of every policy per task (measured turn about on the same instances), each against the
    fastest on that task, and accuracy; with auto and a fixed policy, auto against the best fixed one
    (by tok/s), that one's accuracy, and the median of their answers' paired ratios
    (``paired_ratio``)."""
    policies = list(scores)
    tasks = list(scores[policies[0]])
    fixed = [p for p in policies if p != "auto"]
    against = "auto" in policies and fixed
    lines = [
        "tok/s side by side (x: against the fastest on the task) and accuracy",
        f"  {'task':<8} "
        + " ".join(f"{p:>22}" for p in policies)
        + ("   auto/best fixed (answer by answer: median)" if against else ""),
    ]
    for task in tasks:
        rates = {p: scores[p][task].tokens / scores[p][task].seconds for p in policies}
        best = max(rates.values())
        line = f"  {task:<8} " + " ".join(
            f"{rates[p]:9.1f} {rates[p] / best:5.2f}x {scores[p][task].accuracy:5.0%}" for p in policies
        )
        if against:
            top = max(fixed, key=rates.get)
            line += f"   {rates['auto'] / rates[top]:5.2f}x ({top}, {scores[top][task].accuracy:.0%} right)"
            paired = paired_ratio(scores["auto"][task], scores[top][task])
            line += f" {paired:5.2f}x" if paired is not None else ""
        lines.append(line)
    return "\n".join(lines)
