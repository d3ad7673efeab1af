"""What admitting a hostile schema costs: a string pattern that nests a{110} four deep (110**4
characters forced, past any answer), taken by ``prepare`` (compile, the closing path from the start,
the budget checks) on the bundled demo, in a fresh process per figure: peak resident memory above
the process's baseline (Linux's VmHWM, reset through /proc/self/clear_refs after a warm-up schema has
built the tokenizer's tables) and wall time. ``--against DIR`` runs the same measurement on another
tree (its ``mlx_dgemma`` first on PYTHONPATH) and prints it beside this one's; each figure is the
median of ``--repeats`` processes (the fastest beside it: on a shared machine the time is loose).

    PYTHONPATH=. python benchmarks/closing_walk.py [--against /path/to/other/tree] [--threads 1 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

PATTERN = "^" + "(?:" * 4 + "a" + "{110})" * 4 + "$"
SCHEMA = {
    "title": "Nested repetition",
    "description": "a code of 110**4 characters",
    "type": "object",
    "required": ["code"],
    "properties": {"code": {"type": "string", "pattern": PATTERN, "description": "the code"}},
}


def _status(field: str) -> int:
    """A /proc/self/status figure, in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def measure(threads: int) -> dict:
    """Admission of ``threads`` copies of SCHEMA at once, each in its own thread (one request each)."""
    from mlx_dgemma import load
    from mlx_dgemma.errors import TemplateError
    from mlx_dgemma.generate import DEMO_MODEL, prepare
    from mlx_dgemma.options import GenerationArgs

    model, tokenizer = load(DEMO_MODEL)
    warm = {"type": "object", "required": ["a"], "properties": {"a": {"type": "string", "pattern": "^a{3}$"}}}
    prepare(model, tokenizer, "json: code", GenerationArgs.of(schema=warm, policy="ar", max_tokens=64))
    outcomes: list[str] = []

    def admit():
        schema = json.loads(json.dumps(SCHEMA))  # (a fresh schema: nothing compiled is shared)
        try:
            prepare(model, tokenizer, "json: code", GenerationArgs.of(schema=schema, policy="ar", max_tokens=256))
            outcomes.append("admitted")
        except TemplateError as e:
            outcomes.append(f"refused: {e}")

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # (the peak resident set restarts from now)
    baseline = _status("VmRSS")
    start = time.perf_counter()
    workers = [threading.Thread(target=admit) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - start
    return {"peak_mb": (_status("VmHWM") - baseline) / 2**20, "ms": seconds * 1000, "outcome": outcomes[0]}


def run(tree: str | None, threads: int) -> dict:
    """``measure`` in a fresh process on ``tree`` (None: the PYTHONPATH this one has)."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.path.abspath(tree)
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(threads)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", help="another tree to measure beside this one")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 16], help="requests admitted at once")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per figure (the median is printed)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args.child)))
        return
    print(f"schema: {len(json.dumps(SCHEMA))} bytes of JSON, pattern {PATTERN}")
    print("| tree | requests at once | peak above baseline | time (fastest) | outcome |")
    print("|---|---:|---:|---:|---|")
    trees = [("this", None)] + ([(args.against, args.against)] if args.against else [])
    for name, tree in trees:
        for threads in args.threads:
            runs = [run(tree, threads) for _ in range(args.repeats)]
            peak, ms = (statistics.median(r[k] for r in runs) for k in ("peak_mb", "ms"))
            fastest = min(r["ms"] for r in runs)
            print(f"| {name} | {threads} | {peak:.1f} MB | {ms:.0f} ms ({fastest:.0f}) | {runs[0]['outcome'][:90]} |")


if __name__ == "__main__":
    main()
