"""``python -m mlx_dgemma COMMAND [FLAGS]``: the command lines by name, as ``python -m mlx_lm generate``
runs mlx-lm's (``python -m mlx_dgemma generate`` is ``python -m mlx_dgemma.generate``)."""

from __future__ import annotations

import importlib
import sys

from .errors import MissingExtra

COMMANDS = {
    "generate": "generate",
    "convert": "convert.__main__",
    "server": "server.__main__",
    "lora": "lora",
    "fuse": "fuse",
    "bench": "bench",
    "eval": "demo.eval",
}
USAGE = f"usage: python -m mlx_dgemma {{{','.join(COMMANDS)}}} [FLAGS]  (each command takes --help)"


def main(argv: list[str] | None = None) -> None:
    from_command_line = argv is None
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        raise SystemExit(0 if argv else 2)
    command, flags = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"{USAGE}\nError: no command {command[:40]!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        raise SystemExit(2)
    run_command(command, flags, f"python -m mlx_dgemma {command}", from_command_line)


def server() -> None:
    """The mlx-dgemma-server script."""
    run_command("server", sys.argv[1:], "mlx-dgemma-server", True)


def run_command(command: str, flags: list[str], prog: str, from_command_line: bool) -> None:
    if from_command_line:
        sys.argv[0] = prog  # (argparse's usage line reads it)
    try:
        entry = importlib.import_module(f"mlx_dgemma.{COMMANDS[command]}").main
    except MissingExtra as e:
        print(f"Error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    if hasattr(entry, "main"):  # a Click command
        entry.main(flags, prog_name=prog)
    else:  # argparse's, or convert's own (it picks its subcommand)
        entry(flags)


if __name__ == "__main__":
    main()
