"""Images → what the vision tower takes, as the reference's Gemma 4 image processor (its Pillow
backend) makes them: resized with the aspect ratio kept to at most ``max_soft_tokens · k²`` patches
whose sides are multiples of ``k · patch_size`` (k = pooling kernel), pixels scaled to [0, 1], cut
into patches (row by row, each patch's pixels row-major with the channels last), padded to the same
length with (-1, -1) positions. Plus the prompt side: each image placeholder becomes
``<boi> + <image>·n + <eoi>`` (n = the image's soft tokens), and sources (paths, PIL images, an
OpenAI ``image_url``) → PIL images, with one-line errors for files that are not images or too large.

    inputs = preprocess(["cat.png"], ImageProcessorConfig.from_folder(checkpoint))
    model.encode(ids, cache, pixel_values=inputs["pixel_values"], image_position_ids=inputs["image_position_ids"])
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import os
import stat
import warnings
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from ..errors import ImageError

IMAGE_PLACEHOLDER = "<|image|>"  # what chat templates write for an image part
SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)  # the reference processor's allowed budgets
MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # larger images are refused (decoding alone would take GBs)
MAX_IMAGE_FILE_BYTES = 64 << 20  # a local file an image_url names is read whole, up to this size


def processor_settings(folder: str | Path, places: tuple, error: type[ValueError]) -> dict | None:
    """The first non-empty settings among ``places`` ((file, key or None: the whole file)) in a
    checkpoint's ``folder``; a file that is not JSON is an ``error`` naming it."""
    for name, key in places:
        path = Path(folder) / name
        if path.exists():
            try:
                raw = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise error(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
            if raw := (raw.get(key) if key else raw):
                return raw
    return None


@dataclass
class ImageProcessorConfig:
    """The checkpoint's image processor settings (preprocessor_config.json, or processor_config.json's
    ``image_processor``); the defaults are the reference's."""

    patch_size: int = 16
    max_soft_tokens: int = 280
    pooling_kernel_size: int = 3
    do_resize: bool = True
    resample: int = 3  # PIL.Image.BICUBIC
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = False
    image_mean: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    image_std: list[float] = field(default_factory=lambda: [1.0, 1.0, 1.0])
    do_convert_rgb: bool = True

    def __post_init__(self):
        if self.max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
            raise ImageError(f"max_soft_tokens must be one of {SUPPORTED_SOFT_TOKENS}, got {self.max_soft_tokens}")

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size**2

    @classmethod
    def from_dict(cls, raw: dict) -> "ImageProcessorConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})

    @classmethod
    def from_folder(cls, folder: str | Path, vision_config=None) -> "ImageProcessorConfig":
        """From the files the reference saves; without them, the defaults at the vision tower's
        patch and pooling sizes."""
        places = (("preprocessor_config.json", None), ("processor_config.json", "image_processor"))
        if raw := processor_settings(folder, places, ImageError):
            return cls.from_dict(raw)
        if vision_config is None:
            return cls()
        return cls(patch_size=vision_config.patch_size, pooling_kernel_size=vision_config.pooling_kernel_size)


def target_size(height: int, width: int, config: ImageProcessorConfig) -> tuple[int, int]:
    """The largest size with the aspect ratio kept, at most ``max_patches`` patches, and sides that are
    multiples of ``k · patch_size``; a very thin image gets one row (or column) of squares."""
    patch, k, max_patches = config.patch_size, config.pooling_kernel_size, config.max_patches
    factor = math.sqrt(max_patches * patch**2 / (height * width))
    side = k * patch
    h = int(math.floor(factor * height / side)) * side
    w = int(math.floor(factor * width / side)) * side
    longest = (max_patches // k**2) * side
    if h == 0 and w == 0:
        raise ImageError(f"a {width}x{height} image cannot be resized to whole {side}-pixel squares")
    if h == 0:
        h, w = side, min(int(math.floor(width / height)) * side, longest)
    elif w == 0:
        w, h = side, min(int(math.floor(height / width)) * side, longest)
    return h, w


def to_rgb(image):
    """RGB as the reference converts a PIL image: transparent pixels over white."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)), image).convert("RGB")
    return image.convert("RGB")


def patches_of(image, config: ImageProcessorConfig) -> tuple[np.ndarray, np.ndarray]:
    """One PIL image → its patches [P, p·p·3] (float32) and their (x, y) positions [P, 2]."""
    if config.do_convert_rgb:
        image = to_rgb(image)
    if config.do_resize:
        h, w = target_size(image.height, image.width, config)
        if (h, w) != (image.height, image.width):
            image = image.resize((w, h), resample=config.resample)
    pixels = np.array(image)
    if pixels.ndim == 2:
        pixels = pixels[..., None]
    if config.do_rescale:
        pixels = (pixels.astype(np.float64) * config.rescale_factor).astype(np.float32)
    if config.do_normalize:
        mean, std = np.array(config.image_mean), np.array(config.image_std)
        pixels = ((pixels - mean) / std).astype(np.float32)
    p = config.patch_size
    rows, cols = pixels.shape[0] // p, pixels.shape[1] // p
    patches = pixels[: rows * p, : cols * p].reshape(rows, p, cols, p, -1).transpose(0, 2, 1, 3, 4)
    x, y = np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy")
    return patches.reshape(rows * cols, -1), np.stack([x, y], axis=-1).reshape(-1, 2)


@dataclass(frozen=True)
class Frame:
    """A video's frame: an image preprocessed at the video's own soft-token budget (video.py)."""

    image: object  # a PIL image
    max_soft_tokens: int


def preprocess(images, config: ImageProcessorConfig) -> dict:
    """Images (paths, PIL images, ``Frame``s) → ``pixel_values`` [N, max_patches, p·p·3] float32,
    ``image_position_ids`` [N, max_patches, 2] int64 ((-1, -1) pads) and
    ``num_soft_tokens_per_image``: what the reference's processor returns (padded to the largest
    budget among them when frames come with images)."""
    if not isinstance(images, (list, tuple)):
        images = [images]
    pixel_values, positions, soft_tokens = [], [], []
    budgets = [replace(config, max_soft_tokens=s.max_soft_tokens) if isinstance(s, Frame) else config for s in images]
    length = max(budget.max_patches for budget in budgets)  # (the reference pads to its one budget's)
    for source, budget in zip(images, budgets):
        image = source.image if isinstance(source, Frame) else source
        patches, where = patches_of(load_image(image), budget)
        soft_tokens.append(patches.shape[0] // config.pooling_kernel_size**2)
        pad = length - patches.shape[0]
        pixel_values.append(np.pad(patches, [(0, pad), (0, 0)]))
        positions.append(np.pad(where, [(0, pad), (0, 0)], constant_values=-1))
    return {
        "pixel_values": np.stack(pixel_values),
        "image_position_ids": np.stack(positions).astype(np.int64),
        "num_soft_tokens_per_image": soft_tokens,
    }


def expand_image_tokens(
    ids: list[int], soft_tokens: list[int], image_token_id: int, boi_token_id: int, eoi_token_id: int
) -> list[int]:
    """Each image placeholder (the image token, as the chat template writes it) → ``<boi>``, the
    image's soft tokens, ``<eoi>``, as the reference's processor expands them."""
    placeholders = sum(1 for i in ids if i == image_token_id)
    if placeholders != len(soft_tokens):
        raise ImageError(
            f"the prompt has {placeholders} image placeholders for {len(soft_tokens)} images; "
            "give one image per placeholder"
        )
    out: list[int] = []
    counts = iter(soft_tokens)
    for token in ids:
        out += [boi_token_id] + [image_token_id] * next(counts) + [eoi_token_id] if token == image_token_id else [token]
    return out


def load_image(source):
    """A PIL image from a PIL image, a file path or encoded bytes; files are decoded as the reference's
    ``load_image`` does (EXIF orientation applied, RGB)."""
    from PIL import Image

    if isinstance(source, Image.Image):
        _check_size(source, "the image")
        return source
    return decode_image(open_image(source))


def open_image(source):
    """A file path or encoded bytes opened with only the image's header read, its size checked against
    ``MAX_IMAGE_PIXELS`` before any pixel is decoded."""
    from PIL import Image, UnidentifiedImageError

    name = _name(source)
    try:
        with warnings.catch_warnings():  # Pillow's own bound is above ours: its warning is ours to give
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source)
    except FileNotFoundError:
        raise ImageError(f"image file {name} not found") from None
    except IsADirectoryError:
        raise ImageError(f"{name} is a folder, not an image file") from None
    except UnidentifiedImageError:
        raise ImageError(f"{name} is not an image Pillow can read (PNG, JPEG, GIF, WebP, …)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError(f"{name} is over the {MAX_IMAGE_PIXELS} pixels accepted; scale it down first") from None
    except OSError as e:
        raise ImageError(f"cannot read image {name}: {e.strerror or e}") from None
    except (
        Exception
    ):  # damaged bytes: Pillow's plugins raise ValueError (a text chunk past its bound), struct.error, ...
        raise ImageError(f"{name} is not an image Pillow can read (PNG, JPEG, GIF, WebP, …)") from None
    _check_size(image, name)
    return image


def decode_image(image):
    """An image from ``open_image`` decoded: EXIF orientation applied, RGB."""
    from PIL import ImageOps

    name = _name(getattr(image, "filename", None) or b"")
    try:
        image.load()
        return ImageOps.exif_transpose(image).convert("RGB")  # (EXIF is read from the same hostile bytes)
    except OSError as e:
        raise ImageError(f"cannot read image {name}: {e.strerror or e}") from None
    except Exception:  # as in open_image: whatever a plugin raises on damaged bytes
        raise ImageError(f"{name} is not an image Pillow can read (PNG, JPEG, GIF, WebP, …)") from None


def _name(source) -> str:
    return "the image data" if isinstance(source, (bytes, bytearray)) else str(source)


def _check_size(image, name: str) -> None:
    if image.width * image.height > MAX_IMAGE_PIXELS:
        raise ImageError(
            f"{name} is {image.width}x{image.height} pixels, more than the "
            f"{MAX_IMAGE_PIXELS} pixels accepted; scale it down first"
        )


def data_url_payload(url: str, kind: str, example: str, folder, error: type[ValueError]) -> bytes | None:
    """The bytes of a ``data:KIND/...;base64,`` URL; None for a local path to read under ``folder``. A
    remote URL, a local path where ``folder`` is None, or a damaged data URL is an ``error`` saying so."""
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if not header.startswith(f"data:{kind}/") or ";base64" not in header:
            raise error(
                f"{'an' if kind == 'image' else 'a'} {kind} data URL must look like data:{kind}/{example};base64,..."
            )
        try:
            return base64.b64decode(payload, validate=True)
        except binascii.Error:
            raise error(f"the {kind} data URL's base64 payload is damaged") from None
    if url.startswith(("http://", "https://")):
        raise error(f"remote {kind} URLs are not fetched ({url[:60]}); send the {kind} as a data URL")
    if folder is None:
        raise error(f"local {kind} paths are not read here; send the {kind} as a data URL")
    return None


def image_from_url(url: str, folder: str | Path | None = "/"):
    """An OpenAI chat ``image_url`` (``data:image/...;base64,...``, ``file://`` or a local path) → a PIL
    image. Remote (http) URLs are refused: a local runtime does not fetch them. Local paths are read
    from regular files under ``folder`` only (the default, ``/``: any file on this machine; None: no
    local paths), as ``open_image_url`` says."""
    return decode_image(open_image_url(url, folder))


def open_image_url(url: str, folder: str | Path | None = "/"):
    """``image_from_url``'s image with only its header read (``open_image``). A local path is refused,
    with one message whatever the reason (missing, a folder, a FIFO or device, outside ``folder``, not
    an image), so that refusals do not map the filesystem; a FIFO is never waited on."""
    if (data := data_url_payload(url, "image", "png", folder, ImageError)) is not None:
        return open_image(data)
    refused = ImageError(f"{url[:80]!r} is not an image file that may be read here; send the image as a data URL")
    try:
        data = _read_under(url.removeprefix("file://"), Path(folder))
        return open_image(data)
    except (OSError, ValueError):  # (ImageError is a ValueError; so is a NUL byte in the path)
        raise refused from None


def path_under(path: str, folder: Path) -> Path:
    """The file ``path`` names (relative paths are under ``folder``) once symlinks and ``..`` are
    resolved, if it lies under ``folder``; an ``OSError`` or ``ValueError`` otherwise."""
    root = folder.resolve(strict=True)
    target = (root / path).resolve(strict=True)
    if target != root and root not in target.parents:
        raise PermissionError(f"{target} is outside {root}")
    return target


def _read_under(path: str, folder: Path) -> bytes:
    """The bytes of the regular file ``path_under`` finds; an ``OSError`` or ``ValueError`` otherwise."""
    target = path_under(path, folder)
    fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK)  # (a FIFO opens at once; it is refused next)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PermissionError(f"{target} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read(MAX_IMAGE_FILE_BYTES + 1)
        if len(data) > MAX_IMAGE_FILE_BYTES:
            raise PermissionError(f"{target} is over {MAX_IMAGE_FILE_BYTES} bytes")
        return data
    finally:
        os.close(fd)


def image_inputs(model, ids: list[int], images) -> tuple[list[int], dict]:
    """A prompt's ids with its image placeholders expanded, and the keyword arguments of
    ``model.encode`` that carry the images."""
    from .vision import check_takes_images

    check_takes_images(model)
    cfg = model.config
    processor = getattr(model, "image_processor", None) or ImageProcessorConfig.from_dict(
        {"patch_size": cfg.vision_config.patch_size, "pooling_kernel_size": cfg.vision_config.pooling_kernel_size}
    )
    inputs = preprocess(images, processor)
    ids = expand_image_tokens(
        ids, inputs["num_soft_tokens_per_image"], cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id
    )
    return ids, {"pixel_values": inputs["pixel_values"], "image_position_ids": inputs["image_position_ids"]}


def images_after(ids: list[int], vision_inputs: dict, start: int, image_token_id: int | None) -> dict:
    """The vision inputs of the images whose tokens come at or after ``start`` (a cached prefix holds
    whole images: it ends before a prompt's last token, and images end with <eoi>)."""
    if not vision_inputs:
        return {}
    done = sum(
        token == image_token_id and (i == 0 or ids[i - 1] != image_token_id) for i, token in enumerate(ids[:start])
    )
    if done == len(vision_inputs["pixel_values"]):
        return {}
    return {name: value[done:] for name, value in vision_inputs.items()}


@dataclass(frozen=True)
class ImageInputs:
    """Images already preprocessed for a prompt whose ids already expand their placeholders
    (``image_inputs``' two results): what a server that checks a prompt's length before generating
    passes as ``GenerationArgs.images``."""

    vision_inputs: dict  # as model.encode takes them
