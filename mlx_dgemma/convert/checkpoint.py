"""Hugging Face DiffusionGemma checkpoint → MLX checkpoint, streamed one tensor at a time and
optionally quantized with mixed bit widths (``convert``); a quantized MLX checkpoint written back
unquantized (``dequantize_checkpoint``); every recipe converted and measured (``sweep``).

The output has mlx-vlm's layout (fused ``experts.gate_up_proj``, mlx-lm's ``quantization`` entry
with per-module overrides in config.json), so it loads in mlx-vlm as well as here.
"""

from __future__ import annotations

import copy
import json
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from ..errors import ConversionError
from ..loader import (
    VISION_KEY,
    CheckpointError,
    ExpertSlice,
    check_weights,
    checkpoint_folder,
    load,
    map_key,
    stack_experts,
    weight_files,
)
from ..model.config import ConfigError, ModelConfig
from ..model.diffusion_gemma import DiffusionGemma
from ..safetensors_io import (
    ShardWriter,
    TensorInfo,
    TensorSpec,
    read_header,
    read_tensor,
    shard_names,
    shard_size,
    write_index,
)
from .output import (
    MAX_SHARD_BYTES,
    check_apart,
    check_destination,
    copy_side_files,
    dequantize_model,
    save_model,
    split_into_shards,
    staging_folder,
)
from .quantize import GROUP_SIZES, MODE_DEFAULTS, RECIPES, Quantization, QuantParams
from .report import format_table, measure_against, measure_recipe, reference_logits

DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class Target:
    """One output tensor group: a model parameter (quantized into weight/scales/biases or not) or a
    vision tensor passed through, and the source tensors it is built from."""

    name: str
    sources: dict[str, TensorInfo]
    slices: dict[str, ExpertSlice] = field(default_factory=dict)  # per-expert layout: source key → slice
    num_experts: int = 0
    quant: QuantParams | None = None

    @property
    def module(self) -> str:
        return self.name.removesuffix(".weight")

    @property
    def source_bytes(self) -> int:
        return sum(info.nbytes for info in self.sources.values())

    def assemble(self, read: Callable[[TensorInfo], mx.array]) -> mx.array:
        """The parameter as the model holds it, before casting and quantizing."""
        arrays = {key: read(info) for key, info in self.sources.items()}
        if self.slices:
            return stack_experts({self.slices[k]: v for k, v in arrays.items()}, self.num_experts)
        return arrays.popitem()[1]

    def build(self, read: Callable[[TensorInfo], mx.array], dtype: mx.Dtype | None) -> dict[str, mx.array]:
        """The output tensors, lazily: the caller evaluates them (or, planning, only reads their shapes)."""
        x = self.assemble(read)
        if dtype is not None and mx.issubdtype(x.dtype, mx.floating):
            x = x.astype(dtype)
        if self.quant is None:
            return {self.name: x}
        q = self.quant
        weight, scales, *biases = mx.quantize(x, group_size=q.group_size, bits=q.bits, mode=q.mode)
        out = {f"{self.module}.weight": weight, f"{self.module}.scales": scales}
        if biases:
            out[f"{self.module}.biases"] = biases[0]
        return out


def _placeholder(info: TensorInfo) -> mx.array:
    return mx.zeros(info.shape, info.dtype)  # lazy: planning reads shapes, never data


@dataclass
class ConversionPlan:
    """Everything decided and checked before the first byte is written."""

    source: Path
    raw_config: dict
    config: ModelConfig
    targets: list[Target]
    dtype: mx.Dtype | None
    quantization: Quantization | None

    def quantization_config(self) -> dict | None:
        if self.quantization is None:
            return None
        return self.quantization.config([t.module for t in self.targets if t.quant is not None])


def read_source_config(folder: Path) -> tuple[dict, ModelConfig]:
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
        return raw, ModelConfig.from_dict(raw)
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found: a checkpoint folder needs config.json") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def source_tensors(folder: Path) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for path in weight_files(folder):
        for key, info in read_header(path).items():
            if key in tensors:
                raise CheckpointError(f"{key} is in both {tensors[key].path.name} and {path.name}")
            tensors[key] = info
    return tensors


def _targets(tensors: dict[str, TensorInfo], num_experts: int) -> list[Target]:
    """Source keys grouped by the output tensor they become (the loader's mapping, one key at a time)."""
    targets: dict[str, Target] = {}
    for key, info in tensors.items():
        if key.endswith((".scales", ".biases")):
            raise ConversionError(f"the source is already quantized ({key}); convert from the unquantized checkpoint")
        mapped = key if VISION_KEY.match(key) else map_key(key)
        if mapped is None:
            continue
        name = mapped.target if isinstance(mapped, ExpertSlice) else mapped
        target = targets.setdefault(name, Target(name, {}, num_experts=num_experts))
        if target.sources and not (isinstance(mapped, ExpertSlice) and target.slices):
            raise CheckpointError(f"{key} and {next(iter(target.sources))} both hold {name}")
        target.sources[key] = info
        if isinstance(mapped, ExpertSlice):
            target.slices[key] = mapped
    return [targets[name] for name in sorted(targets, key=_natural_order)]


def _natural_order(name: str) -> tuple:
    """layers.2 before layers.10."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split("."))


def _output_dtype(name: str | None, raw_config: dict) -> mx.Dtype | None:
    """--dtype, else the config's declared dtype, else None (each tensor keeps its own)."""
    text = raw_config.get("text_config") or {}
    for candidate in (name, raw_config.get("dtype"), raw_config.get("torch_dtype"), text.get("dtype")):
        if candidate in DTYPES:
            return getattr(mx, candidate)
    return None


def _check_group_sizes(targets: list[Target], quantization: Quantization) -> None:
    columns = {t.module: t.assemble(_placeholder).shape[-1] for t in targets if t.quant is not None}
    for t in targets:
        if t.quant is None or columns[t.module] % t.quant.group_size == 0:
            continue
        if t.quant == quantization.default:
            requested = [columns[u.module] for u in targets if u.quant == t.quant]
            fits = [str(g) for g in GROUP_SIZES if all(c % g == 0 for c in requested)]
            hint = f"; --q-group-size {' or '.join(fits)} divides them all" if fits else ""
        else:
            hint = f"; the {quantization.recipe} recipe keeps it at 8 bits with group size 64 (try --quant-predicate uniform)"
        raise ConversionError(
            f"group size {t.quant.group_size} does not divide the input dimension {columns[t.module]} of {t.module}{hint}"
        )


def plan_conversion(src: Path, quantization: Quantization | None, dtype: str | None) -> ConversionPlan:
    raw, config = read_source_config(src)
    if raw.get("quantization") or raw.get("quantization_config"):
        raise ConversionError(f"{src} is already quantized; convert from the unquantized checkpoint")
    return plan_tensors(src, raw, config, source_tensors(src), quantization, dtype)


def plan_tensors(
    src: Path,
    raw: dict,
    config: ModelConfig,
    tensors: dict[str, TensorInfo],
    quantization: Quantization | None,
    dtype: str | None,
) -> ConversionPlan:
    """The plan for a source holding ``tensors`` (only their names, shapes and dtypes are read)."""
    targets = _targets(tensors, config.num_experts)
    text_targets = [t for t in targets if not VISION_KEY.match(t.name)]
    model = DiffusionGemma(config)  # parameters stay lazy: only their names and shapes are read
    check_weights(model, {t.name: t.assemble(_placeholder) for t in text_targets})
    if quantization is not None:
        quantizable = {path for path, m in model.named_modules() if hasattr(m, "to_quantized")}
        for t in text_targets:
            if t.module in quantizable and t.name.endswith(".weight"):
                t.quant = quantization.params_for(t.module)
        _check_group_sizes(text_targets, quantization)
    return ConversionPlan(src, raw, config, targets, _output_dtype(dtype, raw), quantization)


def output_specs(plan: ConversionPlan) -> list[tuple[Target, list[TensorSpec]]]:
    """Each target with the names, shapes and dtypes of the tensors it will write."""
    return [(t, [TensorSpec.of(n, a) for n, a in t.build(_placeholder, plan.dtype).items()]) for t in plan.targets]


def converted_size(plan: ConversionPlan, max_shard_bytes: int = MAX_SHARD_BYTES) -> int:
    """The bytes of the safetensors files ``write_weights`` writes for ``plan``, headers included."""
    shards = split_into_shards(output_specs(plan), max_shard_bytes)
    return sum(shard_size([s for _, specs in shard for s in specs]) for shard in shards)


def text_tensors(raw_config: dict, dtype: mx.Dtype = mx.bfloat16) -> dict[str, TensorInfo]:
    """The text model's tensors of an unquantized ``dtype`` checkpoint of ``raw_config``, as shapes
    only (no file): what planning needs to size a conversion that has no source at hand."""
    model = DiffusionGemma(ModelConfig.from_dict(raw_config))  # lazy: nothing is allocated
    return {
        name: TensorInfo(Path(), dtype, tuple(v.shape), 0, math.prod(v.shape) * dtype.size)
        for name, v in tree_flatten(model.parameters())
    }


def recipe_trials(recipes: list[str], bits: list[int]) -> list[tuple[str, int]]:
    """(recipe, bits) of each conversion a sweep makes: every bit width, or a recipe's own."""
    return [(r, b) for r in recipes for b in ([RECIPES[r].bits] if RECIPES[r].bits else bits)]


def recipe_sizes(
    src: Path,
    raw: dict,
    config: ModelConfig,
    tensors: dict[str, TensorInfo],
    recipes: list[str],
    bits: list[int],
    group_size: int | None = None,
) -> list[tuple[Quantization, int]]:
    """Each recipe's converted size for a source of ``tensors``, planned without reading a weight."""
    sizes = []
    for recipe, b in recipe_trials(recipes, bits):
        quantization = Quantization.from_flags(b, group_size, "affine", recipe)
        sizes.append((quantization, converted_size(plan_tensors(src, raw, config, tensors, quantization, None))))
    return sizes


def write_weights(
    plan: ConversionPlan, folder: Path, max_shard_bytes: int = MAX_SHARD_BYTES, progress: bool = True
) -> None:
    from tqdm import tqdm

    groups = output_specs(plan)
    shards = split_into_shards(groups, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = sum(t.source_bytes for t in plan.targets)
    with tqdm(total=total, unit="B", unit_scale=True, desc="converting", disable=not progress) as bar:
        for file_name, shard in zip(shard_names(len(shards)), shards):
            with ShardWriter(folder / file_name, [s for _, specs in shard for s in specs]) as writer:
                for target, specs in shard:
                    outputs = target.build(read_tensor, plan.dtype)
                    mx.eval(outputs)
                    for spec in specs:
                        writer.write(spec.name, outputs[spec.name])
                        weight_map[spec.name] = file_name
                    del outputs
                    mx.clear_cache()  # freed buffers go back to the system, not to MLX's cache
                    bar.update(target.source_bytes)
    write_index(folder, weight_map, sum(s.nbytes for _, specs in groups for s in specs))


def write_config(plan: ConversionPlan, folder: Path) -> None:
    raw = copy.deepcopy(plan.raw_config)
    if isinstance(raw.get("text_config"), dict):
        # transformers' save_pretrained spells these as per_layer_config, which mlx-vlm does not read
        raw["text_config"].setdefault("global_head_dim", plan.config.global_head_dim)
        raw["text_config"].setdefault("num_global_key_value_heads", plan.config.num_global_key_value_heads)
    if plan.dtype is not None:
        dtype = str(plan.dtype).rsplit(".", 1)[-1]
        for section in (raw, raw.get("text_config") or {}):
            for key in ("dtype", "torch_dtype"):
                if key in section:
                    section[key] = dtype
    if (quantization := plan.quantization_config()) is not None:
        raw["quantization"] = quantization
        raw["quantization_config"] = quantization  # mlx-lm and mlx-vlm write both
    (folder / "config.json").write_text(json.dumps(dict(sorted(raw.items())), indent=4))


def convert(
    hf_path: str,
    mlx_path: str = "mlx_model",
    quantize: bool = False,
    q_group_size: int | None = None,
    q_bits: int | None = None,
    q_mode: str | None = None,
    quant_predicate: str | None = None,
    dtype: str | None = None,
    force: bool = False,
    report: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    progress: bool = True,
) -> Path:
    """Convert ``hf_path`` (folder or Hub id) into an MLX checkpoint at ``mlx_path``; returns its path.

    ``force`` replaces an earlier conversion at ``mlx_path``, never a folder holding other files, the
    source or a folder around it. Raises CheckpointError for a source that cannot be read and
    ConversionError for a conversion that cannot be done as asked; either way nothing is left at
    ``mlx_path``, as after ConversionStopped (SIGTERM, SIGHUP) or KeyboardInterrupt.
    """
    dst = Path(mlx_path).expanduser()
    given = [
        flag
        for flag, value in (
            ("--q-bits", q_bits),
            ("--q-group-size", q_group_size),
            ("--q-mode", q_mode),
            ("--quant-predicate", quant_predicate),
        )
        if value is not None
    ]
    if given and not quantize:
        raise ConversionError(
            f"{given[0]} needs -q/--quantize (without it the model is written unquantized); add -q or drop it"
        )
    if Path(hf_path).expanduser().is_dir():  # a local source: the most telling refusal first
        check_apart(Path(hf_path).expanduser(), dst)
    check_destination(dst, force)
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    quantization = Quantization.from_flags(q_bits, q_group_size, q_mode, quant_predicate) if quantize else None
    src = checkpoint_folder(hf_path)
    check_apart(src, dst)
    plan = plan_conversion(src, quantization, dtype)
    with staging_folder(dst, force) as folder:
        write_weights(plan, folder, max_shard_bytes, progress)
        write_config(plan, folder)
        copy_side_files(src, folder)
    if report:
        label = quantization.describe() if quantization else "unquantized"
        print(measure_against(src, {label: dst}))
    return dst


def dequantize_checkpoint(hf_path: str, mlx_path: str = "mlx_model", force: bool = False) -> Path:
    """The quantized MLX checkpoint ``hf_path`` written unquantized at ``mlx_path`` (mlx-lm's ``-d``): each
    quantized weight as ``mx.dequantize`` gives it, in its scales' dtype; returns its path."""
    src, dst = checkpoint_folder(hf_path), Path(mlx_path).expanduser()
    check_apart(src, dst)
    check_destination(dst, force)
    raw, _ = read_source_config(src)
    if "quantization" not in raw:
        raise ConversionError(
            f"--dequantize takes a quantized MLX checkpoint, and {src}'s config.json has no "
            "quantization; convert it without -d"
        )
    model, _ = load(src)
    return save_model(dequantize_model(model), src, dst, dequantized=True, force=force)


def upload(folder: Path, repo: str) -> None:
    """``folder`` uploaded to the Hugging Face model repository ``repo`` (created where it does not exist)."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo, repo_type="model")
    except Exception as e:  # (offline, no token, no such namespace: the hub's own words say which)
        raise ConversionError(
            f"wrote {folder}, but could not upload it to {repo}: {' '.join(str(e).split())[:300]}"
        ) from None


def sweep(
    hf_path: str,
    recipes: list[str],
    bits: list[int],
    group_size: int | None,
    mode: str,
    dtype: str | None,
    work_dir: str | None = None,
    instances: int = 0,
    seed: int = 0,
) -> tuple[str, list[str]]:
    """Convert with every recipe × bit width (a recipe that fixes its bits: once; plus once unquantized)
    and tabulate the cost of each; ``instances`` > 0 adds the demo tasks' accuracy and steps. Returns
    the table and a line per trial that failed."""
    src = checkpoint_folder(hf_path)
    if mode != "affine":
        bits = [MODE_DEFAULTS[mode][1]]
        recipes = [r for r in recipes if RECIPES[r].bits is None]
    reference, probe = reference_logits(src)
    rows, failures = [], []
    trials = [(None, None)] + recipe_trials(recipes, bits)
    with tempfile.TemporaryDirectory(dir=work_dir, prefix="dgemma-report-") as tmp:
        for i, (recipe, b) in enumerate(trials):
            dst = Path(tmp) / f"trial-{i}"
            if recipe is None:
                label = f"unquantized ({dtype or 'config dtype'})"
                options = {}
            else:
                label = Quantization.from_flags(b, group_size, mode, recipe).describe()
                options = dict(quantize=True, q_bits=b, q_group_size=group_size, q_mode=mode, quant_predicate=recipe)
            try:
                convert(str(src), str(dst), dtype=dtype, progress=False, **options)
                rows.append(measure_recipe(dst, label, reference, probe, instances, seed))
            except Exception as e:  # one recipe the runtime cannot run should not hide the others
                reason = str(e).split("\n")[0][:200]
                failures.append(f"{label}: failed ({type(e).__name__}: {reason})")
            mx.clear_cache()
    return format_table(rows), failures
