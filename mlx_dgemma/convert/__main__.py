"""Hugging Face DiffusionGemma checkpoint → MLX checkpoint, streamed one tensor at a time and
optionally quantized with mixed bit widths: the command line (checkpoint.py converts).

    python -m mlx_dgemma.convert --hf-path google/diffusiongemma-26B-A4B-it --mlx-path dgemma-4bit -q
    python -m mlx_dgemma.convert report --hf-path SRC    # logit error, size, demo accuracy per recipe
    python -m mlx_dgemma.convert sizes --hf-path SRC     # each recipe's output size, from the headers alone

The output has mlx-vlm's layout (fused ``experts.gate_up_proj``, mlx-lm's ``quantization`` entry
with per-module overrides in config.json), so it loads in mlx-vlm as well as here.
"""

from __future__ import annotations

from .. import fast_blas

fast_blas.load()  # a command-line process: the fast BLAS before mlx.core loads

import sys

import click

from ..cli import command_line
from ..errors import ConversionError
from ..loader import CheckpointError, checkpoint_folder
from .checkpoint import (
    DTYPES,
    convert,
    converted_size,
    dequantize_checkpoint,
    plan_tensors,
    read_source_config,
    recipe_sizes,
    source_tensors,
    sweep,
    upload,
)
from .output import ConversionStopped
from .quantize import BITS, MODE_DEFAULTS, RECIPES
from .report import format_size

_ERRORS = (CheckpointError, ConversionError, OSError)
_CONTEXT = {"help_option_names": ["-h", "--help"]}


_hf_path = click.option(
    "--hf-path", "--model", required=True, help="Hugging Face checkpoint: a local folder or a Hub id."
)
_q_group_size = click.option(
    "--q-group-size",
    type=click.Choice(["32", "64", "128"]),
    default=None,
    help="Group size of the quantized modules (default: the mode's, 64 for affine).",
)
_q_mode = click.option(
    "--q-mode", type=click.Choice(list(MODE_DEFAULTS)), default=None, help="Quantization mode [default: affine]."
)
_dtype = click.option(
    "--dtype",
    type=click.Choice(DTYPES),
    default=None,
    help="Type of the unquantized tensors and the scales (default: the config's dtype).",
)


def _int(value: str | None) -> int | None:
    return None if value is None else int(value)


@click.command(context_settings=_CONTEXT)
@_hf_path
@click.option("--mlx-path", default="mlx_model", show_default=True, help="Where to write the MLX checkpoint.")
@click.option("-q", "--quantize", is_flag=True, help="Quantize the model.")
@click.option(
    "--q-bits",
    type=click.Choice([str(b) for b in BITS]),
    default=None,
    help="Bits of the quantized modules (under 'mixed': the experts and the self-conditioning MLP) "
    "[default: the mode's, 4 for affine].",
)
@_q_group_size
@_q_mode
@click.option(
    "--quant-predicate",
    type=click.Choice(list(RECIPES)),
    default=None,
    help="Recipe [default: mixed]: " + "; ".join(f"'{r.name}': {r.summary}" for r in RECIPES.values()) + ".",
)
@_dtype
@click.option("-d", "--dequantize", is_flag=True, help="Write a quantized MLX checkpoint (--hf-path) unquantized.")
@click.option("--force", is_flag=True, help="Replace --mlx-path if it holds an earlier conversion (and nothing else).")
@click.option("--report", is_flag=True, help="Afterwards, measure the logit error against the source.")
@click.option(
    "--upload-repo", default=None, help="Afterwards, upload --mlx-path to this Hugging Face model repository."
)
@click.option(
    "--trust-remote-code", is_flag=True, help="Accepted as mlx-lm takes it; no code from the checkpoint is run here."
)
@command_line
def convert_command(
    hf_path,
    mlx_path,
    quantize,
    q_bits,
    q_group_size,
    q_mode,
    quant_predicate,
    dtype,
    dequantize,
    force,
    report,
    upload_repo,
    trust_remote_code,
):
    """Convert a Hugging Face DiffusionGemma checkpoint to MLX."""
    try:
        if dequantize:
            given = [
                flag
                for flag, value in (
                    ("-q", quantize or None),
                    ("--q-bits", q_bits),
                    ("--q-group-size", q_group_size),
                    ("--q-mode", q_mode),
                    ("--quant-predicate", quant_predicate),
                    ("--dtype", dtype),
                    ("--report", report or None),
                )
                if value is not None
            ]
            if given:
                raise ConversionError(
                    f"-d/--dequantize writes the checkpoint's own weights unquantized; drop {given[0]}"
                )
            dst = dequantize_checkpoint(hf_path, mlx_path, force=force)
        else:
            dst = convert(
                hf_path,
                mlx_path,
                quantize=quantize,
                q_group_size=_int(q_group_size),
                q_bits=_int(q_bits),
                q_mode=q_mode,
                quant_predicate=quant_predicate,
                dtype=dtype,
                force=force,
                report=report,
            )
        if upload_repo is not None:
            upload(dst, upload_repo)
    except _ERRORS as e:
        raise click.ClickException(str(e)) from None
    except ConversionStopped as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(128 + e.signum)
    click.echo(f"wrote {dst}")


@click.command(context_settings=_CONTEXT)
@_hf_path
@click.option(
    "--q-bits",
    "bits",
    type=click.Choice([str(b) for b in BITS]),
    multiple=True,
    help="Bit widths of the recipes that take --q-bits (repeatable; default: all).",
)
@_q_group_size
@_q_mode
@click.option(
    "--quant-predicate",
    "recipes",
    type=click.Choice(list(RECIPES)),
    multiple=True,
    help="Recipes to measure (repeatable; default: all).",
)
@_dtype
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where the trial conversions go (default: the system's temporary folder).",
)
@click.option(
    "-n",
    "--instances",
    default=20,
    show_default=True,
    type=click.IntRange(min=0),
    help="Fresh demo-task instances per task for the accuracy and steps columns (0: logit error only).",
)
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0), help="Seed of the task instances.")
@command_line
def report_command(hf_path, bits, q_group_size, q_mode, recipes, dtype, work_dir, instances, seed):
    """Convert with each recipe and bit width; print logit error, size and load time against the source,
    and the demo tasks' accuracy under diffusion and AR with the denoising steps per canvas."""
    try:
        table, failures = sweep(
            hf_path,
            list(recipes or RECIPES),
            [int(b) for b in bits or BITS],
            _int(q_group_size),
            q_mode or "affine",
            dtype,
            work_dir,
            instances,
            seed,
        )
    except _ERRORS as e:
        raise click.ClickException(str(e)) from None
    click.echo(table)
    if failures:  # the table holds the trials that ran; a failed one is an error, as a failed conversion is
        raise click.ClickException(f"{len(failures)} trial{'s' * (len(failures) > 1)} failed; the first: {failures[0]}")


@click.command(context_settings=_CONTEXT)
@_hf_path
@_q_group_size
@command_line
def sizes_command(hf_path, q_group_size):
    """Each recipe's converted size, from the source's safetensors headers (no weight is read)."""
    try:
        src = checkpoint_folder(hf_path)
        raw, config = read_source_config(src)
        tensors = source_tensors(src)
        rows = [("unquantized", converted_size(plan_tensors(src, raw, config, tensors, None, None)))]
        rows += [
            (q.describe(), n)
            for q, n in recipe_sizes(src, raw, config, tensors, list(RECIPES), list(BITS), _int(q_group_size))
        ]
    except _ERRORS as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{'recipe':<32} {'size':>10} {'bytes':>15}")
    for label, nbytes in rows:
        click.echo(f"{label:<32} {format_size(nbytes):>10} {nbytes:>15}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:
        report_command.main(argv[1:], prog_name="python -m mlx_dgemma.convert report")
    elif argv[:1] == ["sizes"]:
        sizes_command.main(argv[1:], prog_name="python -m mlx_dgemma.convert sizes")
    else:
        convert_command.main(argv, prog_name="python -m mlx_dgemma.convert")


if __name__ == "__main__":
    main()
