"""Fine-tuning: the MLX objective against the reference's, adapters (train, save, load, fuse), bad data."""

import json
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten

from checkpoint_tools import train_demo
from mlx_dgemma.convert.output import save_model
from mlx_dgemma.errors import FineTuneError
from mlx_dgemma.fuse import fuse_adapters
from mlx_dgemma.generate import DEMO_MODEL
from mlx_dgemma.loader import load, load_model
from mlx_dgemma.lora import resolve_args
from mlx_dgemma.tuner import objective as train
from mlx_dgemma.tuner.adapters import EmbeddingRows, apply_fine_tune, load_adapters, save_adapters
from mlx_dgemma.tuner.datasets import DataError, load_dataset, load_split, make_example
from mlx_dgemma.tuner.trainer import make_optimizer
from tests.reference import load_reference, on_reference

ROOT = Path(__file__).resolve().parents[1]
LORA = {"rank": 4, "dropout": 0.0, "scale": 10.0}


def random_examples(rng, vocab, shapes):
    """(prompt length, answer length) → examples of random ids, <bos> first and <eos> last."""
    return [
        train.Example([2] + rng.integers(5, vocab, p).tolist(), rng.integers(5, vocab, a).tolist() + [1])
        for p, a in shapes
    ]


def reference_inputs(batch, noise):
    ref_batch = (
        on_reference(batch.ids, torch.long),
        on_reference(batch.pad, torch.long),
        batch.prefix_length,
        batch.canvases,
        on_reference(batch.scored),
    )
    ref_noise = {
        "t": on_reference(noise.t)[:, :, None],
        "replace": on_reference(noise.replace),
        "tokens": on_reference(noise.tokens, torch.long),
        "sc_mask": on_reference(noise.self_conditioning),
        "temp": on_reference(noise.temperature)[:, None, None],
    }
    return ref_batch, ref_noise


@pytest.mark.parametrize("preset", ["small", "mixed"])
@pytest.mark.parametrize("self_conditioning", [[True, False, True], [False, False, False]])
def test_loss_matches_reference(checkpoints, preset, self_conditioning):
    """Same batch (prompts of three lengths, left-padded past the sliding window; two canvases each)
    and the same noise draws: decoder and encoder losses agree with the reference's objective."""
    path = checkpoints(preset)
    model, reference = load_model(path), load_reference(path)
    cfg = model.config
    C = cfg.canvas_length
    rng = np.random.default_rng(3)
    batch = train.collate(random_examples(rng, cfg.vocab_size, [(9, C + 3), (14, 2 * C - 1), (6, C + 1)]), C, 0)
    assert batch.canvases == 2 and batch.prefix_length > cfg.sliding_window
    noise = train.draw_noise(rng, batch, C, cfg.vocab_size)
    noise.self_conditioning = mx.array(self_conditioning)
    ours = train.loss(model, batch, noise)
    with torch.no_grad():
        dec, enc, _ = train_demo.objective(reference, *reference_inputs(batch, noise), C, cfg.sliding_window)
    assert abs(ours.decoder.item() - dec.item()) <= 1e-4 * abs(dec.item())
    assert abs(ours.encoder.item() - enc.item()) <= 1e-4 * abs(enc.item())
    assert abs(ours.total.item() - (dec + enc).item()) <= 1e-4 * abs((dec + enc).item())


def test_gradients_match_the_reference_through_the_device_kernels(checkpoints, monkeypatch):
    """The CPU's inference kernels compute attention, soft-capping and the vocabulary softmax in numpy,
    which has no gradient; with them taken at every size, training's gradients of the attention
    projections are still the reference objective's (on a GPU: through MLX's kernels there)."""
    from mlx_dgemma.model import kernels

    monkeypatch.setattr(kernels, "NUMPY_ATTENTION_MIN_SCORES", 0)
    monkeypatch.setattr(kernels, "NUMPY_GELU_MIN_ELEMENTS", 0)
    path = checkpoints("small")
    model, reference = load_model(path), load_reference(path)
    assert model.kernels is kernels.for_device()
    cfg = model.config
    C = cfg.canvas_length
    rng = np.random.default_rng(4)
    batch = train.collate(random_examples(rng, cfg.vocab_size, [(40, C - 2), (33, C - 4)]), C, 0)
    assert batch.canvases == 1
    noise = train.draw_noise(rng, batch, C, cfg.vocab_size)
    noise.self_conditioning = mx.array([True, False])
    ours = dict(tree_flatten(nn.value_and_grad(model, lambda: train.loss(model, batch, noise).total)()[1]))
    reference.zero_grad(set_to_none=True)
    try:
        dec, enc, _ = train_demo.objective(reference, *reference_inputs(batch, noise), C, cfg.sliding_window)
        (dec + enc).backward()
        theirs = {name: p.grad.cpu().numpy() for name, p in reference.named_parameters() if p.grad is not None}
    finally:
        reference.zero_grad(set_to_none=True)
    bound = chained_roundings(cfg, batch.ids.shape[1] + C, batch.ids.size + batch.ids.shape[0] * C) * FLOAT32_EPS
    for i in range(cfg.num_hidden_layers):
        for proj in ("q_proj", "k_proj"):
            key = f"layers.{i}.self_attn.{proj}.weight"
            want = theirs[f"model.encoder.language_model.{key}"]  # the decoder's layers are the encoder's
            assert relative_error(np.array(ours[f"model.decoder.{key}"]), want) <= bound, key


FLOAT32_EPS = float(np.finfo(np.float32).eps)


def chained_roundings(cfg, keys: int, tokens: int) -> int:
    """The float32 error bound of a gradient, in units of eps relative to its largest value: the lengths
    of the sums chained from the inputs through the loss and back (two BLAS libraries, or a GPU, sum in
    other orders). Per layer and pass: the projections' inputs (hidden, heads x head dim), q.k, the
    softmax and p.v over the keys, the dense and expert feed-forwards; then the head over the
    vocabulary and the loss over the tokens; the backward pass chains as many again."""
    head_dim = max(cfg.head_dim, cfg.global_head_dim or 0)
    layer = (
        4 * cfg.hidden_size
        + head_dim
        + 2 * keys
        + cfg.num_attention_heads * head_dim
        + cfg.intermediate_size
        + cfg.moe_intermediate_size
    )
    forward = 2 * cfg.num_hidden_layers * layer + cfg.hidden_size + 2 * cfg.vocab_size + tokens  # encoder, decoder
    return 2 * forward


def test_grad_checkpoint_gives_the_same_gradients(checkpoints):
    model = load_model(checkpoints("small"))
    apply_fine_tune(model, "lora", 4, LORA)
    cfg = model.config
    rng = np.random.default_rng(1)
    batch = train.collate(random_examples(rng, cfg.vocab_size, [(7, 5), (11, 8)]), cfg.canvas_length, 0)
    noise = train.draw_noise(rng, batch, cfg.canvas_length, cfg.vocab_size)
    noise.self_conditioning = mx.array([True, False])
    for layer in model.layers:  # non-zero B, so that gradients reach A too
        for _, m in layer.named_modules():
            if hasattr(m, "lora_b"):
                m.lora_b = mx.random.normal(m.lora_b.shape) * 0.01
    grads = [
        dict(
            tree_flatten(
                nn.value_and_grad(model, lambda: train.loss(model, batch, noise, grad_checkpoint=c).total)()[1]
            )
        )
        for c in (False, True)
    ]
    for key, plain in grads[0].items():
        assert relative_error(np.array(grads[1][key]), np.array(plain)) <= 1e-4, key


def test_chat_data_has_the_demo_training_layout():
    """A chat-form sample becomes exactly the ids the demo model was trained on."""
    _, tokenizer = load(DEMO_MODEL)
    tok = train_demo.Tok(str(DEMO_MODEL / "tokenizer.model"))
    prompt, answer = "reverse: planet", "tenalp"
    example = make_example(
        {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}, tokenizer, "x:1"
    )
    assert example.prefix == [train_demo.BOS] + tok.encode(train_demo.render_prompt(prompt))
    assert example.answer == tok.encode(answer) + [tok.turn_end]


def adam_steps(model, steps=3, seed=0, lr=1e-2):
    cfg = model.config
    rng = np.random.default_rng(seed)
    batch = train.collate(random_examples(rng, cfg.vocab_size, [(7, 5), (11, 8)]), cfg.canvas_length, 0)
    optimizer = optim.Adam(learning_rate=lr)
    value_and_grad = nn.value_and_grad(model, lambda b, n: train.loss(model, b, n).total)
    losses = []
    for _ in range(steps):
        noise = train.draw_noise(rng, batch, cfg.canvas_length, cfg.vocab_size)
        loss, grads = value_and_grad(batch, noise)
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state)
        losses.append(loss.item())
    return losses


def snapshot(model):
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


def test_lora_trains_only_the_adapters(checkpoints):
    model = load_model(checkpoints("small"))
    apply_fine_tune(model, "lora", 2, LORA)
    before = snapshot(model)
    trainable = dict(tree_flatten(model.trainable_parameters()))
    assert trainable and all(k.rsplit(".", 1)[-1] in ("lora_a", "lora_b") for k in trainable)
    assert all(k.startswith(("model.decoder.layers.2.", "model.decoder.layers.3.")) for k in trainable)
    adam_steps(model)
    after = snapshot(model)
    for key, value in before.items():
        if key in trainable:
            assert not np.array_equal(value, after[key]), f"{key} did not train"
        else:
            assert np.array_equal(value, after[key]), f"frozen {key} changed"


def test_train_embeddings_adds_the_embeddings_only(checkpoints):
    model = load_model(checkpoints("small"))
    apply_fine_tune(model, "lora", 1, LORA, train_embeddings=True)
    before = snapshot(model)
    adam_steps(model)
    after = snapshot(model)
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert "model.decoder.embed_tokens.weight" in changed
    assert changed - {"model.decoder.embed_tokens.weight"} == {k for k in changed if ".lora_" in k}
    assert all(k.startswith("model.decoder.layers.3.") for k in changed if ".lora_" in k)


def test_trainable_tokens_leave_the_other_rows_as_they_were(checkpoints):
    """Embedding training restricted to three rows, under AdamW (whose weight decay moves every
    parameter it is given): those rows train, every other row is bit for bit what it was."""
    model = load_model(checkpoints("small"))
    apply_fine_tune(model, "lora", 1, LORA, train_embeddings=True)
    rows = EmbeddingRows(model, [7, 40, 41])
    before = np.array(model.model.decoder.embed_tokens.weight)
    rng = np.random.default_rng(0)
    batch = train.collate(
        random_examples(rng, model.config.vocab_size, [(7, 5), (11, 8)]), model.config.canvas_length, 0
    )
    optimizer = optim.AdamW(learning_rate=1e-2, weight_decay=0.1)
    value_and_grad = nn.value_and_grad(model, lambda b, n: train.loss(model, b, n).total)
    for _ in range(3):
        _, grads = value_and_grad(
            batch, train.draw_noise(rng, batch, model.config.canvas_length, model.config.vocab_size)
        )
        optimizer.update(model, rows.mask_gradient(grads))
        rows.restore()
        mx.eval(model.parameters(), optimizer.state)
    after = np.array(model.model.decoder.embed_tokens.weight)
    changed = np.flatnonzero((before != after).any(axis=1))
    assert changed.tolist() == [7, 40, 41]
    with pytest.raises(FineTuneError, match="trainable tokens must be 1 or more ids"):
        EmbeddingRows(model, [model.config.vocab_size])


def test_embedding_learning_rate_follows_the_schedule_scaled(checkpoints):
    """--embedding-learning-rate 1e-2 over a schedule starting at 1e-3: Adam's first step moves the
    embeddings 10 times as far as the adapters (its first step is the learning rate times a constant)."""
    model = load_model(checkpoints("small"))
    apply_fine_tune(model, "lora", 1, LORA, train_embeddings=True)
    args = resolve_args(["--train-embeddings", "--embedding-learning-rate", "1e-2"])
    args.lr_schedule = {"name": "cosine_decay", "arguments": [1e-3, 10]}
    optimizer = make_optimizer(args)
    before = snapshot(model)
    rng = np.random.default_rng(0)
    batch = train.collate(random_examples(rng, model.config.vocab_size, [(7, 5)]), model.config.canvas_length, 0)
    _, grads = nn.value_and_grad(model, lambda b, n: train.loss(model, b, n).total)(
        batch, train.draw_noise(rng, batch, model.config.canvas_length, model.config.vocab_size)
    )
    optimizer.update(model, grads)
    after = snapshot(model)
    step = {k: np.abs(after[k] - before[k]).max() for k in before}
    embeddings = step.pop("model.decoder.embed_tokens.weight")
    adapters = max(v for k, v in step.items() if k.endswith("lora_b"))
    np.testing.assert_allclose(embeddings / adapters, 10, rtol=1e-3)


def test_the_upper_recipe_is_a_valid_config():
    args = resolve_args(["-c", str(ROOT / "examples" / "upper.yaml")])
    assert args.train and args.trainable_tokens == "ABCDEFGHIJKLMNOPQRSTUVWXYZ" and args.iters == 800


def test_full_fine_tune_trains_the_last_layers_only(checkpoints):
    model = load_model(checkpoints("small"))
    apply_fine_tune(model, "full", 1, LORA)
    before = snapshot(model)
    adam_steps(model)
    after = snapshot(model)
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed and all(k.startswith("model.decoder.layers.3.") for k in changed)
    assert "model.decoder.layers.3.self_attn.q_proj.weight" in changed


def quantized_demo():
    model, _ = load(DEMO_MODEL)
    nn.quantize(
        model,
        group_size=32,
        bits=4,  # the vision tower stays as it is, as the converter keeps it
        class_predicate=lambda path, m: isinstance(m, nn.Linear) and "vision" not in path,
    )
    return model


def test_qlora_on_a_quantized_model():
    """LoRA on the demo model quantized to 4 bits: the quantized weights stay as they are."""
    with pytest.raises(FineTuneError, match="unquantized"):
        apply_fine_tune(quantized_demo(), "full", 1, LORA)
    model = quantized_demo()
    apply_fine_tune(model, "lora", 2, LORA)
    assert isinstance(model.layers[-1].self_attn.q_proj.linear, nn.QuantizedLinear)
    before = snapshot(model)
    trainable = dict(tree_flatten(model.trainable_parameters()))
    losses = adam_steps(model, steps=4, lr=3e-3)
    after = snapshot(model)
    assert np.isfinite(losses).all()
    assert all(np.array_equal(before[k], after[k]) for k in before if k not in trainable)
    assert all(not np.array_equal(before[k], after[k]) for k in trainable)


def canvas_logits(model, seed=5):
    cfg = model.config
    rng = np.random.default_rng(seed)
    cache = model.make_cache()
    model.encode(mx.array(rng.integers(0, cfg.vocab_size, (1, 9)), dtype=mx.int32), cache)
    return np.array(model.denoise(mx.array(rng.integers(0, cfg.vocab_size, (1, cfg.canvas_length))), cache))


def write_adapters(model, folder: Path, num_layers: int, train_embeddings=False):
    folder.mkdir(parents=True, exist_ok=True)
    save_adapters(model, folder / "adapters.safetensors")
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {
                "fine_tune_type": "lora",
                "num_layers": num_layers,
                "lora_parameters": LORA,
                "train_embeddings": train_embeddings,
            }
        )
    )


def relative_error(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


def test_adapters_save_load_and_fuse_give_the_same_logits(checkpoints, tmp_path):
    from mlx_dgemma.convert import convert

    path = checkpoints("small")
    trained = load_model(path)
    base_logits = canvas_logits(trained)
    apply_fine_tune(trained, "lora", 3, LORA, train_embeddings=True)
    adam_steps(trained)
    trained.eval()
    expected = canvas_logits(trained)
    assert relative_error(expected, base_logits) > 1e-3  # the adapters change the model
    write_adapters(trained, tmp_path / "adapters", 3, train_embeddings=True)

    loaded, _ = load(path, adapter_path=tmp_path / "adapters")
    np.testing.assert_array_equal(canvas_logits(loaded), expected)

    save_model(fuse_adapters(loaded), path, tmp_path / "fused")
    fused, _ = load(tmp_path / "fused")
    assert not any(hasattr(m, "lora_a") for _, m in fused.named_modules())
    assert relative_error(canvas_logits(fused), expected) <= 1e-4
    converted = convert(str(tmp_path / "fused"), str(tmp_path / "converted"), progress=False)
    assert relative_error(canvas_logits(load(converted)[0]), expected) <= 1e-4


def test_qlora_fuse_dequantized_gives_the_same_logits(tmp_path):
    from mlx_dgemma.convert import convert

    base = convert(str(DEMO_MODEL), str(tmp_path / "q4"), quantize=True, q_bits=4, q_group_size=32, progress=False)
    model, _ = load(base)
    apply_fine_tune(model, "lora", 2, LORA)
    adam_steps(model, lr=3e-3)
    model.eval()
    expected = canvas_logits(model)
    write_adapters(model, tmp_path / "adapters", 2)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_dgemma.fuse",
            "--model",
            str(base),
            "--adapter-path",
            str(tmp_path / "adapters"),
            "--save-path",
            str(tmp_path / "fused"),
            "--dequantize",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    fused, _ = load(tmp_path / "fused")
    assert "quantization" not in json.loads((tmp_path / "fused" / "config.json").read_text())
    assert relative_error(canvas_logits(fused), expected) <= 1e-4


def test_adapters_that_do_not_fit_are_refused(checkpoints, tmp_path):
    trained = load_model(checkpoints("small"))
    apply_fine_tune(trained, "lora", 2, LORA)
    write_adapters(trained, tmp_path / "a", 2)
    with pytest.raises(FineTuneError, match="has shape"):
        load_adapters(load_model(checkpoints("mixed")), tmp_path / "a")
    with pytest.raises(FineTuneError, match="no adapter_config.json"):
        load_adapters(load_model(checkpoints("small")), tmp_path / "missing")


# ------------------------------------------------------------------------------------------------
# data


@pytest.fixture(scope="module")
def tokenizer():
    return load(DEMO_MODEL)[1]


def write(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def chat(prompt, answer):
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


def test_data_forms(tokenizer, tmp_path):
    path = write(
        tmp_path / "train.jsonl",
        [chat("upper: ab", "AB"), {"prompt": "upper: ab", "completion": "AB"}, {"text": "hello"}],
    )
    as_chat, as_completion, as_text = load_split(path, tokenizer, 32, 1024)
    assert as_chat == as_completion
    assert as_text.prefix == [tokenizer.bos_token_id] and as_text.answer[-1] == tokenizer.stop_ids[0]
    masked = load_split(write(tmp_path / "m.jsonl", [chat("upper: ab", "AB")]), tokenizer, 32, 1024, mask_prompt=True)
    batch = train.collate(masked, 32, 0)
    scored = np.array(batch.scored[0])
    assert scored.sum() == len(masked[0].answer) and scored[len(masked[0].prefix) - 1]


@pytest.mark.parametrize(
    "lines, message",
    [
        ([chat("a", "b"), "{not json"], r"train\.jsonl:2: not valid JSON"),
        (
            [chat("a", "b"), {"question": "a"}],
            r"train\.jsonl:2: expected 'messages', 'prompt' and 'completion', or 'text'",
        ),
        (
            [{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}],
            r"train\.jsonl:1: the last message must be the assistant's answer",
        ),
        ([], r"train\.jsonl has no samples"),
        (
            [chat("a", "b"), chat("a", "x" * 100)],
            r"train\.jsonl:2: the sample takes \d+ positions .* more than the "
            r"context of 96",
        ),
    ],
)
def test_bad_data_names_file_and_line(tokenizer, tmp_path, lines, message):
    path = write(tmp_path / "train.jsonl", lines)
    with pytest.raises(DataError, match=message):
        load_split(path, tokenizer, 32, 96)


def test_missing_split_and_text_with_mask_prompt(tokenizer, tmp_path):
    write(tmp_path / "train.jsonl", [{"text": "abc"}])
    with pytest.raises(DataError, match=r"valid\.jsonl is missing"):
        load_dataset(tmp_path, tokenizer, 32, 1024)
    with pytest.raises(DataError, match=r"train\.jsonl:1: --mask-prompt needs chat or completions data"):
        load_dataset(tmp_path, tokenizer, 32, 1024, splits=("train",), mask_prompt=True)


def lora_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "mlx_dgemma.lora", *map(str, args)], capture_output=True, text=True, cwd=ROOT
    )


def test_cli_trains_saves_tests_and_generates(tmp_path):
    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, "-m", "mlx_dgemma.demo.tasks", str(data), "--mix", "upper=12,json=4", "--held-out", "2"],
        check=True,
        cwd=ROOT,
    )
    adapters = tmp_path / "adapters"
    (tmp_path / "config.yaml").write_text(
        "lora_parameters: {rank: 4, dropout: 0.0, scale: 10.0}\n"
        "lr_schedule: {name: cosine_decay, arguments: [1.0e-3, 4], warmup: 1}\n"
    )
    result = lora_cli(
        "--train",
        "--data",
        data,
        "--iters",
        4,
        "--batch-size",
        4,
        "--num-layers",
        2,
        "-c",
        tmp_path / "config.yaml",
        "--steps-per-report",
        2,
        "--steps-per-eval",
        4,
        "--save-every",
        2,
        "--adapter-path",
        adapters,
        "--grad-checkpoint",
        "--test",
    )
    assert result.returncode == 0, result.stderr
    assert "Iter 2: Train loss" in result.stdout and "Tokens/sec" in result.stdout
    assert "Iter 4: Val loss" in result.stdout and "Test loss" in result.stdout
    assert {p.name for p in adapters.iterdir()} == {
        "adapters.safetensors",
        "adapter_config.json",
        "0000002_adapters.safetensors",
        "0000004_adapters.safetensors",
    }
    config = json.loads((adapters / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora" and config["num_layers"] == 2 and config["lora_parameters"]["rank"] == 4

    def resume(*args):
        return lora_cli(
            "--train",
            "--data",
            data,
            "--iters",
            1,
            "--batch-size",
            4,
            "--adapter-path",
            tmp_path / "resumed",
            "--resume-adapter-file",
            adapters / "0000002_adapters.safetensors",
            *args,
        )

    resumed = resume("--num-layers", 2, "-c", tmp_path / "config.yaml")
    assert resumed.returncode == 0, resumed.stderr
    assert "has shape (4, 256), here (8, 256)" in resume("--num-layers", 2).stderr  # mlx-lm's rank 8
    assert "is not a trainable parameter" in resume("--fine-tune-type", "full").stderr

    generated = subprocess.run(
        [sys.executable, "-m", "mlx_dgemma.generate", "--prompt", "upper: abc", "--adapter-path", adapters],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert generated.returncode == 0, generated.stderr


def test_a_validation_loss_that_does_not_move_gets_one_hint(tmp_path):
    from mlx_dgemma import lora

    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, "-m", "mlx_dgemma.demo.tasks", str(data), "--mix", "upper=8", "--held-out", "2"],
        check=True,
        cwd=ROOT,
    )

    def logged(learning_rate) -> list[str]:
        lines = []
        lora.fine_tune(
            resolve_args(
                [
                    "--train",
                    "--data",
                    str(data),
                    "--iters",
                    "4",
                    "--batch-size",
                    "2",
                    "--num-layers",
                    "1",
                    "--steps-per-eval",
                    "1",
                    "--learning-rate",
                    str(learning_rate),
                    "--adapter-path",
                    str(tmp_path / f"a{learning_rate}"),
                ]
            ),
            log=lines.append,
        )
        return lines

    stalled = [line for line in logged(1e-12) if "Hint" in line]  # evaluated at iterations 1 to 4, never moving
    assert len(stalled) == 1, stalled
    assert re.fullmatch(
        r"Hint: the validation loss has not moved since iteration 1 \((\d+\.\d+), now \1\); .*"
        r"try a higher --learning-rate.*\(docs/fine-tuning.md\)",
        stalled[0],
    ), stalled
    assert not [line for line in logged(1e-3) if "Hint" in line]


def test_cli_trainable_tokens_train_only_their_rows(tmp_path):
    """--trainable-tokens ABC on the demo model: the saved embeddings differ from the demo's in the
    rows of A, B and C only; the adapters load for generation; text with no token is refused."""
    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, "-m", "mlx_dgemma.demo.tasks", str(data), "--mix", "upper=8", "--held-out", "1"],
        check=True,
        cwd=ROOT,
    )
    adapters = tmp_path / "adapters"
    result = lora_cli(
        "--train",
        "--data",
        data,
        "--iters",
        2,
        "--batch-size",
        4,
        "--num-layers",
        1,
        "--learning-rate",
        1e-2,
        "--optimizer",
        "adamw",
        "--trainable-tokens",
        "ABC",
        "--adapter-path",
        adapters,
    )
    assert result.returncode == 0, result.stderr
    assert "the embedding rows of 3 tokens" in result.stdout
    model, tokenizer = load(DEMO_MODEL)
    base = np.array(model.model.decoder.embed_tokens.weight)
    trained = np.array(mx.load(str(adapters / "adapters.safetensors"))["model.decoder.embed_tokens.weight"])
    changed = np.flatnonzero((base != trained).any(axis=1))
    assert changed.tolist() == sorted(tokenizer.encode("ABC", add_special_tokens=False))
    generated = subprocess.run(
        [sys.executable, "-m", "mlx_dgemma.generate", "--prompt", "upper: abc", "--adapter-path", adapters],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert generated.returncode == 0, generated.stderr
    refused = lora_cli(
        "--train",
        "--data",
        data,
        "--iters",
        1,
        "--batch-size",
        4,
        "--trainable-tokens",
        "",
        "--adapter-path",
        tmp_path / "none",
    )
    assert refused.returncode == 1
    assert refused.stderr.strip().split("\n") == [
        "Error: --trainable-tokens '' encodes to no token; give the text of the tokens whose embeddings to train"
    ]
    assert not (tmp_path / "none").exists()


def test_cli_bad_data_is_one_line(tmp_path):
    write(tmp_path / "train.jsonl", [chat("a", "b"), "[1, 2"])
    write(tmp_path / "valid.jsonl", [chat("a", "b")])
    result = lora_cli("--train", "--data", tmp_path, "--iters", 1, "--adapter-path", tmp_path / "adapters")
    assert result.returncode == 1
    assert result.stderr.strip().split("\n") == [
        f"Error: {tmp_path / 'train.jsonl'}:2: not valid JSON (Expecting ',' delimiter at column 6)"
    ]
    assert not (tmp_path / "adapters").exists()
