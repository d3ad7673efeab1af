"""Each broken checkpoint gives one line that names the problem; good ones load from every layout."""

import json
import shutil
import struct

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten
from safetensors.numpy import load_file, save_file

from mlx_dgemma import load
from mlx_dgemma.loader import CheckpointError


@pytest.fixture
def ckpt(checkpoints, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoints("small"), dst)
    return dst


def rewrite(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def load_error(folder) -> str:
    with pytest.raises(CheckpointError) as info:
        load(folder)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_key(ckpt):
    rewrite(ckpt, lambda t: t.pop("model.decoder.layers.2.router.per_expert_scale"))
    assert load_error(ckpt) == "missing weight model.decoder.layers.2.router.per_expert_scale"


def test_missing_encoder_layer_scalar(ckpt):
    rewrite(ckpt, lambda t: t.pop("model.encoder.language_model.layers.1.layer_scalar"))
    assert "model.encoder.language_model.layers.1.layer_scalar" in load_error(ckpt)


def test_unexpected_key(ckpt):
    rewrite(ckpt, lambda t: t.update({"model.decoder.layers.0.mlp.extra_proj.weight": np.zeros((3, 4), np.float32)}))
    msg = load_error(ckpt)
    assert msg.startswith("unexpected weight model.decoder.layers.0.mlp.extra_proj.weight")


def test_shape_mismatch(ckpt):
    rewrite(
        ckpt, lambda t: t.update({"model.decoder.layers.3.self_attn.o_proj.weight": np.zeros((72, 80), np.float32)})
    )
    msg = load_error(ckpt)
    assert "model.decoder.layers.3.self_attn.o_proj.weight" in msg and "(72, 80)" in msg and "(72, 144)" in msg


def test_wrong_model_type(ckpt):
    path = ckpt / "config.json"
    raw = json.loads(path.read_text())
    raw["model_type"] = "gemma3"
    path.write_text(json.dumps(raw))
    assert "model_type 'gemma3'" in load_error(ckpt)


def test_corrupt_safetensors_header(ckpt):
    path = ckpt / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:40] = b"{not json at all, just garbage!!"
    path.write_bytes(bytes(data))
    assert "model.safetensors is not a readable safetensors file" in load_error(ckpt)


def test_truncated_safetensors(ckpt):
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[:5000])
    assert "model.safetensors is not a readable safetensors file" in load_error(ckpt)


def shard(folder, files: int = 2):
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i in range(files):
        part = {k: tensors[k] for k in names[i::files]}
        fname = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        save_file(part, folder / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sharded_checkpoint_loads_like_single_file(checkpoints, ckpt):
    shard(ckpt, 3)
    a, _ = load(checkpoints("small"))
    b, _ = load(ckpt)
    params_b = dict(tree_flatten(b.parameters()))
    for key, value in tree_flatten(a.parameters()):
        assert mx.array_equal(value, params_b[key]), key


def test_missing_shard(ckpt):
    shard(ckpt, 2)
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    msg = load_error(ckpt)
    assert "model-00002-of-00002.safetensors" in msg and "missing" in msg


def test_missing_folder_and_offline_hub_id(tmp_path):
    assert "not a folder" in load_error(tmp_path / "nope")
    assert "not in the local Hugging Face cache" in load_error("google/diffusiongemma-26B-A4B-it")


def test_per_expert_layout_loads_the_same(checkpoints, ckpt):
    """mlx-community per-expert keys (experts.E.gate_proj/up_proj/down_proj) stack into the fused tensors."""

    def split(t):
        for key in [k for k in t if k.endswith(".experts.gate_up_proj")]:
            prefix, fused = key[: -len(".gate_up_proj")], t.pop(key)
            down = t.pop(prefix + ".down_proj")
            inner = fused.shape[1] // 2
            for e in range(fused.shape[0]):
                t[f"{prefix}.{e}.gate_proj.weight"] = np.ascontiguousarray(fused[e, :inner])
                t[f"{prefix}.{e}.up_proj.weight"] = np.ascontiguousarray(fused[e, inner:])
                t[f"{prefix}.{e}.down_proj.weight"] = np.ascontiguousarray(down[e])

    rewrite(ckpt, split)
    a, _ = load(checkpoints("small"))
    b, _ = load(ckpt)
    la, lb = a.layers[1].experts, b.layers[1].experts
    assert mx.array_equal(la.gate_up_proj.weight, lb.gate_up_proj.weight)
    assert mx.array_equal(la.down_proj.weight, lb.down_proj.weight)


def test_checkpoint_without_tokenizer_files_loads(checkpoints):
    _, tokenizer = load(checkpoints("small"))
    assert tokenizer is not None


def test_broken_generation_config(ckpt):
    (ckpt / "generation_config.json").write_text("{ not json")
    assert "generation_config.json is not valid JSON" in load_error(ckpt)


# ---- hostile safetensors headers: one line naming the file, from every command that reads them ----


def hostile_header(folder, header: bytes) -> None:
    header += b" " * (-len(header) % 8)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))


ENTRY = b'{"w": {"dtype": "F32", "shape": %s, "data_offsets": %s}}'
HOSTILE_HEADERS = {
    "deep": b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "infinite-offset": ENTRY % (b"[4]", b"[0, Infinity]"),
    "infinite-dimension": ENTRY % (b"[Infinity]", b"[0, 16]"),
    "5000-digit-offset": ENTRY % (b"[4]", b"[0, " + b"9" * 5000 + b"]"),
    "5000-digit-dimension": ENTRY % (b"[" + b"9" * 4000 + b"]", b"[0, 16]"),
    "negative-dimensions": ENTRY % (b"[-4, -1]", b"[0, 16]"),
    "reversed-offsets": ENTRY % (b"[-4, 1]", b"[16, 0]"),
    "fractional-dimension": ENTRY % (b"[2.5]", b"[0, 10]"),
    "entry-not-an-object": b'{"w": [1, 2]}',
}


def commands(folder):
    from mlx_dgemma.convert.__main__ import sizes_command
    from mlx_dgemma.generate import main as generate_main
    from mlx_dgemma.server.__main__ import main as server_main

    return {
        "convert sizes": (sizes_command, ["--hf-path", str(folder)]),
        "generate": (generate_main, ["--model", str(folder), "--prompt", "hi"]),
        "generate --ignore-memory-check": (
            generate_main,
            ["--model", str(folder), "--prompt", "hi", "--ignore-memory-check"],
        ),
        "server": (server_main, ["--model", str(folder), "--port", "1"]),
    }


@pytest.mark.parametrize("name", list(HOSTILE_HEADERS))
def test_a_hostile_header_is_one_line_naming_the_file(ckpt, name):
    hostile_header(ckpt, HOSTILE_HEADERS[name])
    for command, (main, args) in commands(ckpt).items():
        result = CliRunner().invoke(main, args)
        lines = result.output.strip().split("\n")
        assert result.exit_code == 1 and len(lines) == 1, (command, result.output[-2000:], result.exception)
        assert (
            lines[0].startswith("Error: model.safetensors is not a readable safetensors file") and len(lines[0]) < 300
        ), (command, lines[0][:400])
