"""Chat templates rendered within bounds (chat_template.py): hostile templates end with a one-line error
within seconds and before memory runs out, and every template renders as transformers renders it."""

import copy
import json
import time

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from checkpoint_tools import train_demo
from mlx_dgemma.chat_template import RENDER_SECONDS, RenderLimit, RenderLimitError
from mlx_dgemma.tokenizer import BUILTIN_CHAT_TEMPLATE, render_chat_template

from .test_server import SORT, raw_post, serving

MESSAGES = [{"role": "user", "content": "sort: 42 17 85"}]
DOUBLING = "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s OP ns.s %}{% endfor %}{{ ns.s }}"
HOSTILE = {
    "doubling +": DOUBLING.replace("OP", "+"),
    "doubling ~": DOUBLING.replace("OP", "~"),
    "doubling a list": DOUBLING.replace("'ab'", "['ab']").replace("OP", "+").replace("{{ ns.s }}", "{{ ns.s|join }}"),
    "repeated": "{{ 'ab' * 10**12 }}",
    "replace filter": "{% set ns = namespace(s='aa') %}{% for i in range(64) %}"
    "{% set ns.s = ns.s|replace('a', ns.s) %}{% endfor %}{{ ns.s }}",
    "replace method": "{% set ns = namespace(s='aa') %}{% for i in range(64) %}"
    "{% set ns.s = ns.s.replace('a', ns.s) %}{% endfor %}{{ ns.s }}",
    "center": "{{ 'a'|center(10**12) }}",
    "a constant's filter": "{{ '%999999999s'|format('a') }}",  # (jinja's compiler would run it while compiling)
    "%": "{{ '%999999999s' % 'a' }}",
    "str.format": "{{ '{:>999999999}'.format('a') }}",
    "power": "{{ 10 ** 100000000 }}",
    "join": "{{ range(100000)|join('x' * 1000) }}",
    "tojson": "{{ [[[1]]]|tojson(indent=10**9) }}",
    "ljust": "{{ 'a'.ljust(10**12) }}",
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested loops over a string": "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "endless output": "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}",
}


@pytest.mark.parametrize("template", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_template_ends_within_its_bounds(template):
    """Each ends with RenderLimitError: a size past the bound before the string is made, or the deadline."""
    start = time.monotonic()
    with pytest.raises(RenderLimitError, match=r"^rendering (grew a text of [\d,]+ characters|ran past 2 s)"):
        render_chat_template(template, MESSAGES)
    assert time.monotonic() - start < RENDER_SECONDS + 2


def test_the_bounds_are_the_callers():
    template = "{% for i in range(100000) %}{{ i }}{% endfor %}"  # 488,890 characters
    assert len(render_chat_template(template, MESSAGES)) == 488890
    with pytest.raises(RenderLimitError, match="past the 1,000 allowed"):
        render_chat_template(template, MESSAGES, render_limit=RenderLimit(chars=1000))
    with pytest.raises(RenderLimitError, match="ran past 0.001 s"):
        render_chat_template(template, MESSAGES, render_limit=RenderLimit(seconds=0.001))
    assert render_chat_template("{{ 'a' * 1000 }}", MESSAGES, render_limit=RenderLimit(chars=1000)) == "a" * 1000


FEATURES = (
    "{% macro turn(m) %}{{ '<|turn>' ~ m['role'] ~ '\n' }}{{ m['content'] | trim }}{% endmacro %}"
    "{% set ns = namespace(n=0, text='') %}"
    "{% for m in messages recursive %}{{ turn(m) }}{% set ns.n = ns.n + 1 %}{% set ns.text = ns.text + m['role'] %}"
    "{{ loop.index }}{% if loop.last %}!{% endif %}{% endfor %}"
    "{{ ns.n }} {{ ns.text | upper | center(20) }} {{ (tools or []) | map(attribute='name') | join(', ') }}"
    "{{ '%s-%d' | format('x', 3) }} {{ 'a b'.split() | length }} {{ messages | tojson }}"
    "{% for i in range(3) %}{{ i * 2 }}{% endfor %}{{ 'ab' * 3 }}{{ [1] + [2] }}"
)


@pytest.mark.parametrize(
    "template", [BUILTIN_CHAT_TEMPLATE, train_demo.CHAT_TEMPLATE, FEATURES], ids=["builtin", "demo", "features"]
)
@pytest.mark.parametrize("think", [False, True])
def test_a_template_renders_as_transformers_renders_it(template, think):
    messages = [
        {"role": "system", "content": " Be exact. "},
        *MESSAGES,
        {"role": "assistant", "content": "17 42 85"},
        {"role": "user", "content": "reverse: planet"},
    ]
    tools = [{"name": "sort", "description": "sorts"}, {"name": "add", "description": "adds"}]
    ours = render_chat_template(template, messages, bos_token="<bos>", enable_thinking=think, tools=tools)
    theirs = render_jinja_template(
        [messages],
        chat_template=template,
        add_generation_prompt=True,
        bos_token="<bos>",
        enable_thinking=think,
        tools=tools,
    )[0][0]
    assert ours == theirs


PER_MESSAGE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['content'] == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% elif m['content'] == 'double' %}{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}{% endif %}"
    "{{ '<|turn>' ~ m['role'] ~ '\n' ~ m['content'] ~ '<turn|>\n' }}{% endfor %}"
    "{{ '<|turn>model\n<|channel>thought\n<channel|>' }}"
)


def test_every_requests_render_is_bounded(demo):
    """A template that renders the server's start-up conversation but not some request's: that request
    is a 400 naming messages within seconds, and the server answers the next one."""
    model, tokenizer = demo
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = PER_MESSAGE
    with serving(model, tokenizer) as url:
        for content, reason in [
            ("loop", "the chat template cannot render these messages: rendering ran past 2 s"),
            ("double", "the prompt the chat template renders is at least "),  # (past what the context holds)
        ]:
            start = time.monotonic()
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4}
            status, reply = raw_post(url, "/v1/chat/completions", json.dumps(body).encode())
            assert status == 400 and reply["error"]["param"] == "messages", reply
            assert reply["error"]["message"].startswith(reason)
            assert time.monotonic() - start < RENDER_SECONDS + 5
        body = {"messages": [{"role": "user", "content": SORT}], "max_tokens": 8, "seed": 0}
        status, reply = raw_post(url, "/v1/chat/completions", json.dumps(body).encode())
        assert status == 200 and reply["usage"]["prompt_tokens"] == len(
            tokenizer.apply_chat_template([{"role": "user", "content": SORT}], tokenize=True)
        )
