import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# One switch for every parity suite: DGEMMA_TEST_DEVICE=gpu runs MLX on Metal or CUDA and the
# reference on the matching torch device (mps / cuda); the default is cpu for both. On CUDA, MLX
# multiplies float32 in TF32 (10 mantissa bits) unless MLX_ENABLE_TF32=0, read once when mlx loads:
# the suite's float32 bounds are float32's, so it is off (torch's matmuls are float32 by default).
if os.environ.get("DGEMMA_TEST_DEVICE", "cpu") == "gpu":
    os.environ.setdefault("MLX_ENABLE_TF32", "0")
from mlx_dgemma import fast_blas  # noqa: E402

fast_blas.load()  # before mlx.core loads: MLX's matmuls then use OpenBLAS where it is installed
import mlx.core as mx  # noqa: E402

if os.environ.get("DGEMMA_TEST_DEVICE", "cpu") == "gpu":
    mx.set_default_device(mx.gpu)

from checkpoint_tools import random_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Random reference checkpoints saved by transformers, built once per session and per request."""
    built: dict[tuple, Path] = {}

    def get(preset: str = "small", dtype: str = "float32", seed: int = 0, tame: bool = False) -> Path:
        key = (preset, dtype, seed, tame)
        if key not in built:
            out = tmp_path_factory.mktemp(f"{preset}-{dtype}-{seed}{'-tame' if tame else ''}")
            built[key] = random_checkpoint.build(out, preset, seed, dtype, tame)
        return built[key]

    return get


@pytest.fixture(scope="module")
def demo():
    """The bundled demo model and its tokenizer, loaded afresh for each test module."""
    from mlx_dgemma import load
    from mlx_dgemma.generate import DEMO_MODEL

    return load(DEMO_MODEL)
