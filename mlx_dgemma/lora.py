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

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from . import train  # noqa: E402
from .adapters import (  # noqa: E402
    ADAPTER_CONFIG,
    ADAPTERS,
    EmbeddingRows,
    apply_fine_tune,
    load_adapters,
    load_trainable,
    save_adapters,
)
from .data import iterate_batches, load_dataset  # noqa: E402
from .errors import FineTuneError  # noqa: E402

EMBEDDINGS = "model.decoder.embed_tokens.weight"

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
    p.add_argument("--mask-prompt", action="store_true", default=None,
                   help="Keep the prompt out of the encoder's causal-LM loss.")
    p.add_argument("--train-embeddings", action="store_true", default=None,
                   help="Also train the token embeddings, every row; they are the tied output head (PEFT's "
                        "modules_to_save). They are saved with the adapters.")
    p.add_argument("--trainable-tokens", metavar="TEXT",
                   help="Train only the embedding rows of the tokens TEXT encodes to (e.g. the characters a new "
                        "task needs that the model never produced); implies --train-embeddings.")
    p.add_argument("--embedding-learning-rate", type=float,
                   help="The trained embeddings' learning rate, under the same schedule (new rows start far from "
                        "where they must go) [default: --learning-rate].")
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
    p.add_argument("--grad-checkpoint", action="store_true", default=None,
                   help="Recompute each layer in the backward pass to save memory.")
    p.add_argument("--seed", type=int, help="The PRNG seed (data order, noise, LoRA init).")
    return p


def resolve_args(argv=None) -> argparse.Namespace:
    """Flags over the YAML config over mlx-lm's defaults."""
    args = build_parser().parse_args(argv)
    config = {}
    if args.config:
        import yaml

        try:
            config = yaml.safe_load(Path(args.config).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise FineTuneError(f"cannot read the config {args.config}: {e}") from None
        if unknown := sorted(set(config) - set(CONFIG_DEFAULTS)):
            raise FineTuneError(f"{args.config}: unknown option {unknown[0]!r}")
    for key, default in CONFIG_DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, config.get(key, default))
    return args


def evaluate(model, examples, batch_size: int, num_batches: int, seed: int,
             objective: train.ObjectiveConfig) -> tuple[float, float, float]:
    """Mean total, decoder and encoder loss over ``num_batches`` (-1: all), under noise drawn from
    ``seed`` each time, so that evaluations during a run are comparable."""
    cfg = model.config
    rng = np.random.default_rng(seed)
    sums, count = np.zeros(3), 0
    batches = iterate_batches(examples, batch_size, cfg.canvas_length, cfg.pad_token_id)
    for i, batch in enumerate(batches):
        if i == num_batches:
            break
        noise = train.draw_noise(rng, batch, cfg.canvas_length, cfg.vocab_size, objective)
        losses = train.loss(model, batch, noise, objective)
        sums += batch.size * np.array([losses.total.item(), losses.decoder.item(), losses.encoder.item()])
        count += batch.size
    return tuple(sums / max(count, 1))


def _print(message: str) -> None:
    print(message, flush=True)  # progress reaches a log file as it happens


def make_optimizer(args) -> optim.Optimizer:
    """Adam(W) at ``learning_rate`` or under ``lr_schedule``; with ``embedding_learning_rate``, the
    embeddings get their own Adam(W) under the same schedule scaled to that peak."""
    from mlx_lm.tuner.utils import build_schedule

    kind = optim.AdamW if args.optimizer == "adamw" else optim.Adam
    schedule = build_schedule(args.lr_schedule) if args.lr_schedule else None
    layers = kind(learning_rate=schedule or args.learning_rate)
    if args.embedding_learning_rate is None or not args.train_embeddings:
        return layers
    if schedule:
        ratio = args.embedding_learning_rate / args.lr_schedule["arguments"][0]
        embeddings = kind(learning_rate=lambda step: ratio * schedule(step))
    else:
        embeddings = kind(learning_rate=args.embedding_learning_rate)
    return optim.MultiOptimizer([embeddings, layers], [lambda path, _: path == EMBEDDINGS])


def run_training(model, args, train_set, valid_set, objective: train.ObjectiveConfig, log=_print,
                 embedding_rows: EmbeddingRows | None = None) -> None:
    cfg = model.config
    adapter_path = Path(args.adapter_path)
    adapter_path.mkdir(parents=True, exist_ok=True)
    (adapter_path / ADAPTER_CONFIG).write_text(json.dumps(
        {k: v for k, v in vars(args).items() if k != "config"}, indent=4))
    optimizer = make_optimizer(args)

    def step_loss(batch, noise):
        losses = train.loss(model, batch, noise, objective, args.grad_checkpoint)
        return losses.total, losses.decoder, losses.encoder

    value_and_grad = nn.value_and_grad(model, step_loss)
    layers_optimizer = optimizer.optimizers[-1] if isinstance(optimizer, optim.MultiOptimizer) else optimizer
    data_rng, noise_rng = np.random.default_rng(args.seed), np.random.default_rng(args.seed + 1)
    batches = iterate_batches(train_set, args.batch_size, cfg.canvas_length, cfg.pad_token_id, data_rng, loop=True)
    sums, steps, tokens, trained, elapsed = np.zeros(3), 0, 0, 0, 0.0
    model.train()
    for it in range(1, args.iters + 1):
        if valid_set and (it == 1 or it % args.steps_per_eval == 0 or it == args.iters):
            start = time.perf_counter()
            val = evaluate(model, valid_set, args.batch_size, args.val_batches, args.seed + 2, objective)
            log(f"Iter {it}: Val loss {val[0]:.3f} (decoder {val[1]:.3f}, encoder {val[2]:.3f}), "
                f"Val took {time.perf_counter() - start:.1f}s")
        start = time.perf_counter()
        batch = next(batches)
        noise = train.draw_noise(noise_rng, batch, cfg.canvas_length, cfg.vocab_size, objective)
        (total, decoder, encoder), grads = value_and_grad(batch, noise)
        if embedding_rows:
            grads = embedding_rows.mask_gradient(grads)
        optimizer.update(model, grads)
        if embedding_rows:
            embedding_rows.restore()
        mx.eval(model.trainable_parameters(), optimizer.state, total, decoder, encoder)
        elapsed += time.perf_counter() - start
        sums += [total.item(), decoder.item(), encoder.item()]
        steps += 1
        tokens += batch.size * (batch.ids.shape[1] + batch.canvases * cfg.canvas_length)
        if it % args.steps_per_report == 0 or it == args.iters:
            trained += tokens
            mean = sums / steps
            log(f"Iter {it}: Train loss {mean[0]:.3f} (decoder {mean[1]:.3f}, encoder {mean[2]:.3f}), "
                f"Learning Rate {layers_optimizer.learning_rate.item():.3e}, It/sec {steps / elapsed:.3f}, "
                f"Tokens/sec {tokens / elapsed:.1f}, Trained Tokens {trained}, "
                f"Peak mem {mx.get_peak_memory() / 1e9:.3f} GB")
            sums, steps, tokens, elapsed = np.zeros(3), 0, 0, 0.0
        if it % args.save_every == 0:
            save_adapters(model, adapter_path / ADAPTERS)
            save_adapters(model, adapter_path / f"{it:07d}_{ADAPTERS}")
            log(f"Iter {it}: Saved adapter weights to {adapter_path / ADAPTERS} and "
                f"{adapter_path / f'{it:07d}_{ADAPTERS}'}.")
    save_adapters(model, adapter_path / ADAPTERS)
    log(f"Saved final weights to {adapter_path / ADAPTERS}.")


def run(args, log=_print) -> None:
    from .generate import DEMO_MODEL
    from .loader import load

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
            raise FineTuneError(f"--trainable-tokens {args.trainable_tokens!r} encodes to no token; give the "
                                "text of the tokens whose embeddings to train")
        args.train_embeddings = True
    gen = getattr(model, "generation_config", None)
    objective = train.ObjectiveConfig(t_min=gen.t_min, t_max=gen.t_max) if gen else train.ObjectiveConfig()
    if args.train:
        if len(data["train"]) < args.batch_size:
            raise FineTuneError(f"train.jsonl has {len(data['train'])} samples, fewer than --batch-size "
                                f"{args.batch_size}")
        apply_fine_tune(model, args.fine_tune_type, args.num_layers, args.lora_parameters, args.train_embeddings)
        if args.resume_adapter_file:
            load_trainable(model, args.resume_adapter_file, "the run that wrote it")
        embedding_rows = EmbeddingRows(model, token_ids) if token_ids else None
        trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
        total = sum(v.size for _, v in tree_flatten(model.parameters()))
        log(f"Trainable parameters: {100 * trainable / total:.3f}% ({trainable / 1e6:.3f}M/{total / 1e6:.3f}M), "
            f"{args.fine_tune_type} on the last {args.num_layers} of {n_layers} layers"
            + (f", the embedding rows of {len(token_ids)} tokens" if token_ids else ""))
        run_training(model, args, data["train"], data["valid"], objective, log, embedding_rows)
    elif args.adapter_path:
        load_adapters(model, args.adapter_path)
    if args.test:
        model.eval()
        loss, decoder, encoder = evaluate(model, data["test"], args.batch_size, args.test_batches, args.seed + 3,
                                          objective)
        log(f"Test loss {loss:.3f} (decoder {decoder:.3f}, encoder {encoder:.3f}).")


def main(argv=None) -> None:
    try:
        run(resolve_args(argv))
    except ValueError as e:  # DataError, FineTuneError, CheckpointError: one line says what is wrong
        print(f"Error: {' '.join(str(e).split())}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
