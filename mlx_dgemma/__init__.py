"""mlx-dgemma: Google's DiffusionGemma on MLX."""

from .loader import load

__all__ = ["load"]
