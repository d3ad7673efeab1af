"""Synthetic tasks with checkable answers, for the bundled demo model.

Pure Python (no torch, no mlx): used by the training script (``checkpoint_tools/train_demo.py``) and by the
evaluation commands.  Four tasks, each a prompt and the one right answer::

    sort: 7 3 9 1                 -> 1 3 7 9                        (3-10 numbers in 0-99)
    reverse: planet               -> tenalp                         (3-12 random lowercase letters)
    add: 417 85                   -> 502                            (operands of 1-3 digits)
    json: name=ada age=36         -> {"name": "ada", "age": 36}     (1-4 pairs, str and int values)

One more task the demo model never saw, for fine-tuning (``python -m mlx_dgemma.lora``)::

    upper: planet                 -> PLANET                         (3-12 random lowercase letters)

JSON answers reach ~60 characters, i.e. two 32-token canvases of the demo's character tokenizer.

Train/eval split: every prompt belongs to exactly one split, decided by a hash of the prompt text
(:func:`split_of`).  ``make_instance(task, rng, split="train")`` only returns prompts of the train
half and ``split="eval"`` only prompts of the other half, so fresh evaluation instances are never
in the training set, whatever the seeds.
"""

from __future__ import annotations

import hashlib
import json
import random

TASKS = ("sort", "reverse", "add", "json")
UNSEEN_TASKS = ("upper",)  # not in the demo's training data
SPLITS = ("train", "eval")

LETTERS = "abcdefghijklmnopqrstuvwxyz"
# JSON keys and the type of their value.  Keys are short so that 4 pairs fit in two 32-token canvases.
JSON_KEYS = {
    "name": str,
    "city": str,
    "color": str,
    "tag": str,
    "age": int,
    "id": int,
    "score": int,
    "year": int,
}

SORT_MIN, SORT_MAX = 3, 10
REVERSE_MIN, REVERSE_MAX = 3, 12
JSON_MIN, JSON_MAX = 1, 4


def split_of(prompt: str) -> str:
    """The split a prompt belongs to: ``"train"`` or ``"eval"`` (stable hash of the prompt text)."""
    h = hashlib.sha256(prompt.encode("utf-8")).digest()
    return "eval" if h[0] % 4 == 0 else "train"  # 3/4 of the prompt space for training, 1/4 for eval


def _word(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))


def _number(rng: random.Random, max_digits: int = 3) -> int:
    digits = rng.randint(1, max_digits)
    return rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits)


def _sample_prompt(task: str, rng: random.Random) -> str:
    if task == "sort":
        n = rng.randint(SORT_MIN, SORT_MAX)
        return "sort: " + " ".join(str(rng.randrange(100)) for _ in range(n))
    if task in ("reverse", "upper"):
        return f"{task}: " + _word(rng, REVERSE_MIN, REVERSE_MAX)
    if task == "add":
        return f"add: {_number(rng)} {_number(rng)}"
    if task == "json":
        keys = rng.sample(list(JSON_KEYS), rng.randint(JSON_MIN, JSON_MAX))
        pairs = []
        for k in keys:
            v = _word(rng, 2, 6) if JSON_KEYS[k] is str else str(_number(rng))
            pairs.append(f"{k}={v}")
        return "json: " + " ".join(pairs)
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS + UNSEEN_TASKS}")


def task_of(prompt: str) -> str:
    """The task of a prompt (its ``name:`` prefix)."""
    head = prompt.split(":", 1)[0].strip()
    if head not in TASKS + UNSEEN_TASKS:
        raise ValueError(f"not a task prompt: {prompt!r}")
    return head


def _json_object(prompt: str) -> dict:
    obj = {}
    for pair in prompt.split(":", 1)[1].split():
        k, v = pair.split("=", 1)
        obj[k] = int(v) if v.isdigit() else v
    return obj


def solve(task: str, prompt: str) -> str:
    """The expected answer text for a prompt."""
    body = prompt.split(":", 1)[1].strip()
    if task == "sort":
        return " ".join(str(x) for x in sorted(int(t) for t in body.split()))
    if task == "reverse":
        return body[::-1]
    if task == "upper":
        return body.upper()
    if task == "add":
        a, b = body.split()
        return str(int(a) + int(b))
    if task == "json":
        return json.dumps(_json_object(prompt))
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS + UNSEEN_TASKS}")


def make_instance(task: str, rng: random.Random, split: str = "train") -> tuple[str, str]:
    """A random ``(prompt_text, answer_text)`` for ``task`` whose prompt lies in ``split``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    while True:
        prompt = _sample_prompt(task, rng)
        if split_of(prompt) == split:
            return prompt, solve(task, prompt)


def check(task: str, prompt_text: str, output_text: str) -> bool:
    """Whether ``output_text`` (the model's answer, scaffolding already stripped) is right."""
    out = output_text.strip()
    if task == "json":
        try:
            return json.loads(out) == _json_object(prompt_text)
        except (ValueError, TypeError):
            return False
    return out == solve(task, prompt_text)


def corpus(rng: random.Random, n_per_task: int = 500) -> list[str]:
    """Text lines covering every character the tasks use (for training a tokenizer)."""
    lines = []
    for _ in range(n_per_task):
        for task in TASKS:
            p, a = make_instance(task, rng)
            lines.append(p)
            lines.append(a)
    return lines


def answer_template(task: str, prompt: str, slack: int = 0) -> str:
    """A partial answer with one ``{{fill:N}}`` hole, for infill evaluations: the answer's first and
    last items (sort: numbers, reverse: letters, add: the last digit of a longer sum) given, the middle
    a hole as long as the missing text plus ``slack`` (json has its own, schema-built templates)."""
    answer = solve(task, prompt)
    if task == "sort":  # at least 3 numbers
        numbers = answer.split()
        head, middle, tail = numbers[0] + " ", " ".join(numbers[1:-1]), " " + numbers[-1]
    elif task == "reverse":  # at least 3 letters
        head, middle, tail = answer[:1], answer[1:-1], answer[-1:]
    elif task == "add":
        head, middle, tail = ("", answer[:-1], answer[-1:]) if len(answer) > 1 else ("", answer, "")
    else:
        raise ValueError(f"no answer template for {task!r}")
    return f"{head}{{{{fill:{len(middle) + slack}}}}}{tail}"


def json_schema(prompt: str) -> dict:
    """The schema of a json task's answer: its keys in order, strings of at most 6 letters, integers 0-999."""
    properties = {}
    for key in _json_object(prompt):
        if JSON_KEYS[key] is str:
            properties[key] = {"type": "string", "maxLength": 6}
        else:
            properties[key] = {"type": "integer", "minimum": 0, "maximum": 999}
    return {"type": "object", "properties": properties, "required": list(properties)}


def write_dataset(folder, mix: dict[str, int], held_out: int, seed: int = 0) -> None:
    """A fine-tuning data folder in mlx-lm's chat form: ``train.jsonl`` with ``mix[task]`` instances
    of each task from the train split, shuffled; ``valid.jsonl`` and ``test.jsonl`` with ``held_out``
    instances of each from the eval split."""
    import os

    rng = random.Random(f"data-{seed}")
    os.makedirs(folder, exist_ok=True)
    for split, counts in (
        ("train", mix),
        ("valid", dict.fromkeys(mix, held_out)),
        ("test", dict.fromkeys(mix, held_out)),
    ):
        rows = [
            make_instance(task, rng, "train" if split == "train" else "eval")
            for task, n in counts.items()
            for _ in range(n)
        ]
        rng.shuffle(rows)
        with open(os.path.join(folder, f"{split}.jsonl"), "w") as f:
            for prompt, answer in rows:
                messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
                f.write(json.dumps({"messages": messages}) + "\n")


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Write a fine-tuning data folder of task instances (chat jsonl).")
    ap.add_argument("out")
    ap.add_argument("--mix", default="upper=1000", help="task=count,... for train.jsonl (e.g. upper=1000,sort=100)")
    ap.add_argument("--held-out", type=int, default=50, help="instances per task in valid.jsonl and test.jsonl")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    mix = {}
    for item in args.mix.split(","):
        task, _, count = item.partition("=")
        if task not in TASKS + UNSEEN_TASKS or not count.isdigit():
            ap.error(f"--mix: {item!r} is not task=count with a task of {TASKS + UNSEEN_TASKS}")
        mix[task] = int(count)
    write_dataset(args.out, mix, args.held_out, args.seed)


if __name__ == "__main__":
    main()
