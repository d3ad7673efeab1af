"""How long a large request body, or a large reply, pauses the server's event loop.

Starts ``python -m mlx_dgemma.server`` on the bundled demo (as server_load.py does), then for each kind
of body (a JSON array of ``--mib`` MiB of one value repeated: numbers, floats, strings, empty arrays,
empty objects; and one long string, as an image's data URL is) posts it to /v1/completions as
``prompt`` while another thread asks /health every 10 ms, and prints the longest /health answer
during the post, the post's status and its seconds. Then, in this process, writes the reply of
2,048 embeddings of 2,816 floats (the released model's width) with starlette's ``JSONResponse`` and
with ``body.json_reply``, and prints the longest another thread waited meanwhile.

    python benchmarks/body_stall.py --mib 24
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

import numpy as np  # noqa: E402
from server_load import free_port, longest_health, start_server  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402

from mlx_dgemma.server.body import json_reply  # noqa: E402

KINDS = {"numbers": "123456", "floats": "0.5", "strings": '"ab"', "arrays": "[]", "objects": "{}"}


def body(kind: str, mib: int) -> bytes:
    size = mib << 20
    if kind == "one string":
        return json.dumps({"prompt": "a" * size, "max_tokens": 1}).encode()
    item = KINDS[kind]
    items = ",".join([item] * (size // (len(item) + 1)))
    return f'{{"prompt": [{items}], "max_tokens": 1}}'.encode()


def reply_waits() -> None:
    vectors = np.random.default_rng(0).standard_normal((2048, 2816), dtype=np.float32)
    content = {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)],
    }
    for name, write in [("JSONResponse", JSONResponse), ("json_reply", json_reply)]:
        gaps, done = [0.0], threading.Event()

        def ping():
            last = time.perf_counter()
            while not done.is_set():
                time.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        thread = threading.Thread(target=ping)
        thread.start()
        start = time.perf_counter()
        size = len(write(content).body)
        seconds = time.perf_counter() - start
        done.set()
        thread.join()
        print(
            f"{name:>12}: {size / 1e6:.0f} MB in {seconds:.2f} s, another thread waited at most {max(gaps):.3f} s",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=24, help="each body's size in MiB (the server takes up to 32)")
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(None, port)
    try:
        print(f"{'body':>10} {'values':>10} {'/health max s':>14} {'status':>7} {'post s':>7}")
        for kind in [*KINDS, "one string"]:
            data = body(kind, args.mib)
            done = threading.Event()
            worst = longest_health(url, done)
            start = time.perf_counter()
            request = urllib.request.Request(url + "/v1/completions", data, {"Content-Type": "application/json"})
            try:
                status = urllib.request.urlopen(request, timeout=600).status
            except urllib.error.HTTPError as e:
                status = e.code
            seconds = time.perf_counter() - start
            done.set()
            time.sleep(0.05)
            values = data.count(b",") + 1
            print(f"{kind:>10} {values:>10} {worst[0]:>14.3f} {status:>7} {seconds:>7.2f}", flush=True)
    finally:
        server.terminate()
        server.wait(30)
    reply_waits()


if __name__ == "__main__":
    main()
