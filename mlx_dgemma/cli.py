"""What every command line of the package does at its edge: exit codes and one-line errors.

``@command_line`` on a CLI's entry function (under Click's decorators, on the callback itself):

* 0 when it returns; 1 with one ``Error: ...`` line for bad input (a ``ValueError``, the typed
  errors of errors.py) or a file or output that cannot be written (stdout on a full disk, a closed
  pipe);
* 130 with one line on Ctrl-C, wherever it lands (loading, generating, training, fusing, evaluating,
  converting), never Click's "Aborted!" nor a traceback.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

from .errors import MissingExtra

INTERRUPTED = 130  # 128 + SIGINT, as shells report it


def fail(message: str, status: int = 1):
    print(f"Error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    raise SystemExit(status)


class OutputError(OSError):
    """Standard output refused a write (a full disk, a closed pipe)."""


class _GuardedStdout:
    """``sys.stdout`` whose failed writes are ``OutputError``, told apart from the command's own files."""

    def __init__(self, stream):
        self._stream = stream

    def _guarded(self, method, *args):
        try:
            return method(*args)
        except OSError as e:
            raise OutputError(e.errno, e.strerror) from None

    def write(self, text):
        return self._guarded(self._stream.write, text)

    def flush(self):
        return self._guarded(self._stream.flush)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null, so that the interpreter's last flush does not fail again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.__stdout__.fileno())
    except (OSError, AttributeError, ValueError):
        pass
    sys.stdout = open(os.devnull, "w")


def command_line(main):
    @functools.wraps(main)
    def guarded(*args, **kwargs):
        stdout = sys.stdout
        sys.stdout = _GuardedStdout(stdout)
        try:
            result = main(*args, **kwargs)
            sys.stdout.flush()
            return result
        except KeyboardInterrupt:
            _silence_stdout()
            fail("interrupted", INTERRUPTED)
        except OutputError as e:
            _silence_stdout()
            fail(f"cannot write the output to stdout ({e.strerror})")
        except (ValueError, MissingExtra) as e:  # the typed bad-input errors: the message says what is wrong
            fail(str(e))
        except OSError as e:  # a file of the command's own that cannot be read or written
            fail(f"{e.filename or 'a file'}: {e.strerror or e}")
        finally:
            if isinstance(sys.stdout, _GuardedStdout):  # a caller in the same process gets its stream back
                sys.stdout = stdout

    return guarded


def check_writable_folder(folder: Path, flag: str) -> None:
    """``folder`` is, or can be created as, a folder that takes new files; nothing is created here
    (checked before a long run writes into it)."""
    folder = Path(folder).expanduser().absolute()
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{flag} {folder}: {existing} is not a folder; choose another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {folder}: {existing} is not writable; choose another path")


def several_values():
    """The ``cls`` of a Click option (with ``multiple=True``) that takes every value up to the next
    option, as argparse's ``nargs="+"``: ``--prefix 64 1024 8192``; repeating the flag adds more."""
    import click

    class Several(click.Option):
        def add_to_parser(self, parser, ctx):
            super().add_to_parser(parser, ctx)
            option = parser._long_opt.get(self.opts[0])
            take_one = option.process

            def take_all(value, state):
                values = [value]
                while state.rargs and not state.rargs[0].startswith("-"):
                    values.append(state.rargs.pop(0))
                for v in values:
                    take_one(v, state)

            option.process = take_all

    return Several


def sampling_options(command):
    """``--temp``, ``--top-p``, ``--min-p`` and ``--top-k`` (mlx-lm's flags): ``temperature``, ``top_p``,
    ``min_p`` and ``top_k``, each None when not given (generate's sampling; the server's default for a
    request that does not set it)."""
    import click

    from .validate import check_min_p, check_temperature, check_top_k, check_top_p, option

    options = [
        click.option(
            "--temp",
            "temperature",
            type=float,
            callback=option(check_temperature),
            help="Sampling temperature: ar and verified draw tokens at it [default: 0, greedy]; diffusion "
            "draws each position at it times the schedule's temperature [default: 1, the schedule's; "
            "0: greedy].",
        ),
        click.option("--top-p", type=float, callback=option(check_top_p), help="Sampling top-p [default: 1, off]."),
        click.option("--min-p", type=float, callback=option(check_min_p), help="Sampling min-p [default: 0, off]."),
        click.option("--top-k", type=int, callback=option(check_top_k), help="Sampling top-k [default: 0, off]."),
    ]
    for add in reversed(options):
        command = add(command)
    return command


def kv_cache_options(command):
    """``--kv-bits``, ``--kv-group-size`` and ``--quantized-kv-start`` (mlx-lm's flags), as generate and
    the server take them: ``kv_bits`` (None or an int), ``kv_group_size`` and ``quantized_kv_start``."""
    import click

    from .options import KV_BITS, KV_GROUP_SIZE, KV_GROUP_SIZES, QUANTIZED_KV_START

    options = [
        click.option(
            "--kv-bits",
            type=click.Choice([str(b) for b in KV_BITS]),
            callback=lambda c, p, v: v and int(v),
            help="Store the KV cache at this many bits, affine per group of --kv-group-size along the "
            "head dimension [default: the activations' dtype].",
        ),
        click.option(
            "--kv-group-size",
            type=click.Choice([str(g) for g in KV_GROUP_SIZES]),
            default=str(KV_GROUP_SIZE),
            show_default=True,
            callback=lambda c, p, v: int(v),
            help="Elements per quantization group of the KV cache.",
        ),
        click.option(
            "--quantized-kv-start",
            type=click.IntRange(min=0),
            default=QUANTIZED_KV_START,
            show_default=True,
            help="Positions a KV cache holds before it is quantized (with --kv-bits).",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command
