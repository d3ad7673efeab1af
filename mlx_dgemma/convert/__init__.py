"""The converter: a Hugging Face checkpoint streamed into an MLX one, quantized by a recipe
(checkpoint.py the conversion, quantize.py the recipes, output.py where and how a checkpoint is written,
report.py what each recipe costs; ``python -m mlx_dgemma.convert`` is __main__.py).

Importing the package does nothing else; the first use of its names below loads the fast BLAS on
Linux first (fast_blas.py: it must precede ``mlx.core``), as the package's own API does.
"""

from .. import fast_blas

_NAMES = {
    "convert": "checkpoint",
    "converted_size": "checkpoint",
    "dequantize_checkpoint": "checkpoint",
    "output_specs": "checkpoint",
    "plan_conversion": "checkpoint",
    "recipe_trials": "checkpoint",
    "write_config": "checkpoint",
    "DTYPES": "checkpoint",
    "MAX_SHARD_BYTES": "output",
    "split_into_shards": "output",
    "BITS": "quantize",
    "RECIPES": "quantize",
    "Quantization": "quantize",
    "ConversionError": "checkpoint",
}

__all__ = sorted(_NAMES)


__getattr__ = fast_blas.lazy_names(__name__, _NAMES)
