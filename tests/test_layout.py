"""The package's layering runs one way: no module imports another that imports it back (at module
level or inside a function), no module reaches into another's private names, and every third-party
module imported is declared in pyproject.toml. Every module, in subpackages too, has one job and stays
under ``MAX_LINES``.

The folders' rules: model/ (the network) and structured/ (templates, schemas, grammars) import
nothing from engine/, server/, convert/ or tuner/; engine/ imports nothing from server/, convert/ or
tuner/; no library module imports a command or the command lines' helpers (cli.py); the ground
modules import only each other; at most ``MAX_ROOT_MODULES`` modules sit at the package root."""

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_dgemma"
MAX_LINES = 600


def module_names() -> dict[str, Path]:
    """Every module of the package by dotted name below it ("policy" is policy/__init__.py)."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(name: str, path: Path, modules: set[str]) -> tuple[set[str], set[str]]:
    """Modules of the package that ``name`` imports anywhere in it (with the packages above them,
    which importing them runs), and the private names it takes from them."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    targets, private = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        base = package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
        source = ".".join(base)
        for alias in node.names:
            submodule = f"{source}.{alias.name}" if source else alias.name
            targets.add(submodule if submodule in modules else source)
            if alias.name.startswith("_") and submodule not in modules:
                private.add(f"{source}.{alias.name}")
    above = {".".join(t.split(".")[:i]) for t in targets for i in range(1, t.count(".") + 1)}
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}  # already running
    return (targets | above) - own - {name, ""}, private


def test_no_import_cycle_and_no_private_name_across_modules():
    modules = module_names()
    graph, borrowed = {}, []
    for name, path in modules.items():
        targets, private = imports_of(name, path, set(modules))
        graph[name] = {t for t in targets if t in modules}
        borrowed += [f"{name} imports {p}" for p in private]
    assert not borrowed, borrowed

    def reaches(start: str, goal: str, seen: set) -> bool:
        return any(m == goal or (m not in seen and not seen.add(m) and reaches(m, goal, seen)) for m in graph[start])

    cycles = [m for m in graph if reaches(m, m, set())]
    assert not cycles, f"modules on an import cycle: {sorted(cycles)}"


def test_no_module_over_the_line_limit():
    lines = {name: len(path.read_text().splitlines()) for name, path in module_names().items()}
    over = {name: n for name, n in lines.items() if n > MAX_LINES}
    assert not over, f"over {MAX_LINES} lines, split them by role: {over}"


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
    undeclared = {
        module: path
        for module, path in third_party_imports().items()
        if not declared & {normalized(d) for d in distributions.get(module, [module])}
    }
    assert undeclared == {}, f"imported but not declared in pyproject.toml: {undeclared}"


MAX_PARAMETERS = 8
# The generation path: the API, the engine (the sampler, drafting, the policy...), the caches and the server.
GENERATION_PATH = ("api", "engine", "options", "model.cache", "server")


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    """Whether module ``name`` is one of ``prefixes`` or inside one of them."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def parameter_count(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Named parameters (positional and keyword-only; not self, cls, *args or **kwargs)."""
    a = function.args
    return sum(p.arg not in ("self", "cls") for p in a.posonlyargs + a.args + a.kwonlyargs)


def is_click_command(function) -> bool:
    """A command line's entry point: click passes each of its flags as a parameter."""
    return any(
        isinstance(d, ast.Call) and ast.unparse(d.func) in ("click.command", "command", "click.group")
        for d in function.decorator_list
    )


def test_no_function_of_the_generation_path_takes_more_than_eight_parameters():
    """Options travel as one object (options.GenerationArgs, policy.DraftRequest, server.Limits)."""
    crowded = []
    for name, path in module_names().items():
        if not within(name, GENERATION_PATH):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and not is_click_command(node)
                and parameter_count(node) > MAX_PARAMETERS
            ):
                crowded.append(f"{name}.{node.name} ({parameter_count(node)})")
    assert not crowded, f"more than {MAX_PARAMETERS} parameters: {crowded}"


# Public names defined in several modules on purpose: each command-line module's ``main``, each server
# API module's ``routes`` (server/routes.py gathers them), and ``fast_blas.load``, which every entry
# point (benchmarks/ too) calls as ``fast_blas.load()`` before mlx.core loads.
SHARED_NAMES = {"main", "routes", "load"}


def defined_names(path: Path) -> set[str]:
    """Public functions, classes and aliases (``A = B``) defined at the top of a module."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return {n for n in names if not n.startswith("_")}


def test_no_public_name_is_defined_in_two_modules():
    where: dict[str, list[str]] = {}
    for name, path in sorted(module_names().items()):
        for defined in defined_names(path) - SHARED_NAMES:
            where.setdefault(defined, []).append(name)
    twice = {n: modules for n, modules in where.items() if len(modules) > 1}
    assert not twice, f"defined in more than one module (rename one): {twice}"


# The modules that drive the model's generation forwards: the engine (batch.py and its rows by kind),
# denoise.py (a canvas's steps) and drafting.py (drafts and their verification). Aside: the model,
# which defines them; profiling (policy/profile.py, bench.py) and convert/report.py (a conversion's
# logit error), which time or measure single forwards; tuner/objective.py, whose differentiable
# forward has methods of the same names.
DRIVERS = ("engine.batch", "engine.rows", "engine.denoise", "engine.drafting")
MEASURING = ("model.diffusion_gemma", "engine.policy.profile", "bench", "convert.report", "tuner.objective")
GENERATION_FORWARDS = ("denoise", "next_token_logits")


def test_only_the_engine_denoise_and_drafting_drive_the_generation_forwards():
    """One driver: a second loop over ``denoise`` or ``next_token_logits`` elsewhere (a module that
    decodes by itself) is what the engine exists to keep from coming back."""
    outside = []
    for name, path in module_names().items():
        if within(name, DRIVERS) or name in MEASURING:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in GENERATION_FORWARDS
            ):
                outside.append(f"{name}:{node.lineno} {ast.unparse(node.func)}")
    assert not outside, f"the model's generation forwards called outside the engine: {outside}"


def class_fields(tree: ast.Module) -> dict[str, set[str]]:
    """Annotated fields of each class defined at the top of a module."""
    return {
        node.name: {f.target.id for f in node.body if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)}
        for node in tree.body
        if isinstance(node, ast.ClassDef)
    }


# How many option names a class may share with GenerationArgs and SamplingArgs: a plan's or a
# prepared request's settled values (policy, settings, draft_length, draft_steps; max_tokens, rng,
# temperature, template) keep the names of the options they settle.
SETTLED_NAMES = 4


def test_option_fields_are_defined_once():
    """Each option is a field of ``GenerationArgs`` or of ``SamplingArgs`` (not both), and no other
    class holds a copy of them (a second options object); ``sampler.SamplerSettings`` is what the
    sampling options override, field for field."""
    options = class_fields(ast.parse((PACKAGE / "options.py").read_text()))
    generation, sampling = options["GenerationArgs"], options["SamplingArgs"]
    assert generation and sampling and not generation & sampling, generation & sampling
    copies = []
    for name, path in module_names().items():
        if not within(name, GENERATION_PATH) or name == "options":
            continue
        for cls, names in class_fields(ast.parse(path.read_text())).items():
            shared = names & (generation | sampling)
            if len(shared) > SETTLED_NAMES and f"{name}.{cls}" != "engine.sampler.SamplerSettings":
                copies.append(f"{name}.{cls}: {sorted(shared)}")
    assert not copies, f"option fields declared outside options.py: {copies}"


MAX_ROOT_MODULES = 20
FOLDERS = ("model", "engine", "structured", "convert", "tuner", "server")
BELOW = {  # what a folder's modules import nothing from
    "model": ("engine", "server", "convert", "tuner"),
    "structured": ("engine", "server", "convert", "tuner"),
    "engine": ("server", "convert", "tuner"),
}
COMMANDS = ("generate", "lora", "fuse", "bench", "__main__", "convert.__main__", "server.__main__", "demo.eval")
COMMAND_LINE_HELPERS = ("cli",)
GROUND = ("errors", "validate", "options", "fast_blas", "cpu_threads", "safetensors_io")


def import_graph() -> dict[str, set[str]]:
    """Each module's imports of the package's modules (the packages above them left out)."""
    modules = module_names()
    return {
        name: {t for t in imports_of(name, path, set(modules))[0] if t in modules and t not in FOLDERS}
        for name, path in modules.items()
    }


def broken_rules(graph: dict[str, set[str]]) -> list[str]:
    """Every import in ``graph`` that a folder's rule forbids."""
    broken = []
    for name, targets in graph.items():
        top = name.split(".")[0]
        for target in targets:
            if target.split(".")[0] in BELOW.get(top, ()):
                broken.append(f"{name} ({top}/) imports {target}")
            if name not in COMMANDS and target in COMMANDS + COMMAND_LINE_HELPERS and name not in COMMAND_LINE_HELPERS:
                broken.append(f"library module {name} imports {target}, a command's")
            if name in GROUND and target not in GROUND:
                broken.append(f"ground module {name} imports {target}")
    return broken


def test_the_folders_import_one_way():
    assert broken_rules(import_graph()) == []


def test_the_root_holds_at_most_20_modules_beside_the_six_folders():
    root = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root
    assert [f for f in FOLDERS if not (PACKAGE / f / "__init__.py").exists()] == []


@pytest.mark.parametrize(
    "importer, imported",
    [
        ("structured.template", "engine.sampler"),  # Clamp, once the sampler's
        ("structured.grammar", "engine.filters"),  # sampling_probs
        ("convert.checkpoint", "fuse"),  # save_model and dequantize_model, once the fuse command's
        ("tuner.adapters", "cli"),  # write_atomically, once the command lines' helper
    ],
)
def test_an_old_wrong_way_import_brought_back_breaks_a_rule(importer, imported):
    graph = import_graph()
    graph[importer] = graph[importer] | {imported}
    assert [line for line in broken_rules(graph) if line.startswith(f"{importer} ") or f" {importer} " in line]
