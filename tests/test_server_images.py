"""Image content parts in the server's chat endpoint: a random checkpoint with a vision tower served on
loopback and driven by the official ``openai`` client, answered as ``generate(..., images=...)`` answers."""

import base64
import io
import shutil

import mlx.core as mx
import openai
import pytest

from mlx_dgemma import generate, load
from mlx_dgemma.generate import DEMO_MODEL, prompt_ids
from mlx_dgemma.tokenizer import BUILTIN_CHAT_TEMPLATE

from .test_server import serving
from .test_vision import IMAGE, PICTURES, C, picture, with_tokenizer

MODEL_ID = "vision"
PROMPT = "sort: 7 3"
# The same size as PICTURES[0] (the same soft tokens, so the same ids): only the pixels differ.
LOOKALIKE = picture(20, 28, 9)


def data_url(image) -> str:
    png = io.BytesIO()
    image.save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def with_image(url: str, text: str = PROMPT) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]


# Soft attention (the "tame" checkpoint): the server prefills in other chunks than generate does, and
# the random init's peaked attention lets the ~1e-6 differences flip a draw. The chat template keeps
# the empty thought channel in the history, as the demo's does, so that a conversation's earlier
# prompt is a prefix of its next one.
@pytest.fixture(scope="module")
def vision_model(checkpoints, tmp_path_factory):
    folder = with_tokenizer(checkpoints("vision", tame=True), tmp_path_factory)
    turn = "{{ '<|turn>' + role + '\n' }}"
    (folder / "chat_template.jinja").write_text(
        BUILTIN_CHAT_TEMPLATE.replace(
            turn, turn + "{%- if role == 'model' -%}{{ '<|channel>thought\n<channel|>' }}{%- endif -%}"
        )
    )
    return load(folder)


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("allowed-images")


@pytest.fixture(scope="module")
def client(vision_model, image_dir):
    with serving(*vision_model, model_id=MODEL_ID, image_dir=image_dir) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def text_only_client(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text-only") / "demo"
    shutil.copytree(DEMO_MODEL, folder)
    weights = mx.load(str(folder / "model.safetensors"))
    mx.save_safetensors(str(folder / "model.safetensors"), {k: v for k, v in weights.items() if "vision" not in k})
    with serving(*load(folder), model_id=MODEL_ID) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def ask(client, messages, **kwargs):
    return client.chat.completions.create(model=MODEL_ID, messages=messages, seed=5, max_tokens=2 * C, **kwargs)


def test_an_image_part_is_answered_as_generate_answers_it(client, vision_model, image_dir):
    model, tokenizer = vision_model
    expected = generate(model, tokenizer, PROMPT, max_tokens=2 * C, seed=5, images=[PICTURES[0]])
    reply = ask(client, [{"role": "user", "content": with_image(data_url(PICTURES[0]))}])
    assert reply.choices[0].message.content == expected
    ids = prompt_ids(tokenizer, PROMPT, images=1)
    assert reply.usage.prompt_tokens == len(ids) - 1 + 2 + 63  # the placeholder → <boi>, 63 soft tokens, <eoi>

    # A local file in the server's allowed folder, as a path or a file:// URL, streamed: the same answer.
    path = image_dir / "picture.png"
    PICTURES[0].save(path)
    for url in (str(path), f"file://{path}"):
        chunks = ask(client, [{"role": "user", "content": with_image(url)}], stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected


@pytest.mark.parametrize("policy", ["ar", "verified"])
def test_an_image_part_is_answered_under_the_autoregressive_policies(client, vision_model, policy):
    """The image reaches AR and verified rows too (the worker places it; the engine decodes from there):
    the answer is generate's with the image, and not the one without it."""
    model, tokenizer = vision_model
    expected = generate(model, tokenizer, PROMPT, max_tokens=2 * C, seed=5, images=[PICTURES[0]], policy=policy)
    blind = generate(model, tokenizer, PROMPT, max_tokens=2 * C, seed=5, policy=policy)
    assert expected != blind
    reply = ask(client, [{"role": "user", "content": with_image(data_url(PICTURES[0]))}], extra_body={"policy": policy})
    assert reply.choices[0].message.content == expected


def test_the_prompt_cache_tells_images_apart_and_keeps_them_for_the_next_turn(client, vision_model):
    model, tokenizer = vision_model
    first = [{"role": "user", "content": with_image(data_url(PICTURES[0]))}]
    answer = ask(client, first).choices[0].message.content
    # Another picture with the same ids: none of it comes from the first one's cache, and its answer is its own.
    other = ask(client, [{"role": "user", "content": with_image(data_url(LOOKALIKE))}])
    first_image = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}]}], tokenize=True
    ).index(IMAGE)
    assert other.usage.prompt_tokens_details.cached_tokens <= first_image
    expected_other = generate(model, tokenizer, PROMPT, max_tokens=2 * C, seed=5, images=[LOOKALIKE])
    assert other.choices[0].message.content == expected_other != answer

    # The next turn finds the first turn, image and all, in the prompt cache.
    second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "sort: 9 1"}]
    again = ask(client, second)
    template = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}, *second[1:]]
    ids = tokenizer.apply_chat_template(template, add_generation_prompt=True, tokenize=True)
    first_ids = tokenizer.apply_chat_template(template[:1], add_generation_prompt=True, tokenize=True)
    assert ids[: len(first_ids)] == first_ids
    expanded = len(first_ids) - 1 + 2 + 63  # the placeholder → <boi>, 63 soft tokens, <eoi>
    assert again.usage.prompt_tokens_details.cached_tokens == expanded - 1  # all but the last token
    assert again.choices[0].message.content == generate(
        model, tokenizer, ids, max_tokens=2 * C, seed=5, images=[PICTURES[0]]
    )


@pytest.mark.parametrize(
    "url, message",
    [
        ("data:text/plain;base64,aGk=", "messages[0]: an image data URL must look like data:image/png;base64,..."),
        (
            "data:image/png;base64,aGVsbG8=",
            "messages[0]: the image data is not an image Pillow can read (PNG, JPEG, GIF, WebP, …)",
        ),
        (
            "https://example.com/cat.png",
            "messages[0]: remote image URLs are not fetched (https://example.com/cat.png); "
            "send the image as a data URL",
        ),
        (
            "/nowhere/cat.png",
            "messages[0]: '/nowhere/cat.png' is not an image file that may be read here; send the image as a data URL",
        ),
    ],
)
def test_bad_image_parts_get_openai_errors(client, url, message):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, [{"role": "user", "content": with_image(url)}])
    body = caught.value.body
    assert body["message"] == message
    assert body["param"] == "messages" and body["type"] == "invalid_request_error"


@pytest.mark.parametrize("policy", ["ar", "verified", "fast"])
def test_a_template_image_prompt_is_answered_with_its_image(client, vision_model, policy):
    """Templates decoded autoregressively or verified start from the worker's image-encoded cache: the
    answer is generate's with the image, not the one without it."""
    model, tokenizer = vision_model
    template = "{{fill:8}}"
    expected = generate(model, tokenizer, PROMPT, seed=5, images=[PICTURES[0]], policy=policy, template=template)
    reply = (
        ask(
            client,
            [{"role": "user", "content": with_image(data_url(PICTURES[0]))}],
            extra_body={"policy": policy, "template": template},
        )
        .choices[0]
        .message.content
    )
    assert reply == expected
    if policy != "fast":  # (what ar and verified decode of this random model's hole depends on the image)
        assert expected != generate(model, tokenizer, PROMPT, seed=5, policy=policy, template=template)


def test_an_image_prompt_under_auto_is_answered(client, vision_model):
    """auto takes image prompts (it was refused, then answered blind). Its plans depend on what it has
    learned in this server, so its text is not compared here; that a row starts from the
    image-encoded cache is what the template test above checks."""
    reply = ask(client, [{"role": "user", "content": with_image(data_url(PICTURES[0]))}], extra_body={"policy": "auto"})
    assert reply.usage.prompt_tokens == len(prompt_ids(vision_model[1], PROMPT, images=1)) - 1 + 2 + 63
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_an_image_to_a_text_only_model_is_refused(text_only_client):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(
            text_only_client,
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": with_image(data_url(PICTURES[0]))},
            ],
        )
    assert caught.value.body["message"] == "messages[1] has an image, but this model takes text only (no vision tower)"
    parts = ask(text_only_client, [{"role": "user", "content": [{"type": "text", "text": "sort: 5 3 9"}]}])
    text = ask(text_only_client, [{"role": "user", "content": "sort: 5 3 9"}])  # text parts still go through
    assert parts.choices[0].message.content == text.choices[0].message.content
