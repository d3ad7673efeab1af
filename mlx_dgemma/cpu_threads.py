"""How many threads the CPU work splits over: the cores that other work leaves free.

OpenBLAS splits each product over as many threads as there are cores, and the numpy kernels split
their widest passes the same way (model/kernels.py). When another process keeps a core busy, one of
those threads waits for the scheduler, and every product takes as long as its slowest part. On a
2-core machine beside one busy core, the demo's answers ran 1.5-2.1x slower on two threads than on
the one left (docs/cpu.md). The engine calls ``follow_free_cores`` once per step. At most every
``INTERVAL_S`` it reads how much time of the cores it may run on went to work other than this
process's (``/proc/stat`` less ``/proc/self/stat``) and splits over the cores left.

The numpy kernels split by rows, each computed as it would be alone, so their split changes no
number. OpenBLAS's count is moved only where it changes none either (``sums_agree``: OpenBLAS's
SkylakeX kernels, not its Haswell ones), and not where it was set (``OPENBLAS_NUM_THREADS``,
``GOTO_NUM_THREADS`` or ``OMP_NUM_THREADS``) or where OpenBLAS is not the BLAS in use. Where /proc
cannot tell (macOS), the split stays at every core.
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


def threads_for(busy: float, cores: int) -> int:
    """Threads for the ``cores`` this process may run on, ``busy`` of them taken: at least one."""
    return max(1, round(cores - busy))


def read_sample(proc: str = "/proc", cpus: set[int] | None = None) -> tuple[Sample, int] | None:
    """The counters now, summed over the cores this process may run on (``cpus``; default its
    affinity: a container's share of a larger host), and how many those are; None where ``proc``
    cannot tell."""
    cpus = usable_cpus() if cpus is None else cpus
    try:
        with open(f"{proc}/stat") as f:
            lines = f.read().split("\n")
        with open(f"{proc}/self/stat") as f:
            own_fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold anything
        own = int(own_fields[11]) + int(own_fields[12])  # utime and stime: fields 14 and 15 of the line
        busy = total = cores = 0
        for line in lines[1:]:
            name, *values = line.split()[:9] or [""]
            if name[:3] != "cpu" or not name[3:].isdigit() or int(name[3:]) not in cpus:
                continue
            counters = [int(v) for v in values]  # user nice system idle iowait irq softirq steal
            total += sum(counters)
            busy += sum(counters) - counters[3] - counters[4]
            cores += 1
    except (OSError, ValueError, IndexError):
        return None
    return (Sample(time.monotonic(), busy, total, own), cores) if cores else None


def usable_cpus() -> set[int]:
    """The cores this process may run on."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def usable_cores() -> int:
    return len(usable_cpus())


class _Follower:
    """The process's thread count (OpenBLAS's is global) and the sample it came from."""

    def __init__(self, proc: str = "/proc", cpus: set[int] | None = None):
        self.proc, self.cpus = proc, cpus  # (None: the process's affinity at each reading)
        self.threads = len(cpus) if cpus is not None else usable_cores()
        self.last: Sample | None = None
        self.off = False  # /proc cannot tell
        self.blas = None  # OpenBLAS, once it is known to be ours to set
        self.blas_known = False

    def follow(self) -> int:
        if self.off or (self.last is not None and time.monotonic() - self.last.at < INTERVAL_S):
            return self.threads
        read = read_sample(self.proc, self.cpus)
        if read is None:
            self.off = True
            return self.threads
        now, cores = read
        if self.last is not None:
            self.threads = threads_for(busy_elsewhere(self.last, now, cores), cores)
            blas = self._blas()
            if blas and blas.openblas_get_num_threads() != self.threads:
                blas.openblas_set_num_threads(self.threads)
        self.last = now
        return self.threads

    def _blas(self):
        if not self.blas_known:
            self.blas_known = True
            library = None if any(name in os.environ for name in SET_BY_USER) else openblas()
            self.blas = library if library and sums_agree(library) else None
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


def sums_agree(blas) -> bool:
    """Whether ``blas`` (OpenBLAS) gives the same bits on one thread as on every usable core, for
    products of a canvas's shape both ways round. Its SkylakeX kernels do (tests/test_cpu_threads.py
    checks the released model's widths too); its Haswell kernels, from 4 rows, do not (another
    summation order): there the count is left as it is, so that an answer does not depend on the
    load it ran beside."""
    import mlx.core as mx  # (this module loads before mlx.core: fast_blas.py)

    cores = usable_cores()
    if cores < 2:
        return True
    x = mx.random.normal((64, 512), key=mx.random.key(0), stream=mx.cpu)
    w = mx.random.normal((512, 1024), key=mx.random.key(1), stream=mx.cpu)
    wt = mx.random.normal((1024, 512), key=mx.random.key(2), stream=mx.cpu)  # multiplied transposed
    before, products = blas.openblas_get_num_threads(), []
    try:
        for threads in (1, cores):
            blas.openblas_set_num_threads(threads)
            products.append([mx.matmul(x, w, stream=mx.cpu), mx.matmul(x, wt.T, stream=mx.cpu)])
            mx.eval(products[-1])
    finally:
        blas.openblas_set_num_threads(before)
    return all(mx.array_equal(a, b).item() for a, b in zip(*products))


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
