"""Importing the package has no side effects: no mlx.core, no BLAS loaded, until its API is used."""

import os
import subprocess
import sys

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
