"""The converter: a Hugging Face checkpoint streamed into an MLX one, quantized by a recipe
(checkpoint.py the conversion, quantize.py the recipes, output.py where and how a checkpoint is written,
report.py what each recipe costs; ``python -m mlx_dgemma.convert`` is __main__.py).

Importing the package does nothing else; the first use of its names below loads the fast BLAS on
Linux first (fast_blas.py: it must precede ``mlx.core``), as the package's own API does.
"""

import importlib

_NAMES = {
    "convert": "checkpoint", "converted_size": "checkpoint", "dequantize_checkpoint": "checkpoint",
    "output_specs": "checkpoint", "plan_conversion": "checkpoint", "recipe_trials": "checkpoint",
    "write_config": "checkpoint", "DTYPES": "checkpoint",
    "MAX_SHARD_BYTES": "output", "split_into_shards": "output",
    "BITS": "quantize", "RECIPES": "quantize", "Quantization": "quantize",
    "ConversionError": "checkpoint",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module 'mlx_dgemma.convert' has no attribute {name!r}")
    from .. import fast_blas

    fast_blas.load()
    value = getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    globals()[name] = value
    return value
