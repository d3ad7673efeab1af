"""A reply of log-probabilities just under the bound one reply may hold (logprobs.MAX_REPLY_LOGPROBS): does it
stall the server, and does the server's memory come back after it?

Starts ``python -m mlx_dgemma.server`` on the bundled demo (as server_load.py does) and sends ``--rounds``
times lm-eval's loglikelihood request at its largest: 64 token-id prompts, echoed, ``logprobs`` 20,
``max_tokens`` 0, each prompt as long as keeps the reply's log-probabilities under the bound, streamed
(``--whole``: one JSON reply). Another thread asks /health every 10 ms meanwhile. Prints, per round, the
reply's log-probabilities, megabytes and seconds, the longest /health answer, and the server's resident
memory (VmRSS) at start, after a request of one of the prompts (before), and after each (a second after
it ends). Then one request just
over the bound, refused, and how long its 400 took.

    python benchmarks/logprob_reply.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from server_load import free_port, longest_health, start_server  # noqa: E402

from mlx_dgemma.engine.scoring import MAX_TOP_LOGPROBS  # noqa: E402
from mlx_dgemma.server.jobs import MAX_PROMPTS  # noqa: E402
from mlx_dgemma.server.logprobs import MAX_REPLY_LOGPROBS  # noqa: E402

TOKEN = 300  # a token of the demo's vocabulary, repeated to the prompt's length


def rss_mb(pid: int) -> float:
    """The process's resident memory in MB (Linux's /proc; elsewhere ps)."""
    status = Path(f"/proc/{pid}/status")
    if status.exists():
        line = next(line for line in status.read_text().splitlines() if line.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024
    import subprocess

    return int(subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True).stdout) / 1024


def post(url: str, body: dict) -> tuple[int, int]:
    """The reply's status and bytes (read as they come)."""
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            size = 0
            while piece := response.read(1 << 16):
                size += len(piece)
            return response.status, size
    except urllib.error.HTTPError as e:
        return e.code, len(e.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="times the request is sent")
    parser.add_argument("--whole", action="store_true", help="one JSON reply instead of a stream")
    args = parser.parse_args()
    per_position = 1 + MAX_TOP_LOGPROBS
    length = MAX_REPLY_LOGPROBS // (MAX_PROMPTS * per_position)  # (a prompt's first position counts too)
    body = {
        "prompt": [[2] + [TOKEN] * (length - 1)] * MAX_PROMPTS,
        "echo": True,
        "logprobs": MAX_TOP_LOGPROBS,
        "max_tokens": 0,
        "stream": not args.whole,
    }
    entries = MAX_PROMPTS * length * per_position
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(None, port)
    try:
        time.sleep(1)
        print(f"server RSS at start: {rss_mb(server.pid):.0f} MB", flush=True)
        assert post(url, {**body, "prompt": body["prompt"][:1]})[0] == 200  # (the scorer's first use)
        time.sleep(1)
        print(f"server RSS after one prompt of the request (before): {rss_mb(server.pid):.0f} MB", flush=True)
        print(f"{'round':>5} {'logprobs':>9} {'reply MB':>9} {'s':>6} {'/health max s':>14} {'RSS after MB':>13}")
        for round in range(1, args.rounds + 1):
            done = threading.Event()
            worst = longest_health(url, done)
            start = time.perf_counter()
            status, size = post(url, body)
            seconds = time.perf_counter() - start
            done.set()
            assert status == 200, status
            time.sleep(1)
            print(
                f"{round:>5} {entries:>9,} {size / 1e6:>9.1f} {seconds:>6.1f} {worst[0]:>14.3f} "
                f"{rss_mb(server.pid):>13.0f}",
                flush=True,
            )
        over = {**body, "prompt": [[2] + [TOKEN] * length] * MAX_PROMPTS}
        start = time.perf_counter()
        status, _ = post(url, over)
        print(
            f"{MAX_PROMPTS * (length + 1) * per_position:,} log-probabilities: {status} in {time.perf_counter() - start:.3f} s"
        )
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
