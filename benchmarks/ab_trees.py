"""One command run in two source trees in turn (A B, B A, A B, ...), to compare a change's speed on a
shared machine: each tree's runs are spread over the same minutes, so a slow spell costs both.

    git archive 5a855cb | tar -x -C /tmp/before;  git archive HEAD | tar -x -C /tmp/after
    python benchmarks/ab_trees.py /tmp/before /tmp/after --rounds 3 -- python -m mlx_dgemma.demo.eval -n 8 --seed 1
    python benchmarks/ab_trees.py /tmp/before /tmp/after --rounds 3 -- \\
        python benchmarks/server_load.py --concurrency 1 4 --requests 16 --json {json}

The command runs with the tree as its working folder and first on PYTHONPATH. Reported: each run's
wall and CPU seconds (the CPU seconds move less with the others' load, as long as the cores are
not idle-spinning), and with ``{json}`` in the command (a file it writes: server_load.py's rows), each
concurrency level's tokens per second; then per tree the median and the best run (the one others'
jobs disturbed least), B against A (below 1: B faster, for seconds; above 1, for tok/s) and the
load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(tree: Path, command: list[str]) -> tuple[float, float, dict[int, float]]:
    """Wall and CPU seconds of ``command`` in ``tree``, and the tok/s per concurrency level it wrote to
    ``{json}``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        argv = [str(out) if part == "{json}" else part for part in command]
        env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
        start, used = time.perf_counter(), _children_cpu()
        done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True)
        seconds, cpu = time.perf_counter() - start, _children_cpu() - used
        if done.returncode != 0:
            sys.exit(f"{' '.join(argv)} failed in {tree} (exit {done.returncode}):\n{done.stderr[-3000:]}")
        levels = (
            {row["concurrency"]: row["tokens_per_second"] for row in json.loads(out.read_text())}
            if out.exists()
            else {}
        )
    return seconds, cpu, levels


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path, help="tree A (before)")
    parser.add_argument("b", type=Path, help="tree B (after)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.usage = "%(prog)s A B [--rounds N] -- COMMAND..."
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = parser.parse_args(argv[:split]), argv[split + 1 :]
    if not command:
        parser.error("give the command to run in each tree after --")
    trees = {"A": args.a.resolve(), "B": args.b.resolve()}
    load_before = os.getloadavg()
    seconds: dict[str, list[float]] = {"A": [], "B": []}
    cpu: dict[str, list[float]] = {"A": [], "B": []}
    tok_s: dict[str, dict[int, list[float]]] = {"A": {}, "B": {}}
    for r in range(args.rounds):
        for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
            wall, used, levels = run(trees[name], command)
            seconds[name].append(wall)
            cpu[name].append(used)
            for level, value in levels.items():
                tok_s[name].setdefault(level, []).append(value)
            shown = "".join(f", concurrency {level}: {value:.1f} tok/s" for level, value in levels.items())
            print(f"round {r + 1} {name}: {wall:.1f} s, {used:.1f} CPU s{shown}", flush=True)
    load_after = os.getloadavg()
    for name, pick in (("median", statistics.median), ("best", min)):
        for what, figures in (("wall", seconds), ("CPU", cpu)):
            a, b = pick(figures["A"]), pick(figures["B"])
            print(f"{name} {what} seconds: A {a:.1f}, B {b:.1f}, B/A {b / a:.3f}")
    for level in tok_s["A"]:
        for name, pick in (("median", statistics.median), ("best", max)):
            a, b = pick(tok_s["A"][level]), pick(tok_s["B"][level])
            print(f"concurrency {level}: {name} tok/s A {a:.1f}, B {b:.1f}, B/A {b / a:.3f}")
    print(
        f"load average (1, 5, 15 min): before {' '.join(f'{x:.2f}' for x in load_before)}, "
        f"after {' '.join(f'{x:.2f}' for x in load_after)}"
    )


if __name__ == "__main__":
    main()
