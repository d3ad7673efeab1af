"""Adapters of a fine-tuning run: make a model's last layers trainable (mlx-lm's LoRA layers, QLoRA on
quantized ones, or the layers themselves), save what was trained, and apply a run's adapter folder
to a model (``load(path, adapter_path=...)``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..errors import FineTuneError, MissingExtra

ADAPTERS = "adapters.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def mlx_lm_tuner():
    """mlx-lm's tuner utilities (its LoRA layers, its learning-rate schedules): the ``train`` extra."""
    try:
        from mlx_lm.tuner import utils
    except ImportError as e:
        raise MissingExtra(e.name, "LoRA (training, --adapter-path)", "train") from None
    return utils


def apply_fine_tune(
    model, fine_tune_type: str, num_layers: int, lora_parameters: dict, train_embeddings: bool = False
) -> None:
    """Freeze the model, then make the last ``num_layers`` layers trainable: their linear layers
    become mlx-lm's LoRA layers (on quantized ones: QLoRA), or (full) the layers themselves.
    Encoder and decoder share these layers, so both passes use the adapters. ``train_embeddings``
    unfreezes the token embeddings too (input and tied head)."""
    tuner = mlx_lm_tuner()
    model.freeze()
    embed = model.model.decoder.embed_tokens
    if train_embeddings and isinstance(embed, nn.QuantizedEmbedding):
        raise FineTuneError("--train-embeddings needs unquantized embeddings (the quantized model keeps them fixed)")
    if fine_tune_type == "full":
        layers = model.layers[-num_layers:]
        if (
            any(
                isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
                for layer in layers
                for _, m in layer.named_modules()
            )
            or model.config.quantization
        ):
            raise FineTuneError("full fine-tuning needs an unquantized model; use --fine-tune-type lora (QLoRA)")
        for layer in layers:
            layer.unfreeze()
    elif fine_tune_type == "lora":
        tuner.linear_to_lora_layers(model, num_layers, lora_parameters)
    else:
        raise FineTuneError(f"unknown fine-tune type {fine_tune_type!r}; choose lora or full")
    if train_embeddings:
        embed.unfreeze()


class EmbeddingRows:
    """Embedding training restricted to the rows of some tokens (PEFT's trainable tokens). The
    embeddings are the tied head too: a trained row moves every output that token competes in, so a
    new task's tokens are trained and the rows the model already uses stay as they are. The other
    rows get no gradient and are put back after each update (an optimizer's weight decay would
    still move them)."""

    def __init__(self, model, token_ids: list[int]):
        self.embed = model.model.decoder.embed_tokens
        vocab = self.embed.weight.shape[0]
        if not token_ids or not all(0 <= i < vocab for i in token_ids):
            raise FineTuneError(f"trainable tokens must be 1 or more ids in 0..{vocab - 1}, got {token_ids}")
        rows = np.zeros((vocab, 1), dtype=bool)
        rows[token_ids] = True
        self.rows, self.frozen = mx.array(rows), mx.array(self.embed.weight)

    def mask_gradient(self, grads: dict) -> dict:
        grad = grads["model"]["decoder"]["embed_tokens"]
        grad["weight"] = mx.where(self.rows, grad["weight"], 0)
        return grads

    def restore(self) -> None:
        self.embed.weight = mx.where(self.rows, self.embed.weight, self.frozen)


def write_atomically(path: Path, write) -> None:
    """``write(temporary_path)`` in ``path``'s folder, then renamed over ``path``: a failed or
    interrupted write leaves the previous file (or none) and no temporary one. The temporary name
    keeps the suffix (writers such as mx.save_safetensors add theirs otherwise)."""
    path = Path(path)
    temporary = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def save_adapters(model, path: Path) -> None:
    """The trainable parameters at ``path``, written whole or not at all (a full disk leaves the previous file)."""
    weights = dict(tree_flatten(model.trainable_parameters()))
    try:
        write_atomically(path, lambda temporary: mx.save_safetensors(str(temporary), weights))
    except OSError as e:
        raise FineTuneError(f"cannot write {path}: {e.strerror or e}") from None


def load_adapters(model, adapter_path: str | Path):
    """Apply the adapters of an (mlx-lm style) adapter folder to ``model``, in place."""
    folder = Path(adapter_path)
    for name in (ADAPTER_CONFIG, ADAPTERS):
        if not (folder / name).is_file():
            raise FineTuneError(f"no {name} in {folder}; pass the --adapter-path a training run wrote")
    config = read_adapter_config(folder / ADAPTER_CONFIG)
    try:
        apply_fine_tune(
            model,
            config.get("fine_tune_type", "lora"),
            config["num_layers"],
            config.get("lora_parameters"),
            config.get("train_embeddings", False),
        )
    except (ValueError, KeyError, TypeError) as e:
        raise FineTuneError(f"{folder / ADAPTER_CONFIG} cannot be applied to this model: {e}") from None
    load_trainable(model, folder / ADAPTERS, "the run that wrote it")
    return model


def read_adapter_config(path: Path) -> dict:
    """A run's adapter_config.json: a JSON object with at least ``num_layers``."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise FineTuneError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    except json.JSONDecodeError as e:
        raise FineTuneError(
            f"{path} is not valid JSON ({e.msg} at line {e.lineno}); pass the --adapter-path a training run wrote"
        ) from None
    if not isinstance(config, dict):
        raise FineTuneError(f"{path} must be a JSON object of the run's options, got a {type(config).__name__}")
    if "num_layers" not in config:
        raise FineTuneError(f"{path} has no num_layers; pass the --adapter-path a training run wrote")
    return config


def load_trainable(model, path: str | Path, origin: str = "the run that wrote it") -> None:
    """Load saved trainable parameters; each must be a trainable parameter of ``model`` with its shape."""
    try:
        weights = mx.load(str(path))
    except Exception:  # MLX raises bare ValueError/RuntimeError for a missing or damaged file
        raise FineTuneError(f"cannot read the adapter file {path}") from None
    trainable = dict(tree_flatten(model.trainable_parameters()))
    for name, value in weights.items():
        if name not in trainable:
            raise FineTuneError(
                f"{path}: {name} is not a trainable parameter here (same --fine-tune-type, "
                f"--num-layers and --train-embeddings as {origin}?)"
            )
        if trainable[name].shape != value.shape:
            raise FineTuneError(
                f"{path}: {name} has shape {tuple(value.shape)}, here "
                f"{tuple(trainable[name].shape)} (same model and LoRA rank as {origin}?)"
            )
    model.load_weights(list(weights.items()), strict=False)
