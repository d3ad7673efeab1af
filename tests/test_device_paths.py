"""The Metal/CUDA kernels must give what the CPU kernels (per-expert BLAS products, numpy
transcendentals) give: on a CPU both run there; with DGEMMA_TEST_DEVICE=gpu the accelerator kernels run
on the GPU and the CPU kernels on MLX's CPU stream."""

import contextlib

import mlx.core as mx
import numpy as np
import pytest

from checkpoint_tools.random_checkpoint import PRESETS
from mlx_dgemma import load, stream_generate
from mlx_dgemma.model import kernels


def forward(model, prompt, canvas, sc=None):
    cache = model.make_cache()
    model.encode(mx.array(prompt), cache)
    return np.array(model.denoise(mx.array(canvas), cache, sc))


@contextlib.contextmanager
def on_the_cpu(model):
    """The CPU kernels on MLX's CPU stream, whatever the default device."""
    with mx.stream(mx.cpu), model.kernels_in_use(kernels.CPU):
        yield


@contextlib.contextmanager
def on_the_accelerator(model):
    """The accelerator kernels on the default device (the CPU's, where there is no GPU)."""
    with model.kernels_in_use(kernels.MLX):
        yield


@pytest.mark.parametrize("preset", ["pattern", "mixed"])
def test_accelerator_paths_match_cpu_paths(checkpoints, preset):
    model, _ = load(checkpoints(preset))
    assert model.kernels is kernels.for_device()
    sizes = PRESETS[preset]
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, sizes["vocab_size"], (1, 11))
    canvas = rng.integers(0, sizes["vocab_size"], (1, sizes["canvas_length"]))
    with on_the_cpu(model):
        cpu = forward(model, prompt, canvas)
        cpu_sc = forward(model, prompt, canvas, mx.array(cpu / 0.7))
    with on_the_accelerator(model):
        accelerator = forward(model, prompt, canvas)
        accelerator_sc = forward(model, prompt, canvas, mx.array(cpu / 0.7))
    for a, b in ((cpu, accelerator), (cpu_sc, accelerator_sc)):
        assert np.abs(a - b).max() / np.abs(b).max() < 1e-5


def test_generation_is_the_same_on_both_paths(checkpoints):
    model, tokenizer = load(checkpoints("small", tame=True))
    prompt = [2, 10, 11, 12, 13, 14, 15]
    with on_the_cpu(model):
        cpu = [r.tokens for r in stream_generate(model, tokenizer, prompt, 24, seed=5)]
    with on_the_accelerator(model):
        accelerator = [r.tokens for r in stream_generate(model, tokenizer, prompt, 24, seed=5)]
    assert cpu == accelerator


@pytest.fixture
def numpy_always(monkeypatch):
    """The CPU kernels' numpy paths at every size (they leave small inputs to MLX)."""
    monkeypatch.setattr(kernels, "NUMPY_ATTENTION_MIN_SCORES", 0)
    monkeypatch.setattr(kernels, "NUMPY_GELU_MIN_ELEMENTS", 0)


@pytest.mark.parametrize("keys", [7, 600, 1300])
def test_cpu_attention_matches_mlx(keys, numpy_always):
    """The CPU kernel's numpy softmax, few keys and many; masked, grouped heads, two rows."""
    q = mx.random.normal((2, 6, 9, 32), key=mx.random.key(0))
    k = mx.random.normal((2, 2, keys, 32), key=mx.random.key(1))
    v = mx.random.normal((2, 2, keys, 48), key=mx.random.key(2))
    mask = mx.random.uniform(shape=(2, 1, 9, keys), key=mx.random.key(3)) < 0.7
    mask = mask | (mx.arange(keys)[None, None, None] == 0)  # every query sees a key
    for m in (mask, None):
        want = np.array(kernels.MLX.attention(q, k, v, m))
        got = np.array(kernels.CPU.attention(q, k, v, m))
        assert got.shape == want.shape == (2, 6, 9, 48)
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


@pytest.mark.parametrize("queries", [9, 1])
def test_cpu_attention_split_over_the_cores_takes_one_mask_row_for_every_query(queries, numpy_always, monkeypatch):
    """A canvas view's mask is one row of keys for all the canvas's queries, [B, 1, 1, K]: split among
    the cores by query, each part still sees it (it gave an empty mask past the first part and a
    broadcast error once several long prompts were batched)."""
    monkeypatch.setattr(kernels, "PARALLEL_MIN_ELEMENTS", 0)
    monkeypatch.setattr(kernels, "free_cores", lambda: 3)  # split, however busy the machine is
    q = mx.random.normal((3, 4, queries, 16), key=mx.random.key(0))
    k = mx.random.normal((3, 1, 700, 16), key=mx.random.key(1))
    v = mx.random.normal((3, 1, 700, 16), key=mx.random.key(2))
    mask = (mx.random.uniform(shape=(3, 1, 1, 700), key=mx.random.key(3)) < 0.7) | (mx.arange(700) == 0)
    want = np.array(kernels.MLX.attention(q, k, v, mask))
    got = np.array(kernels.CPU.attention(q, k, v, mask))
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


def test_cpu_kernels_give_mlx_gradients(numpy_always):
    """Training runs through the CPU kernels: their gradients are MLX's own, to float32 rounding.
    Two BLAS kernels may sum in other orders, so the bound is the one for float32 sums: n·eps of the
    largest magnitude, n the reductions chained from inputs to gradient (the forward's q·k over the
    head dim, softmax and p·v over the keys; the backward's sums over values, keys and queries)."""
    q = mx.random.normal((2, 4, 5, 16), key=mx.random.key(0))
    k = mx.random.normal((2, 2, 9, 16), key=mx.random.key(1))
    v = mx.random.normal((2, 2, 9, 8), key=mx.random.key(2))
    mask = (mx.random.uniform(shape=(2, 1, 5, 9), key=mx.random.key(3)) < 0.7) | (mx.arange(9) == 0)
    x = mx.random.normal((3, 40), key=mx.random.key(4))
    heads, queries, dim, keys, value_dim = q.shape[1], q.shape[2], q.shape[3], k.shape[2], v.shape[3]
    chained = dim + 2 * keys + (value_dim + 2 * keys + heads * queries) + dim
    for m in (mask, None):

        def loss(q, k, v, kern):
            return (kern.attention(q, k, v, m) ** 2).sum()

        want = mx.grad(loss, argnums=(0, 1, 2))(q, k, v, kernels.MLX)
        got = mx.grad(loss, argnums=(0, 1, 2))(q, k, v, kernels.CPU)
        for a, b in zip(got, want):
            assert float(mx.abs(a).max()) > 0
            assert_float32_close(a, b, chained)
    # gelu is elementwise: a few ulps from its transcendentals, cubed by the loss.
    want = mx.grad(lambda x: (kernels.MLX.gelu(x) ** 3).sum())(x)
    got = mx.grad(lambda x: (kernels.CPU.gelu(x) ** 3).sum())(x)
    assert_float32_close(got, want, 16)
    assert_float32_close(kernels.CPU.gelu(x), kernels.MLX.gelu(x), 4)


def assert_float32_close(got, want, terms):
    """|got - want| within the float32 error bound of `terms` chained roundings, relative to want's largest value."""
    got, want = np.array(got), np.array(want)
    bound = terms * np.finfo(np.float32).eps * np.abs(want).max()
    assert np.abs(got - want).max() <= bound, (np.abs(got - want).max(), bound)


def c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, size = [], itemsize
    for n in reversed(shape):
        strides.append(size)
        size *= n
    return tuple(reversed(strides))


@pytest.fixture
def expert_operands(monkeypatch):
    """Every left operand the experts hand gather_mm / gather_qmm in a forward, evaluated, with the strides
    MLX gives it (the buffer protocol shows a view's strides, as a GPU kernel reads them)."""
    seen = []

    def recording(product):
        def wrapper(x, *args, **kwargs):
            seen.append(x)
            return product(x, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(mx, "gather_mm", recording(mx.gather_mm))
    monkeypatch.setattr(mx, "gather_qmm", recording(mx.gather_qmm))
    return seen


def assert_arrays_of_their_own(operands):
    """CUDA's sorted gather_mm (and Metal's before mlx 0.32.1) takes a row-contiguous operand's
    second-to-last stride for its rows' leading dimension: an operand must hold the strides of its own
    shape (an axis inserted into another array has stride 1 there)."""
    assert operands
    for x in operands:
        mx.eval(x)
        view = memoryview(x)
        assert view.strides == c_strides(x.shape, x.itemsize), (x.shape, view.strides)


@pytest.mark.parametrize("quantized", [False, True])
def test_expert_products_get_operands_of_their_own(checkpoints, expert_operands, quantized):
    """The accelerator kernels' expert products, on a prefill, a denoising step and an AR token."""
    import mlx.nn as nn

    model, _ = load(checkpoints("mixed"))
    if quantized:
        nn.quantize(
            model,
            group_size=32,
            bits=4,
            class_predicate=lambda p, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0,
        )
    model.use_kernels(kernels.MLX)
    sizes = PRESETS["mixed"]
    rng = np.random.default_rng(0)
    cache = model.make_cache()
    model.encode(mx.array(rng.integers(3, sizes["vocab_size"], (1, 9))), cache)
    mx.eval(model.denoise(mx.array(rng.integers(0, sizes["vocab_size"], (1, sizes["canvas_length"]))), cache))
    mx.eval(model.next_token_logits(mx.array([[5]]), cache))
    assert_arrays_of_their_own(expert_operands)
