"""Video → timestamped frames, as Gemma 4's processor lays a clip out: frames sampled evenly through
the clip (or at a given rate) up to a frame limit, each an image at the video's per-frame soft-token
budget, and in the prompt each frame's ``mm:ss`` timestamp, a space and its image, frames separated by
a space, in place of the clip's ``<|video|>`` placeholder. DiffusionGemma has no video tower or video
token: the frames are images to the vision tower and the encoder (``images.Frame``).

Clips are decoded with PyAV (the ``video`` extra), seeking to each sampled frame rather than
decoding the clip whole, so a long clip costs its sampled frames and one keyframe interval each.

    clip = load_video("walk.mp4", VideoProcessorConfig.from_folder(checkpoint))
    text, images = place_videos(text, [], [clip])  # then the images' placeholders, as for images
"""

from __future__ import annotations

import io
import re
import stat
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from ..errors import VideoError
from .images import (
    IMAGE_PLACEHOLDER,
    MAX_IMAGE_PIXELS,
    SUPPORTED_SOFT_TOKENS,
    Frame,
    data_url_payload,
    path_under,
    processor_settings,
)

VIDEO_PLACEHOLDER = "<|video|>"  # what Gemma 4's chat template writes for a video part
MAX_VIDEO_SECONDS = 2 * 60 * 60  # longer clips are refused
MAX_FRAMES = 256  # the most frames a clip gives, whatever the rate asked for or the checkpoint's limit
SEEK_AHEAD_SECONDS = 2.0  # a sampled frame closer than this to the last one decoded is reached by decoding on
MAX_DECODED_PER_FRAME = 1000  # frames decoded to reach one sampled frame (a keyframe interval past it: refused)
UNTIMED_FPS = 24  # the rate the reference gives frames passed without a clip's metadata


@dataclass
class VideoProcessorConfig:
    """The checkpoint's video settings (processor_config.json's ``video_processor``, or
    video_preprocessor_config.json); the defaults are Gemma 4's video processor's."""

    num_frames: int = 32  # frames sampled evenly through a clip
    max_soft_tokens: int = 70  # per frame
    fps: float | None = None  # frames per second to sample instead (still at most num_frames)

    def __post_init__(self):
        if self.max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
            raise VideoError(
                f"the video max_soft_tokens must be one of {SUPPORTED_SOFT_TOKENS}, got {self.max_soft_tokens}"
            )
        if not (isinstance(self.num_frames, int) and 1 <= self.num_frames <= MAX_FRAMES):
            raise VideoError(f"the video num_frames must be an integer from 1 to {MAX_FRAMES}, got {self.num_frames}")

    @classmethod
    def from_folder(cls, folder: str | Path) -> "VideoProcessorConfig":
        places = (("processor_config.json", "video_processor"), ("video_preprocessor_config.json", None))
        if raw := processor_settings(folder, places, VideoError):
            names = {f.name for f in fields(cls)}
            return cls(**{k: v for k, v in raw.items() if k in names and v is not None})
        return cls()


def video_processor(model) -> VideoProcessorConfig:
    """The model's video settings (the loader reads them with the image processor's), else the defaults."""
    return getattr(model, "video_processor", None) or VideoProcessorConfig()


@dataclass(frozen=True)
class Clip:
    """A clip's sampled frames (PIL images) and their times in seconds."""

    name: str
    frames: list
    timestamps: list[float]
    decoded: int = 0  # frames decoded to get them

    def layout(self) -> str:
        """The clip's text in the prompt: ``mm:ss <|image|>`` per frame, separated by spaces."""
        return " ".join(f"{int(t // 60):02d}:{int(t % 60):02d} {IMAGE_PLACEHOLDER}" for t in self.timestamps)

    def most_tokens(self, config: VideoProcessorConfig) -> int:
        """The most prompt tokens the clip takes (its times' bytes, each frame's budget and its two markers)."""
        return len(self.layout().encode()) + len(self.frames) * (config.max_soft_tokens + 2)

    def images(self, config: VideoProcessorConfig) -> list[Frame]:
        return [Frame(frame, config.max_soft_tokens) for frame in self.frames]


def sample_indices(total: int, rate: float, num_frames: int, fps: float | None = None) -> list[int]:
    """The frames to take of ``total`` at ``rate`` per second: ``fps`` per second, or ``num_frames``
    evenly, never more than ``num_frames`` (nor ``total``): the reference's default sampling."""
    count = num_frames if fps is None else max(1, int(total / rate * fps))
    count = min(count, num_frames, total)
    return (np.arange(count, dtype=np.int64) * total // count).tolist()


def load_video(source, config: VideoProcessorConfig, fps: float | None = None) -> Clip:
    """A ``Clip`` from a file path, encoded bytes, a list of PIL images (a clip's frames at
    ``UNTIMED_FPS``) or a ``Clip``; ``fps`` (else the config's) samples at that rate instead of
    evenly."""
    fps = config.fps if fps is None else fps
    if fps is not None and not (isinstance(fps, (int, float)) and 0 < fps < float("inf")):
        raise VideoError(f"the video fps must be a number above 0, got {fps}")
    if isinstance(source, Clip):
        return source
    if hasattr(source, "getbands"):  # one PIL image
        raise VideoError("a video is a file, its bytes or a list of PIL frames, not one image; pass [frames]")
    if isinstance(source, (list, tuple)):
        return _given_frames(list(source), config, fps)
    name = "the video data" if isinstance(source, (bytes, bytearray)) else str(source)
    with _open(source, name) as container:
        return _decode(container, name, config, fps)


def _given_frames(frames: list, config: VideoProcessorConfig, fps: float | None) -> Clip:
    from PIL import Image

    if not frames:
        raise VideoError("a video given as frames has no frames")
    if not all(isinstance(f, Image.Image) for f in frames):
        raise VideoError("a video given as frames must be a list of PIL images")
    for frame in frames:
        if frame.width * frame.height > MAX_IMAGE_PIXELS:
            raise VideoError(
                f"the video's frames are {frame.width}x{frame.height} pixels, more than the {MAX_IMAGE_PIXELS} "
                "pixels accepted; scale them down first"
            )
    indices = sample_indices(len(frames), UNTIMED_FPS, config.num_frames, fps)
    return Clip("the video frames", [frames[i] for i in indices], [i / UNTIMED_FPS for i in indices])


def _open(source, name: str):
    try:
        import av
    except ImportError:
        raise VideoError("video input needs PyAV: pip install 'mlx-dgemma[video]'") from None
    try:
        return av.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else str(source))
    except FileNotFoundError:
        raise VideoError(f"video file {name} not found") from None
    except IsADirectoryError:
        raise VideoError(f"{name} is a folder, not a video file") from None
    except av.FFmpegError:
        raise VideoError(f"{name} is not a video FFmpeg can read (MP4, WebM, MKV, MOV, …)") from None


def _decode(container, name: str, config: VideoProcessorConfig, fps: float | None) -> Clip:
    import av

    if not container.streams.video:
        raise VideoError(f"{name} has no video frames")
    stream = container.streams.video[0]
    rate = float(stream.average_rate or stream.guessed_rate or 0)
    if stream.width * stream.height > MAX_IMAGE_PIXELS:
        raise VideoError(
            f"{name} is {stream.width}x{stream.height} pixels, more than the {MAX_IMAGE_PIXELS} "
            "pixels accepted per frame; scale it down first"
        )
    if stream.duration is not None and stream.time_base:
        seconds = float(stream.duration * stream.time_base)
    else:
        seconds = (container.duration or 0) / av.time_base
    if seconds > MAX_VIDEO_SECONDS:
        raise VideoError(
            f"{name} is {seconds:.1f} seconds long, more than the {MAX_VIDEO_SECONDS} seconds accepted; cut it first"
        )
    total = stream.frames or round(seconds * rate)
    if rate <= 0 or total <= 0:
        raise VideoError(f"{name} has no video frames")
    try:
        frames, times, decoded = _seek_frames(
            container, stream, sample_indices(total, rate, config.num_frames, fps), rate
        )
    except av.FFmpegError as e:
        raise VideoError(f"{name} cannot be decoded ({e.strerror or type(e).__name__})") from None
    if frames is None:
        raise VideoError(f"{name} has keyframes more than {MAX_DECODED_PER_FRAME} frames apart; re-encode it")
    if not frames:
        raise VideoError(f"{name} has no video frames")
    return Clip(name, frames, times, decoded)


def _seek_frames(container, stream, indices: list[int], rate: float):
    """The frames at ``indices`` (the i-th frame: the first whose time is at or past i / rate), their
    times (i / rate, as the reference stamps them) and how many frames were decoded; frames None when
    one took more than ``MAX_DECODED_PER_FRAME`` to reach."""
    base, start = float(stream.time_base), stream.start_time or 0
    frames, times, decoded, position, packets = [], [], 0, None, None
    for index in indices:
        if packets is None or index - position > SEEK_AHEAD_SECONDS * rate:
            container.seek(start + int(index / rate / base), stream=stream, backward=True)
            packets = container.decode(stream)
        for spent, frame in enumerate(packets):
            decoded += 1
            if spent >= MAX_DECODED_PER_FRAME:
                return None, times, decoded
            if frame.pts is None:
                continue
            position = round((frame.pts - start) * base * rate)
            if position >= index:
                frames.append(frame.to_image())
                times.append(index / rate)
                break
        else:  # the clip ends before its header said
            break
    return frames, times, decoded


def video_from_url(url: str, folder: str | Path | None, config: VideoProcessorConfig, fps=None) -> Clip:
    """An OpenAI-style ``video_url`` (``data:video/...;base64,...``, ``file://`` or a local path under
    ``folder``; None: no local paths) → a ``Clip``. A local path is refused with one message whatever
    the reason, as ``images.open_image_url`` refuses one."""
    if (data := data_url_payload(url, "video", "mp4", folder, VideoError)) is not None:
        return load_video(data, config, fps)
    refused = VideoError(f"{url[:80]!r} is not a video file that may be read here; send the video as a data URL")
    try:
        path = path_under(url.removeprefix("file://"), Path(folder))
        if not stat.S_ISREG(path.stat().st_mode):
            raise refused
    except (OSError, ValueError):
        raise refused from None
    return load_video(path, config, fps)


def place_videos(prompt, images: list, clips: list[Clip], config: VideoProcessorConfig, tokens=None, encode=None):
    """``prompt`` with each video placeholder replaced by its clip's frames laid out, and the images in
    the order their placeholders now come (each image's own, each clip's frames). Text has the
    placeholders' text; ids have ``tokens`` (the image and video token ids) and ``encode`` (text → ids)."""
    is_text = isinstance(prompt, str)
    image, video = (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER) if is_text else tokens
    pieces = re.split(f"({re.escape(image)}|{re.escape(video)})", prompt) if is_text else prompt
    if (placed := sum(piece == video for piece in pieces)) != len(clips):
        raise VideoError(
            f"the prompt has {placed} video placeholders for {len(clips)} videos; give one video per placeholder"
        )
    out, ordered, given, clips = [], [], iter(images), iter(clips)
    for piece in pieces:
        if piece == video:
            clip = next(clips)
            out += [clip.layout()] if is_text else encode(clip.layout())
            ordered += clip.images(config)
        else:
            out.append(piece)
            if piece == image and (own := next(given, None)) is not None:
                ordered.append(own)
    ordered += list(given)  # (more images than placeholders: refused when they are expanded)
    return ("".join(out) if is_text else out), ordered
