"""Image input against the transformers reference on a random checkpoint with a vision tower (the
"vision" preset): preprocessing, vision features, the encoder cache and denoiser logits with one and
two images in the prompt, a replayed whole generation, the CLI end to end, the converter's output,
and one-line errors for what is not an image."""

import base64
import io
import shutil
import types

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from transformers import AutoImageProcessor, Gemma4ImageProcessorPil, Gemma4Processor

from checkpoint_tools.random_checkpoint import PRESETS
from mlx_dgemma import generate, load, stream_generate
from mlx_dgemma.convert import convert
from mlx_dgemma.generate import DEMO_MODEL, main, prompt_ids
from mlx_dgemma.model import images as images_module
from mlx_dgemma.model.images import (
    ImageError,
    ImageProcessorConfig,
    expand_image_tokens,
    image_from_url,
    load_image,
    preprocess,
)
from mlx_dgemma.model.vision import has_vision, image_features

from .reference import ReferenceSession, load_reference, on_reference, torch_device
from .test_sampler_replay import DraftRecorder, ReplayRandom, recorded_draws
from .tokenizer_files import train_sentencepiece, write_sentencepiece, write_tokenizer_json

FP32_BOUND = 1e-4
SIZES = PRESETS["vision"]
V, C = SIZES["vocab_size"], SIZES["canvas_length"]
IMAGE, BOI, EOI = V - 3, V - 2, V - 1  # as checkpoint_tools/random_checkpoint.py numbers them


def rel_err(ours, ref) -> float:
    return float(np.abs(np.asarray(ours, dtype=np.float32) - ref).max() / np.abs(ref).max())


def picture(height: int, width: int, seed: int, mode: str = "RGB") -> Image.Image:
    """A smooth random picture (gradients plus noise), so that resizing has something to blend."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    channels = 4 if mode == "RGBA" else 3
    base = np.stack([(x * (c + 1) * 7 + y * (c + 2) * 5) % 256 for c in range(channels)], axis=-1)
    pixels = np.clip(base + rng.integers(-40, 40, base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGBA" if mode == "RGBA" else "RGB")
    return image if mode in ("RGB", "RGBA") else image.convert(mode)


PICTURES = [picture(20, 28, 0), picture(30, 12, 1)]  # 63 and 65 soft tokens


@pytest.fixture(scope="module")
def vision_checkpoint(checkpoints):
    return checkpoints("vision")


def with_tokenizer(checkpoint, tmp_path_factory):
    """A copy of a checkpoint with a tokenizer that knows the image tokens (and the built-in chat template)."""
    folder = tmp_path_factory.mktemp("vision-chat") / "model"
    shutil.copytree(checkpoint, folder)
    write_tokenizer_json(
        folder,
        train_sentencepiece(tmp_path_factory.mktemp("sp")),
        {"<|image|>": IMAGE, "<|image>": BOI, "<image|>": EOI},
    )
    return folder


@pytest.fixture(scope="module")
def chat_checkpoint(vision_checkpoint, tmp_path_factory):
    return with_tokenizer(vision_checkpoint, tmp_path_factory)


# Soft attention ("tame", as in test_sampler_replay.py): with the random init's peaked attention the
# ~1e-6 differences grow through the self-conditioning chain until a draw flips (step 4 here).
@pytest.fixture(scope="module")
def tame_chat_checkpoint(checkpoints, tmp_path_factory):
    return with_tokenizer(checkpoints("vision", tame=True), tmp_path_factory)


def prompt_with_images(count: int, seed: int = 4) -> list[int]:
    """Random text ids around ``count`` image placeholders, the first image after a few tokens."""
    rng = np.random.default_rng(seed)
    ids = [2] + rng.integers(3, V - 3, size=5).tolist()
    for _ in range(count):
        ids += [IMAGE] + rng.integers(3, V - 3, size=3).tolist()
    return ids


# Preprocessing


@pytest.mark.parametrize("which", ["checkpoint", "defaults"])
def test_preprocess_matches_the_reference_processor(vision_checkpoint, tmp_path, which):
    if which == "checkpoint":
        folder = vision_checkpoint
        pictures = PICTURES + [picture(300, 12, 2, "RGBA"), picture(5, 700, 3, "L"), picture(48, 48, 4)]
    else:  # the reference's defaults (16-pixel patches, 280 soft tokens), large and palette images
        folder = tmp_path
        Gemma4ImageProcessorPil().save_pretrained(folder)
        pictures = [picture(900, 1300, 5), picture(64, 640, 6, "P")]
    reference = AutoImageProcessor.from_pretrained(str(folder))
    assert isinstance(reference, Gemma4ImageProcessorPil)
    expected = reference(pictures)
    ours = preprocess(pictures, ImageProcessorConfig.from_folder(folder))
    assert np.array_equal(ours["pixel_values"], np.asarray(expected["pixel_values"]))
    assert np.array_equal(ours["image_position_ids"], np.asarray(expected["image_position_ids"]))
    assert ours["num_soft_tokens_per_image"] == list(expected["num_soft_tokens_per_image"])


def test_placeholders_expand_as_the_reference_processor_expands_them(chat_checkpoint):
    model, tokenizer = load(chat_checkpoint)
    inputs = preprocess(PICTURES, model.image_processor)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "sort: 7 3"}]}],
        tokenize=False,
    )
    assert text.count("<|image|>") == 2
    # The reference processor's own replacement, on the text (Gemma4Processor.replace_image_token).
    tokens = types.SimpleNamespace(boi_token="<|image>", image_token="<|image|>", eoi_token="<image|>")
    pieces = text.split("<|image|>")
    expanded = pieces[0] + "".join(
        Gemma4Processor.replace_image_token(tokens, inputs, i) + piece for i, piece in enumerate(pieces[1:])
    )
    ids = prompt_ids(tokenizer, "sort: 7 3", images=2)
    ours = expand_image_tokens(ids, inputs["num_soft_tokens_per_image"], IMAGE, BOI, EOI)
    assert ours == tokenizer.encode(expanded, add_special_tokens=False)
    assert ours.count(IMAGE) == sum(inputs["num_soft_tokens_per_image"]) == 63 + 65


# The model against the reference


def test_vision_features_match_the_reference(vision_checkpoint):
    ref = load_reference(vision_checkpoint)
    model, _ = load(vision_checkpoint)
    assert has_vision(model)
    for pictures in (PICTURES[:1], PICTURES):
        inputs = preprocess(pictures, model.image_processor)
        with torch.no_grad():
            expected = (
                ref.model.encoder.get_image_features(
                    on_reference(inputs["pixel_values"]), on_reference(inputs["image_position_ids"]), return_dict=True
                )
                .pooler_output.cpu()
                .numpy()
            )
        ours = image_features(model, inputs["pixel_values"], inputs["image_position_ids"])
        assert ours.shape == expected.shape == (sum(inputs["num_soft_tokens_per_image"]), SIZES["hidden_size"])
        assert rel_err(ours, expected) <= FP32_BOUND


def test_bfloat16_vision_features_are_as_close_as_the_reference_own(checkpoints):
    """bf16 weights: our features against the reference's bf16 run, and both against the same
    weights computed in float32 (measured: 0.018; 0.043 against the reference's own 0.040)."""
    path = checkpoints("vision", "bfloat16")
    model, _ = load(path)
    inputs = preprocess(PICTURES, model.image_processor)
    ours = np.array(image_features(model, inputs["pixel_values"], inputs["image_position_ids"]).astype(mx.float32))
    expected = {}
    for dtype in (torch.float32, torch.bfloat16):
        with torch.no_grad():
            expected[dtype] = (
                load_reference(path, dtype)
                .model.encoder.get_image_features(
                    on_reference(inputs["pixel_values"]), on_reference(inputs["image_position_ids"]), return_dict=True
                )
                .pooler_output.float()
                .cpu()
                .numpy()
            )
    assert rel_err(ours, expected[torch.bfloat16]) <= 5e-2
    assert rel_err(ours, expected[torch.float32]) <= 1.5 * rel_err(expected[torch.bfloat16], expected[torch.float32])


@pytest.mark.parametrize("count", [1, 2])
def test_cache_and_logits_with_images_match_the_reference(vision_checkpoint, count):
    ref = ReferenceSession(load_reference(vision_checkpoint))
    model, _ = load(vision_checkpoint)
    inputs = preprocess(PICTURES[:count], model.image_processor)
    vision = {k: inputs[k] for k in ("pixel_values", "image_position_ids")}
    ids = expand_image_tokens(prompt_with_images(count), inputs["num_soft_tokens_per_image"], IMAGE, BOI, EOI)
    rng = np.random.default_rng(count)
    canvases = [rng.integers(0, V, size=(1, C)) for _ in range(3)]

    ref.encode([ids], **vision)
    cache = model.make_cache()
    model.encode(mx.array([ids]), cache, **vision)
    assert cache.offset == len(ids) > SIZES["sliding_window"] + 63  # an image block is longer than the window
    for i, kind in enumerate(SIZES["layer_types"]):
        keys, values = ref.layer_kv(i)
        ours_k, ours_v = cache.layer_keys(i)  # what the denoiser reads: sliding layers' last window - 1
        assert ours_k.shape == keys.shape
        assert rel_err(ours_k, keys) <= FP32_BOUND, f"layer {i} keys"
        assert rel_err(ours_v, values) <= FP32_BOUND, f"layer {i} values"

    r1 = ref.denoise(canvases[0])
    m1 = model.denoise(mx.array(canvases[0]), cache)
    r2 = ref.denoise(canvases[1], r1 / 0.8)
    m2 = model.denoise(mx.array(canvases[1]), cache, mx.array(r1 / 0.8))
    committed = r2.argmax(-1)
    ref.encode(committed)
    model.encode(mx.array(committed), cache)
    r3 = ref.denoise(canvases[2])
    m3 = model.denoise(mx.array(canvases[2]), cache)
    for what, ours, expected in [("step 1", m1, r1), ("step 2", m2, r2), ("next canvas", m3, r3)]:
        assert rel_err(ours, expected) <= FP32_BOUND, what

    # The test has teeth: without the images, or without the bidirectional image blocks, the
    # logits are far off.
    for kwargs in ({}, {**vision, "mm_token_type_ids": np.zeros(len(ids))}):
        other = model.make_cache()
        model.encode(mx.array([ids]), other, **kwargs)
        assert rel_err(model.denoise(mx.array(canvases[0]), other), r1) > 0.05


def test_replayed_generation_with_two_images_matches_the_reference(tame_chat_checkpoint):
    reference = load_reference(tame_chat_checkpoint)
    model, tokenizer = load(tame_chat_checkpoint)
    placeholders = prompt_with_images(2, seed=9)
    inputs = preprocess(PICTURES, model.image_processor)
    ids = expand_image_tokens(placeholders, inputs["num_soft_tokens_per_image"], IMAGE, BOI, EOI)
    streamer = DraftRecorder()
    torch.manual_seed(1234)
    with recorded_draws() as draws:
        out = reference.generate(
            on_reference([ids]),
            pixel_values=on_reference(inputs["pixel_values"]),
            image_position_ids=on_reference(inputs["image_position_ids"]),
            mm_token_type_ids=on_reference([[int(i == IMAGE) for i in ids]]),
            max_new_tokens=2 * C,
            streamer=streamer,
        )
    expected = out.sequences[0, len(ids) :].tolist()

    rng = ReplayRandom(draws)
    responses = list(stream_generate(model, tokenizer, placeholders, 2 * C, images=PICTURES, rng=rng, drafts=True))
    assert rng.used == len(draws)
    tokens = [t for r in responses for t in r.tokens + [0] * (C - len(r.tokens))]
    assert tokens == expected and len(expected) == 2 * C
    assert [[d.tokens for d in r.drafts] for r in responses] == streamer.canvases
    assert responses[0].prompt_tokens == len(ids)


def test_next_token_logits_with_an_image_match_the_reference(vision_checkpoint):
    """Autoregressive mode: the encoder's final-normed states through the tied, soft-capped head."""
    ref = ReferenceSession(load_reference(vision_checkpoint))
    model, _ = load(vision_checkpoint)
    inputs = preprocess(PICTURES[:1], model.image_processor)
    vision = {k: inputs[k] for k in ("pixel_values", "image_position_ids")}
    ids = expand_image_tokens(prompt_with_images(1), inputs["num_soft_tokens_per_image"], IMAGE, BOI, EOI)
    with torch.no_grad():
        ref.encode([ids], **vision)  # fills the cache; the hidden states come from a second, cache-free pass
        types_ = on_reference([[int(i == IMAGE) for i in ids]])
        masks = ref.model.model.encoder.create_masks_for_generate(
            config=ref.model.config,
            inputs_embeds=torch.empty(1, len(ids), 0, device=torch_device()),
            attention_mask=torch.ones(1, len(ids), dtype=torch.bool, device=torch_device()),
            cache=None,
            position_ids=on_reference(np.arange(len(ids)))[None],
            mm_token_type_ids=types_,
        )
        hidden = ref.model.model.encoder(
            input_ids=on_reference([ids]),
            attention_mask=masks,
            position_ids=on_reference(np.arange(len(ids)))[None],
            pixel_values=on_reference(inputs["pixel_values"]),
            image_position_ids=on_reference(inputs["image_position_ids"]),
            mm_token_type_ids=types_,
        ).last_hidden_state[:, -1]
        cap = ref.model.config.text_config.final_logit_softcapping
        expected = (cap * torch.tanh(ref.model.lm_head(hidden) / cap)).cpu().numpy()
    ours = model.next_token_logits(mx.array([ids]), model.make_cache(), **vision)
    assert rel_err(ours, expected) <= FP32_BOUND


@pytest.mark.parametrize("policy", ["ar", "fast"])
def test_policies_and_templates_take_images(chat_checkpoint, policy):
    model, tokenizer = load(chat_checkpoint)
    answers = [
        generate(
            model,
            tokenizer,
            "sort: 7 3",
            max_tokens=C,
            seed=2,
            policy=policy,
            images=pictures,
            template="7 {{fill:4}} 3",
        )
        for pictures in (PICTURES[:1], PICTURES[1:])
    ]
    assert all(a.startswith("7 ") and a.endswith(" 3") for a in answers)
    free = [
        generate(model, tokenizer, "sort: 7 3", max_tokens=C, seed=2, policy=policy, images=pictures)
        for pictures in (PICTURES[:1], PICTURES[1:])
    ]
    assert free[0] != free[1]  # the image is seen


# The CLI and the Python API


def test_image_prompt_through_the_cli(chat_checkpoint, tmp_path):
    files = []
    for i, image in enumerate(PICTURES):
        files.append(tmp_path / f"picture{i}.png")
        image.save(files[-1])
    args = ["--model", str(chat_checkpoint), "--prompt", "sort: 7 3", "--max-tokens", str(2 * C), "--seed", "5"]
    # mlx-lm's syntax (the paths after one --image), and the flag repeated: the same run.
    result = CliRunner().invoke(main, args + ["--image", str(files[0]), str(files[1]), "--verbose"])
    assert result.exit_code == 0, result.output
    repeated = CliRunner().invoke(main, args + ["--image", str(files[0]), "--image", str(files[1])])
    assert result.stdout.startswith(repeated.stdout.rstrip("\n") + "\n")
    model, tokenizer = load(chat_checkpoint)
    expected = generate(model, tokenizer, "sort: 7 3", max_tokens=2 * C, seed=5, images=[str(f) for f in files])
    assert expected and result.stdout.startswith(expected + "\n")
    prompt = len(prompt_ids(tokenizer, "sort: 7 3", images=2)) - 2 + 2 * 2 + 63 + 65  # placeholders expanded
    assert f"Prompt: {prompt} tokens" in result.output
    # The images are seen: another picture gives another answer.
    assert (
        generate(model, tokenizer, "sort: 7 3", max_tokens=2 * C, seed=5, images=[PICTURES[1], PICTURES[0]]) != expected
    )


def test_a_text_prompt_gets_its_placeholders_from_a_tokenizer_without_image_tokens(
    vision_checkpoint, chat_checkpoint, tmp_path
):
    """A sentencepiece tokenizer that knows no image token, and no chat template (the built-in one is
    used): the placeholder the template writes still becomes the model's image token."""
    model = tmp_path / "model"
    shutil.copytree(vision_checkpoint, model)
    write_sentencepiece(model, train_sentencepiece(tmp_path), chat_template=None)
    dgemma, tokenizer = load(model)
    assert tokenizer.token_id("<|image|>") is None
    # The same ids as a tokenizer that spells the image token.
    assert prompt_ids(tokenizer, "sort: 7 3", images=1) == prompt_ids(load(chat_checkpoint)[1], "sort: 7 3", images=1)
    PICTURES[0].save(tmp_path / "picture.png")
    args = ["--model", str(model), "--prompt", "sort: 7 3", "--max-tokens", str(C), "--seed", "5"]
    result = CliRunner().invoke(main, args + ["--image", str(tmp_path / "picture.png")])
    assert result.exit_code == 0, result.output
    assert result.stdout == generate(dgemma, tokenizer, "sort: 7 3", max_tokens=C, seed=5, images=PICTURES[:1]) + "\n"


@pytest.mark.parametrize(
    "case", ["text file", "missing", "too large", "no vision tower", "no image tokens", "placeholders"]
)
def test_bad_images_get_a_one_line_error(chat_checkpoint, tmp_path, monkeypatch, case):
    good = tmp_path / "picture.png"
    PICTURES[0].save(good)
    model, image, extra = chat_checkpoint, good, []
    if case == "text file":
        image = tmp_path / "notes.txt"
        image.write_text("not a picture")
        expected = f"{image} is not an image Pillow can read (PNG, JPEG, GIF, WebP, …)"
    elif case == "missing":
        image = tmp_path / "nowhere.png"
        expected = f"image file {image} not found"
    elif case == "too large":
        monkeypatch.setattr(images_module, "MAX_IMAGE_PIXELS", 500)
        expected = f"{good} is 28x20 pixels, more than the 500 pixels accepted; scale it down first"
    elif case == "no vision tower":  # a vision config, but no vision weights
        model = tmp_path / "text-only"
        shutil.copytree(chat_checkpoint, model)
        weights = mx.load(str(model / "model.safetensors"))
        mx.save_safetensors(str(model / "model.safetensors"), {k: v for k, v in weights.items() if "vision" not in k})
        extra = ["--ignore-chat-template"]
        expected = "this checkpoint takes text only, not images: it has no vision tower weights"
    elif case == "no image tokens":  # the demo: a vision tower, but image token ids past its vocabulary
        model = DEMO_MODEL
        expected = (
            "this checkpoint takes text only, not images: its image token ids (up to 350) are outside its "
            "vocabulary of 348"
        )
    else:
        extra = ["--ignore-chat-template"]
        expected = "the prompt has 0 image placeholders for 1 images; give one image per placeholder"
    result = CliRunner().invoke(main, ["--model", str(model), "--prompt", "1 2 3", "--image", str(image), *extra])
    assert result.exit_code == 1
    assert result.output == f"Error: {expected}\n"


def test_image_tokens_and_images_must_agree(vision_checkpoint):
    model, _ = load(vision_checkpoint)
    inputs = preprocess(PICTURES[:1], model.image_processor)
    ids = expand_image_tokens(prompt_with_images(1), [62], IMAGE, BOI, EOI)  # one soft token short
    with pytest.raises(ValueError, match="the prompt has 62 image tokens but the images give 63 soft tokens"):
        model.encode(
            mx.array([ids]),
            model.make_cache(),
            pixel_values=inputs["pixel_values"],
            image_position_ids=inputs["image_position_ids"],
        )


def test_image_sources(tmp_path):
    png = io.BytesIO()
    PICTURES[1].save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    assert np.array_equal(np.array(image_from_url(url)), np.array(PICTURES[1]))
    path = tmp_path / "p.png"
    PICTURES[1].save(path)
    assert np.array_equal(np.array(image_from_url(f"file://{path}")), np.array(PICTURES[1]))
    assert np.array_equal(np.array(load_image(str(path))), np.array(PICTURES[1]))
    for bad, message in [
        ("https://example.com/cat.png", "remote image URLs are not fetched"),
        ("data:text/plain;base64,aGk=", "an image data URL must look like"),
        ("data:image/png;base64,!!!", "base64 payload is damaged"),
        ("data:image/png;base64,aGVsbG8=", "the image data is not an image"),
    ]:
        with pytest.raises(ImageError, match=message):
            image_from_url(bad)


# Conversion


@pytest.mark.parametrize("quantized", [False, True], ids=["unquantized", "uniform-4bit-g32"])
def test_converted_checkpoint_loads_with_its_vision_weights(vision_checkpoint, tmp_path, quantized):
    options = dict(quantize=True, q_bits=4, q_group_size=32, quant_predicate="uniform") if quantized else {}
    out = convert(str(vision_checkpoint), str(tmp_path / "out"), progress=False, **options)
    source, _ = load(vision_checkpoint)
    converted, _ = load(out)
    assert has_vision(converted) and converted.image_processor == source.image_processor
    tower = converted.model.encoder.vision_tower
    # The vision weights are carried unquantized (and the text weights quantized when asked).
    assert type(tower.encoder.layers[0].self_attn.q_proj.linear) is nn.Linear
    assert tower.patch_embedder.input_proj.weight.dtype == mx.float32
    assert ("scales" in converted.layers[0].self_attn.q_proj) == quantized
    inputs = preprocess(PICTURES, source.image_processor)
    a = image_features(source, inputs["pixel_values"], inputs["image_position_ids"])
    b = image_features(converted, inputs["pixel_values"], inputs["image_position_ids"])
    assert np.array_equal(np.array(a), np.array(b))
