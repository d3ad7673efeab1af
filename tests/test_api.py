"""The Python API called with mlx-lm's habits, on the bundled demo: its chat-template idiom, generate's
verbose, batch_generate's response and per-prompt budgets, the per-commit fields of a response, and one
error base class."""

import io
from contextlib import redirect_stdout

import pytest

import mlx_dgemma
from mlx_dgemma import DGemmaError, OptionError, batch_generate, generate, stream_generate
from mlx_dgemma.demo import DEMO_MODEL
from mlx_dgemma.engine.scoring import Scorer
from mlx_dgemma.errors import PromptError

SORT = "sort: 42 17 85 23 61"
SORTED = " ".join(sorted(SORT.split(": ")[1].split(), key=int))  # the task's answer, from the prompt
MESSAGES = [{"role": "user", "content": SORT}]


def test_mlx_lms_chat_template_idiom_gets_the_demos_answer(demo):
    """mlx-lm's ``prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)`` then
    ``generate``: ids, as in mlx-lm and transformers, and the answer is the demo's to the question
    (the template applied once)."""
    model, tokenizer = demo
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert isinstance(prompt, list) and prompt.count(tokenizer.bos_token_id) == 1
    assert generate(model, tokenizer, prompt) == SORTED == generate(model, tokenizer, SORT)


def test_an_already_templated_string_is_not_templated_again(demo):
    model, tokenizer = demo
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<bos>") and tokenizer.carries_chat_template(text)
    assert tokenizer.carries_chat_template(text.removeprefix("<bos>"))  # the turn opener alone says so too
    assert not tokenizer.carries_chat_template(SORT)
    assert generate(model, tokenizer, text) == SORTED
    assert generate(model, tokenizer, text.removeprefix("<bos>")) == SORTED
    with pytest.raises(PromptError, match="already carries the chat template"):
        generate(model, tokenizer, text, system_prompt="be brief")


def test_generates_fourth_argument_is_verbose_as_in_mlx_lm(demo):
    model, tokenizer = demo
    printed = io.StringIO()
    with redirect_stdout(printed):
        answer = generate(model, tokenizer, SORT, True)
    assert printed.getvalue().startswith(answer) and "Peak memory" in printed.getvalue()
    with pytest.raises(TypeError, match="fourth argument is verbose.*max_tokens=8"):
        generate(model, tokenizer, SORT, 8)


def test_batch_generate_gives_texts_and_stats_with_a_budget_per_prompt(demo):
    model, tokenizer = demo
    prompts = [SORT, "reverse: planet", "add: 417 85"]
    budgets = [4, None, 12]
    batch = batch_generate(model, tokenizer, prompts, max_tokens=budgets, seeds=[0, 1, 2])
    alone = [generate(model, tokenizer, p, max_tokens=m, seed=s) for p, m, s in zip(prompts, budgets, [0, 1, 2])]
    assert batch.texts == alone
    prompt_tokens = sum(len(tokenizer.apply_chat_template([{"role": "user", "content": p}])) for p in prompts)
    assert batch.stats.prompt_tokens == prompt_tokens and batch.stats.generation_tokens > 0
    assert batch.stats.peak_memory > 0
    with pytest.raises(OptionError, match="3 prompts but 2 max_tokens; give one per prompt"):
        batch_generate(model, tokenizer, prompts, max_tokens=[4, 8])
    assert batch_generate(model, tokenizer, []).texts == []


@pytest.mark.parametrize("policy", ["reference", "ar", "verified"])
def test_a_response_has_mlx_lms_per_token_fields_per_commit(demo, policy):
    model, tokenizer = demo
    responses = list(stream_generate(model, tokenizer, SORT, policy=policy, logprobs=2, seed=0))
    tokens = [t for r in responses for t in r.tokens]
    assert all(r.token == r.tokens[-1] for r in responses)
    assert all(r.from_draft == (policy == "verified") for r in responses)
    scored = [lp for r in responses for lp in r.logprobs]
    assert [lp.token for lp in scored] == tokens and all(len(lp.top) == 2 for lp in scored)
    # The same numbers as one scorer over the whole sequence (the encoder's, given everything before).
    whole = Scorer(model, 2).add(tokenizer.apply_chat_template(MESSAGES) + tokens)[-len(tokens) :]
    assert [lp.logprob for lp in scored] == pytest.approx([lp.logprob for lp in whole], rel=1e-4, abs=1e-5)
    assert all(r.logprobs is None for r in stream_generate(model, tokenizer, SORT, policy=policy))


def test_every_refusal_is_a_dgemma_error(demo):
    model, tokenizer = demo
    for bad in (dict(temperature=-1), dict(policy="fastest"), dict(top_p=2), dict(seed=-1)):
        with pytest.raises(OptionError) as refused:
            generate(model, tokenizer, SORT, **bad)
        assert isinstance(refused.value, DGemmaError) and isinstance(refused.value, ValueError)
    with pytest.raises(DGemmaError, match="the prompt is empty"):
        generate(model, tokenizer, [])
    with pytest.raises(DGemmaError, match="revision 'main' is for a Hub id; .* is a local folder"):
        mlx_dgemma.load(DEMO_MODEL, revision="main")


def test_the_package_has_its_version():
    from importlib.metadata import version

    assert mlx_dgemma.__version__ == version("mlx-dgemma")
