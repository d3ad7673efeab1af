"""How often each front door answers the demo's held-out json prompts right, under every policy, and
whether the three agree: the Python API (``generate(..., schema=...)``), the command line
(``generate --schema``, in-process through click) and the server (``response_format`` through the
openai client, over HTTP on loopback). Each prompt gets its own seed, the same at every door.

    python benchmarks/front_doors.py              # 12 prompts per policy
    python benchmarks/front_doors.py -n 8 --seed 1 --policy reference --policy auto
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlx_dgemma import fast_blas  # noqa: E402

fast_blas.load()

import openai  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from mlx_dgemma import generate, load  # noqa: E402
from mlx_dgemma.demo import DEMO_MODEL  # noqa: E402
from mlx_dgemma.demo.tasks import check, json_schema, make_instance  # noqa: E402
from mlx_dgemma.generate import main as command_line  # noqa: E402
from tests.test_server import MODEL_ID, serving  # noqa: E402

POLICIES = ["reference", "fast", "ar", "verified", "auto"]


def answers(model, tokenizer, client, prompt: str, seed: int, policy: str, folder: Path) -> dict[str, str]:
    schema = json_schema(prompt)
    path = folder / "schema.json"
    path.write_text(json.dumps(schema))
    cli = CliRunner().invoke(
        command_line, ["--prompt", prompt, "--schema", str(path), "--seed", str(seed), "--policy", policy]
    )
    served = client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": prompt}],
        seed=seed,
        extra_body={"policy": policy},
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    return {
        "api": generate(model, tokenizer, prompt, schema=schema, seed=seed, policy=policy),
        "cli": cli.output.removesuffix("\n") if cli.exit_code == 0 else f"(exit {cli.exit_code})",
        "server": served.choices[0].message.content,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=12, help="held-out json prompts per policy")
    parser.add_argument("--seed", type=int, default=0, help="the prompts' draw; prompt i gets seed + i")
    parser.add_argument("--policy", action="append", choices=POLICIES, help="repeatable [default: all]")
    args = parser.parse_args()
    model, tokenizer = load(DEMO_MODEL)
    rng = random.Random(f"front-doors-{args.seed}")
    prompts = [make_instance("json", rng, split="eval")[0] for _ in range(args.n)]
    print(f"{'policy':<10} {'api':>7} {'cli':>7} {'server':>7} {'all three agree':>16}")
    with serving(model, tokenizer) as url, tempfile.TemporaryDirectory() as folder:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        for policy in args.policy or POLICIES:
            right, agree = {"api": 0, "cli": 0, "server": 0}, 0
            for i, prompt in enumerate(prompts):
                got = answers(model, tokenizer, client, prompt, args.seed + i, policy, Path(folder))
                for door, text in got.items():
                    right[door] += check("json", prompt, text)
                agree += len(set(got.values())) == 1
            n = len(prompts)
            print(f"{policy:<10} " + " ".join(f"{right[d]:>3}/{n:<3}" for d in right) + f" {agree:>12}/{n}")


if __name__ == "__main__":
    main()
