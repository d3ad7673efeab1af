"""Sharding across machines (distributed.py): the expert plan and partial reads in process; the real
thing as two ranks over MLX's ring backend on loopback, launched by ``mlx.launch``, whose text must
equal a single process's at the same seed; and ranks that cannot connect, die or hang."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_dgemma import distributed
from mlx_dgemma.loader import load_model
from mlx_dgemma.model.experts import Experts
from mlx_dgemma.safetensors_io import read_header, read_tensor

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "mlx_dgemma" / "demo"
LAUNCH = shutil.which("mlx.launch")
needs_launch = pytest.mark.skipif(
    LAUNCH is None or not mx.distributed.is_available(), reason="mlx.launch and a distributed backend are needed"
)
PROMPT = "sort: 42 17 85 23 61"


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    for name in distributed._LAUNCH_ENV:  # a test run inside a launched process must not inherit its rank
        env.pop(name, None)
    return env | extra


def single(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlx_dgemma.generate", *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
        cwd=ROOT,
    )


def sharded(*args: str, ranks: int = 2) -> subprocess.CompletedProcess:
    # Ports of our own: two launches on one machine at the default ports would join each other's ring.
    command = [
        LAUNCH,
        "-n",
        str(ranks),
        "--backend",
        "ring",
        "--starting-port",
        str(_free_ports(ranks)),
        "--python",
        sys.executable,
        "--",
        "-m",
        "mlx_dgemma.generate",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT)


def assert_same_text(*args: str) -> str:
    one, two = single(*args), sharded(*args)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    assert one.stdout.strip(), "the single process wrote no text"
    assert two.stdout == one.stdout  # rank 0 prints, rank 1 does not
    return one.stdout


# -- in process ---------------------------------------------------------------------------------


@pytest.mark.parametrize("experts, size", [(8, 2), (128, 4), (6, 4), (5, 5)])
def test_expert_ranges_cover_every_expert_once_and_evenly(experts, size):
    ranges = [distributed.expert_range(experts, r, size) for r in range(size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == experts
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    widths = [stop - start for start, stop in ranges]
    assert max(widths) - min(widths) <= 1 and min(widths) >= 1


def test_read_rows_reads_just_those_experts(checkpoints):
    folder = checkpoints("small")
    header = read_header(folder / "model.safetensors")
    key = "model.decoder.layers.1.experts.gate_up_proj"
    whole = read_tensor(header[key])
    assert mx.array_equal(distributed.read_rows(header[key], 2, 5), whole[2:5])


@pytest.mark.parametrize("kernels", ["cpu", "mlx"])  # per-expert BLAS segments, and gather_mm
def test_expert_shards_add_up_to_the_whole_layer(checkpoints, kernels):
    """Each shard computes only its experts' copies (zeros for the rest); summed over the shards
    (what all_sum does across ranks) the copies are the whole layer's, bit for bit."""
    from mlx_dgemma.model import kernels as device_kernels

    model = load_model(checkpoints("pattern"))
    layer = model.layers[2]
    x = mx.random.normal((2, 24, model.config.hidden_size), key=mx.random.key(0))
    idx, weights = layer.router(x)
    whole = layer.experts
    whole.kernels = getattr(device_kernels, kernels.upper())
    expected = whole(x, idx, weights)

    singleton = mx.distributed.init()  # size 1: all_sum is the identity, so each shard's part shows
    copies = []
    for rank in range(3):
        start, stop = distributed.expert_range(model.config.num_experts, rank, 3)
        part = Experts(model.config)
        part.kernels = whole.kernels
        part.gate_up_proj.weight = whole.gate_up_proj.weight[start:stop]
        part.down_proj.weight = whole.down_proj.weight[start:stop]
        part.shard = distributed.ExpertShard(start, stop, singleton)
        seen = []
        part.shard.all_sum = lambda y, seen=seen: seen.append(y) or y
        part(x, idx, weights)
        copies.append(seen[0])
    total = copies[0] + copies[1] + copies[2]
    one = Experts(model.config)
    one.kernels = whole.kernels
    one.gate_up_proj, one.down_proj = whole.gate_up_proj, whole.down_proj
    one.shard = distributed.ExpertShard(0, model.config.num_experts, singleton)
    assert mx.array_equal(one(x, idx, weights), expected)  # a shard of everything is the layer itself
    reached = [(c != 0).any(axis=-1) for c in copies]
    assert sum(r.astype(mx.int32) for r in reached).max().item() == 1  # each copy on one shard only
    k = idx.shape[-1]
    order = mx.argsort(idx.reshape(-1))
    y = total[mx.argsort(order)].reshape(-1, k, x.shape[-1])
    out = (y.astype(mx.float32) * weights.reshape(-1, k, 1)).sum(axis=1).reshape(x.shape)
    assert mx.array_equal(out, expected)


def test_from_rank0_is_the_value_itself_in_one_process():
    assert distributed.from_rank0({"seed": 7, "steps": [1, 2]}) == {"seed": 7, "steps": [1, 2]}


# -- two ranks over the ring backend on loopback -----------------------------------------------


@needs_launch
def test_two_ranks_write_the_single_process_text_on_the_demo():
    assert_same_text("--prompt", PROMPT, "--seed", "3", "--max-tokens", "64")


@needs_launch
@pytest.mark.slow
@pytest.mark.parametrize("policy", ["ar", "fast", "verified"])
def test_two_ranks_on_the_demo_other_policies(policy):
    assert_same_text("--prompt", "reverse: a b c d e f", "--seed", "11", "--max-tokens", "64", "--policy", policy)


@needs_launch
@pytest.mark.slow
def test_batch_engine_templates_and_schemas_on_two_ranks():
    command = [
        LAUNCH,
        "-n",
        "2",
        "--backend",
        "ring",
        "--starting-port",
        str(_free_ports(2)),
        "--python",
        sys.executable,
        str(ROOT / "tests" / "sharded_check.py"),
        str(DEMO),
    ]
    run = subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT)
    assert run.returncode == 0 and run.stdout.strip(), run.stderr
    seen = json.loads(run.stdout.strip().split("\n")[-1])
    assert seen["ranks"] == 2 and seen["experts"] == [0, 4]  # the demo's 8 experts, rank 0's half
    whole, sharded = seen["whole"], seen["sharded"]
    assert sharded["no_seed"]  # rank 0's seed on both ranks, or they would have parted ways
    del whole["no_seed"], sharded["no_seed"]
    assert sharded == whole
    assert all(whole["batch"]) and whole["template"].startswith("17 ") and json.loads(whole["schema"])


@needs_launch
@pytest.mark.slow
def test_two_ranks_plan_auto_from_rank_0s_profile(tmp_path):
    """Each rank's own timings would differ; they measure together and all use rank 0's profile."""
    first = _free_ports(2)
    command = [
        LAUNCH,
        "-n",
        "2",
        "--backend",
        "ring",
        "--starting-port",
        str(first),
        "--python",
        sys.executable,
        "--",
        "-m",
        "mlx_dgemma.generate",
        "--prompt",
        PROMPT,
        "--policy",
        "auto",
        "--seed",
        "2",
    ]
    for _ in range(2):  # measured, then read from rank 0's cache
        run = subprocess.run(
            command, capture_output=True, text=True, env=_env(HOME=str(tmp_path)), timeout=300, cwd=ROOT
        )
        assert run.returncode == 0 and run.stdout.strip(), run.stderr
    assert len(list((tmp_path / ".cache" / "mlx_dgemma" / "profiles").glob("*.json"))) == 1


@pytest.fixture(scope="module")
def many_experts(checkpoints, tmp_path_factory):
    """A random reference checkpoint whose experts are 85% of its weights, with the demo's tokenizer,
    and its 4-bit conversion."""
    folder = tmp_path_factory.mktemp("many") / "model"
    shutil.copytree(checkpoints("many-experts"), folder)
    for f in DEMO.glob("tokenizer*"):
        shutil.copy(f, folder)
    quantized = folder.parent / "q4"
    done = subprocess.run(
        [sys.executable, "-m", "mlx_dgemma.convert", "--hf-path", str(folder), "--mlx-path", str(quantized), "-q"],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    for f in DEMO.glob("tokenizer*"):
        shutil.copy(f, quantized)
    per_expert = folder.parent / "per-expert"  # the layout with one tensor per expert and projection
    shutil.copytree(folder, per_expert)
    weights = mx.load(str(per_expert / "model.safetensors"))
    inner = many_experts_config()["moe_intermediate_size"]
    for key in [k for k in weights if k.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        stacked = weights.pop(key)
        for e in range(stacked.shape[0]):
            if key.endswith("down_proj"):
                weights[f"{key[: -len('down_proj')]}{e}.down_proj.weight"] = stacked[e]
            else:
                weights[f"{key[: -len('gate_up_proj')]}{e}.gate_proj.weight"] = stacked[e, :inner]
                weights[f"{key[: -len('gate_up_proj')]}{e}.up_proj.weight"] = stacked[e, inner:]
    mx.save_safetensors(str(per_expert / "model.safetensors"), weights)
    return {"fp32": folder, "4-bit": quantized, "per-expert": per_expert}


def many_experts_config() -> dict:
    from checkpoint_tools.random_checkpoint import PRESETS

    return PRESETS["many-experts"]


@needs_launch
@pytest.mark.slow
@pytest.mark.parametrize(
    "which, policy",
    [
        ("fp32", "reference"),
        ("fp32", "ar"),
        ("fp32", "fast"),
        ("fp32", "verified"),
        ("4-bit", "reference"),
        ("4-bit", "ar"),
        ("per-expert", "reference"),
    ],
)
def test_two_ranks_write_the_single_process_text_on_a_random_checkpoint(many_experts, policy, which):
    folder = many_experts[which]
    assert_same_text(
        "--model", str(folder), "--prompt", "hello there", "--seed", "5", "--max-tokens", "48", "--policy", policy
    )


@needs_launch
@pytest.mark.slow
def test_three_ranks_and_no_seed_agree(many_experts):
    """Uneven shares (11/11/10 experts); without --seed every rank still draws rank 0's seed (else
    their canvases, step counts and collectives would part ways)."""
    run = sharded("--model", str(many_experts["fp32"]), "--prompt", "hello", "--max-tokens", "32", ranks=3)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()


# -- ranks that cannot connect, die or hang ----------------------------------------------------


def _free_ports(n: int) -> int:
    """The first of ``n`` consecutive ports free on loopback."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        try:
            with contextlib.ExitStack() as stack:
                for port in range(first, first + n):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise RuntimeError("no free ports on loopback")


def _rank(rank: int, hostfile: Path, *args: str, timeout: str = "4") -> subprocess.Popen:
    env = _env(MLX_HOSTFILE=str(hostfile), MLX_RANK=str(rank), **{distributed.TIMEOUT_ENV: timeout})
    return subprocess.Popen(
        [sys.executable, "-m", "mlx_dgemma.generate", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def _hostfile(tmp_path: Path) -> Path:
    path = tmp_path / "hosts.json"
    first = _free_ports(2)
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in (first, first + 1)]))
    return path


def _our_lines(stderr: str) -> list[str]:
    """Stderr without the lines MLX's ring backend logs itself."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("[ring]")]


@needs_launch
def test_a_rank_whose_peer_never_comes_says_so_in_bounded_time(tmp_path):
    start = time.monotonic()
    rank0 = _rank(0, _hostfile(tmp_path), "--prompt", PROMPT, timeout="3")
    _, err = rank0.communicate(timeout=60)
    assert rank0.returncode != 0
    assert time.monotonic() - start < 30
    (line,) = _our_lines(err)
    assert "did not connect within 3 s" in line and distributed.TIMEOUT_ENV in line


def _start_long_run(tmp_path: Path, model: Path, timeout: str = "4"):
    """Two ranks decoding 4000 tokens of a random checkpoint (which never writes a stop id)."""
    hostfile = _hostfile(tmp_path)
    args = ("--model", str(model), "--prompt", "hello", "--max-tokens", "4000", "--policy", "ar")
    ranks = [_rank(r, hostfile, *args, timeout=timeout) for r in range(2)]
    first = ranks[0].stdout.read(1)  # rank 0 has written text: both ranks are generating
    assert first, ranks[0].stderr.read()
    return ranks


@needs_launch
@pytest.mark.slow
def test_a_rank_that_dies_ends_the_others_with_one_line(tmp_path, many_experts):
    rank0, rank1 = _start_long_run(tmp_path, many_experts["fp32"])
    rank1.kill()
    start = time.monotonic()
    _, err = rank0.communicate(timeout=60)
    assert rank0.returncode != 0 and time.monotonic() - start < 10
    (line,) = _our_lines(err)
    assert line.startswith("Error: rank 0: lost the connection to another rank"), line


@needs_launch
@pytest.mark.slow
def test_a_rank_that_hangs_ends_the_others_after_the_timeout(tmp_path, many_experts):
    rank0, rank1 = _start_long_run(tmp_path, many_experts["fp32"], timeout="3")
    os.kill(rank1.pid, signal.SIGSTOP)  # alive, connected, silent: a machine frozen or a link gone dark
    try:
        start = time.monotonic()
        _, err = rank0.communicate(timeout=60)
        assert rank0.returncode != 0 and time.monotonic() - start < 15
        (line,) = _our_lines(err)
        assert "rank 0: no progress from the other ranks for 3 s" in line, line
    finally:
        rank1.kill()
        rank1.wait()
