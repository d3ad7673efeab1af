"""Checkpoint files → a DiffusionGemma model: local folder or Hub id, one file or shards, HF or
mlx-vlm / mlx-community layout, quantized or not. Loading is strict: every weight the model needs
must be there with its shape, and nothing else may be."""

from __future__ import annotations

import errno
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .errors import CheckpointError
from .model.config import ConfigError, GenerationConfig, ModelConfig
from .model.diffusion_gemma import DiffusionGemma
from .model.images import ImageProcessorConfig
from .model.video import VideoProcessorConfig
from .model.vision import add_vision_modules, has_vision
from .safetensors_io import read_header

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

WEIGHTS_INDEX = "model.safetensors.index.json"
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt"]

# The vision tower's and the multimodal embedder's keys, loaded when the config has a vision tower.
VISION_KEY = re.compile(r"^model\.encoder\.(vision_tower|embed_vision)\.")
_UNUSED = re.compile(r"^lm_head\.|rotary_emb")
_CLIP_BOUND = re.compile(r"\.(input|output)_(min|max)$")
# Keys never used: rotary buffers and the tied head.
# The encoder's copies of tied weights; only its layer scalars are its own.
_ENCODER_TIED = re.compile(r"^model\.encoder\.language_model\.(?!layers\.\d+\.layer_scalar$)")
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$")


def checkpoint_folder(path_or_repo: str | os.PathLike, revision: str | None = None) -> Path:
    """A local checkpoint folder, or a Hub repo id fetched (or found in the cache) by huggingface_hub,
    at ``revision`` (a branch, tag or commit; None: the default branch)."""
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        if revision is not None:
            raise CheckpointError(f"revision {revision!r} is for a Hub id; {str(path_or_repo)!r} is a local folder")
        return path
    text = str(path_or_repo)
    try:  # a path through a link that leads nowhere: say so, rather than look it up on the Hub
        path.resolve(strict=True)
    except RuntimeError:  # Python < 3.13 reports a loop this way
        raise CheckpointError(
            f"model path {text!r} runs into a symbolic link loop; point it at a checkpoint folder"
        ) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(
                f"model path {text!r} runs into a symbolic link loop; point it at a checkpoint folder"
            ) from None
        if path.is_symlink():
            raise CheckpointError(
                f"model path {text!r} is a broken symbolic link (to {os.readlink(path)!r}); "
                "point it at a checkpoint folder"
            ) from None
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise CheckpointError(f"model path {text!r} is not a folder; pass a checkpoint folder or a Hub id (org/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(text, revision=revision, allow_patterns=HUB_PATTERNS))
    except LocalEntryNotFoundError:
        raise CheckpointError(
            f"{text!r} is not in the local Hugging Face cache and the Hub cannot be reached (HF_HUB_OFFLINE?)"
        ) from None
    except HfHubHTTPError as e:
        raise CheckpointError(f"cannot fetch {text!r} from the Hub: {str(e).splitlines()[0]}") from None


def weight_files(folder: Path) -> list[Path]:
    index = folder / WEIGHTS_INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index} is not a valid safetensors index (needs a 'weight_map')") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(
                f"{index}: 'weight_map' must map each tensor name to a shard file name; re-export the checkpoint"
            )
        names = sorted(set(weight_map.values()))
        if bad := [n for n in names if Path(n).name != n]:
            raise CheckpointError(f"{index} names shard {bad[0]!r}, which is not a file name in {folder}")
        files = [folder / n for n in names]
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{index.name} names shard {f.name}, which is missing from {folder}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {folder}")
    return files


def read_safetensors(path: Path) -> dict[str, mx.array]:
    read_header(path)  # MLX's own reader takes negative dimensions and words its errors past one line
    try:
        return mx.load(str(path))
    except Exception as e:  # MLX raises a bare ValueError/RuntimeError on a damaged file
        reason = str(e).split("\n")[0][:120] if str(e) else type(e).__name__
        raise CheckpointError(f"{path.name} is not a readable safetensors file ({reason}); re-download it") from None


@dataclass(frozen=True)
class ExpertSlice:
    """One expert's projection in the per-expert layout (``<prefix>.<expert>.<projection>.<part>``)."""

    prefix: str  # model.decoder.layers.N.experts
    expert: int
    projection: str  # gate_proj | up_proj | down_proj
    part: str  # weight | scales | biases

    @property
    def target(self) -> str:
        """The stacked parameter this slice is part of (gate and up fuse into gate_up_proj)."""
        fused = "down_proj" if self.projection == "down_proj" else "gate_up_proj"
        return f"{self.prefix}.{fused}.{self.part}"


def map_key(key: str) -> str | ExpertSlice | None:
    """The model parameter a checkpoint key holds: its name, an ``ExpertSlice`` to be stacked with
    the other experts, or None for keys the model does not use (vision keys keep their names)."""
    if _UNUSED.search(key):
        return None
    if VISION_KEY.match(key):
        return key
    if _ENCODER_TIED.match(key):
        return None
    if m := _PER_EXPERT.match(key):
        return ExpertSlice(m[1], int(m[2]), m[3], m[4])
    if key.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        return key + ".weight"  # HF stores the 3-D expert tensors without a ".weight" suffix
    return key


def stack_experts(slices: Mapping[ExpertSlice, mx.array], num_experts: int, start: int = 0) -> mx.array:
    """The slices of one stacked parameter → [E, out, in]; gate and up rows are concatenated.
    ``start``: the slices are experts ``start .. start + num_experts - 1`` (a rank's share)."""
    by_projection: dict[str, dict[int, mx.array]] = {}
    for s, value in slices.items():
        by_projection.setdefault(s.projection, {})[s.expert] = value
    first = next(iter(slices))
    stacked: dict[str, mx.array] = {}
    for projection, experts in sorted(by_projection.items()):
        name = f"{first.prefix}.{{}}.{projection}.{first.part}"
        wanted = range(start, start + num_experts)
        if missing := sorted(set(wanted) - set(experts)):
            raise CheckpointError(f"missing weight {name.format(missing[0])}")
        if extra := sorted(set(experts) - set(wanted)):
            raise CheckpointError(f"unexpected weight {name.format(extra[0])}: the config has {num_experts} experts")
        stacked[projection] = mx.stack([experts[e] for e in wanted])
    if "down_proj" in stacked:
        return stacked["down_proj"]
    if set(stacked) != {"gate_proj", "up_proj"}:
        raise CheckpointError(
            f"{first.prefix} has {sorted(stacked)[0]} but not its pair; expected gate_proj and up_proj"
        )
    return mx.concatenate([stacked["gate_proj"], stacked["up_proj"]], axis=1)


def sanitize(weights: dict[str, mx.array], num_experts: int) -> dict[str, mx.array]:
    """Map HF and mlx-vlm/mlx-community key layouts onto the model's parameter names."""
    out: dict[str, mx.array] = {}
    per_expert: dict[str, dict[ExpertSlice, mx.array]] = {}
    for key, value in weights.items():
        target = map_key(key)
        if isinstance(target, ExpertSlice):
            per_expert.setdefault(target.target, {})[target] = value
        elif target is not None:
            out[target] = value
    for target, slices in per_expert.items():
        out[target] = stack_experts(slices, num_experts)
    return out


def _quantize(model: nn.Module, quantization: dict, weights: dict[str, mx.array]) -> None:
    """Apply mlx-lm's quantization config: defaults plus per-module overrides keyed by module path."""

    def predicate(path: str, module: nn.Module):
        if path in quantization:
            return quantization[path]
        return hasattr(module, "to_quantized") and f"{path}.scales" in weights

    nn.quantize(
        model,
        group_size=quantization.get("group_size", 64),
        bits=quantization.get("bits", 4),
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )


def check_weights(model: nn.Module, weights: dict[str, mx.array]) -> None:
    """Every parameter there, nothing else, each with its shape and a dtype of its kind: floating point
    where the model holds floats, exactly the packed type where it holds quantized integers."""
    expected = dict(tree_flatten(model.parameters()))
    for key in expected:
        if key not in weights:
            raise CheckpointError(f"missing weight {key}")
    for key, value in weights.items():
        if key not in expected:
            raise CheckpointError(
                f"unexpected weight {key} (shape {tuple(value.shape)}): not part of a DiffusionGemma text model"
            )
        if tuple(value.shape) != tuple(expected[key].shape):
            raise CheckpointError(
                f"weight {key} has shape {tuple(value.shape)}, the config implies {tuple(expected[key].shape)}"
            )
        want = expected[key].dtype
        floating = mx.issubdtype(want, mx.floating)
        if (mx.issubdtype(value.dtype, mx.floating) != floating) or (not floating and value.dtype != want):
            kind = "a floating-point type (float32, float16 or bfloat16)" if floating else _dtype_name(want)
            raise CheckpointError(
                f"weight {key} has dtype {_dtype_name(value.dtype)}, expected {kind}; re-export the checkpoint"
            )


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def read_config(folder: Path) -> ModelConfig:
    try:
        return ModelConfig.from_file(folder / "config.json")
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def load_model(folder: Path) -> DiffusionGemma:
    config = read_config(folder)
    weights: dict[str, mx.array] = {}
    for f in weight_files(folder):
        weights.update(read_safetensors(f))
    return build_model(DiffusionGemma(config), sanitize(weights, config.num_experts))


def build_model(model: DiffusionGemma, weights: dict[str, mx.array]) -> DiffusionGemma:
    """``weights`` (by model name) into ``model``: with the vision modules when they are there,
    quantized as the config says, checked strictly, evaluated."""
    config = model.config
    if config.vision_config is not None and any(VISION_KEY.match(k) for k in weights):
        add_vision_modules(model)
        if not config.vision_config.use_clipped_linears:  # clipping bounds of unclipped linears are unused
            weights = {k: v for k, v in weights.items() if not (VISION_KEY.match(k) and _CLIP_BOUND.search(k))}
    else:  # a text-only checkpoint (or config): the vision keys, if any, are not used
        weights = {k: v for k, v in weights.items() if not VISION_KEY.match(k)}
    if config.quantization:
        _quantize(model, config.quantization, weights)
    check_weights(model, weights)
    model.update(tree_unflatten(list(weights.items())))
    model.eval()
    mx.eval(model.parameters())
    return model


def load(
    path_or_repo: str | os.PathLike[str],
    adapter_path: str | os.PathLike[str] | None = None,
    revision: str | None = None,
) -> tuple[DiffusionGemma, Tokenizer]:
    """``model, tokenizer = load(path)`` for a local folder or a Hugging Face Hub id (at ``revision``: a
    branch, tag or commit, to pin a snapshot); ``adapter_path``: a fine-tuning run's adapter folder
    (``python -m mlx_dgemma.lora``), applied to the model."""
    from .tokenizer import load_tokenizer

    folder = checkpoint_folder(path_or_repo, revision)
    if adapter_path is not None:
        from .tuner.adapters import load_adapters, mlx_lm_tuner

        mlx_lm_tuner()  # the train extra, before the model loads
    model = load_model(folder)
    if adapter_path is not None:
        load_adapters(model, adapter_path)
        model.eval()
    try:
        model.generation_config = GenerationConfig.from_folder(folder, model.config)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    if has_vision(model):
        model.image_processor = ImageProcessorConfig.from_folder(folder, model.config.vision_config)
        model.video_processor = VideoProcessorConfig.from_folder(folder)
    return model, load_tokenizer(folder, model.config)
