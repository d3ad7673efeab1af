"""KV caches: the encoder appends to them, verified drafting trims them, and the denoiser reads a
per-canvas view of them.

Rows of a batch are left-padded to a common length, as in mlx-lm's batched generation: every row
appends at the same physical index, padding keys are masked out, and each row's RoPE positions
count from its first real token. The layer caches have the API of mlx-lm's ``BatchKVCache``
(``update_and_fetch``, ``offset``, ``left_padding``, ``trim``, ``filter``, ``extend``, ``state``);
they are not mlx-lm's because importing anything from mlx_lm imports transformers (≈ 7 s here),
and a sliding window must stay trimmable, which mlx-lm's rotating cache is not once it wraps.

A cache made with a ``KVQuantization`` stores its K/V as mlx-lm's ``QuantizedKVCache`` does, a
``(packed, scales, biases)`` triple from ``mx.quantize`` per tensor, once it holds more than
``start`` positions; every operation below maps over the triple's arrays alike (they share every
axis but the last). Attention reads it dequantized: on the CPU that is about 20x faster than MLX's
quantized products over the keys (benchmarks/long_context.py), and it keeps the attention kernels
one. The canvas view keeps the prefix quantized and its canvas room in the activations' dtype.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from ..options import KVQuantization


def _first(a) -> mx.array:
    """The array that speaks for a stored tensor's shape but its last axis (a triple's packed values)."""
    return a[0] if isinstance(a, tuple) else a


def _arrays(*tensors) -> list[mx.array]:
    return [a for _, a in tree_flatten(list(tensors))]


def _dequantized(a, quantization: KVQuantization | None) -> mx.array:
    if not isinstance(a, tuple):
        return a
    return mx.dequantize(*a, group_size=quantization.group_size, bits=quantization.bits)


def _quantized(a: mx.array, quantization: KVQuantization) -> tuple[mx.array, mx.array, mx.array]:
    return tuple(mx.quantize(a, group_size=quantization.group_size, bits=quantization.bits))


def _pad_positions(a, before: int):
    return tree_map(lambda x: mx.pad(x, [(0, 0), (0, 0), (before, 0), (0, 0)]), a)


def _concatenate(parts: list, axis: int = 0):
    return tree_map(lambda *xs: mx.concatenate(xs, axis=axis), *parts)


class LayerCache:
    """One layer's K/V for B left-padded rows, [B, kv_heads, capacity, head_dim], grown in chunks of
    ``step`` positions. ``window``: a sliding-window layer keeps at least its last ``keep``
    positions (the reference's window − 1 plus a canvas, so that trimming up to a canvas leaves
    exactly the reference's window); older ones are dropped a chunk at a time. ``quantization``:
    stored quantized once more than its ``start`` positions were appended (``quantized`` says so)."""

    step = 256

    def __init__(self, left_padding: list[int], keep: int | None = None, quantization: KVQuantization | None = None):
        self.keys: mx.array | tuple | None = None
        self.values: mx.array | tuple | None = None
        self.left_padding = mx.array(left_padding, dtype=mx.int32)  # physical index of each row's first token
        self.offset = mx.array([-p for p in left_padding], dtype=mx.int32)  # each row's tokens = next RoPE position
        self._idx = 0  # physical positions stored
        self.keep = keep
        self.quantization = quantization
        self.quantized = False
        self.appended = 0  # positions appended and not trimmed, those dropped from a window included

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append [B, kv_heads, S, head_dim] and return every stored position (the new ones' masks
        say which each may see), dequantized if stored quantized."""
        prev, S = self._idx, keys.shape[2]
        q = self.quantization
        if q is not None and not self.quantized and self.appended + S > q.start:
            self.quantize()
        if self.quantized:
            keys, values = _quantized(keys, q), _quantized(values, q)
        if self.keys is None or prev + S > _first(self.keys).shape[2]:
            B, H = _first(keys).shape[:2]
            grow = -(-S // self.step) * self.step
            room_k, room_v = (
                tree_map(lambda a: mx.zeros((B, H, grow, a.shape[3]), a.dtype), x) for x in (keys, values)
            )
            if self.keys is None:
                self.keys, self.values = room_k, room_v
            else:
                self.keys = _concatenate([self.stored(self.keys), room_k], axis=2)
                self.values = _concatenate([self.stored(self.values), room_v], axis=2)
        self._idx += S
        self.appended += S
        self.offset = self.offset + S

        def write(stored: mx.array, new: mx.array) -> None:
            stored[..., prev : self._idx, :] = new

        tree_map(write, self.keys, keys)
        tree_map(write, self.values, values)
        fetched = self.stored(self.keys), self.stored(self.values)
        if self.keep is not None and (drop := self._idx - self.keep) >= self.step:
            self.keys, self.values = (tree_map(lambda a: a[..., drop:, :], x) for x in (self.keys, self.values))
            self._idx -= drop
            self.left_padding = self.left_padding - drop
        return _dequantized(fetched[0], q), _dequantized(fetched[1], q)

    def stored(self, tensor, start: int = 0):
        """Positions ``start`` up to those stored of ``tensor`` (the keys or values, as stored)."""
        return tree_map(lambda a: a[..., start : self._idx, :], tensor)

    def quantize(self) -> None:
        """Store the K/V quantized from now on (those stored so far too)."""
        if self.keys is not None:  # (the room for more too: its zeros quantize to zeros)
            self.keys, self.values = (_quantized(x, self.quantization) for x in (self.keys, self.values))
        self.quantized = True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.appended -= n
        self.offset = self.offset - n
        return n

    def drop_front(self, n: int) -> None:
        """Forget the first ``n`` stored positions (a row's left padding)."""
        self.keys, self.values = (tree_map(lambda a: a[..., n:, :], x) for x in (self.keys, self.values))
        self._idx -= n
        self.appended -= n
        self.left_padding = self.left_padding - n

    def filter(self, rows: mx.array) -> None:
        if self.keys is not None:
            self.keys, self.values = (tree_map(lambda a: a[rows], x) for x in (self.keys, self.values))
        self.offset, self.left_padding = self.offset[rows], self.left_padding[rows]

    def extend(self, other: LayerCache) -> None:
        """Append ``other``'s rows, left-padding the side with fewer stored positions (quantized, both
        are stored quantized)."""
        for a, b in ((self, other), (other, self)):
            if b.quantized and not a.quantized:
                a.quantization = a.quantization or b.quantization
                a.quantize()
        end = max(self._idx, other._idx)

        def aligned(c: LayerCache) -> tuple:
            pad = end - c._idx
            return _pad_positions(c.stored(c.keys), pad), _pad_positions(c.stored(c.values), pad), c.left_padding + pad

        (k1, v1, p1), (k2, v2, p2) = aligned(self), aligned(other)
        self.keys, self.values = _concatenate([k1, k2]), _concatenate([v1, v2])
        self.left_padding = mx.concatenate([p1, p2])
        self.offset = mx.concatenate([self.offset, other.offset])
        self._idx = end
        self.appended = max(self.appended, other.appended)

    @property
    def state(self) -> list[mx.array]:
        return _arrays(self.stored(self.keys), self.stored(self.values))

    @property
    def nbytes(self) -> int:
        """Bytes held for this layer's K/V (room for more included)."""
        return sum(a.nbytes for a in _arrays(self.keys, self.values)) if self.keys is not None else 0


class KVCache:
    """The encoder's cache of a model: one cache per layer, ``B`` left-padded rows.

    ``offset``: physical positions encoded (padding included; for one unpadded row, its tokens);
    ``lengths``: each row's real tokens, i.e. the RoPE position of its next token. The last layer
    is always a full-attention one (the config forces it), so its cache speaks for the rows."""

    def __init__(
        self, windows: list[int | None], left_padding: list[int], slack: int, quantization: KVQuantization | None = None
    ):
        self.windows = windows
        self.layers = [LayerCache(left_padding, None if w is None else w - 1 + slack, quantization) for w in windows]
        self.padded = any(p > 0 for p in left_padding)  # known on the host: masks need no sync

    @property
    def _rows(self) -> LayerCache:
        return self.layers[-1]

    @property
    def offset(self) -> int:
        return self._rows._idx

    @property
    def lengths(self) -> mx.array:
        return self._rows.offset

    @property
    def batch_size(self) -> int:
        return self._rows.left_padding.shape[0]

    def state(self) -> list[mx.array]:
        return [a for c in self.layers if c.keys is not None for a in c.state]

    @property
    def nbytes(self) -> int:
        """Bytes held for the K/V of every layer."""
        return sum(c.nbytes for c in self.layers)

    def layer_keys(self, i: int) -> tuple:
        """Layer i's stored K/V, [B, kv_heads, T, head_dim] (sliding layers: the last window − 1), as
        stored: arrays, or (packed, scales, biases) triples of a quantized layer."""
        c, window = self.layers[i], self.windows[i]
        if c.keys is None:
            raise ValueError("the cache is empty: encode a prompt first")
        start = 0 if window is None else max(0, c._idx - (window - 1))
        return c.stored(c.keys, start), c.stored(c.values, start)

    def trim(self, n: int) -> int:
        """Forget the last ``n`` positions of every row; ValueError where that would not be exact (a
        sliding layer keeps a canvas of history beyond its window, at least)."""
        if not 0 <= n <= self.offset:
            raise ValueError(f"cannot trim {n} positions from a cache of {self.offset}")
        for c, window in zip(self.layers, self.windows):
            if window is not None and c._idx - n < min(window - 1, self.offset - n):
                raise ValueError(
                    f"cannot trim {n} positions: a sliding layer keeps only {c._idx - (window - 1)} "
                    "beyond its window (a canvas, at least)"
                )
        for c in self.layers:
            c.trim(n)
        return n

    def rows(self, rows: list[int]) -> KVCache:
        """A new cache of these rows (this one is left as it is)."""
        out = object.__new__(KVCache)
        out.windows, out.padded = self.windows, self.padded
        out.layers = []
        for c in self.layers:
            copy = object.__new__(LayerCache)
            copy.__dict__.update(c.__dict__)
            out.layers.append(copy)
        out.filter(rows)
        return out

    def row(self, i: int) -> KVCache:
        """Row ``i`` alone, without its left padding: a cache as if its prompt had been encoded alone
        (a row of a batched prefill that goes its own way, or that a prompt cache keeps)."""
        out = self.rows([i])
        for c in out.layers:
            pad = max(0, c.left_padding.item())
            if pad and c.keys is not None:
                c.drop_front(pad)
        out.padded = False
        return out

    def filter(self, rows: list[int]) -> None:
        """Keep only these rows, in this order."""
        index = mx.array(rows, dtype=mx.int32)
        for c in self.layers:
            c.filter(index)

    def extend(self, other: KVCache) -> None:
        """Append ``other``'s rows; the side with fewer positions is left-padded so all rows end together."""
        if other.offset != self.offset:
            self.padded = True
        self.padded |= other.padded
        for a, b in zip(self.layers, other.layers):
            a.extend(b)

    def encoder_mask(self, i: int, length: int) -> mx.array | None:
        """Which keys each of ``length`` new positions of layer i may attend to, [B|1, 1, T, K] bool,
        computed before they are appended: causal, inside the window on sliding layers, never a
        padding key, except itself (so that a padding query attends to something and stays finite)."""
        c, window = self.layers[i], self.windows[i]
        start = c._idx
        q = mx.arange(start, start + length)[:, None]
        k = mx.arange(start + length)[None, :]
        allowed = k <= q
        if window is not None:
            allowed = allowed & (k > q - window)
        if not self.padded:
            return allowed[None, None] if window is not None or length > 1 else None
        valid = k[None] >= c.left_padding[:, None, None]  # [B, 1, K]
        return ((allowed[None] & valid) | (k == q)[None])[:, None]

    def encoder_masks(self, length: int) -> list[mx.array | None]:
        """``encoder_mask`` of every layer, each built once per layer geometry (all full layers share
        one, and so do all sliding ones): a forward builds two masks, not one per layer."""
        built: dict[tuple[int | None, int], mx.array | None] = {}
        for i, (c, window) in enumerate(zip(self.layers, self.windows)):
            if (window, c._idx) not in built:
                built[window, c._idx] = self.encoder_mask(i, length)
        return [built[window, c._idx] for c, window in zip(self.layers, self.windows)]

    def canvas_view(self, length: int) -> CanvasView:
        return CanvasView(self, length)


class CanvasLayerView:
    """One layer's prefix K/V with room for a canvas after it, [B, kv_heads, P + C, head_dim].

    Each denoising step writes its canvas positions' K/V into that room: all of them, or under
    active-set compaction only the ``slots`` still computed (the others keep the K/V they had when
    last computed, which is what the still-moving positions attend to). A quantized prefix stays
    as stored (``quantized_prefix``: its K/V triples) and ``keys``/``values`` are the room alone;
    each forward reads the prefix dequantized before the room."""

    def __init__(self, keys, values, length: int, quantization: KVQuantization | None = None):
        B, H, P, _ = _first(keys).shape
        self.prefix = P
        self.slots: mx.array | None = None  # [B, A] canvas indexes of the positions being computed
        self.quantization = quantization
        self.quantized_prefix = None
        if isinstance(keys, tuple):
            self.quantized_prefix = (keys, values)
            # room in the dequantized width and dtype (the scales')
            self.keys, self.values = (
                mx.zeros((B, H, length, packed.shape[3] * 32 // quantization.bits), scales.dtype)
                for packed, scales, _ in (keys, values)
            )
            return
        room = mx.zeros((B, H, length, keys.shape[3]), keys.dtype)
        self.keys = mx.concatenate([keys, room], axis=2)
        self.values = mx.concatenate([values, mx.zeros((B, H, length, values.shape[3]), values.dtype)], axis=2)

    @property
    def room_start(self) -> int:
        """Where the canvas starts in ``keys``/``values``."""
        return 0 if self.quantized_prefix is not None else self.prefix

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.slots is None:
            self.keys[..., self.room_start :, :] = keys
            self.values[..., self.room_start :, :] = values
        else:
            index = (self.slots + self.room_start)[:, None, :, None]
            self.keys = mx.put_along_axis(self.keys, index, keys, axis=2)
            self.values = mx.put_along_axis(self.values, index, values, axis=2)
        if self.quantized_prefix is None:
            return self.keys, self.values
        prefix_k, prefix_v = (_dequantized(x, self.quantization) for x in self.quantized_prefix)
        return mx.concatenate([prefix_k, self.keys], axis=2), mx.concatenate([prefix_v, self.values], axis=2)

    def canvas(self, row: int) -> tuple[mx.array, mx.array]:
        """Row ``row``'s canvas K/V, [1, kv_heads, C, head_dim]."""
        return self.keys[row : row + 1, :, self.room_start :], self.values[row : row + 1, :, self.room_start :]

    def select(self, rows: mx.array) -> CanvasLayerView:
        view = object.__new__(CanvasLayerView)
        view.__dict__.update(self.__dict__)
        view.keys, view.values, view.slots = self.keys[rows], self.values[rows], None
        if self.quantized_prefix is not None:
            view.quantized_prefix = tree_map(lambda a: a[rows], self.quantized_prefix)
        return view

    def dequantized(self) -> CanvasLayerView:
        """The same view with its prefix held dequantized (the very numbers a forward reads)."""
        if self.quantized_prefix is None:
            return self
        view = object.__new__(CanvasLayerView)
        view.__dict__.update(self.__dict__)
        prefix_k, prefix_v = (_dequantized(x, self.quantization) for x in self.quantized_prefix)
        view.keys = mx.concatenate([prefix_k, self.keys], axis=2)
        view.values = mx.concatenate([prefix_v, self.values], axis=2)
        view.quantized_prefix = None
        return view

    @staticmethod
    def stack(layers: list[CanvasLayerView], prefix: int) -> CanvasLayerView:
        """The rows of ``layers`` in one view, each prefix left-padded to ``prefix`` positions (a
        quantized prefix stays quantized where every layer's is)."""
        if any(layer.quantized_prefix is None for layer in layers):
            layers = [layer.dequantized() for layer in layers]
        stacked = object.__new__(CanvasLayerView)
        stacked.__dict__.update(layers[0].__dict__)
        stacked.prefix, stacked.slots = prefix, None
        if stacked.quantized_prefix is None:
            stacked.keys, stacked.values = (
                mx.concatenate([_pad_positions(getattr(layer, name), prefix - layer.prefix) for layer in layers])
                for name in ("keys", "values")
            )
            return stacked
        stacked.keys = mx.concatenate([layer.keys for layer in layers])
        stacked.values = mx.concatenate([layer.values for layer in layers])
        stacked.quantized_prefix = _concatenate(
            [_pad_positions(layer.quantized_prefix, prefix - layer.prefix) for layer in layers]
        )
        return stacked


class CanvasView:
    """The prefix K/V of every layer laid out once per canvas, for the steps that denoise it (the
    cache itself is only read). ``positions``: each row's RoPE position of canvas index 0."""

    def __init__(self, cache: KVCache, length: int):
        self.length = length
        self.positions = cache.lengths
        self.windows = cache.windows
        self.layers: list[CanvasLayerView] = []
        self.masks: list[mx.array | None] = []
        for i, c in enumerate(cache.layers):
            keys, values = cache.layer_keys(i)
            self.layers.append(CanvasLayerView(keys, values, length, c.quantization))
            if cache.padded:
                start = c._idx - _first(keys).shape[2]
                valid = mx.arange(start, c._idx)[None, :] >= c.left_padding[:, None]  # [B, P]
                whole = mx.concatenate([valid, mx.ones((valid.shape[0], length), dtype=mx.bool_)], axis=1)
                self.masks.append(whole[:, None, None, :])
            else:
                self.masks.append(None)

    def set_active(self, active: mx.array | None) -> None:
        """The canvas indexes [B, A] the next forward computes (None: the whole canvas)."""
        for layer in self.layers:
            layer.slots = active

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]

    def encoder_masks(self) -> list[mx.array]:
        """Which keys each canvas position may see when the canvas is encoded through this view
        (committed, causally), per layer [B|1, 1, C, P + C]: the real prefix keys inside its window
        and the canvas positions up to itself. A sliding layer's view holds the last window − 1
        prefix positions, all that canvas position 0 sees; later ones see fewer."""
        masks = []
        for layer, window, valid in zip(self.layers, self.windows, self.masks):
            q = mx.arange(layer.prefix, layer.prefix + self.length)[:, None]
            k = mx.arange(layer.prefix + self.length)[None, :]
            allowed = k <= q
            if window is not None:
                allowed = allowed & (k > q - window)
            allowed = allowed[None, None]
            masks.append(allowed if valid is None else allowed & valid)
        return masks

    def append_canvas(self, caches: list[KVCache]) -> None:
        """Append each row's canvas K/V (an encode through this view wrote them) to that row's own
        cache, ``caches[r]`` for row r: several rows' commits encoded in one forward."""
        for i, layer in enumerate(self.layers):
            for r, cache in enumerate(caches):
                cache.layers[i].update_and_fetch(*layer.canvas(r))

    def select(self, rows: list[int]) -> CanvasView:
        """The same view for a subset of its rows (rows whose canvas is done stop costing compute)."""
        index = mx.array(rows, dtype=mx.int32)
        view = object.__new__(CanvasView)
        view.length, view.positions, view.windows = self.length, self.positions[index], self.windows
        view.layers = [layer.select(index) for layer in self.layers]
        view.masks = [None if m is None else m[index] for m in self.masks]
        return view

    @staticmethod
    def stack(views: list[CanvasView]) -> CanvasView:
        """One view of several views' rows (each laid out from its own cache, prefixes of any
        lengths), left-padded per layer to the longest prefix with the padding masked, the canvas
        K/V each holds kept: rows that started their canvases at different times share one forward
        (continuous batching)."""
        if len(views) == 1:
            return views[0]
        view = object.__new__(CanvasView)
        view.length = length = views[0].length
        view.positions = mx.concatenate([v.positions for v in views])
        view.windows = views[0].windows
        view.layers, view.masks = [], []
        for i in range(len(views[0].layers)):
            layers = [v.layers[i] for v in views]
            prefix = max(layer.prefix for layer in layers)
            masks = []
            for v, layer in zip(views, layers):
                pad = prefix - layer.prefix
                own = (
                    v.masks[i]
                    if v.masks[i] is not None
                    else mx.ones((layer.keys.shape[0], 1, 1, layer.prefix + length), dtype=mx.bool_)
                )
                masks.append(mx.pad(own, [(0, 0), (0, 0), (0, 0), (pad, 0)], constant_values=False))
            view.layers.append(CanvasLayerView.stack(layers, prefix))
            padded = any(layer.prefix < prefix for layer in layers) or any(v.masks[i] is not None for v in views)
            view.masks.append(mx.concatenate(masks) if padded else None)
        return view
