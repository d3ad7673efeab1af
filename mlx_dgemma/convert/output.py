"""Where a conversion writes: the destination's checks (nothing but an earlier conversion is ever
replaced), a staging folder beside it that replaces it on success and vanishes on failure or
SIGTERM/SIGHUP, the marker that lists what a conversion wrote, its shards and the small files copied
beside them; and a loaded model written as a checkpoint (``save_model``, after ``dequantize_model``
where it is to be unquantized). convert.py and fuse.py write through it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import ConversionError
from ..loader import HUB_PATTERNS, WEIGHTS_INDEX
from ..model.experts import ExpertLinear, QuantizedExpertLinear
from ..safetensors_io import ShardWriter, TensorSpec, shard_names, write_index

MARKER = ".mlx_dgemma_conversion.json"  # written last into every output: its files, so --force replaces only those
MAX_SHARD_BYTES = 5 << 30  # mlx-lm's limit
_COPIED = [p for p in HUB_PATTERNS if p != "*.safetensors"]  # tokenizer, chat template, generation config
_REWRITTEN = {"config.json", WEIGHTS_INDEX}
_STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class ConversionStopped(BaseException):
    """SIGTERM or SIGHUP during a conversion (raised like KeyboardInterrupt, after which the partial
    output is removed)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"conversion stopped by {signal.Signals(signum).name}; the partial output was removed")


def write_marker(folder: Path) -> None:
    """The list of the files this conversion wrote, written last: what ``--force`` may replace."""
    files = sorted(p.name for p in folder.iterdir())
    (folder / MARKER).write_text(json.dumps({"written_by": "mlx_dgemma.convert", "files": files}, indent=1))


def foreign_files(dst: Path) -> list[str]:
    """The entries of ``dst`` a conversion did not write (all of them where it has no valid marker)."""
    entries = sorted(p.name for p in dst.iterdir())
    try:
        marker = json.loads((dst / MARKER).read_text())
        files = marker["files"] if marker.get("written_by") == "mlx_dgemma.convert" else []
        ours = {MARKER, *files} if isinstance(files, list) and all(isinstance(f, str) for f in files) else set()
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        ours = set()
    return [name for name in entries if name not in ours or not (dst / name).is_file() or (dst / name).is_symlink()]


def check_destination(dst: Path, force: bool, flag: str = "--mlx-path") -> None:
    """Refuse a destination whose replacement could lose anything: a file or link, a folder holding
    files a conversion did not write (even with ``force``), or an earlier conversion without ``force``."""
    if dst.is_symlink() or (dst.exists() and not dst.is_dir()):
        raise ConversionError(f"{dst} exists and is not a plain folder (a file or a link); choose another {flag}")
    if not dst.exists():
        return
    if foreign := foreign_files(dst):
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise ConversionError(
            f"{dst} holds files a conversion did not write ({foreign[0]}{more}); "
            f"choose another {flag} (--force replaces only an earlier conversion)"
        )
    if not force:
        raise ConversionError(f"{dst} already exists; pass --force to replace it")


def check_apart(src: Path, dst: Path, flag: str = "--mlx-path") -> None:
    """The destination may neither be, hold, nor lie inside the source (replacing it would delete it)."""
    source, target = src.resolve(), dst.resolve()
    if target == source:
        raise ConversionError(f"{dst} is the source checkpoint; choose another {flag}")
    if source.is_relative_to(target):
        raise ConversionError(f"{dst} contains the source checkpoint {src}; choose an {flag} outside it")
    if target.is_relative_to(source):
        raise ConversionError(f"{dst} is inside the source checkpoint {src}; choose an {flag} outside it")


@contextmanager
def _stop_signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP raise ConversionStopped (once; a second is ignored while cleaning up), so a
    killed conversion removes its partial output. Signals reach only the main thread's handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        for s in _STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise ConversionStopped(signum)

    previous = {s: signal.signal(s, stop) for s in _STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _staging_prefix(dst: Path) -> str:
    return f".{dst.name}."


def sweep_stale_staging(dst: Path) -> list[Path]:
    """Remove the temporary folders of earlier conversions to ``dst`` whose process is gone (killed
    by SIGKILL or a power cut, say); a live process's folder is left alone. Returns what was removed."""
    removed = []
    prefix = _staging_prefix(dst)
    for path in dst.parent.iterdir() if dst.parent.is_dir() else []:
        name = path.name
        if not (name.startswith(prefix) and name.endswith(".converting") and path.is_dir()):
            continue
        pid = name[len(prefix) :].split(".", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


@contextmanager
def staging_folder(dst: Path, force: bool, flag: str = "--mlx-path") -> Iterator[Path]:
    """A temporary sibling of ``dst`` (named with this process's id) that replaces it when the block
    succeeds and vanishes when it fails, is interrupted, or gets SIGTERM/SIGHUP."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_staging(dst)
    tmp = None
    with _stop_signals_raise():
        try:
            tmp = Path(
                tempfile.mkdtemp(prefix=f"{_staging_prefix(dst)}{os.getpid()}.", suffix=".converting", dir=dst.parent)
            )
            umask = os.umask(0)
            os.umask(umask)
            tmp.chmod(0o777 & ~umask)  # mkdtemp's folder is private; the result should not be
            yield tmp
            write_marker(tmp)
            _replace(tmp, dst, force, flag)
        except BaseException:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise


def _replace(new: Path, dst: Path, force: bool, flag: str) -> None:
    if not dst.exists() and not dst.is_symlink():
        new.rename(dst)
        return
    check_destination(dst, force, flag)  # again: the destination may have changed during the conversion
    old = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:8]}.old")
    dst.rename(old)
    try:
        new.rename(dst)
    except BaseException:
        old.rename(dst)
        raise
    shutil.rmtree(old) if old.is_dir() else old.unlink()


def split_into_shards(groups: list[tuple[object, list]], max_bytes: int) -> list[list]:
    """Whole tensor groups per shard, in order, each shard under ``max_bytes`` unless one group is larger."""
    shards: list[list] = [[]]
    size = 0
    for target, specs in groups:
        nbytes = sum(s.nbytes for s in specs)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((target, specs))
        size += nbytes
    return shards


def copy_side_files(src: Path, folder: Path) -> None:
    """Tokenizer, chat template, generation config: every small file a loader reads besides weights."""
    for pattern in _COPIED:
        for path in src.glob(pattern):
            if path.is_file() and path.name not in _REWRITTEN and path.name != MARKER:
                shutil.copy2(path, folder / path.name)


def _dequantized(module):
    def weight(m):
        return mx.dequantize(m.weight, m.scales, m.get("biases"), group_size=m.group_size, bits=m.bits, mode=m.mode)

    if isinstance(module, nn.QuantizedLinear):
        out_dims, in_dims = weight(module).shape
        linear = nn.Linear(in_dims, out_dims, bias="bias" in module)
        linear.weight = weight(module)
        if "bias" in module:
            linear.bias = module.bias
        return linear
    if isinstance(module, nn.QuantizedEmbedding):
        embedding = nn.Embedding(*weight(module).shape)
        embedding.weight = weight(module)
        return embedding
    if isinstance(module, QuantizedExpertLinear):
        experts, out_dims, in_dims = weight(module).shape
        linear = ExpertLinear(in_dims, out_dims, experts)
        linear.weight = weight(module)
        return linear
    return None


def dequantize_model(model):
    """Every quantized layer replaced by its plain layer of the dequantized weights."""
    replaced = [(name, new) for name, module in model.named_modules() if (new := _dequantized(module)) is not None]
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    return model


def save_model(
    model, base_folder: Path, save_path: Path, dequantized: bool = False, force: bool = False, flag: str = "--mlx-path"
) -> Path:
    """The model's weights in ≤ 5 GB shards, the base's config (without its quantization entries when
    ``dequantized``) and side files; written in a temporary folder renamed at the end (``flag``: the
    command-line flag that names ``save_path``, for errors)."""
    weights = dict(tree_flatten(model.parameters()))
    groups = [(name, [TensorSpec.of(name, array)]) for name, array in weights.items()]
    shards = split_into_shards(groups, MAX_SHARD_BYTES)
    config = json.loads((base_folder / "config.json").read_text())
    if dequantized:
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    with staging_folder(save_path, force, flag) as folder:
        weight_map = {}
        for file_name, shard in zip(shard_names(len(shards)), shards):
            with ShardWriter(folder / file_name, [spec for _, specs in shard for spec in specs]) as writer:
                for name, _ in shard:
                    writer.write(name, weights[name])
                    weight_map[name] = file_name
        if len(shards) > 1:
            write_index(folder, weight_map, sum(a.nbytes for a in weights.values()))
        (folder / "config.json").write_text(json.dumps(config, indent=4))
        copy_side_files(base_folder, folder)
    return save_path
