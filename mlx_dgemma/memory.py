"""Whether a checkpoint fits the device, decided before any weight is read: its weights (from the
safetensors headers; a sharded run counts one rank's share of the experts), the KV cache at the
requested context (at the KV bits asked for) and a canvas's activations, against what the device can give: on Metal its
recommended working set, on CUDA its free memory, elsewhere the available memory (/proc/meminfo's
MemAvailable). ``MLX_DGEMMA_DEVICE_MEMORY`` (for example ``16GB``) sets the device's memory instead."""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from .convert.quantize import GROUP_SIZES, Quantization
from .convert.report import format_size
from .distributed import STACKED_EXPERTS, expert_range
from .errors import CheckpointError, ConfigError, ConversionError, MemoryCheckError
from .loader import VISION_KEY, ExpertSlice, checkpoint_folder, map_key, read_config, weight_files
from .model.config import GenerationConfig, ModelConfig
from .model.diffusion_gemma import ATTENTION_SCORES_ELEMENTS
from .options import KV_BITS, KV_GROUP_SIZE, PREFILL_STEP_SIZE
from .safetensors_io import TensorInfo, read_header
from .validate import shown

DEVICE_MEMORY_ENV = "MLX_DGEMMA_DEVICE_MEMORY"
IGNORE_FLAG = "--ignore-memory-check"
KV_FLAG = "--kv-bits"
# A denoising step holds a canvas's [positions, vocabulary] float32 logits about four times over (the
# logits, their soft-capped and tempered copies, the self-conditioning probabilities): measured 1.1 GB
# above the weights for a 256-position canvas of the released 262144-token vocabulary.
LOGIT_COPIES = 4
KV_CHUNK = 256  # positions a layer's cache grows by (cache.LayerCache.step)
MEMORY_RECIPES = ("mixed-32gb", "mixed-24gb", "mixed-16gb")  # largest first: the best one that fits is named
MAX_SIZE = 2.0**63  # bytes: a size past it is a typo, not a device
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


@dataclass(frozen=True)
class MemoryNeed:
    weights: int
    kv_cache: int
    activations: int
    context: int  # tokens the KV cache is counted for
    canvas: int
    kv_bits: int | None = None
    attention: int = 0  # a block of attention scores: never alive with the canvas's logits (activations)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + max(self.activations, self.attention)

    def describe(self) -> str:
        kv = f" at {self.kv_bits} bits" if self.kv_bits else ""
        what = f"a {self.canvas}-position canvas" if self.attention <= self.activations else "attention"
        return (
            f"{format_size(self.total)} ({format_size(self.weights)} of weights, {format_size(self.kv_cache)} of KV "
            f"cache for {self.context} tokens{kv}, {format_size(max(self.activations, self.attention))} for "
            f"{what})"
        )


def parse_size(text: str, name: str = DEVICE_MEMORY_ENV) -> int:
    """``16GB``, ``24 GiB``, ``512MB`` or a number of bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    size = float(m[1]) * _UNITS[(m[2] or "").upper()] if m else 0.0  # (400 nines are inf)
    if not 1 <= size < MAX_SIZE:
        raise MemoryCheckError(f"{name}={shown(text)} is not a memory size; write it like 16GB or 24GiB")
    return int(size)


def device_memory() -> tuple[int, str] | None:
    """What the device can give a model, and where that figure comes from (None: unknown)."""
    if raw := os.environ.get(DEVICE_MEMORY_ENV):
        return parse_size(raw), DEVICE_MEMORY_ENV
    if mx.metal.is_available():
        return int(mx.device_info()["max_recommended_working_set_size"]), "the GPU's recommended working set"
    if mx.cuda.is_available() and mx.default_device() == mx.gpu and (free := mx.device_info().get("free_memory")):
        return int(free), "the GPU's free memory"
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    if m := re.search(r"^MemAvailable:\s+(\d+) kB", meminfo, re.MULTILINE):
        return int(m[1]) * 1024, "available memory"
    return None


def _tensors(folder: Path) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for f in weight_files(folder):
        tensors.update(read_header(f))
    return tensors


def weight_bytes(tensors: dict[str, TensorInfo], config: ModelConfig, ranks: int = 1) -> int:
    """The bytes the loader keeps of ``tensors``: every tensor the model uses, of the experts one rank's share."""
    share = expert_range(config.num_experts, 0, ranks)[1]  # rank 0 holds the most: experts [0, share)
    total = 0
    for key, info in tensors.items():
        target = map_key(key)
        if target is None or (VISION_KEY.match(key) and config.vision_config is None):
            continue
        if isinstance(target, ExpertSlice):
            total += info.nbytes if target.expert < share else 0
        elif STACKED_EXPERTS.search(target):
            total += info.nbytes * share // config.num_experts
        else:
            total += info.nbytes
    return total


def _activation_itemsize(tensors: dict[str, TensorInfo]) -> int:
    """The activations' bytes per element: the embedding's dtype (its scales' when quantized)."""
    embedding = {map_key(k): info for k, info in tensors.items() if ".embed_tokens." in k and "decoder" in k}
    for name in ("model.decoder.embed_tokens.scales", "model.decoder.embed_tokens.weight"):
        if (info := embedding.get(name)) is not None and mx.issubdtype(info.dtype, mx.floating):
            return info.dtype.size
    return 4


def kv_cache_bytes(
    config: ModelConfig, context: int, itemsize: int, kv_bits: int | None = None, group_size: int = KV_GROUP_SIZE
) -> int:
    """The encoder's cache at ``context`` tokens (a sliding layer keeps its window and a canvas, in
    whole chunks) and the canvas view's copy of it with room for a canvas. Quantized (cache.py), the
    view keeps the prefix as stored and only its canvas room is a copy; a forward reads one layer at
    a time dequantized, then joined to its room: twice the largest layer's K/V in ``itemsize`` more."""
    total, largest = 0, 0
    for layer in range(config.num_hidden_layers):
        positions = context
        if config.is_sliding(layer):
            positions = min(context, config.sliding_window - 1 + config.canvas_length + KV_CHUNK)
        elements = 2 * config.layer_kv_heads(layer) * config.layer_head_dim(layer)  # K and V of a position
        cached = -(-positions // KV_CHUNK) * KV_CHUNK
        if kv_bits is None:
            total += (cached + positions + config.canvas_length) * elements * itemsize
            continue
        stored = elements * kv_bits // 8 + elements // group_size * 2 * itemsize  # values, scales and biases
        total += cached * stored + config.canvas_length * elements * itemsize
        largest = max(largest, 2 * (positions + config.canvas_length) * elements * itemsize)
    return total + largest


def canvas_bytes(config: ModelConfig) -> int:
    return LOGIT_COPIES * config.canvas_length * config.vocab_size * 4


def attention_bytes(config: ModelConfig, context: int, chunk: int = PREFILL_STEP_SIZE) -> int:
    """A prefill chunk's attention scores over ``context`` keys and their softmax, float32, in blocks
    of at most ``model.ATTENTION_SCORES_ELEMENTS`` (a canvas's queries are fewer than a chunk's), and
    the chunk's hidden states, queries, keys and values around them."""
    chunk = min(chunk, context)
    width = max(config.layer_head_dim(i) for i in range(config.num_hidden_layers))
    around = chunk * ((config.num_attention_heads + 2 * config.num_key_value_heads) * width + 4 * config.hidden_size)
    return 4 * (2 * min(config.num_attention_heads * chunk * context, ATTENTION_SCORES_ELEMENTS) + around)


def memory_need(
    config: ModelConfig, tensors: dict[str, TensorInfo], context: int, ranks: int = 1, kv_bits: int | None = None
) -> MemoryNeed:
    context = min(context, config.max_position_embeddings)
    kv = kv_cache_bytes(config, context, _activation_itemsize(tensors), kv_bits)
    return MemoryNeed(
        weight_bytes(tensors, config, ranks),
        kv,
        canvas_bytes(config),
        context,
        config.canvas_length,
        kv_bits,
        attention_bytes(config, context),
    )


def largest_context(
    config: ModelConfig, weights: int, itemsize: int, available: int, kv_bits: int | None = None, step: int = 1024
) -> int:
    """The most tokens of context (a multiple of ``step``, up to the model's) that ``weights`` bytes of
    weights, their KV cache at ``kv_bits`` and the activations fit in ``available`` bytes; 0 if none."""

    def fits(context: int) -> bool:
        need = kv_cache_bytes(config, context, itemsize, kv_bits) + max(
            canvas_bytes(config), attention_bytes(config, context)
        )
        return weights + need <= available

    low, high = 0, config.max_position_embeddings // step
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid * step) else (low, mid - 1)
    return low * step


def requested_context(
    folder: Path, config: ModelConfig, prompt: str = "", max_tokens: int | None = None, extra_tokens: int = 0
) -> int:
    """The prompt's UTF-8 bytes (no fewer than its tokens), ``extra_tokens`` (a video's frames) and
    ``max_tokens`` (default: the generation config's) in whole canvases."""
    try:
        max_tokens = max_tokens or GenerationConfig.from_folder(folder, config).max_new_tokens
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    return len(prompt.encode()) + extra_tokens + -(-max_tokens // config.canvas_length) * config.canvas_length


def check_memory(
    path_or_repo: str | os.PathLike,
    prompt: str = "",
    max_tokens: int | None = None,
    ranks: int = 1,
    kv_bits: int | None = None,
    extra_tokens: int = 0,
) -> MemoryNeed | None:
    """Raise MemoryCheckError, naming what would fit, when the model needs more than the device can
    give with its KV cache at ``kv_bits`` (None: the activations' dtype); returns the need (None
    when the device's memory is unknown). ``extra_tokens``: the prompt's tokens its text does not show
    (a video's frames). Reads only headers and configs."""
    folder = checkpoint_folder(path_or_repo)
    config = read_config(folder)
    tensors = _tensors(folder)
    context = requested_context(folder, config, prompt, max_tokens, extra_tokens)
    needed = memory_need(config, tensors, context, ranks, kv_bits)
    if (device := device_memory()) is None:
        return None
    available, source = device
    if needed.total <= available:
        return needed
    raise MemoryCheckError(
        f"the model needs {needed.describe()} and this device can give {format_size(available)} "
        f"({source}); {_what_fits(folder, config, tensors, needed, available, ranks)}, or pass "
        f"{IGNORE_FLAG} to load it anyway"
    )


def _what_fits(
    folder: Path, config: ModelConfig, tensors: dict[str, TensorInfo], needed: MemoryNeed, available: int, ranks: int
) -> str:
    """What would fit: a narrower KV cache alone, the largest recipe (with the widest KV cache it fits
    with), more machines like this one."""
    narrower = [b for b in sorted(KV_BITS, reverse=True) if needed.kv_bits is None or b < needed.kv_bits]
    itemsize = _activation_itemsize(tensors)
    kv = {bits: kv_cache_bytes(config, needed.context, itemsize, bits) for bits in (needed.kv_bits, *narrower)}

    def fits(weights: int, bits: int | None) -> bool:
        return weights + kv[bits] + needed.total - needed.weights - needed.kv_cache <= available

    options = []
    if (bits := next((b for b in narrower if fits(needed.weights, b)), None)) is not None:
        options.append(f"with {KV_FLAG} {bits} it fits ({format_size(kv[bits])} of KV cache)")
    for name, size in recipe_weight_sizes(folder, config, tensors, ranks):
        if size < needed.weights and (bits := next((b for b in kv if fits(size, b)), 0)) != 0:
            kv_flag = "" if bits == needed.kv_bits else f" and {KV_FLAG} {bits}"
            options.append(f"converted with --quant-predicate {name}{kv_flag} it fits ({format_size(size)} of weights)")
            break
    room = available - (needed.total - needed.weights)
    for n in range(ranks + 1, config.num_experts + 1):
        if weight_bytes(tensors, config, n) <= room:
            options.append(f"sharded over {n} machines like this one it fits (mlx.launch, docs/distributed.md)")
            break
    return "; ".join(options) if options else "no recipe or sharding here makes it fit"


def recipe_weight_sizes(
    folder: Path, config: ModelConfig, tensors: dict[str, TensorInfo], ranks: int = 1
) -> list[tuple[str, int]]:
    """(recipe, weight bytes per rank) for ``MEMORY_RECIPES``, planned from shapes: the checkpoint's own
    tensors when unquantized, else its config's text model in bfloat16 and its vision tensors as they are."""
    with warnings.catch_warnings():  # the converter's import asks for the fast BLAS, loaded (or not) by now
        warnings.simplefilter("ignore")
        from .convert import checkpoint as convert
    raw = json.loads((folder / "config.json").read_text())
    if config.quantization:
        raw = {k: v for k, v in raw.items() if k not in ("quantization", "quantization_config")}
        tensors = {**convert.text_tensors(raw), **{k: v for k, v in tensors.items() if VISION_KEY.match(k)}}
    base = ModelConfig.from_dict(raw)
    sizes = []
    for name in MEMORY_RECIPES:
        for group_size in GROUP_SIZES[1::-1]:  # 64, then 32 where 64 does not divide a dimension
            quantization = Quantization.from_flags(group_size=group_size, recipe=name)
            try:
                plan = convert.plan_tensors(folder, raw, base, tensors, quantization, None)
            except ConversionError:
                continue
            specs = {s.name: s for _, group in convert.output_specs(plan) for s in group}
            infos = {n: TensorInfo(Path(), s.dtype, s.shape, 0, s.nbytes) for n, s in specs.items()}
            sizes.append((name, weight_bytes(infos, base, ranks)))
            break
    return sizes
