"""Use OpenBLAS for MLX's CPU matmuls on Linux.

The `mlx[cpu]` wheel bundles netlib's reference BLAS (≈2 GFLOP/s). Loading OpenBLAS into the
global symbol scope *before* `mlx.core` is imported makes MLX resolve its BLAS calls there — the
same effect as LD_PRELOAD, from inside the process (≈10-20x faster matmuls on this CPU).
Set MLX_DGEMMA_BLAS=reference to keep the bundled one, or a path to load another library.

Debian 12's OpenBLAS (0.3.21) does not recognise recent Xeons and falls back to its Prescott (SSE3)
kernels: 526 ms for a 256x512x32000 product where its SkylakeX (AVX-512) kernels took 121 ms. Unless
OPENBLAS_CORETYPE is already set, we ask for the newest mature family the CPU's flags support.

Only a library named in MLX_DGEMMA_BLAS that cannot take effect (missing, not loadable, or named after
mlx.core was imported) is warned of, once: without OpenBLAS, or with mlx.core imported first, MLX
keeps the BLAS it has, as nobody asked otherwise.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys
import warnings

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
)

loaded: str | None = None
_tried = False  # load() decides once per process: mlx.core is imported right after its first call


def load() -> str | None:
    """Load a fast BLAS if one is installed; returns its path (None on macOS or when absent)."""
    global loaded, _tried
    if _tried or sys.platform != "linux":
        return loaded
    _tried = True
    choice = os.environ.get("MLX_DGEMMA_BLAS", "")
    if choice == "reference":
        return None
    if "mlx.core" in sys.modules:
        if choice:
            _not_loaded(
                choice,
                "is not loaded: mlx.core was imported first (use mlx_dgemma.load or call "
                "mlx_dgemma.fast_blas.load() before importing mlx.core or a module of mlx_dgemma)",
            )
        return None
    if choice and not os.path.isfile(choice):
        _not_loaded(choice, "is not a file")
        return None
    path = choice or next((p for p in CANDIDATES if os.path.exists(p)), None)
    if path is None:
        return None
    if coretype := kernel_family():
        os.environ.setdefault("OPENBLAS_CORETYPE", coretype)  # read by OpenBLAS when it loads
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        if choice:
            _not_loaded(choice, f"cannot be loaded ({e})")
        return None
    loaded = path
    return loaded


def _not_loaded(choice: str, reason: str) -> None:
    warnings.warn(f"MLX_DGEMMA_BLAS={choice} {reason}: MLX keeps its bundled reference BLAS", stacklevel=3)


def kernel_family() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return None
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


def describe() -> str:
    """Which BLAS MLX's CPU matmuls use, for benchmark reports."""
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    preload = os.environ.get("LD_PRELOAD", "")
    if "blas" in preload:
        return f"LD_PRELOAD={preload}"
    if loaded:
        return f"{loaded} (OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'auto')})"
    return "netlib reference BLAS bundled with mlx[cpu]"


def lazy_names(package: str, names: dict[str, str]):
    """A package's ``__getattr__`` that imports each of ``names`` from its submodule (``names[name]``)
    on first use, the fast BLAS loaded first: importing the package itself loads neither."""
    namespace = sys.modules[package].__dict__

    def attribute(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        load()
        value = getattr(importlib.import_module(f".{names[name]}", package), name)
        namespace[name] = value
        return value

    return attribute
