"""The roofline: what a denoising step and an autoregressive token cost on a device not at hand,
predicted from its spec sheet for the released model.

A denoising step runs the whole canvas (C tokens) through every layer plus two vocabulary-wide
products (head and self-conditioning), so at C = 256 it is compute-bound; an autoregressive token is
one position, bandwidth-bound. Whether diffusion wins depends on the device's FLOP/s per byte/s and
on how many steps a canvas takes: the crossover is ``256 · t_token / t_step(256)`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...model.config import FULL, ModelConfig
from .acceptance import Acceptance, best_draft
from .profile import CANVAS_LENGTHS, DRAFT_LENGTHS, SLOPE_KEYS, Profile


@dataclass(frozen=True)
class Device:
    name: str
    tflops: float  # dense fp16/bf16 matmul peak, TFLOP/s
    bandwidth: float  # memory bandwidth, GB/s
    vendor: str  # "apple" | "nvidia"
    memory_gb: float = 0.0


# Public spec-sheet figures (GPU FP16 for Apple, dense tensor-core BF16/FP16 for NVIDIA). Apple GPUs
# run FP16 at the FP32 rate before M5; M5's per-core neural accelerators raise matmul throughput
# (Apple quotes "over 4x" peak GPU AI compute over M4); M5 Pro/Max figures are scaled from M5.
KNOWN_DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device("M1", 2.6, 68, "apple"),
        Device("M1 Pro", 5.2, 200, "apple"),
        Device("M1 Max", 10.4, 400, "apple"),
        Device("M1 Ultra", 20.8, 800, "apple"),
        Device("M2", 3.6, 100, "apple"),
        Device("M2 Pro", 6.8, 200, "apple"),
        Device("M2 Max", 13.6, 400, "apple"),
        Device("M2 Ultra", 27.2, 800, "apple"),
        Device("M3", 4.1, 100, "apple"),
        Device("M3 Pro", 7.4, 150, "apple"),
        Device("M3 Max", 16.4, 400, "apple"),
        Device("M3 Ultra", 32.8, 819, "apple"),
        Device("M4", 4.3, 120, "apple"),
        Device("M4 Pro", 9.2, 273, "apple"),
        Device("M4 Max", 18.4, 546, "apple"),
        Device("M5", 17.0, 153, "apple"),
        Device("M5 Pro", 34.0, 307, "apple"),
        Device("M5 Max", 68.0, 614, "apple"),
        Device("RTX 4090", 165.0, 1008, "nvidia", 24),
        Device("RTX 5090", 209.0, 1792, "nvidia", 32),
        Device("H100", 989.0, 3350, "nvidia", 80),
        Device("H200", 989.0, 4800, "nvidia", 141),
    )
}


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak that a real engine reaches, and a fixed cost per layer per forward."""

    compute: float
    bandwidth: float
    per_layer_s: float


# Calibrated so that the model reproduces both public data points with one compute efficiency:
# M1 Ultra, 4-bit: 71 tok/s autoregressive and ~15 tok/s diffusion (≈16 steps per 256-canvas);
# H100, bf16: diffusion "up to 4x" the autoregressive model.
EFFICIENCY = {
    "apple": Efficiency(compute=0.12, bandwidth=0.25, per_layer_s=100e-6),
    "nvidia": Efficiency(compute=0.12, bandwidth=0.7, per_layer_s=20e-6),
}

# The released google/diffusiongemma-26B-A4B-it (its config.json's text_config).
RELEASED = ModelConfig(
    vocab_size=262144,
    hidden_size=2816,
    intermediate_size=2112,
    moe_intermediate_size=704,
    num_hidden_layers=30,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=256,
    global_head_dim=512,
    num_global_key_value_heads=2,
    num_experts=128,
    top_k_experts=8,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5,
    sliding_window=1024,
)


@dataclass(frozen=True)
class Cost:
    flops: float
    bytes: float


def forward_cost(
    cfg: ModelConfig, tokens: int, prefix: int, bits: float, denoise: bool, logits: int | None = None
) -> Cost:
    """FLOPs and bytes moved by one forward over ``tokens`` positions after ``prefix`` cached ones.

    The cost model, the same for a 256-position step, a 2-token draft and an AR token:

    - weights are read once per forward (``bits`` per weight on average: 16 for bf16, ≈4.5 for the
      4-bit mixed recipe): every layer's attention, dense MLP and router, the tied embedding/head
      (H·V), and each expert at least one position routes to. With E experts and top-k routing, L
      positions touch E·(1 − (1 − k/E)^L) of them on average (8 of 128: 6% for one token, 40% at
      L = 8, 87% at 32, all at 256): a short draft on a mixture of experts reads most of the model,
      which is why it costs several AR tokens on a bandwidth-bound device;
    - FLOPs: 2 per weight per position for the dense parts and the top-k experts; attention over the
      keys each position sees (denoising: the prefix and the whole canvas; the encoder: the prefix and
      the causal half of the new tokens); the head over ``logits`` positions (default: every position
      when denoising, the last one otherwise; a verifying pass takes all); denoising adds the
      self-conditioning soft embedding (V·H per position) and MLP;
    - bytes: the weights, the K/V cache read (bf16), and fp32 logits passes ([logits, V]: ~4 when
      denoising — soft-cap, tempered softmax, entropy, self-conditioning softmax — 2 otherwise);
    - seconds (``predicted_seconds``): max(FLOPs / (peak · compute efficiency), bytes / (bandwidth ·
      bandwidth efficiency)) plus a fixed cost per layer per forward (launches and synchronisation),
      which dominates short passes on a small model.
    """
    H, V = cfg.hidden_size, cfg.vocab_size
    logits = (tokens if denoise else 1) if logits is None else logits
    weight_bytes = bits / 8
    macs = 0.0
    params = 0.0
    kv_bytes = 0.0
    for layer in range(cfg.num_hidden_layers):
        d, kv = cfg.layer_head_dim(layer), cfg.layer_kv_heads(layer)
        n_proj = 2 if cfg.layer_types[layer] == FULL else 3  # full layers have no v_proj
        attn = H * cfg.num_attention_heads * d * 2 + H * kv * d * (n_proj - 1)
        dense = 3 * H * cfg.intermediate_size + H * cfg.num_experts
        expert = 3 * H * cfg.moe_intermediate_size
        touched = cfg.num_experts * (1 - (1 - cfg.top_k_experts / cfg.num_experts) ** tokens)
        seen = prefix if cfg.layer_types[layer] == FULL else min(prefix, cfg.sliding_window - 1)
        keys = seen + (tokens if denoise else (tokens + 1) / 2)
        macs += tokens * (attn + dense + cfg.top_k_experts * expert)
        macs += tokens * 2 * cfg.num_attention_heads * d * keys
        params += attn + dense + touched * expert
        kv_bytes += 2 * seen * kv * d * 2
    macs += logits * H * V + (tokens * H * V + 3 * tokens * H * cfg.intermediate_size if denoise else 0)
    params += H * V
    logits_bytes = 4 * (4 if denoise else 2) * logits * V if logits > 1 else 0
    return Cost(flops=2 * macs, bytes=params * weight_bytes + kv_bytes + logits_bytes)


def predicted_seconds(device: Device, cost: Cost, layers: int) -> float:
    eff = EFFICIENCY[device.vendor]
    compute = cost.flops / (device.tflops * 1e12 * eff.compute)
    memory = cost.bytes / (device.bandwidth * 1e9 * eff.bandwidth)
    return max(compute, memory) + layers * eff.per_layer_s


def default_bits(device: Device, cfg: ModelConfig = RELEASED) -> float:
    """What people run: 4-bit mixed (≈4.5 bits/weight) on a Mac, bf16 on an NVIDIA GPU it fits on."""
    if device.vendor == "apple":
        return 4.5
    bf16_gb = parameter_count(cfg) * 2 / 1e9
    return 16 if bf16_gb < 0.9 * device.memory_gb else 4.5


def parameter_count(cfg: ModelConfig) -> float:
    H = cfg.hidden_size
    total = cfg.vocab_size * H + 3 * H * cfg.intermediate_size
    for layer in range(cfg.num_hidden_layers):
        d, kv = cfg.layer_head_dim(layer), cfg.layer_kv_heads(layer)
        n_proj = 2 if cfg.layer_types[layer] == FULL else 3
        total += H * cfg.num_attention_heads * d * 2 + H * kv * d * (n_proj - 1)
        total += 3 * H * cfg.intermediate_size + H * cfg.num_experts
        total += cfg.num_experts * 3 * H * cfg.moe_intermediate_size
    return total


def predict(device: Device | str, cfg: ModelConfig = RELEASED, bits: float | None = None, prefix: int = 512) -> Profile:
    """A profile for a device not at hand (see ``default_bits`` for the precision assumed)."""
    device = KNOWN_DEVICES[device] if isinstance(device, str) else device
    if bits is None:
        bits = default_bits(device, cfg)
    layers = cfg.num_hidden_layers
    lengths = sorted(set(CANVAS_LENGTHS) | set(DRAFT_LENGTHS))
    steps = {c: predicted_seconds(device, forward_cost(cfg, c, prefix, bits, denoise=True), layers) for c in lengths}
    verify = {
        n: predicted_seconds(device, forward_cost(cfg, n, prefix, bits, denoise=False, logits=n), layers)
        for n in DRAFT_LENGTHS
    }
    ar = predicted_seconds(device, forward_cost(cfg, 1, prefix, bits, denoise=False), layers)
    prefill = predicted_seconds(device, forward_cost(cfg, prefix, 0, bits, denoise=False), layers)
    # growth past the prefix: between two prefixes past the sliding window, SLOPE_KEYS apart
    near = max(prefix, cfg.sliding_window)
    step_slope, ar_slope = (
        (
            predicted_seconds(device, forward_cost(cfg, n, near + SLOPE_KEYS, bits, denoise=n > 1), layers)
            - predicted_seconds(device, forward_cost(cfg, n, near, bits, denoise=n > 1), layers)
        )
        / SLOPE_KEYS
        for n in (max(lengths), 1)
    )
    return Profile(
        device.name, "predicted", steps, ar, prefix / prefill, f"{bits:g}-bit", verify, prefix, step_slope, ar_slope
    )


def predicted_table(steps: float = 16, cfg: ModelConfig = RELEASED) -> dict[str, dict[str, float]]:
    """Per known device: AR and diffusion (``steps`` per 256-canvas) tok/s, and verified drafting at
    its best draft length and steps for the demo's acceptance (``PRIOR_ALPHA``: a draft of 32 keeps
    ~6.7 tokens per round with one step, ~9.7 with two) and at half those tokens per round."""
    table = {}
    for name in KNOWN_DEVICES:
        p = predict(name, cfg)
        diffusion = p.diffusion_tok_s(steps)
        row = {"ar_tok_s": p.ar_tok_s, "diffusion_tok_s": diffusion, "speedup": diffusion / p.ar_tok_s}
        for key, acceptance in (("verified", Acceptance()), ("verified_half", Acceptance.scaled(0.5))):
            length, draft_steps, tok_s = best_draft(p, acceptance, cfg.canvas_length if cfg.canvas_length else 256)
            row.update({f"{key}_tok_s": tok_s, f"{key}_length": length, f"{key}_steps": draft_steps})
        table[name] = row
    return table
