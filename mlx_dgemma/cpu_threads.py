"""How many threads the CPU work splits over: the cores that other work leaves free.

OpenBLAS splits each product over as many threads as there are cores, and the numpy kernels split
their widest passes the same way (model/kernels.py). When another process keeps a core busy, one of
those threads waits for the scheduler, and every product takes as long as its slowest part. On a
2-core machine beside one busy core, the demo's answers ran 1.5-2.1x slower on two threads than on
the one left (docs/cpu.md). The engine calls ``follow_free_cores`` once per step. At most every
``INTERVAL_S`` it reads how much CPU time went to work other than this process's (``/proc/stat``
less ``/proc/self/stat``) and splits over the cores left. The count changes no result: OpenBLAS and
the numpy kernels split a product by its outputs, so every sum runs in the same order whatever the
count (tests/test_cpu_threads.py).

Where /proc cannot tell (macOS), the split stays at every core. OpenBLAS's thread count is left
alone where OpenBLAS is not the BLAS in use or where it was set (``OPENBLAS_NUM_THREADS``,
``GOTO_NUM_THREADS`` or ``OMP_NUM_THREADS``).
"""

from __future__ import annotations

import ctypes
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

from . import fast_blas

INTERVAL_S = 0.25  # /proc/stat counts in 10 ms ticks: 25 per core over this interval
SET_BY_USER = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")


@dataclass(frozen=True)
class Sample:
    """CPU time counters at one moment, in clock ticks."""

    at: float  # time.monotonic()
    busy: int  # every core's time not idle (nor waiting for I/O)
    total: int  # every core's time
    own: int  # this process's user and system time, all its threads


def busy_elsewhere(before: Sample, after: Sample, cores: int) -> float:
    """Cores that work other than this process's kept busy between the two samples."""
    total = after.total - before.total
    if total <= 0:
        return 0.0
    other = (after.busy - before.busy) - (after.own - before.own)
    return max(0.0, other / total * cores)


def threads_for(busy: float, cores: int, usable: int) -> int:
    """Threads for the cores left free: at least one, at most the cores this process may run on."""
    return max(1, min(usable, round(cores - busy)))


def read_sample(proc: str = "/proc") -> tuple[Sample, int] | None:
    """The counters now and the number of cores they cover; None where ``proc`` cannot tell."""
    try:
        with open(f"{proc}/stat") as f:
            lines = f.read().split("\n")
        with open(f"{proc}/self/stat") as f:
            own_fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold anything
        counters = [int(v) for v in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
        own = int(own_fields[11]) + int(own_fields[12])  # utime and stime: fields 14 and 15 of the line
    except (OSError, ValueError, IndexError):
        return None
    cores = sum(1 for line in lines[1:] if line.startswith("cpu"))
    total, idle = sum(counters), counters[3] + counters[4]
    return Sample(time.monotonic(), total - idle, total, own), cores


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class _Follower:
    """The process's thread count (OpenBLAS's is global) and the sample it came from."""

    def __init__(self, proc: str = "/proc"):
        self.proc = proc
        self.threads = usable_cores()
        self.last: Sample | None = None
        self.off = False  # /proc cannot tell
        self.blas = None  # OpenBLAS, once it is known to be ours to set
        self.blas_known = False

    def follow(self) -> int:
        if self.off or (self.last is not None and time.monotonic() - self.last.at < INTERVAL_S):
            return self.threads
        read = read_sample(self.proc)
        if read is None:
            self.off = True
            return self.threads
        now, cores = read
        if self.last is not None:
            self.threads = threads_for(busy_elsewhere(self.last, now, cores), cores, usable_cores())
            blas = self._blas()
            if blas and blas.openblas_get_num_threads() != self.threads:
                blas.openblas_set_num_threads(self.threads)
        self.last = now
        return self.threads

    def _blas(self):
        if not self.blas_known:
            self.blas_known = True
            if not any(name in os.environ for name in SET_BY_USER):
                self.blas = openblas()
        return self.blas


def openblas():
    """The OpenBLAS MLX uses, as a ctypes library; None where MLX uses another BLAS."""
    library = ctypes.CDLL(fast_blas.loaded) if fast_blas.loaded else None
    return library if hasattr(library, "openblas_set_num_threads") else None  # not a BLAS named in MLX_DGEMMA_BLAS


_follower = _Follower()


def follow_free_cores() -> int:
    """Split the CPU work over the cores other work left free over the last ``INTERVAL_S`` or more
    (between readings, a clock read); returns that count."""
    return _follower.follow()


def free_cores() -> int:
    """The cores the CPU work splits over now (every usable core until a reading says otherwise)."""
    return _follower.threads


@contextmanager
def pinned(threads: int):
    """The CPU work split over ``threads`` while the block runs, whatever the load (to compare
    counts side by side); the follower and OpenBLAS's count as they were afterwards."""
    global _follower
    following, blas = _follower, openblas()
    before = blas.openblas_get_num_threads() if blas else None
    _follower = _Follower(proc="")  # reads nothing: its count stays
    _follower.off, _follower.threads = True, threads
    if blas:
        blas.openblas_set_num_threads(threads)
    try:
        yield
    finally:
        _follower = following
        if blas:
            blas.openblas_set_num_threads(before)
