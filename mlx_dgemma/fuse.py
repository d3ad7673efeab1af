"""Merge fine-tuned adapters into a checkpoint that loads, generates and converts like any other.

    python -m mlx_dgemma.fuse [--model PATH] --adapter-path adapters --save-path fused [--dequantize]

LoRA layers become plain linear layers ``W + scale · Bᵀ Aᵀ`` (on a quantized base: dequantized,
merged and quantized again with the same settings, or left unquantized with ``--dequantize``);
full fine-tuning's weights are written as they are. The tokenizer, chat template and generation
config are copied from the base model.
"""

from __future__ import annotations

from . import fast_blas

fast_blas.load()  # a command-line process: the fast BLAS before mlx.core loads

import argparse
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .cli import check_writable_folder, command_line
from .convert_output import (
    MAX_SHARD_BYTES,
    check_apart,
    check_destination,
    copy_side_files,
    split_into_shards,
    staging_folder,
)
from .experts import ExpertLinear, QuantizedExpertLinear
from .safetensors_io import ShardWriter, TensorSpec, shard_names, write_index

SAVE_PATH = "--save-path"


def fuse_adapters(model, dequantize: bool = False):
    """Replace every adapter layer (anything with mlx-lm's ``fuse``) by its merged layer."""
    fused = [(name, module.fuse(dequantize=dequantize)) for name, module in model.named_modules()
             if hasattr(module, "fuse")]
    if fused:
        model.update_modules(tree_unflatten(fused))
    return model


def _dequantized(module):
    def weight(m):
        return mx.dequantize(m.weight, m.scales, m.get("biases"), group_size=m.group_size, bits=m.bits, mode=m.mode)

    if isinstance(module, nn.QuantizedLinear):
        out_dims, in_dims = weight(module).shape
        linear = nn.Linear(in_dims, out_dims, bias="bias" in module)
        linear.weight = weight(module)
        if "bias" in module:
            linear.bias = module.bias
        return linear
    if isinstance(module, nn.QuantizedEmbedding):
        embedding = nn.Embedding(*weight(module).shape)
        embedding.weight = weight(module)
        return embedding
    if isinstance(module, QuantizedExpertLinear):
        experts, out_dims, in_dims = weight(module).shape
        linear = ExpertLinear(in_dims, out_dims, experts)
        linear.weight = weight(module)
        return linear
    return None


def dequantize_model(model):
    replaced = [(name, new) for name, module in model.named_modules() if (new := _dequantized(module)) is not None]
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    return model


def save_model(model, base_folder: Path, save_path: Path, dequantized: bool = False, force: bool = False) -> Path:
    """The model's weights in ≤ 5 GB shards, the base's config (without its quantization entries when
    ``dequantized``) and side files; written in a temporary folder renamed at the end."""
    weights = dict(tree_flatten(model.parameters()))
    groups = [(name, [TensorSpec.of(name, array)]) for name, array in weights.items()]
    shards = split_into_shards(groups, MAX_SHARD_BYTES)
    config = json.loads((base_folder / "config.json").read_text())
    if dequantized:
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    with staging_folder(save_path, force, SAVE_PATH) as folder:
        weight_map = {}
        for file_name, shard in zip(shard_names(len(shards)), shards):
            with ShardWriter(folder / file_name, [spec for _, specs in shard for spec in specs]) as writer:
                for name, _ in shard:
                    writer.write(name, weights[name])
                    weight_map[name] = file_name
        if len(shards) > 1:
            write_index(folder, weight_map, sum(a.nbytes for a in weights.values()))
        (folder / "config.json").write_text(json.dumps(config, indent=4))
        copy_side_files(base_folder, folder)
    return save_path


@command_line
def main(argv=None) -> None:
    from .demo import DEMO_MODEL
    from .loader import load, resolve

    p = argparse.ArgumentParser(description="Fuse fine-tuned adapters into the model.")
    p.add_argument("--model", help="The base checkpoint [default: the bundled demo model].")
    p.add_argument("--adapter-path", default="adapters", help="The adapters' folder [default: adapters].")
    p.add_argument(SAVE_PATH, default="fused_model", help="Where to write the fused model [default: fused_model].")
    p.add_argument("--dequantize", action="store_true", help="Write the fused model unquantized.")
    p.add_argument("--force", action="store_true", help=f"Replace an existing {SAVE_PATH} (an earlier fused model).")
    args = p.parse_args(argv)
    save_path = Path(args.save_path)
    try:
        base = resolve(args.model or DEMO_MODEL)
        check_apart(base, save_path, SAVE_PATH)
        check_destination(save_path, args.force, SAVE_PATH)  # before the model loads
        check_writable_folder(save_path.parent, SAVE_PATH)
        model, _ = load(base, adapter_path=args.adapter_path)
        fuse_adapters(model, args.dequantize)
        if args.dequantize:
            dequantize_model(model)
        save_model(model, base, save_path, dequantized=args.dequantize, force=args.force)
    except OSError as e:
        raise ValueError(f"cannot write {SAVE_PATH} {save_path}: {e.strerror or e}") from None
    print(f"Fused model saved to {save_path}")


if __name__ == "__main__":
    main()
