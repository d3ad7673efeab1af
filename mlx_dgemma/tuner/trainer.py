"""The training loop of a fine-tuning run (``python -m mlx_dgemma.lora``, lora.py, reads its options):
Adam(W) steps on DiffusionGemma's objective (objective.py) over batches of the datasets (datasets.py),
validation and progress as mlx-lm's trainer reports them, adapters saved every ``save_every`` steps
and at the end (adapters.py), each file whole or not at all.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from ..errors import FineTuneError
from . import objective as train
from .adapters import ADAPTER_CONFIG, ADAPTERS, EmbeddingRows, mlx_lm_tuner, save_adapters, write_atomically
from .datasets import iterate_batches

EMBEDDINGS = "model.decoder.embed_tokens.weight"
STALLED = 0.01  # a validation loss that moves less than this fraction between two evaluations has stalled


def evaluate_loss(
    model, examples, batch_size: int, num_batches: int, seed: int, objective: train.ObjectiveConfig
) -> tuple[float, float, float]:
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


def stalled_hint(previous: tuple[int, float], loss: float) -> str | None:
    """A line for a validation loss that has not moved since the evaluation at ``previous``
    (iteration, loss), or None."""
    since, before = previous
    if abs(before - loss) > STALLED * abs(before):
        return None
    return (
        f"Hint: the validation loss has not moved since iteration {since} ({before:.3f}, now {loss:.3f}); "
        "if the model should still be learning, try a higher --learning-rate (docs/fine-tuning.md)"
    )


def report(message: str) -> None:
    print(message, flush=True)  # progress reaches a log file as it happens


def make_optimizer(args) -> optim.Optimizer:
    """Adam(W) at ``learning_rate`` or under ``lr_schedule``; with ``embedding_learning_rate``, the
    embeddings get their own Adam(W) under the same schedule scaled to that peak."""
    kind = optim.AdamW if args.optimizer == "adamw" else optim.Adam
    schedule = mlx_lm_tuner().build_schedule(args.lr_schedule) if args.lr_schedule else None
    layers = kind(learning_rate=schedule or args.learning_rate)
    if args.embedding_learning_rate is None or not args.train_embeddings:
        return layers
    if schedule:
        ratio = args.embedding_learning_rate / args.lr_schedule["arguments"][0]
        embeddings = kind(learning_rate=lambda step: ratio * schedule(step))
    else:
        embeddings = kind(learning_rate=args.embedding_learning_rate)
    return optim.MultiOptimizer([embeddings, layers], [lambda path, _: path == EMBEDDINGS])


def _all_finite(tree) -> mx.array:
    return mx.all(mx.stack([mx.isfinite(v).all() for _, v in tree_flatten(tree)]))


def save_run(model, args, adapter_path: Path, names: list[str]) -> None:
    """The trained parameters under each of ``names`` and the run's options, each file written whole
    or not at all; parameters that are not finite are never saved."""
    if not _all_finite(model.trainable_parameters()).item():
        raise FineTuneError(
            f"the trained parameters are not finite; nothing saved to {adapter_path} (lower --learning-rate)"
        )
    for name in names:
        save_adapters(model, adapter_path / name)
    options = {k: v for k, v in vars(args).items() if k != "config"}
    write_atomically(adapter_path / ADAPTER_CONFIG, lambda path: path.write_text(json.dumps(options, indent=4)))


def run_training(
    model,
    args,
    train_set,
    valid_set,
    objective: train.ObjectiveConfig,
    log=report,
    embedding_rows: EmbeddingRows | None = None,
) -> None:
    """Train for ``args.iters`` steps; a step whose loss or gradient is not finite stops the run before
    its update, with nothing saved from it."""
    cfg = model.config
    adapter_path = Path(args.adapter_path)
    optimizer = make_optimizer(args)

    def step_loss(batch, noise):
        losses = train.loss(model, batch, noise, objective, args.grad_checkpoint)
        return losses.total, losses.decoder, losses.encoder

    value_and_grad = nn.value_and_grad(model, step_loss)
    layers_optimizer = optimizer.optimizers[-1] if isinstance(optimizer, optim.MultiOptimizer) else optimizer
    data_rng, noise_rng = np.random.default_rng(args.seed), np.random.default_rng(args.seed + 1)
    batches = iterate_batches(train_set, args.batch_size, cfg.canvas_length, cfg.pad_token_id, data_rng, loop=True)
    sums, steps, tokens, trained, elapsed = np.zeros(3), 0, 0, 0, 0.0
    evaluated, hinted = None, False  # the last evaluation (iteration, loss); whether the hint was given
    model.train()
    for it in range(1, args.iters + 1):
        if valid_set and (it == 1 or it % args.steps_per_eval == 0 or it == args.iters):
            start = time.perf_counter()
            val = evaluate_loss(model, valid_set, args.batch_size, args.val_batches, args.seed + 2, objective)
            log(
                f"Iter {it}: Val loss {val[0]:.3f} (decoder {val[1]:.3f}, encoder {val[2]:.3f}), "
                f"Val took {time.perf_counter() - start:.1f}s"
            )
            if evaluated and not hinted and (hint := stalled_hint(evaluated, val[0])):
                log(hint)
                hinted = True
            evaluated = (it, val[0])
        start = time.perf_counter()
        batch = next(batches)
        noise = train.draw_noise(noise_rng, batch, cfg.canvas_length, cfg.vocab_size, objective)
        (total, decoder, encoder), grads = value_and_grad(batch, noise)
        if embedding_rows:
            grads = embedding_rows.mask_gradient(grads)
        finite = _all_finite(grads)
        mx.eval(total, finite)
        if not (math.isfinite(total.item()) and finite.item()):
            what = f"the loss is {total.item()}" if not math.isfinite(total.item()) else "a gradient is not finite"
            raise FineTuneError(
                f"iteration {it}: {what}; training stopped and nothing more was saved (lower --learning-rate)"
            )
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
            log(
                f"Iter {it}: Train loss {mean[0]:.3f} (decoder {mean[1]:.3f}, encoder {mean[2]:.3f}), "
                f"Learning Rate {layers_optimizer.learning_rate.item():.3e}, It/sec {steps / elapsed:.3f}, "
                f"Tokens/sec {tokens / elapsed:.1f}, Trained Tokens {trained}, "
                f"Peak mem {mx.get_peak_memory() / 1e9:.3f} GB"
            )
            sums, steps, tokens, elapsed = np.zeros(3), 0, 0, 0.0
        if it % args.save_every == 0:
            adapter_path.mkdir(parents=True, exist_ok=True)
            save_run(model, args, adapter_path, [ADAPTERS, f"{it:07d}_{ADAPTERS}"])
            log(
                f"Iter {it}: Saved adapter weights to {adapter_path / ADAPTERS} and "
                f"{adapter_path / f'{it:07d}_{ADAPTERS}'}."
            )
    adapter_path.mkdir(parents=True, exist_ok=True)
    save_run(model, args, adapter_path, [ADAPTERS])
    log(f"Saved final weights to {adapter_path / ADAPTERS}.")
