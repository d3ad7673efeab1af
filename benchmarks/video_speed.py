"""What a video costs before the language model sees it: a 30-second 720p clip (H.264, 30 fps, a keyframe
every 2 s; encoded here with PyAV) sampled to Gemma 4's 32 frames, each preprocessed at the video budget
of 70 soft tokens and run through a vision tower at the reference's Gemma 4 sizes (random weights).

    python benchmarks/video_speed.py [--seconds 30] [--frames 32] [--dtype bfloat16]

Prints the seconds of each step (best of ``--repeat``), and for comparison decoding the whole clip
frame by frame, as a reader without seeking does. The tower is timed on ``--tower-frames`` frames (a
frame's cost does not depend on the others: each is its own attention block) and scaled to the clip's.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import av
import numpy as np

from mlx_dgemma import fast_blas

fast_blas.load()  # (before mlx.core: MLX's CPU matmuls on OpenBLAS)
import mlx.core as mx  # noqa: E402

from mlx_dgemma.model.config import VisionConfig  # noqa: E402
from mlx_dgemma.model.images import ImageProcessorConfig, preprocess  # noqa: E402
from mlx_dgemma.model.video import VideoProcessorConfig, load_video  # noqa: E402
from mlx_dgemma.model.vision import MultimodalEmbedder, VisionModel  # noqa: E402

TEXT_WIDTH = 2816  # the released model's hidden size (the embedder's output width)


def encode_clip(path: Path, seconds: int, width: int = 1280, height: int = 720, fps: int = 30) -> Path:
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 40, (height, width, 3), dtype=np.uint8)
    y, x = np.mgrid[0:height, 0:width]
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fps, options={"g": str(2 * fps), "preset": "ultrafast"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(seconds * fps):
            pixels = (np.stack([(x + 4 * i) % 256, (y + 2 * i) % 256, (x + y + i) % 256], -1) + noise).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def best(function, repeat: int):
    times, result = [], None
    for _ in range(repeat):
        tic = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - tic)
    return min(times), result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=int, default=30)
    parser.add_argument("--frames", type=int, default=32)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")  # (bf16 is slow on CPU)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--tower-frames", type=int, default=4, help="frames timed through the tower (all: 0)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        tic = time.perf_counter()
        path = encode_clip(Path(folder) / "clip.mp4", args.seconds)
        print(
            f"clip: {args.seconds} s, 1280x720, 30 fps, {path.stat().st_size / 1e6:.1f} MB (made in {time.perf_counter() - tic:.1f} s)"
        )
        config = VideoProcessorConfig(num_frames=args.frames)
        seconds, clip = best(lambda: load_video(path, config), args.repeat)
        print(f"decode, {len(clip.frames)} frames by seeking: {seconds:.3f} s ({clip.decoded} frames decoded)")

        def whole():
            with av.open(str(path)) as container:
                return sum(1 for _ in container.decode(video=0))

        seconds, count = best(whole, 1)
        print(f"decode, the whole clip ({count} frames, for comparison): {seconds:.3f} s")

        image_config = ImageProcessorConfig()
        seconds, inputs = best(lambda: preprocess(clip.images(config), image_config), args.repeat)
        tokens = inputs["num_soft_tokens_per_image"]
        print(f"preprocess {len(tokens)} frames ({tokens[0]} soft tokens each): {seconds:.3f} s")

    vision = VisionConfig()
    dtype = getattr(mx, args.dtype)
    tower, embedder = VisionModel(vision), MultimodalEmbedder(vision.hidden_size, TEXT_WIDTH, vision.rms_norm_eps)
    tower.set_dtype(dtype)
    embedder.set_dtype(dtype)
    timed = args.tower_frames or len(tokens)
    pixels, positions = mx.array(inputs["pixel_values"][:timed]), np.asarray(inputs["image_position_ids"][:timed])

    def encode():
        features = []
        for image, where in zip(pixels, positions):
            real = np.flatnonzero((where != -1).any(axis=-1))
            features.append(tower(image[mx.array(real)].astype(dtype), where[real], vision.pooling_kernel_size))
        out = embedder(mx.concatenate(features))
        mx.eval(out)
        return out

    seconds, features = best(encode, args.repeat)
    print(
        f"vision tower ({vision.num_hidden_layers} layers, width {vision.hidden_size}, {args.dtype}, "
        f"mlx {mx.default_device()}): {seconds:.3f} s for {timed} frames ({features.shape[0]} soft tokens), "
        f"{seconds / timed:.3f} s a frame: {seconds / timed * len(tokens):.1f} s for the clip's {len(tokens)}"
    )


if __name__ == "__main__":
    main()
