"""Fine-tune a DiffusionGemma with its own objective: LoRA, QLoRA (LoRA on a quantized base) or full.

    python -m mlx_dgemma.lora --train --data DIR [--model PATH] [--iters 600] [--learning-rate 1e-3]
    python -m mlx_dgemma.lora --test --data DIR --adapter-path adapters

mlx-lm's flags, data forms (data.py) and adapter files: ``adapters.safetensors`` (the trainable
parameters), ``adapter_config.json`` (the run's options, ``fine_tune_type``, ``num_layers``,
``lora_parameters``, ``train_embeddings``), and ``NNNNNNN_adapters.safetensors`` every
``--save-every`` iterations. The LoRA layers are mlx-lm's own (``mlx_lm.tuner``), so LoRA adapters
move between the two; the loss is DiffusionGemma's (train.py), not a next-token loss. Beyond
mlx-lm: ``--trainable-tokens`` (embedding rows of a new task's tokens only) and
``--embedding-learning-rate``, for teaching tokens the model never produced (examples/upper.yaml).
"""

from __future__ import annotations

from . import fast_blas

fast_blas.load()  # a command-line process: the fast BLAS before mlx.core loads

import argparse
import inspect
import math
import re
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from .cli import check_writable_folder, command_line
from .errors import FineTuneError
from .tuner import objective as train
from .tuner.adapters import (
    EmbeddingRows,
    apply_fine_tune,
    load_adapters,
    load_trainable,
    mlx_lm_tuner,
)
from .tuner.datasets import load_dataset
from .tuner.trainer import evaluate_loss, report, run_training
from .validate import at_least, check_seed, finite_number, shown

CONFIG_DEFAULTS = {
    "model": None,
    "train": False,
    "data": "data",
    "fine_tune_type": "lora",
    "optimizer": "adam",
    "seed": 0,
    "num_layers": None,  # mlx-lm's 16, or all the model has if fewer
    "batch_size": 4,
    "iters": 1000,
    "val_batches": 25,
    "learning_rate": 1e-5,
    "lr_schedule": None,  # YAML only, mlx-lm's form: {name: cosine_decay, arguments: [1e-5, 1000], warmup: 100}
    "steps_per_report": 10,
    "steps_per_eval": 200,
    "resume_adapter_file": None,
    "adapter_path": "adapters",
    "save_every": 100,
    "test": False,
    "test_batches": 500,
    "max_seq_length": None,  # the model's context
    "grad_checkpoint": False,
    "mask_prompt": False,
    "train_embeddings": False,
    "trainable_tokens": None,
    "embedding_learning_rate": None,  # the trained embeddings' peak learning rate [default: learning_rate]
    "lora_parameters": {"rank": 8, "dropout": 0.0, "scale": 20.0},
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="LoRA, QLoRA or full fine-tuning with DiffusionGemma's objective.")
    p.add_argument("--model", help="Checkpoint folder or Hub id [default: the bundled demo model].")
    p.add_argument("--train", action="store_true", default=None, help="Do training.")
    p.add_argument("--data", help="Folder with train.jsonl, valid.jsonl, test.jsonl.")
    p.add_argument("--fine-tune-type", choices=["lora", "full"], help="lora (QLoRA on a quantized model) or full.")
    p.add_argument("--optimizer", choices=["adam", "adamw"])
    p.add_argument(
        "--mask-prompt", action="store_true", default=None, help="Keep the prompt out of the encoder's causal-LM loss."
    )
    p.add_argument(
        "--train-embeddings",
        action="store_true",
        default=None,
        help="Also train the token embeddings, every row; they are the tied output head (PEFT's "
        "modules_to_save). They are saved with the adapters.",
    )
    p.add_argument(
        "--trainable-tokens",
        metavar="TEXT",
        help="Train only the embedding rows of the tokens TEXT encodes to (e.g. the characters a new "
        "task needs that the model never produced); implies --train-embeddings.",
    )
    p.add_argument(
        "--embedding-learning-rate",
        type=float,
        help="The trained embeddings' learning rate, under the same schedule (new rows start far from "
        "where they must go) [default: --learning-rate].",
    )
    p.add_argument("--num-layers", type=int, help="Layers to fine-tune, from the last [default: 16]; -1 for all.")
    p.add_argument("--batch-size", type=int, help="Minibatch size.")
    p.add_argument("--iters", type=int, help="Iterations to train for.")
    p.add_argument("--val-batches", type=int, help="Validation batches, -1 for the whole validation set.")
    p.add_argument("--learning-rate", type=float, help="Adam learning rate.")
    p.add_argument("--steps-per-report", type=int, help="Training steps between loss reports.")
    p.add_argument("--steps-per-eval", type=int, help="Training steps between validations.")
    p.add_argument("--resume-adapter-file", help="Start from these adapter weights.")
    p.add_argument("--adapter-path", help="Save/load path for the adapters.")
    p.add_argument("--save-every", type=int, help="Save the adapters every N iterations.")
    p.add_argument("--test", action="store_true", default=None, help="Evaluate on the test set (after training).")
    p.add_argument("--test-batches", type=int, help="Test batches, -1 for the whole test set.")
    p.add_argument("--max-seq-length", type=int, help="Longest sample (prompt + canvases) [default: the context].")
    p.add_argument("-c", "--config", help="A YAML file with these options (and lora_parameters).")
    p.add_argument(
        "--grad-checkpoint",
        action="store_true",
        default=None,
        help="Recompute each layer in the backward pass to save memory.",
    )
    p.add_argument("--seed", type=int, help="The PRNG seed (data order, noise, LoRA init).")
    return p


def _yaml_loader():
    """PyYAML's safe loader, reading ``1e-5`` as a number as mlx-lm's does (YAML 1.1 wants ``1.0e-5``)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(
            r"""^(?:
         [-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
            re.X,
        ),
        list("-+0123456789."),
    )
    return Loader


def read_options_file(path: str) -> dict:
    """The options of a YAML config file, a mapping of CONFIG_DEFAULTS' keys."""
    import yaml

    try:
        config = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_yaml_loader())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        reason = getattr(e, "strerror", None) or " ".join(str(e).split())
        raise FineTuneError(f"cannot read the config {path}: {reason}") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise FineTuneError(
            f"the config {path} must be a mapping of options (key: value), got a {type(config).__name__}"
        )
    if unknown := sorted(map(str, set(config) - set(CONFIG_DEFAULTS))):
        raise FineTuneError(f"{path}: unknown option {shown(unknown[0])}")
    return config


def resolve_args(argv=None) -> argparse.Namespace:
    """Flags over the YAML config over mlx-lm's defaults, each checked (``check_options``);
    ``lora_parameters`` of the config fill in the defaults they do not give."""
    args = build_parser().parse_args(argv)
    config = read_options_file(args.config) if args.config else {}
    sources = {}
    for key, default in CONFIG_DEFAULTS.items():
        if getattr(args, key, None) is not None:
            sources[key] = "--" + key.replace("_", "-")
            continue
        value = config.get(key, default)
        sources[key] = f"{key} in {args.config}" if key in config else key
        if key == "lora_parameters" and isinstance(value, dict):
            value = {**default, **value}
        setattr(args, key, value)
    check_options(args, sources)
    return args


def _optional(check):
    return lambda value, name: None if value is None else check(value, name)


def _one_of(*choices):
    def check(value, name):
        if value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {shown(value)}")

    return check


def _of_type(kind, what):
    def check(value, name):
        if not isinstance(value, kind):
            raise ValueError(f"{name} must be {what}, got {shown(value)}")

    return check


def _count_or_all(value, name):  # -1: every batch, or every layer (whose count is checked once the model loads)
    if value != -1:
        at_least(1)(value, name)


def _lora_parameters(value, name):
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a mapping (rank, dropout, scale), got {shown(value)}")
    if unknown := sorted(map(str, set(value) - {"rank", "dropout", "scale", "keys"})):
        raise ValueError(f"{name}: unknown key {shown(unknown[0])} (rank, dropout, scale, keys)")
    at_least(1)(value["rank"], f"{name} rank")
    finite_number(0.0, 1.0)(value["dropout"], f"{name} dropout")
    finite_number(-math.inf)(value["scale"], f"{name} scale")
    if "keys" in value and not (isinstance(value["keys"], list) and all(isinstance(k, str) for k in value["keys"])):
        raise ValueError(f"{name} keys must be a list of module names, got {shown(value['keys'])}")


# The schedules an lr_schedule may name: mlx's that take numbers (join_schedules takes schedules).
SCHEDULES = ("cosine_decay", "exponential_decay", "linear_schedule", "step_decay")


def _lr_schedule(value, name):
    if (
        not isinstance(value, dict)
        or not isinstance(value.get("name"), str)
        or not isinstance(value.get("arguments"), list)
        or not value["arguments"]
    ):
        raise ValueError(
            f"{name} must be a mapping with a name and arguments, as mlx-lm's "
            f"{{name: cosine_decay, arguments: [1.0e-5, 1000], warmup: 100}}; got {shown(value)}"
        )
    if unknown := sorted(map(str, set(value) - {"name", "arguments", "warmup", "warmup_init"})):
        raise ValueError(f"{name}: unknown key {shown(unknown[0])} (name, arguments, warmup, warmup_init)")
    if value["name"] not in SCHEDULES:
        raise ValueError(
            f"{name}: name must be one of {', '.join(SCHEDULES)} (mlx.optimizers.schedulers), "
            f"got {shown(value['name'])}"
        )
    schedule, arguments = getattr(optim.schedulers, value["name"]), value["arguments"]
    try:
        inspect.signature(schedule).bind(*arguments)
    except TypeError:
        raise ValueError(
            f"{name}: {value['name']} takes the arguments {list(inspect.signature(schedule).parameters)}, "
            f"got {len(arguments)}"
        ) from None
    finite_number(0.0, low_open=True)(arguments[0], f"{name} arguments[0] (the peak learning rate)")
    for i, argument in enumerate(arguments[1:], 1):
        finite_number(-math.inf)(argument, f"{name} arguments[{i}]")
    at_least(0)(value.get("warmup", 0), f"{name} warmup")
    finite_number(0.0)(value.get("warmup_init", 0.0), f"{name} warmup_init")
    try:
        schedule(*arguments)
    except ValueError as e:  # (linear_schedule's steps < 1)
        raise ValueError(f"{name}: {value['name']}{tuple(arguments)}: {e}") from None


_TEXT = _optional(_of_type(str, "text"))
_FLAG = _of_type(bool, "true or false")
OPTION_CHECKS = {
    "model": _TEXT,
    "train": _FLAG,
    "data": _of_type(str, "text"),
    "fine_tune_type": _one_of("lora", "full"),
    "optimizer": _one_of("adam", "adamw"),
    "seed": check_seed,
    "num_layers": _optional(_count_or_all),
    "batch_size": at_least(1),
    "iters": at_least(1),
    "val_batches": _count_or_all,
    "learning_rate": finite_number(0.0, low_open=True),
    "lr_schedule": _optional(_lr_schedule),
    "steps_per_report": at_least(1),
    "steps_per_eval": at_least(1),
    "resume_adapter_file": _TEXT,
    "adapter_path": _of_type(str, "text"),
    "save_every": at_least(1),
    "test": _FLAG,
    "test_batches": _count_or_all,
    "max_seq_length": _optional(at_least(1)),
    "grad_checkpoint": _FLAG,
    "mask_prompt": _FLAG,
    "train_embeddings": _FLAG,
    "trainable_tokens": _TEXT,
    "embedding_learning_rate": _optional(finite_number(0.0, low_open=True)),
    "lora_parameters": _lora_parameters,
}


def check_options(args: argparse.Namespace, sources: dict[str, str]) -> None:
    """Every option of a run, checked before anything loads: a NaN learning rate or a batch of 0
    would otherwise train to the end and save garbage. ``sources`` names each option as the user
    gave it (the flag, or the key in the config file)."""
    for key, check in OPTION_CHECKS.items():
        try:
            check(getattr(args, key), sources.get(key, key))
        except ValueError as e:
            raise FineTuneError(str(e)) from None


def fine_tune(args, log=report) -> None:
    from .demo import DEMO_MODEL
    from .loader import load

    mlx_lm_tuner()  # the train extra, before the model loads
    mx.random.seed(args.seed)
    model, tokenizer = load(args.model or DEMO_MODEL)
    cfg = model.config
    n_layers = len(model.layers)
    if args.num_layers is None:
        args.num_layers = min(16, n_layers)
    elif args.num_layers < 0:
        args.num_layers = n_layers
    elif not 1 <= args.num_layers <= n_layers:
        raise FineTuneError(f"--num-layers {args.num_layers}: the model has {n_layers} layers (-1: all)")
    max_length = args.max_seq_length or cfg.max_position_embeddings
    splits = (("train", "valid") if args.train else ()) + (("test",) if args.test else ())
    if not splits:
        raise FineTuneError("give --train, --test or both")
    data = load_dataset(args.data, tokenizer, cfg.canvas_length, max_length, splits, args.mask_prompt)
    token_ids = None
    if args.trainable_tokens is not None:
        token_ids = sorted(set(tokenizer.encode(str(args.trainable_tokens), add_special_tokens=False)))
        if not token_ids:
            raise FineTuneError(
                f"--trainable-tokens {args.trainable_tokens!r} encodes to no token; give the "
                "text of the tokens whose embeddings to train"
            )
        args.train_embeddings = True
    gen = getattr(model, "generation_config", None)
    objective = train.ObjectiveConfig(t_min=gen.t_min, t_max=gen.t_max) if gen else train.ObjectiveConfig()
    if args.train:
        if len(data["train"]) < args.batch_size:
            raise FineTuneError(
                f"train.jsonl has {len(data['train'])} samples, fewer than --batch-size {args.batch_size}"
            )
        check_writable_folder(args.adapter_path, "--adapter-path")
        apply_fine_tune(model, args.fine_tune_type, args.num_layers, args.lora_parameters, args.train_embeddings)
        if args.resume_adapter_file:
            load_trainable(model, args.resume_adapter_file, "the run that wrote it")
        embedding_rows = EmbeddingRows(model, token_ids) if token_ids else None
        trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
        total = sum(v.size for _, v in tree_flatten(model.parameters()))
        log(
            f"Trainable parameters: {100 * trainable / total:.3f}% ({trainable / 1e6:.3f}M/{total / 1e6:.3f}M), "
            f"{args.fine_tune_type} on the last {args.num_layers} of {n_layers} layers"
            + (f", the embedding rows of {len(token_ids)} tokens" if token_ids else "")
        )
        with np.errstate(over="ignore", invalid="ignore"):  # a diverging run is stopped by its loss, in one line
            run_training(model, args, data["train"], data["valid"], objective, log, embedding_rows)
    elif args.adapter_path:
        load_adapters(model, args.adapter_path)
    if args.test:
        model.eval()
        loss, decoder, encoder = evaluate_loss(
            model, data["test"], args.batch_size, args.test_batches, args.seed + 3, objective
        )
        log(f"Test loss {loss:.3f} (decoder {decoder:.3f}, encoder {encoder:.3f}).")


@command_line
def main(argv=None) -> None:
    fine_tune(resolve_args(argv))


if __name__ == "__main__":
    main()
