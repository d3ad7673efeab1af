"""Large random DiffusionGemma checkpoints in the Hugging Face layout, written with numpy one tensor at
a time (no transformers, never the whole model in memory): inputs for converter memory tests and
benchmarks. The sizes are a preset of ``random_checkpoint`` made wider; the size in bytes comes from
the number of layers, so every tensor keeps its size whatever the checkpoint's total.

    python -m checkpoint_tools.synthetic_checkpoint OUT --gigabytes 2.5 [--dtype bfloat16]
    python -m checkpoint_tools.synthetic_checkpoint OUT --released --header-only   # the released shapes, no data
"""

from __future__ import annotations

import argparse
import json
import math
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from checkpoint_tools.random_checkpoint import PRESETS
from mlx_dgemma.model.config import FULL, SLIDING, ModelConfig
from mlx_dgemma.model.diffusion_gemma import DiffusionGemma
from mlx_dgemma.safetensors_io import ShardWriter, TensorSpec, write_index

# The text config of google/diffusiongemma-26B-A4B-it (its config.json's text_config).
RELEASED = dict(
    vocab_size=262144,
    hidden_size=2816,
    intermediate_size=2112,
    moe_intermediate_size=704,
    num_hidden_layers=30,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=256,
    global_head_dim=512,
    num_global_key_value_heads=2,
    num_experts=128,
    top_k_experts=8,
    sliding_window=1024,
    canvas_length=256,
    max_position_embeddings=262144,
)
# The released attention layout (a 1,024-token window, a full layer every sixth with 512-wide heads,
# 256-wide sliding heads, a 256K context) around tiny experts and one head per layer (the released
# model has 16, and 8 or 2 K/V heads), so that a 32K-token prompt runs on two CPU cores: what
# benchmarks/long_context.py and the long-context tests run.
LONG_CONTEXT = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=6,
    num_attention_heads=1,
    num_key_value_heads=1,
    head_dim=256,
    global_head_dim=512,
    num_global_key_value_heads=1,
    num_experts=4,
    top_k_experts=2,
    sliding_window=1024,
    canvas_length=64,
    max_position_embeddings=262144,
    layer_types=[SLIDING] * 5 + [FULL],
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
_WIDTHS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "head_dim", "global_head_dim")
ONES = ("norm.weight", "layernorm_1.weight", "layernorm_2.weight", "scale", "layer_scalar")


def scaled_sizes(layers: int, width: int = 8, preset: str = "pattern") -> dict:
    """``preset`` with every width × ``width`` and ``layers`` layers in the released 5:1 pattern."""
    sizes = {k: v for k, v in PRESETS[preset].items() if k != "layer_types"}
    sizes.update({k: sizes[k] * width for k in _WIDTHS})
    sizes["num_hidden_layers"] = layers
    sizes["layer_types"] = [FULL if (i + 1) % 6 == 0 or i == layers - 1 else SLIDING for i in range(layers)]
    return sizes


def hf_config(sizes: dict, dtype: str) -> dict:
    text = {k: v for k, v in sizes.items() if k != "canvas_length"}
    return {
        "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "model_type": "diffusion_gemma",
        "canvas_length": sizes["canvas_length"],
        "dtype": dtype,
        "tie_word_embeddings": True,
        "text_config": {"model_type": "diffusion_gemma_text", "dtype": dtype, **text},
    }


def hf_tensors(sizes: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(HF key, shape) of every tensor, read off the MLX model's lazily built parameter tree."""
    model = DiffusionGemma(ModelConfig.from_dict(hf_config(sizes, "float32")))
    out = []
    for name, value in tree_flatten(model.parameters()):
        if name.endswith((".experts.gate_up_proj.weight", ".experts.down_proj.weight")):
            name = name.removesuffix(".weight")  # HF's 3-D expert tensors have no suffix
        out.append((name, tuple(value.shape)))
    return out


def layers_for(gigabytes: float, dtype: str = "bfloat16", width: int = 8) -> int:
    one, two = (sum(math.prod(s) for _, s in hf_tensors(scaled_sizes(n, width))) for n in (1, 2))
    itemsize = getattr(mx, dtype).size
    return max(1, round((gigabytes * 1e9 / itemsize - (2 * one - two)) / (two - one)))


def write_checkpoint(
    out: Path, sizes: dict, dtype: str = "bfloat16", seed: int = 0, shard_bytes: int = 1 << 30
) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(sizes, dtype), indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [1], "pad_token_id": 0}))
    mx_dtype = getattr(mx, dtype)
    specs = [TensorSpec(name, shape, mx_dtype) for name, shape in hf_tensors(sizes)]
    shards: list[list[TensorSpec]] = [[]]
    for spec in specs:
        if shards[-1] and sum(s.nbytes for s in shards[-1]) + spec.nbytes > shard_bytes:
            shards.append([])
        shards[-1].append(spec)
    rng = np.random.default_rng(seed)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        with ShardWriter(out / name, shard, metadata={"format": "pt"}) as writer:
            for spec in shard:
                if spec.name.endswith(ONES):
                    value = 0.5 + rng.random(spec.shape, dtype=np.float32)
                else:
                    value = 0.02 * rng.standard_normal(spec.shape, dtype=np.float32)
                writer.write(spec.name, mx.array(value).astype(mx_dtype))
                weight_map[spec.name] = name
    write_index(out, weight_map, sum(s.nbytes for s in specs))
    return out


def write_long_context(out: Path, dtype: str = "float32", steps: int = 4) -> Path:
    """``LONG_CONTEXT`` with random weights, the demo's tokenizer and ``steps`` denoising steps per canvas."""
    from mlx_dgemma.demo import DEMO_MODEL

    out = write_checkpoint(out, LONG_CONTEXT, dtype)
    for name in ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        (out / name).write_bytes((DEMO_MODEL / name).read_bytes())
    generation = json.loads((DEMO_MODEL / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**generation, "max_denoising_steps": steps}))
    return out


def write_header_only(out: Path, sizes: dict, dtype: str = "bfloat16") -> Path:
    """A checkpoint whose one safetensors file has the full header and no data: a sparse file of the
    checkpoint's length (no disk is used), for what reads headers only (planning, sizes, memory checks)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(sizes, dtype), indent=2))
    header, offset = {}, 0
    for name, shape in hf_tensors(sizes):
        nbytes = math.prod(shape) * getattr(mx, dtype).size
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header).encode()
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return out


_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def write_converted_header_only(src: Path, out: Path, recipe: str) -> Path:
    """What ``convert`` would write for ``src`` under ``recipe`` (config and safetensors header), with no
    data: a sparse file, for what reads headers only (the memory check of a converted model)."""
    from mlx_dgemma.convert import Quantization, output_specs, plan_conversion, write_config
    from mlx_dgemma.safetensors_io import shard_header

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plan = plan_conversion(Path(src), Quantization.from_flags(recipe=recipe), None)
    write_config(plan, out)
    specs = [spec for _, group in output_specs(plan) for spec in group]
    header = shard_header(specs)
    with open(out / "model.safetensors", "wb") as f:
        f.write(header)
        f.truncate(len(header) + sum(s.nbytes for s in specs))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--width", type=int, default=8, help="multiplier of the 'pattern' preset's widths")
    parser.add_argument("--released", action="store_true", help="the released model's shapes (ignores --gigabytes)")
    parser.add_argument("--header-only", action="store_true", help="write the header and no data (a sparse file)")
    args = parser.parse_args()
    sizes = RELEASED if args.released else scaled_sizes(layers_for(args.gigabytes, args.dtype, args.width), args.width)
    print((write_header_only if args.header_only else write_checkpoint)(args.out, sizes, args.dtype))


if __name__ == "__main__":
    main()
