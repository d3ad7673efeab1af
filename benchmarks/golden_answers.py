"""The engine's answers on the bundled demo, written to a JSON file: every policy, greedy and seeded
sampled, each prompt alone (``stream_generate``, with its commits' token ids) and all together
(``BatchGenerator``, the rows of every policy in one engine), and schema-constrained.

    python benchmarks/golden_answers.py /tmp/before.json     # on one tree
    python benchmarks/golden_answers.py /tmp/after.json      # on another, on the same machine
    cmp /tmp/before.json /tmp/after.json
    python benchmarks/golden_answers.py --device cpu /tmp/cpu.json
    python benchmarks/golden_answers.py --device gpu /tmp/gpu.json --against /tmp/cpu.json   # benchmarks/gpu_suite.sh

Two trees' files are compared on the same machine only: another BLAS kernel may round a logit the
other way and pick another token, so the file is not a test's expected output. ``auto`` runs on a
fixed device profile with its pace (measured seconds) left out, so its choices are the same from run
to run; every request gives a seed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlx_dgemma import fast_blas  # noqa: E402

fast_blas.load()

import mlx.core as mx  # noqa: E402

from mlx_dgemma import BatchGenerator, load, stream_generate  # noqa: E402
from mlx_dgemma.demo import DEMO_MODEL  # noqa: E402
from mlx_dgemma.demo.tasks import TASKS, make_instance  # noqa: E402
from mlx_dgemma.engine.policy import AutoPlanner, Profile  # noqa: E402
from mlx_dgemma.engine.request import generation_device, prepare  # noqa: E402
from mlx_dgemma.options import GenerationArgs  # noqa: E402

# Times close enough that auto moves between plans as its estimates of steps, answer lengths and
# acceptance change (its measured pace is left out: see main).
PROFILE = Profile(
    "golden",
    "measured",
    {16: 0.004, 32: 0.006},
    0.0025,
    5000.0,
    "float32",
    {2: 0.003, 4: 0.0032, 8: 0.0036, 16: 0.0045, 32: 0.006},
)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "age"],
}


def cases(n: int) -> list[tuple[str, str, dict]]:
    """(name, prompt, options) for every policy, greedy and sampled, and under a schema."""
    rng = random.Random(0)
    prompts = [make_instance(task, rng, split="eval")[0] for task in TASKS for _ in range(n)]
    draft = dict(draft_length=8, draft_steps=2)
    kinds = {
        "reference": dict(policy="reference"),
        "fast": dict(policy="fast"),
        "ar": dict(policy="ar"),
        "verified": dict(policy="verified", **draft),
        "auto": dict(policy="auto", profile=PROFILE),
        "reference-sampled": dict(policy="reference", temperature=0.7, top_p=0.9),
        "fast-sampled": dict(policy="fast", temperature=0.7),
        "ar-sampled": dict(policy="ar", temperature=0.8, top_k=20),
        "verified-sampled": dict(policy="verified", temperature=0.8, **draft),
        "auto-sampled": dict(policy="auto", profile=PROFILE, temperature=0.8),
        "ar-penalized": dict(policy="ar", repetition_penalty=1.3),
    }
    out = [
        (f"{kind}/{i}", prompt, dict(options, seed=i, max_tokens=48))
        for kind, options in kinds.items()
        for i, prompt in enumerate(prompts)
    ]
    schema_prompt = "json: name=ada age=36"
    for policy in ("reference", "fast", "ar", "verified", "auto"):
        extra = draft if policy == "verified" else dict(profile=PROFILE) if policy == "auto" else {}
        out.append(
            (f"schema-{policy}", schema_prompt, dict(policy=policy, schema=SCHEMA, seed=0, max_tokens=64, **extra))
        )
        out.append(
            (
                f"template-{policy}",
                "sort: 42 17 85 23 61",
                dict(policy=policy, template="17 {{fill:8}} 85", seed=0, **extra),
            )
        )
    return out


def alone(model, tokenizer, prompt: str, options: dict) -> dict:
    commits = list(stream_generate(model, tokenizer, prompt, **options))
    return {
        "text": "".join(c.text for c in commits),
        "tokens": [c.tokens for c in commits],
        "finish": commits[-1].finish_reason if commits else None,
        "modes": [c.plan.mode if c.plan else None for c in commits],
    }


def together(model, tokenizer, requests: list[tuple[str, str, dict]]) -> dict[str, dict]:
    engine = BatchGenerator(model, tokenizer)
    names = {
        engine.insert(prepare(model, tokenizer, prompt, GenerationArgs.of(**options))): name
        for name, prompt, options in requests
    }
    out = {name: {"text": "", "tokens": [], "finish": None, "modes": []} for name in names.values()}
    with generation_device(model):
        while len(engine):
            for r in engine.next():
                answer = out[names[r.uid]]
                answer["text"] += r.text
                answer["tokens"] += r.tokens
                answer["finish"] = r.finish_reason
                answer["modes"].append(r.plan.mode if r.plan else None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the JSON file to write")
    parser.add_argument("-n", type=int, default=3, help="prompts per demo task (default 3)")
    parser.add_argument("--device", choices=["cpu", "gpu"], default=None, help="MLX's device (default: its default)")
    parser.add_argument(
        "--against",
        type=Path,
        default=None,
        help="another run's file: name every answer that differs from it, and exit 1 if any does",
    )
    a = parser.parse_args()
    if a.device is not None:
        mx.set_default_device(getattr(mx, a.device))
    AutoPlanner._pace = lambda self, *args: None  # measured seconds would make auto's choices vary by run
    model, tokenizer = load(DEMO_MODEL)
    requests = cases(a.n)
    answers = {"alone": {name: alone(model, tokenizer, prompt, options) for name, prompt, options in requests}}
    answers["together"] = together(model, tokenizer, requests)
    Path(a.out).write_text(json.dumps(answers, indent=1, sort_keys=True) + "\n")
    differ = [
        name
        for name in answers["alone"]
        if answers["alone"][name]["text"] != answers["together"][name]["text"]
        and not name.startswith("auto")
        and "-auto" not in name
    ]
    print(
        f"{len(requests)} requests alone and together on {mx.default_device()} -> {a.out}; batched text differs "
        f"from alone (auto aside: its planner learns from every answer) for {len(differ)}: {differ}"
    )
    if a.against is not None:
        theirs = json.loads(a.against.read_text())
        changed = [
            f"{how}/{name}"
            for how in answers
            for name in answers[how]
            if answers[how][name] != theirs.get(how, {}).get(name)
        ]
        print(
            f"against {a.against}: {len(changed)} of {2 * len(requests)} answers differ"
            + (f": {changed}" if changed else "")
        )
        sys.exit(1 if changed else 0)


if __name__ == "__main__":
    main()
