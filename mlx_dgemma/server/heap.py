"""Memory a large reply freed, given back to the system. A reply of hundreds of thousands of
log-probabilities is that many Python objects and a body of tens of MB, and its scorers hold KV
caches as long as its prompts. Once it is sent they are freed, but MLX keeps the buffers in its
cache and glibc's allocator keeps the pages for the process's next allocations, so the server would
stay about 150 MB larger after each. ``give_back_freed`` empties MLX's cache and returns the free
pages of every glibc arena (``malloc_trim``), and the server gives large blocks their own mappings
(``keep_large_blocks_mapped``), which go back as they are freed; elsewhere (macOS's allocator gives
freed regions back on its own) only MLX's cache is emptied."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import mlx.core as mx

# Log-probabilities a reply holds from which, once it is sent, the freed memory is given back (a trim
# walks the heap: a few ms, worth it only after a reply of tens of MB).
TRIM_AFTER_LOGPROBS = 1 << 16

M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
MMAP_THRESHOLD = 128 << 10  # glibc's default before it starts to move


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def keep_large_blocks_mapped() -> None:
    """Give every block of ``MMAP_THRESHOLD`` or more its own mapping, returned to the system when
    freed: glibc raises its threshold to the size of each large block freed (up to 32 MB), after which
    a reply's body and lists come from the heap and stay with the process (glibc)."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def give_back_freed() -> None:
    """Empty MLX's cache of freed buffers (the scorers' KV caches) and return the allocator's free
    pages to the system (glibc). (No collection: a reply's objects hold no cycles, they go as it
    is sent, and a collection would hold the interpreter for every thread meanwhile.)"""
    mx.clear_cache()
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
