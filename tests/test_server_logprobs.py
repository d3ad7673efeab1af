"""Log-probabilities, echo and prompt arrays on a real server serving the demo, driven by the ``openai``
client in the shapes lm-evaluation-harness sends (test_lm_eval.py runs the harness itself): the numbers
are scoring.py's in process, a batch's choices each prompt's alone, and bad values refused by name."""

import gc
import json

import openai
import pytest

from mlx_dgemma.engine.scoring import Scorer, sequence_logprobs
from mlx_dgemma.options import GenerationArgs
from mlx_dgemma.server.api import BadRequest
from mlx_dgemma.server.logprobs import MAX_REPLY_LOGPROBS, check_reply_logprobs
from mlx_dgemma.server.scheduler import Job

from .test_server import MODEL_ID, SORT, health, raw_post, serving

# Scored in pieces (a stream's commits) or whole, the same logits differ by float32 rounding: at most
# FP32_BOUND of the largest logit (the soft-cap, 30) each, so a log-probability by twice that.
PIECES_BOUND = 2 * 1e-4 * 30


@pytest.fixture(scope="module")
def served(demo):
    with serving(*demo) as url:
        yield url


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served + "/v1", api_key="none", max_retries=0, timeout=120)


def chat_ids(tokenizer, content: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=True)


def test_echoed_prompt_logprobs_are_the_encoders(client, demo):
    """lm-eval's loglikelihood request: token-id prompts in a batch, echo, logprobs 1, one token."""
    model, tokenizer = demo
    prompts = [
        chat_ids(tokenizer, SORT) + tokenizer.encode("17 23", add_special_tokens=False),
        tokenizer.encode("add: 4 5"),
        [2, 300],
    ]
    reply = client.completions.create(
        model=MODEL_ID, prompt=prompts, max_tokens=1, echo=True, logprobs=1, temperature=0, seed=1234
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for ids, choice in zip(prompts, reply.choices):
        expected = sequence_logprobs(model, ids, top=1)
        got = choice.logprobs
        assert len(got.token_logprobs) == len(ids) + 1  # the prompt's, then the generated token's
        assert got.token_logprobs[: len(ids)] == [e.logprob for e in expected]  # the same forward: the same numbers
        assert got.top_logprobs[0] is None and got.token_logprobs[0] is None
        for entry, top in zip(expected[1:], got.top_logprobs[1 : len(ids)]):
            assert list(top.values()) == [entry.top[0][1]]
        assert got.tokens[: len(ids)] == [tokenizer.decode([i]) or tokenizer.piece(i) for i in ids]
        assert choice.text.startswith(tokenizer.decode(ids))
    assert reply.usage.prompt_tokens == sum(map(len, prompts))


def test_max_tokens_0_with_echo_scores_the_prompt_alone(client, demo):
    model, tokenizer = demo
    reply = client.completions.create(model=MODEL_ID, prompt="sort: 3 1 2", max_tokens=0, echo=True, logprobs=3)
    (choice,) = reply.choices
    assert choice.text == "sort: 3 1 2" and reply.usage.completion_tokens == 0
    expected = sequence_logprobs(model, tokenizer.encode("sort: 3 1 2"), top=3)
    assert choice.logprobs.token_logprobs == [e.logprob for e in expected]
    assert choice.logprobs.text_offset == [0, *range(len(expected) - 1)]  # <bos> has no text
    assert [len(top) for top in choice.logprobs.top_logprobs[1:]] == [3] * (len(expected) - 1)


def test_a_prompt_array_gives_each_prompt_alone(client):
    """Generate requests as lm-eval batches them: each choice is what its prompt gets alone."""
    prompts = ["sort: 42 17 85 23 61", "reverse: planet", "add: 417 85"]
    kwargs = dict(model=MODEL_ID, max_tokens=40, temperature=0.7, seed=5, stop=["\n"])
    batched = client.completions.create(prompt=prompts, **kwargs)
    alone = [client.completions.create(prompt=p, **kwargs).choices[0] for p in prompts]
    assert [c.text for c in batched.choices] == [c.text for c in alone]
    assert [c.finish_reason for c in batched.choices] == [c.finish_reason for c in alone]
    assert batched.usage.completion_tokens == sum(
        client.completions.create(prompt=p, **kwargs).usage.completion_tokens for p in prompts
    )


def test_a_prompt_array_with_n_gives_each_prompts_choices_in_turn(client):
    """n choices per prompt, prompt by prompt: choice i of a prompt is that prompt alone at seed + i,
    its echo its own prompt; usage counts each prompt once."""
    prompts = ["sort: 42 17 85 23 61", "reverse: planet"]
    kwargs = dict(model=MODEL_ID, max_tokens=24, temperature=0.7, echo=True, logprobs=0)
    batched = client.completions.create(prompt=prompts, n=2, seed=5, **kwargs)
    alone = [client.completions.create(prompt=p, seed=5 + i, **kwargs) for p in prompts for i in range(2)]
    assert [c.index for c in batched.choices] == [0, 1, 2, 3]
    assert [c.text for c in batched.choices] == [a.choices[0].text for a in alone]
    assert [c.text.startswith(p) for c, p in zip(batched.choices, [p for p in prompts for _ in range(2)])] == [True] * 4
    assert [c.logprobs.token_logprobs for c in batched.choices] == [a.choices[0].logprobs.token_logprobs for a in alone]
    assert batched.usage.prompt_tokens == alone[0].usage.prompt_tokens + alone[2].usage.prompt_tokens
    assert batched.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    # Streamed, each choice's chunks (by index) join into its whole text and entries; usage as above.
    chunks = list(
        client.completions.create(
            prompt=prompts, n=2, seed=5, stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    for choice in batched.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert [x for c in mine for x in c.logprobs.token_logprobs] == choice.logprobs.token_logprobs
        assert [x for c in mine for x in c.logprobs.text_offset] == choice.logprobs.text_offset
    assert chunks[-1].usage.model_dump() == batched.usage.model_dump()


@pytest.mark.parametrize("policy, drawn", [("ar", "encoder"), ("reference", "denoiser")])
def test_chat_logprobs_are_the_encoders_of_the_answer(client, demo, policy, drawn):
    model, tokenizer = demo
    reply = client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": SORT}],
        seed=3,
        max_tokens=64,
        logprobs=True,
        top_logprobs=2,
        extra_body={"policy": policy},
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs.model_extra["sampled_from"] == drawn
    content = logprobs.content
    answer = [tokenizer.encode(e.token, add_special_tokens=False) or [tokenizer.token_id(e.token)] for e in content]
    answer = [ids[0] for ids in answer]
    assert tokenizer.decode_clean(answer) == reply.choices[0].message.content
    scorer = Scorer(model, top=2)
    scorer.add(chat_ids(tokenizer, SORT))
    expected = scorer.add(answer)
    assert [e.logprob for e in content] == [e.logprob for e in expected]
    assert all(len(e.top_logprobs) == 2 and bytes(e.bytes).decode() == e.token for e in content)
    if policy == "ar":  # greedy: every token is the encoder's likeliest
        assert all(e.logprob == e.top_logprobs[0].logprob for e in content)

    chunks = list(
        client.chat.completions.create(
            model=MODEL_ID,
            messages=[{"role": "user", "content": SORT}],
            seed=3,
            max_tokens=64,
            logprobs=True,
            stream=True,
            extra_body={"policy": policy},
        )
    )
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) <= PIECES_BOUND


def test_the_tokenizer_endpoints_tokenize_as_the_server(served, demo):
    url = served
    _, tokenizer = demo
    status, body = raw_post(
        url, "/tokenize", json.dumps({"prompt": "<bos>sort: 1", "add_special_tokens": False}).encode()
    )
    assert status == 200 and body["tokens"] == tokenizer.encode("<bos>sort: 1", add_special_tokens=False)
    assert body["count"] == len(body["tokens"])
    status, body = raw_post(url, "/detokenize", json.dumps({"tokens": body["tokens"]}).encode())
    assert status == 200 and body["prompt"] == "sort: 1"


@pytest.mark.parametrize(
    "path, body, param, message",
    [
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", "logprobs must be an integer from 0 to 20"),
        ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs", "logprobs must be an integer from 0 to 20"),
        ("/v1/completions", {"prompt": "x", "top_logprobs": 2}, "top_logprobs", "top_logprobs is for chat completions"),
        (
            "/v1/completions",
            {"prompt": "x", "max_tokens": 0},
            "max_tokens",
            "max_tokens must be at least 1 (0 with echo",
        ),
        ("/v1/completions", {"prompt": ["x"] * 65}, "prompt", "prompt holds 65 prompts, more than the 64"),
        ("/v1/completions", {"prompt": ["x"] * 33, "n": 2}, "n", "33 prompts of n 2 choices each are more than the 64"),
        ("/v1/completions", {"prompt": [[2, 300], [2, 9999]]}, "prompt", "prompt[1]: prompt token id 9999 is outside"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
            "top_logprobs must be from 0 to 20, got 21",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
            "top_logprobs needs logprobs true",
        ),
        (
            "/v1/responses",
            {"input": "x", "top_logprobs": 3},
            "top_logprobs",
            "top_logprobs is not supported on the Responses API",
        ),
        ("/tokenize", {"text": "x"}, "prompt", "prompt must be the text to tokenize"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens", "tokens must be a list of token ids from 0 to 347"),
    ],
)
def test_bad_values_are_refused_by_name(served, path, body, param, message):
    status, reply = raw_post(served, path, json.dumps(body).encode())
    assert status == 400 and reply["error"]["param"] == param and reply["error"]["message"].startswith(message), reply


def test_a_stop_string_cuts_the_entries_with_the_text(client, demo):
    _, tokenizer = demo
    kwargs = dict(model=MODEL_ID, prompt=chat_ids(tokenizer, SORT), max_tokens=64, seed=3, logprobs=0)
    whole = client.completions.create(**kwargs).choices[0]
    assert whole.text == "17 23 42 61 85"
    cut = client.completions.create(stop=[" 61"], **kwargs).choices[0]
    assert cut.text == "17 23 42" and cut.finish_reason == "stop"
    assert "".join(cut.logprobs.tokens) == cut.text  # (the demo's tokens are characters)
    assert cut.logprobs.token_logprobs == whole.logprobs.token_logprobs[: len(cut.text)]


def test_a_streamed_echo_gives_the_whole_ones_text_and_entries(client, demo):
    _, tokenizer = demo
    kwargs = dict(model=MODEL_ID, prompt=chat_ids(tokenizer, SORT), max_tokens=64, seed=3, logprobs=2, echo=True)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs)]
    assert "".join(c.text for c in chunks) == whole.text
    entries = [
        (token, logprob, offset)
        for c in chunks
        if c.logprobs
        for token, logprob, offset in zip(c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.text_offset)
    ]
    assert [e[0] for e in entries] == whole.logprobs.tokens
    assert [e[2] for e in entries] == whole.logprobs.text_offset
    prompt = len(kwargs["prompt"])  # scored in one piece either way: the same numbers
    assert [e[1] for e in entries[:prompt]] == whole.logprobs.token_logprobs[:prompt]
    assert (
        max(abs(a - b) for (_, a, _), b in zip(entries[prompt:], whole.logprobs.token_logprobs[prompt:]))
        <= PIECES_BOUND
    )


def test_a_reply_of_too_many_logprobs_is_refused_before_any_forward(served, demo):
    """64 prompts of 1,500 tokens, echoed with 20 most likely tokens each and nothing generated: 2,016,000
    log-probabilities, refused by name before the worker scores a prompt (its count of finished requests
    stays). A chat's choices count alike."""
    _, tokenizer = demo
    ids = (tokenizer.encode(SORT, add_special_tokens=False) * 200)[:1500]
    body = {"model": MODEL_ID, "prompt": [ids] * 64, "echo": True, "logprobs": 20, "max_tokens": 0}
    before = health(served)
    status, reply = raw_post(served, "/v1/completions", json.dumps(body).encode())
    assert status == 400 and reply["error"]["param"] == "logprobs", reply
    message = reply["error"]["message"]
    assert message.startswith("the reply would hold 2,016,000 log-probabilities (64 choices of up to 1,500 positions")
    assert f"{MAX_REPLY_LOGPROBS:,}" in message
    chat = {"messages": [{"role": "user", "content": SORT}], "n": 8, "logprobs": True, "top_logprobs": 20}
    status, reply = raw_post(served, "/v1/chat/completions", json.dumps({**chat, "max_tokens": 4000}).encode())
    assert status == 400 and reply["error"]["param"] == "top_logprobs", reply
    assert "8 choices of up to 4,000 positions each with its own and top_logprobs 20 more" in reply["error"]["message"]
    after = health(served)
    assert (after["finished"], after["rounds"]) == (before["finished"], before["rounds"])


def test_the_bound_counts_every_position_of_every_choice(demo):
    """At the bound a request is taken; one log-probability more is refused."""
    _, tokenizer = demo
    prompt = [2] + [300] * 4095  # 4,096 positions
    at_bound = [Job(prompt, GenerationArgs(), logprobs=3, echo=True)] * (MAX_REPLY_LOGPROBS // (4 * 4096))
    check_reply_logprobs(at_bound)
    with pytest.raises(BadRequest, match=f"the reply would hold {MAX_REPLY_LOGPROBS + 4:,} log-probabilities"):
        check_reply_logprobs([*at_bound, Job([2], GenerationArgs(), logprobs=3, echo=True)])
    check_reply_logprobs([Job(prompt, GenerationArgs(), logprobs=20, echo=False)] * 64)  # nothing scored: no entries
    check_reply_logprobs([Job(prompt, GenerationArgs(), logprobs=None, echo=True)] * 64)


def test_no_scorer_outlives_its_answer(served, client, demo):
    """Each choice's scorer holds a KV cache as long as its prompt and answer: it is let go as the
    answer finishes (a scored prompt alone, an answer whole or streamed), so the memory of a large
    reply can go back to the system after it is sent (heap.give_back_freed)."""
    _, tokenizer = demo

    def scorers() -> int:
        gc.collect()
        return sum(type(o) is Scorer for o in gc.get_objects())

    before = scorers()
    ids = tokenizer.encode(SORT, add_special_tokens=False)
    client.completions.create(model=MODEL_ID, prompt=[ids] * 3, echo=True, logprobs=2, max_tokens=0)
    client.completions.create(model=MODEL_ID, prompt=SORT, logprobs=2, max_tokens=8, n=2)
    stream = client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": SORT}],
        logprobs=True,
        top_logprobs=2,
        max_tokens=8,
        stream=True,
    )
    assert any(chunk.choices and chunk.choices[0].logprobs for chunk in stream)
    assert scorers() == before
