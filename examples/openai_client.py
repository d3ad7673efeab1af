"""Calling the server with the official ``openai`` client (``pip install openai``): plain, streamed,
and JSON of a schema. It starts ``python -m mlx_dgemma.server`` on a free loopback port with the
bundled demo model, and stops it at the end.

    python examples/openai_client.py
    # or against a server you started yourself:
    python -m mlx_dgemma.server --port 8080 &  python examples/openai_client.py --base-url http://127.0.0.1:8080/v1
"""

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.request

from openai import OpenAI

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "age"],
}


@contextlib.contextmanager
def local_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "mlx_dgemma.server", "--port", str(port), "--log-level", "warning"]
    )
    try:
        for _ in range(300):  # the model loads first
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.terminate()
        server.wait(timeout=30)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="a running server's /v1 address (default: start one)")
    args = parser.parse_args()
    with contextlib.nullcontext(args.base_url) if args.base_url else local_server() as base_url:
        client = OpenAI(base_url=base_url, api_key="not-needed")
        model = client.models.list().data[0].id

        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "sort: 42 17 85 23 61"}], seed=0
        )
        print("chat:", reply.choices[0].message.content, f"({reply.usage.completion_tokens} tokens)")

        print("streamed: ", end="", flush=True)
        for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "reverse: planet"}], seed=0, stream=True
        ):
            print(chunk.choices[0].delta.content or "" if chunk.choices else "", end="", flush=True)
        print()

        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "json: name=ada age=36"}],
            seed=0,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
        )
        print("json_schema:", json.loads(reply.choices[0].message.content))


if __name__ == "__main__":
    main()
