"""One model over several machines with ``mx.distributed`` (launched by ``mlx.launch``): expert
parallelism. Each rank holds a contiguous share of every layer's experts and reads only those from
the checkpoint; attention, the dense MLP, the router, the embeddings and the head are whole on every
rank (the experts are ~90% of the released model's bytes). A MoE layer's output is each rank's share
of the weighted sum over its experts, added up with one ``all_sum`` of [tokens, hidden] float32 per
layer; everything after it is computed the same way on every rank, so every rank makes the same
decisions and the same random draws (seeds agreed through rank 0).

A rank that cannot connect, or whose peers die or hang, stops with a one-line error within
``timeout`` seconds (``MLX_DGEMMA_DIST_TIMEOUT``, default 120): ``init`` runs under a guard process
(the backends' init holds the GIL, so no thread of ours could act), and a watchdog thread (evals
release the GIL) ends a rank that has queued no collective for that long while watched.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from .errors import DistributedError
from .loader import (
    CheckpointError,
    ExpertSlice,
    build_model,
    checkpoint_folder,
    map_key,
    read_config,
    stack_experts,
    weight_files,
)
from .model.config import ConfigError, GenerationConfig
from .model.diffusion_gemma import DiffusionGemma
from .safetensors_io import TensorInfo, read_header, read_tensor

TIMEOUT_ENV = "MLX_DGEMMA_DIST_TIMEOUT"
DEFAULT_TIMEOUT = 120.0
# Variables the launchers set (mlx.launch's ring and JACCL backends, MPI): a process started by one.
_LAUNCH_ENV = ("MLX_RANK", "MLX_HOSTFILE", "MLX_JACCL_COORDINATOR", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
STACKED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)\.(weight|scales|biases)$")
_TICK_EVERY = 64  # tensors read between two lockstep ticks while loading


def timeout_seconds() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise DistributedError(f"{TIMEOUT_ENV}={raw!r} is not a positive number of seconds")
    return value


def launched() -> bool:
    """Whether this process was started by a distributed launcher."""
    return any(name in os.environ for name in _LAUNCH_ENV)


# A separate process: it waits on a pipe from us; our exit or close of the pipe ends it quietly;
# a timeout prints the message and kills us (blocked in C++ holding the GIL, we cannot act ourselves).
_GUARD = """import os, select, signal, sys
ready, _, _ = select.select([sys.stdin], [], [], float(sys.argv[1]))
if not ready:
    sys.stderr.write(sys.argv[2] + "\\n"); sys.stderr.flush(); os.kill(int(sys.argv[3]), signal.SIGKILL)
"""


def init(timeout: float | None = None) -> mx.distributed.Group:
    """``mx.distributed.init()``; under a launcher, bounded by ``timeout`` seconds: a rank whose
    peers do not connect in time exits with a one-line error instead of waiting for ever."""
    if not launched():
        return mx.distributed.init()
    timeout = timeout_seconds() if timeout is None else timeout
    rank = os.environ.get("MLX_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))
    message = (
        f"error: rank {rank}: the other ranks did not connect within {timeout:g} s (is every host up and "
        f"reachable, and running the same command?); {TIMEOUT_ENV} sets the wait"
    )
    guard = subprocess.Popen(
        [sys.executable, "-c", _GUARD, str(timeout), message, str(os.getpid())], stdin=subprocess.PIPE
    )
    try:
        return mx.distributed.init(strict=True)
    except RuntimeError as e:
        raise DistributedError(f"rank {rank}: cannot join the other ranks ({_first_line(e)})") from None
    finally:
        guard.stdin.close()
        guard.wait()


class Watchdog:
    """Ends this process with a one-line error when, while ``watching``, no collective has been
    queued for ``timeout`` seconds: a peer died without closing its connection (a machine off, a
    cable out) or hangs. Collectives are queued at every MoE layer of every forward, so the gap is
    at most one forward (or one slice of loading) plus the wait for the slowest rank."""

    def __init__(self, rank: int, timeout: float):
        self.rank, self.timeout = rank, timeout
        self._last = time.monotonic()
        self._depth = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def kick(self) -> None:
        self._last = time.monotonic()

    @contextlib.contextmanager
    def watching(self):
        with self._lock:
            self._depth += 1
            self.kick()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mlx_dgemma-watchdog", daemon=True)
                self._thread.start()
        try:
            yield self
        finally:
            with self._lock:
                self._depth -= 1

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            if self._depth and time.monotonic() - self._last > self.timeout:
                sys.stderr.write(
                    f"error: rank {self.rank}: no progress from the other ranks for {self.timeout:g} s "
                    f"(one died, hangs or lost its link); stopping. {TIMEOUT_ENV} sets the wait\n"
                )
                sys.stderr.flush()
                os._exit(1)


@dataclass
class ExpertShard:
    """This rank's experts ``[start, stop)`` of one layer and how their share of the output joins
    the others' (model.Experts calls ``all_sum``)."""

    start: int
    stop: int
    group: mx.distributed.Group
    watchdog: Watchdog | None = None

    def all_sum(self, partial: mx.array) -> mx.array:
        if self.watchdog is not None:
            self.watchdog.kick()
        return mx.distributed.all_sum(partial, group=self.group)


def expert_range(num_experts: int, rank: int, size: int) -> tuple[int, int]:
    """The contiguous experts of ``rank`` out of ``size``: as even as can be, the first ranks one more."""
    base, extra = divmod(num_experts, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def shard(model: DiffusionGemma, group: mx.distributed.Group, watchdog: Watchdog | None = None) -> tuple[int, int]:
    """Make ``model`` (weights not loaded yet) hold only this rank's experts; returns their range."""
    cfg = model.config
    if cfg.num_experts < group.size():
        raise DistributedError(
            f"{group.size()} ranks but only {cfg.num_experts} experts to share; use at most {cfg.num_experts} ranks"
        )
    start, stop = expert_range(cfg.num_experts, group.rank(), group.size())
    for layer in model.layers:
        experts = layer.experts
        for linear in (experts.gate_up_proj, experts.down_proj):
            linear.weight = mx.zeros((stop - start, *linear.weight.shape[1:]), linear.weight.dtype)
        experts.shard = ExpertShard(start, stop, group, watchdog)
    return start, stop


def sharded_group(model) -> mx.distributed.Group | None:
    """The group whose ranks share ``model``'s experts (``shard``), or None for a whole model."""
    shard = model.layers[0].experts.shard if model.layers else None
    return None if shard is None else shard.group


def read_rows(info: TensorInfo, start: int, stop: int) -> mx.array:
    """Rows ``[start, stop)`` of a tensor's first axis, read from the file without the rest."""
    row = math.prod(info.shape[1:]) * info.dtype.size
    part = TensorInfo(
        info.path, info.dtype, (stop - start, *info.shape[1:]), info.offset + start * row, (stop - start) * row
    )
    return read_tensor(part)


def _checkpoint_tensors(folder: Path) -> list[tuple[str, TensorInfo]]:
    tensors = []
    for f in weight_files(folder):
        tensors += sorted(read_header(f).items())
    return tensors


def _agree_on_checkpoint(group: mx.distributed.Group, tensors: list[tuple[str, TensorInfo]]) -> None:
    """Every rank must read the same tensors in the same order (loading runs in lockstep)."""
    listing = json.dumps([(k, str(t.dtype), t.shape) for k, t in tensors]).encode()
    digest = np.frombuffer(hashlib.sha256(listing).digest(), dtype=np.uint8).astype(np.int32)
    mine = mx.array(digest)
    total = mx.distributed.all_sum(mine, group=group)
    if not mx.array_equal(total, mine * group.size()).item():
        raise DistributedError(
            f"rank {group.rank()}: the checkpoint here is not the one the other ranks hold "
            "(different tensors); give every machine the same files"
        )


def load_shard(folder: Path, group: mx.distributed.Group, watchdog: Watchdog | None = None) -> DiffusionGemma:
    """This rank's part of the checkpoint in ``folder``: its experts (their rows of stacked tensors,
    or their per-expert tensors) and every other weight whole; checked as strictly as ``loader``."""
    config = read_config(folder)
    model = DiffusionGemma(config)
    start, stop = shard(model, group, watchdog)
    tensors = _checkpoint_tensors(folder)
    _agree_on_checkpoint(group, tensors)
    weights: dict[str, mx.array] = {}
    per_expert: dict[str, dict[ExpertSlice, mx.array]] = {}
    for i, (key, info) in enumerate(tensors):
        if i % _TICK_EVERY == 0:  # lockstep: no rank waits on another for longer than a few tensors
            mx.eval(mx.distributed.all_sum(mx.array(1), group=group))
            if watchdog is not None:
                watchdog.kick()
        target = map_key(key)
        if target is None:
            continue
        if isinstance(target, ExpertSlice):
            if start <= target.expert < stop:
                per_expert.setdefault(target.target, {})[target] = _evaluated(read_tensor(info))
        elif STACKED_EXPERTS.search(target):
            if info.shape[0] != config.num_experts:
                raise CheckpointError(f"weight {key} has {info.shape[0]} experts, the config has {config.num_experts}")
            weights[target] = _evaluated(read_rows(info, start, stop))
        else:
            weights[target] = _evaluated(read_tensor(info))
    for target, slices in per_expert.items():
        weights[target] = stack_experts(slices, stop - start, start=start)
    build_model(model, weights)
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group))  # everyone loaded
    return model


def _evaluated(a: mx.array) -> mx.array:
    mx.eval(a)
    return a


def sharded_load(
    path_or_repo: str | os.PathLike, group: mx.distributed.Group | None = None, watchdog: Watchdog | None = None
):
    """``model, tokenizer`` with this rank's share of the experts (``load``'s counterpart under
    ``mlx.launch``). Each rank needs the checkpoint on its own disk (a Hub id is fetched on each)."""
    from .tokenizer import load_tokenizer

    group = group or init()
    folder = checkpoint_folder(path_or_repo)
    model = load_shard(folder, group, watchdog)
    try:
        model.generation_config = GenerationConfig.from_folder(folder, model.config)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    return model, load_tokenizer(folder, model.config)


def from_rank0(value, group: mx.distributed.Group | None = None):
    """Rank 0's ``value`` (anything JSON can hold) on every rank; the value itself in a process no
    launcher started (where ``mx.distributed.init`` could start an MPI of its own)."""
    if group is None:
        if not launched():
            return value
        group = mx.distributed.init()
    if group.size() == 1:
        return value
    raw = json.dumps(value).encode() if group.rank() == 0 else b""
    length = mx.distributed.all_sum(mx.array(len(raw)), group=group).item()
    data = np.zeros(length, dtype=np.int32)
    if group.rank() == 0:
        data[:] = np.frombuffer(raw, dtype=np.uint8)
    total = np.array(mx.distributed.all_sum(mx.array(data), group=group))
    return json.loads(total.astype(np.uint8).tobytes().decode())


def lost_peer(error: BaseException) -> str | None:
    """A one-line account of a collective that failed because another rank went away, else None."""
    text = _first_line(error)
    if isinstance(error, RuntimeError) and re.match(r"\[(ring|jaccl|mpi|nccl)\]", text):
        return text
    return None


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__
