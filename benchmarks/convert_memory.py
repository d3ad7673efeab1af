"""Peak RSS of the converter against checkpoint size.

Writes random bf16 checkpoints in the Hugging Face layout (same tensor sizes, more layers for a
bigger checkpoint), converts each (4-bit mixed; also unquantized with --unquantized) under
``/usr/bin/time -v`` and prints the peak resident set of every run next to an import-only baseline.
Streaming keeps the peak flat: it follows the largest tensor, not the checkpoint.

    python benchmarks/convert_memory.py [--gigabytes 1 2.5] [--unquantized] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from checkpoint_tools.synthetic_checkpoint import layers_for, scaled_sizes, write_checkpoint  # noqa: E402
from mlx_dgemma.safetensors_io import read_header  # noqa: E402

TIME = Path("/usr/bin/time")
# Runs the converter with the given arguments (none: only imports it) and reports its own peak, in
# /usr/bin/time's words, for machines without GNU time; with it, time's own line comes last.
CHILD = """
import resource, runpy, sys
sys.argv = ["mlx_dgemma.convert", *sys.argv[1:]]
if sys.argv[1:]:
    try:
        runpy.run_module("mlx_dgemma.convert", run_name="__main__")
    except SystemExit as done:
        if done.code:
            raise
else:
    import mlx_dgemma.convert
print("Maximum resident set size (kbytes):", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
"""


def peak_rss(convert_args: list[str]) -> tuple[float, str]:
    """(peak RSS in MB, wall time) of a process running ``python -m mlx_dgemma.convert convert_args``."""
    command = [sys.executable, "-c", CHILD, *convert_args]
    if TIME.exists():
        command = [str(TIME), "-v", *command]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        raise RuntimeError(f"conversion {convert_args} failed:\n{done.stderr[-2000:]}")
    rss = re.findall(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)[-1]
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", done.stderr)
    return int(rss) / 1024, wall[1] if wall else "?"


def folder_size(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, nargs="+", default=[1.0, 2.5])
    parser.add_argument("--unquantized", action="store_true", help="also time a plain (bf16 → bf16) conversion")
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="convert-memory-", dir=args.work_dir))
    try:
        base_mb, _ = peak_rss([])
        print(
            f"import-only baseline: peak RSS {base_mb:.0f} MB  ({'/usr/bin/time -v' if TIME.exists() else 'getrusage'})"
        )
        print(
            f"{'checkpoint':>12} {'largest tensor':>15} {'conversion':>12} {'peak RSS':>10} {'over baseline':>14} {'wall':>8}"
        )
        for gigabytes in args.gigabytes:
            sizes = scaled_sizes(layers_for(gigabytes, "bfloat16"))
            src = write_checkpoint(work / f"src-{gigabytes}", sizes, "bfloat16", shard_bytes=1 << 30)
            largest_mb = max(i.nbytes for f in src.glob("*.safetensors") for i in read_header(f).values()) / 1e6
            runs = [("4-bit mixed", ["-q"])] + ([("unquantized", [])] if args.unquantized else [])
            for label, flags in runs:
                dst = work / f"dst-{gigabytes}-{len(flags)}"
                mb, wall = peak_rss(["--hf-path", str(src), "--mlx-path", str(dst), *flags])
                print(
                    f"{folder_size(src):>9.2f} GB {largest_mb:>12.1f} MB {label:>12} {mb:>7.0f} MB {mb - base_mb:>11.0f} MB {wall:>8}",
                    flush=True,
                )
                shutil.rmtree(dst)
            shutil.rmtree(src)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
