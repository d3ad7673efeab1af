"""mlx-dgemma: Google's DiffusionGemma on MLX."""

from . import fast_blas

fast_blas.load()  # before anything imports mlx.core

from .loader import load

__all__ = ["load"]
