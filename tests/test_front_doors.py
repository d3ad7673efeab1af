"""The three front doors give the same answer to the same request: the Python API's ``generate``, the
``generate`` command line and the server (through the openai client, over HTTP) on the demo's
held-out json prompts with their schemas, seeded, under every policy; and each of the four budget
checks runs once per server request, however many choices it asks for.

``auto`` (and verified drafting's acceptance estimate) learns from every answer (the model's planner),
and ``auto`` from measured seconds: each door's request starts from a fresh planner here, with the
seconds left out, so that the request is the same.
"""

import json
import sys

import jsonschema
import openai
import pytest
from click.testing import CliRunner

from mlx_dgemma import generate
from mlx_dgemma.demo.tasks import json_schema, make_instance
from mlx_dgemma.engine import resolve
from mlx_dgemma.engine.policy import PLANNERS, AutoPlanner
from mlx_dgemma.generate import main

from .test_server import MODEL_ID, serving

POLICIES = ["reference", "fast", "ar", "verified", "auto"]
PROMPTS = 3  # held-out json prompts per policy


@pytest.fixture(scope="module")
def server(demo):
    with serving(*demo) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


def held_out(n: int) -> list[str]:
    import random

    rng = random.Random("front-doors")
    return [make_instance("json", rng, split="eval")[0] for _ in range(n)]


def command_line(prompt: str, schema: dict, seed: int, policy: str, tmp_path) -> str:
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    result = CliRunner().invoke(
        main, ["--prompt", prompt, "--schema", str(path), "--seed", str(seed), "--policy", policy]
    )
    assert result.exit_code == 0, result.output
    return result.output.removesuffix("\n")


def served(client, prompt: str, schema: dict, seed: int, policy: str) -> str:
    completion = client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": prompt}],
        seed=seed,
        extra_body={"policy": policy},
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    return completion.choices[0].message.content


@pytest.mark.parametrize("policy", POLICIES)
def test_the_api_the_command_line_and_the_server_answer_alike(demo, client, tmp_path, monkeypatch, policy):
    model, tokenizer = demo
    monkeypatch.setattr(AutoPlanner, "_pace", lambda self, *args: None)

    def fresh(door, *args, **kwargs) -> str:
        PLANNERS.set(model, None)  # (the command line loads a model, and a planner, of its own)
        return door(*args, **kwargs)

    for seed, prompt in enumerate(held_out(PROMPTS)):
        schema = json_schema(prompt)
        answers = {
            "api": fresh(generate, model, tokenizer, prompt, schema=schema, seed=seed, policy=policy),
            "cli": command_line(prompt, schema, seed, policy, tmp_path),
            "server": fresh(served, client, prompt, schema, seed, policy),
        }
        assert len(set(answers.values())) == 1, (prompt, answers)
        jsonschema.validate(json.loads(answers["api"]), schema)


CHECKS = ("check_prompt_fits", "check_closing_room", "check_closing_fits", "check_template_fits")


@pytest.fixture
def counted(monkeypatch):
    """The calls of each of the four checks, from whichever of the package's modules calls it."""
    calls = dict.fromkeys(CHECKS, 0)

    def counting(name, real):
        def check(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return check

    for name in CHECKS:
        real = getattr(resolve, name)
        for module in [m for key, m in sys.modules.items() if key.startswith("mlx_dgemma")]:
            if getattr(module, name, None) is real:
                monkeypatch.setattr(module, name, counting(name, real))
    return calls


SCHEMA_PROMPT = held_out(1)[0]
ASKED = {"type": "json_schema", "json_schema": {"name": "answer", "schema": json_schema(SCHEMA_PROMPT)}}


@pytest.mark.parametrize(
    "prompt, options, once",
    [
        (
            SCHEMA_PROMPT,
            {"response_format": ASKED, "extra_body": {"policy": "ar"}},
            {"check_prompt_fits", "check_closing_room", "check_closing_fits"},
        ),
        ("sort: 9 4 1", {"extra_body": {"template": "1 {{fill:3}} 9"}}, {"check_prompt_fits", "check_template_fits"}),
        (
            SCHEMA_PROMPT,
            {"response_format": ASKED, "extra_body": {"policy": "reference"}},
            {"check_prompt_fits", "check_template_fits"},
        ),
    ],
    ids=["grammar", "template", "drafted"],
)
def test_each_check_runs_once_per_server_request(client, counted, prompt, options, once):
    """Each check the request needs runs once, the others never, for a request of two choices."""
    client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": prompt}], n=2, seed=0, **options
    )
    assert counted == {name: int(name in once) for name in CHECKS}
