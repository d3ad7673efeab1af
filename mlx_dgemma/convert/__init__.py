"""The converter: a Hugging Face checkpoint streamed into an MLX one, quantized by a recipe
(checkpoint.py the conversion, quantize.py the recipes, output.py where and how a checkpoint is written,
report.py what each recipe costs; ``python -m mlx_dgemma.convert`` is __main__.py).

The converter is an entry point: importing it loads the fast BLAS before mlx.core (fast_blas.py)."""

from .. import fast_blas

fast_blas.load()

from ..errors import ConversionError
from .checkpoint import (
    DTYPES,
    convert,
    converted_size,
    dequantize_checkpoint,
    output_specs,
    plan_conversion,
    recipe_trials,
    write_config,
)
from .output import MAX_SHARD_BYTES, split_into_shards
from .quantize import BITS, RECIPES, Quantization

__all__ = ["BITS", "DTYPES", "MAX_SHARD_BYTES", "RECIPES", "ConversionError", "Quantization", "convert",
           "converted_size", "dequantize_checkpoint", "output_specs", "plan_conversion", "recipe_trials",
           "split_into_shards", "write_config"]
