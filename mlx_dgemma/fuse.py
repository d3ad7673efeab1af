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
from pathlib import Path

from mlx.utils import tree_unflatten

from .cli import check_writable_folder, command_line
from .convert.output import check_apart, check_destination, dequantize_model, save_model

SAVE_PATH = "--save-path"


def fuse_adapters(model, dequantize: bool = False):
    """Replace every adapter layer (anything with mlx-lm's ``fuse``) by its merged layer."""
    fused = [
        (name, module.fuse(dequantize=dequantize)) for name, module in model.named_modules() if hasattr(module, "fuse")
    ]
    if fused:
        model.update_modules(tree_unflatten(fused))
    return model


@command_line
def main(argv=None) -> None:
    from .demo import DEMO_MODEL
    from .loader import checkpoint_folder, load

    p = argparse.ArgumentParser(description="Fuse fine-tuned adapters into the model.")
    p.add_argument("--model", help="The base checkpoint [default: the bundled demo model].")
    p.add_argument("--adapter-path", default="adapters", help="The adapters' folder [default: adapters].")
    p.add_argument(SAVE_PATH, default="fused_model", help="Where to write the fused model [default: fused_model].")
    p.add_argument("--dequantize", action="store_true", help="Write the fused model unquantized.")
    p.add_argument("--force", action="store_true", help=f"Replace an existing {SAVE_PATH} (an earlier fused model).")
    args = p.parse_args(argv)
    save_path = Path(args.save_path)
    try:
        base = checkpoint_folder(args.model or DEMO_MODEL)
        check_apart(base, save_path, SAVE_PATH)
        check_destination(save_path, args.force, SAVE_PATH)  # before the model loads
        check_writable_folder(save_path.parent, SAVE_PATH)
        model, _ = load(base, adapter_path=args.adapter_path)
        fuse_adapters(model, args.dequantize)
        if args.dequantize:
            dequantize_model(model)
        save_model(model, base, save_path, dequantized=args.dequantize, force=args.force, flag=SAVE_PATH)
    except OSError as e:
        raise ValueError(f"cannot write {SAVE_PATH} {save_path}: {e.strerror or e}") from None
    print(f"Fused model saved to {save_path}")


if __name__ == "__main__":
    main()
