"""The fenced shell commands of README.md and docs/*.md work as written.

Every command of a ```bash block (or sh, shell, console) is parsed like a shell line: backslash
continuations joined, comments dropped, `&&`/`;`/`|` chains split, `NAME=value` prefixes and
redirections taken off. A Python entry point (`python -m MODULE`, `python SCRIPT.py`, a console
script of this project or of MLX, the program `mlx.launch` starts) must exist and accept every
flag the command gives it (each appears in its `--help`); a `pip install '.[extra]'` must name an
extra of pyproject.toml. Generation on the bundled demo model runs (its tokens capped), as does
every `--help`; under `-m slow` every command that needs no Hub model, no file the page does not
make, no second machine and no server runs too (in a copy of the repository, each block's
commands in order), and passes if it exits 0 or is still running after its time limit.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_FENCES = {"bash", "sh", "shell", "console", "zsh"}
CHAIN = {"&&", "||", ";", "|", "&"}
REDIRECT = re.compile(r"^\d*(<<|<|>|>>)$")
PYTHONS = {"python", "python3", "$(which python)", "$(which python3)"}
NEVER_RUN = {"pip", "pytest", "mlx_dgemma.server"}  # changes the environment, runs the suite, or serves for ever
INPUT_FLAGS = {
    "--model",
    "--hf-path",
    "--data",
    "-c",
    "--config",
    "--template",
    "--schema",
    "--image",
    "--peer-python",
    "--peer-script",
    "--resume-adapter-file",
    "--adapter-path",
}
SECOND_MACHINE = {"--hostfile", "--hosts"}
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]+$")  # PATH, CK, DIR, SRC: a value the reader fills in
QUICK = {"mlx_dgemma.generate"}  # seconds on the bundled demo
QUICK_MAX_TOKENS = "16"


def pyproject_table(name: str) -> dict[str, str]:
    """``key = value`` lines of one table of pyproject.toml (tomllib is Python 3.11+)."""
    text = (ROOT / "pyproject.toml").read_text()
    body = text.split(f"\n[{name}]\n", 1)[1].split("\n[", 1)[0]
    return {m[1]: m[2].strip().strip('"') for m in re.finditer(r"^([\w.-]+)\s*=\s*(.*)$", body, re.M)}


SCRIPTS_TABLE = pyproject_table("project.scripts")
EXTRAS = pyproject_table("project.optional-dependencies")


@dataclass
class Command:
    page: str
    line: str  # the logical line it came from
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = "."  # where the block's `cd` left it, relative to the repository
    piped: bool = False  # its input is the previous command's output
    stdin: str | None = None
    stdout: str | None = None

    def __str__(self) -> str:
        return f"{self.page}: {shlex.join(self.argv)}"


@dataclass
class EntryPoint:
    """What runs: `python -m module` or `python script` (or an executable), and the arguments it gets."""

    program: list[str]  # the argv prefix that runs it (python -m X, python path, or an executable)
    name: str  # module name, script path or executable
    args: list[str]
    launcher: Command | None = None  # mlx.launch around it


def shell_blocks(text: str) -> list[str]:
    blocks, current = [], None
    for line in text.splitlines():
        fence = re.match(r"^\s*```+\s*([\w+-]*)", line)
        if fence and current is None:
            current = [] if fence.group(1).lower() in SHELL_FENCES else False
        elif fence:
            if current:
                blocks.append("\n".join(current))
            current = None
        elif current is not False and current is not None:
            current.append(line)
    return blocks


def tokens(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def logical_lines(block: str) -> list[str]:
    """A block's lines with backslash continuations and quotes left open joined."""
    lines, pending, heredoc = [], "", None
    for raw in block.splitlines():
        if heredoc is not None:  # a here-document's body is input, not commands
            heredoc = None if raw.strip() == heredoc else heredoc
            continue
        raw = re.sub(r"^\s*\$ ", "", raw)  # a console prompt
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        pending += raw
        try:
            tokens(pending)
        except ValueError:  # a quote still open: the next line continues it
            pending += "\n"
            continue
        if pending.strip():
            lines.append(pending)
            if end := re.search(r"<<-?\s*['\"]?(\w+)", pending):
                heredoc = end.group(1)
        pending = ""
    return lines


def commands(page: Path) -> list[list[Command]]:
    return commands_in(page.read_text(), page.relative_to(ROOT).as_posix())


def commands_in(text: str, name: str) -> list[list[Command]]:
    """Each shell block's commands, in order."""
    out = []
    for block in shell_blocks(text):
        cmds, cwd = [], Path(".")
        for line in logical_lines(block):
            parts: list[tuple[bool, list[str]]] = [(False, [])]
            for tok in tokens(line):
                if tok in CHAIN:
                    parts.append((tok == "|", []))
                else:
                    parts[-1][1].append(tok)
            for piped, part in parts:
                if not part:
                    continue
                if part[0] == "cd" and len(part) == 2:
                    cwd = cwd / part[1]
                    continue
                cmd = Command(name, line, [], cwd=cwd.as_posix(), piped=piped)
                it = iter(part)
                for tok in it:
                    if REDIRECT.match(tok):
                        target = next(it, None)
                        setattr(cmd, "stdin" if "<" in tok else "stdout", target)
                    elif not cmd.argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tok):
                        key, value = tok.split("=", 1)
                        cmd.env[key] = value
                    else:
                        cmd.argv.append(tok)
                if cmd.argv:
                    cmds.append(cmd)
        out.append(cmds)
    return out


def console_scripts() -> dict[str, list[str]]:
    """Executable name → the argv prefix that runs it with this interpreter."""
    scripts = {
        name: [
            sys.executable,
            "-c",
            f"import sys; from {target.split(':')[0]} import "
            f"{target.split(':')[1]} as m; sys.argv[0] = {name!r}; sys.exit(m())",
        ]
        for name, target in SCRIPTS_TABLE.items()
    }
    from importlib.metadata import entry_points

    for ep in entry_points(group="console_scripts"):
        if ep.name.startswith("mlx.") and shutil.which(ep.name):
            scripts.setdefault(ep.name, [shutil.which(ep.name)])
    return scripts


SCRIPTS = console_scripts()


def python_entry(args: list[str]) -> EntryPoint | None:
    """`-m module rest` or `script.py rest` (the words after `python`)."""
    if len(args) >= 2 and args[0] == "-m":
        return EntryPoint([sys.executable, "-m", args[1]], args[1], args[2:])
    if args and args[0].endswith(".py"):
        return EntryPoint([sys.executable, args[0]], args[0], args[1:])
    return None


def entry_point(cmd: Command) -> EntryPoint | None:
    head, rest = cmd.argv[0], cmd.argv[1:]
    if head in PYTHONS or head.endswith("/python"):
        return python_entry(rest)
    if head == "mlx.launch":
        if "--" in rest:
            inner = rest[rest.index("--") + 1 :]
        else:
            inner = rest[next((i for i, a in enumerate(rest) if a.endswith(".py")), len(rest)) :]
        ep = python_entry(inner)
        if ep is not None:
            ep.launcher = Command(cmd.page, cmd.line, cmd.argv[: len(cmd.argv) - len(inner)], cmd.env)
        return ep
    if head in SCRIPTS:
        return EntryPoint(SCRIPTS[head], head, rest)
    return None


def module_exists(name: str) -> bool:
    sys.path.insert(0, str(ROOT))
    try:
        return find_spec(name) is not None
    except ModuleNotFoundError:
        return False
    finally:
        sys.path.remove(str(ROOT))


def env_for(extra: dict[str, str], root: Path = ROOT) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(root), **extra)
    env["PATH"] = f"{python_bin()}{os.pathsep}{env.get('PATH', '')}"
    return env


@functools.cache
def python_bin() -> str:
    """A folder whose `python` is this interpreter, for the programs a command starts itself."""
    folder = Path(tempfile.mkdtemp(prefix="test-docs-bin-"))
    for name in ("python", "python3"):
        (folder / name).symlink_to(sys.executable)
    return str(folder)


@functools.cache
def help_text(program: tuple[str, ...], cwd: str = ".") -> str | None:
    """`PROGRAM --help`'s output, or None when it fails."""
    proc = subprocess.run(
        [*program, "--help"], cwd=ROOT / cwd, env=env_for({}), capture_output=True, text=True, timeout=120
    )
    return proc.stdout + proc.stderr if proc.returncode == 0 else None


def flags(args: list[str]) -> list[str]:
    out = []
    for a in args:
        if a == "--":
            break
        if re.match(r"^--?[A-Za-z][\w-]*", a):
            out.append(a.split("=", 1)[0])
    return out


def source_of(ep: EntryPoint, cwd: str) -> Path | None:
    """The file of this repository that defines ``ep``'s options, if it is one."""
    if ep.name.endswith(".py"):
        path = ROOT / cwd / ep.name
    elif ep.program[1:2] == ["-m"] and module_exists(ep.name):
        sys.path.insert(0, str(ROOT))
        try:
            spec = find_spec(ep.name)
            if spec.submodule_search_locations:  # a package runs its __main__
                spec = find_spec(f"{ep.name}.__main__")
        finally:
            sys.path.remove(str(ROOT))
        path = Path(spec.origin) if spec and spec.origin else None
    else:
        return None
    return path if path and path.is_file() and ROOT in path.resolve().parents else None


def declared_flags(path: Path) -> set[str]:
    """Option names written as string literals in ``path`` (argparse's and click's "--a/--b")."""
    literals = re.findall(r"""["'](-{1,2}[A-Za-z][\w/-]*)["']""", path.read_text())
    return {f for lit in literals for f in lit.split("/") if f.startswith("-")}


def missing_flags(program: list[str], args: list[str], cwd: str = ".", source: Path | None = None) -> list[str] | str:
    """The flags of ``args`` that ``source`` does not declare and ``program --help`` does not list,
    or why there is no help."""
    wanted = [f for f in flags(args) if source is None or f not in declared_flags(source)]
    if not wanted:
        return []
    helps = [help_text(tuple(program), cwd)]
    if args and not args[0].startswith("-"):  # a subcommand (or a positional argument, whose help is the same)
        helps.append(help_text((*program, args[0]), cwd))
    text = "\n".join(h for h in helps if h)
    if not text:
        return f"`{shlex.join(program)} --help` fails"
    return [f for f in wanted if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)]


def check_parses(cmd: Command) -> list[str]:
    """What is wrong with ``cmd`` as written (empty when nothing)."""
    if cmd.argv[0] in ("pip", "pip3") or cmd.argv[1:3] == ["-m", "pip"]:
        return [
            f"{cmd}: no extra {e!r} in pyproject.toml"
            for a in cmd.argv
            for group in re.findall(r"^\.\[(.+)\]$", a)
            for e in group.split(",")
            if e not in EXTRAS
        ]
    ep = entry_point(cmd)
    if ep is None:
        return []
    problems = []
    if ep.launcher is not None:
        launcher_args = [a for a in ep.launcher.argv[1:] if a != "--"]
        bad = missing_flags(SCRIPTS.get("mlx.launch", ["mlx.launch"]), launcher_args)
        problems += [f"{cmd}: {bad}"] if isinstance(bad, str) else [f"{cmd}: mlx.launch has no {f}" for f in bad]
    if ep.program[1:2] == ["-m"] and not module_exists(ep.name):
        return [*problems, f"{cmd}: no module {ep.name}"]
    if ep.name.endswith(".py") and not (ROOT / cmd.cwd / ep.name).is_file():
        return [*problems, f"{cmd}: no file {ep.name}"]
    bad = missing_flags(ep.program, ep.args, cmd.cwd, source_of(ep, cmd.cwd))
    if isinstance(bad, str):
        return [*problems, f"{cmd}: {bad}"]
    return problems + [f"{cmd}: {ep.name} has no {f}" for f in bad]


def why_not_run(cmd: Command, root: Path, quick: bool) -> str | None:
    """None when ``cmd`` can run now in the repository at ``root``, else the reason it cannot."""
    cwd = root / cmd.cwd
    ep = entry_point(cmd)
    if ep is None:
        return "not a Python entry point"
    if ep.name in NEVER_RUN or (cmd.argv[1:3] == ["-m", "pip"]):
        return f"{ep.name} is not run"
    if "--help" in ep.args or "-h" in ep.args:
        return None
    if quick and (ep.name not in QUICK or ep.launcher is not None):
        return "takes more than seconds"
    args = ep.args + (ep.launcher.argv if ep.launcher else [])
    if SECOND_MACHINE & set(args):
        return "a second machine"
    if any(PLACEHOLDER.match(a) for a in args):
        return "a value to fill in"
    training = "--train" in args
    for flag, value in zip(args, args[1:]):
        if flag in INPUT_FLAGS and not (flag == "--adapter-path" and training) and not (cwd / value).exists():
            return f"{flag} {value} is not here"
    if cmd.stdin is not None and not (cwd / cmd.stdin).exists():
        return f"< {cmd.stdin} is not here"
    if cmd.piped or ("-" in args and cmd.stdin is None):
        return "reads another command's output"
    if any("$" in a and a not in PYTHONS for a in cmd.argv):
        return "a shell expansion"
    return None


def run(cmd: Command, root: Path, quick: bool, timeout: float) -> str | None:
    """Run ``cmd`` in the repository at ``root``; None when it exits 0 (or, not quick, runs past
    ``timeout``), else what failed."""
    cwd = root / cmd.cwd
    ep = entry_point(cmd)
    argv = [sys.executable if a in PYTHONS else a for a in cmd.argv]
    if argv[0] == "mlx.launch":
        argv[0] = SCRIPTS["mlx.launch"][0]
    elif ep.launcher is None:
        argv = ep.program + ep.args
    if quick and ep.name in QUICK and "--help" not in ep.args and not {"--schema", "--template"} & set(ep.args):
        argv += ["--max-tokens", QUICK_MAX_TOKENS]  # (a template sets its own length, a schema needs its room)
    temp = root.parent / "tmp"  # the programs' temporary files stay with the test's
    temp.mkdir(exist_ok=True)
    stdin = open(cwd / cmd.stdin, "rb") if cmd.stdin else subprocess.DEVNULL
    # A session of its own, so that a timeout ends what the command started too (a server, ranks).
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env_for({**cmd.env, "TMPDIR": str(temp)}, root),
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return f"{cmd}: still running after {timeout:.0f} s" if quick else None
    finally:
        if cmd.stdin:
            stdin.close()
    if cmd.stdout:
        (cwd / cmd.stdout).write_bytes(out)
    if proc.returncode != 0:
        return f"{cmd}: exit {proc.returncode}: {err.decode(errors='replace')[-600:]}"
    return None


def repo_copy(tmp_path: Path) -> Path:
    """The working tree without .git: commands that write next to themselves write here."""
    copy = tmp_path / "repo"
    shutil.copytree(
        ROOT, copy, ignore=shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", ".ruff_cache", "*.egg-info")
    )
    return copy


def run_page(page: Path, tmp_path: Path, quick: bool, timeout: float) -> tuple[list[str], int]:
    copy = None
    failures, ran = [], 0
    for block in commands(page):
        for cmd in block:
            if why_not_run(cmd, copy or ROOT, quick) is not None:
                continue
            copy = copy or repo_copy(tmp_path)
            ran += 1
            failure = run(cmd, copy, quick, timeout)
            if failure:
                failures.append(failure)
    return failures, ran


PAGE_IDS = [p.relative_to(ROOT).as_posix() for p in PAGES]


def test_readme_is_short_and_starts_with_the_setup_commands():
    readme = ROOT / "README.md"
    assert readme.stat().st_size < 12 * 1024, "README.md is over 12 KB: move detail to a page under docs/"
    first = commands(readme)[0]
    assert [c.argv[:2] for c in first[:2]] == [["pip", "install"], ["python", "-m"]], first
    assert first[1].argv[2] == "mlx_dgemma.generate" and "--model" not in first[1].argv  # the bundled demo
    tests = [c for c in first[2:] if c.argv[-3:] == ["-m", "pytest", "-q"] or c.argv[1:4] == ["-m", "pytest", "-q"]]
    assert tests and tests[0].env.get("HF_HUB_OFFLINE") == "1", "the second set-up command runs the tests"


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_commands_parse(page):
    cmds = [c for block in commands(page) for c in block]
    with ThreadPoolExecutor(2) as pool:  # fill help_text's cache two at a time
        list(pool.map(lambda c: check_parses(c), cmds))
    problems = [p for c in cmds for p in check_parses(c)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_quick_commands_run(page, tmp_path):
    failures, ran = run_page(page, tmp_path, quick=True, timeout=120)
    assert not failures, "\n".join(failures)
    if page.name == "README.md":
        assert ran >= 2, "the README's generations on the bundled demo are among what runs"


def test_the_readmes_server_answers_its_curl_commands():
    """The README's server block as written: its server (on a free port for its 8080) answers each of
    its curl commands with a reply, not an error."""
    [block] = [
        b for b in commands(ROOT / "README.md") if any(c.argv[:3] == ["python", "-m", "mlx_dgemma.server"] for c in b)
    ]
    [start] = [c for c in block if c.argv[:3] == ["python", "-m", "mlx_dgemma.server"]]
    curls = [c for c in block if c.argv[0] == "curl"]
    assert curls and "--model" not in start.argv, "the block serves the bundled demo and asks it with curl"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    local = lambda argv: [str(port) if a == "8080" else a.replace("localhost:8080", f"localhost:{port}") for a in argv]  # noqa: E731
    server = subprocess.Popen(
        [sys.executable, *local(start.argv[1:])],
        cwd=ROOT,
        env=env_for(start.env),
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "the README's server did not start"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                time.sleep(0.2)
        for curl in curls:
            done = subprocess.run(local(curl.argv), capture_output=True, text=True, timeout=120)
            reply = json.loads(done.stdout) if done.returncode == 0 else {}
            assert reply.get("choices") or reply.get("response"), f"{curl}: {done.stdout[:300]} {done.stderr[:300]}"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.communicate(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_commands_run(page, tmp_path):
    failures, _ = run_page(page, tmp_path, quick=False, timeout=180)
    assert not failures, "\n".join(failures)


def test_shell_lines_are_split_as_a_shell_splits_them():
    text = (
        "```bash\nA=1 python -m mod --x 1 \\\n  --y 'a b' && pip install -e '.[test]'  # note\n"
        "python s.py < in.txt > out.txt\ncurl -d '{\"a\":\n 1}' u\n```\n```python\nprint(1)\n```\n"
    )
    [block] = commands_in(text, "x.md")
    assert [(c.argv, c.env, c.stdin, c.stdout) for c in block] == [
        (["python", "-m", "mod", "--x", "1", "--y", "a b"], {"A": "1"}, None, None),
        (["pip", "install", "-e", ".[test]"], {}, None, None),
        (["python", "s.py"], {}, "in.txt", "out.txt"),
        (["curl", "-d", '{"a":\n 1}', "u"], {}, None, None),
    ]
    assert flags(block[0].argv) == ["-m", "--x", "--y"]

    [block] = commands_in(
        "```console\n$ cd examples && python chat.py --turns 2\npython - <<EOF\nprint(1)\n"
        "python -m x\nEOF\necho hi | python -m y --prompt -\n```\n",
        "x.md",
    )
    assert [(c.argv, c.cwd, c.piped) for c in block] == [
        (["python", "chat.py", "--turns", "2"], "examples", False),
        (["python", "-"], "examples", False),
        (["echo", "hi"], "examples", False),
        (["python", "-m", "y", "--prompt", "-"], "examples", True),
    ]


def test_parse_check_finds_what_is_wrong():
    def check(line):
        return check_parses(commands_in(f"```bash\n{line}\n```\n", "x.md")[0][0])

    assert check("python -m mlx_dgemma.generate --prompt hi --max-tokens 8 -m 8") == []
    assert check("mlx.launch -n 2 --backend ring -- -m mlx_dgemma.generate --seed 1") == []
    assert "no --no-such-flag" in check("python -m mlx_dgemma.generate --no-such-flag 1")[0]
    assert "mlx.launch has no --nodes" in check("mlx.launch --nodes 2 -- -m mlx_dgemma.generate")[0]
    assert "no module" in check("python -m mlx_dgemma.no_such_module --help")[0]
    assert "no file" in check("python benchmarks/no_such_benchmark.py")[0]
    assert "no extra 'gpu'" in check("pip install -e '.[gpu]'")[0]
    assert check("python -m mlx_dgemma.convert report --hf-path SRC --q-bits 4") == []  # a subcommand's flags


def test_readme_predicted_table_is_what_the_roofline_predicts():
    from mlx_dgemma.engine.policy import predicted_table

    text = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| ((?:M\d|RTX|H\d)[^|]*?)(?: \(4-bit\))? \| (.+) \|$", text, re.M)
    assert len(rows) >= 5, "the README's predicted table is gone"
    predicted = predicted_table()
    for device, cells in rows:
        p = predicted[device]
        expected = [
            f"{p['ar_tok_s']:.1f}",
            f"{p['diffusion_tok_s']:.1f}",
            f"{p['speedup']:.2f}x",
            f"{p['verified_tok_s']:.1f} ({p['verified_length']}/{p['verified_steps']})",
            f"{p['verified_half_tok_s']:.1f} ({p['verified_half_length']}/{p['verified_half_steps']})",
        ]
        assert [c.strip() for c in cells.split("|")] == expected, device


def test_a_command_that_fails_is_reported(tmp_path):
    [[good, bad]] = commands_in(
        '```bash\npython -m mlx_dgemma.generate --prompt "reverse: abc"\n'
        'python -m mlx_dgemma.generate --prompt " "\n```\n',
        "x.md",
    )
    root = repo_copy(tmp_path)
    assert run(good, root, quick=True, timeout=120) is None
    assert "exit 1: Error: the prompt is empty" in run(bad, root, quick=True, timeout=120)


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_every_relative_link_names_a_file_of_the_repository(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):  # a web address or an anchor
            continue
        if not (page.parent / target.split("#")[0]).exists():
            broken.append(target)
    assert broken == [], f"{page.relative_to(ROOT)} links to files that do not exist: {broken}"
