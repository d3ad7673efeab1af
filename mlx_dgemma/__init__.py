"""mlx-dgemma: Google's DiffusionGemma on MLX.

Importing the package does nothing else; the first use of its API (``mlx_dgemma.load`` and the
rest below) loads the fast BLAS on Linux first (fast_blas.py: it must precede ``mlx.core``).
"""

import sys
import types

from . import fast_blas

_API = {
    "load": "loader",
    "generate": "generate",
    "stream_generate": "generate",
    "infill": "generate",
    "drafted_json_template": "generate",
    "batch_generate": "engine.batch",
    "BatchGenerator": "engine.batch",
    "parse_template": "structured.template",
    "json_template": "structured.json_schema",
}

__all__ = list(_API)


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
