"""A bounded LRU cache of encoder KV caches keyed by the token ids they hold (an image prompt's key
has a hash of the image in place of each of its tokens; scheduler._cache_key).

A multi-turn conversation sends its earlier turns again with every request; the cache of the earlier
request's prompt is a prefix of the new one, so only the new turns are encoded. A request gets a copy
(generation appends to a cache), and the copy stored keeps the original intact.
"""

from __future__ import annotations

import copy
from collections import OrderedDict


class PromptCache:
    def __init__(self, max_size: int = 10):
        if max_size < 0:
            raise ValueError(f"the prompt cache size must be >= 0, got {max_size}")
        self.max_size = max_size
        self._entries: OrderedDict[tuple[int, ...], object] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def fetch(self, ids: list[int]):
        """A copy of the cache of the longest stored prefix of ``ids`` shorter than ``ids`` (a model
        needs one new position to start from), and its length; (None, 0) when none is stored."""
        best: tuple[int, ...] | None = None
        for key in self._entries:
            if len(key) < len(ids) and (best is None or len(key) > len(best)) and list(key) == ids[: len(key)]:
                best = key
        if best is None:
            return None, 0
        self._entries.move_to_end(best)
        return copy.deepcopy(self._entries[best]), len(best)

    def insert(self, ids: list[int], cache) -> None:
        """Keep a copy of ``cache``, which holds ``ids`` and perhaps positions after them (the copy
        forgets those); the least recently used entry goes when the cache is full."""
        if self.max_size == 0 or not ids:
            return
        if cache.offset < len(ids):
            raise ValueError(f"a cache of {cache.offset} positions cannot be stored for {len(ids)} ids")
        key = tuple(ids)
        kept = copy.deepcopy(cache)
        kept.trim(cache.offset - len(ids))
        self._entries[key] = kept
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)
