"""mlx-dgemma: Google's DiffusionGemma on MLX.

Importing the package does nothing else; the first use of its API (``mlx_dgemma.load`` and the
rest below) loads the fast BLAS on Linux first (fast_blas.py: it must precede ``mlx.core``).
"""

import sys
import types
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from . import fast_blas
from .errors import DGemmaError, MissingExtra, OptionError

try:
    __version__ = version("mlx-dgemma")
except PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+unknown"

_API = {
    "load": "loader",
    "generate": "api",
    "stream_generate": "api",
    "batch_generate": "api",
    "infill": "api",
    "drafted_json_template": "api",
    "GenerationResponse": "api",
    "BatchResponse": "api",
    "BatchGenerator": "engine.batch",
    "parse_template": "structured.template",
    "json_template": "structured.json_schema",
}

if TYPE_CHECKING:  # what type checkers see; at run time each name is imported on first use
    from .api import (
        BatchResponse as BatchResponse,
        GenerationResponse as GenerationResponse,
        batch_generate as batch_generate,
        drafted_json_template as drafted_json_template,
        generate as generate,
        infill as infill,
        stream_generate as stream_generate,
    )
    from .engine.batch import BatchGenerator as BatchGenerator
    from .loader import load as load
    from .structured.json_schema import json_template as json_template
    from .structured.template import parse_template as parse_template

__all__ = [*_API, "DGemmaError", "MissingExtra", "OptionError", "__version__"]


__getattr__ = fast_blas.lazy_names(__name__, _API)


class _Package(types.ModuleType):
    """``mlx_dgemma.generate`` is the function even once the submodule of that name is imported
    (the import system would set the package attribute to the module; the module stays reachable
    as ``sys.modules["mlx_dgemma.generate"]``, which is what ``import mlx_dgemma.generate`` uses)."""

    def __setattr__(self, name, value):
        if name in _API and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
