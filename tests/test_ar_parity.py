"""Autoregressive mode: next-token logits = reference encoder hidden states → final norm → tied head → soft-cap."""

import mlx.core as mx
import numpy as np
import pytest
import torch

from checkpoint_tools.random_checkpoint import PRESETS
from mlx_dgemma import load

from .reference import load_reference
from .test_model_parity import FP32_BOUND, rel_err


@torch.no_grad()
def reference_next_token_logits(ref, ids: np.ndarray) -> np.ndarray:
    out = ref.model.encoder(input_ids=torch.as_tensor(ids, dtype=torch.long, device=ref.device))
    hidden = out.last_hidden_state  # already through the shared final norm
    logits = ref.lm_head(hidden).float()
    cap = ref.config.text_config.final_logit_softcapping
    return (cap * torch.tanh(logits / cap)).cpu().numpy()


@pytest.mark.parametrize("preset", ["small", "mixed"])
def test_next_token_logits_match_reference(checkpoints, preset):
    path = checkpoints(preset)
    ref = load_reference(path)
    model, _ = load(path)
    vocab = PRESETS[preset]["vocab_size"]
    ids = np.random.default_rng(4).integers(3, vocab, size=(1, 2 * PRESETS[preset]["sliding_window"] + 5))
    expected = reference_next_token_logits(ref, ids)  # [1, T, V]: every prefix's next token

    # Whole prompt at once, then token by token through the cache (the AR decode path).
    cache = model.make_cache()
    split = ids.shape[1] - 4
    got = [model.next_token_logits(mx.array(ids[:, :split]), cache)]
    for t in range(split, ids.shape[1]):
        got.append(model.next_token_logits(mx.array(ids[:, t : t + 1]), cache))
    for i, logits in enumerate(got):
        position = split - 1 + i
        err = rel_err(logits, expected[:, position])
        assert err <= FP32_BOUND, f"position {position}: {err:.2e}"
