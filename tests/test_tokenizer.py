"""Tokenizer: both backends, the chat template (the checkpoint's and the built-in one), output clean-up,
and checkpoints without tokenizer files."""

import pytest
import sentencepiece as spm
from transformers.utils.chat_template_utils import render_jinja_template

from checkpoint_tools import train_demo
from mlx_dgemma import load, stream_generate
from mlx_dgemma.model.config import ModelConfig
from mlx_dgemma.tokenizer import BUILTIN_CHAT_TEMPLATE, TextStream, TokenizerError, load_tokenizer

from .tokenizer_files import train_sentencepiece, write_sentencepiece, write_tokenizer_json

CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort: 7 3 9 1"}]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    return train_sentencepiece(tmp_path_factory.mktemp("sp"))


@pytest.fixture(scope="module")
def config(checkpoints):
    return ModelConfig.from_file(checkpoints("small") / "config.json")


@pytest.fixture(scope="module")
def tokenizers(sp_model, config, tmp_path_factory):
    """The demo's tokenizer.model with its chat template, and the same vocabulary as tokenizer.json."""
    sp_folder, json_folder = tmp_path_factory.mktemp("with-model"), tmp_path_factory.mktemp("with-json")
    write_sentencepiece(sp_folder, sp_model)
    write_tokenizer_json(json_folder, sp_model)
    return load_tokenizer(sp_folder, config), load_tokenizer(json_folder, config)


def test_checkpoint_template_renders_as_the_demo_was_trained(tokenizers, sp_model):
    sp_tokenizer, _ = tokenizers
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    expected = train_demo.render_prompt("sort: 7 3 9 1", "be brief")
    assert sp_tokenizer.apply_chat_template(CONVERSATION, tokenize=False) == "<bos>" + expected
    assert sp_tokenizer.apply_chat_template(CONVERSATION, tokenize=True) == [2] + sp.encode(expected)
    # transformers' own renderer gives the same text from the same template
    hf = render_jinja_template(
        [CONVERSATION], chat_template=train_demo.CHAT_TEMPLATE, add_generation_prompt=True, bos_token="<bos>"
    )[0][0]
    assert sp_tokenizer.apply_chat_template(CONVERSATION, tokenize=False) == hf


def test_builtin_template_is_gemma4_with_an_empty_thought_channel(tokenizers):
    _, json_tokenizer = tokenizers  # tokenizer.json only: no template in the folder
    assert json_tokenizer.chat_template == BUILTIN_CHAT_TEMPLATE
    assert json_tokenizer.apply_chat_template(CONVERSATION, tokenize=False) == (
        "<bos><|turn>system\nbe brief<turn|>\n<|turn>user\nsort: 7 3 9 1<turn|>\n"
        "<|turn>model\n<|channel>thought\n<channel|>"
    )
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " hello "}]
    assert json_tokenizer.apply_chat_template(history, add_generation_prompt=False, tokenize=False) == (
        "<bos><|turn>user\nhi<turn|>\n<|turn>model\nhello<turn|>\n"
    )


def test_both_backends_give_the_same_ids_and_text(tokenizers):
    sp_tokenizer, json_tokenizer = tokenizers
    for text in ["sort: 7 3 9 1", "<|turn>user\nreverse: abc<turn|>\n", "héllo wörld", "<bos>x<eos>"]:
        ids = sp_tokenizer.encode(text)
        assert ids == json_tokenizer.encode(text), text
        assert ids[0] == 2 and ids.count(2) == 1  # <bos> once, whether or not the text has it
        expected_text = text.replace("<bos>", "").replace("<eos>", "")  # <eos> is a stop id
        assert sp_tokenizer.decode_clean(ids) == json_tokenizer.decode_clean(ids) == expected_text
    assert sp_tokenizer.encode("<|channel>")[1:] == [sp_tokenizer.token_id("<|channel>")]
    plain = [t.encode("a b", add_special_tokens=False) for t in tokenizers]
    assert plain[0] == plain[1] and 2 not in plain[0]


def test_clean_up_cuts_at_stop_ids_and_drops_thoughts_and_padding(tokenizers):
    for tok in tokenizers:
        enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
        turn_end = tok.token_id("<turn|>")
        tok_ids = (
            enc("<|channel>thought\nfirst sort<channel|>")
            + enc("1 3")
            + [0, 0]
            + enc(" 7 9")
            + [turn_end]
            + enc("after the stop")
        )
        assert tok.decode_clean(tok_ids, stop_ids=[1, turn_end]) == "1 3 7 9"
        assert tok.decode_clean(enc("ok <|channel>still thinking"), stop_ids=[1]) == "ok "
        assert tok.decode_clean(enc("a") + [1] + enc("b"), stop_ids=[1]) == "a"
        assert tok.decode_clean([2] + enc("a") + [0] + enc("b"), stop_ids=[]) == "ab"


def test_text_stream_hands_out_text_as_it_grows(tokenizers):
    tok = tokenizers[0]
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    stream = TextStream(tok, stop_ids=[1])
    e_acute = enc("é")
    assert len(e_acute) == 2  # byte fallback: a character split over two tokens
    pieces = [
        stream.add(enc("<|channel>thought\nhmm")),
        stream.add(enc("<channel|>caf") + e_acute[:1]),
        stream.add(e_acute[1:] + enc(" ok")),
        stream.add([1] + enc("never"), final=True),
    ]
    assert pieces == ["", "caf", "é ok", ""]


def test_thought_channel_is_read_apart_from_the_answer(tokenizers):
    tok = tokenizers[0]
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    turn_end = tok.token_id("<turn|>")
    ids = enc("<|channel>thought\nsmall ones") + [0] + enc(" first<channel|>1 3") + [turn_end] + enc("<|channel>x\nno")
    assert tok.decode_thought(ids, stop_ids=[turn_end]) == "small ones first"
    assert tok.decode_clean(ids, stop_ids=[turn_end]) == "1 3"
    assert tok.decode_thought(enc("no thought here"), stop_ids=[1]) == ""
    stream = TextStream(tok, stop_ids=[1], thought=True)
    pieces = [stream.add(enc("<|channel>thou")), stream.add(enc("ght\nhm")), stream.add(enc("m<channel|>ok"))]
    assert pieces == ["", "hm", "m"]  # nothing until the channel's name line is complete


def test_checkpoint_without_tokenizer_files_loads_and_takes_token_ids(checkpoints):
    model, tokenizer = load(checkpoints("small"))
    assert not tokenizer.has_vocabulary
    with pytest.raises(TokenizerError, match="no tokenizer files.*token ids"):
        next(stream_generate(model, tokenizer, "hello", max_tokens=1))
    response = next(stream_generate(model, tokenizer, [2, 10, 11], max_tokens=1, seed=0))
    assert response.text == " ".join(str(t) for t in tokenizer.clean(response.tokens))
