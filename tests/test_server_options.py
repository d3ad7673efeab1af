"""The server's generation options, on a real uvicorn server driven by the official clients: every
``GenerationArgs`` field a request can set reaches the engine (the others are named with the reason a
client cannot set them); the same body and seed give what ``generate`` gives under every policy,
temperature included; the sampling filters arrive through each API's own fields."""

import contextlib
import copy
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import fields
from pathlib import Path

import anthropic
import ollama
import openai
import pytest

from mlx_dgemma import generate, load
from mlx_dgemma.engine import request
from mlx_dgemma.engine.policy import PLANNERS
from mlx_dgemma.generate import DEMO_MODEL
from mlx_dgemma.options import GenerationArgs, SamplingArgs
from mlx_dgemma.server import scheduler
from mlx_dgemma.server.settings import NOT_SETTABLE, SET_OTHERWISE, SETTINGS
from mlx_dgemma.structured.template import CanvasTemplate

from .test_server import MODEL_ID, serving

PROMPT = "add: 417 85"
POLICIES = ["reference", "fast", "ar", "verified", "auto"]


@pytest.fixture(scope="module")
def server(demo):
    with serving(*demo) as url:
        yield url


@pytest.fixture(scope="module")
def clients(server):
    return {
        "openai": openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=60),
        "ollama": ollama.Client(host=server, timeout=60),
        "anthropic": anthropic.Anthropic(base_url=server, api_key="none", max_retries=0, timeout=60),
    }


def user(text):
    return [{"role": "user", "content": text}]


def ask(clients, api: str, seed: int, max_tokens: int, prompt: str = PROMPT, **settings) -> str:
    """The answer to ``prompt`` through ``api``, with ``settings`` in the fields that API has for them."""
    extra = {k: v for k, v in settings.items() if k not in ("temperature", "top_p")}
    native = {k: v for k, v in settings.items() if k in ("temperature", "top_p")}
    if api == "chat":
        return (
            clients["openai"]
            .chat.completions.create(
                model=MODEL_ID, messages=user(prompt), seed=seed, max_tokens=max_tokens, extra_body=extra, **native
            )
            .choices[0]
            .message.content
        )
    if api == "responses":
        return (
            clients["openai"]
            .responses.create(
                model=MODEL_ID, input=prompt, max_output_tokens=max_tokens, extra_body={"seed": seed, **extra}, **native
            )
            .output_text
        )
    if api == "messages":  # (anthropic 2.15's create() no longer names temperature, top_p and top_k)
        reply = clients["anthropic"].messages.create(
            model=MODEL_ID, messages=user(prompt), max_tokens=max_tokens, extra_body={"seed": seed, **settings}
        )
        return "".join(block.text for block in reply.content)
    options = {"seed": seed, "num_predict": max_tokens, **settings}
    if "repetition_penalty" in options:  # Ollama's name for it
        options["repeat_penalty"] = options.pop("repetition_penalty")
    return clients["ollama"].chat(model=MODEL_ID, messages=user(prompt), options=options).message.content


def planner_kept(model):
    """The model's auto planner and the verified policy's acceptance estimate as they are now (auto
    rows move the one, verified rows the other), to set back."""
    return copy.deepcopy((PLANNERS.get(model), PLANNERS.drafting.get(id(model))))


def planner_set(model, kept) -> None:
    """Set back what ``planner_kept`` kept (None: neither)."""
    planner, acceptance = copy.deepcopy(kept) if kept is not None else (None, None)
    PLANNERS.set(model, None)  # both forgotten
    if planner is not None:
        PLANNERS.set(model, planner)
    if acceptance is not None:
        vars(PLANNERS.acceptance(model)).update(vars(acceptance))


@pytest.fixture
def fixed_profile(monkeypatch, demo):
    """auto plans from the cached profile kept fixed: no live profile learns from this run's wall-clock
    times, so the served answer and generate's are planned alike (both run in this process)."""
    monkeypatch.setattr(request, "live_profile_store", lambda model: None)
    before = planner_kept(demo[0])
    planner_set(demo[0], None)  # a planner made afresh, without a live profile
    yield
    planner_set(demo[0], before)


@pytest.mark.parametrize("temperature", [None, 0.7])
@pytest.mark.parametrize("policy", POLICIES)
def test_the_server_answers_as_generate_does(clients, demo, policy, temperature, fixed_profile):
    """The same body and seed: the text ``generate`` gives, under every policy, with and without a
    temperature (one meaning of it in the API and the server alike)."""
    model, tokenizer = demo
    settings = {"policy": policy} | ({} if temperature is None else {"temperature": temperature})
    for seed in range(3):
        before = planner_kept(model)
        served = ask(clients, "chat", seed, 32, **settings)
        planner_set(model, before)
        assert served == generate(model, tokenizer, PROMPT, max_tokens=32, seed=seed, **settings), (policy, seed)


@pytest.mark.parametrize("api", ["chat", "responses", "messages", "ollama"])
@pytest.mark.parametrize("policy", ["reference", "fast", "ar", "verified"])
def test_a_filter_to_one_token_is_greedy_through_each_api(clients, demo, api, policy):
    """top_k 1 (top_p 1e-6 in Responses, which has no top_k) at temperature 1.7 gives the greedy
    answer, per policy and API; the same temperature unfiltered gives the sampled one."""
    model, tokenizer = demo
    narrow = {"top_p": 1e-6} if api == "responses" else {"top_k": 1}
    before = planner_kept(model)  # each answer from the same planner: a verified row moves its acceptance
    filtered = ask(clients, api, 4, 32, policy=policy, temperature=1.7, **narrow)
    planner_set(model, before)
    sampled = ask(clients, api, 4, 32, policy=policy, temperature=1.7)
    planner_set(model, before)
    greedy = generate(model, tokenizer, PROMPT, max_tokens=32, seed=4, policy=policy, temperature=0)
    planner_set(model, before)
    assert filtered == greedy
    assert sampled == generate(model, tokenizer, PROMPT, max_tokens=32, seed=4, policy=policy, temperature=1.7)
    planner_set(model, before)


def test_penalties_reach_ar_through_the_apis(clients, demo):
    """presence and frequency penalties (OpenAI's), and Ollama's repeat_penalty, give generate's answer,
    which is not the answer without them."""
    model, tokenizer = demo
    prompt = "sort: 5 5 5 3 3"
    plain = generate(model, tokenizer, prompt, max_tokens=16, seed=0, policy="ar")
    for api, sent, options in [
        ("chat", {"presence_penalty": 2.0}, {"presence_penalty": 2.0}),
        ("chat", {"frequency_penalty": 1.5}, {"frequency_penalty": 1.5}),
        ("ollama", {"repeat_penalty": 3.0}, {"repetition_penalty": 3.0}),
    ]:
        served = ask(clients, api, 0, 16, prompt, policy="ar", **sent)
        assert served == generate(model, tokenizer, prompt, max_tokens=16, seed=0, policy="ar", **options) != plain, api


def option(args: GenerationArgs, name: str):
    return getattr(args.sampling, name) if name in {f.name for f in fields(SamplingArgs)} else getattr(args, name)


def test_every_option_a_request_can_set_reaches_the_engine(clients, monkeypatch):
    """Every field of GenerationArgs and SamplingArgs is read from a request (by its own name, or
    otherwise: max_tokens, a template) or named as not the client's to set; those read arrive in the
    args the worker plans, through each API."""
    names = {f.name for f in fields(GenerationArgs)} - {"sampling"} | {f.name for f in fields(SamplingArgs)}
    assert names == set(SETTINGS) | set(SET_OTHERWISE) | set(NOT_SETTABLE)
    assert not set(SETTINGS) & set(NOT_SETTABLE)
    seen = []
    real = scheduler.plan
    monkeypatch.setattr(
        scheduler, "plan", lambda model, tokenizer, resolved: real(model, tokenizer, seen.append(resolved) or resolved)
    )
    given = {
        "policy": "verified",
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "min_p": 0.05,
        "steps": 6,
        "entropy_bound": 0.2,
        "temp_min": 0.3,
        "temp_max": 0.9,
        "schedule_scale": 0.8,
        "freeze_after": 2,
        "draft_length": 4,
        "draft_steps": 2,
        "expected_steps": 5.0,
    }
    penalties = {"policy": "ar", "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.25}
    assert set(given) | set(penalties) | {"seed"} == set(SETTINGS)
    for api in ("chat", "responses", "messages", "ollama"):
        for sent in (given, penalties):
            ask(clients, api, 9, 8, **sent)
            args = seen[-1].args
            assert {name: option(args, name) for name in sent} == sent, api
            assert args.seed == 9 and args.max_tokens == 8, api
    clients["openai"].chat.completions.create(
        model=MODEL_ID, messages=user(PROMPT), seed=1, extra_body={"template": "{{fill:4}} and {{fill:4}}"}
    )
    assert isinstance(seen[-1].template, CanvasTemplate) and seen[-1].template.holes


@pytest.mark.parametrize(
    "api, field, value, message",
    [
        ("chat", "top_p", 0, "top_p must be a finite number in (0, 1], got 0"),
        ("chat", "top_k", 2.5, "top_k must be an integer, got 2.5"),
        ("chat", "min_p", -0.1, "min_p must be a finite number in [0, 1], got -0.1"),
        ("chat", "schedule_scale", 0, "schedule_scale must be a finite number > 0, got 0"),
        ("chat", "temp_min", 0.9, "temperatures need temp-min < temp-max"),
        ("chat", "presence_penalty", 0.5, 'presence_penalty applies to autoregressive decoding only: send policy "ar"'),
        ("chat", "repetition_penalty", 0, "repetition_penalty must be a finite number in [0.0001, 10000], got 0"),
        ("responses", "top_p", 1.5, "top_p must be a finite number in (0, 1], got 1.5"),
        ("messages", "top_k", -1, "top_k must be at least 0, got -1"),
        ("ollama", "min_p", 2, "options.min_p must be a finite number in [0, 1], got 2"),
    ],
)
def test_a_bad_setting_is_a_400_naming_it(clients, api, field, value, message):
    with pytest.raises((openai.BadRequestError, anthropic.BadRequestError, ollama.ResponseError)) as caught:
        ask(clients, api, 1, 8, **{field: value})
    error = caught.value
    if api == "ollama":
        assert error.status_code == 400 and message in error.error
        return
    body = error.body if api != "messages" else error.body["error"]
    assert message in body["message"], body
    if api == "chat":
        assert body["param"] == field


def test_a_setting_a_template_cannot_take_is_a_400_naming_it(clients):
    """ar decodes a template's holes greedily: the worker's refusal of a temperature or a filter beside
    one names that field, in each API's terms."""
    with pytest.raises(openai.BadRequestError) as caught:
        clients["openai"].chat.completions.create(
            model=MODEL_ID,
            messages=user(PROMPT),
            temperature=0.5,
            extra_body={"policy": "ar", "template": "{{fill:4}}"},
        )
    assert caught.value.body["param"] == "temperature"
    assert caught.value.body["message"].startswith("templates decode greedily under ar; drop the temperature")
    with pytest.raises(ollama.ResponseError) as caught:
        clients["ollama"].chat(
            model=MODEL_ID, messages=user(PROMPT), options={"policy": "verified", "top_k": 3, "template": "{{fill:4}}"}
        )
    assert caught.value.status_code == 400 and "templates decode greedily under verified" in caught.value.error


# -- the server's command line: mlx-lm's flags for the defaults of requests ---------------------------------

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def command_line_server(*flags: str):
    """``python -m mlx_dgemma server FLAGS`` on a free port: its base URL once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "mlx_dgemma", "server", "--port", str(port), *flags],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "the server did not start"
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        yield url, process
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def demo_adapters(tmp_path_factory):
    """LoRA adapters on the demo, a few Adam steps away from it (so they change its answers)."""
    from mlx_dgemma.loader import load_model
    from mlx_dgemma.tuner.adapters import apply_fine_tune

    from .test_train import LORA, adam_steps, write_adapters

    model = load_model(DEMO_MODEL)
    apply_fine_tune(model, "lora", 2, LORA)
    adam_steps(model)
    model.eval()
    folder = tmp_path_factory.mktemp("adapters")
    write_adapters(model, folder, 2)
    return folder


def test_the_servers_flags_are_the_defaults_of_requests_that_omit_them(demo, demo_adapters):
    """mlx-lm's server flags, in its value syntax: a request that omits temperature, top_k and
    reasoning gets --temp, --top-k and --chat-template-args' enable_thinking, on the model with
    --adapter-path's adapters; that is, the answer of the same request with those fields sent to a
    server of the adapted model. A field the request sends is its own."""
    flags = [
        "--temp",
        "0.7",
        "--top-k",
        "5",
        "--adapter-path",
        str(demo_adapters),
        "--log-level",
        "INFO",
        "--chat-template-args",
        '{"enable_thinking": true}',
    ]
    asked = dict(model="default_model", messages=user(PROMPT), seed=1, max_tokens=32)  # (either server's)
    with command_line_server(*flags) as (url, process):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        defaulted = client.chat.completions.create(**asked)
        own = client.chat.completions.create(**asked, temperature=0, extra_body={"top_k": 0})
    adapted = load(DEMO_MODEL, adapter_path=demo_adapters)
    with serving(*adapted) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        sent = client.chat.completions.create(
            **asked, temperature=0.7, reasoning_effort="high", extra_body={"top_k": 5}
        )
        greedy = client.chat.completions.create(
            **asked, temperature=0, reasoning_effort="high", extra_body={"top_k": 0}
        )
        plain = client.chat.completions.create(**asked)
    assert (defaulted.choices[0].message, defaulted.usage) == (sent.choices[0].message, sent.usage)
    assert (own.choices[0].message, own.usage) == (greedy.choices[0].message, greedy.usage)
    assert defaulted.usage.prompt_tokens > plain.usage.prompt_tokens  # the thinking switch is in the prompt
    assert defaulted.choices[0].message.content != plain.choices[0].message.content
    with serving(*demo) as url:  # the adapters change the answer
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        unadapted = client.chat.completions.create(**asked)
    assert unadapted.choices[0].message.content != plain.choices[0].message.content


@pytest.mark.parametrize("as_file", [False, True], ids=["text", "file"])
def test_the_servers_chat_template_flag_renders_every_prompt(demo, as_file, tmp_path):
    """mlx-lm's --chat-template: each prompt is rendered by the given template (the flag's text, or the
    file it names) in place of the checkpoint's, as the tokenizer renders it with that template."""
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[model] "
    asked = dict(model="default_model", messages=user(PROMPT), seed=1, max_tokens=8)
    (tmp_path / "my_template.jinja").write_text(template)
    flag = str(tmp_path / "my_template.jinja") if as_file else template
    with command_line_server("--chat-template", flag) as (url, process):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        reply = client.chat.completions.create(**asked)
    _, tokenizer = load(DEMO_MODEL)
    default = len(tokenizer.apply_chat_template(user(PROMPT), tokenize=True))
    tokenizer.chat_template = template
    assert reply.usage.prompt_tokens == len(tokenizer.apply_chat_template(user(PROMPT), tokenize=True)) != default


@pytest.mark.parametrize(
    "flags, status, message",
    [
        (["--chat-template", "{% for %}"], 1, "Error: --chat-template cannot render a conversation: "),
        (
            [
                "--chat-template",
                "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                "{% endfor %}{{ ns.s }}",
            ],
            1,
            "Error: --chat-template cannot render a conversation: rendering grew a text of 67,108,864 characters",
        ),
        (
            ["--chat-template", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"],
            1,
            "Error: --chat-template cannot render a conversation: rendering ran past 2 s (a loop without end?)",
        ),
        (["--chat-template", "my_template.jinja"], 2, "no file my_template.jinja, and as a template it has no {{ }}"),
        (["--temp", "3"], 1, "--temp: temperature must be 0 or a finite number from 0.0001 to 2, got 3"),
        (["--chat-template-args", "[1]"], 2, "must be a JSON object"),
        (["--chat-template-args", '{"tools": []}'], 2, "tools is set by each request"),
        (["--log-level", "LOUD"], 2, "'LOUD' is not one of"),
    ],
)
def test_bad_server_flags_are_refused_by_name(flags, status, message):
    """Each a one-line error naming the flag, in seconds (the time to load the demo; a template's render
    is bounded)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mlx_dgemma", "server", "--port", "1", *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == status and message in done.stderr, done.stderr
    assert done.stderr.strip().split("\n")[-1].startswith("Error: ")


# -- n: several choices -------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["reference", "fast", "ar", "verified"])
def test_n_choices_are_the_request_at_seed_plus_their_index(clients, demo, policy):
    """Run as one batch, choice i is the answer the same request alone gets at seed + i (generate's):
    reproducible, and different from each other; streamed, each choice's deltas carry its index."""
    model, tokenizer = demo
    client = clients["openai"]
    settings = {"policy": policy, "temperature": 0.7}
    before = planner_kept(model)
    reply = client.chat.completions.create(
        model=MODEL_ID,
        messages=user(PROMPT),
        seed=5,
        max_tokens=32,
        n=3,
        temperature=0.7,
        extra_body={"policy": policy},
    )
    planner_set(model, before)
    texts = [choice.message.content for choice in reply.choices]
    assert [choice.index for choice in reply.choices] == [0, 1, 2] and len(set(texts)) > 1
    alone, generated = [], []
    for i in range(3):  # each from the planner the batch's rows planned from (verified's drafts: its acceptance)
        planner_set(model, before)
        alone.append(
            client.chat.completions.create(
                model=MODEL_ID,
                messages=user(PROMPT),
                seed=5 + i,
                max_tokens=32,
                temperature=0.7,
                extra_body={"policy": policy},
            )
        )
        planner_set(model, before)
        generated.append(generate(model, tokenizer, PROMPT, max_tokens=32, seed=5 + i, **settings))
    planner_set(model, before)
    assert texts == [a.choices[0].message.content for a in alone]
    assert texts == generated
    assert reply.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert reply.usage.prompt_tokens == alone[0].usage.prompt_tokens
    planner_set(model, before)
    chunks = list(
        client.chat.completions.create(
            model=MODEL_ID,
            messages=user(PROMPT),
            seed=5,
            max_tokens=32,
            n=3,
            temperature=0.7,
            extra_body={"policy": policy},
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    planner_set(model, before)
    streamed = [
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        for i in range(3)
    ]
    finishes = [c.choices[0].index for c in chunks if len(c.choices) == 1 and c.choices[0].finish_reason]
    assert streamed == texts and sorted(finishes) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    completions = client.completions.create(
        model=MODEL_ID, prompt=PROMPT, seed=5, max_tokens=16, n=2, extra_body={"policy": policy}
    )
    assert [c.text for c in completions.choices] == [
        client.completions.create(
            model=MODEL_ID, prompt=PROMPT, seed=5 + i, max_tokens=16, extra_body={"policy": policy}
        )
        .choices[0]
        .text
        for i in range(2)
    ]


@pytest.mark.parametrize(
    "body, message",
    [
        ({"n": 9}, "n must be from 1 to 8, the choices this server runs for one request, got 9"),
        ({"n": 0}, "n must be from 1 to 8, the choices this server runs for one request, got 0"),
        ({"n": "2"}, 'n must be of type int, got "2"'),
    ],
)
def test_n_past_its_bound_is_a_400_naming_it(clients, body, message):
    with pytest.raises(openai.BadRequestError) as caught:
        clients["openai"].chat.completions.create(model=MODEL_ID, messages=user(PROMPT), max_tokens=8, extra_body=body)
    assert caught.value.body["param"] == "n" and caught.value.body["message"] == message
