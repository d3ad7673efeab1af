"""Hardware-aware step policy: what a denoising step and an autoregressive token cost on a device
(measured here, or predicted by a roofline model for known devices) and the generation plan that
follows from it.

A denoising step runs the whole canvas (C tokens) through every layer plus two vocabulary-wide
products (head and self-conditioning), so at C = 256 it is compute-bound; an autoregressive token is
one position, bandwidth-bound. Whether diffusion wins depends on the device's FLOP/s per byte/s and
on how many steps a canvas takes: the crossover is ``256 · t_token / t_step(256)`` steps.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import mlx.core as mx

from .config import FULL, GenerationConfig, ModelConfig
from .sampler import SamplerSettings

CANVAS_LENGTHS = (16, 32, 64, 128, 256)
DRAFT_LENGTHS = (2, 4, 8, 16, 32, 64, 128, 256)  # verified drafting's candidates (up to the canvas length)
DRAFT_STEPS = (1, 2)
# Bumped whenever the engine's speed changes enough to make cached device profiles stale.
PROFILE_VERSION = 3
POLICIES = ("reference", "auto", "fast", "ar", "verified")


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
    vocab_size=262144, hidden_size=2816, intermediate_size=2112, moe_intermediate_size=704,
    num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
    global_head_dim=512, num_global_key_value_heads=2, num_experts=128, top_k_experts=8,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5, sliding_window=1024,
)


@dataclass(frozen=True)
class Cost:
    flops: float
    bytes: float


def forward_cost(cfg: ModelConfig, tokens: int, prefix: int, bits: float, denoise: bool,
                 logits: int | None = None) -> Cost:
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


@dataclass
class Profile:
    """Seconds per denoising step by canvas length, per autoregressive token, and prefill speed."""

    device: str
    source: str  # "measured" | "predicted"
    step_s_by_canvas: dict[int, float]
    ar_token_s: float
    prefill_tok_s: float
    dtype: str = ""
    # One encoder forward over L tokens with next-token logits at each (verified drafting's check).
    verify_s_by_length: dict[int, float] = field(default_factory=dict)

    def step_s(self, canvas: int) -> float:
        """Step time at any canvas length, interpolated linearly between measured lengths."""
        return _interpolate(self.step_s_by_canvas, canvas)

    def verify_s(self, length: int) -> float:
        """An encoder pass over ``length`` tokens with their next-token logits; where it was not
        measured, a denoising step of that length (the same layers, one vocabulary pass fewer)."""
        if length == 1:
            return self.ar_token_s
        return _interpolate(self.verify_s_by_length, length) if self.verify_s_by_length else self.step_s(length)

    def verified_tok_s(self, length: int, steps: int, tokens_per_round: float) -> float:
        """Tokens/s of verified drafting: a round is ``steps`` denoising steps and one verify pass."""
        return tokens_per_round / (steps * self.step_s(length) + self.verify_s(length))

    @property
    def ar_tok_s(self) -> float:
        return 1.0 / self.ar_token_s

    def diffusion_tok_s(self, steps: float, canvas: int = 256) -> float:
        return canvas / (steps * self.step_s(canvas))

    def crossover_steps(self, canvas: int = 256) -> float:
        """Steps per canvas at which diffusion and autoregression emit tokens equally fast."""
        return canvas * self.ar_token_s / self.step_s(canvas)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict) -> "Profile":
        """A profile from ``to_json``'s dict; ValueError if any figure is missing or not a positive time."""
        try:
            raw = dict(raw)
            raw["step_s_by_canvas"] = {int(k): float(v) for k, v in raw["step_s_by_canvas"].items()}
            raw["verify_s_by_length"] = {int(k): float(v) for k, v in raw.get("verify_s_by_length", {}).items()}
            profile = cls(**raw)
            figures = [*profile.step_s_by_canvas.values(), float(profile.ar_token_s), float(profile.prefill_tok_s)]
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a device profile ({type(e).__name__}: {e})") from None
        if not profile.step_s_by_canvas or not all(0 < f < float("inf") for f in figures):
            raise ValueError("not a device profile (its times must be positive)")
        return profile


def _interpolate(points_by_length: dict[int, float], length: int) -> float:
    """Linear between measured lengths; below the shortest, its value; beyond the longest, proportional."""
    points = sorted(points_by_length.items())
    if length <= points[0][0]:
        return points[0][1] * max(length, 1) / points[0][0] if len(points) == 1 else points[0][1]
    for (c0, s0), (c1, s1) in zip(points, points[1:]):
        if length <= c1:
            return s0 + (s1 - s0) * (length - c0) / (c1 - c0)
    c_last, s_last = points[-1]
    return s_last * length / c_last


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
    verify = {n: predicted_seconds(device, forward_cost(cfg, n, prefix, bits, denoise=False, logits=n), layers)
              for n in DRAFT_LENGTHS}
    ar = predicted_seconds(device, forward_cost(cfg, 1, prefix, bits, denoise=False), layers)
    prefill = predicted_seconds(device, forward_cost(cfg, prefix, 0, bits, denoise=False), layers)
    return Profile(device.name, "predicted", steps, ar, prefix / prefill, f"{bits:g}-bit", verify)


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


# ---------------------------------------------------------------------------------------------
# Measuring the current device


def device_name() -> str:
    device = mx.default_device()
    if device.type == mx.gpu and hasattr(mx, "metal") and mx.metal.is_available():
        return mx.metal.device_info().get("device_name", "Metal GPU")
    if device.type == mx.gpu:
        return "GPU"
    return f"CPU ({platform.machine()}, {platform.processor() or 'unknown'})"


def model_fingerprint(model) -> str:
    cfg = model.config
    dtype = str(model.model.decoder.norm.weight.dtype)
    # The kernels and PROFILE_VERSION: a profile measured with other kernels (or before verified
    # drafting's timings existed) is measured again.
    raw = json.dumps([asdict(cfg), dtype, str(mx.default_device()), model.kernels.name, PROFILE_VERSION],
                     sort_keys=True, default=str)
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def time_canvas(model, cache, steps: int, canvas: int, seed: int = 0) -> float:
    """Seconds for one canvas of exactly ``steps`` sampler steps (the stop rule cannot fire)."""
    from .sampler import MxRandom, denoise_canvas

    settings = SamplerSettings(steps=steps, confidence_threshold=1e-30)
    start = time.perf_counter()
    result = denoise_canvas(model, cache, settings, MxRandom(seed), canvas_length=canvas)
    mx.eval(result.tokens)
    return time.perf_counter() - start


def measure(model, prefix: int = 64, canvases=CANVAS_LENGTHS, repeats: int = 2, ar_tokens: int = 8,
            steps: int = 3, draft_lengths=DRAFT_LENGTHS) -> Profile:
    """Time real sampler steps (forward, self-conditioning, sampling) per canvas length (and per draft
    length up to the model's canvas), verifying encoder passes per draft length, AR tokens and
    prefill on this device; each figure is the best of ``repeats`` after a warm-up."""
    cfg = model.config
    ids = mx.random.randint(3, cfg.vocab_size, (1, prefix), key=mx.random.key(0))
    cache = model.make_cache()
    start = time.perf_counter()
    model.encode(ids, cache)
    mx.eval(cache.state())
    prefill_s = time.perf_counter() - start
    drafts = [n for n in draft_lengths if n <= cfg.canvas_length]
    step_s = {}
    for c in sorted(set(canvases) | set(drafts)):
        time_canvas(model, cache, 1, c)  # warm-up: kernels and buffers for this shape
        step_s[c] = min(time_canvas(model, cache, steps, c) for _ in range(repeats)) / steps
    verify_s = {}
    for n in drafts:
        time_verify(model, cache, n)
        verify_s[n] = min(time_verify(model, cache, n) for _ in range(repeats))

    def ar_run():
        ar_cache = model.make_cache()
        model.encode(ids, ar_cache)
        mx.eval(ar_cache.state())
        token = ids[:, -1:]
        start = time.perf_counter()
        for _ in range(ar_tokens):
            token = model.next_token_logits(token, ar_cache).argmax(-1, keepdims=True)
            mx.eval(token)
        return (time.perf_counter() - start) / ar_tokens

    ar_run()
    ar = min(ar_run() for _ in range(repeats))
    dtype = str(model.model.decoder.norm.weight.dtype).replace("mlx.core.", "")
    return Profile(device_name(), "measured", step_s, ar, prefix / prefill_s, dtype, verify_s)


def time_verify(model, cache, length: int) -> float:
    """Seconds for verified drafting's check: an encoder pass over ``length`` tokens, their
    next-token predictions on the host, and the cache trimmed back."""
    ids = mx.random.randint(3, model.config.vocab_size, (1, length), key=mx.random.key(length))
    start = time.perf_counter()
    predictions = model.head(model.encode(ids, cache, return_hidden=True))[0].argmax(-1)
    predictions.tolist()
    cache.trim(length)
    return time.perf_counter() - start


def profile_cache_path(model, root: Path | None = None) -> Path | None:
    """Where this machine's profile of ``model`` is cached; None without a home folder to keep it in."""
    if root is None:
        try:
            root = Path.home() / ".cache" / "mlx_dgemma" / "profiles"
        except (RuntimeError, KeyError):  # no HOME and no password entry
            return None
    return root / f"{platform.node() or 'host'}-{model_fingerprint(model)}.json"


def cached_profile(model, root: Path | None = None, refresh: bool = False) -> Profile:
    """The measured profile of this machine and model, measured once and cached on disk. A damaged
    cache file is measured again and replaced; a cache that cannot be written is said, not fatal.
    A model sharded over several ranks (distributed.py) uses rank 0's profile on every rank, so
    that all of them plan alike; they measure together, since every forward involves them all."""
    group = getattr(model, "group", None)
    lead = group is None or group.rank() == 0
    path = profile_cache_path(model, root)
    profile = _read_cached_profile(path) if lead and not refresh else None
    if group is not None:
        from .distributed import from_rank0

        if not from_rank0(profile is None, group):
            return Profile.from_json(from_rank0(profile.to_json() if lead else None, group))
    elif profile is not None:
        return profile
    if lead:
        print(f"measuring denoising steps and AR tokens on this device, once (cached in {path})", file=sys.stderr)
    profile = measure(model)
    if group is not None:
        profile = Profile.from_json(from_rank0(profile.to_json(), group))
    if not lead:
        return profile
    if path is None:
        print("no home folder to cache the device profile in; it will be measured again next time", file=sys.stderr)
        return profile
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(profile.to_json(), indent=2))
        tmp.replace(path)  # whole or not at all: a killed run leaves no truncated cache
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        print(f"cannot cache the device profile in {path} ({e.strerror or e}); it will be measured again "
              "next time", file=sys.stderr)
    return profile


def _read_cached_profile(path: Path | None) -> Profile | None:
    if path is None or not path.is_file():
        return None
    try:
        return Profile.from_json(json.loads(path.read_text()))
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) else str(e).splitlines()[0] or type(e).__name__
        print(f"ignoring the damaged device profile {path} ({reason}); measuring again", file=sys.stderr)
        return None


# ---------------------------------------------------------------------------------------------
# Plans


@dataclass
class Plan:
    """How to generate: the mode, the sampler settings every canvas and draft runs with, and the last
    canvas length, with reasons. The settings are the policy's, or with the caller's in their place
    (``overridden``); nothing else holds a copy of them."""

    policy: str
    mode: str  # "diffusion" | "ar" | "verified"
    settings: SamplerSettings
    trim_last_canvas: bool = False
    reasons: list[str] = field(default_factory=list)
    draft_length: int = 0  # verified drafting (drafting.py): canvas positions per draft, the known token included
    draft_steps: int = 0  # verified drafting: denoising steps per draft

    def explain(self) -> str:
        head = f"plan ({self.policy}): {self.mode}"
        s = self.settings
        if self.mode == "diffusion":
            head += f", ≤{s.steps} steps/canvas, entropy bound {s.entropy_bound:g}, t {s.t_min:g}–{s.t_max:g}"
            if s.freeze_after:
                head += f", positions settled for {s.freeze_after} step(s) frozen"
            head += ", last canvas trimmed to the tokens wanted" if self.trim_last_canvas else ", full canvases"
        if self.mode == "verified":
            head += f", drafts of {self.draft_length} tokens in {self.draft_steps} step(s), verified by the encoder"
        return "\n".join([head] + [f"  - {r}" for r in self.reasons])

    def overridden(self, overrides: dict) -> Plan:
        """The plan with the caller's sampler settings (``SamplerSettings`` field -> value, every one
        applied) in place of the policy's, naming those that differ from the policy's choice."""
        settings = replace(self.settings, **overrides)
        changed = [f.name for f in fields(settings) if getattr(settings, f.name) != getattr(self.settings, f.name)]
        if not changed:
            return self
        given = ", ".join(f"{name.replace('_', ' ')} {getattr(settings, name):g}" for name in changed)
        return replace(self, settings=settings, reasons=self.reasons + [f"set by the caller: {given}"])

    def last_canvas_length(self, remaining: int, canvas: int) -> int:
        """Length of a canvas when only ``remaining`` tokens are still wanted: whole canvases unless
        trimming, else rounded up to a multiple of 16 (of canvas/4 for small canvases)."""
        if not self.trim_last_canvas or remaining >= canvas:
            return canvas
        multiple = max(1, min(16, canvas // 4))
        return min(canvas, -(-remaining // multiple) * multiple)


FREEZE_AFTER = 1  # the fast policy's active-set compaction: benchmarks/demo_speed.py measures the choice


def make_plan(
    policy: str,
    gen: GenerationConfig,
    canvas: int,
    max_tokens: int,
    profile: Profile | None = None,
    expected_steps: float | None = None,
    draft_length: int | None = None,
    draft_steps: int | None = None,
    acceptance: "Acceptance | None" = None,
) -> Plan:
    """Turn a policy name, the generation config, the request and the device profile into a plan.
    ``acceptance`` is verified drafting's running estimate (the model's, see ``auto_planner``).

    ``expected_steps`` is how many steps a canvas typically takes with this model (the stop rule
    usually fires well before the limit); without it the step limit is assumed.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    reference = Plan(policy, "diffusion", SamplerSettings.from_generation_config(gen), reasons=[
        f"the checkpoint's generation config: {gen.max_denoising_steps} steps, bound {gen.entropy_bound:g}, "
        f"t {gen.t_min:g}–{gen.t_max:g}, whole canvases"])
    if policy == "reference":
        return reference
    if policy == "ar":
        return replace(reference, mode="ar", reasons=["autoregressive decoding requested (the encoder as a causal LM)"])
    if policy == "verified":
        return verified_plan(reference, canvas, profile, draft_length, draft_steps, acceptance)
    if policy == "fast":
        return replace(
            reference, settings=replace(reference.settings, freeze_after=FREEZE_AFTER, stability_threshold=0),
            trim_last_canvas=True,
            reasons=[f"positions accepted with the same token {FREEZE_AFTER} step(s) running are frozen (K/V kept) "
                     "and no longer recomputed: a step costs the share of the canvas still moving",
                     "a canvas may stop once confident (stability threshold 0): no extra step to confirm it",
                     "the last canvas is cut to the tokens still wanted (a step costs ~ canvas length when compute-bound)",
                     "measured on the demo tasks: benchmarks/demo_speed.py"],
        )
    # auto
    if profile is None:
        return replace(reference, trim_last_canvas=True, reasons=reference.reasons + ["no device profile: diffusion"])
    return AutoPlanner(gen, canvas, profile, expected_steps).choose(max_tokens)


def verified_plan(reference: Plan, canvas: int, profile: Profile | None, length: int | None, steps: int | None,
                  acceptance: "Acceptance | None" = None) -> Plan:
    """Verified drafting with the given draft length and steps, the rest chosen for ``profile``."""
    reasons = ["verified drafting: the decoder drafts, the encoder verifies and encodes the draft in one "
               "forward; the output is autoregressive decoding's"]
    if length is None or steps is None:
        if profile is None:
            best_length, best_steps = min(canvas, 32), 2
            reasons.append(f"no device profile: drafts of {best_length} in {best_steps} steps")
        else:
            acceptance = acceptance or Acceptance()
            best_length, best_steps, tok_s = best_draft(profile, acceptance, canvas, length, steps)
            reasons.append(f"{profile.device} ({profile.source}): {best_length} positions in {best_steps} step(s) "
                           f"predicted fastest, {acceptance.tokens_per_round(best_steps, best_length):.1f} tokens "
                           f"per round at {tok_s:.1f} tok/s ({acceptance.describe()})")
        length = best_length if length is None else length
        steps = best_steps if steps is None else steps
    return replace(reference, mode="verified", draft_length=length, draft_steps=steps, reasons=reasons)


# Per-draft-token acceptance of verified drafting on the demo tasks, from one and two draft steps
# (DEMO_ACCEPTANCE): a draft of 32 kept 6.3-12.2 tokens per round with one step, 10.2-23.8 with two.
PRIOR_ALPHA = {1: 0.85, 2: 0.9}


@dataclass
class Acceptance:
    """Running estimate of verified drafting's acceptance: with ``k`` draft steps, a draft token is
    kept with probability ``alpha(k)`` given that the ones before it were, so a round of L positions
    yields (1 − α^L)/(1 − α) tokens on average (the kept ones plus the encoder's next token). α is
    kept / (kept + rejections) over the rounds seen, started from a prior worth ``prior_weight``
    draft tokens; a round that ends at a stop id or at the draft's end counts its kept tokens only."""

    kept: dict[int, float] = field(default_factory=dict)
    rejected: dict[int, float] = field(default_factory=dict)
    prior_weight: float = 20.0
    prior: dict[int, float] = field(default_factory=lambda: dict(PRIOR_ALPHA))

    @classmethod
    def scaled(cls, factor: float, length: int = 32) -> "Acceptance":
        """The prior with ``factor`` times its tokens per round at drafts of ``length`` (0.5: half)."""
        base = cls()
        prior = {}
        for k in base.prior:
            target, low, high = factor * base.tokens_per_round(k, length), 0.0, 1.0 - 1e-9
            for _ in range(60):
                mid = (low + high) / 2
                low, high = (mid, high) if (1 - mid ** length) / (1 - mid) < target else (low, mid)
            prior[k] = low
        return cls(prior=prior)

    def alpha(self, steps: int) -> float:
        prior = self.prior.get(steps, self.prior[max(self.prior)])
        kept = self.kept.get(steps, 0.0) + self.prior_weight * prior
        rejected = self.rejected.get(steps, 0.0) + self.prior_weight * (1 - prior)
        return kept / (kept + rejected)

    def tokens_per_round(self, steps: int, length: int) -> float:
        a = min(self.alpha(steps), 1 - 1e-9)
        return (1 - a ** length) / (1 - a)

    def observe(self, steps: int, length: int, kept: int, rejected: bool, memory: float = 200.0) -> None:
        """A round kept ``kept`` draft tokens, then rejected one or not (a stop id, the draft's end);
        only the last ~``memory`` draft tokens count, so the estimate follows a change of task."""
        kept_total, rejected_total = self.kept.get(steps, 0.0) + kept, self.rejected.get(steps, 0.0) + rejected
        fade = min(1.0, memory / max(kept_total + rejected_total, 1e-9))
        self.kept[steps], self.rejected[steps] = kept_total * fade, rejected_total * fade

    def describe(self) -> str:
        seen = sum(self.kept.values()) + sum(self.rejected.values())
        alphas = ", ".join(f"{self.alpha(k):.2f} at {k} step(s)" for k in DRAFT_STEPS)
        return f"a draft token kept with probability {alphas}; {seen:.0f} draft tokens seen"


def best_draft(profile: Profile, acceptance: Acceptance, canvas: int, length: int | None = None,
               steps: int | None = None) -> tuple[int, int, float]:
    """(draft length, draft steps, predicted tok/s) with the most predicted tokens per second among
    the candidate lengths up to the canvas and 1-2 steps (either may be fixed by the caller)."""
    lengths = [length] if length else [n for n in DRAFT_LENGTHS if n <= canvas] or [canvas]
    options = [(profile.verified_tok_s(n, k, acceptance.tokens_per_round(k, n)), n, k)
               for n in lengths for k in ([steps] if steps else DRAFT_STEPS)]
    tok_s, n, k = max(options)
    return n, k, tok_s


# Share of canvas positions the fast policy computes per step (active-set compaction): 74 of 144 on
# the demo tasks (benchmarks/demo_speed.py).
FAST_POSITION_SHARE = 0.5
# auto expects an answer's length from this many recent answers to prompts like its own; it keeps the
# last OBSERVATIONS_KEPT of each thing it observes, and a prompt's first PROMPT_KEY ids say what it is like
ANSWERS_KEPT = 8
OBSERVATIONS_KEPT = 64
PROMPT_KEY = 256
# auto runs a plan again after this many choices without it, if predicted within this share of the best
EXPLORE_EVERY = 16
EXPLORE_WITHIN = 0.8


class AutoPlanner:
    """The auto policy: before each canvas, AR block or verified round, the plan with the most predicted
    tokens per second among reference, fast, ar and verified, from the device profile and what this
    model has done so far; the estimates are updated as it generates, so a plan that turns out slower
    than predicted is left for the next best at the next canvas or round.

    Predicted tok/s: reference = tokens per canvas / (steps per canvas · step time at the canvas);
    fast = the same at ``FAST_POSITION_SHARE`` of the canvas's positions; ar = 1 / token time;
    verified = tokens per round / (draft steps · step time at the draft length + the verifying pass),
    at the draft length and steps ``best_draft`` picks from the acceptance estimate, scaled by the
    observed ratio of tokens per round to the model's. A canvas or round gives no more tokens than the
    answer is expected still to have, from the lengths of earlier answers (those longer than what this
    one has so far; a whole canvas when none is). Each prediction times that plan's pace: the tokens
    per second it gave (commit encodes included) over what was predicted when it was chosen, which
    corrects both the profile's times and the tokens a canvas or round was expected to give.

    Answer lengths, steps per canvas (from a prior of the generation config: a quarter of the step
    limit, at least the stability threshold + 1, worth one canvas), tokens per round and pace are each
    the mean of the ~8 observations made on the prompts that begin most like this one
    (``PromptLikeMeans``: a task's instructions, a conversation's earlier turns), so one task's do not
    stand for another's. A plan not run for ``EXPLORE_EVERY`` choices but predicted within
    ``EXPLORE_WITHIN`` of the best is run once more, so estimates follow a change of task."""

    def __init__(self, gen: GenerationConfig, canvas: int, profile: Profile, expected_steps: float | None = None):
        self.gen, self.canvas, self.profile = gen, canvas, profile
        prior = expected_steps or max(gen.stability_threshold + 1, gen.max_denoising_steps / 4)
        self.steps = {"reference": PromptLikeMeans(prior), "fast": PromptLikeMeans(prior)}
        self.lengths = PromptLikeMeans(float(canvas), window=ANSWERS_KEPT)  # answer lengths
        self.acceptance = Acceptance()
        self.round_yield = PromptLikeMeans(1.0)  # observed / modelled tokens per round
        # tok/s a plan gave / tok/s predicted when it was chosen
        self.pace = {name: PromptLikeMeans(1.0) for name in ("reference", "fast", "ar", "verified")}
        self.current: Plan | None = None
        self.sampling = False  # a sampling temperature: only ar and verified decode with one
        self.idle = {name: 0 for name in self.pace}  # choices since each plan last ran
        self.chosen: tuple[str, float] | None = None  # the plan running, and its tok/s predicted before its pace

    def answers(self, prompt: list[int] | tuple[int, ...] = ()) -> list[int]:
        """Lengths of the ``ANSWERS_KEPT`` answers to the prompts that begin most like ``prompt``."""
        return [int(n) for n in self.lengths.observed(prompt)]

    def expected_tokens(self, produced: int, prompt: list[int] | tuple[int, ...] = ()) -> float:
        """Tokens an answer to ``prompt`` that has ``produced`` so far is expected still to give."""
        longer = [n - produced for n in self.answers(prompt) if n > produced]
        return sum(longer) / len(longer) if longer else float(self.canvas)

    def predictions(self, remaining: int, produced: int = 0,
                    prompt: list[int] | tuple[int, ...] = ()) -> dict[str, tuple[float, str]]:
        p, C = self.profile, self.canvas
        expected = self.expected_tokens(produced, prompt)
        tokens = min(expected, remaining, C)
        length, steps, verified = best_draft(p, self.acceptance, C)
        out = {}
        for name in ("reference", "fast"):
            positions = C if name == "reference" else max(1, round(FAST_POSITION_SHARE * C))
            n = self.steps[name].value(prompt)
            out[name] = (tokens / (n * p.step_s(positions)),
                         f"{n:.1f} steps per canvas of {positions} computed positions, {tokens:.1f} tokens per canvas")
        out["ar"] = (p.ar_tok_s, f"{p.ar_token_s * 1e3:.2f} ms per token")
        modelled = self.acceptance.tokens_per_round(steps, length)
        per_round = min(modelled * self.round_yield.value(prompt), max(1.0, expected), remaining)
        out["verified"] = (verified * per_round / modelled,
                           f"drafts of {length} in {steps} step(s), {per_round:.1f} tokens per round "
                           f"({self.acceptance.describe()})")
        paces = {name: self.pace[name].value(prompt) for name in out}
        return {name: (tok_s * paces[name], why + (f", x{paces[name]:.2f} as observed"
                                                   if self.pace[name].observed(prompt) else ""))
                for name, (tok_s, why) in out.items()}

    def choose(self, remaining: int, overrides: dict | None = None, produced: int = 0,
               prompt: list[int] | tuple[int, ...] = ()) -> Plan:
        """The next plan for an answer to ``prompt`` that has ``produced`` tokens and room for
        ``remaining`` more, with the caller's sampler ``overrides`` (``Plan.overridden``) applied."""
        predicted = self.predictions(remaining, produced, prompt)
        if self.sampling:
            predicted = {name: predicted[name] for name in ("ar", "verified")}
        best = max(predicted, key=lambda name: predicted[name][0])
        # Estimates of a plan that does not run do not move: one close enough to the best is run again
        # now and then, so a change of task (or a wrong prior) cannot keep auto on a worse plan.
        stale = [name for name in predicted if self.idle[name] >= EXPLORE_EVERY
                 and predicted[name][0] >= EXPLORE_WITHIN * predicted[best][0]]
        retry = max(stale, key=lambda name: predicted[name][0]) if stale else None
        for name in self.idle:
            self.idle[name] += 1
        best = retry or best
        self.idle[best] = 0
        self.chosen = best, predicted[best][0] / self.pace[best].value(prompt)
        plan = make_plan(best, self.gen, self.canvas, remaining, self.profile)
        if best == "verified":
            plan = verified_plan(plan, self.canvas, self.profile, None, None, self.acceptance)
        reasons = [f"{self.profile.device} ({self.profile.source}), predicted tok/s:"]
        reasons += [f"{name}: {tok_s:.1f} ({why})" for name, (tok_s, why) in
                    sorted(predicted.items(), key=lambda item: -item[1][0])]
        reasons.append(f"→ {best}" + (f" (not run for {EXPLORE_EVERY}+ choices and predicted within "
                                      f"{1 / EXPLORE_WITHIN:.1f}x of the best: run again to check)" if retry else "")
                       + "; re-chosen at every canvas or round as the estimates move")
        self.current = replace(plan, policy="auto", reasons=reasons).overridden(overrides or {})
        return self.current

    def observe_canvas(self, policy: str, steps: int, length: int, seconds: float | None = None,
                       tokens: int | None = None, prompt: list[int] | tuple[int, ...] = ()) -> None:
        """A canvas of ``length`` positions took ``steps`` steps and gave ``tokens`` in ``seconds``."""
        self.steps[policy].add(steps, prompt)
        self._pace(policy, tokens, seconds, prompt)

    def observe_ar(self, tokens: int, seconds: float | None = None, prompt: list[int] | tuple[int, ...] = ()) -> None:
        self._pace("ar", tokens, seconds, prompt)

    def observe_round(self, length: int, steps: int, kept: int, rejected: bool, tokens: int,
                      seconds: float | None = None, final: bool = False,
                      prompt: list[int] | tuple[int, ...] = ()) -> None:
        """A verified round; ``final``: it ended the answer (its tokens say how long the answer was,
        not how well drafts are accepted)."""
        modelled = self.acceptance.tokens_per_round(steps, length)
        self.acceptance.observe(steps, length, kept, rejected)
        if not final:
            self.round_yield.add(tokens / modelled, prompt)
        self._pace("verified", tokens, seconds, prompt)

    def observe_answer(self, tokens: int, prompt: list[int] | tuple[int, ...] = ()) -> None:
        """An answer to ``prompt`` ended after ``tokens`` tokens."""
        self.lengths.add(tokens, prompt)

    def _pace(self, name: str, tokens: int | None, seconds: float | None, prompt) -> None:
        if tokens is None or not seconds or self.chosen is None or self.chosen[0] != name:
            return
        self.pace[name].add(min(4.0, max(0.25, tokens / seconds / self.chosen[1])), prompt)


class PromptLikeMeans:
    """One quantity observed along with the prompt each observation came from, estimated from the
    ``window`` observations on the prompts that share the longest beginnings with the one at hand (the
    same instructions, a conversation's earlier turns; the latest when none shares more than the
    template), after a prior worth one observation until there are ``window``. A new kind of prompt
    starts from what the others gave and takes over the estimate as its own observations come in."""

    def __init__(self, prior: float, window: int = 8):
        self.prior, self.window = prior, window
        self.records: deque[tuple[tuple[int, ...], float]] = deque(maxlen=OBSERVATIONS_KEPT)
        self._observed: dict[tuple[int, ...], list[float]] = {}  # per prompt key, until the next observation

    def add(self, value: float, prompt: list[int] | tuple[int, ...] = ()) -> None:
        self.records.append((tuple(prompt[:PROMPT_KEY]), value))
        self._observed.clear()

    def observed(self, prompt: list[int] | tuple[int, ...] = ()) -> list[float]:
        """The ``window`` observations on the prompts that share the longest beginnings with ``prompt``
        (the latest first among equals), oldest first."""
        key = tuple(prompt[:PROMPT_KEY])
        if key not in self._observed:
            shared = [_common_prefix(key, past) for past, _ in self.records]
            nearest = sorted(range(len(shared)), key=lambda i: (shared[i], i), reverse=True)[: self.window]
            self._observed[key] = [self.records[i][1] for i in sorted(nearest)]
        return self._observed[key]

    def value(self, prompt: list[int] | tuple[int, ...] = ()) -> float:
        seen = self.observed(prompt)
        if len(seen) >= self.window:
            return sum(seen) / len(seen)
        return (self.prior + sum(seen)) / (1 + len(seen))


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def auto_planner(model, gen: GenerationConfig, profile: Profile) -> AutoPlanner:
    """This model's planner for ``profile``, kept across generations so that what one generation saw
    informs the next."""
    planner = getattr(model, "_auto_planner", None)
    if planner is None or planner.profile != profile:
        planner = AutoPlanner(gen, model.config.canvas_length, profile)
        model._auto_planner = planner
    return planner
