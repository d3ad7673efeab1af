"""Load on the OpenAI-compatible server: total tokens/s and p50/p95 latency per concurrency level.

Starts ``python -m mlx_dgemma.server`` on a free loopback port (the bundled demo model unless
--model) with its prompt cache off, then for each level sends the same ``--requests`` chat requests
(demo-task prompts from tasks.py's evaluation split, a seed each, not streamed, under --policy) from that many client
threads at once, so every level does the same work, and prints per level: requests, completion
tokens, wall seconds, total completion tokens per second, and the p50 / p95 request latency.

With ``--rounds N`` the levels run N times in turn (1 2 4 8 1 2 4 8 ...); each level's fastest
round is reported, and beside it the median over rounds of the level's speed against the first
level's in the same round (measured minutes apart, two levels' best rounds may come from a fast and
a slow spell of a shared machine; a round's levels run seconds apart).

    python benchmarks/server_load.py --concurrency 1 2 4 8 --requests 32 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlx_dgemma.demo.tasks import TASKS, make_instance  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, port: int, timeout: float = 120) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "mlx_dgemma.server",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--prompt-cache-size",
        "0",
    ]
    if model:
        command += ["--model", model]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    process = subprocess.Popen(command, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with code {process.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
            return process
        except OSError:
            time.sleep(0.2)
    process.terminate()
    raise SystemExit(f"the server did not answer within {timeout:.0f} s")


def longest_health(url: str, done: threading.Event) -> list[float]:
    """Poll ``/health`` until ``done``: the one-item list holds the longest answer's seconds so far."""
    worst = [0.0]

    def poll():
        while not done.is_set():
            start = time.perf_counter()
            urllib.request.urlopen(url + "/health", timeout=60).read()
            worst[0] = max(worst[0], time.perf_counter() - start)
            time.sleep(0.01)

    threading.Thread(target=poll, daemon=True).start()
    return worst


def request(url: str, prompt: str, seed: int, max_tokens: int, policy: str = "reference") -> tuple[float, int]:
    """(latency in seconds, completion tokens) of one chat request."""
    body = json.dumps(
        {"messages": [{"role": "user", "content": prompt}], "seed": seed, "max_tokens": max_tokens, "policy": policy}
    ).encode()
    tic = time.perf_counter()
    with urllib.request.urlopen(
        urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}), timeout=600
    ) as response:
        reply = json.loads(response.read())
    return time.perf_counter() - tic, reply["usage"]["completion_tokens"]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_level(
    url: str, prompts: list[str], concurrency: int, max_tokens: int, seed: int, policy: str = "reference"
) -> dict:
    tic = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda i: request(url, prompts[i], seed + i, max_tokens, policy), range(len(prompts))))
    wall = time.perf_counter() - tic
    latencies = [r[0] for r in results]
    tokens = sum(r[1] for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(prompts),
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_second": tokens / wall,
        "p50": statistics.median(latencies),
        "p95": percentile(latencies, 0.95),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint (default: the bundled demo)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--requests", type=int, default=32, help="requests per level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", default="reference", help="the requests' policy (a body field of this server)")
    parser.add_argument("--rounds", type=int, default=1, help="times the levels run in turn; the fastest is kept")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if min(args.concurrency) < 1 or args.requests < 1 or args.rounds < 1:
        parser.error("--concurrency levels, --requests and --rounds must be at least 1")

    rng = random.Random(args.seed)
    port = free_port()
    server = start_server(args.model, port)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    best: dict[int, dict] = {}
    ratios: dict[int, list[float]] = {level: [] for level in args.concurrency}
    try:
        request(url, "sort: 3 1 2", 0, 8, args.policy)  # warm up
        prompts = [make_instance(TASKS[i % len(TASKS)], rng, split="eval")[0] for i in range(args.requests)]
        for _ in range(args.rounds):
            first = None
            for level in args.concurrency:
                row = run_level(url, prompts, level, args.max_tokens, args.seed, args.policy)
                first = first or row["tokens_per_second"]
                ratios[level].append(row["tokens_per_second"] / first)
                print(
                    f"concurrency {level:>3}: {row['requests']} requests, {row['tokens']} tokens in "
                    f"{row['seconds']:.2f} s = {row['tokens_per_second']:.1f} tok/s; latency p50 {row['p50']:.3f} s,"
                    f" p95 {row['p95']:.3f} s",
                    flush=True,
                )
                if level not in best or row["tokens_per_second"] > best[level]["tokens_per_second"]:
                    best[level] = row
    finally:
        server.terminate()
        server.wait(timeout=30)
    rows = [best[level] for level in args.concurrency]
    base = rows[0]["tokens_per_second"]
    print(
        "\n| concurrency | requests | tokens | tok/s | vs first | vs first, per round (median) | p50 s | p95 s |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for row in rows:
        row["vs_first_per_round"] = statistics.median(ratios[row["concurrency"]])
        print(
            f"| {row['concurrency']} | {row['requests']} | {row['tokens']} | {row['tokens_per_second']:.1f} | "
            f"{row['tokens_per_second'] / base:.2f}x | {row['vs_first_per_round']:.2f}x | {row['p50']:.3f} | "
            f"{row['p95']:.3f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
