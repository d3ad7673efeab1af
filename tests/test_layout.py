"""The package's layering runs one way: no module imports another that imports it back (at module
level or inside a function), and no module reaches into another's private names."""

import ast
from pathlib import Path

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
