"""Video input against the transformers reference on a random checkpoint with a vision tower: a clip
encoded here with PyAV gives the frames the reference's PyAV reader gives, the token layout its Gemma 4
processor writes, the encoder's logits and the answers (reference and ar policies) the reference gives
the frames as images; the CLI, the API and the server answer alike; bad clips get a one-line error."""

import base64
import json
import re
import shutil
import sys
import types

import av
import mlx.core as mx
import numpy as np
import openai
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from transformers import Gemma4ImageProcessorPil, Gemma4Processor
from transformers.video_utils import VideoMetadata, load_video as reference_load_video

from mlx_dgemma import generate, load, stream_generate
from mlx_dgemma.engine.resolve import resolve
from mlx_dgemma.generate import DEMO_MODEL, main
from mlx_dgemma.memory import DEVICE_MEMORY_ENV, check_memory
from mlx_dgemma.model import video as video_module
from mlx_dgemma.model.video import VideoError, VideoProcessorConfig, load_video, sample_indices, video_from_url
from mlx_dgemma.options import GenerationArgs

from .reference import ReferenceSession, load_reference, on_reference, torch_device
from .test_sampler_replay import ReplayRandom, recorded_draws
from .test_server import serving
from .test_vision import BOI, EOI, FP32_BOUND, IMAGE, SIZES, C, V, rel_err
from .tokenizer_files import train_sentencepiece, write_tokenizer_json

VIDEO = V - 4  # the test tokenizer's <|video|>
PROMPT = "sort: 7 3"
FRAMES = 4  # the test checkpoint's video frame limit (its processor_config.json)
VIDEO_PROCESSOR = Gemma4ImageProcessorPil(
    patch_size=SIZES["vision"]["patch_size"],
    pooling_kernel_size=SIZES["vision"]["pooling_kernel_size"],
    max_soft_tokens=70,  # Gemma 4's video budget per frame
)


def encode_clip(path, frames: int, width: int = 32, height: int = 24, fps: int = 24, gop: int = 12, seed: int = 0):
    """An H.264 clip whose frames all differ (moving gradients and noise), a keyframe every ``gop``."""
    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fps, options={"g": str(gop)})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        y, x = np.mgrid[0:height, 0:width]
        for i in range(frames):
            base = np.stack([(x * 3 + i * 5), (y * 2 + i * 7), (x + y + i * 11)], -1) % 256
            pixels = np.clip(base + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return encode_clip(tmp_path_factory.mktemp("clips") / "clip.mp4", 60)  # 2.5 s at 24 fps


def with_video_tokenizer(checkpoint, tmp_path_factory):
    """A copy of a checkpoint with a tokenizer that knows the image and video tokens, and a video frame
    limit of ``FRAMES`` in its processor config."""
    folder = tmp_path_factory.mktemp("video-chat") / "model"
    shutil.copytree(checkpoint, folder)
    sp = tmp_path_factory.mktemp("sp")
    write_tokenizer_json(
        folder, train_sentencepiece(sp), {"<|image|>": IMAGE, "<|image>": BOI, "<image|>": EOI, "<|video|>": VIDEO}
    )
    (folder / "processor_config.json").write_text(json.dumps({"video_processor": {"num_frames": FRAMES}}))
    return folder


@pytest.fixture(scope="module")
def chat_checkpoint(checkpoints, tmp_path_factory):
    return with_video_tokenizer(checkpoints("vision"), tmp_path_factory)


# Soft attention ("tame"): a replayed generation's ~1e-6 differences do not flip a draw.
@pytest.fixture(scope="module")
def tame_checkpoint(checkpoints, tmp_path_factory):
    return with_video_tokenizer(checkpoints("vision", tame=True), tmp_path_factory)


def reference_frames(path, num_frames: int, fps=None):
    """The frames the reference's PyAV reader decodes (the whole clip) at our sampled indices, and its metadata."""

    def indices(metadata, **kwargs):
        return np.array(sample_indices(metadata.total_num_frames, metadata.fps, num_frames, fps))

    frames, metadata = reference_load_video(str(path), backend="pyav", sample_indices_fn=indices)
    return [Image.fromarray(f) for f in frames], metadata


def reference_prompt(tokenizer, frames, metadata: VideoMetadata) -> tuple[list[int], dict]:
    """The ids and images the reference takes: its Gemma 4 processor's video layout with the frames'
    soft tokens as image tokens (DiffusionGemma has no video token), the frames through its image
    processor at the video budget."""
    inputs = VIDEO_PROCESSOR(frames)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": PROMPT}]}], tokenize=False
    )
    names = types.SimpleNamespace(boi_token="<|image>", video_token="<|image|>", eoi_token="<image|>")
    per_frame = set(inputs["num_soft_tokens_per_image"])
    assert len(per_frame) == 1
    layout = Gemma4Processor.replace_video_token(
        names, {"num_soft_tokens_per_video": [per_frame.pop()], "video_metadata": [metadata]}, 0
    )
    assert text.count("<|video|>") == 1
    ids = tokenizer.encode(text.replace("<|video|>", layout), add_special_tokens=False)
    return ids, {k: np.asarray(inputs[k]) for k in ("pixel_values", "image_position_ids")}


# Frames and layout


@pytest.mark.parametrize("fps", [None, 2.0, 100 / 7])
def test_frames_are_the_reference_readers(clip, fps):
    ours = load_video(clip, VideoProcessorConfig(), fps)
    frames, metadata = reference_frames(clip, 32, fps)
    assert len(ours.frames) == len(frames) == {None: 32, 2.0: 5, 100 / 7: 32}[fps]
    assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(ours.frames, frames))
    assert ours.timestamps == [float(t) for t in metadata.timestamps]


def test_a_long_clip_is_sampled_not_decoded_whole(tmp_path):
    path = encode_clip(tmp_path / "long.mp4", 2400, 16, 16, gop=48)  # 100 s
    ours = load_video(path, VideoProcessorConfig(num_frames=8))
    frames, _ = reference_frames(path, 8)
    assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(ours.frames, frames))
    assert ours.decoded <= 8 * 48  # each sampled frame costs at most a keyframe interval, not the clip


def test_prompt_and_pixels_are_the_reference_processors(chat_checkpoint, clip):
    model, tokenizer = load(chat_checkpoint)
    assert model.video_processor == VideoProcessorConfig(num_frames=FRAMES)
    resolved = resolve(model, tokenizer, PROMPT, GenerationArgs(videos=[str(clip)]))
    ids, vision = reference_prompt(tokenizer, *reference_frames(clip, FRAMES))
    assert resolved.ids == ids
    assert ids.count(BOI) == FRAMES and "00:00  00:00  00:01  00:01 sort" in tokenizer.decode(ids)  # (markers hidden)
    for name in ("pixel_values", "image_position_ids"):
        assert np.array_equal(resolved.vision_inputs[name], vision[name])


# The model against the reference


def test_encoder_logits_match_the_reference(chat_checkpoint, clip):
    model, tokenizer = load(chat_checkpoint)
    resolved = resolve(model, tokenizer, PROMPT, GenerationArgs(videos=[str(clip)]))
    ref = ReferenceSession(load_reference(chat_checkpoint))
    ref.encode([resolved.ids], **resolved.vision_inputs)
    cache = model.make_cache()
    model.encode(mx.array([resolved.ids]), cache, **resolved.vision_inputs)
    canvas = np.random.default_rng(0).integers(0, V, size=(1, C))
    expected = ref.denoise(canvas)
    assert rel_err(model.denoise(mx.array(canvas), cache), expected) <= FP32_BOUND
    # The test has teeth: another clip's frames give other logits.
    other = resolve(
        model,
        tokenizer,
        PROMPT,
        GenerationArgs(videos=[list(reversed(load_video(clip, VideoProcessorConfig(num_frames=FRAMES)).frames))]),
    )
    moved = model.make_cache()
    model.encode(mx.array([other.ids]), moved, **other.vision_inputs)
    assert rel_err(model.denoise(mx.array(canvas), moved), expected) > 0.05


def test_replayed_answer_matches_the_reference(tame_checkpoint, clip):
    model, tokenizer = load(tame_checkpoint)
    ids, vision = reference_prompt(tokenizer, *reference_frames(clip, FRAMES))
    torch.manual_seed(1234)
    with recorded_draws() as draws:
        out = load_reference(tame_checkpoint).generate(
            on_reference([ids]),
            pixel_values=on_reference(vision["pixel_values"]),
            image_position_ids=on_reference(vision["image_position_ids"]),
            mm_token_type_ids=on_reference([[int(i == IMAGE) for i in ids]]),
            max_new_tokens=2 * C,
        )
    expected = out.sequences[0, len(ids) :].tolist()
    rng = ReplayRandom(draws)
    responses = list(stream_generate(model, tokenizer, PROMPT, 2 * C, videos=[str(clip)], rng=rng))
    assert rng.used == len(draws)
    assert [t for r in responses for t in r.tokens + [0] * (C - len(r.tokens))] == expected
    assert responses[0].prompt_tokens == len(ids)


@torch.no_grad()
def reference_greedy(ref, ids: list[int], vision: dict, count: int) -> list[int]:
    """The reference's greedy autoregressive tokens: its encoder's last hidden state through the
    tied, soft-capped head, the whole sequence (frames as images) again for each token."""
    out = list(ids)
    for _ in range(count):
        length = len(out)
        positions = on_reference(np.arange(length))[None]
        kinds = on_reference([[int(i == IMAGE) for i in out]])
        masks = ref.model.encoder.create_masks_for_generate(
            config=ref.config,
            inputs_embeds=torch.empty(1, length, 0, device=torch_device()),
            attention_mask=torch.ones(1, length, dtype=torch.bool, device=torch_device()),
            cache=None,
            position_ids=positions,
            mm_token_type_ids=kinds,
        )
        hidden = ref.model.encoder(
            input_ids=on_reference([out]),
            attention_mask=masks,
            position_ids=positions,
            pixel_values=on_reference(vision["pixel_values"]),
            image_position_ids=on_reference(vision["image_position_ids"]),
            mm_token_type_ids=kinds,
        ).last_hidden_state[:, -1]
        out.append(int(ref.lm_head(hidden).argmax(-1)))
    return out[len(ids) :]


@pytest.mark.slow  # (~20 s: the reference re-reads the whole prompt for each token)
def test_greedy_ar_answer_matches_the_reference(chat_checkpoint, clip):
    model, tokenizer = load(chat_checkpoint)
    ids, vision = reference_prompt(tokenizer, *reference_frames(clip, FRAMES))
    tokens = [
        t for r in stream_generate(model, tokenizer, PROMPT, C, videos=[str(clip)], policy="ar") for t in r.tokens
    ]
    expected = reference_greedy(load_reference(chat_checkpoint), ids, vision, len(tokens))
    assert tokens == expected and tokens


# Front doors


def test_the_cli_answers_as_the_api(chat_checkpoint, clip):
    model, tokenizer = load(chat_checkpoint)
    expected = generate(model, tokenizer, PROMPT, max_tokens=2 * C, seed=5, videos=[str(clip)])
    args = ["--model", str(chat_checkpoint), "--prompt", PROMPT, "--max-tokens", str(2 * C), "--seed", "5"]
    result = CliRunner().invoke(main, args + ["--video", str(clip), "--verbose"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(expected + "\n")
    ids = resolve(model, tokenizer, PROMPT, GenerationArgs(videos=[str(clip)])).ids
    assert f"Prompt: {len(ids)} tokens" in result.output
    # The frames are seen (another rate, other frames, another answer), and frames given as images
    # at the clip's rate are the clip.
    at_rate = generate(model, tokenizer, PROMPT, max_tokens=2 * C, seed=5, videos=[str(clip)], video_fps=1.0)
    assert at_rate != expected
    fast = CliRunner().invoke(main, args + ["--video", str(clip), "--video-fps", "1"])
    assert fast.exit_code == 0 and fast.stdout == at_rate + "\n"


def test_frames_given_as_images_and_raw_prompts(chat_checkpoint, clip):
    model, tokenizer = load(chat_checkpoint)
    frames = load_video(clip, VideoProcessorConfig()).frames  # 32 frames of 60 at 24 fps
    whole, _ = reference_frames(clip, 60)
    from_frames = resolve(model, tokenizer, PROMPT, GenerationArgs(videos=[whole]))
    from_file = resolve(model, tokenizer, PROMPT, GenerationArgs(videos=[str(clip)]))
    assert from_frames.ids == from_file.ids  # the clip's own frames at the reference's 24 fps: the same clip
    assert np.array_equal(from_frames.vision_inputs["pixel_values"], from_file.vision_inputs["pixel_values"])
    assert len(frames) == 32
    # A raw prompt holds the placeholder itself, as text or as ids, wherever it goes.
    raw = "<bos>look: <|video|> then <|image|>!"
    picture = whole[0]
    text = resolve(model, tokenizer, raw, GenerationArgs(videos=[str(clip)], images=[picture], chat_template=False))
    ids = resolve(model, tokenizer, tokenizer.encode(raw), GenerationArgs(videos=[str(clip)], images=[picture]))
    assert text.ids == ids.ids and text.ids.count(BOI) == FRAMES + 1
    assert np.array_equal(text.vision_inputs["pixel_values"], ids.vision_inputs["pixel_values"])


@pytest.fixture(scope="module")
def client(tame_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("allowed-videos")
    with serving(*load(tame_checkpoint), model_id="vision", image_dir=folder) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60), folder


def test_the_server_answers_as_the_api(client, tame_checkpoint, clip):
    openai_client, folder = client
    model, tokenizer = load(tame_checkpoint)
    expected = generate(model, tokenizer, PROMPT, max_tokens=2 * C, seed=5, videos=[str(clip)])
    url = "data:video/mp4;base64," + base64.b64encode(clip.read_bytes()).decode()
    shutil.copyfile(clip, folder / "clip.mp4")
    for where in (url, "clip.mp4"):
        content = [{"type": "video_url", "video_url": {"url": where}}, {"type": "text", "text": PROMPT}]
        reply = openai_client.chat.completions.create(
            model="vision", messages=[{"role": "user", "content": content}], seed=5, max_tokens=2 * C
        )
        assert reply.choices[0].message.content == expected
    # Responses has no video part of its own: the chat's is taken as the chat takes it.
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "input_text", "text": PROMPT}]
    reply = openai_client.responses.create(
        model="vision", input=[{"role": "user", "content": content}], max_output_tokens=2 * C, extra_body={"seed": 5}
    )
    assert reply.output_text == expected
    bad = [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,aGVsbG8="}}]
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model="vision", messages=[{"role": "user", "content": bad}])
    assert e.value.body["message"] == (
        "messages[0]: the video data is not a video FFmpeg can read (MP4, WebM, MKV, MOV, …)"
    )
    assert e.value.body["param"] == "messages"


def test_the_memory_check_counts_the_frames(chat_checkpoint, clip, monkeypatch):
    model, tokenizer = load(chat_checkpoint)
    with_frames = len(resolve(model, tokenizer, PROMPT, GenerationArgs(videos=[str(clip)])).ids)
    frame_tokens = with_frames - len(resolve(model, tokenizer, PROMPT, GenerationArgs()).ids)
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "1TB")
    text = check_memory(chat_checkpoint, PROMPT, 2 * C).total
    video = check_memory(chat_checkpoint, PROMPT, 2 * C, extra_tokens=frame_tokens).total
    assert video > text
    monkeypatch.setenv(DEVICE_MEMORY_ENV, str((text + video) // 2))  # the text fits, not with the frames
    args = ["--model", str(chat_checkpoint), "--prompt", PROMPT, "--max-tokens", str(2 * C)]
    assert CliRunner().invoke(main, args).exit_code == 0
    result = CliRunner().invoke(main, args + ["--video", str(clip)])
    assert result.exit_code == 1 and result.output.startswith("Error: the model needs ")


def test_the_demo_server_refuses_a_video(clip):
    with serving(*load(DEMO_MODEL), model_id="demo") as url:
        demo = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        part = {
            "type": "video_url",
            "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(clip.read_bytes()).decode()},
        }
        with pytest.raises(openai.BadRequestError) as e:
            demo.chat.completions.create(model="demo", messages=[{"role": "user", "content": [part]}])
    assert e.value.status_code == 400 and e.value.body["param"] == "messages"
    assert e.value.body["message"] == (
        "messages[0]: this checkpoint takes text only, not video: its image token ids (up to 350) are outside "
        "its vocabulary of 348"
    )


# Bad input


def test_video_sources(clip, tmp_path, monkeypatch):
    config = VideoProcessorConfig(num_frames=FRAMES)
    frames = load_video(clip, config).frames
    url = "data:video/mp4;base64," + base64.b64encode(clip.read_bytes()).decode()
    for source in (url, str(clip), f"file://{clip}"):
        same = video_from_url(source, clip.parent, config).frames
        assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(same, frames))
    for bad, folder, message in [
        ("https://example.com/walk.mp4", "/", "remote video URLs are not fetched"),
        ("data:image/png;base64,aGk=", "/", "a video data URL must look like data:video/mp4;base64,..."),
        ("data:video/mp4;base64,!!!", "/", "the video data URL's base64 payload is damaged"),
        (str(clip), tmp_path, f"{str(clip)!r} is not a video file that may be read here"),
        (str(clip), None, "local video paths are not read here"),
    ]:
        with pytest.raises(VideoError, match=re.escape(message)):
            video_from_url(bad, folder, config)
    with pytest.raises(VideoError, match=re.escape("not one image; pass [frames]")):
        load_video(frames[0], config)
    with pytest.raises(VideoError, match="the video fps must be a number above 0, got 0"):
        load_video(clip, config, fps=0)
    monkeypatch.setitem(sys.modules, "av", None)  # PyAV not installed
    with pytest.raises(VideoError, match=re.escape("video input needs PyAV: pip install 'mlx-dgemma[video]'")):
        load_video(clip, config)


@pytest.mark.parametrize(
    "case",
    [
        "text file",
        "missing",
        "no frames",
        "too long",
        "too large",
        "far keyframes",
        "no vision tower",
        "too many tokens",
    ],
)
def test_bad_videos_get_a_one_line_error(chat_checkpoint, clip, tmp_path, monkeypatch, case):
    model, video, extra = chat_checkpoint, clip, []
    if case == "text file":
        video = tmp_path / "notes.mp4"
        video.write_text("not a clip")
        expected = f"{video} is not a video FFmpeg can read (MP4, WebM, MKV, MOV, …)"
    elif case == "missing":
        video = tmp_path / "nowhere.mp4"
        expected = f"video file {video} not found"
    elif case == "no frames":  # a container with no video in it
        video = tmp_path / "empty.mp4"
        with av.open(str(video), "w") as out:
            stream = out.add_stream("libx264", rate=24)
            stream.width, stream.height, stream.pix_fmt = 32, 24, "yuv420p"
            out.start_encoding()
        expected = f"{video} has no video frames"
    elif case == "too long":
        monkeypatch.setattr(video_module, "MAX_VIDEO_SECONDS", 2)
        expected = f"{clip} is 2.5 seconds long, more than the 2 seconds accepted; cut it first"
    elif case == "too large":
        monkeypatch.setattr(video_module, "MAX_IMAGE_PIXELS", 500)
        expected = f"{clip} is 32x24 pixels, more than the 500 pixels accepted per frame; scale it down first"
    elif case == "far keyframes":  # (the clip's frames 0, 15, 30, 45 are sampled: 15 decoded to reach the second)
        monkeypatch.setattr(video_module, "MAX_DECODED_PER_FRAME", 10)
        expected = f"{clip} has keyframes more than 10 frames apart; re-encode it"
    elif case == "no vision tower":  # the demo: a tower, but no image tokens in its vocabulary
        model = DEMO_MODEL
        expected = (
            "this checkpoint takes text only, not video: its image token ids (up to 350) are outside its "
            "vocabulary of 348"
        )
    else:
        model = tmp_path / "short-context"
        shutil.copytree(chat_checkpoint, model)
        config = json.loads((model / "config.json").read_text())
        config["text_config"]["max_position_embeddings"] = 256
        (model / "config.json").write_text(json.dumps(config))
        extra = ["--ignore-memory-check"]
        length = len(resolve(*load(chat_checkpoint), PROMPT, GenerationArgs(videos=[str(clip)])).ids)
        assert length + C > 256 > length - FRAMES * 60  # the frames put it past the context
        expected = (
            f"the prompt with its videos' 4 frames is {length} tokens: with a 12-token canvas after it, past the "
            "model's context of 256; sample fewer frames (a lower video fps) or send a shorter clip"
        )
    result = CliRunner().invoke(main, ["--model", str(model), "--prompt", PROMPT, "--video", str(video), *extra])
    assert result.exit_code == 1
    assert result.output == f"Error: {expected}\n"
