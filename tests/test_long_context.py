"""Long prompts on a checkpoint with the released attention layout (checkpoint_tools.synthetic_checkpoint
.LONG_CONTEXT: a 1,024-token window, a full layer every sixth with 512-wide heads): reference, ar and
verified answer with the KV cache at 8 and 4 bits, verified gives ar's tokens, and the peak memory
of a generation stays within the memory check's plan. A profile moved to a longer prefix, and auto's
choice by the prefix at hand. The 32K-token run is benchmarks/long_context.py, run here at a tiny size."""

import gc
import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from checkpoint_tools.synthetic_checkpoint import write_long_context
from mlx_dgemma import generate, load
from mlx_dgemma.engine.policy import RELEASED, AutoPlanner, cached_profile, predict
from mlx_dgemma.loader import weight_files
from mlx_dgemma.memory import memory_need
from mlx_dgemma.model.config import GenerationConfig
from mlx_dgemma.safetensors_io import read_header

MAX_TOKENS = 64  # one canvas
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def long_context(tmp_path_factory):
    folder = write_long_context(tmp_path_factory.mktemp("long-context"))
    model, tokenizer = load(folder)
    cached_profile(model)  # verified's draft plan measures it once: not inside a generation's peak
    return folder, model, tokenizer


def planned(folder, model, context: int, kv_bits) -> int:
    tensors = {k: v for f in weight_files(folder) for k, v in read_header(f).items()}
    return memory_need(model.config, tensors, context, kv_bits=kv_bits).total


def answers(model, tokenizer, ids, kv_bits, step):
    out = {}
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    for policy in ("reference", "ar", "verified"):
        gc.collect()
        mx.clear_cache()
        others = mx.get_active_memory() - weights  # what other tests in this process still hold
        mx.reset_peak_memory()
        out[policy] = generate(
            model,
            tokenizer,
            ids,
            max_tokens=MAX_TOKENS,
            seed=0,
            policy=policy,
            kv_bits=kv_bits,
            quantized_kv_start=0,
            prefill_step_size=step,
        )
        out[policy + " peak"] = mx.get_peak_memory() - max(others, 0)
    return out


def check(folder, model, tokenizer, length: int, bits_list, step: int):
    ids = np.random.default_rng(length).integers(3, 300, length).tolist()
    for bits in bits_list:
        got = answers(model, tokenizer, ids, bits, step)
        assert got["reference"] and got["ar"]
        assert got["verified"] == got["ar"], bits  # verified drafting keeps ar's tokens through its trims
        plan = planned(folder, model, length + MAX_TOKENS, bits)
        for policy in ("reference", "ar", "verified"):
            assert got[policy + " peak"] <= plan, (bits, policy, got[policy + " peak"], plan)


def test_a_prompt_past_the_window_answers_with_a_4bit_cache(long_context):
    """1,300 tokens in chunks of 512: the sliding layers drop positions, the full layer keeps all."""
    check(*long_context, 1300, [4], 512)


@pytest.mark.slow
def test_an_8k_prompt_answers_with_an_8_and_a_4bit_cache(long_context):
    check(*long_context, 8192, [8, 4], 2048)


@pytest.mark.parametrize("device", ["M5 Max", "H100", "RTX 4090"])
def test_a_profile_at_a_longer_prefix_is_the_roofline_there(device):
    """A step of the longest canvas and an AR token grow linearly with the prefix (the full layers'
    attention FLOPs and K/V bytes), so the slopes a profile keeps give the roofline's own times."""
    base = predict(device, prefix=4096)
    for prefix in (32768, 131072, 262144):
        moved, there = base.at_prefix(prefix), predict(device, prefix=prefix)
        assert moved.step_s(256) == pytest.approx(there.step_s(256), rel=1e-9)
        assert moved.ar_token_s == pytest.approx(there.ar_token_s, rel=1e-9)
    assert base.at_prefix(1024) is base  # never faster than where it was measured


@pytest.mark.parametrize("device,short,long", [("M5 Max", "fast", "verified"), ("RTX 4090", "ar", "verified")])
def test_auto_picks_by_the_prefix_at_hand(device, short, long):
    """The prompt's tokens and those produced so far are the prefix the profile is moved to."""
    gen = GenerationConfig.from_dict({"max_denoising_steps": 64}, RELEASED)  # a prior of 16 steps per canvas
    choices = {}
    for prompt, produced in ((4096, 0), (131072, 0), (4096, 131072 - 4096)):
        planner = AutoPlanner(gen, 256, predict(device))
        choices[prompt, produced] = planner.choose(256, produced=produced, prompt=[0] * prompt).predicted[0]
    assert list(choices.values()) == [short, long, long]


def test_the_benchmark_runs_at_a_tiny_size(tmp_path):
    out = tmp_path / "figures.json"
    run = subprocess.run(
        [
            sys.executable,
            "benchmarks/long_context.py",
            "--prefixes",
            "256",
            "512",
            "--prefill-limit",
            "256",
            "--float-prefill-limit",
            "0",
            "--kv",
            "none",
            "4",
            "--keys",
            "256",
            "--released",
            "4096",
            "--repeats",
            "1",
            "--answer-tokens",
            "8",
            "--work-dir",
            str(tmp_path),
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    figures = json.loads(out.read_text())
    rows = {(r["prefix"], r["kv_bits"]): r for r in figures["prefixes"]}
    assert sorted(rows) == [(256, 4), (256, 32), (512, 4), (512, 32)]
    assert rows[256, 4]["prefill_s"] > 0 and rows[256, 32]["prefill_s"] is None  # filled past its limit
    assert rows[512, 4]["kv_mb"] < 0.5 * rows[512, 32]["kv_mb"]
    assert all(
        r["step_ms"] > 0 and r["ar_ms"] > 0 and r["auto"] in ("reference", "fast", "ar", "verified")
        for r in rows.values()
    )
    assert [r["policy"] for r in figures["answers"][:3]] == ["reference", "ar", "verified"]
    assert figures["answers"][3]["verified_is_ar"] is True
    assert [r["kv_bits"] for r in figures["attention"]] == [32, 8, 4]
    assert len(figures["released"]) == 6


def test_attention_in_blocks_of_queries_gives_the_same_logits(monkeypatch):
    """Past ``ATTENTION_SCORES_ELEMENTS`` scores a pass's queries go in blocks (a prefill chunk's causal
    mask cut with them): the encoder's and the denoiser's logits are those of one block, to the float
    summation order of products of other row counts."""
    from mlx_dgemma.generate import DEMO_MODEL
    from mlx_dgemma.model import diffusion_gemma as model_module

    model, tokenizer = load(DEMO_MODEL)
    ids = mx.array([tokenizer.encode("sort: 42 17 85 23 61 " * 8)])
    canvas = mx.random.randint(0, model.config.vocab_size, (1, model.config.canvas_length), key=mx.random.key(4))

    def logits():
        cache = model.make_cache()
        hidden = model.encode(ids, cache, return_hidden=True)
        return model.head(hidden), model.denoise(canvas, cache)

    whole = logits()
    monkeypatch.setattr(model_module, "ATTENTION_SCORES_ELEMENTS", 4 * ids.shape[1])  # blocks of a few queries
    for got, want in zip(logits(), whole):
        assert mx.abs(got - want).max().item() <= 1e-5 * mx.abs(want).max().item()
