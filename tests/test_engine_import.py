"""Importing the package has no side effects: no mlx.core, no BLAS loaded, until its API is used; and
nothing is printed about the BLAS unless a library the user named cannot take effect."""

import os
import subprocess
import sys

import pytest

from mlx_dgemma import fast_blas

CHECK = """
import sys
import mlx_dgemma
from mlx_dgemma import fast_blas
assert "mlx.core" not in sys.modules, "import mlx_dgemma imported mlx.core"
assert fast_blas.loaded is None, "import mlx_dgemma loaded a BLAS"
load = mlx_dgemma.load  # the API's first use prepares the process, then imports MLX
assert "mlx.core" in sys.modules
print(fast_blas.describe())
"""


def test_import_has_no_side_effects_and_the_api_loads_the_blas():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    installed = sys.platform == "linux" and any(os.path.exists(p) for p in fast_blas.CANDIDATES)
    if installed and "MLX_DGEMMA_BLAS" not in os.environ:
        assert "openblas" in out.stdout, out.stdout


# A plain command, as installed (with OpenBLAS where it is), and with the loader pointed at a library
# that is not there (Linux without OpenBLAS).
PLAIN = """
import runpy, sys
sys.argv = ["generate", "--prompt", "sort: 3 1 2", "--max-tokens", "8"]
runpy.run_module("mlx_dgemma.generate", run_name="__main__")
"""
WITHOUT_OPENBLAS = (
    """
from mlx_dgemma import fast_blas
fast_blas.CANDIDATES = ("/nonexistent/libblas.so.3",)
"""
    + PLAIN
)
MLX_FIRST = """
import mlx.core
from mlx_dgemma import fast_blas, generate, load
from mlx_dgemma.demo import DEMO_MODEL
print(generate(*load(DEMO_MODEL), "sort: 3 1 2", max_tokens=8) != "", fast_blas.loaded)
"""


def run(script: str, **env) -> subprocess.CompletedProcess:
    environment = {**os.environ, **env}
    for name in ("LD_PRELOAD", *(() if "MLX_DGEMMA_BLAS" in env else ("MLX_DGEMMA_BLAS",))):
        environment.pop(name, None)
    return subprocess.run(
        [sys.executable, "-W", "default", "-c", script], capture_output=True, text=True, timeout=300, env=environment
    )


def test_no_warning_where_no_choice_was_made():
    """Without OpenBLAS, and with mlx.core imported first, nothing is printed: the reference BLAS is
    what MLX has, and nobody asked for another."""
    for script in (PLAIN, WITHOUT_OPENBLAS, MLX_FIRST):
        out = run(script)
        assert out.returncode == 0 and out.stderr == "", out.stderr[-2000:]


@pytest.mark.skipif(sys.platform != "linux", reason="MLX_DGEMMA_BLAS is read on Linux only")
def test_an_explicit_library_that_cannot_take_effect_is_warned_of_once():
    missing = run(WITHOUT_OPENBLAS, MLX_DGEMMA_BLAS="/nonexistent/libopenblas.so.0")
    assert missing.returncode == 0, missing.stderr
    warnings = [line for line in missing.stderr.split("\n") if "Warning" in line]
    assert len(warnings) == 1 and "MLX_DGEMMA_BLAS=/nonexistent/libopenblas.so.0 is not a file" in warnings[0], (
        missing.stderr
    )
    late = run(MLX_FIRST, MLX_DGEMMA_BLAS=fast_blas.CANDIDATES[0])
    assert late.returncode == 0, late.stderr
    warnings = [line for line in late.stderr.split("\n") if "Warning" in line]
    assert len(warnings) == 1 and "mlx.core was imported first" in warnings[0], late.stderr
    assert late.stdout.split() == ["True", "None"]


# The entry points: each command line's module, the server, and the package's API (mlx_dgemma.load).
ENTRY_POINTS = (
    "mlx_dgemma.generate",
    "mlx_dgemma.bench",
    "mlx_dgemma.lora",
    "mlx_dgemma.fuse",
    "mlx_dgemma.demo.eval",
    "mlx_dgemma.server.__main__",
    "mlx_dgemma.convert.__main__",
)


@pytest.mark.skipif(
    sys.platform != "linux" or not any(os.path.exists(p) for p in fast_blas.CANDIDATES),
    reason="needs OpenBLAS on Linux",
)
@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_each_entry_point_loads_the_blas_before_mlx(module):
    out = run(f"import {module}\nfrom mlx_dgemma import fast_blas\nprint(fast_blas.loaded)")
    assert out.returncode == 0 and out.stdout.strip() in fast_blas.CANDIDATES, (out.stdout, out.stderr[-2000:])


@pytest.mark.skipif(sys.platform != "linux", reason="MLX_DGEMMA_BLAS is read on Linux only")
def test_library_modules_leave_the_blas_to_the_entry_points():
    """A library module imported first (it imports mlx.core) and the engine's modules after it say
    nothing of the BLAS, even with one named: none of them tries to load it."""
    script = (
        "import mlx_dgemma.loader, mlx_dgemma.engine.request, mlx_dgemma.engine.batch, mlx_dgemma.api\n"
        "from mlx_dgemma import fast_blas\nprint(fast_blas.loaded)"
    )
    out = run(script, MLX_DGEMMA_BLAS=fast_blas.CANDIDATES[0])
    assert out.returncode == 0 and out.stderr == "" and out.stdout.strip() == "None", out.stderr[-2000:]
