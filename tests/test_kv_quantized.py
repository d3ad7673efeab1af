"""A KV cache stored at 8 and 4 bits (cache.py): every stored element within a step of its group's
quantization of the unquantized one, logits within the bound that step gives, the demo's
answers unchanged at 8 bits, batched rows equal to rows alone, exact trims, the start threshold, the
bytes held, and the errors of bad options."""

import socket
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

from mlx_dgemma import batch_generate, generate
from mlx_dgemma.errors import OptionError
from mlx_dgemma.generate import main as generate_main, prefill
from mlx_dgemma.model.cache import KVCache, LayerCache
from mlx_dgemma.options import KVQuantization
from mlx_dgemma.server.__main__ import main as server_main

DEMO_PROMPTS = ["sort: 42 17 85 23 61", "reverse: planet", "add: 417 85", "json: name=ada age=36 city=rome"]
DEMO_GROUP = 32  # the demo's head dims are 32 and 64


def kv(bits: int, group_size: int = DEMO_GROUP, start: int = 0) -> KVQuantization:
    return KVQuantization(bits, group_size, start)


@pytest.mark.parametrize("bits", [8, 4])
def test_stored_elements_are_within_a_step(bits):
    """Affine quantization rounds each element to the nearest of its group's n = 2^bits − 1 levels:
    half a step, were the levels spread over the group's range. MLX snaps the zero point to the
    group's larger end e (bias e, step e / q0 with q0 = round(e / (range / n)), |q0| ≥ n // 2), which
    can leave the other end up to n / (2 |q0|) steps past the last level: at most n / (2 (n // 2))
    steps (255/254 at 8 bits, 15/14 at 4). Through appends, row filters, extends and padding."""
    rng = np.random.default_rng(bits)
    q = kv(bits, 64)
    chunks = [mx.array(rng.standard_normal((2, 2, n, 128)).astype(np.float32) * 3) for n in (5, 300)]
    cache = LayerCache([0, 3], quantization=q)
    for c in chunks:
        fetched, _ = cache.update_and_fetch(c, -c)
    want = mx.concatenate(chunks, axis=2)
    packed, scales, biases = cache.stored(cache.keys)
    assert packed.dtype == mx.uint32 and packed.shape[-1] == 128 * bits // 32
    n = 2**bits - 1
    bound = mx.abs(mx.repeat(scales, 64, axis=-1)) * n / (2 * (n // 2)) * (1 + 1e-6)  # (scales are signed)
    assert (mx.abs(fetched - want) <= bound).all().item()
    assert mx.abs(fetched - want).max().item() > 0  # it does quantize
    other = LayerCache([0], quantization=q)
    other.update_and_fetch(want[:1, :, :100], want[:1, :, :100])
    cache.extend(other)  # the shorter row is left-padded
    cache.filter(mx.array([2, 0]))
    _, got = cache.update_and_fetch(want[:2, :, :1], want[:2, :, :1])
    assert (mx.abs(got[1, :, :305] + want[0]) <= bound[0]).all().item()
    padded = cache.offset[0].item()
    assert padded == 101 and cache.left_padding[0].item() == 306 - 101


@pytest.mark.parametrize("bits", [8, 4])
def test_logits_are_within_the_quantization_bound(demo, bits):
    """Against the float32 cache. A stored element moves by at most 15/14 of its group's step (the
    test above), and a step is at most 15/14 of the group's range 2 max|x| over 2^bits − 1 levels:
    by less than 2.5 max|x| / (2^bits − 1). Every layer reads its K/V after an RMS norm and adds to
    a residual stream that the next layer norms again, so to first order the layers' relative errors
    add: the logits move by less than 2.5 · layers / (2^bits − 1) of their largest magnitude (at 4
    bits that is 1.0: only the comparison with 8 bits, whose step is 17x smaller, has teeth)."""
    model, tokenizer = demo
    ids = mx.array([tokenizer.encode("sort: 42 17 85 23 61 5 9 77 31 12 " * 6)])
    canvas = mx.random.randint(0, model.config.vocab_size, (1, model.config.canvas_length), key=mx.random.key(1))
    step = mx.array([[7]])

    def logits(q):
        cache = model.make_cache(None, q)
        model.encode(ids, cache)
        return model.denoise(canvas, cache), model.next_token_logits(step, cache)

    base = logits(None)
    bound = 2.5 * len(model.layers) / (2**bits - 1)
    errors = []
    for got, want in zip(logits(kv(bits)), base):
        error = mx.abs(got - want).max().item() / mx.abs(want).max().item()
        assert 0 < error <= bound
        errors.append(error)
    if bits == 4:
        eight = logits(kv(8))
        assert all(mx.abs(g - w).max().item() / mx.abs(w).max().item() < e for g, w, e in zip(eight, base, errors))


@pytest.mark.parametrize("policy", ["reference", "ar", "verified"])
def test_demo_answers_are_unchanged_with_an_8bit_cache(demo, policy):
    model, tokenizer = demo
    for seed, prompt in enumerate(DEMO_PROMPTS):
        want = generate(model, tokenizer, prompt, seed=seed, policy=policy)
        got = generate(
            model,
            tokenizer,
            prompt,
            seed=seed,
            policy=policy,
            kv_bits=8,
            kv_group_size=DEMO_GROUP,
            quantized_kv_start=0,
        )
        assert got == want, (policy, prompt)


@pytest.mark.parametrize("policy", ["reference", "ar", "fast", "verified"])
def test_batched_rows_equal_rows_alone_with_a_4bit_cache(demo, policy):
    """Rows of other lengths, one padded prefill, their caches split, stacked and extended by the engine."""
    model, tokenizer = demo
    options = dict(policy=policy, kv_bits=4, kv_group_size=DEMO_GROUP, quantized_kv_start=0)
    seeds = [7, 8, 9, 10]
    alone = [generate(model, tokenizer, p, seed=s, **options) for p, s in zip(DEMO_PROMPTS, seeds)]
    assert batch_generate(model, tokenizer, DEMO_PROMPTS, seeds=seeds, **options).texts == alone


def test_a_trimmed_quantized_cache_equals_one_that_never_held_the_draft(demo):
    """Verified drafting encodes a draft and trims what the encoder rejects: the positions left are
    the very ones stored before (the kept tokens are encoded alone in both, so their K/V are the
    same numbers, quantized alike)."""
    model, tokenizer = demo
    prompt = mx.array(tokenizer.encode("reverse: a b c d e f g h " * 30))
    draft, other = mx.arange(3, 3 + model.config.canvas_length)[None], mx.array([[9, 10, 11]])
    trimmed, fresh = model.make_cache(None, kv(4)), model.make_cache(None, kv(4))
    prefill(model, prompt, trimmed)
    prefill(model, prompt, fresh)
    for cache in (trimmed, fresh):
        model.encode(draft[:, :2], cache)
    model.encode(draft[:, 2:], trimmed)
    trimmed.trim(draft.shape[1] - 2)
    assert mx.array_equal(model.next_token_logits(other, trimmed), model.next_token_logits(other, fresh))
    canvas = mx.arange(model.config.canvas_length)[None]
    assert mx.array_equal(model.denoise(canvas, trimmed), model.denoise(canvas, fresh))


def test_the_cache_is_quantized_once_it_passes_the_start(demo):
    model, tokenizer = demo
    ids = tokenizer.encode("sort: 42 17 85 23 61 " * 10)
    plain, cache = model.make_cache(), model.make_cache(None, kv(8, start=len(ids)))
    for c in (plain, cache):
        model.encode(mx.array([ids]), c)
    assert not any(layer.quantized for layer in cache.layers) and cache.nbytes == plain.nbytes
    for c in (plain, cache):
        model.encode(mx.array([[5]]), c)
    assert all(layer.quantized for layer in cache.layers)
    assert cache.nbytes < 0.35 * plain.nbytes  # float32 to 8 bits and a float32 scale and bias per 32


@pytest.mark.parametrize("bits", [8, 4])
def test_bytes_held_at_the_released_head_dims(bits):
    """At the released shapes (sliding layers: 8 KV heads of 256, a 1,024 window; full layers: 2 of
    512) a bfloat16 cache holds 2 bytes an element; a quantized one bits/8 and a bfloat16 scale and
    bias per group of 64: at 4 bits 0.28x the bfloat16 cache's bytes."""
    windows = [1024] * 5 + [None]
    shapes = [(8, 256)] * 5 + [(2, 512)]
    caches = [KVCache(windows, [0], slack=256, quantization=q) for q in (None, kv(bits, 64))]
    for cache in caches:
        for layer, (heads, dim) in zip(cache.layers, shapes):
            x = mx.zeros((1, heads, 4096, dim), mx.bfloat16)
            layer.update_and_fetch(x, x)
    ratio = (bits / 8 + 2 * 2 / 64) / 2
    assert caches[1].nbytes == pytest.approx(ratio * caches[0].nbytes, rel=1e-9)
    if bits == 4:
        assert caches[1].nbytes <= 0.3 * caches[0].nbytes


def test_bad_kv_options_name_the_option(demo):
    model, tokenizer = demo
    with pytest.raises(OptionError, match="kv_bits must be one of 4, 8, not 3") as e:
        generate(model, tokenizer, "sort: 3 1 2", kv_bits=3)
    assert e.value.option == "kv_bits"
    with pytest.raises(OptionError, match="kv_group_size 64 does not divide this model's head dim 32; take 32") as e:
        generate(model, tokenizer, "sort: 3 1 2", kv_bits=4)
    assert e.value.option == "kv_group_size"
    with pytest.raises(OptionError, match="quantized_kv_start must be a whole number") as e:
        generate(model, tokenizer, "sort: 3 1 2", kv_bits=4, kv_group_size=32, quantized_kv_start=-1)
    assert e.value.option == "quantized_kv_start"


def test_the_command_line_takes_the_kv_flags(demo):
    model, tokenizer = demo
    prompt = DEMO_PROMPTS[0]
    flags = ["--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "0", "--seed", "0", "--policy", "ar"]
    result = CliRunner().invoke(generate_main, ["--prompt", prompt, *flags])
    assert result.exit_code == 0, result.output
    assert (
        result.stdout.strip()
        == generate(
            model, tokenizer, prompt, seed=0, policy="ar", kv_bits=4, kv_group_size=DEMO_GROUP, quantized_kv_start=0
        ).strip()
    )
    bad = CliRunner().invoke(generate_main, ["--prompt", prompt, "--kv-bits", "3"])
    assert bad.exit_code == 2 and "Invalid value for '--kv-bits': '3' is not one of '4', '8'" in bad.stderr
    bad = CliRunner().invoke(generate_main, ["--prompt", prompt, "--kv-bits", "4"])
    lines = bad.stderr.strip().split("\n")
    assert bad.exit_code == 1 and len(lines) == 1
    assert lines[0] == "Error: kv_group_size 64 does not divide this model's head dim 32; take 32"


def test_a_server_started_with_kv_bits_answers_as_the_api_does(demo):
    """The real command (uvicorn, the openai client) started with a 4-bit KV cache answers as the API
    does with the same KV options, on prompts where those answers are not the unquantized ones; a
    group size the model cannot take stops it at start, in one line."""
    import openai

    model, tokenizer = demo
    prompts = ["add: 417 85", "sort: 9 3 77 12"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlx_dgemma.server",
            "--port",
            str(port),
            "--kv-bits",
            "4",
            "--kv-group-size",
            "32",
            "--quantized-kv-start",
            "0",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        deadline = time.monotonic() + 60
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline and server.poll() is None, "the server did not start"
                time.sleep(0.2)
        for prompt in prompts:
            got = client.chat.completions.create(
                model="mlx-dgemma-demo",
                messages=[{"role": "user", "content": prompt}],
                seed=0,
                extra_body={"policy": "ar"},
            )
            want = generate(
                model, tokenizer, prompt, seed=0, policy="ar", kv_bits=4, kv_group_size=DEMO_GROUP, quantized_kv_start=0
            )
            assert want != generate(model, tokenizer, prompt, seed=0, policy="ar")
            assert got.choices[0].message.content == want, prompt
    finally:
        server.terminate()
        server.wait(timeout=30)
    result = CliRunner().invoke(server_main, ["--kv-bits", "4"])
    lines = result.stderr.strip().split("\n")
    assert result.exit_code == 1 and lines == [
        "Error: kv_group_size 64 does not divide this model's head dim 32; take 32"
    ]


def test_a_stack_of_quantized_and_plain_prefixes_denoises_each_row_as_alone(demo):
    """A row whose cache passed its start beside one whose cache did not (their own caches, as the
    engine keeps them): the stacked view reads the quantized prefix dequantized, as the row alone does."""
    from mlx_dgemma.model.cache import CanvasView

    model, tokenizer = demo
    C = model.config.canvas_length
    prompts = [tokenizer.encode("sort: 42 17 85 23 61 " * 12), tokenizer.encode("reverse: planet")]
    caches = [model.make_cache(None, kv(4, start=100)) for _ in prompts]
    for ids, cache in zip(prompts, caches):
        model.encode(mx.array([ids]), cache)
    assert [cache.layers[-1].quantized for cache in caches] == [True, False]
    canvas = mx.random.randint(0, model.config.vocab_size, (2, C), key=mx.random.key(3))
    together = model.denoise(canvas, CanvasView.stack([cache.canvas_view(C) for cache in caches]))
    for i, cache in enumerate(caches):
        alone = model.denoise(canvas[i : i + 1], cache.canvas_view(C))
        # (OpenBLAS sums rows stacked in one product in another order: test_batch.py's DENOISE_BOUND)
        assert mx.abs(together[i] - alone[0]).max().item() <= 2e-5 * mx.abs(alone).max().item()
