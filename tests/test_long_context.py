"""Long prompts on a checkpoint with the released attention layout (checkpoint_tools.synthetic_checkpoint
.LONG_CONTEXT: a 1,024-token window, a full layer every sixth with 512-wide heads): reference, ar and
verified answer with the KV cache at 8 and 4 bits, verified gives ar's tokens, and the peak memory
of a generation stays within the memory check's plan. The 32K-token run is benchmarks/long_context.py."""

import mlx.core as mx
import numpy as np
import pytest

from checkpoint_tools.synthetic_checkpoint import write_long_context
from mlx_dgemma import generate, load
from mlx_dgemma.loader import weight_files
from mlx_dgemma.memory import memory_need
from mlx_dgemma.safetensors_io import read_header

MAX_TOKENS = 64  # one canvas


@pytest.fixture(scope="module")
def long_context(tmp_path_factory):
    folder = write_long_context(tmp_path_factory.mktemp("long-context"))
    return folder, *load(folder)


def planned(folder, model, context: int, kv_bits) -> int:
    tensors = {k: v for f in weight_files(folder) for k, v in read_header(f).items()}
    return memory_need(model.config, tensors, context, kv_bits=kv_bits).total


def answers(model, tokenizer, ids, kv_bits, step):
    out = {}
    for policy in ("reference", "ar", "verified"):
        mx.reset_peak_memory()
        out[policy] = generate(model, tokenizer, ids, MAX_TOKENS, seed=0, policy=policy, kv_bits=kv_bits,
                               quantized_kv_start=0, prefill_step_size=step)
        out[policy + " peak"] = mx.get_peak_memory()
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
