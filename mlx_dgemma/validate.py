"""Checks of values as they come in (CLI flags, the Python API): each failure is one line that says
what is wrong and how to fix it. ``option`` turns a check into a Click callback."""

from __future__ import annotations

import json
import math
import os
import reprlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from .errors import OptionError, PromptError

MIN_TEMPERATURE = 1e-4  # below it, soft-capped logits / T overflow float32 and the canvas turns to NaN
# Above it, soft-capped logits (within +-30) / T are uniform draws already; far above, T overflows float32
# and the canvas turns to NaN.
TEMPERATURE_LIMIT = 1e4
SEED_LIMIT = 1 << 64  # mx.random.key takes an unsigned 64-bit seed
# Denoising steps a canvas may be given: 10x the released checkpoint's 48, each a forward of the decoder.
MAX_STEPS = 512


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 3, 60, 60, 40
_SHOWN.maxlist = _SHOWN.maxdict = _SHOWN.maxtuple = _SHOWN.maxset = 4


def shown(value) -> str:
    """``value`` as an error message shows it: its repr cut to a few items and characters, with work
    to match (the whole repr of a YAML alias bomb is gigabytes)."""
    text = _SHOWN.repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


def shown_json(value, width: int = 40) -> str:
    """``value`` as JSON, cut to ``width`` characters, with work to match: a string is cut before it is
    written (the first ``width`` characters of a string's JSON are those of its start's), an array or
    object shown as ``shown`` shows it."""
    if isinstance(value, str):
        return json.dumps(value[:width])[:width]
    if isinstance(value, (list, dict)):
        return shown(value)[:width]
    return json.dumps(value)[:width]


def is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def at_least(minimum: int) -> Callable[[object, str], None]:
    def check(value, name: str) -> None:
        if not is_int(value):
            raise OptionError(f"{name} must be an integer, got {shown(value)}")
        if value < minimum:
            raise OptionError(f"{name} must be at least {minimum}, got {shown(value)}")

    return check


def integer_in(low: int, high: int) -> Callable[[object, str], None]:
    """A check of an integer from ``low`` to ``high`` (a value past the bound reaches MLX's int32 or
    a loop as long as it)."""

    def check(value, name: str) -> None:
        if not is_int(value) or not low <= value <= high:
            raise OptionError(f"{name} must be an integer from {low} to {high}, got {shown(value)}")

    return check


def is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def finite_number(
    low: float, high: float | None = None, low_open: bool = False, high_open: bool = True
) -> Callable[[object, str], None]:
    """A check of a finite number from ``low`` to ``high`` (each end open or closed)."""
    bounds = (
        ""
        if high is None and low == -math.inf
        else f" {'>' if low_open else '>='} {low:g}"
        if high is None
        else f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    )

    def check(value, name: str) -> None:
        if (
            not is_number(value)
            or not math.isfinite(value)
            or value < low
            or (low_open and value == low)
            or (high is not None and (value > high or (high_open and value == high)))
        ):
            raise OptionError(f"{name} must be a finite number{bounds}, got {shown(value)}")

    return check


# The sampling filters' and penalties' values (filters.py applies them).
check_top_p = finite_number(0, 1, low_open=True, high_open=False)  # 1: off
# 1: off. It divides (or multiplies) soft-capped logits, within +-30, in float32: past these bounds a
# repeated token's logit turns to 0/0 (NaN) or overflows, and no draw is left to make.
check_repetition_penalty = finite_number(1e-4, 1e4, high_open=False)
check_penalty = finite_number(-2, 2, high_open=False)  # OpenAI's range for presence and frequency; 0: off
check_min_p = finite_number(0, 1, high_open=False)  # 0: off
check_top_k = at_least(0)  # 0: off


def check_steps(value, name: str = "steps", limit: int = MAX_STEPS) -> None:
    """Denoising steps from 1 to ``limit``: each step is a forward of the decoder, so an unbounded count
    is an unbounded request. The checkpoint's ``max_denoising_steps`` is a default, not this bound."""
    if not is_int(value) or not 1 <= value <= limit:
        raise OptionError(f"{name} must be an integer from 1 to {limit}, got {shown(value)}")


def check_seed(seed, name: str = "seed") -> None:
    if not is_int(seed) or not 0 <= seed < SEED_LIMIT:
        raise OptionError(f"{name} must be an integer from 0 to 2**64 - 1, got {shown(seed)}")


def check_temperature(value, name: str) -> None:
    """0, or from ``MIN_TEMPERATURE`` to ``TEMPERATURE_LIMIT`` (NaN, infinities and denormals give NaN canvases)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float, np.integer, np.floating))
        or not math.isfinite(value)
        or not (value == 0 or MIN_TEMPERATURE <= value <= TEMPERATURE_LIMIT)
    ):
        raise OptionError(
            f"{name} must be 0 or a finite number from {MIN_TEMPERATURE:g} to {TEMPERATURE_LIMIT:g}, got {shown(value)}"
        )


def check_temperatures(t_min, t_max) -> None:
    check_temperature(t_min, "temp-min")
    check_temperature(t_max, "temp-max")
    if not t_min < t_max:
        raise OptionError(f"temperatures need temp-min < temp-max, got {t_min} and {t_max}")


def check_entropy_bound(value, name: str = "entropy bound") -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float, np.floating))
        or not math.isfinite(value)
        or not value > 0
    ):
        raise OptionError(f"{name} must be > 0 and finite (nats), got {shown(value)}")


def check_text(text: str, what: str) -> str:
    """``text`` if it is a str that UTF-8 can encode (no lone surrogates, as undecodable arguments become)."""
    if not isinstance(text, str):
        raise PromptError(f"{what} must be text (str), got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptError(
            f"{what} is not valid UTF-8 (a bad byte at character {e.start}); re-encode it as UTF-8"
        ) from None
    return text


def decode_utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PromptError(
            f"{what} is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); re-encode it as UTF-8"
        ) from None


def check_prompt(prompt, name: str = "prompt") -> str | list[int]:
    """Text that is not blank, or a sequence of integer token ids; anything else is refused by name."""
    if isinstance(prompt, str):
        check_text(prompt, f"the {name}")
        if not prompt.strip():
            raise PromptError(f"the {name} is empty or only whitespace; give the model something to answer")
        return prompt
    if prompt is None:
        raise PromptError(f"the {name} is None; pass text (str) or a list of token ids")
    if isinstance(prompt, (bytes, bytearray)):
        raise PromptError(f"the {name} is bytes; decode it to text (str) or pass a list of token ids")
    if hasattr(prompt, "tolist") and hasattr(prompt, "dtype"):  # an mx / numpy array
        prompt = prompt.tolist()
        prompt = prompt[0] if len(prompt) == 1 and isinstance(prompt[0], list) else prompt
    if not isinstance(prompt, Sequence):
        raise PromptError(f"the {name} must be text (str) or a list of token ids, got {type(prompt).__name__}")
    if bad := [i for i in prompt if not is_int(i)]:
        raise PromptError(f"the {name}'s token ids must be integers, got {shown(bad[0])} ({type(bad[0]).__name__})")
    if not prompt:
        raise PromptError(f"the {name} is empty; give the model something to answer")
    return [int(i) for i in prompt]


def check_request(prompt, max_tokens, seed=None, system_prompt=None, chat_template: bool = True) -> str | list[int]:
    """The checks at the generation API's entry; returns the prompt as text or a list of ids."""
    prompt = check_prompt(prompt)
    at_least(1)(max_tokens, "max_tokens")
    if seed is not None:
        check_seed(seed)
    if system_prompt is not None:
        check_text(system_prompt, "the system prompt")
        if not chat_template or not isinstance(prompt, str):
            raise PromptError(
                "a system prompt needs the chat template and a text prompt; put the system text in the prompt instead"
            )
    return prompt


def writable_file(path: Path, name: str) -> None:
    """A file that can be created: its folder exists and takes new files (checked before long runs)."""
    folder = Path(path).expanduser().absolute().parent
    if not folder.is_dir():
        raise OptionError(f"{name}: folder {folder} does not exist; create it first or choose another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OptionError(f"{name}: folder {folder} is not writable; choose another path")
    if Path(path).is_dir():
        raise OptionError(f"{name}: {path} is a folder; give a file name")


def option(check: Callable[[object, str], None]):
    """A Click callback running ``check(value, '--flag')``; a failure is Click's one-line error, exit 1."""
    import click

    def callback(ctx, param, value):
        if value is None:
            return value
        try:
            check(value, max(param.opts, key=len))
        except ValueError as e:
            raise click.ClickException(str(e)) from None
        return value

    return callback
