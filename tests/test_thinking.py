"""Configurable reasoning: Gemma 4's thinking switch in the chat templates (the built-in one and the
demo's, against transformers' own renderer), ``think`` in the API and ``--think`` in the CLI.

The demo was not trained to think, so the thought is laid out by a text template: a literal thought
channel, then a hole the model fills. What is tested is the protocol: the thought in each API's own
field, never in the answer, and none with thinking off."""

import copy
import json
import subprocess
import sys

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from checkpoint_tools import train_demo
from mlx_dgemma import generate, load, stream_generate
from mlx_dgemma.errors import PromptError
from mlx_dgemma.generate import DEMO_MODEL
from mlx_dgemma.request import prompt_ids
from mlx_dgemma.tokenizer import BUILTIN_CHAT_TEMPLATE, TextStream

from .test_server import SORT

THOUGHT = "the numbers, smallest first"
TEMPLATE = "<|channel>thought\n" + THOUGHT + "<channel|>sorted:{{fill:8}}"  # a thought, then the answer
NO_SWITCH = ("{{ bos_token }}{% for m in messages %}{{ '<|turn>' + m['role'] + '\n' }}{{ m['content'] | trim }}"
             "{{ '<turn|>\n' }}{% endfor %}{{ '<|turn>model\n<|channel>thought\n<channel|>' }}")  # no switch


@pytest.fixture(scope="module")
def demo():
    return load(DEMO_MODEL)


# -- the chat template ---------------------------------------------------------------------------------

@pytest.mark.parametrize("template", [BUILTIN_CHAT_TEMPLATE, train_demo.CHAT_TEMPLATE], ids=["builtin", "demo"])
def test_the_switch_renders_as_gemma4_and_as_transformers_renders_it(demo, template):
    """Gemma 4's convention: thinking on opens the system turn with <|think|> (a turn of its own when
    there is no system message) and leaves the model's turn open; off, the prompt ends with an empty
    thought channel. transformers renders the same template to the same text for enable_thinking."""
    tokenizer = copy.copy(demo[1])
    tokenizer.chat_template = template
    user = [{"role": "user", "content": " Solve it. "}]
    system = [{"role": "system", "content": " Be exact. "}] + user
    expected = {
        (False, False): "<bos><|turn>user\nSolve it.<turn|>\n<|turn>model\n<|channel>thought\n<channel|>",
        (True, False): "<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\nSolve it.<turn|>\n<|turn>model\n",
        (False, True): "<bos><|turn>system\nBe exact.<turn|>\n<|turn>user\nSolve it.<turn|>\n<|turn>model\n"
                       "<|channel>thought\n<channel|>",
        (True, True): "<bos><|turn>system\n<|think|>\nBe exact.<turn|>\n<|turn>user\nSolve it.<turn|>\n<|turn>model\n",
    }
    for (think, with_system), text in expected.items():
        messages = system if with_system else user
        ours = tokenizer.apply_chat_template(messages, enable_thinking=think)
        assert ours == text
        theirs = render_jinja_template([messages], chat_template=template, add_generation_prompt=True,
                                       bos_token="<bos>", enable_thinking=think)[0][0]
        assert ours == theirs
    assert tokenizer.apply_chat_template(user) == expected[False, False]  # off unless asked for
    assert tokenizer.renders_thinking


def test_thinking_off_renders_the_prompt_the_demo_was_trained_on(demo):
    _, tokenizer = demo
    ids = prompt_ids(tokenizer, SORT, "be brief")
    assert ids == tokenizer.encode(train_demo.render_prompt(SORT, "be brief"))
    on = prompt_ids(tokenizer, SORT, "be brief", think=True)
    channel = tokenizer.encode("<|channel>thought\n<channel|>", add_special_tokens=False)
    think = tokenizer.encode("<|think|>\n", add_special_tokens=False)
    turn = tokenizer.encode("<|turn>system\n", add_special_tokens=False)
    # on = off with <|think|> after the system turn's opening and without the empty thought channel
    assert on == ids[: 1 + len(turn)] + think + ids[1 + len(turn): -len(channel)]


def test_a_template_without_the_switch_is_refused(demo):
    tokenizer = copy.copy(demo[1])
    tokenizer.chat_template = NO_SWITCH
    assert not tokenizer.renders_thinking
    with pytest.raises(PromptError, match="has no thinking switch"):
        prompt_ids(tokenizer, SORT, think=True)
    assert prompt_ids(tokenizer, [2, 5, 6], think=True) == [2, 5, 6]  # ids are taken as given


def test_the_thought_streams_apart_from_the_answer(demo):
    _, tokenizer = demo
    ids = tokenizer.encode("<|channel>thought\n" + THOUGHT + "<channel|>1 3 7 9<turn|>after", add_special_tokens=False)
    stop = {tokenizer.token_id("<turn|>")}
    answer, thought = TextStream(tokenizer, stop), TextStream(tokenizer, stop, thought=True)
    pieces = [(answer.add(ids[i:i + 3]), thought.add(ids[i:i + 3])) for i in range(0, len(ids), 3)]
    assert "".join(a for a, _ in pieces) == "1 3 7 9" and "".join(t for _, t in pieces) == THOUGHT
    assert pieces[0] == ("", "")  # "<|channel>thought\n" is the channel's name, no part of the thought


# -- the API and the CLI -------------------------------------------------------------------------------

def test_stream_generate_hands_out_the_thought_apart(demo):
    model, tokenizer = demo
    on = list(stream_generate(model, tokenizer, SORT, seed=0, think=True, template=TEMPLATE))
    assert "".join(r.thought for r in on) == THOUGHT
    answer = "".join(r.text for r in on)
    assert answer.startswith("sorted:") and THOUGHT not in answer and "<|channel>" not in answer
    off = list(stream_generate(model, tokenizer, SORT, seed=0, template=TEMPLATE))
    assert all(r.thought == "" for r in off) and "".join(r.text for r in off).startswith("sorted:")
    free = list(stream_generate(model, tokenizer, SORT, seed=0, max_tokens=16, think=True))
    assert "<|channel>" not in "".join(r.text for r in free)
    with pytest.raises(ValueError, match="JSON template .* no room for a thought"):
        generate(model, tokenizer, SORT, think=True, template=_json_template(tokenizer))


def _json_template(tokenizer):
    from mlx_dgemma.json_schema import json_template

    return json_template(tokenizer, {"type": "object", "properties": {"a": {"type": "integer"}}})


def test_cli_think_writes_the_thought_to_stderr(tmp_path, demo):
    model, tokenizer = demo
    (tmp_path / "layout.txt").write_text(TEMPLATE + "\n")
    run = subprocess.run([sys.executable, "-m", "mlx_dgemma.generate", "--prompt", SORT, "--seed", "0", "--think",
                          "--template", str(tmp_path / "layout.txt")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stderr == THOUGHT
    assert run.stdout == generate(model, tokenizer, SORT, seed=0, think=True, template=TEMPLATE) + "\n"
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object"}))
    refused = subprocess.run([sys.executable, "-m", "mlx_dgemma.generate", "--think", "--schema", str(schema)],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.splitlines() == ["Error: a schema lays the answer out from its first token and leaves no "
                                           "room for a thought; drop --think or --schema"]
