"""The package's layering runs one way: no module imports another that imports it back (at module
level or inside a function), no module reaches into another's private names, and every third-party
module imported is declared in pyproject.toml."""

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_dgemma"


def imports_of(path: Path) -> tuple[set[str], set[str]]:
    """Sibling modules ``path`` imports anywhere in it, and the private names it takes from them."""
    modules, private = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            targets = {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
            modules |= targets
            private |= {f"{node.module}.{a.name}" for a in node.names if node.module and a.name.startswith("_")}
    return modules, private


def test_no_import_cycle_and_no_private_name_across_modules():
    graph, borrowed = {}, []
    names = {p.stem for p in PACKAGE.glob("*.py")}
    for path in PACKAGE.glob("*.py"):
        modules, private = imports_of(path)
        graph[path.stem] = (modules & names) - {path.stem}
        borrowed += [f"{path.stem} imports {name}" for name in private]
    assert not borrowed, borrowed

    def reaches(start: str, goal: str, seen: set) -> bool:
        return any(m == goal or (m not in seen and not seen.add(m) and reaches(m, goal, seen)) for m in graph[start])

    cycles = [m for m in graph if reaches(m, m, set())]
    assert not cycles, f"modules on an import cycle: {sorted(cycles)}"


def third_party_imports() -> dict[str, str]:
    """Top-level modules outside the standard library that the package imports (anywhere), each with
    a file that imports it."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != PACKAGE.name:
                    found.setdefault(top, str(path.relative_to(PACKAGE.parent)))
    return found


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_third_party_import_is_declared():
    """Each module the package imports comes from a distribution pyproject.toml declares (as a
    dependency or in an extra), not only as a dependency of another (yaml arrives with mlx-lm)."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    declared = {normalized(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in requirements}
    # Import names to distributions as installed (yaml -> PyYAML, PIL -> pillow, mlx -> mlx or mlx-cpu).
    distributions = importlib.metadata.packages_distributions()
    undeclared = {module: path for module, path in third_party_imports().items()
                  if not declared & {normalized(d) for d in distributions.get(module, [module])}}
    assert undeclared == {}, f"imported but not declared in pyproject.toml: {undeclared}"
