"""Several machines as one: ``mlx.launch`` starts a rank per machine, each holds a share of the
experts, and rank 0 prints. On one machine (two ranks over loopback, as this script does with the
bundled demo model when run with no arguments) it shows the mechanics; across two Macs:

    mlx.distributed_config --hosts mac1.local,mac2.local --over thunderbolt --backend ring --output-hostfile hosts.json
    mlx.launch --hostfile hosts.json --backend ring --python PY -- -m mlx_dgemma.generate --model M --prompt ...

    python examples/two_machines.py
"""

import shutil
import socket
import subprocess
import sys

PROMPT = "sort: 42 17 85 23 61"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    launch = shutil.which("mlx.launch")
    if launch is None:
        sys.exit("mlx.launch is not on PATH: it comes with the mlx package")
    generate = ["-m", "mlx_dgemma.generate", "--prompt", PROMPT, "--seed", "0", "--max-tokens", "32"]
    alone = subprocess.run([sys.executable, *generate], capture_output=True, text=True, check=True).stdout
    # A port range of our own, so that another launch on this machine cannot join this ring.
    two = subprocess.run(
        [
            launch,
            "-n",
            "2",
            "--backend",
            "ring",
            "--starting-port",
            str(free_port()),
            "--python",
            sys.executable,
            "--",
            *generate,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    print(f"one process: {alone.strip()}")
    print(f"two ranks:   {two.stdout.strip()}")
    print("the same text" if two.stdout == alone else "the texts differ")


if __name__ == "__main__":
    main()
