"""The model shapes the speed benchmarks run at: the released text config cut to ``--layers`` layers
(``full_scale.released_sizes``), or a small preset of ``checkpoint_tools.random_checkpoint`` for quick
checks. Shared by reference_speed.py and profile_step.py (each runs as ``python benchmarks/NAME.py``,
which puts this folder on the import path)."""

from __future__ import annotations

import argparse

from full_scale import released_sizes

from checkpoint_tools.random_checkpoint import PRESETS
from mlx_dgemma.engine.policy import RELEASED


def add_shape_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=RELEASED.num_hidden_layers)
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="a small preset's shapes instead of the released ones (ignores --layers)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])


def require_positive(p: argparse.ArgumentParser, args: argparse.Namespace, names: tuple[str, ...]) -> None:
    """``p.error`` naming the first of the integer options ``names`` that is under 1."""
    for name in names:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")


def sizes_from(args: argparse.Namespace) -> dict:
    if args.preset is not None:
        return dict(PRESETS[args.preset])
    if not 1 <= args.layers <= RELEASED.num_hidden_layers:
        raise SystemExit(f"--layers must be 1..{RELEASED.num_hidden_layers}, got {args.layers}")
    return released_sizes(args.layers)


def describe(args: argparse.Namespace) -> str:
    shapes = f"preset {args.preset}" if args.preset else f"released text shapes, {args.layers} layer(s)"
    return f"{shapes}, {args.dtype}"
