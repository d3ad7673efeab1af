"""The package as pip installs it: the wheel and sdist built from this tree (setuptools' own backend, as
pip builds them), their metadata, and the wheel installed in a virtual environment, run from another
folder: its version, the demo's answer, its types, and the one-line errors of the extras it lacks."""

import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
ONLY_IN_EXTRAS = ("mlx-lm", "transformers", "torch", "starlette", "uvicorn")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    """The wheel and the sdist of the working tree (its files as git lists them, copied elsewhere so
    that the build leaves nothing here)."""
    tree, dist = tmp_path_factory.mktemp("tree"), tmp_path_factory.mktemp("dist")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        source = ROOT / name.decode()
        if source.is_file():
            (tree / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, tree / name.decode())
    for kind in ("wheel", "sdist"):  # one process each, as pip's build frontends run them
        build = f"from setuptools import build_meta; import sys; build_meta.build_{kind}(sys.argv[1])"
        subprocess.run([sys.executable, "-c", build, str(dist)], cwd=tree, check=True, capture_output=True)
    return next(dist.glob("*.whl")), next(dist.glob("*.tar.gz"))


def metadata(wheel: Path) -> list[tuple[str, str]]:
    with zipfile.ZipFile(wheel) as z:
        text = z.read(f"mlx_dgemma-{PROJECT['version']}.dist-info/METADATA").decode()
    head = text.split("\n\n", 1)[0]
    return [tuple(line.split(": ", 1)) for line in head.split("\n") if ": " in line]


def test_the_wheel_says_what_it_needs_and_ships_its_licence_and_types(built):
    wheel, _ = built
    fields = metadata(wheel)
    values = lambda key: [v for k, v in fields if k == key]  # noqa: E731
    assert values("Requires-Python") == [">=3.11"]
    assert values("License-Expression") == ["Apache-2.0"] and values("License-File") == ["LICENSE"]
    assert "Programming Language :: Python :: 3.11" in values("Classifier")
    assert {"server", "train"} <= set(values("Provides-Extra"))
    core = [r for r in values("Requires-Dist") if "extra ==" not in r]
    assert not [r for r in core if re.match(r"[A-Za-z0-9._-]+", r).group().lower() in ONLY_IN_EXTRAS], core
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert "mlx_dgemma/py.typed" in names
    assert f"mlx_dgemma-{PROJECT['version']}.dist-info/licenses/LICENSE" in names
    assert not [n for n in names if n.startswith("tests/")]


def test_the_sdist_holds_the_licence_and_no_tests_without_their_fixtures(built):
    _, sdist = built
    with tarfile.open(sdist) as t:
        names = [n.split("/", 1)[1] for n in t.getnames() if "/" in n]
    assert "LICENSE" in names and "pyproject.toml" in names and "mlx_dgemma/py.typed" in names
    assert not [n for n in names if n.startswith("tests")], "tests without their conftest and fixtures"


def older_python() -> str | None:
    """An interpreter older than the package's floor, where this machine has one (on the PATH, or
    installed beside this one, as pyenv and uv keep them)."""
    beside = sorted(Path(sys.base_prefix).parent.glob("3.1[0]*/bin/python3.10"))
    for found in [shutil.which("python3.10"), *map(str, beside)]:
        if found and subprocess.run([found, "-m", "pip", "--version"], capture_output=True).returncode == 0:
            return found
    return None


def test_pip_on_an_older_python_refuses_with_the_version_named(built):
    python = older_python()
    if python is None:
        pytest.skip("no Python older than 3.11 with pip on this machine")
    wheel, _ = built
    done = subprocess.run(
        [python, "-m", "pip", "install", "--dry-run", "--no-deps", str(wheel)], capture_output=True, text=True
    )
    assert done.returncode != 0 and "requires a different Python" in done.stderr and ">=3.11" in done.stderr


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory) -> Path:
    """The wheel in a virtual environment (its dependencies from this one's site-packages): its python."""
    wheel, _ = built
    home = tmp_path_factory.mktemp("venv")
    venv.create(home, system_site_packages=True, with_pip=False, symlinks=True)
    python = home / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    if subprocess.run([*pip, "--version"], capture_output=True).returncode != 0:  # pip < 22.3
        pytest.skip("this pip cannot install into another environment (--python)")
    subprocess.run([*pip, "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True)
    return python


def run(python: Path, folder: Path, *args: str, blocked: str | None = None) -> subprocess.CompletedProcess:
    """``python args`` in ``folder``; ``blocked``: a module made unimportable there (an extra not installed)."""
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HOME": str(folder)}
    if blocked is not None:
        (folder / "blocked").mkdir(exist_ok=True)
        (folder / "blocked" / "sitecustomize.py").write_text(f"import sys\nsys.modules[{blocked!r}] = None\n")
        env["PYTHONPATH"] = str(folder / "blocked")
    return subprocess.run([str(python), *args], cwd=folder, env=env, capture_output=True, text=True, timeout=300)


def test_the_installed_wheel_runs_from_another_folder(installed, tmp_path):
    done = run(installed, tmp_path, "-c", "import mlx_dgemma; print(mlx_dgemma.__version__, mlx_dgemma.__file__)")
    version, where = done.stdout.split()
    assert version == PROJECT["version"] and where.startswith(str(installed.parent.parent)), done.stdout
    done = run(installed, tmp_path, "-m", "mlx_dgemma.generate", "--prompt", "sort: 42 17 85 23 61", "--seed", "0")
    assert done.returncode == 0 and done.stdout.strip() == "17 23 42 61 85", done.stderr[-1000:]


@pytest.mark.parametrize(
    "blocked, command, extra",
    [
        ("starlette", ["-m", "mlx_dgemma.server", "--help"], "server"),
        ("uvicorn", ["-m", "mlx_dgemma", "server", "--help"], "server"),
        ("mlx_lm", ["-m", "mlx_dgemma.lora", "--train"], "train"),
        ("mlx_lm", ["-m", "mlx_dgemma.generate", "--adapter-path", "adapters", "--prompt", "x"], "train"),
    ],
    ids=["server", "server-command", "lora", "adapter-path"],
)
def test_a_missing_extra_is_one_line_naming_it(installed, tmp_path, blocked, command, extra):
    done = run(installed, tmp_path, *command, blocked=blocked)
    assert done.returncode == 1 and done.stdout == ""
    assert len(done.stderr.strip().split("\n")) == 1, done.stderr
    assert f"pip install 'mlx-dgemma[{extra}]'" in done.stderr and blocked in done.stderr


def test_type_checkers_see_the_readmes_python_block(installed, tmp_path):
    """mypy on the README's Python block, against the installed wheel (its py.typed): no error, and
    ``generate`` is the function, not the module of that name."""
    pytest.importorskip("mypy")
    block = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S)[0]
    checked = tmp_path / "readme_block.py"
    checked.write_text(
        block
        + textwrap.dedent("""
        reveal_type(generate)
        reveal_type(load)
        reveal_type(answers)
    """)
    )
    done = run(installed, tmp_path, "-m", "mypy", "--follow-imports=silent", "--no-incremental", checked.name)
    assert done.returncode == 0, done.stdout[-2000:]
    revealed = [line.split("Revealed type is ", 1)[1] for line in done.stdout.split("\n") if "Revealed type" in line]
    assert revealed[0].startswith('"def (model: mlx_dgemma.model.diffusion_gemma.DiffusionGemma')
    assert revealed[0].endswith('-> str"')
    assert "tuple[mlx_dgemma.model.diffusion_gemma.DiffusionGemma, mlx_dgemma.tokenizer.Tokenizer]" in revealed[1]
    assert revealed[2] == '"list[str]"'
