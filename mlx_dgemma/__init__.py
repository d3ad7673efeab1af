"""mlx-dgemma: Google's DiffusionGemma on MLX."""

import warnings

from . import fast_blas

fast_blas.load()  # before anything imports mlx.core

from .generate import drafted_json_template, generate, infill, stream_generate
from .loader import load
from .template import json_template, parse_template

# `python -m mlx_dgemma.generate` runs the CLI module this package has already imported for its API;
# runpy warns about that, harmlessly (the module only defines things until its __main__ block).
warnings.filterwarnings("ignore", message=r"'mlx_dgemma\.generate' found in sys\.modules", category=RuntimeWarning)

__all__ = ["load", "generate", "stream_generate", "infill", "parse_template", "json_template", "drafted_json_template"]
