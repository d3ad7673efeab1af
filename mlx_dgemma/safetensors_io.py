"""Safetensors one tensor at a time: headers read and checked without touching the data, tensors
read on demand, and shards written tensor by tensor into a header laid out up front. Neither side
ever holds more than the tensor in hand.

Reads use a positioned read per tensor rather than a long-lived memory map: pages of a map stay
resident (and count in the process's RSS) until the whole map is dropped, so reading a 5 GB shard
through one map grows the process by 5 GB.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from .errors import CheckpointError

# safetensors dtype name → MLX dtype; numpy has no bfloat16, so its bytes travel as uint16.
_MLX_DTYPES = {
    "BOOL": mx.bool_,
    "U8": mx.uint8,
    "I8": mx.int8,
    "U16": mx.uint16,
    "I16": mx.int16,
    "U32": mx.uint32,
    "I32": mx.int32,
    "U64": mx.uint64,
    "I64": mx.int64,
    "F16": mx.float16,
    "BF16": mx.bfloat16,
    "F32": mx.float32,
}
_NAMES = {dtype: name for name, dtype in _MLX_DTYPES.items()}
_NUMPY_DTYPES = {
    mx.bool_: np.bool_,
    mx.uint8: np.uint8,
    mx.int8: np.int8,
    mx.uint16: np.uint16,
    mx.int16: np.int16,
    mx.uint32: np.uint32,
    mx.int32: np.int32,
    mx.uint64: np.uint64,
    mx.int64: np.int64,
    mx.float16: np.float16,
    mx.float32: np.float32,
}
_MAX_HEADER = 100 << 20  # the safetensors library's own limit


def _storage(dtype: mx.Dtype) -> mx.Dtype:
    return mx.uint16 if dtype == mx.bfloat16 else dtype


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in a safetensors file."""

    path: Path
    dtype: mx.Dtype
    shape: tuple[int, ...]
    offset: int  # absolute, in bytes
    nbytes: int


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors a safetensors file holds; raises CheckpointError if the header is damaged or the
    data it describes runs past the end of the file (a truncated download)."""

    def damaged(reason: str) -> CheckpointError:
        return CheckpointError(f"{path.name} is not a readable safetensors file ({reason}); re-download it")

    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise damaged("shorter than a header")
        header_len = struct.unpack("<Q", prefix)[0]
        if header_len > min(size - 8, _MAX_HEADER):
            raise damaged("header length points past the end of the file")
        try:
            header = json.loads(f.read(header_len))
        except (ValueError, RecursionError):  # (bad UTF-8 or JSON, an integer past Python's digit limit, deep nesting)
            raise damaged("header is not JSON") from None
    if not isinstance(header, dict):
        raise damaged("header is not a JSON object")
    data_start = 8 + header_len
    tensors = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        entry = entry if isinstance(entry, dict) else {}
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not (
            entry.get("dtype") in _MLX_DTYPES
            and _naturals(shape)
            and _naturals(offsets)
            and len(offsets) == 2
            and offsets[0] <= offsets[1]
        ):
            raise damaged(
                f"bad header entry for {key[:80]!r}: it needs a dtype, a shape of whole numbers >= 0 and "
                "data_offsets [begin, end]"
            )
        dtype, shape, (begin, end) = _MLX_DTYPES[entry["dtype"]], tuple(shape), offsets
        if data_start + end > size:
            raise damaged(f"{key[:80]!r} ends past the end of the file")
        nbytes = math.prod(shape) * dtype.size
        if end - begin != nbytes:
            raise damaged(f"{key[:80]!r} spans {end - begin} bytes, its shape {_cut(list(shape))} needs {_cut(nbytes)}")
        tensors[key] = TensorInfo(path, dtype, shape, data_start + begin, nbytes)
    return tensors


def _cut(value, width: int = 40) -> str:
    text = str(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _naturals(value) -> bool:
    """A list of whole numbers >= 0 (JSON's 1.5, true, Infinity and strings are none)."""
    return isinstance(value, list) and all(type(x) is int and x >= 0 for x in value)


def read_tensor(info: TensorInfo) -> mx.array:
    storage = _storage(info.dtype)
    data = np.fromfile(info.path, dtype=_NUMPY_DTYPES[storage], count=math.prod(info.shape), offset=info.offset)
    return mx.array(data.reshape(info.shape)).view(info.dtype)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: its name, shape and dtype, known before its data exists."""

    name: str
    shape: tuple[int, ...]
    dtype: mx.Dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.size

    @classmethod
    def of(cls, name: str, array: mx.array) -> "TensorSpec":
        """The spec of a (typically lazy, never evaluated) array."""
        return cls(name, tuple(array.shape), array.dtype)


def shard_header(specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The bytes a shard of ``specs`` starts with: the header's length and the header."""
    header: dict = {"__metadata__": metadata or {"format": "mlx"}}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": _NAMES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keeps the data 8-byte aligned, as the safetensors library does
    return struct.pack("<Q", len(raw)) + raw


def shard_size(specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> int:
    """The size in bytes of the file ``ShardWriter`` writes for ``specs``."""
    return len(shard_header(specs, metadata)) + sum(s.nbytes for s in specs)


class ShardWriter:
    """One safetensors file whose header is written first; the tensors then arrive in header order."""

    def __init__(self, path: Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None):
        self.path = path
        self._pending = list(reversed(specs))
        self._file = open(path, "wb")
        self._file.write(shard_header(specs, metadata))

    def write(self, name: str, array: mx.array) -> None:
        spec = self._pending.pop()
        if spec != TensorSpec.of(name, array):
            raise RuntimeError(f"{self.path.name}: expected {spec}, got {TensorSpec.of(name, array)}")
        data = np.ascontiguousarray(np.asarray(array.view(_storage(array.dtype))))
        self._file.write(data.data)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._file.close()
        if exc_type is None and self._pending:
            raise RuntimeError(f"{self.path.name}: {len(self._pending)} tensors were never written")


def shard_names(count: int) -> list[str]:
    """mlx-lm's shard file names."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_index(folder: Path, weight_map: dict[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
